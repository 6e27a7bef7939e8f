"""GR00T through the same RL protocol as pi0.5 (issue 31: "both model families"), end to end on this machine.

The supervised start: embodyhpc.rl.few_shot with family="groot" (the GR00T demo recipe's own SFT path, 150 steps on
20 reach-v3 demonstrations). Then `embodyhpc submit recipes/rl_groot_metaworld_cpu.yaml --local` (GRPO,
asynchronous, the three roles as local processes) for a few versions, then `embodyhpc resume` for two more. What
must hold: the versions advance and the run completes, the metrics reach MLflow under the training run's prefix,
the resume continues the version counter from the actor's checkpoint, and the rollout worker samples with the
actor's whole policy: GR00T trains only its action head, so its frozen VLM must come from model.init_weights on
both sides (version 1's samples are all version 0's, scored by the actor's version 0: importance weight 1, KL 0).
And the actor scores chunks without dropout (GR00T-N1.5's action head has 0.2 at full size).

Learning (held-out success up with non-overlapping Wilson intervals) is pi0.5's proof in CI (test_rl_closed_loop.py);
GR00T's was measured outside it (a 300-step start, 20 versions at the recipe's lr 1e-5: about 8 minutes here, the
README's RL section has the numbers).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_dir_from
from tests.launch.demo import embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim, pytest.mark.xdist_group("rl-groot")]  # its fixtures once

ITERATIONS, RESUMED_TO = 3, 5
METRICS = ("env/success_once", "env/return", "rl/staleness_max", "time/actor_s", "time/sync_s", "rl/samples_per_s",
           "loss/policy", "loss/approx_kl", "rl/version")


def _sft(out: Path) -> None:
    from embodyhpc.rl.few_shot import build_few_shot_sft

    export, _ = build_few_shot_sft(out, lambda *args: embodyhpc(*args).stdout, family="groot")
    (out / "run_dir").write_text(str(export.parent))


@pytest.fixture(scope="module")
def groot_sft(tmp_path_factory) -> Path:
    from tests.artifacts import build_once

    return build_once(tmp_path_factory, "rl-groot-sft", _sft)


@pytest.fixture(scope="module")
def groot_rl(groot_sft, tmp_path_factory) -> tuple[Path, Path]:
    """(the RL run after its resume, the runs root): ITERATIONS versions, then resumed to RESUMED_TO."""
    out = tmp_path_factory.mktemp("groot-rl")
    export = Path((groot_sft / "run_dir").read_text()) / "export"
    run = run_dir_from(embodyhpc("submit", "recipes/rl_groot_metaworld_cpu.yaml", "--local", "--json",
                                 f"job.runs_root={out}", f"model.init_weights={export}",
                                 f"data.root={groot_sft / 'reach'}", f"rl.iterations={ITERATIONS}",
                                 "eval.enabled=false", "checkpoint.every_steps=1000").stdout)
    first = json.loads((run / "logs" / "train_result.json").read_text())
    assert (first["status"], first["version"]) == ("completed", ITERATIONS), first
    embodyhpc("resume", str(run), "--local", f"rl.iterations={RESUMED_TO}")
    return run, out


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def test_groot_rl_runs_resumes_with_its_version_counter_and_logs_to_mlflow(groot_rl):
    run, out = groot_rl
    result = json.loads((run / "logs" / "train_result.json").read_text())
    assert (result["status"], result["mode"]) == ("completed", "rl"), result
    assert (result["resumed_from_step"], result["version"]) == (ITERATIONS, RESUMED_TO)  # the actor's checkpoint
    metrics = _metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, RESUMED_TO + 1))  # each version once, in order
    assert [m["rl/version"] for m in metrics] == list(range(1, RESUMED_TO + 1))
    for key in METRICS:
        assert any(key in m for m in metrics), key
    from mlflow.tracking import MlflowClient

    run_id = json.loads((run / "run.json").read_text())["mlflow_run_id"]
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    logged = client.get_run(run_id).data.metrics
    assert not [key for key in METRICS if f"train/{key}" not in logged], sorted(logged)
    history = client.get_metric_history(run_id, "train/rl/version")
    assert sorted(p.step for p in history) == list(range(1, RESUMED_TO + 1))  # both starts, one MLflow run


def test_the_rollout_worker_samples_with_the_actors_whole_policy(groot_rl):
    """Version 1 trains on samples of version 0 only (the first weights every rollout worker got), scored by the
    actor's version 0: the same policy on both sides gives importance weights of exactly 1 and a KL of 0 (up to
    float rounding between two batchings). A rollout worker whose frozen VLM is not the supervised policy's (built
    at random, only the trainable head synced) samples from another policy: KL ~0.1 at version 1 (measured)."""
    first = _metrics(groot_rl[0])[0]
    assert first["rl/staleness_max"] == 0
    assert abs(first["loss/approx_kl"]) < 1e-4, first
    assert first["loss/is_weight_mean"] == pytest.approx(1.0, abs=1e-3), first


def test_the_actor_scores_chunks_without_dropout(groot_rl, tmp_path):
    """The actor's log-probability of a chunk is the policy's, not a dropout mask's: with the action head's dropout
    at GR00T-N1.5's full-size 0.2, scoring one trajectory twice gives the same numbers (in train mode it would
    not: two masks)."""
    import dataclasses
    import shutil

    import torch
    import torch.distributed as dist

    from embodyhpc.models.groot.batch import GrootSample, collate
    from embodyhpc.rl.actor import Actor
    from embodyhpc.rl.flow_sde import trajectory_log_prob
    from embodyhpc.validation import load_resolved

    run = tmp_path / "run"
    shutil.copytree(groot_rl[0], run, ignore=shutil.ignore_patterns("eval", "export", "submitit"))
    config = load_resolved(str(run))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        actor = Actor(dataclasses.replace(config), run, torch.device("cpu"))
        actor.ckpt.close()
        dropouts = [m for m in actor.model.modules() if isinstance(m, torch.nn.Dropout)]
        assert dropouts  # the action head's (p 0 at size tiny)
        for module in dropouts:
            module.p = 0.2
        g = torch.Generator().manual_seed(0)
        batch = collate([GrootSample(images=torch.rand(1, 3, 32, 32, generator=g), text_ids=[5, 6, 7],
                                     state=torch.randn(64, generator=g)) for _ in range(2)], embodiment_id=31)
        trajectory = torch.randn(2, 5, actor.model.action_horizon, actor.model.action_dim, generator=g)
        scores = [trajectory_log_prob(actor.model, batch, trajectory, noise_level=0.5) for _ in range(2)]
    finally:
        dist.destroy_process_group()
    assert torch.equal(scores[0], scores[1])
    assert scores[0].requires_grad  # still the gradient's path
