"""`submit --local` and `eval --local` exit 1 with the reason on one line when the chain did not complete: a job
failed, or fewer than N of N shards completed. Tiny chains: one training process, a few shards."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.helpers import run_dir_from, statuses

pytestmark = pytest.mark.sim  # steps a simulator

DEMO = "recipes/smoke_cpu.yaml"
TINY = ("resources.nodes=1", "eval.shards=3", "eval.array_parallelism=3")
CHUNK = "{action: [" + ", ".join(str(i / 10) for i in range(10)) + "]}"  # model.action_horizon 10 at 10 fps

# `import metaworld` in a job: takes one token from $BROKEN_METAWORLD_TOKENS (atomically) and fails, or, when none
# is left, imports the real package. Shards run as processes of their own, so N tokens break N of them.
SHADOW = '''
import importlib, os, sys
tokens = os.environ["BROKEN_METAWORLD_TOKENS"]
for name in sorted(os.listdir(tokens)):
    try:
        os.rename(os.path.join(tokens, name), os.path.join(tokens, name + f".taken-{os.getpid()}"))
    except FileNotFoundError:
        continue
    if ".taken" not in name:
        raise ImportError("metaworld broken in this process (test double)")
here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["metaworld"]
sys.modules["metaworld"] = importlib.import_module("metaworld")
'''


@pytest.fixture
def broken_metaworld(tmp_path, monkeypatch):
    """Returns a function that makes the next `n` imports of metaworld in jobs fail."""
    shadow = tmp_path / "shadow" / "metaworld"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(SHADOW)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    repo = Path(__file__).resolve().parents[2]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(shadow.parent), str(repo)]))
    monkeypatch.setenv("BROKEN_METAWORLD_TOKENS", str(tokens))

    def break_next(n: int) -> None:
        for i in range(n):
            (tokens / f"t{i}").touch()
    return break_next


def _one_line_error(result) -> str:
    errors = [line for line in result.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.err, result.err
    return errors[0]


@pytest.mark.slow
def test_training_that_fails_at_train_time_exits_1(cli, runs_root, tmp_path):
    # metadata intact (passes every check at submit, which refuses a dataset it cannot read), a video cut in half:
    # training breaks when a worker decodes a frame of the lost half
    root = tmp_path / "demos"
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample", root)
    garbage = root / "videos" / "observation.images.top" / "chunk-000" / "file-000.mp4"
    garbage.chmod(0o644)
    garbage.write_bytes(garbage.read_bytes()[: garbage.stat().st_size // 2])
    result = cli("submit", DEMO, "--local", "--json", f"job.runs_root={runs_root}", *TINY, "data.format=lerobot",
                 f"data.root={root}", f"data.delta_timestamps={CHUNK}", "train.warmup_steps=1")
    assert result.code == 1
    error = _one_line_error(result)
    assert "train FAILED" in error and str(garbage) in error and "0 of 3 shards completed" in error
    assert statuses(cli, run_dir_from(result.out))["eval"]["state"] == "CANCELLED"  # --json still prints the run


@pytest.mark.slow
def test_no_shard_completing_exits_1(cli, runs_root, broken_metaworld):
    broken_metaworld(4)  # every shard, and the report
    result = cli("submit", DEMO, "--local", f"job.runs_root={runs_root}", *TINY, "train.steps=2")
    assert result.code == 1
    # the first failed shard's own reason, not only a count: the user reads why without opening a log
    error = _one_line_error(result)
    assert "eval FAILED (3 shard(s) failed; first, shard 0: ImportError: " in error
    assert "metaworld broken in this process" in error and "0 of 3 shards completed" in error
    assert "train" not in _one_line_error(result).split(":", 2)[2].split(";")[0]  # training completed


@pytest.mark.slow
def test_one_of_three_shards_failing_exits_1(cli, runs_root, broken_metaworld):
    broken_metaworld(1)
    result = cli("submit", DEMO, "--local", "--json", f"job.runs_root={runs_root}", *TINY, "train.steps=2")
    assert result.code == 1
    error = _one_line_error(result)
    assert "2 of 3 shards completed" in error and "report incomplete" in error
    assert statuses(cli, run_dir_from(result.out))["eval"]["array_counts"] == {"COMPLETED": 2, "FAILED": 1}


@pytest.mark.slow
def test_eval_local_with_failing_shards_exits_1(cli, training_run, broken_metaworld):
    run, _ = training_run  # a checkpoint of the recipe's model: export and its checks pass, the shards then fail
    broken_metaworld(8)
    result = cli("eval", "--ckpt", str(run / "checkpoints" / "step-40"), "--local", "eval.shards=3",
                 "eval.episodes_per_task=1", "eval.max_steps=5", "eval.reference_policies=[]")
    assert result.code == 1
    assert "0 of 3 shards completed" in _one_line_error(result)


@pytest.mark.slow
def test_eval_local_names_why_the_shards_failed(cli, training_run, runs_root):
    """A failure only the shard can see (it asks for a GPU; CUDA sees none on this node): `eval --local` exits 1
    with the shard's own one-line reason in the "eval FAILED" line."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this node has a GPU: the shards would not fail")
    run, _ = training_run
    result = cli("eval", "--ckpt", str(run / "checkpoints" / "step-40"), "--local", f"job.runs_root={runs_root}",
                 "eval.shards=2", "eval.episodes_per_task=1", "eval.max_steps=2", "eval.reference_policies=[]",
                 "eval.gpus_per_task=1")
    assert result.code == 1
    error = _one_line_error(result)
    assert ("eval FAILED (2 shard(s) failed; first, shard 0: RuntimeError: the evaluation asks for 1 GPU(s) per "
            "shard (eval.gpus_per_task) but CUDA sees none on this node; set eval.gpus_per_task=0") in error, error


