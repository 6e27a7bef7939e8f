"""Orchestration: which jobs a run has and in what order, and starting them on a backend.

    plan            the chain as data (JobSpec: kind, task by import name, dependency, array size); chain_kinds
    api             start_run (fill a run directory), run_chain (hand its plan to a backend), submit_smoke, cancel
    backend_slurm   executes a plan through submitit's Slurm executor (embodyhpc.slurm renders and submits)
    backend_local   executes the same plan on this machine (submitit's local executor), one job after another

Tasks are resolved by their import name when a job starts, so nothing here imports job code (embodyhpc.launch):
job code may call this package (an evaluation while training starts its chain through `api`), never the other way.
"""
