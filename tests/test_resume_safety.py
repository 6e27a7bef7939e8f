"""Resume never loses or fakes an attempt: one command at a time on a run (the run folder's lock, real processes
included), an archive is never overwritten, a resume that dies half-way is finished or undone by the next, the
step resumed from is the one the checkpoint records, and resolved.yaml's model must fit the checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.checkpoint import layout
from embodyhpc.rundir import write_private
from embodyhpc.runinfo import RunInfo
from embodyhpc.runlock import RunLock
from tests.test_resume import demo_checkpoint_template, fake_run, refused  # noqa: F401 (a session fixture)

EMBODYHPC = str(Path(sys.executable).parent / "embodyhpc")
HOST = socket.gethostname()


def tree(run: Path) -> dict[str, bytes | None]:
    """Every path under the run (the lock file aside) with its bytes (None: a folder), to compare before/after."""
    out: dict[str, bytes | None] = {}
    for path in sorted(run.rglob("*")):
        rel = str(path.relative_to(run))
        if rel == ".embodyhpc.lock":
            continue
        out[rel] = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    return out


def resumed_once(run: Path) -> RunInfo:
    """Attempt 2 recorded (as `resume` records it) with its outputs of attempt 1 moved: a run resumed once."""
    info = RunInfo.load(run)
    (run / "attempts" / "1" / "scripts").mkdir(parents=True)
    shutil.copy(run / "resolved.yaml", run / "attempts" / "1" / "resolved.yaml")
    (run / "attempts" / "1" / "scripts" / "train.sbatch").write_text("# attempt 1\n")
    info.start_attempt(backend="local", site="local", python=sys.executable, overrides=["train.steps=60"],
                       resumed_from_step=20, created="2026-01-02T00:00:00+0000")
    info.save()
    return info


# ---- the lock: one command at a time ----
def test_a_resume_while_another_command_holds_the_run_is_refused_naming_it(cli, runs_root):
    run = fake_run(runs_root)
    for command, shared in (("embodyhpc resume", False), ("embodyhpc eval", True), ("embodyhpc submit", False)):
        with RunLock(run, command, shared=shared):
            line = refused(cli, run, "train.steps=60")
        assert f"in use by `{command}` (pid {os.getpid()} on {HOST}, since 20" in line, line
    assert cli("resume", str(run), "--dry-run", "train.steps=60").code == 0  # a dry run changes nothing: no lock


def test_cancel_and_eval_are_refused_while_a_resume_holds_the_run(cli, runs_root):
    run = fake_run(runs_root, backend="slurm")
    with RunLock(run, "embodyhpc resume"):
        for args in (("cancel", str(run)), ("eval", "--ckpt", str(run / "checkpoints" / "step-20"), "--local"),
                     ("eval", "--ckpt", str(run), "--local")):
            result = cli(*args)
            lines = result.err.strip().splitlines()
            assert result.code == 2 and len(lines) == 1, (args, result.err)
            assert f"in use by `embodyhpc resume` (pid {os.getpid()} on {HOST}" in lines[0]
    assert not (run / "attempts").exists() and not list(run.glob("evals/*"))


def test_a_chain_running_here_lets_evaluations_in_and_keeps_resumes_out(runs_root):
    """submit/resume turn their lock shared while a local chain runs: `eval --ckpt` (shared) may read the run
    beside it, another resume (exclusive) may not."""
    from embodyhpc.evaluate import source_lock
    from embodyhpc.runlock import RunInUseError

    run = fake_run(runs_root)
    driver = RunLock(run, "embodyhpc submit")
    with driver:
        with pytest.raises(RunInUseError, match="embodyhpc submit"), source_lock(run / "checkpoints" / "step-20"):
            pass
        driver.share()
        with pytest.raises(RunInUseError, match="in use by `embodyhpc submit`"):
            RunLock(run, "embodyhpc resume").acquire()
        with source_lock(run / "checkpoints" / "step-20"), source_lock(run):  # two evaluations side by side
            with pytest.raises(RunInUseError, match="in use by `embodyhpc"):
                RunLock(run, "embodyhpc resume").acquire()
        with pytest.raises(RunInUseError):
            RunLock(run, "embodyhpc resume").acquire()
    with RunLock(run, "embodyhpc resume"):  # all released
        pass


def test_submit_holds_its_new_folder_until_its_chain_is_submitted(monkeypatch, runs_root):
    from embodyhpc import submit as submitting
    from embodyhpc.orchestrate import api
    from embodyhpc.runlock import RunInUseError
    from embodyhpc.validation import load_recipe

    loaded = load_recipe("recipes/demo_metaworld_cpu.yaml", [f"job.runs_root={runs_root}", "data.root=/tmp",
                                                            "tracking.enabled=false"], site="local")
    seen = []

    def run_chain(loaded, info, **kwargs):
        try:
            RunLock(info.run_dir, "embodyhpc resume").acquire()
        except RunInUseError as exc:
            seen.append(exc.message)
        return info

    for backend in ("slurm", "local"):
        monkeypatch.setattr(submitting, "prepare_launch", lambda loaded, *a, backend=backend, **k: (loaded, backend))
        monkeypatch.setattr(api, "run_chain", run_chain)
        info = submitting.submit(loaded, sys.executable, progress=lambda m: None)
        with RunLock(info.run_dir, "embodyhpc resume"):  # released once submit returned
            pass
    assert len(seen) == 2 and all("in use by `embodyhpc submit`" in m for m in seen), seen


# `embodyhpc resume` as installed, its chain replaced by one that takes CHAIN_S to run (a real chain here takes
# half a minute on 2 cores; what matters is that the first holds the run while the second arrives)
RESUME_WITH_A_SLOW_CHAIN = r"""
import sys, time
from embodyhpc import submit
from embodyhpc.orchestrate import api
submit.preflight = lambda *args, **kwargs: []  # the fake run's data folder is empty: no dataset to check
chain_s = float(sys.argv[1])
def run_chain(loaded, info, **kwargs):
    time.sleep(chain_s)
    return info
