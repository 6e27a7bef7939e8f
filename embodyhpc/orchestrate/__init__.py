"""Orchestration: which jobs a run has and in what order, and starting them on a backend.

    plan            the chain as data: Plan of Jobs, each its JobSpec (task by import name, dependencies, array),
                    JobShape (resources, environment, command) and script, computed once (chain_plan, kind_plan)
    api             Backend (submit a plan, poll, cancel) and BACKENDS; start_run, run_chain, submit_smoke,
                    cancel_run; dry_run (the one dry run: submit --dry-run and resume --dry-run)
    backend_slurm   SlurmBackend: the plan's scripts through submitit's Slurm executor (embodyhpc.slurm submits)
    backend_local   LocalBackend: the same plan on this machine (submitit's local executor), one job after another

Tasks are resolved by their import name when a job starts, so nothing here imports job code (embodyhpc.launch):
job code may call this package (an evaluation while training starts its chain through `api`), never the other way.
"""
