"""The task names of the shipped suites, without importing a simulator: `validate` checks eval.tasks against them
(an unknown task would otherwise fail the evaluation array after hours of training). A test compares these lists
with the simulators' own (tests/eval/test_task_names.py). Suites a site registers are checked when their factory
lists its names (a `task_names` attribute, eval/suites.py suite_task_names); LIBERO task file names are checked by
the suite (they need the libero package)."""

from __future__ import annotations

METAWORLD_TASKS = (
    "assembly-v3", "basketball-v3", "bin-picking-v3", "box-close-v3", "button-press-topdown-v3",
    "button-press-topdown-wall-v3", "button-press-v3", "button-press-wall-v3", "coffee-button-v3", "coffee-pull-v3",
    "coffee-push-v3", "dial-turn-v3", "disassemble-v3", "door-close-v3", "door-lock-v3", "door-open-v3",
    "door-unlock-v3", "drawer-close-v3", "drawer-open-v3", "faucet-close-v3", "faucet-open-v3", "hammer-v3",
    "hand-insert-v3", "handle-press-side-v3", "handle-press-v3", "handle-pull-side-v3", "handle-pull-v3",
    "lever-pull-v3", "peg-insert-side-v3", "peg-unplug-side-v3", "pick-out-of-hole-v3", "pick-place-v3",
    "pick-place-wall-v3", "plate-slide-back-side-v3", "plate-slide-back-v3", "plate-slide-side-v3", "plate-slide-v3",
    "push-back-v3", "push-v3", "push-wall-v3", "reach-v3", "reach-wall-v3", "shelf-place-v3", "soccer-v3",
    "stick-pull-v3", "stick-push-v3", "sweep-into-v3", "sweep-v3", "window-close-v3", "window-open-v3",
)
METAWORLD_GROUPS = ("MT10", "MT50")
PUSHT_TASKS = ("pusht", "pusht-v0", "gym_pusht/pusht-v0")  # compared case-insensitively, as the suite does
LIBERO_BENCHMARKS = {"libero_spatial": 10, "libero_object": 10, "libero_goal": 10, "libero_10": 10, "libero_90": 90}
"""Tasks per LIBERO benchmark; "libero" means the first four (the suites the field reports)."""


def unknown_task(suite: str, tasks: list[str]) -> tuple[str, list[str]] | None:
    """(the first unknown task, the names the suite accepts), or None when every task is known or the suite's
    names are not listed here."""
    if suite == "metaworld":
        accepted = [*METAWORLD_GROUPS, *METAWORLD_TASKS]
        known = {*METAWORLD_TASKS, *(g.upper() for g in METAWORLD_GROUPS)}
        bad = next((t for t in tasks if t not in known and t.upper() not in METAWORLD_GROUPS), None)
    elif suite == "pusht":
        accepted = list(PUSHT_TASKS)
        bad = next((t for t in tasks if t.lower() not in PUSHT_TASKS), None)
    elif suite == "libero":
        accepted = ["libero", *LIBERO_BENCHMARKS, "<benchmark>/<index or task file name>"]
        bad = next((t for t in tasks if not _libero_task(t)), None)
    else:  # a registered suite: checked when its factory lists its names (eval.suites.suite_task_names)
        from embodyhpc.eval.suites import suite_task_names

        try:
            names = suite_task_names(suite)
        except ValueError:  # not registered: eval.suite's own check names it
            return None
        if names is None:
            return None
        accepted = names
        bad = next((t for t in tasks if t not in names), None)
    return (bad, accepted) if bad is not None else None


def _libero_task(task: str) -> bool:
    bench, slash, which = task.strip().lower().partition("/")
    if not slash:
        return bench == "libero" or bench in LIBERO_BENCHMARKS
    if bench not in LIBERO_BENCHMARKS or not which:
        return False
    return int(which) < LIBERO_BENCHMARKS[bench] if which.isdigit() else True  # names: checked by the suite