api.run_chain = run_chain
from embodyhpc.cli.main import main
sys.argv = ["embodyhpc", *sys.argv[2:]]
sys.exit(main())
"""


@pytest.mark.slow
def test_two_resumes_started_together_exactly_one_proceeds(runs_root):
    """Real processes: two `embodyhpc resume` of one run at the same moment. One takes the run (attempt 2), the
    other exits 2 with one line naming it; attempt 1's config is archived once, unchanged (a holder that dies:
    tests/test_runlock.py)."""
    run = fake_run(runs_root, overrides=("eval.enabled=false",))
    original = (run / "resolved.yaml").read_bytes()
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}

    def resume(chain_s: float, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", RESUME_WITH_A_SLOW_CHAIN, str(chain_s), "resume", str(run),
                                 "--local", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)

    procs = [resume(6, "train.steps=60"), resume(6, "train.steps=60")]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    codes = [proc.returncode for proc in procs]
    assert sorted(codes) == [0, 2], (codes, outputs)
    loser = codes.index(2)
    winner = procs[1 - loser]
    lines = outputs[loser][1].strip().splitlines()
    assert len(lines) == 1, outputs[loser]
    assert f"in use by `embodyhpc resume` (pid {winner.pid} on {HOST}, since 20" in lines[0], lines[0]
    assert "attempt 2 of" in outputs[1 - loser][0], outputs[1 - loser]
    info = RunInfo.load(run)
    assert info.attempt == 2 and [a.number for a in info.attempts] == [1]
    assert info.attempt_overrides == ["train.steps=60"]
    assert (run / "attempts" / "1" / "resolved.yaml").read_bytes() == original
    assert sorted(p.name for p in (run / "attempts").iterdir()) == ["1"]


# ---- an archive is never overwritten ----
def test_a_run_json_restored_from_a_backup_cannot_overwrite_the_archive(cli, runs_root):
    run = fake_run(runs_root)
    backup = (run / "run.json").read_bytes()
    resumed_once(run)
    (run / "run.json").write_bytes(backup)  # restored: attempt 1 again, while attempts/1 holds its archive
    before = tree(run)
    result = cli("resume", str(run), "train.steps=60")
    lines = result.err.strip().splitlines()
    assert result.code == 2 and len(lines) == 1, result.err
    line = lines[0]
    assert "attempts/1: exists already, but run.json records attempt 1 as the newest" in line, line
    assert "restore the run.json that recorded attempt 2" in line
    assert tree(run) == before
    assert cli("resume", str(run), "--dry-run", "train.steps=60").code == 2  # the dry run tells the same


@pytest.mark.parametrize("make", ["later folder", "file", "symlink", "half archive", "attempts a file"])
def test_any_archive_at_or_past_the_newest_attempt_is_refused_before_anything_moves(cli, runs_root, tmp_path, make):
    run = fake_run(runs_root)
    (run / "scripts" / "train.sbatch").write_text("# attempt 1's script\n")
    (run / "attempts").mkdir()
    if make == "later folder":  # run.json at 1, an attempts/3 of a lost history
        (run / "attempts" / "3").mkdir()
    elif make == "file":
        (run / "attempts" / "1").write_text("x")
    elif make == "symlink":
        (tmp_path / "elsewhere").mkdir()
        (run / "attempts" / "1").symlink_to(tmp_path / "elsewhere")
    elif make == "half archive":  # an older embodyhpc died after moving scripts/: every retry failed the same way
        (run / "attempts" / "1" / "scripts").mkdir(parents=True)
    else:
        (run / "attempts").rmdir()
        (run / "attempts").write_text("not a folder")
    before = tree(run)
    result = cli("resume", str(run), "train.steps=60")
    problem = "cannot read attempts/: Not a directory" if make == "attempts a file" else "exists already"
    assert result.code == 2 and problem in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert tree(run) == before


# ---- a resume that dies half-way ----
@pytest.fixture
def no_dataset_checks(monkeypatch):
    """The fake run's data folder is empty: submit's preflight (paths, dataset, templates) would refuse it first."""
    from embodyhpc import submit

    monkeypatch.setattr(submit, "preflight", lambda *args, **kwargs: [])


def test_an_error_while_archiving_puts_everything_back(cli, runs_root, monkeypatch, no_dataset_checks):
    run = fake_run(runs_root)
    (run / "scripts" / "train.sbatch").write_text("# attempt 1\n")
    (run / "export").mkdir()
    (run / "export" / "model.safetensors").write_bytes(b"w")
    (run / "eval" / "report.json").write_text("{}")
    before = tree(run)
    real = Path.rename
    calls = []

    def rename(self, target):
        calls.append(self.name)
        if self.name == "report.json":
            raise OSError(28, "No space left on device")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    result = cli("resume", str(run), "--local", "train.steps=60")
    assert result.code == 1 and len(result.err.strip().splitlines()) == 1, result.err
    assert "nothing changed (attempt 1's outputs and resolved.yaml are in place)" in result.err
    assert "archiving them failed (No space left on device" in result.err
    assert {"scripts", "export"} <= set(calls)  # it had moved those before the failure
    monkeypatch.undo()
    assert tree(run) == {k: v for k, v in before.items()} | {"attempts": None}
    assert RunInfo.load(run).attempt == 1


def test_an_error_recording_the_attempt_puts_back_resolved_yaml_too(cli, runs_root, monkeypatch, no_dataset_checks):
    run = fake_run(runs_root)
    before = tree(run)

    def save(self):
        raise OSError(122, "Disk quota exceeded")

    monkeypatch.setattr(RunInfo, "save", save)
    result = cli("resume", str(run), "--local", "train.steps=60")
    assert result.code == 1 and len(result.err.strip().splitlines()) == 1, result.err
    assert "nothing changed" in result.err and "recording attempt 2 failed (Disk quota exceeded)" in result.err
    monkeypatch.undo()
    assert tree(run) == before | {"attempts": None}  # resolved.yaml says train.steps=40 again


CRASH = r"""
import os, sys
from embodyhpc import attempts, submit
from embodyhpc.runinfo import RunInfo
submit.preflight = lambda *args, **kwargs: []  # the fake run's data folder is empty: no dataset to check
point = sys.argv.pop(1)
if point == "before-commit":  # resolved.yaml rewritten, run.json not yet: the process dies
    real_save = RunInfo.save
    RunInfo.save = lambda self: os._exit(9) if self.attempt > 1 else real_save(self)
