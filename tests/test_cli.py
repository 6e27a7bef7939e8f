"""CLI commands that need no cluster: recipes, validate, render, dry runs, run-dir errors."""

from __future__ import annotations

import json

from embodyhpc.validation import load_recipe

TOK = "model.tokenizer_path=/models/paligemma/tokenizer.model"


def test_recipes_list_and_show(cli, tmp_path):
    listing = cli("recipes", "list")
    assert listing.code == 0
    assert "pi05_fp8" in listing.out and "example_roce" in listing.out
    shown = cli("recipes", "show", "pi05_fp8", "data.root=/d", TOK, "train.steps=7", "train.warmup_steps=0")
    assert shown.code == 0, shown.err
    assert "steps: 7" in shown.out and "mode: fp8" in shown.out and "root: /d" in shown.out
    # what `show` prints is a complete recipe: loading it back gives the same config
    (tmp_path / "shown.yaml").write_text(shown.out)
    assert load_recipe(str(tmp_path / "shown.yaml")).config == load_recipe(
        "pi05_fp8", ["data.root=/d", TOK, "train.steps=7", "train.warmup_steps=0"]).config


def test_validate_prints_the_job_shape(cli):
    result = cli("validate", "pi05_fp8", "--site", "example_ib", "data.root=/d", "site.account=a", TOK)
    assert result.code == 0, result.err
    assert "world 32" in result.out and "dp_replicate=4 dp_shard=8" in result.out
    assert "30 episodes in 30 shards" in result.out


def test_render_all_jobs(cli, tmp_path):
    result = cli("render", "smoke_cpu", "--run-dir", str(tmp_path / "r"))
    assert result.code == 0, result.err
    assert [line for line in result.out.splitlines() if line.startswith("# =====")] == [
        "# ===== train.sbatch =====", "# ===== eval.sbatch =====", "# ===== report.sbatch ====="]
    assert result.out.count("#!/bin/bash") == 3


def test_render_without_eval(cli, tmp_path):
    result = cli("render", "smoke_cpu", "eval.enabled=false", "--run-dir", str(tmp_path))
    assert result.code == 0 and "eval.sbatch" not in result.out and result.out.count("#!/bin/bash") == 2


def test_dry_run_creates_and_submits_nothing(cli, runs_root):
    result = cli("submit", "smoke_cpu", "--dry-run", f"job.runs_root={runs_root}")
    assert result.code == 0, result.err
    assert "nothing submitted" in result.out
    assert "# sbatch --dependency=afterok:<train> --kill-on-invalid-dep=yes" in result.out
    assert "--dependency=afterany:<train>:<eval>" in result.out
    assert list(runs_root.iterdir()) == []


def test_status_of_a_folder_that_is_not_a_run(cli, tmp_path):
    result = cli("status", str(tmp_path))
    assert result.code == 2 and "no run.json" in result.err and len(result.err.splitlines()) == 1


def test_status_and_logs_of_a_local_run_record(cli, tmp_path):
    """status/logs read run.json and submitit's files; no job needed to check the formatting."""
    from embodyhpc.runinfo import JobRecord, RunInfo

    (tmp_path / "submitit").mkdir()
    (tmp_path / "submitit" / "77_0_log.out").write_text("hello from rank 0\n")
    info = RunInfo(run_id="r", run_dir=str(tmp_path), backend="local", recipe="x", site=None, overrides=[],
                   python="python", created="now",
                   jobs={"train": JobRecord("train", job_id="77", state="COMPLETED", exit_code=0),
                         "eval": JobRecord("eval", job_id="78", array_size=4, state="RUNNING",
                                           array_counts={"COMPLETED": 1, "RUNNING": 3}),
                         "report": JobRecord("report", state="PENDING", reason="Dependency")})
    info.save()
    text = cli("status", str(tmp_path)).out
    assert "1/4 done, 3 running" in text and "Dependency" in text
    data = json.loads(cli("status", str(tmp_path), "--json").out)
    assert [j["state"] for j in data["jobs"]] == ["COMPLETED", "RUNNING", "PENDING"]
    logs = cli("logs", str(tmp_path), "--job", "train").out
    assert "hello from rank 0" in logs and "train task 0 out" in logs
    assert cli("cancel", str(tmp_path)).out.startswith("local runs stop")


