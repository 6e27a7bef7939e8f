"""What a checkpoint carries besides weights (embodyhpc/models/checkpoint_assets.py): the state statistics and the
tokenizer of LeRobot's and openpi's published folders and of our exports, the recipe's overrides, and every way a
statistics file can be wrong (one line naming the file, the key and the fix; exit 2 at validate)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models.checkpoint_assets import (
    find_checkpoint_tokenizer,
    read_stats_file,
    resolve_normalizer,
    resolve_tokenizer,
)
from tests.helpers import one_line_error
from tests.models import published_assets as pa

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample"
CHUNK = f"data.delta_timestamps.action=[{','.join(str(i / 10) for i in range(10))}]"  # the fixture's 10 fps, horizon 10
DATASET_STATS = json.loads((FIXTURE / "meta" / "stats.json").read_text())["observation.state"]


def model(mode="quantile", **kw) -> ModelConfig:
    return ModelConfig(size="tiny", state_norm=mode, **kw)


def quantile_offset_scale(q01, q99):
    return ([(a + b) / 2 for a, b in zip(q01, q99, strict=True)], [(b - a) / 2 for a, b in zip(q01, q99, strict=True)])


# ---------------------------------------------------------------- the layouts a user meets

def test_a_lerobot_policy_folder_gives_its_quantile_statistics_and_its_tokenizer(tmp_path):
    folder = pa.lerobot_policy_folder(tmp_path / "pi05_libero")
    normalizer, source = resolve_normalizer(model(init_weights=str(folder)), str(FIXTURE))
    assert source.endswith("policy_preprocessor.json")
    offset, scale = quantile_offset_scale(pa.CHECKPOINT_Q01, pa.CHECKPOINT_Q99)
    assert normalizer.offset == pytest.approx(offset) and normalizer.scale == pytest.approx(scale)
    # init_weights may name the weights file itself: the folder around it is the checkpoint's
    again, _ = resolve_normalizer(model(init_weights=str(folder / "model.safetensors")), str(FIXTURE))
    assert again == normalizer
    path, source = resolve_tokenizer(model(init_weights=str(folder)))
    assert path == str(folder / "tokenizer" / "tokenizer.model") and "init_weights" in source


def test_mean_std_from_lerobot_when_its_norm_map_says_mean_std(tmp_path):
    folder = pa.lerobot_policy_folder(tmp_path / "ckpt", pipeline=pa.preprocessor_json("MEAN_STD"), tokenizer=False)
    normalizer, _ = resolve_normalizer(model("mean_std", init_weights=str(folder)), str(FIXTURE))
    assert normalizer.offset == pytest.approx(pa.CHECKPOINT_MEAN)
    assert normalizer.scale == pytest.approx(pa.CHECKPOINT_STD)


def test_an_openpi_folder_gives_its_asset_statistics_and_no_tokenizer(tmp_path):
    folder = pa.openpi_folder(tmp_path / "pi05_libero_pytorch")
    normalizer, source = resolve_normalizer(model(init_weights=str(folder)), str(FIXTURE))
    assert source.endswith("assets/physical-intelligence/libero/norm_stats.json")
    assert normalizer.key == "observation.state"  # openpi's "state" entry, under the recipe's state key
    assert normalizer.offset == pytest.approx(quantile_offset_scale(pa.CHECKPOINT_Q01, pa.CHECKPOINT_Q99)[0])
    assert resolve_tokenizer(model(init_weights=str(folder))) == (None, "built-in")


def test_an_embodyhpc_export_gives_its_normalization_json_and_tokenizer_copy(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "normalization.json").write_text(json.dumps(
        {"key": "observation.state", "mode": "mean_std", "offset": pa.CHECKPOINT_MEAN, "scale": pa.CHECKPOINT_STD}))
    pa.train_sentencepiece(export / "tokenizer.model")
    normalizer, _ = resolve_normalizer(model("mean_std", init_weights=str(export)), str(FIXTURE))
    assert normalizer.offset == pytest.approx(pa.CHECKPOINT_MEAN)
    assert resolve_tokenizer(model(init_weights=str(export)))[0] == str(export / "tokenizer.model")


def test_a_checkpoint_without_statistics_falls_back_to_the_dataset_under_auto(tmp_path):
    folder = tmp_path / "weights-only"
    folder.mkdir()
    normalizer, source = resolve_normalizer(model(init_weights=str(folder)), str(FIXTURE))
    assert source.endswith("meta/stats.json")
    assert normalizer.offset == pytest.approx(quantile_offset_scale(DATASET_STATS["q01"], DATASET_STATS["q99"])[0])


# ---------------------------------------------------------------- the recipe's overrides

def test_the_recipe_overrides_either(tmp_path):
    folder = pa.lerobot_policy_folder(tmp_path / "ckpt")
    dataset, source = resolve_normalizer(model(init_weights=str(folder), norm_stats="dataset"), str(FIXTURE))
    assert source.endswith("meta/stats.json") and dataset.offset[0] == pytest.approx(
        (DATASET_STATS["q01"][0] + DATASET_STATS["q99"][0]) / 2)
    other = pa.openpi_folder(tmp_path / "other", state={"mean": [0.0] * 6, "std": [1.0] * 6,
                                                       "q01": [-7.0] * 6, "q99": [7.0] * 6})
    named, _ = resolve_normalizer(model(init_weights=str(folder), norm_stats=str(other)), str(FIXTURE))
    assert named.scale == pytest.approx([7.0] * 6)
    own_tokenizer = pa.train_sentencepiece(tmp_path / "mine.model", vocab_size=50)
    assert resolve_tokenizer(model(init_weights=str(folder), tokenizer_path=str(own_tokenizer)))[0] == \
        str(own_tokenizer)


def test_the_runs_own_statistics_and_tokenizer_win_on_resume(tmp_path):
    folder = pa.lerobot_policy_folder(tmp_path / "ckpt")
    run_checkpoints = tmp_path / "run" / "checkpoints"
    run_checkpoints.mkdir(parents=True)
    started, _ = resolve_normalizer(model(norm_stats="dataset"), str(FIXTURE))
    started.save(run_checkpoints)
    (run_checkpoints / "tokenizer.model").write_bytes((folder / "tokenizer" / "tokenizer.model").read_bytes())
    kept, source = resolve_normalizer(model(init_weights=str(folder)), str(FIXTURE), run_checkpoints=run_checkpoints)
    assert kept == started and "kept on resume" in source
    assert resolve_tokenizer(model(init_weights=str(tmp_path / "gone")), run_checkpoints=run_checkpoints)[0] == \
        str(run_checkpoints / "tokenizer.model")
    # a run that started with the built-in tokenizer keeps it, even if its init checkpoint gained one since
    (run_checkpoints / "tokenizer.model").unlink()
    assert resolve_tokenizer(model(init_weights=str(folder)), run_checkpoints=run_checkpoints)[0] is None


def test_tokenizer_locations_and_names_that_escape_the_folder(tmp_path):
    root_file = tmp_path / "a"
    pa.train_sentencepiece(root_file / "tokenizer.model")
    assert find_checkpoint_tokenizer(root_file) == root_file / "tokenizer.model"
    json_only = tmp_path / "b"
    json_only.mkdir()
    (json_only / "tokenizer.json").write_text("{}")
    assert find_checkpoint_tokenizer(json_only) == json_only / "tokenizer.json"
    # a step naming a folder elsewhere, a hub id (older LeRobot folders) or an absolute path: not followed
    for name in ("../a", "google/paligemma-3b-pt-224", str(root_file)):
        folder = tmp_path / f"c{abs(hash(name))}"
        folder.mkdir()
        (folder / "policy_preprocessor.json").write_text(json.dumps(pa.preprocessor_json(tokenizer_name=name)))
        assert find_checkpoint_tokenizer(folder) is None, name


# ---------------------------------------------------------------- hostile statistics files

def _lerobot(tmp_path, name, *, stats=None, pipeline=None, raw_state=None):
    folder = pa.lerobot_policy_folder(tmp_path / name, stats=stats, pipeline=pipeline, tokenizer=False)
    if raw_state is not None:
        (folder / "policy_preprocessor_step_3_normalizer_processor.safetensors").write_bytes(raw_state)
    return folder / "policy_preprocessor.json"


def _openpi(tmp_path, name, state):
    return pa.openpi_folder(tmp_path / name, state=state) / "assets" / "physical-intelligence" / "libero" / \
        "norm_stats.json"


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def _ours(tmp_path, name, **fields):
    data = {"key": "observation.state", "mode": "quantile", "offset": [0.0] * 6, "scale": [1.0] * 6, **fields}
    return _write(tmp_path, name, json.dumps(data))


GOOD = {"mean": pa.CHECKPOINT_MEAN, "std": pa.CHECKPOINT_STD, "q01": pa.CHECKPOINT_Q01, "q99": pa.CHECKPOINT_Q99}
NAN, INF = float("nan"), float("inf")


def hostile_cases(tmp_path):
    """(name, file, recipe mode, words the one line must hold): classes structure, key, shape, values, mode."""
    q01 = pa.CHECKPOINT_Q01
    pipeline = pa.preprocessor_json()
    no_norm = {**pipeline, "steps": [s for s in pipeline["steps"] if s["registry_name"] != "normalizer_processor"]}
    return [
        # structure
        ("not json", _write(tmp_path, "broken.json", "{not json"), "quantile", ["cannot read it as JSON"]),
        ("unknown json", _write(tmp_path, "other.json", json.dumps({"a": 1})), "quantile", ["not a statistics file"]),
        ("steps not a list", _write(tmp_path, "steps.json", json.dumps({"steps": 3})), "quantile", ["'steps'"]),
        ("no normalizer step", _lerobot(tmp_path, "nonorm", pipeline=no_norm), "quantile", ["no normalizer_processor"]),
        ("state_file escapes", _lerobot(tmp_path, "escape", pipeline=pa.preprocessor_json(
            state_file="../../etc/x.safetensors")), "quantile", ["state_file"]),
        ("state_file missing", _lerobot(tmp_path, "nofile", pipeline=pa.preprocessor_json(
            state_file="gone.safetensors")), "quantile", ["gone.safetensors"]),
        ("damaged safetensors", _lerobot(tmp_path, "damaged", raw_state=b"\x00" * 40), "quantile",
         ["not a readable safetensors"]),
        ("norm_stats not a mapping", _write(tmp_path, "ns.json", json.dumps({"norm_stats": [1]})), "quantile",
         ["norm_stats is not a mapping"]),
        # key
        ("lerobot state key missing", _lerobot(tmp_path, "nokey", stats=pa.lerobot_stats(**{
            f"observation.state.{s}": None for s in ("q01", "q99", "mean", "std", "min", "max")})), "quantile",
         ["no statistics for 'observation.state'", "action"]),
        ("openpi without state", _write(tmp_path, "nostate.json", json.dumps({"norm_stats": {"actions": GOOD}})),
         "quantile", ["no statistics", "actions"]),
        ("ours of another key", _ours(tmp_path, "key.json", key="observation.environment_state"), "quantile",
         ["observation.environment_state"]),
        # shape
        ("lerobot dim differs", _lerobot(tmp_path, "dim", stats=pa.lerobot_stats(**{
            "observation.state.q01": q01 + [0.0], "observation.state.q99": pa.CHECKPOINT_Q99 + [1.0]})), "quantile",
         ["7 values", "state has 6"]),
        ("openpi dim differs", _openpi(tmp_path, "odim", {**GOOD, "q01": q01[:5], "q99": pa.CHECKPOINT_Q99[:5]}),
         "quantile", ["5 values", "state has 6"]),
        ("ours dim differs", _ours(tmp_path, "dim.json", offset=[0.0] * 8, scale=[1.0] * 8), "quantile",
         ["8 values"]),
        ("q01 and q99 lengths differ", _openpi(tmp_path, "len", {**GOOD, "q01": q01[:4]}), "quantile",
         ["q01 has 4 values"]),
        ("empty list", _openpi(tmp_path, "empty", {**GOOD, "q01": []}), "quantile", ["not a list of numbers"]),
        ("strings", _openpi(tmp_path, "str", {**GOOD, "q99": ["a"] * 6}), "quantile", ["not a list of numbers"]),
        # values
        ("nan", _openpi(tmp_path, "nan", {**GOOD, "q01": [NAN] + q01[1:]}), "quantile", ["q01[0] is nan"]),
        ("inf", _openpi(tmp_path, "inf", {**GOOD, "std": [1.0, INF, 1, 1, 1, 1]}), "mean_std", ["std[1] is inf"]),
        ("lerobot nan", _lerobot(tmp_path, "lnan", stats=pa.lerobot_stats(**{
            "observation.state.q99": [1.0] * 5 + [NAN]})), "quantile", ["q99[5] is nan"]),
        ("negative std", _openpi(tmp_path, "negstd", {**GOOD, "std": [1.0, 1.0, -0.5, 1.0, 1.0, 1.0]}), "mean_std",
         ["std[2] = -0.5 is negative"]),
        ("q99 below q01", _openpi(tmp_path, "swap", {**GOOD, "q01": pa.CHECKPOINT_Q99, "q99": q01}), "quantile",
         ["q99[0] < q01[0]"]),
        ("ours negative scale", _ours(tmp_path, "neg.json", scale=[1.0] * 5 + [-1.0]), "quantile",
         ["scale[5] = -1.0 is negative"]),
        # mode
        ("quantile needed, only mean/std", _openpi(tmp_path, "noq", {**GOOD, "q01": None, "q99": None}), "quantile",
         ["no q01/q99", "model.state_norm=mean_std"]),
        ("mean_std needed, only quantiles", _lerobot(tmp_path, "onlyq", stats=pa.lerobot_stats(**{
            "observation.state.mean": None, "observation.state.std": None}), pipeline=pa.preprocessor_json(
            "MEAN_STD")), "mean_std", ["no mean/std", "model.state_norm=quantile"]),
        ("lerobot trained quantile, recipe mean_std", _lerobot(tmp_path, "mode"), "mean_std",
         ["normalised observation.state with quantile", "model.state_norm=quantile"]),
        ("lerobot trained min_max", _lerobot(tmp_path, "minmax", pipeline=pa.preprocessor_json("MIN_MAX")),
         "quantile", ["with min_max"]),
        ("ours trained mean_std, recipe quantile", _ours(tmp_path, "mode.json", mode="mean_std"), "quantile",
         ["with mean_std", "model.state_norm=mean_std"]),
    ]


def test_hostile_statistics_files_are_one_line_naming_file_key_and_fix(tmp_path):
    cases = hostile_cases(tmp_path)
    for name, path, mode, words in cases:
        with pytest.raises(ConfigError) as caught:
            read_stats_file(path, key="observation.state", mode=mode, state_dim=6)
        line = caught.value.one_line()
        assert "\n" not in line and "model.norm_stats" in line and "(fix:" in line, (name, line)
        assert caught.value.where and Path(caught.value.where).name in line, (name, line)
        for word in words:
            assert word in line, (name, word, line)
    assert len(cases) == 28  # 8 structure, 3 key, 6 shape, 6 values, 5 mode


def test_where_the_statistics_come_from_is_checked_too(tmp_path):
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    two_assets = pa.openpi_folder(tmp_path / "pi05_base", asset_ids=("droid", "trossen"))
    cases = [
        (model(init_weights=str(weights_only), norm_stats="init"), ["carries no normalisation statistics"]),
        (model(norm_stats="init"), ["needs model.init_weights"]),
        (model(init_weights=str(two_assets)), ["2 asset ids", "droid, trossen"]),
        (model(norm_stats=str(weights_only)), ["holds no normalisation statistics"]),
        (model(norm_stats=str(tmp_path / "gone.json")), ["no statistics file"]),
    ]
    for cfg, words in cases:
        with pytest.raises(ConfigError) as caught:
            resolve_normalizer(cfg, str(FIXTURE))
        line = caught.value.one_line()
        assert "model.norm_stats" in line and "(fix:" in line and all(w in line for w in words), line


def test_the_dataset_statistics_are_checked_as_well(tmp_path):
    import shutil

    copy = tmp_path / "dataset"
    shutil.copytree(FIXTURE, copy)
    stats = json.loads((copy / "meta" / "stats.json").read_text())
    stats["observation.state"]["std"][3] = -1.0
    (copy / "meta" / "stats.json").write_text(json.dumps(stats))
    with pytest.raises(ConfigError, match=r"meta/stats.json.*is negative"):
        resolve_normalizer(model("mean_std"), str(copy))


def test_the_normalizer_of_a_checkpoint_normalises_as_lerobot_does(tmp_path):
    """LeRobot's QUANTILES: 2 (x - q01) / (q99 - q01) - 1; ours then clips to [-1, 1]."""
    folder = pa.lerobot_policy_folder(tmp_path / "ckpt", tokenizer=False)
    normalizer, _ = resolve_normalizer(model(init_weights=str(folder)), str(FIXTURE))
    x = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    q01, q99 = np.asarray(pa.CHECKPOINT_Q01), np.asarray(pa.CHECKPOINT_Q99)
    expected = np.clip(2 * (x - q01) / (q99 - q01) - 1, -1, 1)
    assert np.allclose(normalizer(x), expected, atol=1e-6) and not any(math.isnan(v) for v in normalizer(x))


