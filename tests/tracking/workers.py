"""Functions run in other processes (multiprocessing spawn imports them by module name)."""

from __future__ import annotations

import os
import time

os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"


def init_store_when_told(uri: str, ready, go, results) -> None:
    """Import mlflow, say ready, wait for `go`, call init_store, report the time it returned (or the error)."""
    import mlflow.db  # noqa: F401  (imports take seconds: done before the race starts)
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401

    from embodyhpc.tracking.mlflow_run import init_store

    ready.put(os.getpid())
    go.wait(120)
    try:
        init_store(uri)
        results.put(("ok", time.time()))
    except BaseException as exc:  # the parent asserts on it
        results.put(("error", repr(exc)))


def log_child_main(argv: list[str]) -> None:
    """`python -m tests.tracking.workers URI PARENT_RUN_ID STEP FILE DIR`: the report job's call, printed as JSON."""
    import json

    from embodyhpc.tracking.mlflow_run import log_child_run

    uri, parent, step, plot, videos = argv
    run_id = log_child_run(uri, parent, run_name="eval-report", metrics={"success_rate": 0.75, "episodes": 8.0},
                           step=int(step), params={"eval": {"suite": "metaworld", "tasks": ["reach-v3"]}},
                           tags={"kind": "eval"}, artifacts=[(plot, "plots"), (videos, "videos")])
    print(json.dumps({"run_id": run_id, "pid": os.getpid()}))


if __name__ == "__main__":
    import sys

    log_child_main(sys.argv[1:])