def test_doctor_json_on_this_node(cli):
    """No GPU and no RDMA here: a warning, not a failure; the JSON names the node and each check."""
    result = cli("doctor", "--json", "--probe-mb", "0", "--suggest-network")
    assert result.code == 0, result.out + result.err
    data = json.loads(result.out)
    assert data["hostname"] and {c["name"] for c in data["checks"]} >= {"gpus", "ib", "versions"}
    assert data["suggested_network"]["network"] == {"fabric": "ethernet"}


def test_environment_contradicting_the_network_profile_is_refused(cli, runs_root, monkeypatch):
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_9:1")
    result = cli("submit", "smoke_cpu", "--local", f"job.runs_root={runs_root}", "network.fabric=ib",
                 "network.hcas=[mlx5_0:1]")
    assert result.code == 2 and "NCCL_IB_HCA='mlx5_9:1'" in result.err and "network.extra_env.NCCL_IB_HCA" in result.err
    assert list(runs_root.iterdir()) == []


def test_environment_agreeing_or_extra_is_logged_not_refused(cli, runs_root, monkeypatch):
    from embodyhpc.submit import check_environment
    from embodyhpc.validation import load_recipe

    loaded = load_recipe("smoke_cpu")
    notes: list[str] = []
    check_environment(loaded, {"NCCL_DEBUG": "WARN", "NCCL_ALGO": "Ring", "PATH": "/bin"}, notes.append)
    assert notes == ["note: jobs inherit from your environment NCCL_ALGO=Ring"]


def test_data_synth_rejects_unknown_task_or_env_before_writing(cli, tmp_path):
    result = cli("data", "synth", "--out", str(tmp_path / "ds"), "--tasks", "reach-v3,reach-v9")
    assert result.code == 2 and "unknown MetaWorld tasks ['reach-v9']" in result.err
    out = ("data", "synth", "--out", str(tmp_path / "ds"))
    for args, message in ((("--env", "nope"), "unknown simulator 'nope'"),
                          (("--env", "libero"), "name the tasks"),
                          (("--env", "libero", "--tasks", "libero_spatial/0"), "has no scripted expert"),
                          (("--env", "libero", "--tasks", "libero_99/0", "--policy", "random"), "unknown LIBERO task"),
                          (("--env", "libero", "--tasks", "libero_spatial/0", "--policy", "god"), "unknown policy"),
                          (("--env", "libero", "--tasks", "libero_spatial/0", "--option", "bogus=1"), "not an option"),
                          (("--env", "libero", "--tasks", "libero_spatial/0", "--option", "convention"),
                           "not an option"),
                          (("--env", "libero", "--tasks", "libero_spatial/0", "--cameras", "corner"), "cameras"),
                          (("--env", "pusht", "--tasks", "pusht", "--episodes", "0", "--policy", "random"), ">= 1")):
        result = cli(*out, *args)
        assert result.code == 2 and message in result.err and len(result.err.strip().splitlines()) == 1, (args,
                                                                                                     result.err)
    assert not (tmp_path / "ds").exists()


def test_data_info_on_the_lerobot_fixture(cli):
    from pathlib import Path

    fixture = Path(__file__).parent / "data" / "fixtures" / "lerobot_v30_sample"
    data = json.loads(cli("data", "info", str(fixture), "--json").out)
    assert (data["format"], data["num_episodes"], data["num_frames"], data["fps"]) == ("lerobot-v3.0", 4, 120, 10)
    assert data["cameras"] == ["observation.images.top", "observation.images.wrist"]
    assert data["features"]["action"] == {"dtype": "float32", "shape": [4]} and len(data["tasks"]) == 2
    assert data["episode_length"] == {"min": 30, "max": 30}
    text = cli("data", "info", str(fixture)).out
    assert "4 episodes, 120 frames at 10 fps" in text and "(av1)" in text


def test_data_info_on_an_hdf5_file(cli, tmp_path):
    import h5py
    import numpy as np

    path = tmp_path / "demos.hdf5"
    with h5py.File(path, "w") as f:
        for i, length in enumerate((5, 8)):
            demo = f.create_group(f"data/demo_{i}")
            demo["obs/agentview_image"] = np.zeros((length, 16, 16, 3), np.uint8)
            demo["obs/joint_pos"] = np.zeros((length, 7), np.float64)
            demo["actions"] = np.zeros((length, 7), np.float64)
    data = json.loads(cli("data", "info", str(path), "--json").out)
    assert (data["format"], data["num_episodes"], data["num_frames"]) == ("hdf5", 2, 13)
    assert data["features"]["obs/agentview_image"] == {"dtype": "uint8", "shape": [16, 16, 3]}
    assert data["episode_length"] == {"min": 5, "max": 8}
