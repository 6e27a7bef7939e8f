"""Is the local file a key names of the kind the job will read? Checked at validate from its first bytes.

`model.tokenizer_path=/data/robot.mp4` or `model.init_weights=/dev/zero` used to pass validate and fail hours later
in the job (or hang it: /dev/zero never ends, a FIFO blocks its reader). Each check here reads a bounded number of
bytes, never follows a file to its end, and refuses devices, FIFOs and sockets before opening them:

- a SentencePiece model (`*.model`) is a serialized ModelProto: its first field is the vocabulary (field 1, bytes),
  whose first entry starts with its piece (field 1, bytes) -- 0x0A, a length, 0x0A;
- a tokenizers file (`*.json`) is a JSON object with a "model" section (tokenizer_config.json and config.json are not);
- a safetensors file starts with the 8-byte little-endian length of a JSON header (at most 100 MB, as the
  safetensors library allows) that fits the file; the header's tensors must fit the file too (a truncated copy);
- a sharded checkpoint's model.safetensors.index.json maps every tensor to a shard file beside it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from embodyhpc.errors import ConfigError

HEAD_BYTES = 16 << 20
"""The most any check reads of one file: a tokenizer.json's "model" section starts within its first kilobytes."""
SAFETENSORS_MAX_HEADER = 100_000_000  # the safetensors library's own limit
MAX_SHARDS = 1000  # published checkpoints have a few to a few hundred
INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
_MODEL_SECTION = re.compile(rb'"model"\s*:\s*\{')


def _kind(path: Path) -> str | None:
    """What a path that is not a regular file or folder is (None for those), without opening it."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None


def _head(path: Path, size: int) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(size)


def check_tokenizer(key: str, path: Path) -> None:
    """`path` (exists) is a SentencePiece *.model or a tokenizers *.json file, by its first bytes."""
    fix = f"set {key} to the tokenizer file itself: a SentencePiece *.model (PaliGemma) or a tokenizer.json"
    special = _kind(path)
    if special is not None or path.is_dir():
        raise ConfigError(f"{str(path)!r} is {special or 'a folder'}, not a tokenizer file", key=key,
                          fix=f"{fix} (e.g. {path / 'tokenizer.model'})" if path.is_dir() else fix)
    if path.suffix == ".model":
        if not _sentencepiece_head(_head(path, 64)):
            raise ConfigError(f"{str(path)!r} is not a SentencePiece model (its first bytes are not a vocabulary "
                              "entry)", key=key, fix=fix)
    elif path.suffix == ".json":
        problem = _tokenizers_json_problem(path)
        if problem is not None:
            raise ConfigError(f"{str(path)!r} is not a tokenizers file: {problem}", key=key, fix=fix)
    else:
        raise ConfigError(f"{path.name}: unknown tokenizer format (jobs read *.model and *.json)", key=key, fix=fix)


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    value = shift = 0
    while pos < len(data) and shift < 64:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None


def _sentencepiece_head(head: bytes) -> bool:
    if not head.startswith(b"\x0a"):  # field 1 (pieces), length-delimited
        return False
    entry = _varint(head, 1)
    if entry is None or entry[0] < 2 or head[entry[1]:entry[1] + 1] != b"\x0a":  # its field 1 (piece): bytes
        return False
    piece = _varint(head, entry[1] + 1)
    return piece is not None and piece[0] < entry[0]


def _tokenizers_json_problem(path: Path) -> str | None:
    size = path.stat().st_size
    head = _head(path, HEAD_BYTES)
    if not head.lstrip().startswith(b"{"):
        return "not a JSON object"
    if len(head) >= size:  # the whole file was read: parse it
        try:
            data = json.loads(head.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            return f"not valid JSON ({type(exc).__name__})"
        if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
            return 'no "model" section (tokenizer_config.json and config.json sit beside tokenizer.json)'
        return None
    return None if _MODEL_SECTION.search(head) else f'no "model" section in its first {HEAD_BYTES >> 20} MiB'


def check_weights(key: str, path: Path) -> None:
    """`path` (exists) is what SafetensorsCheckpoint opens: a safetensors file, a sharded index, or a folder with
    model.safetensors or model.safetensors.index.json (an embodyhpc export, LeRobot's and openpi's folders)."""
    fix = (f"set {key} to a safetensors file, a model.safetensors.index.json, or a folder holding "
           f"{SINGLE_FILE} or {INDEX_FILE}")
    special = _kind(path)
    if special is not None:
        raise ConfigError(f"{str(path)!r} is {special}, not a weights file", key=key, fix=fix)
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            path = path / INDEX_FILE
        elif (path / SINGLE_FILE).exists():
            path = path / SINGLE_FILE
        else:
            raise ConfigError(f"the folder {str(path)!r} holds neither {SINGLE_FILE} nor {INDEX_FILE}", key=key,
                              fix=fix)
        special = _kind(path)
        if special is not None:
            raise ConfigError(f"{str(path)!r} is {special}, not a weights file", key=key, fix=fix)
    problem = _index_problem(path) if path.name.endswith(".json") else _safetensors_problem(path)
    if problem is not None:
        raise ConfigError(f"{str(path)!r} {problem}", key=key, fix=fix)


def _safetensors_problem(path: Path) -> str | None:
    size = path.stat().st_size
    head = _head(path, 8)
    if len(head) < 8:
        return f"is not a safetensors file ({size} bytes: shorter than its header length)"
    if head.startswith(b"PK\x03\x04"):
        return "is a zip archive (a PyTorch .pt/.bin checkpoint?), not a safetensors file"
    length = int.from_bytes(head, "little")
    if not 2 <= length <= min(SAFETENSORS_MAX_HEADER, size - 8):
        return f"is not a safetensors file (its first 8 bytes give a header of {length} bytes in a {size}-byte file)"
    with open(path, "rb") as handle:
        handle.seek(8)
        header = handle.read(min(length, HEAD_BYTES))
    if not header.lstrip().startswith(b"{"):
        return "is not a safetensors file (its header is not a JSON object)"
    if length > HEAD_BYTES:
        return None  # a header this large is not parsed here; the job reads it
    try:
        tensors = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "is not a safetensors file (its header is not valid JSON)"
    if not isinstance(tensors, dict):
        return "is not a safetensors file (its header is not a JSON object)"
    ends = [entry.get("data_offsets", [0, 0])[1] for name, entry in tensors.items()
            if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2 and isinstance(entry["data_offsets"][1], int)]
    data = size - 8 - length
    if ends and max(ends) > data:
        return f"is truncated: its tensors need {max(ends)} bytes of data, the file holds {data} (copy it again)"
    return None


def _index_problem(path: Path) -> str | None:
    size = path.stat().st_size
    if size > HEAD_BYTES:
        return f"is {size} bytes: larger than any safetensors index"
    try:
        data = json.loads(_head(path, HEAD_BYTES).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "is not valid JSON"
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        return 'has no "weight_map": not a safetensors index (model.safetensors.index.json)'
    shards = sorted({str(name) for name in weight_map.values()})
    if len(shards) > MAX_SHARDS:
        return f"names {len(shards)} shard files: more than any checkpoint has ({MAX_SHARDS})"
    for shard in shards:
        shard_path = path.parent / shard
        if "/" in shard or os.sep in shard or shard in ("", ".", "..") or not shard_path.exists():
            return f"names the shard {shard!r}, which is not a file beside it"
        special = _kind(shard_path)
        problem = f"is {special}" if special else _safetensors_problem(shard_path)
        if problem is not None:
            return f"names the shard {shard!r}, which {problem}"
    return None
