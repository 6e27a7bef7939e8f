"""GR00T full's tokenizer: a Qwen3-style tokenizer.json (byte-level BPE, Qwen2's pre-tokenizer split, NFC, the
<|endoftext|> / <|im_start|> / <|im_end|> special tokens after the vocabulary) built here with the `tokenizers`
library, loaded through our loader, and compared with what the library returns for the same file and with the
file's own added-token table. Also the packaging that makes it load on a node: `tokenizers` in the train extra,
pinned in CI's constraints to the installed version, and a one-line error naming the fix when it is missing."""

from __future__ import annotations

import json
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_tokenizer
from embodyhpc.models.tokenizer import HFTokenizer
from tests.helpers import require

require("tokenizers", "train")  # GR00T full's tokenizer.json needs it on the nodes: a CI failure if missing

REPO = Path(__file__).resolve().parents[2]
QWEN3_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643-151645 in Qwen3
QWEN3_ADDED = ("<think>", "</think>")  # added tokens that are not special (Qwen3 has them too)
# the pre-tokenizer split of Qwen2/2.5/3's tokenizer.json
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [f"Task: pick up the {colour} cup number {i}, then open the top drawer.\nAction: "
          for i in range(60) for colour in ("red", "blue", "green")]
TEXTS = ["pick up the red cup", "  open the top drawer\nthen press the button ", "État: 12°, naïve café",
         "grasp the 🤖 toy and put it on the 棚", "numbers 0123456789 and tabs\tand\r\nlines", "", " "]


def _qwen3_style_tokenizer(path: Path, *, num_extra_tokens: int = 0) -> Path:
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL])
    extra = tuple(f"<|extra_{i}|>" for i in range(num_extra_tokens))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*QWEN3_ADDED, *extra)])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def qwen3_file(tmp_path_factory) -> Path:
    return _qwen3_style_tokenizer(tmp_path_factory.mktemp("qwen3") / "tokenizer.json")


@pytest.fixture(scope="module")
def reference(qwen3_file):
    import tokenizers

    return tokenizers.Tokenizer.from_file(str(qwen3_file))


def _groot_full(path: Path | None) -> ModelConfig:
    # full: 256 image tokens per camera, so max_token_len leaves 64 instruction tokens for one camera
    return ModelConfig(name="groot", size="full", action_horizon=16, max_token_len=256 + 64,
                       tokenizer_path=None if path is None else str(path))


def _added_tokens(path: Path) -> dict[str, tuple[int, bool]]:
    """content -> (id, special), read from the file's JSON (not through any tokenizer)."""
    return {t["content"]: (t["id"], t["special"]) for t in json.loads(path.read_text())["added_tokens"]}


def _num_bpe_ids(path: Path) -> int:
    return len(json.loads(path.read_text())["model"]["vocab"])


def test_groot_full_loads_the_file_through_the_tokenizers_library(qwen3_file, reference) -> None:
    tok = build_tokenizer(_groot_full(qwen3_file))
    assert isinstance(tok, HFTokenizer)
    added, num_bpe = _added_tokens(qwen3_file), _num_bpe_ids(qwen3_file)
    # as in Qwen3: the special tokens right after the BPE vocabulary, then the other added tokens
    assert [added[t] for t in (*QWEN3_SPECIAL, *QWEN3_ADDED)] == [(num_bpe + i, i < 3) for i in range(5)]
    assert tok.vocab_size == reference.get_vocab_size(with_added_tokens=True) == num_bpe + 5


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_are_the_librarys_and_decode_back_to_the_text(qwen3_file, reference, text) -> None:
    tok = build_tokenizer(_groot_full(qwen3_file))
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert all(0 <= i < _num_bpe_ids(qwen3_file) for i in ids)  # plain text never yields an added token
    assert tok.decode(ids) == reference.decode(ids) == text  # byte-level BPE loses nothing (NFC text)


def test_pad_bos_eos_are_qwen3s(qwen3_file, reference) -> None:
    tok = build_tokenizer(_groot_full(qwen3_file))
    added = _added_tokens(qwen3_file)
    # Qwen3's tokenizer_config: pad <|endoftext|>, eos <|im_end|>, no bos
    assert tok.pad_id == added["<|endoftext|>"][0] == reference.token_to_id("<|endoftext|>")
    assert tok.eos_id == added["<|im_end|>"][0] == reference.token_to_id("<|im_end|>")
    assert tok.bos_id is None and reference.token_to_id("<s>") is None


