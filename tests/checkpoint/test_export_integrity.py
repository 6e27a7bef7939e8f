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
    ("weights-deleted", lambda o, e: (o / WEIGHTS).unlink(), "model.safetensors is missing"),
    ("config-yaml-deleted", lambda o, e: (o / "config.yaml").unlink(), "config.yaml is missing"),
    ("export-json-deleted", lambda o, e: (o / "export.json").unlink(), "no export.json"),
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


# --- side files: hashed into export.json, verified where the weights are ------------------------------------------

SIDE = {"normalization.json": b'{"key": "observation.state", "mode": "none", "offset": [], "scale": []}\n',
        "policy_io.json": b'{"cameras": [], "image_size": null, "action_dim": 2}\n',
        "tokenizer.model": b"\x00sentencepiece bytes"}


@pytest.fixture(scope="module")
def sided(tmp_path_factory) -> Path:
    """An export written with side files (tokenizer.json: recorded as absent)."""
    from tests.exports import save_checkpoint

    root = tmp_path_factory.mktemp("sided")
    sources = root / "sources"
    sources.mkdir()
    for name, data in SIDE.items():
        (sources / name).write_bytes(data)
    step = save_checkpoint(root / "checkpoints", small_model(0))
    from embodyhpc.checkpoint.export import export_consolidated

    export_consolidated(step, root / "export", config_yaml="job: {name: x}\n",
                        side_files={**{name: sources / name for name in SIDE}, "tokenizer.json": None})
    return root / "export"


def test_side_files_are_copied_and_their_hashes_recorded(sided):
    import hashlib

    recorded = verify_export(sided)["side_files"]
    assert recorded == {**{name: hashlib.sha256(data).hexdigest() for name, data in SIDE.items()},
                        "tokenizer.json": None}
    for name, data in SIDE.items():
        assert (sided / name).read_bytes() == data


def _link_other(name):
    def tamper(out):
        (out / name).unlink()
        (out / name).symlink_to(out.parent / "elsewhere")
        (out.parent / "elsewhere").write_bytes(b'{"key": "x"}')
    return tamper


def _edit_side(change):
    def edit(out):
        summary = json.loads((out / "export.json").read_text())
        change(summary["side_files"])
        (out / "export.json").write_text(json.dumps(summary))
    return edit


SIDE_TAMPER = [
    ("statistics-edited", lambda o: (o / "normalization.json").write_text('{"key": "observation.state", "mode": '
                                                                          '"none", "offset": [], "scale": [] }'),
     "normalization.json differs"),
    ("statistics-deleted", lambda o: (o / "normalization.json").unlink(), "normalization.json is missing"),
    ("policy-io-emptied", lambda o: (o / "policy_io.json").write_bytes(b""), "policy_io.json differs"),
    ("policy-io-a-folder", lambda o: ((o / "policy_io.json").unlink(), (o / "policy_io.json").mkdir()),
     "policy_io.json is not a regular file"),
    ("policy-io-a-link-elsewhere", _link_other("policy_io.json"), "policy_io.json differs"),
    ("tokenizer-swapped", lambda o: (o / "tokenizer.model").write_bytes(b"another tokenizer"),
     "tokenizer.model differs"),
    ("tokenizer-added", lambda o: (o / "tokenizer.json").write_text("{}"), "tokenizer.json is not part of the export"),
    ("tokenizer-added-as-dangling-link", lambda o: (o / "tokenizer.json").symlink_to(o / "nowhere"),
     "tokenizer.json is not part of the export"),
    ("side-files-not-an-object", lambda o: _rewrite_summary(o, side_files=["policy_io.json"]),
     "side_files is not a JSON object"),
    ("side-file-hash-not-hex", _edit_side(lambda s: s.update({"policy_io.json": "z" * 64})),
     "neither a sha256 nor null"),
    ("side-file-hash-a-number", _edit_side(lambda s: s.update({"policy_io.json": 7})), "neither a sha256 nor null"),
    ("side-file-names-a-parent-path", _edit_side(lambda s: s.update({"../sources/policy_io.json": None})),
     "not a side file's name"),
    ("side-file-names-an-absolute-path", _edit_side(lambda s: s.update({"/etc/passwd": None})),
     "not a side file's name"),
    ("side-file-names-the-weights", _edit_side(lambda s: s.update({"model.safetensors": None})),
     "not a side file's name"),
    ("side-file-names-nothing", _edit_side(lambda s: s.update({"": None})), "not a side file's name"),
]


