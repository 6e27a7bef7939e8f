"""Issue 31's proof on this machine: RL raises a few-shot supervised policy's held-out success.

The supervised policy (embodyhpc.rl.few_shot, which bench/rl_async.py starts from too): pi0.5 (tiny) trained by the
demo recipe's own SFT path on 20 reach-v3 demonstrations (seed 0) for 150 steps, a policy clearly below success 1.
Then `embodyhpc submit recipes/rl_metaworld_cpu.yaml --local` (GRPO, asynchronous, the three roles as local
processes, RL seeds [1]) starts from its export; so does recipes/rl_ppo_metaworld_cpu.yaml (PPO). All are evaluated by
the project's evaluation chain on the same held-out goals (eval.seeds [100]), 48 episodes each, with the same
settings (4 denoising steps, 60 steps per episode): the RL policy's Wilson interval must lie above the SFT one.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.helpers import run_dir_from
from tests.launch.demo import embodyhpc

pytestmark = [pytest.mark.slow, pytest.mark.sim, pytest.mark.xdist_group("rl-closed-loop")]  # its fixtures once

ITERATIONS = 12
EVAL = ["eval.episodes_per_task=48", "eval.max_steps=60", "eval.denoise_steps=4", "eval.execute_steps=5",
        "eval.shards=2", "eval.tasks=[reach-v3]", "eval.seeds=[100]", "eval.reference_policies=[]"]


def _sft(out: Path) -> None:
    from embodyhpc.rl.few_shot import build_few_shot_sft

    export, _ = build_few_shot_sft(out, lambda *args: embodyhpc(*args).stdout)
    (out / "run_dir").write_text(str(export.parent))


def _overall(run_dir: Path) -> dict:
    report = json.loads((run_dir / "eval" / "report.json").read_text())
    return report["results"]["policies"]["trained"]["overall"]


@pytest.fixture(scope="module")
def sft_folder(tmp_path_factory) -> Path:
    """The demonstrations (reach/) and the SFT run (its folder in run_dir), built once per test run."""
    from tests.artifacts import build_once

    return build_once(tmp_path_factory, "rl-sft", _sft)


@pytest.fixture(scope="module")
def sft_eval(sft_folder, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the SFT export, its demonstrations, the SFT policy's held-out evaluation run), shared by GRPO and PPO."""
    out = tmp_path_factory.mktemp("sft-eval")
    export = Path((sft_folder / "run_dir").read_text()) / "export"
    sft = run_dir_from(embodyhpc("eval", "--ckpt", str(export), "--local", "--json", f"job.runs_root={out}",
                                 *EVAL).stdout)
    return export, sft_folder / "reach", sft


def _rl(out: Path, sft_eval, recipe: str) -> tuple[Path, Path, float]:
    export, demos, sft = sft_eval
    started = time.monotonic()
    rl = embodyhpc("submit", recipe, "--local", "--json", f"job.runs_root={out}",
                   f"model.init_weights={export}", f"data.root={demos}", *EVAL)
    return run_dir_from(rl.stdout), sft, time.monotonic() - started


@pytest.fixture(scope="module")
def rl_and_sft(sft_eval, tmp_path_factory):
    return _rl(tmp_path_factory.mktemp("rl"), sft_eval, "recipes/rl_metaworld_cpu.yaml")


@pytest.fixture(scope="module")
def ppo_and_sft(sft_eval, tmp_path_factory):
    """PPO (value head, GAE, advantages normalised per micro-batch): asynchronous, 12 versions of 192 chunk samples."""
    return _rl(tmp_path_factory.mktemp("ppo"), sft_eval, "recipes/rl_ppo_metaworld_cpu.yaml")


def _check_learnt(rl_dir: Path, sft_dir: Path, wall_s: float, name: str) -> list[dict]:
    rl, sft = _overall(rl_dir), _overall(sft_dir)
    print(f"SFT {sft['successes']}/{sft['recorded']} [{sft['ci_low']:.3f}, {sft['ci_high']:.3f}]; {name} "
          f"{rl['successes']}/{rl['recorded']} [{rl['ci_low']:.3f}, {rl['ci_high']:.3f}]; RL run {wall_s:.0f} s")
    assert sft["recorded"] >= 40 and rl["recorded"] >= 40
    assert sft["success_rate"] < 0.9  # the supervised policy leaves room to improve
    assert rl["ci_low"] > sft["ci_high"], (sft, rl)
    return _versions(rl_dir)


