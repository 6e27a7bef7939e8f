"""Reinforcement learning of the policies in simulation (issue 31): see embodyhpc/rl/README in the module docstrings."""
