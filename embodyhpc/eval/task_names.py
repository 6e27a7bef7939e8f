"""The task names, cameras and action sizes of the shipped suites, without importing a simulator: `validate` checks
eval.tasks against them (an unknown task would otherwise fail the evaluation array after hours of training), and
`eval --ckpt` checks that the suite renders every camera the weights were trained on and takes actions of their size
(embodyhpc.eval.policy_files). A test compares these lists with the simulators' own (tests/eval/test_task_names.py).
Suites a site registers are checked when their factory lists them (`task_names`, `camera_names` and `action_dim`
attributes, eval/suites.py); LIBERO task file names are checked by the suite (they need the libero package)."""

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

METAWORLD_CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
SUITE_CAMERAS = {"metaworld": METAWORLD_CAMERAS, "pusht": ("top",), "libero": ("image", "image2", "wrist_image")}
"""The camera names each shipped suite renders as observation.images.<name> (MetaWorld: every task's model has
these; LIBERO: image = agentview, image2 and wrist_image = the wrist camera)."""
SUITE_ACTION_DIMS = {"metaworld": 4, "pusht": 2, "libero": 7}
"""The size of the action every task of a shipped suite takes."""


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


def suite_cameras(suite: str) -> tuple[str, ...] | None:
    """The camera names `suite` renders; None when a registered suite does not list them (`camera_names`)."""
    if suite in SUITE_CAMERAS:
        return SUITE_CAMERAS[suite]
    return _registered(suite, "camera_names", lambda names: tuple(str(n) for n in names))


def suite_action_dim(suite: str) -> int | None:
    """The action size every task of `suite` takes; None when a registered suite does not say (`action_dim`)."""
    if suite in SUITE_ACTION_DIMS:
        return SUITE_ACTION_DIMS[suite]
    return _registered(suite, "action_dim", int)


def _registered(suite: str, attribute: str, convert):
    from embodyhpc.eval.suites import suite_factory

    try:
        value = getattr(suite_factory(suite), attribute, None)
    except ValueError:  # not registered: eval.suite's own check names it
        return None
    try:
        value = value() if callable(value) else value
        return None if value is None else convert(value)
    except (TypeError, ValueError):  # e.g. an instance property: not a statement about the suite
        return None