def _versions(rl_dir: Path) -> list[dict]:
    """The run's metrics lines, after checking there is one per version, in order."""
    metrics = [json.loads(line) for line in (rl_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, ITERATIONS + 1))
    return metrics


def test_rl_raises_held_out_success_with_non_overlapping_intervals(rl_and_sft):
    metrics = _check_learnt(*rl_and_sft, "GRPO")
    for key in ("env/success_once", "env/return", "env/episode_length", "rl/staleness_mean", "rl/staleness_max",
                "rl/rejected_stale_fraction", "time/env_s", "time/rollout_s", "time/actor_s", "time/sync_s",
                "time/push_wait_s", "rl/env_steps_per_s", "rl/samples_per_s", "loss/policy"):
        assert any(key in m for m in metrics), key
    for m in metrics:  # a version that saw samples older than rl.max_staleness (1) rejected them, end to end
        assert m["rl/staleness_max"] <= 1 or m["rl/rejected_stale"] > 0, m


def test_ppo_trains_its_value_head_and_keeps_a_critic_beside_each_checkpoint(ppo_and_sft):
    """The PPO run, whatever it learnt: one metrics line per version, the value head's loss and gradient norm finite
    in every one, the share of states out of the demonstrations' range logged, and the critic beside each checkpoint
    the run keeps (checkpoint.keep_latest_k), and no other."""
    import math

    rl_dir = ppo_and_sft[0]
    versions = _versions(rl_dir)
    assert all(math.isfinite(m["loss/value"]) and math.isfinite(m["value_grad_norm"]) for m in versions)
    assert all(0.0 <= m["rl/state_out_of_range"] <= 1.0 for m in versions)
    print("states out of range per version:", [round(m["rl/state_out_of_range"], 3) for m in versions])
    checkpoints = rl_dir / "checkpoints"
    kept = sorted(p.name.removeprefix("step-") for p in checkpoints.glob("step-*"))
    assert sorted(p.name.removeprefix("critic-step-").removesuffix(".pt")
                  for p in checkpoints.glob("critic-step-*")) == kept and len(kept) == 2


@pytest.mark.xfail(strict=False, reason="PPO collapses now and then: 45-48/48 in 7 runs, 0/48 in the CI of "
                   "52fa2d0 (the critic's value loss jumped to 3.4 at version 4, training success 0 from then on)")
def test_ppo_raises_held_out_success_with_non_overlapping_intervals(ppo_and_sft):
    """PPO learns too: the held-out success of the same SFT start rises with non-overlapping Wilson intervals."""
    _check_learnt(*ppo_and_sft, "PPO")


def test_resume_of_an_rl_run_keeps_the_version_counter(rl_and_sft, tmp_path):
    """The actor of a resumed run loads the newest checkpoint's version (its step), sends those weights as that
    version, and its next optimizer step is the version after it (samples the rollouts stamp from then on)."""
    import dataclasses
    import shutil

    import torch
    import torch.distributed as dist

    from embodyhpc.rl.actor import Actor
    from embodyhpc.validation import load_resolved

    rl_dir, _, _ = rl_and_sft
    run = tmp_path / "run"
    shutil.copytree(rl_dir, run, ignore=shutil.ignore_patterns("eval", "export"))
    config = load_resolved(str(run))
    config = dataclasses.replace(config, rl=dataclasses.replace(config.rl, iterations=ITERATIONS + 2))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        actor = Actor(config, run, torch.device("cpu"))
        sent = []

        class Sender:
            def send(self, state, version):
                sent.append(version)

            def close(self):
                sent.append("goodbye")

        actor._send(Sender(), last=False)
        actor.ckpt.close()
    finally:
        dist.destroy_process_group()
    assert actor.start_version == actor.version.value == ITERATIONS and sent == [ITERATIONS]
    assert actor.version.advance() == ITERATIONS + 1
