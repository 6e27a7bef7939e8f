"""The demo chains the closed-loop tests share (tests/conftest.py builds each once per test run):

- the demonstrations: MetaWorld expert episodes of the four demo tasks, as `make demo` makes them (20 per task
  instead of 25, 32 px), read by the pi0.5 and the GR00T demo recipes alike;
- the pi0.5 demo run: `embodyhpc submit recipes/demo_metaworld_cpu.yaml --local` on them, the recipe as shipped
  (600 steps on 2 processes, evaluations of steps 200 and 400 beside training, the final one with the expert and
  random rows) but for fewer evaluation episodes (6 per task, 2 shards). The claim, the evaluations while training,
  `eval --ckpt` and the logged model are checked on this one run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import run_dir_from

TASKS = "reach-v3,button-press-topdown-v3,drawer-open-v3,door-open-v3"
PI05_DEMO = "recipes/demo_metaworld_cpu.yaml"
GROOT_DEMO = "recipes/demo_groot_metaworld_cpu.yaml"
PI05_EPISODES_PER_TASK = 6


def embodyhpc(*args: str, ok: bool = True, timeout_s: float = 3600) -> subprocess.CompletedProcess:
    """The installed command line in its own process, as `make demo` runs it."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    result = subprocess.run([sys.executable, "-m", "embodyhpc.cli.main", *args], capture_output=True, text=True,
                            env=env, timeout=timeout_s)
    if ok:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def synth_demos(out: Path) -> None:
    embodyhpc("data", "synth", "--out", str(out / "metaworld-mt4"), "--tasks", TASKS, "--episodes", "20",
              "--image-size", "32", "--workers", "2")


def run_pi05_demo(out: Path, demos: Path) -> None:
    """The run's folder is recorded in `out/run_dir`."""
    result = embodyhpc("submit", PI05_DEMO, "--local", "--json", f"job.runs_root={out / 'runs'}", f"data.root={demos}",
                       f"eval.episodes_per_task={PI05_EPISODES_PER_TASK}", "eval.shards=2")
    (out / "run_dir").write_text(str(run_dir_from(result.stdout)))
