"""Prompt tokenizers: the byte tokenizer, local SentencePiece / tokenizers files, the pi0.5 state prompt."""

from __future__ import annotations

import sys

import pytest
import torch

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_tokenizer
from embodyhpc.models.tokenizer import ByteTokenizer, discretize_state, encode_prompt, load_tokenizer


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("pick up the cup, État 7")
    assert min(ids) >= ByteTokenizer.num_special and max(ids) < tok.vocab_size == 259
    assert tok.decode(ids) == "pick up the cup, État 7"


def test_state_bins() -> None:
    assert discretize_state(torch.tensor([-1.0, -0.999, 0.0, 0.999, 1.0, 5.0, -5.0])) == [0, 0, 128, 255, 255, 255, 0]
    assert discretize_state(torch.tensor([0.0, 0.5]), num_bins=4) == [2, 3]


def test_prompt_format_and_truncation() -> None:
    tok = ByteTokenizer()
    ids = encode_prompt(tok, "  pick_up  the cup ", torch.tensor([0.0, 1.0]), max_tokens=200)
    assert ids[0] == tok.bos_id
    assert tok.decode(ids[1:]) == "Task: pick up the cup, State: 128 255;\nAction: "
    short = encode_prompt(tok, "a very long instruction " * 10, torch.tensor([0.0, 1.0]), max_tokens=40)
    assert len(short) == 40 and tok.decode(short).endswith(", State: 128 255;\nAction: ")
    with pytest.raises(ConfigError, match="model.max_token_len: the prompt budget of 10 tokens"):
        encode_prompt(tok, "x", torch.zeros(8), max_tokens=10)


def test_which_tokenizer_for_which_size(tmp_path) -> None:
    assert isinstance(build_tokenizer(ModelConfig(size="tiny")), ByteTokenizer)
    assert isinstance(build_tokenizer(ModelConfig(size="small")), ByteTokenizer)
    with pytest.raises(ConfigError, match="model.tokenizer_path: size full needs the tokenizer.*fix: set"):
        build_tokenizer(ModelConfig(size="full"))
    with pytest.raises(ConfigError, match="no tokenizer file at"):
        load_tokenizer("full", str(tmp_path / "missing.model"))
    (tmp_path / "vocab.txt").write_text("a b c")
    with pytest.raises(ConfigError, match="unknown tokenizer format"):
        load_tokenizer("full", str(tmp_path / "vocab.txt"))


def test_sentencepiece_file(tmp_path) -> None:
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Task: pick up the cup number {i}, State: {i} {2 * i};" for i in range(200)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=60,
                                   model_type="unigram", bos_id=1, eos_id=2, pad_id=0, unk_id=3,
                                   minloglevel=2)
    tok = load_tokenizer("full", str(tmp_path / "sp.model"))
    assert (tok.vocab_size, tok.bos_id, tok.pad_id) == (60, 1, 0)
    ids = encode_prompt(tok, "pick up the cup", torch.tensor([0.5]), max_tokens=64)
    assert ids[0] == 1 and all(0 <= i < 60 for i in ids)
    # a small model's embedding table (320 ids) holds this vocabulary; a too-large one is refused
    assert build_tokenizer(ModelConfig(size="tiny", tokenizer_path=str(tmp_path / "sp.model"))).vocab_size == 60


def test_a_tokenizer_larger_than_the_embedding_is_refused(monkeypatch) -> None:
    class Big(ByteTokenizer):
        vocab_size = 100_000

    monkeypatch.setattr("embodyhpc.models.tokenizer.load_tokenizer", lambda size, path: Big())
    with pytest.raises(ConfigError, match="100000 ids, more than the 320 embeddings of size tiny"):
        build_tokenizer(ModelConfig(size="tiny"))


def test_json_tokenizer_without_the_package_says_how_to_fix(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ConfigError, match="tokenizers package is not installed.*fix: pip install tokenizers"):
        load_tokenizer("full", str(tmp_path / "tokenizer.json"))
