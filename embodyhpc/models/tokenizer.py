"""Tokenizers for policy prompts, and the pi0.5 prompt: instruction + discretised robot state as text.

- tiny / small: a built-in byte-level tokenizer (no files, nothing to download).
- full: a local file named by `model.tokenizer_path` — a SentencePiece model (`*.model`, e.g. PaliGemma's, which
  the published pi0.5 vocabulary of 257152 ids comes from) or a Hugging Face `tokenizers` file (`*.json`).
  The libraries are imported only when such a file is used; both come with the `train` extra (sentencepiece for
  pi0.5, tokenizers for GR00T's Qwen3 tokenizer.json). A missing one is a one-line ConfigError naming the fix.

pi0.5 puts the proprioceptive state into the prompt: each dimension (normalised to [-1, 1]) is quantised into
`num_bins` bins and written as its bin number, "Task: pick up the cup, State: 12 200 31;\nAction: ".
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from embodyhpc.errors import ConfigError

_KEY = "model.tokenizer_path"


class Tokenizer(Protocol):
    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes shifted past three special ids: 0 pad, 1 bos, 2 eos."""

    pad_id, bos_id, eos_id = 0, 1, 2
    num_special = 3
    vocab_size = 256 + num_special

    def encode(self, text: str) -> list[int]:
        return [b + self.num_special for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.num_special for i in ids if i >= self.num_special).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, path: Path) -> None:
        try:
            import sentencepiece
        except ImportError as exc:
            raise ConfigError(f"{path} is a SentencePiece model but the sentencepiece package is not installed",
                              key=_KEY, fix="pip install 'embodyhpc[train]' (or sentencepiece)") from exc
        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with a multi-line message
            raise ConfigError(f"{path} is not a readable SentencePiece model ({' '.join(str(exc).split())[:120]})",
                              key=_KEY, fix="give PaliGemma's tokenizer.model (or set model.tokenizer_path to one)"
                              ) from None
        self.vocab_size = self._sp.get_piece_size()
        self.pad_id = max(self._sp.pad_id(), 0)  # -1 when the model defines none; padding is masked anyway
        self.bos_id = self._sp.bos_id() if self._sp.bos_id() >= 0 else None
        self.eos_id = self._sp.eos_id() if self._sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))


# Special tokens found by name in a tokenizers file (the file itself does not say which is which: a checkpoint's
# tokenizer_config.json does, and it does not travel with tokenizer.json). Qwen2/2.5/3 (GR00T-N1.5's Eagle 2.5 LLM)
# pad with <|endoftext|>, end a turn with <|im_end|> and have no BOS; the others are the BERT/Llama/Gemma names.
HF_PAD_TOKENS = ("<pad>", "[PAD]", "<|endoftext|>")
HF_BOS_TOKENS = ("<bos>", "<s>", "[CLS]")
HF_EOS_TOKENS = ("<eos>", "</s>", "[SEP]", "<|im_end|>", "<|endoftext|>")


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (only the Rust `tokenizers` package, no hub access).

    pad_id, bos_id and eos_id are the first of HF_PAD_TOKENS, HF_BOS_TOKENS and HF_EOS_TOKENS the file holds (pad
    falls back to 0: padding is masked by the lengths anyway; no BOS and no EOS are None, as in Qwen3 for BOS).
    `encode` adds no special tokens (the prompt builders add what the model expects); special tokens written in
    the text (<|im_start|>) are matched as single ids, as the file's added tokens say.
    """

    def __init__(self, path: Path) -> None:
        try:
            import tokenizers
        except ImportError as exc:
            raise ConfigError(f"{path} is a tokenizers JSON file but the tokenizers package is not installed",
                              key=_KEY, fix="pip install tokenizers (it comes with: pip install 'embodyhpc[train]')"
                              ) from exc
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers' own exception type
            raise ConfigError(f"{path} is not a readable tokenizers file ({' '.join(str(exc).split())[:120]})",
                              key=_KEY, fix="give a tokenizer.json saved by tokenizers (or set model.tokenizer_path)"
                              ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.pad_id = self._first_id(HF_PAD_TOKENS)
        if self.pad_id is None:
            self.pad_id = 0
        self.bos_id = self._first_id(HF_BOS_TOKENS)
        self.eos_id = self._first_id(HF_EOS_TOKENS)

    def _first_id(self, names: tuple[str, ...]) -> int | None:
        return next((i for name in names if (i := self._tok.token_to_id(name)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (pad, <|im_start|> ...) are left out unless asked for, as
        ByteTokenizer.decode leaves out its own."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(size: str, tokenizer_path: str | None) -> Tokenizer:
    """The tokenizer for a model size: the file at tokenizer_path if set, else the byte tokenizer (not for full)."""
    if tokenizer_path is None:
        if size == "full":
            raise ConfigError("size full needs the tokenizer its 257152-id vocabulary comes from", key=_KEY,
                              fix=f"set {_KEY}=/path/to/paligemma_tokenizer.model (a local SentencePiece file)")
        return ByteTokenizer()
    path = Path(tokenizer_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"no tokenizer file at {path}", key=_KEY,
                          fix="copy the tokenizer file to the cluster and give its full path")
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    if path.suffix == ".json":
        return HFTokenizer(path)
    raise ConfigError(f"{path.name}: unknown tokenizer format", key=_KEY,
                      fix="give a SentencePiece *.model or a tokenizers *.json file")


def discretize_state(state: torch.Tensor, num_bins: int = 256) -> list[int]:
    """Bin numbers 0..num_bins-1 of a state normalised to [-1, 1] (values outside are clipped to the end bins)."""
    scaled = (state.detach().float().cpu().clamp(-1.0, 1.0) + 1.0) / 2.0 * num_bins
    return scaled.floor().clamp(max=num_bins - 1).long().tolist()


def encode_prompt(tokenizer: Tokenizer, instruction: str, state: torch.Tensor | None, *, max_tokens: int,
                  num_bins: int = 256) -> list[int]:
    """[bos] + "Task: <instruction>, State: <bins>;\\nAction: ", at most max_tokens ids (no State part when state
    is None: the model then reads the continuous state).

    The prompt is encoded whole, in one call: SentencePiece marks the start of every piece it is given ("▁"),
    so pieces encoded apart are not the tokens of the prompt ("cup" + ", State" decodes as "cup , State").
    A long instruction is cut (its end) so that the state and the "Action: " cue always survive; the ids are
    then those of the shortened prompt, encoded whole as well.
    """
    task = " ".join(instruction.strip().replace("_", " ").split())
    bins = "" if state is None else f", State: {' '.join(map(str, discretize_state(state, num_bins)))}"
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []

    def encoded(task_chars: int) -> list[int]:
        return bos + tokenizer.encode(f"Task: {task[:task_chars]}{bins};\nAction: ")

    ids = encoded(len(task))
    if len(ids) <= max_tokens:
        return ids
    shortest = encoded(0)
    if len(shortest) > max_tokens:
        raise ConfigError(f"the prompt budget of {max_tokens} tokens cannot hold the {len(shortest)} tokens of the "
                          "prompt without its instruction (the state)", key="model.max_token_len",
                          fix="raise model.max_token_len")
    # the longest instruction prefix that fits; token counts need not grow with every character, so the search
    # keeps `fits` as its invariant and returns a prefix that fits, not necessarily the longest one
    fits, too_long = 0, len(task)
    while too_long - fits > 1:
        middle = (fits + too_long) // 2
        if len(encoded(middle)) <= max_tokens:
            fits = middle
        else:
            too_long = middle
    return encoded(fits) if fits else shortest