def _record(run: Path, report: dict | None, jobs: dict[str, dict]) -> None:
    from embodyhpc.runinfo import JobRecord, RunInfo

    (run / "eval").mkdir(parents=True, exist_ok=True)
    RunInfo(run_id=run.name, run_dir=str(run), backend="local", recipe="x", site=None, overrides=[], python="py",
            created="now", jobs={k: JobRecord(kind=k, **v) for k, v in jobs.items()}).save()
    if report is not None:
        (run / "eval" / "report.json").write_text(json.dumps(report))


COMPLETE = {"outcome": "complete", "why": "all shards reported"}
DONE = {"state": "COMPLETED", "job_id": "1"}
CASES = {
    "complete": ({}, COMPLETE, None),
    "train failed": ({"train": {"state": "FAILED", "reason": "OOM"}}, COMPLETE, "train FAILED (OOM)"),
    "train never ran": ({"train": {"state": None}}, COMPLETE, "train never ran"),
    "3 of 4 shards": ({"eval": {"state": "COMPLETED", "array_size": 4, "array_counts": {"COMPLETED": 3}}},
                      COMPLETE, "eval 3 of 4 shards completed"),
    "0 of 4 shards": ({"eval": {"state": "CANCELLED", "array_size": 4}}, COMPLETE,
                      "eval CANCELLED, 0 of 4 shards completed"),
    "report incomplete": ({}, {"outcome": "incomplete", "why": "1 of 4 evaluation shards missing"},
                          "report incomplete: 1 of 4"),
    "no report file": ({}, None, "no report.json"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_why_a_chain_did_not_complete(tmp_path, case):
    from embodyhpc.submit import chain_failure

    jobs, report, expected = CASES[case]
    run = tmp_path / "run"
    _record(run, report, {"train": DONE, "eval": {**DONE, "array_size": 4, "array_counts": {"COMPLETED": 4}},
                          "report": DONE, **jobs})
    why = chain_failure(run)
    assert why is None if expected is None else expected in why and "\n" not in why


def test_a_failed_evaluation_beside_training_counts(tmp_path):
    from embodyhpc.submit import chain_failure

    run = tmp_path / "run"
    _record(run, COMPLETE, {"train": DONE, "report": DONE})
    _record(run / "evals" / "step-2", COMPLETE, {"export": {"state": "FAILED", "reason": "truncated weights"},
                                                  "report": DONE})
    assert chain_failure(run) == "the chain did not complete: evaluation step-2: export FAILED (truncated weights)"
    (run / "evals" / "step-2" / "run.json").write_text("{")
    assert "evaluation step-2: " in chain_failure(run) and "damaged run.json" in chain_failure(run)
