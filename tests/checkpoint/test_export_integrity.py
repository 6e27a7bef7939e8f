"""An export's weights are checked against what export.json recorded (size, header, sha256, config) before anything
uses them: every damaged, swapped or edited export is refused in one line, by the loader and by `embodyhpc eval`
before it creates a run folder."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from embodyhpc.checkpoint import NotACheckpointError, load_exported
from embodyhpc.checkpoint.export import check_fits
from embodyhpc.checkpoint.integrity import safetensors_header, verify_export
from tests.exports import make_export, small_model

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
WEIGHTS = "model.safetensors"


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """One good export, another of other weights of the same model, and a bf16 one."""
    root = tmp_path_factory.mktemp("exports")
    return {"good": make_export(root / "good", small_model(0)), "other": make_export(root / "other", small_model(1)),
            "bf16": make_export(root / "bf16", small_model(0), dtype=torch.bfloat16)}


def _truncate(n):
    def cut(out, exports):
        path = out / WEIGHTS
        os.truncate(path, n(path.stat().st_size))
    return cut


def _rewrite(data):
    def write(out, exports):
        (out / WEIGHTS).write_bytes(data(out / WEIGHTS, exports))
    return write


def _flip(out, exports):
    path = out / WEIGHTS
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # a tensor byte: size and header unchanged
    path.write_bytes(bytes(data))


def _same_size_ints(out, exports):
    """fp32 tensors rewritten as int32 with the same metadata: the same byte size, another dtype."""
    from safetensors import safe_open

    with safe_open(str(out / WEIGHTS), framework="pt") as f:
        metadata = f.metadata()
    size = (out / WEIGHTS).stat().st_size
    tensors = load_file(str(out / WEIGHTS))
    save_file({k: v.view(torch.int32) for k, v in tensors.items()}, str(out / WEIGHTS), metadata=metadata)
    assert (out / WEIGHTS).stat().st_size == size


def _lying_header(out, exports):
    """A header whose offsets claim more bytes than the file holds (the JSON is valid)."""
    path = out / WEIGHTS
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] += 4
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length:])
    _edit_summary(lambda s, o: s.update(bytes=path.stat().st_size))(out, exports)  # the size alone would tell


def _edit_summary(change):
    def edit(out, exports):
        summary = json.loads((out / "export.json").read_text())
        change(summary, out)
        (out / "export.json").write_text(json.dumps(summary))
    return edit


def _garbage_same_size(path, exports):
    return os.urandom(path.stat().st_size)


def _garbage_with_prefix(path, exports):
    size = path.stat().st_size
    return (size - 8 - 10).to_bytes(8, "little") + os.urandom(size - 8)


def _padded(path, exports):
    return path.read_bytes() + b"\0" * 16


def _weights_symlink_to_other(out, exports):
    (out / WEIGHTS).unlink()
    (out / WEIGHTS).symlink_to(exports["other"] / WEIGHTS)


def _weights_dir(out, exports):
    (out / WEIGHTS).unlink()
    (out / WEIGHTS).mkdir()


def _summary_matching_tampered_size(out, exports):
    """Truncate, then edit export.json's size to match: the hash still tells."""
    _truncate(lambda n: n - 4)(out, exports)
    _edit_summary(lambda s, o: s.update(bytes=(o / WEIGHTS).stat().st_size))(out, exports)