def _rewrite_summary(out, **changes):
    summary = json.loads((out / "export.json").read_text())
    summary.update(changes)
    (out / "export.json").write_text(json.dumps(summary))


@pytest.mark.parametrize(("case", "tamper", "expected"), SIDE_TAMPER, ids=[c[0] for c in SIDE_TAMPER])
def test_a_changed_side_file_is_refused_in_one_line(sided, tmp_path, cli, runs_root, case, tamper, expected):
    out = tmp_path / "export"
    shutil.copytree(sided, out, symlinks=True)
    verify_export(out)
    tamper(out)
    with pytest.raises(NotACheckpointError, match=expected) as caught:
        load_exported(out)
    line = caught.value.one_line()
    assert caught.value.exit_code == 2 and "\n" not in line and "fix:" in line
    result = cli("eval", "--ckpt", str(out), "--local", f"job.runs_root={runs_root}")
    assert result.code == 2 and expected in result.err and len(result.err.strip().splitlines()) == 1, result.err
    assert list(runs_root.iterdir()) == []


def test_an_export_from_before_side_files_were_hashed_is_still_read(sided, tmp_path):
    """The documented rule: no `side_files` in export.json -> weights and config are verified, side files are used
    as they are (whatever they hold now)."""
    out = tmp_path / "export"
    shutil.copytree(sided, out)
    summary = json.loads((out / "export.json").read_text())
    del summary["side_files"]
    (out / "export.json").write_text(json.dumps(summary))
    (out / "policy_io.json").write_text('{"cameras": ["edited"]}')
    (out / "tokenizer.json").write_text("{}")
    assert "side_files" not in verify_export(out)
    load_exported(out)
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:-1] + b"\x01")
    with pytest.raises(NotACheckpointError, match="sha256 mismatch"):  # the weights are checked as ever
        verify_export(out)


def test_a_re_export_removes_a_side_file_the_new_one_does_not_have(sided, tmp_path):
    """An export written over an older one with a tokenizer: the stale copy must go, or it would be fed to the new
    policy (and fail the hash check as 'added afterwards')."""
    from embodyhpc.checkpoint.export import export_consolidated
    from tests.exports import save_checkpoint

    out = tmp_path / "export"
    shutil.copytree(sided, out)
    step = save_checkpoint(tmp_path / "checkpoints", small_model(1))
    export_consolidated(step, out, config_yaml="job: {name: x}\n",
                        side_files={"policy_io.json": sided / "policy_io.json", "tokenizer.model": None})
    assert not (out / "tokenizer.model").exists()
    assert verify_export(out)["side_files"]["tokenizer.model"] is None


@pytest.mark.parametrize("name", ["../escape.json", "/tmp/abs.json", "export.json", ".."])
def test_a_side_file_name_that_is_a_path_is_refused_before_writing(tmp_path, name):
    from embodyhpc.checkpoint.export import export_consolidated
    from tests.exports import save_checkpoint

    (tmp_path / "s.json").write_text("{}")
    step = save_checkpoint(tmp_path / "checkpoints", small_model(0))
    with pytest.raises(NotACheckpointError, match="not a side file's name"):
        export_consolidated(step, tmp_path / "export", config_yaml="x: 1\n", side_files={name: tmp_path / "s.json"})
    assert not (tmp_path / "export" / "export.json").exists() and not (tmp_path / "escape.json").exists()
