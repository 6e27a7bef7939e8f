"""Prompt tokenizers: the byte tokenizer, local SentencePiece / tokenizers files, the pi0.5 state prompt."""

from __future__ import annotations

import io
import sys
from pathlib import Path

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


def test_state_bins_are_openpis_digitize_inside_the_range() -> None:
    """openpi's pi0.5 prompt (and LeRobot's port): np.digitize(state, np.linspace(-1, 1, 257)[:-1]) - 1, on states
    already in [-1, 1]; checked on random values and on every bin edge (dyadic, so exact in float32)."""
    import numpy as np

    edges = np.linspace(-1.0, 1.0, 257)[:-1]
    values = np.concatenate([np.random.default_rng(0).uniform(-1.0, 1.0, 4000), edges, [1.0]]).astype(np.float32)
    expected = np.clip(np.digitize(values.astype(np.float64), edges) - 1, 0, 255).tolist()
    assert discretize_state(torch.from_numpy(values)) == expected


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


def _train_sentencepiece(folder: Path) -> Path:
    """A real SentencePiece model (unigram, 60 ids, PaliGemma-like special ids but its own order), trained here."""
    import sentencepiece

    lines = [f"Task: pick up the {colour} cup number {i}, State: {i} {2 * i} {7 * i % 256};\nAction: "
             for i in range(200) for colour in ("red", "blue")]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model, vocab_size=60,
                                             model_type="unigram", pad_id=0, bos_id=1, eos_id=2, unk_id=3,
                                             minloglevel=2)
    path = folder / "sp.model"
    path.write_bytes(model.getvalue())
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return _train_sentencepiece(tmp_path_factory.mktemp("sentencepiece"))


def test_sentencepiece_file(sp_model) -> None:
    tok = load_tokenizer("full", str(sp_model))
    assert (tok.vocab_size, tok.bos_id, tok.pad_id) == (60, 1, 0)
    ids = encode_prompt(tok, "pick up the cup", torch.tensor([0.5]), max_tokens=64)
    assert ids[0] == 1 and all(0 <= i < 60 for i in ids)
    # a small model's embedding table (320 ids) holds this vocabulary; a too-large one is refused
    assert build_tokenizer(ModelConfig(size="tiny", tokenizer_path=str(sp_model))).vocab_size == 60


def test_sentencepiece_prompt_is_encoded_whole_once(sp_model) -> None:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    tok = load_tokenizer("full", str(sp_model))
    ids = encode_prompt(tok, " pick_up  the red cup", torch.tensor([-1.0, 0.0, 1.0]), max_tokens=200)
    whole = "Task: pick up the red cup, State: 0 128 255;\nAction: "
    assert ids == [tok.bos_id, *sp.encode(whole)]
    assert ids.count(tok.bos_id) == 1  # one BOS, ours: SentencePiece's encode adds none
    assert sp.decode(ids[1:]) == "Task: pick up the red cup, State: 0 128 255; Action:"  # nmt normalisation
    # encoding the two halves apart gives other tokens (a "▁" before the comma): the reason for one call
    apart = sp.encode("Task: pick up the red cup") + sp.encode(", State: 0 128 255;\nAction: ")
    assert apart != ids[1:] and sp.decode(apart).startswith("Task: pick up the red cup , State")
    assert encode_prompt(tok, "pick up the red cup", None, max_tokens=200) == [1, *sp.encode(
        "Task: pick up the red cup;\nAction: ")]


def test_pi05_collate_with_sentencepiece_truncates_and_pads_to_the_config_budget(sp_model) -> None:
    import sentencepiece

    from embodyhpc.models.pi05 import max_prompt_tokens
    from embodyhpc.models.pi05.batching import Pi05Collate

    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    # tiny: 16 patches per camera; 1 camera + 4 action tokens leave max_token_len - 20 prompt tokens
    cfg = ModelConfig(size="tiny", tokenizer_path=str(sp_model), action_horizon=4, max_token_len=20 + 80)
    budget = max_prompt_tokens(cfg, 1)
    assert budget == 80

    def item(task: str) -> dict:
        return {"observation.images.top": torch.rand(3, 32, 32), "observation.state": torch.tensor([0.0, 1.0]),
                "action": torch.zeros(4, 32), "task": task}

    long_task = "pick up the blue cup and then the red cup number " * 8
    batch = Pi05Collate(cfg, build_tokenizer(cfg))([item("pick up the red cup"), item(long_task)])
    short_len, long_len = batch.prompt_lengths.tolist()
    assert batch.prompt_ids.shape == (2, long_len)
    assert budget - 4 <= long_len <= budget  # cut to the budget (a prefix that fits, within a few ids)
    short = batch.prompt_ids[0, :short_len].tolist()
    assert short == [1, *sp.encode("Task: pick up the red cup, State: 128 255;\nAction: ")]
    assert batch.prompt_ids[0, short_len:].eq(0).all()  # right-padded with the model's pad id
    cut = batch.prompt_ids[1].tolist()
    assert cut[0] == 1 and cut.count(1) == 1
    text = sp.decode(cut[1:])
    assert text.startswith("Task: pick up the blue cup and then") and text.endswith(", State: 128 255; Action:")
    assert cut[1:] == sp.encode(text.replace("; Action:", ";\nAction: "))  # the shortened prompt, encoded whole
    # the packer got the prompt lengths: every sample's tokens fit a row of max_token_len
    assert batch.rows is not None and sorted(i for row in batch.rows for i in row) == [0, 1]


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