else:  # run.json records attempt 2, the archive's rename not done
    attempts.commit = lambda *args, **kwargs: os._exit(9)
from embodyhpc.cli.main import main
sys.argv = ["embodyhpc", *sys.argv[1:]]
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("point", ["before-commit", "after-commit"])
def test_a_resume_killed_half_way_is_undone_or_finished_by_the_next(cli, runs_root, point):
    run = fake_run(runs_root)
    (run / "scripts" / "train.sbatch").write_text("# attempt 1\n")
    original = (run / "resolved.yaml").read_bytes()
    before = tree(run)
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    crashed = subprocess.run([sys.executable, "-c", CRASH, point, "resume", str(run), "--local", "train.steps=60"],
                             capture_output=True, text=True, env=env, timeout=120)
    assert crashed.returncode == 9, crashed.stderr
    staging = list((run / "attempts").glob(".1.staging-*"))
    assert len(staging) == 1 and not (run / "scripts" / "train.sbatch").exists()

    dry = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert dry.code == 2 and "stopped half-way" in dry.err and str(staging[0]) in dry.err
    # the next resume (here refused later, for steps below the checkpoint) first repairs what the crash left
    result = cli("resume", str(run), "train.steps=10")
    assert result.code == 2 and "below the step" in result.err
    assert not list((run / "attempts").glob(".*"))
    if point == "before-commit":
        assert "stopped before recording attempt 2" in result.out
        assert tree(run) == before | {"attempts": None}
        assert RunInfo.load(run).attempt == 1
    else:
        assert "stopped after recording attempt 2" in result.out
        assert RunInfo.load(run).attempt == 2
        assert (run / "attempts" / "1" / "resolved.yaml").read_bytes() == original
        assert (run / "attempts" / "1" / "scripts" / "train.sbatch").read_text() == "# attempt 1\n"
        assert "steps: 60" in (run / "resolved.yaml").read_text()


