"""The whole RL job on the local Slurm cluster: `embodyhpc submit recipes/rl_metaworld_cpu.yaml` (not --local) runs
env workers, a rollout worker and two FSDP2 actor ranks as one heterogeneous job (partition `het`: a node per
group), from the few-shot supervised policy tests/rl/test_rl_closed_loop.py builds. What the real program must show,
beyond tests/slurm/test_hetjob.py's role report: every group ran its role on its own node, the policy version advanced
to rl.iterations through both actor ranks, the run ends completed in `status` and `runs`, and the issue's RL metrics
reach the run's metrics file and its MLflow run, one point per version."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import yaml

from embodyhpc.rundir import ATTEMPTS_FILE
from embodyhpc.slurm.status import ACTIVE
from tests.helpers import run_dir_from, wait_for
from tests.launch.demo import embodyhpc

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.sim, pytest.mark.xdist_group("slurm")]

ITERATIONS = 3
METRICS = ("env/success_once", "env/return", "env/episode_length", "rl/staleness_mean", "rl/staleness_max",
           "rl/rejected_stale_fraction", "time/env_s", "time/rollout_s", "time/actor_s", "time/sync_s",
           "rl/env_steps_per_s", "rl/samples_per_s", "loss/policy")


@pytest.fixture(scope="module")
def sft_folder(tmp_path_factory) -> Path:
    from tests.artifacts import build_once
    from tests.rl.test_rl_closed_loop import _sft

    return build_once(tmp_path_factory, "rl-sft", _sft)


def _submit(sft_folder: Path, tmp_path: Path, iterations: int, *extra: str, het_jobs: bool = True) -> Path:
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"name": "local-het", "partition": "het", "gpu_request": "none",
                                             "het_jobs": het_jobs}, "network": {"fabric": "ethernet"}}))
    export = Path((sft_folder / "run_dir").read_text()) / "export"
    overrides = [f"job.runs_root={tmp_path / 'runs'}", f"model.init_weights={export}",
                 f"data.root={sft_folder / 'reach'}", f"rl.iterations={iterations}", "rl.actor_ranks=2",
                 "rl.envs_per_worker=8", "rl.episodes_per_iteration=16", "rl.group_size=8",
                 "train.global_batch_size=32", "train.micro_batch_size=32", "rl.micro_batch_size=16",
                 "eval.enabled=false", "resources.time=00:10:00", "checkpoint.every_steps=2", *extra]
    for role in ("actor", "rollout", "env"):
        overrides += [f"rl.resources.{role}.nodes=1", f"rl.resources.{role}.cpus_per_task=1",
                      f"rl.resources.{role}.mem=2G"]
    return run_dir_from(embodyhpc("submit", "recipes/rl_metaworld_cpu.yaml", "--site", str(site), "--json",
                                  *overrides).stdout)


def _wait_ended(run_dir: Path, timeout_s: float) -> dict:
    try:
        return wait_for(lambda: (s := json.loads(embodyhpc("status", str(run_dir), "--json").stdout))["jobs"]
                        and all(j["state"] not in ACTIVE + ("UNKNOWN",) for j in s["jobs"]) and s, timeout_s,
                        "the RL job ended", poll_s=3)
    finally:
        embodyhpc("cancel", str(run_dir), ok=False)


def test_the_rl_job_runs_its_roles_on_the_het_groups_and_trains(slurm_cluster, sft_folder, tmp_path):
    run_dir = _submit(sft_folder, tmp_path, ITERATIONS)
    status = _wait_ended(run_dir, 300)
    logs = run_dir / "submitit"
    job = {j["kind"]: j for j in status["jobs"]}["rl"]
    assert (job["kind"], job["state"]) == ("rl", "COMPLETED"), (status, _tails(logs))
    assert set(job["nodes"].split(",")) == {"n1", "n2", "n3"}  # a node per het component, read back from sacct
    # each group's processes log under the job's id and their role: two actor ranks, one rollout, one env worker
    for role, count in (("actor", 2), ("rollout", 1), ("env", 1)):
        outs = sorted(logs.glob(f"{job['job_id']}_{role}-*.out"))
        assert len(outs) == count, (role, sorted(p.name for p in logs.iterdir()))

    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, ITERATIONS + 1))
    for key in METRICS:  # env/* only for versions in which episodes ended, loss/* for those that trained samples (a
        # version whose groups all had equal rewards steps on none: Actor._batch_due)
        every = [m for m in metrics if not key.startswith("env/") and (not key.startswith("loss/") or m["rl/samples"])]
        assert any(key in m for m in metrics) and all(key in m for m in every), key
    assert status["state"] == "COMPLETED"

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    logged = client.get_run(status["mlflow_run_id"]).data.metrics
    assert not [key for key in METRICS if f"train/{key}" not in logged], sorted(logged)  # under the train/ prefix
    history = client.get_metric_history(status["mlflow_run_id"], "train/rl/samples_per_s")
    assert sorted(p.step for p in history) == list(range(1, ITERATIONS + 1))  # a point per policy version


def test_without_het_jobs_one_allocation_runs_a_role_per_node_and_trains(slurm_cluster, sft_folder, tmp_path):
    """site.het_jobs: false (sites where heterogeneous steps are disabled): the same RL job as one allocation of 3
    nodes and one srun step whose ranks are laid out group by group (SLURM_HOSTFILE), each rank's role from its
    SLURM_PROCID and EMBODYHPC_RL_SIZES. It must train the same way: both actor ranks on the first node, the rollout
    worker on the second, the env worker on the third; the versions advance to rl.iterations, the run completes and
    its metrics reach MLflow."""
    run_dir = _submit(sft_folder, tmp_path, ITERATIONS, het_jobs=False)
    script = (run_dir / "scripts" / "rl.sbatch").read_text()
    assert "#SBATCH hetjob" not in script and "SLURM_HOSTFILE" in script  # really the one-allocation form
    status = _wait_ended(run_dir, 300)
    logs = run_dir / "submitit"
    job = {j["kind"]: j for j in status["jobs"]}["rl"]
    assert (job["kind"], job["state"]) == ("rl", "COMPLETED"), (status, _tails(logs))
    nodes = subprocess.run(["scontrol", "show", "hostnames", job["nodes"]], check=True, capture_output=True,
                           text=True, timeout=30).stdout.split()
    assert "+" not in job["job_id"] and nodes == ["n1", "n2", "n3"], job  # one job (no het components), 3 nodes
    # where each server role published itself: actor rank 0 (its stream and the weights' store) on the first node
    # of the allocation, the rollout worker on the second (n1, n2, n3 in order: the hostfile's layout)
    hosts = {name: json.loads((run_dir / "rl" / "endpoints" / f"{name}.json").read_text())["host"]
             for name in ("actor-0", "dist-0", "weights-0", "rollout-0")}
    assert hosts == {"actor-0": "n1", "dist-0": "n1", "weights-0": "n1", "rollout-0": "n2"}, hosts
    metrics = [json.loads(line) for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, ITERATIONS + 1))
    assert status["state"] == "COMPLETED"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    history = client.get_metric_history(status["mlflow_run_id"], "train/rl/samples_per_s")
    assert sorted(p.step for p in history) == list(range(1, ITERATIONS + 1))


def _ended(status: dict) -> dict | None:
    return status if status["jobs"] and all(j["state"] not in (*ACTIVE, "UNKNOWN") for j in status["jobs"]) else None


def _versions(run_dir: Path) -> list[int]:
    path = run_dir / "logs" / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def test_usr2_saves_the_actor_requeues_the_het_job_and_it_continues_the_version_counter(slurm_cluster, sft_folder,
                                                                                      tmp_path):
    """The time-limit warning (USR2 to every component) once version 2 is out: the actor ranks save (DCP, RNG,
    the version as the step) and actor rank 0 requeues the whole het job with scontrol; the next start resumes from
    that version and runs on to rl.iterations: every version logged once, in order, none trained twice."""
    iterations = 6
    run_dir = _submit(sft_folder, tmp_path, iterations, "checkpoint.keep_latest_k=10")
    wait_for(lambda: len(_versions(run_dir)) >= 2, 240, "version 2 of the RL job")
    job_id = json.loads((run_dir / "run.json").read_text())["jobs"]["rl"]["job_id"]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, capture_output=True, timeout=30)
    status = _wait_ended(run_dir, 420)
    logs = run_dir / "submitit"
    attempts = [json.loads(line) for line in (run_dir / ATTEMPTS_FILE).read_text().splitlines()]
    assert [(a["outcome"], a["signal"]) for a in attempts] == [("requeued", "SIGUSR2")], (attempts, _tails(logs))
    stopped = attempts[0]["step"]
    assert 2 <= stopped < iterations
    saved = run_dir / "checkpoints" / f"step-{stopped}"  # at the stop: DCP shards, the version, every rank's RNG
    assert json.loads((saved / "trainer.json").read_text())["step"] == stopped
    assert len(list(saved.glob("*.distcp"))) == 2 and len(list((saved / "rng").glob("rank-*.pt"))) == 2
    result = json.loads((run_dir / "logs" / "train_result.json").read_text())
    assert (result["status"], result["resumed_from_step"], result["version"]) == ("completed", stopped, iterations)
    assert _versions(run_dir) == list(range(1, iterations + 1))  # the counter went on: nothing repeated or skipped
    assert status["state"] == "COMPLETED", (status, _tails(logs))
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    history = client.get_metric_history(status["mlflow_run_id"], "train/rl/version")
    assert sorted(p.step for p in history) == list(range(1, iterations + 1))  # one MLflow run over both starts
    # the warning reached the env worker too: it lived on (a USR2 death would be restarted and logged here)
    env_log = "".join(p.read_text() for p in logs.glob(f"{job_id}_env-*.out"))
    assert f"exit code {-signal.SIGUSR2}" not in env_log, env_log[-2000:]
    out = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--duplicates", f"--jobs={job_id}",
                          "--format=JobID,State"], check=True, capture_output=True, text=True, timeout=30).stdout
    assert [line.split("|")[1].split()[0] for line in out.splitlines() if line.split("|")[0] == f"{job_id}+0"] == [
        "REQUEUED", "COMPLETED"]


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(logs.glob("*.err")))