# ---------------------------------------------------------------- validate: before anything is submitted

def test_validate_refuses_a_bad_statistics_file_in_one_line(cli, tmp_path):
    bad = _openpi(tmp_path, "nan", {**GOOD, "q01": [NAN] + pa.CHECKPOINT_Q01[1:]})
    args = ["smoke_cpu", "data.format=lerobot", f"data.root={FIXTURE}", "model.state_norm=quantile", CHUNK]
    result = cli("validate", *args, f"model.norm_stats={bad}")
    assert result.code == 2
    one_line_error(result, "model.norm_stats", "norm_stats.json", "q01[0] is nan", "fix")
    folder = pa.lerobot_policy_folder(tmp_path / "ckpt", tokenizer=False)
    pa.lerobot_policy_folder(tmp_path / "ckpt", stats=pa.lerobot_stats(**{
        "observation.state.q01": [0.0] * 8, "observation.state.q99": [1.0] * 8}), tokenizer=False)
    result = cli("validate", *args, f"model.init_weights={folder}")
    assert result.code == 2
    one_line_error(result, "model.norm_stats", "8 values", "state has 6")
    assert cli("validate", *args, f"model.init_weights={folder}", "model.norm_stats=dataset").code == 0
    result = cli("validate", *args, f"model.norm_stats={tmp_path}/nowhere.json")
    assert result.code == 2
    one_line_error(result, "model.norm_stats", "does not exist")