def test_a_staging_folder_run_json_cannot_place_is_refused_not_guessed(cli, runs_root):
    run = fake_run(runs_root)
    resumed_once(run)  # run.json at attempt 2, attempts/1 present
    stray = run / "attempts" / ".1.staging-0123456789abcdef"
    stray.mkdir()
    (stray / "resolved.yaml").write_text("x: 1\n")
    before = tree(run)
    result = cli("resume", str(run), "train.steps=60")
    assert result.code == 2 and "cannot place" in result.err and str(stray) in result.err
    assert tree(run) == before


# ---- the step is the checkpoint's own record ----
@pytest.mark.parametrize("record, problem", [
    ({"step": 4}, "named step-20 but its .complete records step 4"),
    ({"step": 20.0}, "records step 20.0, not a whole number"),
    ({"step": True}, "records step True, not a whole number"),
    ({"step": "20"}, "records step 20, not a whole number"),
    ({"step": 2 ** 64}, "not a whole number from 0 to 9223372036854775807"),
    ({"world_size": 2}, "neither .complete nor trainer.json records the step"),
    ([20], "is not a JSON object"),
])
def test_a_step_folder_whose_record_says_another_step_is_refused(cli, runs_root, record, problem):
    run = fake_run(runs_root)
    (run / "checkpoints" / "step-20" / ".complete").write_text(json.dumps(record))
    line = refused(cli, run, "train.steps=60")
    assert "checkpoints/step-20" in line and problem in line, line


def test_step_8_holding_step_4s_checkpoint_is_refused_whether_copied_renamed_or_linked(cli, runs_root):
    run = fake_run(runs_root, checkpoints=(4,))
    ckpt = run / "checkpoints"
    shutil.copytree(ckpt / "step-4", ckpt / "step-8")  # copied by hand under a newer name
    assert "named step-8 but its .complete records step 4" in refused(cli, run, "train.steps=60")
    shutil.rmtree(ckpt / "step-8")
    (ckpt / "step-8").symlink_to(ckpt / "step-4")  # a link inside checkpoints/: its record still decides
    assert "named step-8 but its .complete records step 4" in refused(cli, run, "train.steps=60")
    (ckpt / "step-8").unlink()
    shutil.copytree(ckpt / "step-4", ckpt / "step-8")  # the marker rewritten, trainer.json still says 4
    layout.write_marker(ckpt / "step-8", {"step": 8})
    (ckpt / "step-8" / "trainer.json").write_text(json.dumps({"version": 1, "step": 4}))
    assert "named step-8 but its trainer.json records step 4" in refused(cli, run, "train.steps=60")


@pytest.mark.parametrize("name, problem", [
    ("step-0004", "a step written with leading zeros (embodyhpc writes step-4)"),
    ("step-+4", "not a step as embodyhpc writes one"),
    ("step-٤", "not a step as embodyhpc writes one"),
    ("step-9223372036854775808", "a step past 9223372036854775807"),
])
def test_a_complete_checkpoint_under_a_near_miss_name_is_refused_with_its_true_name(cli, runs_root, name, problem):
    run = fake_run(runs_root, checkpoints=(4,))
    (run / "checkpoints" / "step-4").rename(run / "checkpoints" / name)
    line = refused(cli, run, "train.steps=60")
    assert f"checkpoints/{name}: a complete checkpoint under a name that is no step folder: {problem}" in line, line


