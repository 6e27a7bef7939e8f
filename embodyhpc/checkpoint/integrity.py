"""What an export promises and the check that it still holds, before anything uses it. Imports no torch: the CLI
checks an export before it submits an evaluation of it.

export.json records, besides step and counts:

    bytes           size of model.safetensors
    sha256          its content hash (a truncated, padded, garbage or swapped file fails here)
    config_sha256   hash of config.yaml (the recipe the weights are built with)
    tensors         {name: [dtype, shape]} as the safetensors header holds them
    built_from      {"checkpoint": folder, "checkpoint_id": sha256 of its .metadata and .complete marker,
                     "config_sha256": the recipe the checkpoint was exported with, and "weights_kind": "ema" for an
                     export of the weights' moving average}: what the export is of; an export of another
                    checkpoint, recipe or kind of weights is never reused in its place
    weights_kind    "ema" (the moving average of train.ema_decay) or "raw" (the optimizer's weights); absent in
                    exports written before the choice existed, which hold the raw weights
    side_files      {name: sha256 or null} of every other file the policy's behaviour depends on
                    (normalization.json, policy_io.json, the tokenizer copy: the writer names them), null for one
                    the export does not have

`verify_export` re-reads the header and hashes the whole file (~1-2 GB/s: seconds for pi0.5's 3B weights, against
minutes of evaluation that would otherwise run on wrong ones), then the side files. Every failure is a one-line
NotACheckpointError.

The side-file rule: an export.json with `side_files` (every export written since they are recorded) is whole only
when each file it names with a hash is there with that hash and each file it names with null is absent (a
statistics or tokenizer file dropped in afterwards changes the policy as much as an edited one). An export.json
without `side_files` (an export written before they were recorded) is still read: its weights and config are
checked as ever, its side files are used as they are, unchecked; exporting the checkpoint again records them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from embodyhpc.checkpoint.errors import NotACheckpointError

WEIGHTS_FILE, CONFIG_FILE, EXPORT_JSON = "model.safetensors", "config.yaml", "export.json"
DCP_METADATA = ".metadata"
WEIGHTS_KIND_KEY = "weights_kind"
"""export.json's (and built_from's) record of which weights an export holds: "ema" or "raw"."""
_HASH_BLOCK_BYTES = 8 * 1024 * 1024
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
REEXPORT = "export the checkpoint again (embodyhpc eval --ckpt RUN/checkpoints/step-N writes a fresh export)"


def sha256_file(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK_BYTES):
            digest.update(block)
    return digest.hexdigest()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def checkpoint_id(folder: str | Path) -> str:
    """What a DCP checkpoint folder is, for keying exports: its .metadata (tensor names, shapes, dtypes, shard
    layout) and its completion marker (step, time). A folder re-saved at the same step gets another id."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for name in (DCP_METADATA, ".complete"):
        try:
            digest.update((folder / name).read_bytes())
        except OSError as exc:
            raise NotACheckpointError(f"cannot read {name} ({exc.strerror or exc})", where=str(folder),
                                      fix="pass a complete step-N folder") from None
        digest.update(b"\0")
    return digest.hexdigest()


