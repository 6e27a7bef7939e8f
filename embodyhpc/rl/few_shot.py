"""The few-shot supervised policy RL starts from on this machine (issue 31's proof): 20 reach-v3 demonstrations
(seed 0) and a tiny pi0.5 trained on them by the demo recipe's own SFT path for 150 steps, a policy clearly below
success 1 on held-out goals. tests/rl/test_rl_closed_loop.py and bench/rl_async.py both start from it; GR00T's
(family="groot": the GR00T demo recipe, the same demonstrations, steps and overrides) is what
tests/rl/test_groot_rl.py starts recipes/rl_groot_metaworld_cpu.yaml from.

    export, demos = build_few_shot_sft(out, submit)                    # pi0.5
    export, demos = build_few_shot_sft(out, submit, family="groot")    # GR00T

`submit(*args)` runs `embodyhpc <args>` (each caller's own way of running the command line) and returns its
standard output; the SFT run is `embodyhpc submit recipes/demo_metaworld_cpu.yaml --local --json ...`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

SFT_RECIPE = "recipes/demo_metaworld_cpu.yaml"
SFT_RECIPES = {"pi05": SFT_RECIPE, "groot": "recipes/demo_groot_metaworld_cpu.yaml"}
TASK = "reach-v3"
DEMO_EPISODES = 20
DEMO_SEED = 0
SFT_STEPS = 150


def sft_overrides(runs_root: Path, demos: Path) -> list[str]:
    """The demo recipe's overrides that make it the few-shot SFT run (no evaluation: callers evaluate)."""
    return [f"job.runs_root={runs_root}", f"data.root={demos}", f"train.steps={SFT_STEPS}", "train.warmup_steps=20",
            "eval.enabled=false", f"eval.tasks=[{TASK}]", "resources.nodes=1", "checkpoint.every_steps=1000"]


def build_few_shot_sft(out: Path, submit: Callable[..., str], *, family: str = "pi05") -> tuple[Path, Path]:
    """Demonstrations in <out>/reach and the SFT run under <out>; (its export folder, the demonstrations)."""
    from embodyhpc.sim.metaworld import generate_demos

    if family not in SFT_RECIPES:
        raise ValueError(f"no few-shot SFT recipe for model family {family!r}; one of {', '.join(SFT_RECIPES)}")

    os.environ.setdefault("MUJOCO_GL", "egl")
    out = Path(out)
    demos = out / "reach"
    generate_demos(demos, tasks=[TASK], episodes_per_task=DEMO_EPISODES, seed=DEMO_SEED, image_size=32,
                   progress=False)
    stdout = submit("submit", SFT_RECIPES[family], "--local", "--json", *sft_overrides(out, demos))
    return Path(json.loads(stdout)["run_dir"]) / "export", demos
