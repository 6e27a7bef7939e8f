"""`embodyhpc resume`: every refusal (one line, exit 2, nothing changed), the attempt bookkeeping, and (slow) a
2-process run resumed on 1 process whose parameters equal a 1-process run from the same checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.checkpoint import layout
from embodyhpc.rundir import RUN_JSON_VERSION, make_run_dir, write_private
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.validation import load_recipe
from tests.helpers import run_dir_from

DEMO = "recipes/demo_metaworld_cpu.yaml"


_DCP_TEMPLATES: dict[str, Path] = {}


def _dcp_template(model_config) -> Path:
    """DCP files of the model `model_config` builds (random weights, no optimizer), written once per model."""
    key = repr(model_config)
    if key not in _DCP_TEMPLATES:
        import atexit
        import tempfile
        import warnings

        import torch.distributed.checkpoint as dcp

        from embodyhpc.models import build_model

        template = Path(tempfile.mkdtemp(prefix="dcp-template-"))
        atexit.register(shutil.rmtree, template, True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "torch.distributed is disabled": one process writes it all
            dcp.save({"model": build_model(model_config).state_dict()}, checkpoint_id=template, no_dist=True)
        _DCP_TEMPLATES[key] = template
    return _DCP_TEMPLATES[key]


@pytest.fixture(scope="session", autouse=True)
def demo_checkpoint_template() -> Path:
    """The demo model's DCP files (torch imported, the model built and saved once): charged to the suite, not to
    whichever test calls fake_run first."""
    return _dcp_template(load_recipe(DEMO, ["data.root=/tmp"], site="local").config.model)


def model_checkpoint(folder: Path, model_config) -> None:
    """What resume reads of a checkpoint (its DCP metadata and shard files) into `folder`: a copy of the model's
    template."""
    shutil.copytree(_dcp_template(model_config), folder, dirs_exist_ok=True)


def fake_run(root: Path, *, steps: int = 40, checkpoints: tuple[int, ...] = (20,), backend: str = "local",
             train_state: str = "FAILED", job_id: str = "123", overrides: tuple[str, ...] = (),
             site: str = "local") -> Path:
    """A run folder as `submit` leaves it (resolved.yaml, run.json) with complete checkpoint folders at `checkpoints`
    (the model's DCP files and a marker each, as the Checkpointer writes them): what resume reads, without
    training."""
    data = root / "data"
    data.mkdir(exist_ok=True)
    loaded = load_recipe(DEMO, [f"job.runs_root={root}", f"data.root={data}", f"train.steps={steps}",
                                "train.warmup_steps=2", *overrides], site=site)
    run = root / "demo" / "run-1"
    assert make_run_dir(run)
    write_private(run / "resolved.yaml", loaded.to_yaml())
    RunInfo(run_id=run.name, run_dir=str(run), backend=backend, recipe=DEMO, site=loaded.site, overrides=[],
            python=sys.executable, created="2026-01-01T00:00:00+0000",
            jobs={"train": JobRecord("train", job_id=job_id, state=train_state),
                  "report": JobRecord("report", job_id=str(int(job_id) + 1), state="COMPLETED")}).save()
    for step in checkpoints:
        folder = layout.step_dir(run / "checkpoints", step)
        folder.mkdir(parents=True)
        if loaded.config.data.format != "synthetic":
            model_checkpoint(folder, loaded.config.model)
        layout.write_marker(folder, {"step": step})
    return run


def refused(cli, run: Path, *args: str) -> str:
    """resume must fail with one line and exit 2, and leave run.json and resolved.yaml as they were."""
    before = {name: (run / name).read_bytes() for name in ("run.json", "resolved.yaml") if (run / name).is_file()}
    result = cli("resume", str(run), *args)
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    assert {name: (run / name).read_bytes() for name in before} == before
    assert not (run / "attempts").exists()
    return lines[0]


# ---- refusals: the run ----
def test_unknown_run_folder_without_run_json_and_a_file(cli, tmp_path):
    assert "no run.json" in refused(cli, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    assert "no run.json" in refused(cli, tmp_path / "empty")
    (tmp_path / "file").write_text("x")
    assert "no run.json" in refused(cli, tmp_path / "file")


@pytest.mark.parametrize("content, problem", [("{", "not valid JSON"), ("", "empty"), ("[1]", "array"),
                                              ('{"run_id": 1}', "run_id"), ("\xff\xfe", "not valid JSON")])
def test_corrupt_run_json(cli, runs_root, content, problem):
    run = fake_run(runs_root)
    (run / "run.json").write_text(content)
    assert problem in refused(cli, run)


def test_damaged_attempts_in_run_json(cli, runs_root):
    run = fake_run(runs_root)
    data = json.loads((run / "run.json").read_text())
    for bad, problem in (({"attempts": {"a": 1}}, "attempts"), ({"attempts": [7]}, "attempts[0]"),
                         ({"attempts": [{"number": 1}]}, "attempts[0].created")):
        (run / "run.json").write_text(json.dumps({**data, **bad}))
        assert problem in refused(cli, run)


def test_newer_schema_version_is_refused_since_resume_rewrites_run_json(cli, runs_root):
    run = fake_run(runs_root)
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "schema_version": RUN_JSON_VERSION + 1, "future": [1]}))
    line = refused(cli, run)
    assert f"schema_version {RUN_JSON_VERSION + 1}" in line and "newer" in line


def test_an_older_run_json_without_attempts_reads_as_one_attempt(runs_root):
    run = fake_run(runs_root)
    data = json.loads((run / "run.json").read_text())
    for key in ("attempts", "attempt", "resumed_from_step", "attempt_overrides", "attempt_created"):
        data.pop(key)
    (run / "run.json").write_text(json.dumps({**data, "schema_version": 2}))
    info = RunInfo.load(run)
    assert info.attempt == 1 and [a.number for a in info.all_attempts()] == [1]
    assert info.all_attempts()[0].jobs["train"].job_id == "123"


def test_no_complete_checkpoint_says_submit_starts_fresh(cli, runs_root):
    run = fake_run(runs_root, checkpoints=())
    (run / "checkpoints" / "step-10").mkdir()  # a save that never completed: not a checkpoint
    line = refused(cli, run)
    assert "no complete checkpoint" in line and "embodyhpc submit" in line


def test_evaluation_runs_are_not_training_runs(cli, runs_root):
    run = fake_run(runs_root)
    info = RunInfo.load(run)
    info.jobs = {"eval": JobRecord("eval", job_id="5"), "report": JobRecord("report", job_id="6")}
    info.save()
    assert "not a training run" in refused(cli, run)


def test_a_local_run_still_running_names_its_job(cli, runs_root):
    # a process of submitit's local executor is the job (its id is the pid): one that lives is running
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "submitit"])
    try:
        run = fake_run(runs_root, train_state="RUNNING", job_id=str(proc.pid))
        line = refused(cli, run)
        assert f"train (process {proc.pid}) is RUNNING" in line
    finally:
        proc.kill()
        proc.wait()
    # its process gone (the submit was killed): the run may resume; the dry run says from where
    result = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert result.code == 0, result.err
    assert "from the checkpoint of step 20" in result.out and "train.steps: 40 -> 60" in result.out


def test_a_damaged_or_missing_resolved_yaml_names_the_file(cli, runs_root):
    run = fake_run(runs_root)
    (run / "resolved.yaml").write_text("model: [unclosed\n")
    assert "resolved.yaml" in refused(cli, run)
    (run / "resolved.yaml").unlink()
    assert "resolved.yaml" in refused(cli, run)


@pytest.mark.parametrize("nodes", ["0", "-1"])
def test_nodes_must_be_positive(cli, runs_root, nodes):
    run = fake_run(runs_root)
    assert "resources.nodes" in refused(cli, run, "--nodes", nodes)


def test_the_synthetic_stand_in_resumes_from_its_state_file_and_a_damaged_one_is_refused(cli, runs_root):
    import torch

    run = fake_run(runs_root, checkpoints=(), overrides=("data.format=synthetic",))
    torch.save({"step": 30, "weights": torch.zeros(16)}, run / "checkpoints" / "spine-state.pt")
    result = cli("resume", str(run), "--dry-run", "--nodes", "1")
    assert result.code == 0 and "from the checkpoint of step 30" in result.out, result.err
    (run / "checkpoints" / "spine-state.pt").write_bytes(b"not a torch file")
    assert "unreadable" in refused(cli, run)


# ---- refusals: steps ----
def test_a_completed_run_without_more_steps(cli, runs_root):
    run = fake_run(runs_root, steps=40, checkpoints=(20, 40), train_state="COMPLETED")
    line = refused(cli, run)
    assert "already trained to train.steps=40; pass train.steps=M to continue" in line
    line = refused(cli, run, "train.steps=40")
    assert "already trained to train.steps=40" in line


def test_a_completed_run_is_extended_by_raising_train_steps(cli, runs_root):
    """The run trained to its train.steps (its newest checkpoint is the last step, its chain COMPLETED): raising
    train.steps trains on from that checkpoint. The dry run says so for the policy's DCP checkpoint; the attempt
    itself (everything before its chain starts: resume.begin_attempt) records attempt 2 from step 40 to 80 and moves
    attempt 1's outputs aside (the synthetic stand-in: its preflight needs no dataset)."""
    import torch

    from embodyhpc.resume import begin_attempt, plan_resume

    run = fake_run(runs_root, steps=40, checkpoints=(20, 40), train_state="COMPLETED")
    result = cli("resume", str(run), "--dry-run", "train.steps=80")
    assert result.code == 0, result.err
    assert "would start from the checkpoint of step 40 and train to train.steps=80" in result.out
    assert "train.steps: 40 -> 80" in result.out

    (runs_root / "synthetic").mkdir()
    run = fake_run(runs_root / "synthetic", steps=40, checkpoints=(), train_state="COMPLETED",
                   overrides=("data.format=synthetic",))
    torch.save({"step": 40, "weights": torch.zeros(4)}, run / "checkpoints" / "spine-state.pt")
    (run / "export").mkdir()
    (run / "export" / "model.safetensors").write_bytes(b"attempt 1's weights")
    said: list[str] = []
    plan = plan_resume(run, ["train.steps=80"], progress=said.append)
    loaded, info = begin_attempt(plan, sys.executable, local=True, progress=said.append)
    assert (plan.from_step, loaded.config.train.steps, info.attempt, info.resumed_from_step) == (40, 80, 2, 40)
    again = RunInfo.load(run)
    assert again.attempt == 2 and again.attempt_overrides == ["train.steps=80"]
    assert again.attempts[0].jobs["train"].state == "COMPLETED" and "train" not in again.jobs
    assert load_recipe(str(run / "resolved.yaml"), recipe_site_keys="keep").config.train.steps == 80
    assert (run / "attempts" / "1" / "export" / "model.safetensors").read_bytes() == b"attempt 1's weights"
    assert not (run / "export").exists()


@pytest.mark.parametrize("value, problem", [("abc", "train.steps"), ("-5", "train.steps"), ("0", "train.steps"),
                                            ("1.5", "train.steps"), ("[1]", "train.steps"), ("", "train.steps"),
                                            ("10", "below the step the newest checkpoint holds (20)"),
                                            ("20", "nothing to train")])
def test_steps_that_are_not_a_count_above_the_checkpoint(cli, runs_root, value, problem):
    run = fake_run(runs_root)
    assert problem in refused(cli, run, f"train.steps={value}")


# ---- refusals: what may not change ----
@pytest.mark.parametrize("override", [
    "model.size=small", "model.action_dim=7", "data.root=/elsewhere", "data.delta_timestamps={}",
    "train.global_batch_size=64", "train.lr=0.1", "train.seed=3", "train.warmup_steps=5", "train.weight_decay=0",
    "precision.mode=bf16", "job.name=other", "job.runs_root=/tmp/x", "tracking.mlflow_uri=http://x",
    "tracking.enabled=false", "eval.tasks=[reach-v3]", "eval.weights=/x", "model", "optimizer.lr=1",
])
def test_overrides_that_change_what_the_checkpoint_holds(cli, runs_root, override):
    run = fake_run(runs_root)
    line = refused(cli, run, override)
    key = override.partition("=")[0]
    assert key in line, line


def test_a_site_profile_that_moves_the_run_is_refused_naming_the_key(cli, runs_root, tmp_path):
    run = fake_run(runs_root)
    site = tmp_path / "other.yaml"
    site.write_text(f"job:\n  runs_root: {tmp_path / 'elsewhere'}\nsite:\n  name: other\n")
    line = refused(cli, run, "--site", str(site))
    assert "job.runs_root" in line and str(site) in line


@pytest.mark.parametrize("args, names", [
    (("--nodes", "3"), ["3 ranks", "2 ranks (micro_batch_size=16) or 4 ranks (micro_batch_size=8)"]),
    (("resources.nodes=1", "resources.tasks_per_node=5"), ["5 ranks", "4 ranks (micro_batch_size=8) or 8 ranks"]),
    (("train.micro_batch_size=5",), ["micro_batch_size=5", "train.micro_batch_size=16"]),
])
def test_a_world_or_micro_batch_that_cannot_divide_the_global_batch_names_the_nearest_valid_values(
        cli, runs_root, args, names):
    run = fake_run(runs_root)
    line = refused(cli, run, *args)
    assert "train.global_batch_size=32 stays" in line
    for name in names:
        assert name in line, line


@pytest.mark.parametrize("nodes, problem", [("", "names no node"), ("n1;touch /tmp/x", "not a Slurm node name"),
                                            ("n1 n2", "not a Slurm node name"), ("-x", "not a Slurm node name")])
def test_exclude_takes_node_names_only(cli, runs_root, nodes, problem):
    run = fake_run(runs_root)
    assert problem in refused(cli, run, "--exclude", nodes)


def test_site_exclude_in_a_recipe_is_checked_and_extra_sbatch_exclude_is_refused(cli, runs_root):
    run = fake_run(runs_root)
    assert "site.exclude" in refused(cli, run, "site.exclude=['n1 n2']")
    assert "exclude" in refused(cli, run, "site.extra_sbatch={exclude: n1}")


# ---- what a resume may change ----
def test_dry_run_renders_the_new_attempt_with_excluded_nodes_and_changes_nothing(cli, runs_root):
    run = fake_run(runs_root, overrides=("site.exclude=[n9]",))
    before = (run / "run.json").read_bytes()
    result = cli("resume", str(run), "--dry-run", "--nodes", "1", "--exclude", "n1,gpu-[01,03]",
                 "train.micro_batch_size=8", "train.steps=80")
    assert result.code == 0, result.err
    text = result.out
    assert "#SBATCH --nodes=1" in text and "#SBATCH --exclude='n9,n1,gpu-[01,03]'" in text
    assert "resources.nodes: 2 -> 1" in text and "train.micro_batch_size: 16 -> 8" in text
    assert (run / "run.json").read_bytes() == before and not (run / "attempts").exists()


@pytest.mark.parametrize("ref", ["run-1", "demo/run-1", "latest", "run-"])
def test_the_run_may_be_named_as_runs_lists_it(cli, runs_root, ref):
    run = fake_run(runs_root)
    by_path = cli("resume", str(run), "--dry-run", "train.steps=80")
    by_name = cli("resume", ref, "--runs-root", str(runs_root), "--dry-run", "train.steps=80")
    assert by_path.code == by_name.code == 0, by_name.err
    assert by_name.out == by_path.out and "train.steps: 40 -> 80" in by_name.out
    assert "no run" in refused(cli, Path("run-2"), "--runs-root", str(runs_root))


def test_attempt_bookkeeping_survives_a_reload(runs_root):
    run = fake_run(runs_root)
    info = RunInfo.load(run)
    info.start_attempt(backend="slurm", site="s", python="py", overrides=["resources.nodes=1"], resumed_from_step=20,
                       created="t2")
    info.jobs["train"] = JobRecord("train", job_id="900")
    info.save()
    again = RunInfo.load(run)
    assert again.attempt == 2 and again.resumed_from_step == 20 and again.jobs["train"].job_id == "900"
    first, second = again.all_attempts()
    assert (first.number, first.backend, first.jobs["train"].job_id) == (1, "local", "123")
    assert (second.number, second.overrides, second.resumed_from_step) == (2, ["resources.nodes=1"], 20)


# ---- the local closed loop ----
def _tensors(export: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(export / "model.safetensors"))


def _mlflow_steps(run: Path, key: str = "train/loss") -> list[int]:
    from embodyhpc.tracking.mlflow_run import client, tracking_uri
    from embodyhpc.validation import load_resolved

    config = load_resolved(run)
    history = client(tracking_uri(config.tracking, config.job.runs_root)).get_metric_history(
        RunInfo.load(run).mlflow_run_id, key)
    return sorted(m.step for m in history)


@pytest.mark.slow
def test_a_2_process_run_resumes_on_1_process_and_equals_a_1_process_run_from_the_checkpoint(
        cli, runs_root, reach_demos):
    from embodyhpc.orchestrate.backend_local import LocalBackend
    from embodyhpc.orchestrate.plan import TASKS, JobSpec, make_plan

    common = [f"job.runs_root={runs_root}", f"data.root={reach_demos}", "train.warmup_steps=2", "train.log_every=1",
              "checkpoint.every_steps=2", "eval.enabled=false", "tracking.telemetry_interval_s=0"]
    result = cli("submit", DEMO, "--local", "--json", *common, "train.steps=4")
    assert result.code == 0, result.err
    run = run_dir_from(result.out)
    assert json.loads((run / "logs" / "train_result.json").read_text())["world_size"] == 2
    reference = runs_root / "reference"
    shutil.copytree(run, reference)  # the same checkpoint, resumed by a plain 1-process training job below

    result = cli("resume", str(run), "--local", "--json", "--nodes", "1", "train.steps=8")
    assert result.code == 0, result.err
    done = json.loads((run / "logs" / "train_result.json").read_text())
    assert (done["world_size"], done["resumed_from_step"], done["steps"]) == (1, 4, 8)
    lines = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 9)), "every step once"
    assert _mlflow_steps(run) == list(range(1, 9)), "one MLflow curve, no step twice or missing"
    info = RunInfo.load(run)
    assert info.attempt == 2 and info.resumed_from_step == 4 and info.attempt_overrides == [
        "resources.nodes=1", "train.steps=8"]
    assert info.attempts[0].jobs["train"].state == "COMPLETED" and info.jobs["train"].state == "COMPLETED"
    assert (run / "attempts" / "1" / "export" / "model.safetensors").is_file()  # attempt 1's export kept
    text = cli("status", str(run)).out
    assert "attempt 1 (submit; local" in text and "attempt 2 (resume from step 4; local" in text

    # the reference: attempt 2's config, its training job alone, on the copy of the step-4 checkpoint
    shutil.copy(run / "resolved.yaml", reference / "resolved.yaml")
    ref_info = RunInfo.load(reference)
    ref_info.mlflow_run_id = None
    (reference / "export").rename(reference / "export-of-step-4")
    loaded = load_recipe(str(reference / "resolved.yaml"), recipe_site_keys="keep")
    plan = make_plan(loaded, [JobSpec("train", TASKS["train"])], reference, ref_info.python)
    LocalBackend().submit(plan, ref_info, progress=lambda m: None)
    assert ref_info.jobs["train"].state == "COMPLETED", ref_info.jobs["train"].reason
    resumed, uninterrupted = _tensors(run / "export"), _tensors(reference / "export")
    before = _tensors(reference / "export-of-step-4")
    assert resumed.keys() == uninterrupted.keys()
    assert all((resumed[k] == uninterrupted[k]).all() for k in resumed), "bit-identical parameters"
    assert any(not (resumed[k] == before[k]).all() for k in resumed), "steps 5-8 trained"


