"""Issue 16, class 1: a recipe built to exhaust the loader (alias bombs, interpolation bombs, deep nesting, huge
files) gets a one-line error with exit 2 within seconds, never a hang, a RecursionError or a segfault.

Every case runs `embodyhpc validate` in a subprocess under a time limit and a memory cap, so a regression shows up
as a failed assertion, not a stuck test run.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

import embodyhpc

CODE_ROOT = Path(embodyhpc.__file__).resolve().parents[1]
TIME_LIMIT_S = 30
MEMORY_CAP_BYTES = 3 << 30


def _alias_bomb(levels: int = 9, width: int = 9, key: str = "x") -> str:
    lines = [f"a0: &a0 [{', '.join(['lol'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines)


def _nested_alias_bomb(section: str, key: str) -> str:
    """The bomb under a real key: anchors defined inside a list, the last alias in the key."""
    inner = [f"    - &a0 [{', '.join(['lol'] * 9)}]"]
    for i in range(1, 9):
        inner.append(f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]")
    return f"{section}:\n  {key}:\n" + "\n".join(inner) + "\n"


def _interpolation_list_bomb() -> str:
    """No YAML alias at all: each list holds nine ${} references to the previous list (OmegaConf copies each)."""
    lines = ["data:", "  delta_timestamps:", "    l0: [1, 2, 3, 4, 5, 6, 7, 8, 9]"]
    for i in range(1, 9):
        lines.append(f"    l{i}: [{', '.join([repr(f'${{data.delta_timestamps.l{i - 1}}}')] * 9)}]")
    return "\n".join(lines) + "\n"


def _interpolation_string_bomb() -> str:
    env = ["site:", "  extra_sbatch:", "    a0: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx'"]
    for i in range(1, 10):
        env.append(f"    a{i}: '{''.join(f'${{site.extra_sbatch.a{i - 1}}}' for _ in range(9))}'")
    return "\n".join(env) + "\n"


def _interpolation_dict_bomb() -> str:
    """The string bomb in network.extra_env (a key a recipe may set)."""
    lines = ["network:", "  extra_env:", "    V0: '0123456789012345678901234567890123456789'"]
    for i in range(1, 8):
        refs = "".join(f"${{network.extra_env.V{i - 1}}}" for _ in range(9))
        lines.append(f"    V{i}: '{refs}'")
    return "\n".join(lines) + "\n"


def _mapping_bomb(section: str, key: str, levels: int = 9) -> str:
    """Anchored mappings of mappings under a free-form mapping key: every walk of the data expands 9**levels."""
    lines = [f"{section}:", f"  {key}:", "    a0: &a0 {" + ", ".join(f"k{j}: v" for j in range(9)) + "}"]
    for i in range(1, levels):
        lines.append(f"    a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(9)) + "}")
    return "\n".join(lines) + "\n"


def _list_bomb_with_interpolation() -> str:
    """Anchored lists of lists in data.delta_timestamps, and one ${} elsewhere: OmegaConf walks it all."""
    lines = ["job:", "  name: '${job.experiment}'", "data:", "  delta_timestamps:",
             "    l0: &l0 [" + ", ".join(["0.0"] * 9) + "]"]
    for i in range(1, 9):
        lines.append(f"    l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


# (name, recipe text) written to a file and validated
HOSTILE_FILES = [
    ("mapping bomb under site.extra_sbatch", _mapping_bomb("site", "extra_sbatch")),
    ("mapping bomb under network.extra_env", _mapping_bomb("network", "extra_env")),
    ("mapping bomb under data.delta_timestamps", _mapping_bomb("data", "delta_timestamps")),
    ("list bomb with a ${} elsewhere", _list_bomb_with_interpolation()),
    ("alias bomb at the top level", _alias_bomb()),
    ("alias bomb 12x12", _alias_bomb(12, 12)),
    ("alias bomb under eval.tasks", _nested_alias_bomb("eval", "tasks")),
    ("alias bomb under site.modules", _nested_alias_bomb("site", "modules")),
    ("alias bomb with a ${} elsewhere", _alias_bomb() + "\njob:\n  name: '${job.experiment}'\n"),
    ("alias bomb inside a ${} list", "eval:\n  tasks: ['${job.name}']\n" + _alias_bomb()),
    ("alias bomb as a mapping", "a0: &a0 {k0: v, k1: v, k2: v, k3: v, k4: v, k5: v, k6: v, k7: v, k8: v}\n"
     + "\n".join(f"a{i}: &a{i} {{{', '.join(f'k{j}: *a{i - 1}' for j in range(9))}}}" for i in range(1, 9))),
    ("interpolation string bomb", _interpolation_string_bomb()),
    ("interpolation list bomb", _interpolation_list_bomb()),
    ("interpolation bomb in network.extra_env", _interpolation_dict_bomb()),
    ("2,000 nested brackets", "train:\n  steps: " + "[" * 2000 + "]" * 2000 + "\n"),
    ("100,000 nested brackets", "train:\n  steps: " + "[" * 100_000 + "]" * 100_000 + "\n"),
    ("100,000 unclosed brackets", "train:\n  steps: " + "[" * 100_000 + "\n"),
    ("100,000 nested braces", "x: " + "{a: " * 100_000 + "1" + "}" * 100_000 + "\n"),
    ("50,000 nested block sequences", "x:\n" + "- " * 50_000 + "1\n"),
    ("deep block mappings", "".join(" " * i + f"k{i}:\n" for i in range(300)) + " " * 300 + "v\n"),
    ("2 MiB file", "# " + "x" * (2 << 20) + "\ntrain:\n  steps: 3\n"),
    ("2 MiB of keys", "".join(f"k{i}: {i}\n" for i in range(200_000))),
    ("5,000 aliases of a scalar", "a: &a 1\nb: [" + ", ".join(["*a"] * 5000) + "]\n"),
]


def _run_validate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP_BYTES, MEMORY_CAP_BYTES))

    env = {**os.environ, "PYTHONPATH": str(CODE_ROOT)}
    env.pop("EMBODYHPC_DEBUG", None)
    try:
        return subprocess.run([sys.executable, "-m", "cli.main", "validate", *args], cwd=cwd,
                              capture_output=True, text=True, timeout=TIME_LIMIT_S, env=env,
                              preexec_fn=limit_memory)
    except subprocess.TimeoutExpired:
        pytest.fail(f"validate {' '.join(a[:60] for a in args)} hung for more than {TIME_LIMIT_S} s")


def _assert_one_line_refusal(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert len(lines[0]) < 600, lines[0][:700]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize(("name", "text"), HOSTILE_FILES, ids=[n for n, _ in HOSTILE_FILES])
def test_hostile_recipe_file_is_refused_quickly(tmp_path, name, text):
    path = tmp_path / "hostile.yaml"
    path.write_text(text)
    _assert_one_line_refusal(_run_validate(str(path), cwd=tmp_path), str(path))


@pytest.mark.parametrize("where", ["base recipe", "site profile"])
def test_alias_bomb_in_a_base_recipe_or_site_profile(tmp_path, where):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_mapping_bomb("site", "env") if where == "site profile" else _list_bomb_with_interpolation())
    recipe = tmp_path / "recipe.yaml"
    if where == "base recipe":
        recipe.write_text("base: bomb.yaml\n")
        proc = _run_validate(str(recipe), cwd=tmp_path)
    else:
        recipe.write_text("train:\n  steps: 3\n")
        proc = _run_validate(str(recipe), "--site", str(bomb), cwd=tmp_path)
    _assert_one_line_refusal(proc, str(bomb))


OVERRIDE_BOMBS = [
    "eval.tasks=[" + "[" * 30_000 + "]" * 30_000 + "]",  # an argument may hold at most 128 KiB
    "site.extra_sbatch={" + "a: {" * 5000 + "}" * 5001,
    "eval.tasks=" + "[&a [x,x,x,x,x,x,x,x,x], " + ", ".join(
        f"&a{i} [{', '.join(['*a' if i == 0 else f'*a{i - 1}'] * 9)}]" for i in range(9)) + "]",
]


@pytest.mark.parametrize("override", OVERRIDE_BOMBS, ids=["nested brackets", "nested braces", "alias bomb"])
def test_hostile_override_is_refused_quickly(tmp_path, override):
    proc = _run_validate("smoke_cpu", override, cwd=tmp_path)
    _assert_one_line_refusal(proc, "override")


def test_limits_leave_real_recipes_alone(cli):
    """The shipped recipes use anchors nowhere and nest 3 levels: far below every cap."""
    from embodyhpc.config.load import shipped_recipes

    for name in shipped_recipes():
        result = cli("recipes", "show", name, "data.root=/tmp", "model.tokenizer_path=/tmp",
                     "model.init_weights=/tmp")
        assert result.code == 0, (name, result.err)


def test_aliases_within_the_caps_still_work(tmp_path, cli):
    path = tmp_path / "anchors.yaml"
    path.write_text("eval:\n  tasks: &t [reach-v3, push-v3]\n  seeds: [0]\n  shards: 2\n"
                    "data:\n  delta_timestamps:\n    action: &ts [0.0, 0.1]\n    observation.state: *ts\n")
    result = cli("recipes", "show", str(path))
    assert result.code == 0, result.err
    assert "observation.state:\n    - 0.0\n    - 0.1" in result.out


# ---------------------------------------------------------------- hardening round 3, class 7: files of the wrong kind
# model.tokenizer_path and model.init_weights are checked at validate by their first bytes (config/file_formats.py):
# devices, FIFOs and folders are refused before anything opens them, and no check reads a file to its end.

@pytest.mark.parametrize("key", ["model.tokenizer_path", "model.init_weights"])
@pytest.mark.parametrize("kind", ["/dev/zero", "/dev/urandom", "fifo"])
def test_devices_and_fifos_are_refused_without_reading_them(tmp_path, key, kind):
    path = kind
    if kind == "fifo":
        path = str(tmp_path / ("tokenizer.model" if "tokenizer" in key else "model.safetensors"))
        os.mkfifo(path)  # opening it would block until a writer comes: never, here
    proc = _run_validate("smoke_cpu", f"{key}={path}", cwd=tmp_path)
    _assert_one_line_refusal(proc, "override", key, "named pipe" if kind == "fifo" else "character device")


def test_a_huge_file_is_read_only_at_its_start(tmp_path):
    """A 4 GiB sparse 'tokenizer.json' and a safetensors header claiming 2**63 bytes: refused from their first bytes
    (the memory cap of _run_validate is 3 GiB)."""
    tokenizer = tmp_path / "tokenizer.json"
    with open(tokenizer, "wb") as handle:
        handle.write(b'{"version": "1.0", "added_tokens": [')
        handle.truncate(4 << 30)
    _assert_one_line_refusal(_run_validate("smoke_cpu", f"model.tokenizer_path={tokenizer}", cwd=tmp_path),
                             'no "model" section in its first 16 MiB')
    weights = tmp_path / "model.safetensors"
    with open(weights, "wb") as handle:
        handle.write((2**63).to_bytes(8, "little") + b"{")
        handle.truncate(4 << 30)
    _assert_one_line_refusal(_run_validate("smoke_cpu", f"model.init_weights={weights}", cwd=tmp_path),
                             "header of 9223372036854775808 bytes")


def _safetensors(path: Path, **arrays) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({name: np.zeros(shape, dtype=np.float32) for name, shape in (arrays or {"w": (4, 4)}).items()},
              str(path))
    return path


def _weights_cases(tmp_path: Path) -> dict[str, tuple[Path, str | None]]:
    """{case: (path, a fragment of the refusal or None when it is fine)}"""
    import json
    import zipfile

    cases: dict[str, tuple[Path, str | None]] = {}
    good = _safetensors(tmp_path / "good.safetensors", a=(8, 8), b=(3,))
    cases["safetensors file"] = (good, None)
    folder = tmp_path / "export"
    folder.mkdir()
    _safetensors(folder / "model.safetensors")
    cases["folder with model.safetensors"] = (folder, None)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shards = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    for name in shards:
        _safetensors(sharded / name)
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"a": shards[0], "b": shards[1]}}))
    cases["sharded folder"] = (sharded, None)
    cases["its index"] = (sharded / "model.safetensors.index.json", None)
    empty = tmp_path / "empty"
    empty.mkdir()
    cases["folder without weights"] = (empty, "holds neither model.safetensors nor")
    (tmp_path / "short.safetensors").write_bytes(b"abc")
    cases["3 bytes"] = (tmp_path / "short.safetensors", "shorter than its header length")
    with zipfile.ZipFile(tmp_path / "pytorch_model.bin", "w") as archive:
        archive.writestr("archive/data.pkl", b"x")
    cases["a PyTorch zip"] = (tmp_path / "pytorch_model.bin", "zip archive")
    (tmp_path / "truncated.safetensors").write_bytes(good.read_bytes()[:-16])
    cases["truncated copy"] = (tmp_path / "truncated.safetensors", "is truncated")
    (tmp_path / "text.safetensors").write_text("hello, this is not a checkpoint at all\n")
    cases["text"] = (tmp_path / "text.safetensors", "not a safetensors file")
    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    cases["index naming a missing shard"] = (missing, "not a file beside it")
    escaping = tmp_path / "escaping"
    escaping.mkdir()
    (escaping / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../good.safetensors"}}))
    cases["index naming a file elsewhere"] = (escaping, "not a file beside it")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "pi05"}))
    cases["a config.json"] = (tmp_path / "config.json", 'no "weight_map"')
    return cases


def test_init_weights_must_be_safetensors(cli, tmp_path):
    for case, (path, refusal) in _weights_cases(tmp_path).items():
        result = cli("validate", "smoke_cpu", f"model.init_weights={path}")
        if refusal is None:
            assert result.code == 0, (case, result.err)
        else:
            lines = result.err.strip().splitlines()
            assert result.code == 2 and len(lines) == 1, (case, result.err)
            assert "model.init_weights:" in lines[0] and refusal in lines[0], (case, lines[0])


def test_tokenizer_path_must_be_a_tokenizer(cli, tmp_path):
    import json

    from tests.helpers import require

    require("sentencepiece", "train")
    tokenizers = require("tokenizers", "train")
    from tests.models.published_assets import train_sentencepiece

    model = train_sentencepiece(tmp_path / "tokenizer.model")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    tok.train_from_iterator(["pick up the red cup"] * 20, tokenizers.trainers.BpeTrainer(vocab_size=280))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "broken.json").write_text('{"model": {')
    (tmp_path / "notes.model").write_text("these are my notes\n")
    (tmp_path / "empty.model").write_bytes(b"")
    (tmp_path / "vocab.txt").write_text("a\nb\n")
    cases = {model: None, tmp_path / "tokenizer.json": None,
             tmp_path / "tokenizer_config.json": 'no "model" section', tmp_path / "list.json": "not a JSON object",
             tmp_path / "broken.json": "not valid JSON", tmp_path / "notes.model": "not a SentencePiece model",
             tmp_path / "empty.model": "not a SentencePiece model", tmp_path / "vocab.txt": "unknown tokenizer format",
             tmp_path: "is a folder"}
    for path, refusal in cases.items():
        result = cli("validate", "smoke_cpu", f"model.tokenizer_path={path}")
        if refusal is None:
            assert result.code == 0, (path, result.err)
        else:
            lines = result.err.strip().splitlines()
            assert result.code == 2 and len(lines) == 1, (path, result.err)
            assert "model.tokenizer_path:" in lines[0] and refusal in lines[0], (path, lines[0])


@pytest.mark.parametrize(("where", "text", "key"), [
    ("override", "train.steps=" + "9" * 5000, "train.steps"),
    ("file", "seed: 0" + "9" * 5000, "train.seed"),
    ("file", "lr: " + "9" * 5000 + ".5", "train.lr"),
], ids=["override", "leading zero in a file", "float in a file"])
def test_huge_numbers_are_refused_quickly(tmp_path, where, text, key):
    """Python refuses to convert an integer of 4,300+ digits (a ValueError traceback before): one line now."""
    if where == "override":
        _assert_one_line_refusal(_run_validate("smoke_cpu", text, cwd=tmp_path), "override", key)
        return
    path = tmp_path / "huge.yaml"
    path.write_text(f"base: smoke_cpu\ntrain:\n  {text}\n")
    _assert_one_line_refusal(_run_validate(str(path), cwd=tmp_path), str(path), key)
