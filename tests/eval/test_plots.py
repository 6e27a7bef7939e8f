"""Report plots are written as non-empty PNG files, for complete and incomplete reports."""

from __future__ import annotations

import pytest

from tests.helpers import require

require("matplotlib", "track")

from embodyhpc.eval.aggregate import aggregate  # noqa: E402
from embodyhpc.eval.plots import plot_success_vs_step, plot_task_bars  # noqa: E402
from embodyhpc.eval.shards import all_episodes  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def report(drop_last: bool):
    plan = all_episodes(["reach-v3", "push-v3", "door-open-v3"], [0], 6)
    records = [{"policy": policy, "task": e.task, "seed": e.seed, "episode": e.episode,
                "success": (e.episode + offset) % 3 != 0, "return": 1.0, "length": 50}
               for policy, offset in (("trained", 0), ("expert", 1), ("random", 2)) for e in plan]
    return aggregate(records[:-3] if drop_last else records, plan)


@pytest.mark.parametrize("drop_last", [False, True])
def test_task_bars(tmp_path, drop_last):
    path = plot_task_bars(report(drop_last), tmp_path / "plots" / "tasks.png")
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 5000
    assert not list(path.parent.glob("*.tmp.png"))


def test_success_vs_step(tmp_path):
    points = [(3000, 0.6, 0.31, 0.83), (1000, 0.1, 0.02, 0.4), (2000, 0.3, 0.1, 0.6)]
    path = plot_success_vs_step(points, tmp_path / "curve.png", references={"expert": 0.98, "random": 0.0})
    assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5000
    # before the first checkpoint was evaluated, and a one-checkpoint evaluation: no single-dot "curve"
    assert plot_success_vs_step([], tmp_path / "empty.png") is None
    assert plot_success_vs_step(points[:1], tmp_path / "one.png", references={"expert": 0.98}) is None
    assert not (tmp_path / "empty.png").exists() and not (tmp_path / "one.png").exists()