# ---- an RL run (rl.enabled) resumes like a training run: its versions are its steps, its rl job starts again ----
RL = ("rl.enabled=true", "model.init_weights=/models/sft", "eval.every_k_checkpoints=0", "rl.iterations=40")


def fake_rl_run(root: Path, *, checkpoints: tuple[int, ...] = (20, 40)) -> Path:
    """fake_run made an RL run: its chain's first job is rl, its checkpoints hold the same model (init_weights
    changes no tensor: the demo model's DCP template is reused)."""
    run = fake_run(root, checkpoints=(), overrides=RL)
    info = RunInfo.load(run)
    info.jobs = {"rl": JobRecord("rl", job_id="123", state="COMPLETED"),
                 "report": JobRecord("report", job_id="124", state="COMPLETED")}
    info.save()
    demo_model = load_recipe(DEMO, ["data.root=/tmp"], site="local").config.model
    for step in checkpoints:
        folder = layout.step_dir(run / "checkpoints", step)
        folder.mkdir(parents=True)
        model_checkpoint(folder, demo_model)
        layout.write_marker(folder, {"step": step})
    return run


def test_an_rl_run_resumes_from_its_newest_version_with_its_rl_job(cli, runs_root):
    run = fake_rl_run(runs_root)
    assert "already trained to rl.iterations=40; pass rl.iterations=M to continue" in refused(cli, run)
    assert "below the step the newest checkpoint holds (40)" in refused(cli, run, "rl.iterations=30")
    result = cli("resume", str(run), "--dry-run", "rl.iterations=80", "rl.env_workers=2")
    assert result.code == 0, result.err
    assert ("would start from the checkpoint of step 40 and train to rl.iterations=80 on 1 actor, 1 rollout, "
            "2 env process(es)") in result.out
    assert "rl.iterations: 40 -> 80" in result.out and "rl.env_workers: 1 -> 2" in result.out
    assert "scripts/rl.sbatch" in result.out and "scripts/train.sbatch" not in result.out


@pytest.mark.parametrize("override", ["rl.algorithm=ppo", "rl.noise_level=0.1", "rl.async=true",
                                      "rl.train_seeds=[5]", "rl.enabled=false"])
def test_an_rl_run_keeps_what_its_policy_learns_with(cli, runs_root, override):
    run = fake_rl_run(runs_root)
    line = refused(cli, run, "rl.iterations=80", override)
    assert override.partition("=")[0] in line and "cannot change on resume" in line, line