def test_special_tokens_in_text_are_single_ids(qwen3_file, reference) -> None:
    tok = build_tokenizer(_groot_full(qwen3_file))
    added = _added_tokens(qwen3_file)
    text = "<|im_start|>user\npick up the red cup<think></think><|im_end|>"
    ids = tok.encode(text)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert ids[0] == added["<|im_start|>"][0] and ids[-1] == added["<|im_end|>"][0]
    assert ids.count(added["<think>"][0]) == 1 and ids.count(added["</think>"][0]) == 1
    # special tokens are left out of the text unless asked for; <think> is an added token, not a special one
    assert tok.decode(ids) == reference.decode(ids) == "user\npick up the red cup<think></think>"
    assert tok.decode(ids, skip_special_tokens=False) == text
    # a special token's text cut short is ordinary text
    assert not set(tok.encode("<|im_start| user")) & {added[t][0] for t in QWEN3_SPECIAL}


def test_groot_collate_reads_the_instruction_with_it(qwen3_file, reference) -> None:
    from embodyhpc.models.groot.batching import GrootCollate

    cfg = _groot_full(qwen3_file)
    long_task = "pick up the red cup then the blue cup and open the top drawer " * 8
    items = [{"observation.images.top": torch.rand(3, 32, 32), "observation.state": torch.rand(6),
              "action": torch.zeros(16, 32), "task": task} for task in ("pick up the red cup", long_task)]
    batch = GrootCollate(cfg, build_tokenizer(cfg))(items)
    lengths = batch.text_lengths.tolist()
    short = reference.encode("pick up the red cup", add_special_tokens=False).ids
    assert lengths[0] == len(short) and batch.text_ids[0, :lengths[0]].tolist() == short
    assert lengths[1] == 64  # cut to what max_token_len leaves after the image tokens
    assert batch.text_ids[1].tolist() == reference.encode(long_task, add_special_tokens=False).ids[:64]


def test_a_vocabulary_larger_than_the_embeddings_is_refused(tmp_path) -> None:
    path = _qwen3_style_tokenizer(tmp_path / "tokenizer.json", num_extra_tokens=320)
    num_ids = _num_bpe_ids(path) + 5 + 320
    with pytest.raises(ConfigError, match=f"{num_ids} ids, more than the 320 embeddings of size tiny") as info:
        build_tokenizer(ModelConfig(name="groot", size="tiny", action_horizon=16, tokenizer_path=str(path)))
    assert info.value.key == "model.tokenizer_path" and "\n" not in str(info.value)


@pytest.mark.parametrize("content", ['{"version": "1.0", "model": ', "", "not json", '{"model": {"type": "BPE"}}'])
def test_a_broken_file_is_a_one_line_error(tmp_path, content) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(ConfigError, match="is not a readable tokenizers file") as info:
        build_tokenizer(_groot_full(tmp_path / "tokenizer.json"))
    assert "\n" not in str(info.value) and info.value.key == "model.tokenizer_path"


def test_without_the_tokenizers_package_the_error_names_the_fix(qwen3_file, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` raises ImportError
    with pytest.raises(ConfigError) as info:
        build_tokenizer(_groot_full(qwen3_file))
    text = str(info.value)
    assert "\n" not in text and text.startswith("model.tokenizer_path: ")
    assert "tokenizers package is not installed" in text and str(qwen3_file) in text
    assert "fix: pip install tokenizers" in text and "embodyhpc[train]" in text


def test_the_train_extra_installs_tokenizers_and_ci_pins_the_installed_version() -> None:
    import tomllib
    from packaging.requirements import Requirement

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    installed = metadata.version("tokenizers")
    wanted = {r.name: r for r in map(Requirement, extras["train"])}
    assert "tokenizers" in wanted and wanted["tokenizers"].specifier.contains(installed)
    pins = dict(line.split("==") for line in (REPO / "tools/ci-constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["tokenizers"] == installed
