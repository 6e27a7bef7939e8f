"""The checks of `embodyhpc data` options, run before anything is simulated or written: every bad value is a one-line
UserError naming the option and the fix (exit 2). And `no_half_made`: a recording that fails leaves nothing behind.

Limits chosen where the simulators take any number (an experienced user's mistake, not a dataset anyone records):
episodes per task up to 100000 (and 1000000 in all: the plan and meta/episodes hold a row per episode in memory;
each episode is seconds of simulation), images up to 1024 px (an episode's frames are held in memory until it is
written: 500 steps of 1024x1024 RGB are 1.5 GB per camera), steps up to 10000 (MetaWorld stops at 500, LIBERO's
longest task at 520), seeds 0..2**31-1 (numpy seeds MetaWorld's goals with seed + episode // 50, below 2**32).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

MAX_EPISODES_PER_TASK = 100_000
MAX_EPISODES = 1_000_000
MAX_IMAGE_SIZE = 1024
MAX_STEPS = 10_000
MAX_SEED = 2**31 - 1
_SUITE_LABELS = {"metaworld": "MetaWorld", "libero": "LIBERO", "pusht": "PushT"}
_TASK_EXAMPLES = {"metaworld": "reach-v3,push-v3 or MT10", "libero": "libero_spatial/0", "pusht": "pusht"}


@dataclass
class SynthRequest:
    """`data synth` options once checked: what the recording gets."""

    out: Path
    tasks: list[str]
    cameras: list[str]
    options: dict[str, int | str]
    workers: int
    metaworld_expert: bool
    """MetaWorld's scripted experts through embodyhpc.sim.metaworld (parallel workers); else the suite's recorder."""
    warnings: list[str] = field(default_factory=list)


def _error(message: str, option: str, fix: str | None = None) -> Exception:
    from embodyhpc.errors import UserError

    return UserError(message, key=option, fix=fix)


def _suggestion(word: str, choices: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _in_range(option: str, value: int, low: int, high: int, fix: str | None = None) -> None:
    if not low <= value <= high:
        raise _error(f"must be >= {low} and <= {high}, got {value}", option, fix or f"use {low} to {high}")


def _names(text: str, option: str, what: str) -> list[str]:
    """The comma-separated names of an option: none empty, none twice, printable."""
    if not text.isprintable():
        raise _error(f"{text!r} holds a control character", option, f"separate {what} names with commas only")
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise _error(f"{text!r} names no {what}", option, f"name {what}s separated by commas, e.g. {option} a,b")
    if "" in names:
        raise _error(f"{text!r} has an empty {what} name", option, "separate names with single commas, no trailing one")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _error(f"{', '.join(map(repr, twice))} named more than once", option, f"name each {what} once")
    return names


def _task_list(env: str, tasks: str | None, episodes: int) -> list[str]:
    from embodyhpc.eval.task_names import METAWORLD_TASKS, unknown_task

    if tasks is None:
        if env == "metaworld":
            from embodyhpc.sim.metaworld import MT10_TASKS

            return list(MT10_TASKS[:4])
        raise _error("name the tasks to record", "--tasks", f"e.g. --tasks {_TASK_EXAMPLES.get(env, 'TASK')}")
    if not tasks.strip():
        raise _error("names no task", "--tasks", "name the tasks, e.g. --tasks "
                     f"{_TASK_EXAMPLES.get(env, 'TASK')}" + (" (or leave --tasks out: 4 MT10 tasks)"
                                                             if env == "metaworld" else ""))
    names = _names(tasks, "--tasks", "task")
    unknown = [t for t in names if unknown_task(env, [t]) is not None]
    if unknown:
        accepted = unknown_task(env, unknown[:1])[1]  # type: ignore[index]
        raise _error(f"unknown {_SUITE_LABELS.get(env, env)} tasks {unknown}{_suggestion(unknown[0], accepted)}",
                     "--tasks", f"choose from: {', '.join(accepted)}")
    if env == "metaworld":  # the suite's groups, expanded here: the expert path takes task names
        from embodyhpc.sim.metaworld import MT10_TASKS

        groups = {"MT10": list(MT10_TASKS), "MT50": list(METAWORLD_TASKS)}
        expanded = [task for name in names for task in groups.get(name.upper(), [name])]
        twice = sorted({t for t in expanded if expanded.count(t) > 1})
        if twice:
            raise _error(f"{', '.join(twice[:3])}{' ...' if len(twice) > 3 else ''} named more than once (a group, "
                         "MT10 or MT50, names each of its tasks)", "--tasks", "name each task once")
        names = expanded
    if len(names) * episodes > MAX_EPISODES:
        raise _error(f"{len(names)} tasks x {episodes} episodes is more than {MAX_EPISODES} episodes", "--episodes",
                     "record fewer episodes per task, or the tasks in several datasets")
    return names


def _camera_list(env: str, cameras: str | None) -> list[str]:
    if cameras is None:
        return ["corner"] if env == "metaworld" else []
    if not cameras.strip():
        return []  # state only
    from embodyhpc.eval.task_names import suite_cameras

    names = _names(cameras, "--cameras", "camera")
    known = suite_cameras(env)  # None: a registered suite that does not list them checks them when made
    unknown = [c for c in names if known is not None and c not in known]
    if unknown:
        raise _error(f"unknown {_SUITE_LABELS.get(env, env)} camera {unknown[0]!r}"
                     f"{_suggestion(unknown[0], list(known or ()))}", "--cameras",
                     f"choose from: {', '.join(known or ())}; or --cameras '' for state only")
    return names


def _suite_options(env: str, options: list[str]) -> dict[str, int | str]:
    from embodyhpc.eval.suites import suite_option_names

    known = suite_option_names(env)
    parsed: dict[str, int | str] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep or key not in known:
            raise _error(f"{item!r} is not an option of the {env} suite", "--option",
                         f"use KEY=VALUE with KEY one of {', '.join(known) or 'none'}")
        if key in parsed:
            raise _error(f"{key} given more than once", "--option", f"give {key}=VALUE once")
        if not value.strip() or not value.isprintable():
            raise _error(f"{item!r} has {'no value' if not value.strip() else 'a control character'}", "--option",
                         f"write {key}=VALUE")
        parsed[key] = int(value) if re.fullmatch(r"[+-]?\d+", value) else value
    return parsed


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # what Slurm's cgroup or taskset gave this process
    except AttributeError:
        return os.cpu_count() or 1


def check_synth(*, out: str, env: str, tasks: str | None, episodes: int, image_size: int, seed: int,
                cameras: str | None, workers: int, policy: str, max_steps: int, options: list[str],
                overwrite: bool) -> SynthRequest:
    """Every `data synth` option, checked without simulating or writing anything (see the module doc)."""
    from embodyhpc.data.output_dir import check_output_dir
    from embodyhpc.eval.references import reference_policy_names
    from embodyhpc.eval.suites import available_suites

    suites = available_suites()
    if env not in suites:
        raise _error(f"unknown simulator {env!r}{_suggestion(env, suites)}", "--env", f"use one of {', '.join(suites)}")
    policies = reference_policy_names()
    if policy not in policies:
        raise _error(f"unknown policy {policy!r}{_suggestion(policy, policies)}", "--policy",
                     f"use one of: {', '.join(policies)}")
    _in_range("--episodes", episodes, 1, MAX_EPISODES_PER_TASK)
    if not 2 <= image_size <= MAX_IMAGE_SIZE or image_size % 2:
        raise _error(f"must be an even number of pixels from 2 to {MAX_IMAGE_SIZE} (yuv420p video halves each side "
                     f"for colour), got {image_size}", "--image-size",
                     f"use {image_size + 1}" if 2 < image_size < MAX_IMAGE_SIZE else
                     "use e.g. 64 (the default), 96, 128 or 224")
    _in_range("--seed", seed, 0, MAX_SEED)
    _in_range("--max-steps", max_steps, 0, MAX_STEPS, f"use 1 to {MAX_STEPS}, or 0 for the suite's own limit")
    if workers < 1:
        raise _error(f"must be >= 1, got {workers}", "--workers", "use 1 (one process) or more")
    task_list = _task_list(env, tasks, episodes)
    camera_list = _camera_list(env, cameras)
    parsed = _suite_options(env, options)
    check_output_dir(out, overwrite=overwrite, key="--out")
    request = SynthRequest(out=Path(out), tasks=task_list, cameras=camera_list, options=parsed, workers=workers,
                           metaworld_expert=env == "metaworld" and policy == "expert" and not parsed and not max_steps)
    if workers > 1 and not request.metaworld_expert:
        request.warnings.append(f"--workers {workers} is ignored: only metaworld expert demonstrations (no --option, "
                                "no --max-steps) roll out in parallel; recording in this process")
        request.workers = 1
    elif workers > _usable_cpus():
        request.warnings.append(f"--workers {workers} is more than the {_usable_cpus()} CPUs this process may use: "
                                f"using {_usable_cpus()}")
        request.workers = _usable_cpus()
    return request


@contextmanager
def no_half_made(out: Path) -> Iterator[None]:
    """If the body fails (Ctrl-C included), remove what it made: the dataset folder while it holds the writer's
    unfinished marker (or, for a folder that was empty before, what the writer put in it) and the parent folders it
    created. A folder that held anything before is left alone (--overwrite writes beside it and aborts cleanly)."""
    from embodyhpc.data.output_dir import WRITING_MARKER

    root = Path(os.path.abspath(out))
    made = [p for p in (root, *root.parents) if not os.path.lexists(p)]  # the deepest first
    was_empty = root.is_dir() and not root.is_symlink() and not any(root.iterdir())
    try:
        yield
    except BaseException:
        if (made[:1] == [root] or was_empty) and (root / WRITING_MARKER).is_file():
            for entry in list(root.iterdir()) if was_empty else [root]:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        for folder in made[1:] if made[:1] == [root] else made:
            try:
                folder.rmdir()  # only while empty: something another process put there stays
            except OSError:
                break
        raise


def check_info_path(path: str) -> Path:
    """`data info PATH`: refuse an empty path (it would mean the current folder) and show a path with control
    characters as it really is."""
    if not path.strip():
        raise _error("empty path", "PATH", "name a LeRobot v3.0 dataset folder or an HDF5 file")
    if not path.isprintable() and not os.path.lexists(path):
        raise _error(f"{path!r} does not exist (it holds a control character: a newline or tab from a script?)",
                     "PATH", "name a LeRobot v3.0 dataset folder or an HDF5 file")
    return Path(path)