# (case, tamper(out, exports), what the one-line error says)
TAMPER = [
    ("truncated-by-10", _truncate(lambda n: n - 10), "truncated"),
    ("truncated-to-half", _truncate(lambda n: n // 2), "truncated"),
    ("truncated-inside-header", _truncate(lambda n: 20), "truncated"),
    ("zero-length", _truncate(lambda n: 0), "truncated"),
    ("garbage-same-size", _rewrite(_garbage_same_size), "not a safetensors file"),
    ("garbage-with-plausible-prefix", _rewrite(_garbage_with_prefix), "not a safetensors file"),
    ("text-file", _rewrite(lambda p, e: b'{"not": "weights"}' + b" " * (p.stat().st_size - 18)),
     "not a safetensors file"),
    ("one-byte-flipped", _flip, "sha256 mismatch"),
    ("padded", _rewrite(_padded), "extended"),
    ("swapped-with-other-weights", lambda o, e: shutil.copy(e["other"] / WEIGHTS, o / WEIGHTS), "sha256 mismatch"),
    ("swapped-with-bf16-export", lambda o, e: shutil.copy(e["bf16"] / WEIGHTS, o / WEIGHTS), "export.json recorded"),
    ("wrong-dtype-same-size", _same_size_ints, "dtypes or shapes differ"),
    ("header-offsets-lie", _lying_header, "described inconsistently"),
    ("weights-symlink-to-other-export", _weights_symlink_to_other, "sha256 mismatch"),
    ("weights-is-a-folder", _weights_dir, "not a regular file"),
    ("export-json-garbage", lambda o, e: (o / "export.json").write_bytes(b"\xff\xfe{{"), "unreadable export.json"),
    ("export-json-a-list", lambda o, e: (o / "export.json").write_text("[1, 2]"), "not a JSON object"),
    ("export-json-without-hash", _edit_summary(lambda s, o: s.pop("sha256")), "no size and sha256"),
    ("export-json-hash-not-hex", _edit_summary(lambda s, o: s.update(sha256="x" * 64)), "no size and sha256"),
    ("export-json-size-as-text", _edit_summary(lambda s, o: s.update(bytes=str(s["bytes"]))), "no size and sha256"),
    ("export-json-size-matched-to-truncation", _summary_matching_tampered_size, "truncated or padded"),
    ("config-yaml-edited", lambda o, e: (o / "config.yaml").write_text("job: {name: y}\n"), "config.yaml differs"),
    ("config-yaml-not-utf8", lambda o, e: (o / "config.yaml").write_bytes(b"\xff\xfe"), "config.yaml differs"),
]


@pytest.fixture
def tampered(exports, tmp_path, request):
    case, tamper, expected = request.param
    out = tmp_path / "export"
    shutil.copytree(exports["good"], out)
    verify_export(out)  # whole before the tampering
    tamper(out, exports)
    return out, expected


@pytest.mark.parametrize("tampered", TAMPER, ids=[c[0] for c in TAMPER], indirect=True)
def test_a_tampered_export_is_refused_in_one_line(tampered):
    out, expected = tampered
    with pytest.raises(NotACheckpointError, match=expected) as caught:
        load_exported(out)
    line = caught.value.one_line()
    assert caught.value.exit_code == 2 and "\n" not in line and str(out) in line and "fix:" in line


@pytest.mark.parametrize("tampered", TAMPER, ids=[c[0] for c in TAMPER], indirect=True)
def test_eval_of_a_tampered_export_fails_before_making_a_run(cli, tampered, runs_root):
    out, expected = tampered
    result = cli("eval", "--ckpt", str(out), "--local", f"job.runs_root={runs_root}")
    assert result.code == 2, result.err
    lines = result.err.strip().splitlines()
    if not (out / WEIGHTS).is_file():
        expected = "neither an export folder"  # no weights file: not an export at all
    assert len(lines) == 1 and expected in lines[0], result.err
    assert list(runs_root.iterdir()) == []


def test_a_whole_export_passes_and_records_what_it_holds(exports):
    summary = verify_export(exports["good"])
    assert summary["bytes"] == (exports["good"] / WEIGHTS).stat().st_size and len(summary["sha256"]) == 64
    assert summary["tensors"] == safetensors_header(exports["good"] / WEIGHTS)
    assert summary["tensors"]["0.weight"] == ["F32", [5, 3]]
    assert verify_export(exports["bf16"])["tensors"]["0.weight"] == ["BF16", [5, 3]]
    weights, _ = load_exported(exports["good"])
    for key, tensor in small_model(0).state_dict().items():
        assert torch.equal(weights[key], tensor)


def test_weights_of_another_shape_or_kind_do_not_fit_the_model():
    from embodyhpc.config.schema import ModelConfig

    cfg = ModelConfig(size="tiny", action_horizon=8, action_dim=8)
    from embodyhpc.models import build_model

    with torch.device("meta"):
        entries = {k: (v.dtype, v.shape) for k, v in build_model(cfg).state_dict().items()}
    check_fits(entries, cfg, where="w", built_with="r")  # the model's own entries fit
    check_fits({k: (torch.bfloat16 if d.is_floating_point else d, s) for k, (d, s) in entries.items()}, cfg,
               where="w", built_with="r")  # a bf16 export loads into fp32
    name = "action_out.weight"
    cases = {
        "shapes differ": {**entries, name: (torch.float32, torch.Size([3, 3]))},
        "missing": {k: v for k, v in entries.items() if k != name},
        "the model lacks": {**entries, "extra.weight": (torch.float32, torch.Size([2]))},
        "wrong kind": {**entries, name: (torch.int32, entries[name][1])},
    }
    for expected, weights in cases.items():
        with pytest.raises(NotACheckpointError, match=expected):
            check_fits(weights, cfg, where="w", built_with="r")
    other_size = ModelConfig(size="tiny", action_horizon=8, action_dim=6)
    with pytest.raises(NotACheckpointError, match=r"do not fit .* \(model.size=tiny\): \d+ shapes differ"):
        check_fits(entries, other_size, where="w", built_with="r")
