"""embodyhpc: robot-policy training recipes to results on Slurm GPU clusters."""

__version__ = "0.1.0"
