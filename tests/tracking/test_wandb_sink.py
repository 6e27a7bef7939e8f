"""W&B as a second sink, offline: what it writes is read back from the run's offline files (the .wandb transaction
log, parsed here as the LevelDB log format W&B documents, its records with W&B's own protobuf classes), not from
our code: training metrics under MLflow's names at their steps, an evaluation's metrics against checkpoint_step with
its videos and plots in the media panel, and one run id across a requeue and the report job."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest

from embodyhpc.config.schema import TrackingConfig
from embodyhpc.errors import ConfigError
from embodyhpc.tracking import wandb_sink
from embodyhpc.tracking.evaluation import headline_metrics
from embodyhpc.validation import load_recipe
from tests.helpers import require

BLOCK = 32768
HEADER = 7  # ":W&B" + magic (2 bytes) + version; each record: crc32 (4), length (2), type (1)


def wandb_records(path: Path) -> list:
    """Every record of a .wandb file (FULL=1, FIRST=2, MIDDLE=3, LAST=4 chunks; a block's tail under 7 bytes is
    padding)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:HEADER]
    pos, out, parts = HEADER, [], b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            parts = chunk
        elif kind == 3:
            parts += chunk
        elif kind == 4:
            out.append(parts + chunk)
    records = []
    for raw in out:
        record = pb.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def _finished(path: Path, wait_s: float = 60.0) -> list:
    """The records once W&B's service wrote the run's exit record (it flushes the file after run.finish returns)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        records = wandb_records(path)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def offline_runs(run_dir: Path) -> list[tuple[str, list[dict], list]]:
    """(run id, history rows as {key: value}, metric definitions) of each offline folder, oldest first."""
    found = []
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        records = _finished(next(folder.glob("run-*.wandb")))
        run_id = next(r.run.run_id for r in records if r.WhichOneof("record_type") == "run")
        rows = [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
                for r in records if r.WhichOneof("record_type") == "history"]
        metrics = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
        found.append((run_id, rows, metrics))
    return found


def tracking(**overrides) -> TrackingConfig:
    return TrackingConfig(backends=["mlflow", "wandb"], **overrides)


def test_the_run_id_is_stored_once_and_kept(tmp_path):
    assert wandb_sink.wandb_run_id(tmp_path, "a1b2c3") == "a1b2c3"  # the MLflow run id, when there is one
    assert (tmp_path / "wandb" / "run-id").read_text() == "a1b2c3\n"
    assert wandb_sink.wandb_run_id(tmp_path, "other") == "a1b2c3"  # a requeue, a resume, the report: the stored one
    fresh = wandb_sink.wandb_run_id(tmp_path / "adhoc")
    assert len(fresh) == 32 and wandb_sink.wandb_run_id(tmp_path / "adhoc") == fresh
    (tmp_path / "wandb" / "run-id").write_text("../../etc\n")
    with pytest.raises(ValueError, match=r"wandb/run-id: '../../etc' is not a W&B run id"):
        wandb_sink.wandb_run_id(tmp_path)


def test_backends_refuse_what_they_cannot_do():
    assert TrackingConfig().backends == ["mlflow"] and TrackingConfig().wandb_mode == "offline"
    assert not wandb_sink.enabled(TrackingConfig()) and wandb_sink.enabled(tracking())
    assert not wandb_sink.enabled(tracking(enabled=False))
    for bad, match in [(dict(backends=["wandb"]), "must name mlflow once"),
                       (dict(backends=["mlflow", "mlflow"]), "must name mlflow once"),
                       (dict(backends=["mlflow", "tensorboard"]), "'tensorboard' is not one of mlflow, wandb"),
                       (dict(wandb_mode="cloud"), "'cloud' is not one of offline, online"),
                       (dict(wandb_project="a/b"), "not a plain name")]:
        with pytest.raises(ConfigError, match=match):
            TrackingConfig(**bad)


@pytest.mark.slow  # ~3 s: three offline wandb.init (one per process of a real run)
def test_offline_sink_writes_the_same_names_media_and_one_run_id(tmp_path, monkeypatch):
    require("wandb", "track")
    monkeypatch.setenv("WANDB_MODE", "online")  # the recipe's mode wins over the environment
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    config = tracking()
    run_id = wandb_sink.wandb_run_id(tmp_path, "0123abcd" * 4)
    first = wandb_sink.WandbSink(tmp_path, config, project="demo", run_id=run_id)
    for step in (25, 50):
        first.write(step, {"loss": 1.0 / step, "lr": 1e-3, "bad": float("nan")})
    first.close("RUNNING")  # requeued: the next attempt goes on with the same run
    again = wandb_sink.WandbSink(tmp_path, config, project="demo", run_id=wandb_sink.wandb_run_id(tmp_path))
    again.write(75, {"loss": 0.01})
    again.close("FINISHED")

    video = tmp_path / "eval" / "videos" / "trained" / "reach-v3" / "success-seed100-ep0000.mp4"
    video.parent.mkdir(parents=True)
    video.write_bytes(bytes.fromhex("000000186674797069736f6d0000020069736f6d69736f32") + bytes(64))
    plot = tmp_path / "task_success.png"
    from PIL import Image

    Image.new("RGB", (8, 8), (255, 0, 0)).save(plot)
    results = {"policies": {"trained": {"overall": {"success_rate": 0.5, "ci_low": 0.1, "ci_high": 0.9},
                                        "tasks": {"reach-v3": {"success_rate": 0.5}}}}}
    metrics = headline_metrics(results)
    wandb_sink.log_evaluation_wandb(tmp_path, config, project="demo", run_id=wandb_sink.wandb_run_id(tmp_path),
                                    step=50, metrics=metrics, images={"task_success": plot}, videos=[video])

    runs = offline_runs(tmp_path)
    assert [r[0] for r in runs] == [run_id] * 3  # training, its requeue, the report: one W&B run
    train_rows = [row for _, rows, _ in runs[:2] for row in rows]
    assert [(row["_step"], row["train/loss"]) for row in train_rows] == [(25, 0.04), (50, 0.02), (75, 0.01)]
    assert "train/bad" not in train_rows[0] and train_rows[0]["train/lr"] == 1e-3
    (evaluation,) = runs[2][1]
    assert {key: evaluation[key] for key in metrics} == metrics  # eval/trained/success_rate, eval/reach-v3/...
    assert set(metrics) == {"eval/trained/success_rate", "eval/trained/success_ci_low",
                            "eval/trained/success_ci_high", "eval/reach-v3/success_rate", "success_rate"}
    assert evaluation["checkpoint_step"] == 50
    assert evaluation["eval/videos/trained/reach-v3/_type"] == "videos"  # the media panel, with the step
    assert evaluation["eval/videos/trained/reach-v3/captions"] == ["step 50: success-seed100-ep0000"]
    assert evaluation["eval/plots/task_success/_type"] == "image-file"
    copied = list((tmp_path / "wandb").glob("offline-run-*/files/media/videos/**/*.mp4"))
    assert [p.read_bytes() for p in copied] == [video.read_bytes()]
    defined = {(m.glob_name or m.name, m.step_metric) for m in runs[2][2]}
    assert ("eval/*", "checkpoint_step") in defined and ("success_rate", "checkpoint_step") in defined
    assert not list((tmp_path / "wandb").glob("run-2*"))  # offline folders only: nothing tried to upload


def test_a_broken_wandb_never_reaches_training(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise RuntimeError("no network")

    monkeypatch.setattr(wandb_sink, "start_run", refuse)
    sink = wandb_sink.WandbSink(tmp_path, tracking(), project="demo", run_id="abc")
    sink.write(1, {"loss": 1.0})
    sink.write(2, {"loss": 0.5})
    sink.close()
    err = capsys.readouterr().err
    assert err.count("W&B run abc not started (RuntimeError: no network)") == 1 and sink.sent == 0


def test_the_mode_comes_from_the_recipe(tmp_path, monkeypatch):
    seen = {}
    fake = SimpleNamespace(Settings=lambda **kw: kw, init=lambda **kw: seen.update(kw) or "run")
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    wandb_sink.start_run(tmp_path, tracking(), project="p", run_id="r1")
    assert seen["settings"]["mode"] == "offline" and seen["id"] == "r1" and seen["resume"] == "allow"
    assert seen["dir"] == str(tmp_path) and seen["settings"]["console"] == "off"
    wandb_sink.start_run(tmp_path, tracking(wandb_mode="online", wandb_entity="team"), project="p", run_id="r1")
    assert seen["settings"]["mode"] == "online" and seen["entity"] == "team"


def test_a_recipe_with_wandb_gets_the_training_sink_beside_mlflows(tmp_path):
    """launch/observe.py: tracking.backends [mlflow, wandb] gives rank 0's loop a W&B sink whose run id is the MLflow
    run's the first time and is kept in the run folder after (resume and requeue reuse it); [mlflow] gives none."""
    from embodyhpc.launch.observe import wandb_sink_for

    config = load_recipe("recipes/smoke_cpu.yaml", ["tracking.enabled=true", "tracking.backends=[mlflow,wandb]",
                                                   "tracking.wandb_project=proj"]).config
    sink = wandb_sink_for(config, tmp_path, "mlflow-run-1")
    assert sink.project == "proj" and sink.run_id == "mlflow-run-1" and sink.prefix == "train/"
    assert wandb_sink_for(config, tmp_path, "mlflow-run-2").run_id == "mlflow-run-1"  # kept across attempts
    mlflow_only = load_recipe("recipes/smoke_cpu.yaml", ["tracking.enabled=true"]).config
    assert wandb_sink_for(mlflow_only, tmp_path, "x") is None