def test_statistics_of_another_robot_with_the_same_state_size_are_warned_about(cli, tmp_path):
    """Quietly wrong: the shapes fit (DROID's state is 8-d, as LIBERO's), the values do not describe the dataset."""
    from embodyhpc.models.checkpoint_assets import fit_warning

    other = pa.openpi_folder(tmp_path / "pi05_droid", asset_ids=("droid",),
                             state={"mean": [11.0] * 6, "std": [0.5] * 6, "q01": [10.0] * 6, "q99": [12.0] * 6})
    normalizer, source = resolve_normalizer(model(init_weights=str(other)), str(FIXTURE))
    warning = fit_warning(normalizer, str(FIXTURE), source)
    assert warning and "do not describe" in warning and "observation.state[0]" in warning
    assert "model.norm_stats=dataset" in warning
    described, source = resolve_normalizer(model(init_weights=str(pa.openpi_folder(tmp_path / "libero"))),
                                           str(FIXTURE))
    assert fit_warning(described, str(FIXTURE), source) is None
    result = cli("validate", "smoke_cpu", "data.format=lerobot", f"data.root={FIXTURE}", "model.state_norm=quantile",
                 CHUNK, f"model.init_weights={other}")
    assert result.code == 0 and "warning: model.norm_stats: the statistics of" in result.err, result.err


def test_a_full_size_run_needs_no_tokenizer_path_when_the_checkpoint_carries_one(cli, tmp_path):
    folder = pa.lerobot_policy_folder(tmp_path / "pi05_base", stats=pa.lerobot_stats())
    args = ["validate", "recipes/pi05_libero.yaml", "--site", "example_ib", f"data.root={FIXTURE}", CHUNK,
            "site.account=me", f"model.init_weights={folder}"]
    result = cli(*args)
    assert result.code == 0 and "tokenizer_path is unset" not in result.err, result.err
    assert "tokenizer_path is unset" in cli(*args[:-1], f"model.init_weights={pa.openpi_folder(tmp_path / 'op')}").err
    (folder / "tokenizer" / "tokenizer.model").write_bytes(b"\x00garbage" * 8)  # a damaged file: refused now
    result = cli(*args)
    assert result.code == 2
    one_line_error(result, "model.tokenizer_path", "tokenizer.model is not a readable SentencePiece model")