def safetensors_header(path: str | Path) -> dict[str, list[Any]]:
    """{name: [dtype, shape]} from a safetensors file's header, refusing a file whose header does not describe
    exactly the bytes after it (truncated, padded, garbage, zero-length)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 2 <= length <= min(_MAX_HEADER_BYTES, size - 8):
                raise _bad(path, f"not a safetensors file ({size} bytes; no valid header)")
            raw = f.read(length)
    except OSError as exc:
        raise NotACheckpointError(f"cannot read the weights ({exc.strerror or exc})", where=str(path),
                                  fix=REEXPORT) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise _bad(path, "not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise _bad(path, "not a safetensors file (its header is not a JSON object)")
    tensors: dict[str, list[Any]] = {}
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, stop) = info["dtype"], list(info["shape"]), info["data_offsets"]
            ok = dtype in DTYPE_BYTES and all(isinstance(d, int) and d >= 0 for d in shape) \
                and isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok or stop - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise _bad(path, f"not a safetensors file (tensor {name!r} is described inconsistently)")
        tensors[name] = [dtype, shape]
        end = max(end, stop)
    if 8 + length + end != size:
        raise _bad(path, f"{size} bytes, but its header describes {8 + length + end} (truncated or padded)")
    return tensors


def _bad(path: Path, message: str) -> NotACheckpointError:
    return NotACheckpointError(message, where=str(path), fix=REEXPORT)


def read_summary(out_dir: str | Path) -> dict[str, Any]:
    out_dir = Path(out_dir)
    path = out_dir / EXPORT_JSON
    if not path.is_file():
        raise NotACheckpointError(f"no {EXPORT_JSON}: not a finished export", where=str(out_dir),
                                  fix="run the export again")
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        raise NotACheckpointError("unreadable export.json", where=str(path), fix=REEXPORT) from None
    if not isinstance(summary, dict):
        raise NotACheckpointError("export.json is not a JSON object", where=str(path), fix=REEXPORT)
    return summary


def verify_export(out_dir: str | Path, *, expect_built_from: dict[str, str] | None = None) -> dict[str, Any]:
    """The summary of an export folder whose weights and config are exactly what export.json recorded; raises
    NotACheckpointError (one line) otherwise. `expect_built_from`: also require that it was exported from that
    checkpoint and recipe."""
    out_dir = Path(out_dir)
    summary = read_summary(out_dir)
    where = str(out_dir / EXPORT_JSON)
    size, digest = summary.get("bytes"), summary.get("sha256")
    if type(size) is not int or not isinstance(digest, str) or not _SHA256_RE.match(digest):
        raise NotACheckpointError("export.json records no size and sha256 of the weights (an export from an older "
                                  "embodyhpc, or edited): they cannot be checked", where=where, fix=REEXPORT)
    weights = out_dir / WEIGHTS_FILE
    try:
        st = weights.stat()
    except OSError:
        raise NotACheckpointError(f"{WEIGHTS_FILE} is missing", where=str(out_dir), fix=REEXPORT) from None
    if not stat.S_ISREG(st.st_mode):
        raise NotACheckpointError(f"{WEIGHTS_FILE} is not a regular file", where=str(weights), fix=REEXPORT)
    if st.st_size != size:
        raise NotACheckpointError(f"{st.st_size} bytes, export.json recorded {size} (truncated, extended or "
                                  "replaced)", where=str(weights), fix=REEXPORT)
    tensors = safetensors_header(weights)
    recorded = summary.get("tensors")
    if recorded is not None and recorded != tensors:
        changed = sorted(k for k in set(recorded) | set(tensors) if recorded.get(k) != tensors.get(k))
        raise NotACheckpointError(f"tensor names, dtypes or shapes differ from export.json (e.g. {changed[:3]})",
                                  where=str(weights), fix=REEXPORT)
    if sha256_file(weights) != digest:
        raise NotACheckpointError("content differs from what export.json recorded (sha256 mismatch: corrupted or "
                                  "swapped)", where=str(weights), fix=REEXPORT)
    config_digest = summary.get("config_sha256")
    config = out_dir / CONFIG_FILE
    if config_digest is not None:
        try:
            actual = sha256_text(config.read_text())
        except (OSError, UnicodeDecodeError):
            actual = None
        if actual is None and not config.is_file():
            raise NotACheckpointError(f"{CONFIG_FILE} is missing", where=str(out_dir), fix=REEXPORT)
        if actual != config_digest:
            raise NotACheckpointError(f"{CONFIG_FILE} differs from the one exported with the weights",
                                      where=str(config), fix=REEXPORT)
    verify_side_files(out_dir, summary)
    if expect_built_from is not None and summary.get("built_from") != expect_built_from:
        raise NotACheckpointError("an export of another checkpoint or recipe", where=str(out_dir), fix=REEXPORT)
    return summary


SIDE_FILES_KEY = "side_files"
_OWN_FILES = frozenset({WEIGHTS_FILE, CONFIG_FILE, EXPORT_JSON})


def side_file_hashes(out_dir: str | Path, names: Iterable[str]) -> dict[str, str | None]:
    """{name: sha256 of out_dir/name, or None where there is no such file}: export.json's `side_files`."""
    out_dir = Path(out_dir)
    hashes: dict[str, str | None] = {}
    for name in names:
        check_side_name(name, where=str(out_dir))
        path = out_dir / name
        hashes[name] = sha256_file(path) if path.is_file() else None
    return hashes


def verify_side_files(out_dir: str | Path, summary: dict[str, Any]) -> None:
    """The side files of an export are what export.json recorded (the rule in the module doc); nothing to check
    for an export.json from before they were recorded."""
    out_dir = Path(out_dir)
    recorded = summary.get(SIDE_FILES_KEY)
    if recorded is None:
        return
    where = str(out_dir / EXPORT_JSON)
    if not isinstance(recorded, dict):
        raise NotACheckpointError(f"{SIDE_FILES_KEY} is not a JSON object", where=where, fix=REEXPORT)
    for name, digest in recorded.items():
        check_side_name(name, where=where)
        if digest is not None and not (isinstance(digest, str) and _SHA256_RE.match(digest)):
            raise NotACheckpointError(f"{SIDE_FILES_KEY}[{name!r}] is neither a sha256 nor null", where=where,
                                      fix=REEXPORT)
        path = out_dir / name
        if digest is None:
            if os.path.lexists(path):
                raise NotACheckpointError(f"{name} is not part of the export (export.json records that it had none: "
                                          "added afterwards)", where=str(path),
                                          fix=f"remove {name}, or {REEXPORT}")
            continue
        try:
            st = path.stat()
        except OSError:
            raise NotACheckpointError(f"{name} is missing (export.json recorded it)", where=str(out_dir),
                                      fix=REEXPORT) from None
        if not stat.S_ISREG(st.st_mode):
            raise NotACheckpointError(f"{name} is not a regular file", where=str(path), fix=REEXPORT)
        try:
            actual = sha256_file(path)
        except OSError as exc:
            raise NotACheckpointError(f"cannot read {name} ({exc.strerror or exc})", where=str(path),
                                      fix=REEXPORT) from None
        if actual != digest:
            raise NotACheckpointError(f"{name} differs from what export.json recorded (sha256 mismatch: edited or "
                                      "replaced after the export)", where=str(path), fix=REEXPORT)


def check_side_name(name: Any, *, where: str) -> None:
    """A side file is a plain file name beside the weights: never a path (export.json may come from anyone)."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name
            or "\0" in name or name in _OWN_FILES):
        raise NotACheckpointError(f"{SIDE_FILES_KEY} names {name!r}, which is not a side file's name", where=where,
                                  fix=REEXPORT)