def test_a_near_miss_folder_without_a_marker_is_no_checkpoint_and_is_passed_over(cli, runs_root):
    run = fake_run(runs_root, checkpoints=(20,))
    (run / "checkpoints" / "step-0030").mkdir()
    result = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert result.code == 0 and "from the checkpoint of step 20" in result.out, result.err


def test_a_checkpoint_past_the_runs_train_steps_gets_a_true_message(cli, runs_root):
    run = fake_run(runs_root, steps=40, checkpoints=(20, 100))
    line = refused(cli, run)
    assert "the newest checkpoint holds step 100, past the train.steps=40 resolved.yaml says" in line, line
    assert "pass train.steps=101 or more" in line
    line = refused(cli, run, "train.steps=80")
    assert "step 100, past the train.steps=40" in line
    result = cli("resume", str(run), "--dry-run", "train.steps=101")
    assert result.code == 0 and "from the checkpoint of step 100" in result.out


# ---- decided: links, hand-edited models, site keys ----
def test_a_step_folder_linking_out_of_the_run_is_refused_a_linked_checkpoints_folder_is_not(cli, runs_root,
                                                                                            tmp_path):
    run = fake_run(runs_root, checkpoints=(20,))
    other = tmp_path / "other-run-step-30"
    shutil.copytree(run / "checkpoints" / "step-20", other)
    layout.write_marker(other, {"step": 30})
    (run / "checkpoints" / "step-30").symlink_to(other)
    line = refused(cli, run, "train.steps=60")
    assert f"checkpoints/step-30: a symbolic link to {other}, outside the run's checkpoints/" in line, line
    (run / "checkpoints" / "step-30").unlink()
    scratch = tmp_path / "scratch" / "checkpoints"
    shutil.move(run / "checkpoints", scratch)  # checkpoints/ on scratch storage, linked from the run
    (run / "checkpoints").symlink_to(scratch)
    result = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert result.code == 0 and "from the checkpoint of step 20" in result.out, result.err


@pytest.mark.parametrize("edit, problem", [
    (("size: tiny", "size: small"), "shapes differ"),
    (("action_dim: 4", "action_dim: 7"), "shapes differ"),
])
def test_a_hand_edited_model_in_resolved_yaml_must_fit_the_checkpoint(cli, runs_root, edit, problem):
    run = fake_run(runs_root)
    text = (run / "resolved.yaml").read_text()
    assert text.count(edit[0]) == 1
    write_private(run / "resolved.yaml", text.replace(*edit))
    line = refused(cli, run, "train.steps=60")
    assert "resolved.yaml: model: the model does not fit the checkpoint of step 20" in line and problem in line, line
    result = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert result.code == 2 and "does not fit" in result.err


@pytest.mark.parametrize("damage", ["metadata", "shard"])
def test_a_checkpoint_without_its_dcp_files_is_refused_before_the_queue(cli, runs_root, damage):
    run = fake_run(runs_root)
    folder = run / "checkpoints" / "step-20"
    if damage == "metadata":
        (folder / ".metadata").unlink()
    else:
        next(folder.glob("*.distcp")).write_bytes(b"")
    line = refused(cli, run, "train.steps=60")
    assert "checkpoints/step-20: the checkpoint to resume from is damaged" in line, line


def test_resume_with_a_site_takes_code_choosing_keys_from_it_not_from_resolved_yaml(cli, runs_root, tmp_path):
    old = tmp_path / "old-site.yaml"
    old.write_text("site:\n  name: old\n  partition: debug\n  gpu_request: none\n  python: /opt/old/bin/python\n"
                   "  modules: [cuda/old-11]\n  container:\n    image: /images/old.sqsh\n")
    new = tmp_path / "new-site.yaml"
    new.write_text("site:\n  name: new\n  partition: debug\n  gpu_request: none\n  modules: [cuda/new-12]\n")
    run = fake_run(runs_root, site=str(old))
    kept = cli("resume", str(run), "--dry-run", "train.steps=60")
    assert kept.code == 0, kept.err
    assert "/opt/old/bin/python" in kept.out and "old.sqsh" in kept.out and "module load cuda/old-11" in kept.out
    given = cli("resume", str(run), "--dry-run", "--site", str(new), "train.steps=60")
    assert given.code == 0, given.err
    changes, _, scripts = given.out.partition("# sbatch ")
    assert "site.python: '/opt/old/bin/python' -> None" in changes
    assert "module load cuda/new-12" in scripts
    for stale in ("/opt/old/bin/python", "old.sqsh", "cuda/old-11"):
        assert stale not in scripts, stale
