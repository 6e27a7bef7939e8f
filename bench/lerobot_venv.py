"""The LeRobot venv the baseline benches run in (bench/data_loader.py, bench/closed_loop_vs_act.py).

lerobot 0.4.4 (the newest for Python 3.11) pins torch < 2.11 and pulls a CUDA build: an ~8 GB venv and minutes
of install, so it is built only on request (`--build-lerobot-venv PATH`) and used only when named
(`--lerobot-venv PATH`). Code runs in it as a subprocess of the bench, offline (no hub access, a private HF_HOME).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

LEROBOT_REQUIREMENT = "lerobot==0.4.4"


def build_lerobot_venv(venv: Path, extra: Sequence[str] = ()) -> None:
    """`python3 -m venv PATH` (unless it exists), then `pip install lerobot==0.4.4 *extra` into it."""
    if (venv / "bin" / "python").exists():
        print(f"# {venv} exists; installing {' '.join([LEROBOT_REQUIREMENT, *extra])} into it (no-op if present)",
              flush=True)
    else:
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", LEROBOT_REQUIREMENT, *extra], check=True)


def offline_env(hf_home: Path) -> dict[str, str]:
    """os.environ for a LeRobot subprocess: Hugging Face hub and datasets offline, HF_HOME under the bench's dir."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(hf_home)}
