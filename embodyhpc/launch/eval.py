"""The evaluation array's entry point: one call per shard of the (task, seed, episode) grid.

Until the simulator suites land, a shard records the episodes it owns (`"simulated": false`)
against the trained weights it would load; the chain, sharding and aggregation are real.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict
from pathlib import Path

from embodyhpc.config.load import load_resolved
from embodyhpc.eval.shards import plan_shards
from embodyhpc.launch.train import RESULT_FILE


def shard_file(run_dir: Path, shard: int) -> Path:
    return run_dir / "eval" / f"shard-{shard:04d}.jsonl"


def eval_shard_task(run_dir: str, shard: int) -> dict:
    config = load_resolved(run_dir)
    ev = config.eval
    episodes = plan_shards(list(ev.tasks), list(ev.seeds), ev.episodes_per_task, ev.shards)[shard]
    trained = Path(run_dir) / RESULT_FILE
    if not trained.is_file():
        raise FileNotFoundError(f"no training result at {trained}: evaluation runs only after training")
    out = shard_file(Path(run_dir), shard)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        for episode in episodes:
            record = {**asdict(episode), "shard": shard, "suite": ev.suite, "simulated": False,
                      "host": socket.gethostname()}
            f.write(json.dumps(record) + "\n")
    tmp.replace(out)  # a shard file exists only when complete
    return {"shard": shard, "episodes": len(episodes), "file": str(out)}
