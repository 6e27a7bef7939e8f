"""Messages between the RL roles, without pickle: anyone on the cluster network can reach a role's port, so nothing
a peer sends is ever executed, and nothing it sends can crash the receiver.

A message is a list of frames (one zmq multipart message):

    frame 0   the header: UTF-8 JSON {"p": 1, "kind": ..., "from": sender, "fields": {name: scalar},
              "arrays": [{"name", "dtype", "shape"}, ...]}
    frame 1   HMAC-SHA256 (32 bytes) with the run's secret key over the header and every array frame (each
              prefixed with its length, so frames cannot be re-cut)
    frame 2+  one raw little-endian C-order buffer per array, in the header's order

Decoding checks, in this order, and refuses with a one-line `RLProtocolError` naming the peer and what was wrong
(the transport drops the message and goes on): the number of frames, the message's size against the limit, the
MAC (compared in constant time, before the header is even parsed: a peer without the key gets nothing parsed), the
header (strict JSON, no NaN, the exact keys, scalars only in fields), the kind (a known one), each array's dtype
(an allow list: uint8, int32, int64, float16, float32, float64, bool; no object dtype can be asked for), shape
(non-negative ints, at most 8 dimensions) and size against its frame's length, and a bool array's bytes (0 or 1).

What the MAC does not stop: a peer replaying a whole message it saw signed with this run's key (the key is per run
and only the run's processes read it, so that peer is one of the run's own; the transport names senders, and the
roles treat a duplicate like any late message). bfloat16 is not on the list: numpy has no bfloat16 without
ml_dtypes, and no message field needs it (weights go through torch.distributed, not here).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from embodyhpc.errors import RunFailure
from embodyhpc.rl.samples import ChunkSample, EpisodeEnd

PROTOCOL = 1
MAC_BYTES = 32
MIN_KEY_BYTES = 16
MAX_MESSAGE_BYTES = 64 << 20
"""Default limit of one message (every frame together): a few hundred camera images; the transport also sets it as
the socket's MAXMSGSIZE, so a bigger frame is dropped by zmq before it is held in memory whole."""
MAX_HEADER_BYTES = 64 << 10
MAX_ARRAYS = 256
MAX_DIMS = 8
MAX_TEXT = 4096  # a task instruction, a reason
MAX_NAME = 200
_MAC_DOMAIN = b"embodyhpc-rl/1"
_INT64 = (-(1 << 63), (1 << 63) - 1)
_NAME_RE = re.compile(rf"[A-Za-z0-9_.:/\-]{{1,{MAX_NAME}}}", re.ASCII)

DTYPES: dict[str, np.dtype] = {
    "uint8": np.dtype("u1"), "int32": np.dtype("<i4"), "int64": np.dtype("<i8"), "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "bool": np.dtype("?"),
}
"""The allow list: dtype name in a header -> the exact (little-endian) layout of its frame."""

KINDS = frozenset({"observation", "action", "chunk_sample", "episode_end", "heartbeat", "stop", "hello"})
"""The kinds this protocol knows; a codec may be given more (`Codec(kinds=KINDS | {...})`)."""

Scalar = str | int | float | bool | None
Frame = bytes | bytearray | memoryview


class RLProtocolError(RunFailure):
    """A message that is not one of ours: one line naming the peer and what was wrong; the receiver drops it."""


@dataclass
class Message:
    """kind, scalar fields and named numpy arrays; `sender` is what the peer called itself (set by `decode`, checked
    by the MAC: only holders of the run's key can claim a name)."""

    kind: str
    fields: dict[str, Scalar] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    sender: str = ""


def dtype_name(dtype: np.dtype) -> str | None:
    """The allow list's name of a numpy dtype (either byte order), None when it is not allowed."""
    dtype = np.dtype(dtype)
    for name, allowed in DTYPES.items():
        if dtype.kind == allowed.kind and dtype.itemsize == allowed.itemsize:
            return name
    return None


class Codec:
    """Encodes and decodes one role's messages with the run's key. `sender`: this role's name in every message it
    sends ("env-0", "rollout-1"), `max_bytes`: the size limit both ways."""

    def __init__(self, key: bytes, *, sender: str, max_bytes: int = MAX_MESSAGE_BYTES,
                 kinds: frozenset[str] = KINDS) -> None:
        if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
            raise ValueError(f"the run's RL key must be at least {MIN_KEY_BYTES} bytes")
        if not _NAME_RE.fullmatch(sender or ""):
            raise ValueError(f"sender name {sender!r} must be 1-{MAX_NAME} of A-Z a-z 0-9 _ . : / -")
        self._key = bytes(key)
        self.sender = sender
        self.max_bytes = int(max_bytes)
        self.kinds = frozenset(kinds)

    def _mac(self, header: Frame, arrays: Sequence[Frame]) -> bytes:
        mac = hmac.new(self._key, _MAC_DOMAIN, hashlib.sha256)
        for frame in (header, *arrays):
            mac.update(len(frame).to_bytes(8, "little"))
            mac.update(frame)
        return mac.digest()

    def encode(self, message: Message) -> list[bytes]:
        """The frames of `message` (signed). Refuses (RLProtocolError) what decode would refuse: an unknown kind, a
        non-scalar field, a dtype off the allow list, a message over the size limit."""
        if message.kind not in self.kinds:
            raise RLProtocolError(f"cannot send a message of unknown kind {message.kind!r}")
        for name, value in message.fields.items():
            _check_field(name, value, "cannot send")
        descriptors, frames = [], []
        for name, array in message.arrays.items():
            if not _NAME_RE.fullmatch(name):
                raise RLProtocolError(f"cannot send array name {name!r}")
            array = np.asarray(array)
            kind = dtype_name(array.dtype)
            if kind is None:
                raise RLProtocolError(f"cannot send array {name!r} of dtype {array.dtype} (allowed: "
                                      f"{', '.join(DTYPES)})")
            if array.ndim > MAX_DIMS:
                raise RLProtocolError(f"cannot send array {name!r} of {array.ndim} dimensions (at most {MAX_DIMS})")
            descriptors.append({"name": name, "dtype": kind, "shape": list(array.shape)})
            frames.append(np.ascontiguousarray(array, dtype=DTYPES[kind]).tobytes())
        if len(frames) > MAX_ARRAYS:
            raise RLProtocolError(f"cannot send {len(frames)} arrays in one message (at most {MAX_ARRAYS})")
        header = json.dumps({"p": PROTOCOL, "kind": message.kind, "from": self.sender, "fields": message.fields,
                             "arrays": descriptors}, allow_nan=False, separators=(",", ":")).encode()
        total = len(header) + MAC_BYTES + sum(len(f) for f in frames)
        if total > self.max_bytes or len(header) > MAX_HEADER_BYTES:
            raise RLProtocolError(f"cannot send a {message.kind} message of {total} bytes (limit {self.max_bytes}, "
                                  f"header {len(header)} of at most {MAX_HEADER_BYTES})")
        return [header, self._mac(header, frames), *frames]

    def decode(self, frames: Sequence[Frame], peer: str) -> Message:
        """The message in `frames`, or RLProtocolError naming `peer` (where the frames came from, as the transport
        knows it) and what was wrong. Nothing is parsed before the MAC is verified."""
        def refuse(what: str) -> RLProtocolError:
            return RLProtocolError(f"message from {peer} dropped: {what}")

        if len(frames) < 2 or len(frames) > 2 + MAX_ARRAYS:
            raise refuse(f"{len(frames)} frames (a message has a header, a MAC and at most {MAX_ARRAYS} arrays)")
        total = sum(len(f) for f in frames)
        if total > self.max_bytes:
            raise refuse(f"{total} bytes, over the limit of {self.max_bytes}")
        header, mac, arrays = frames[0], frames[1], frames[2:]
        if len(header) > MAX_HEADER_BYTES:
            raise refuse(f"header of {len(header)} bytes (at most {MAX_HEADER_BYTES})")
        if len(mac) != MAC_BYTES or not hmac.compare_digest(bytes(mac), self._mac(header, arrays)):
            raise refuse("bad MAC (not signed with this run's key, or altered on the way)")
        try:
            parsed = json.loads(bytes(header).decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, RecursionError) as exc:
            raise refuse(f"malformed header ({' '.join(str(exc).split())[:80]})") from None
        if not isinstance(parsed, dict) or set(parsed) != {"p", "kind", "from", "fields", "arrays"}:
            raise refuse("malformed header (expected keys p, kind, from, fields, arrays)")
        if parsed["p"] != PROTOCOL:
            raise refuse(f"protocol {parsed['p']!r} (this side speaks {PROTOCOL})")
        kind, sender = parsed["kind"], parsed["from"]
        if not isinstance(sender, str) or not _NAME_RE.fullmatch(sender):
            raise refuse("malformed header (sender name)")
        peer = f"{sender} ({peer})"
        if not isinstance(kind, str) or kind not in self.kinds:
            raise refuse(f"unknown kind {_shown(kind)}")
        fields = parsed["fields"]
        if not isinstance(fields, dict):
            raise refuse("malformed header (fields is not an object)")
        try:
            for name, value in fields.items():
                _check_field(name, value, "bad")
        except RLProtocolError as exc:
            raise refuse(str(exc)) from None
        descriptors = parsed["arrays"]
        if not isinstance(descriptors, list) or len(descriptors) != len(arrays):
            raise refuse(f"{len(arrays)} array frames for "
                         f"{len(descriptors) if isinstance(descriptors, list) else 'no'} array descriptors")
        out: dict[str, np.ndarray] = {}
        for descriptor, frame in zip(descriptors, arrays, strict=True):
            name, array = _array(descriptor, frame, refuse)
            if name in out:
                raise refuse(f"array {name!r} twice")
            out[name] = array
        return Message(kind=kind, fields=fields, arrays=out, sender=sender)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_field(name: object, value: object, verb: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise RLProtocolError(f"{verb} field name {_shown(name)}")
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not _INT64[0] <= value <= _INT64[1]:
            raise RLProtocolError(f"{verb} field {name!r}: integer out of int64 range")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise RLProtocolError(f"{verb} field {name!r}: {value} is not a finite number")
    elif isinstance(value, str):
        if len(value) > MAX_TEXT:
            raise RLProtocolError(f"{verb} field {name!r}: text of {len(value)} characters (at most {MAX_TEXT})")
    else:
        raise RLProtocolError(f"{verb} field {name!r}: a {type(value).__name__} is not a scalar")


def _array(descriptor: object, frame: Frame, refuse) -> tuple[str, np.ndarray]:
    if not isinstance(descriptor, dict) or set(descriptor) != {"name", "dtype", "shape"}:
        raise refuse("malformed array descriptor (expected name, dtype, shape)")
    name, kind, shape = descriptor["name"], descriptor["dtype"], descriptor["shape"]
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise refuse(f"array name {_shown(name)}")
    if not isinstance(kind, str) or kind not in DTYPES:
        raise refuse(f"array {name!r}: dtype {_shown(kind)} is not allowed (allowed: {', '.join(DTYPES)})")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= _INT64[1] for n in shape)):
        raise refuse(f"array {name!r}: shape {_shown(shape)} (a list of at most {MAX_DIMS} integers >= 0)")
    dtype = DTYPES[kind]
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(frame):
        raise refuse(f"array {name!r}: {kind} {tuple(shape)} needs {expected} bytes, its frame has {len(frame)}")
    array = np.frombuffer(frame, dtype=dtype).reshape(shape).copy()
    if kind == "bool" and array.size and np.frombuffer(frame, dtype=np.uint8).max() > 1:
        raise refuse(f"array {name!r}: bool bytes other than 0 and 1")
    return name, array


# ---- the messages the roles exchange ----
OBS_PREFIX = "obs/"


def _put_observation(message: Message, observation: Mapping[str, Any]) -> Message:
    for key, value in observation.items():
        if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) > 0:
            message.arrays[OBS_PREFIX + key] = value
        elif isinstance(value, np.generic):
            message.fields[OBS_PREFIX + key] = value.item()
        else:
            message.fields[OBS_PREFIX + key] = value
    return message


def _get_observation(message: Message) -> dict[str, Any]:
    observation: dict[str, Any] = {k[len(OBS_PREFIX):]: v for k, v in message.fields.items()
                                   if k.startswith(OBS_PREFIX)}
    observation.update({k[len(OBS_PREFIX):]: v for k, v in message.arrays.items() if k.startswith(OBS_PREFIX)})
    return observation


def _required(message: Message, name: str, kind: type | tuple[type, ...]) -> Any:
    value = message.fields.get(name)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise RLProtocolError(f"{message.kind} message from {message.sender or 'a peer'} dropped: field {name!r} "
                              f"missing or not {getattr(kind, '__name__', kind)}")
    return value


def _required_array(message: Message, name: str) -> np.ndarray:
    if name not in message.arrays:
        raise RLProtocolError(f"{message.kind} message from {message.sender or 'a peer'} dropped: array {name!r} "
                              "missing")
    return message.arrays[name]


def _expect(message: Message, kind: str) -> None:
    if message.kind != kind:
        raise RLProtocolError(f"expected a {kind} message from {message.sender or 'a peer'}, got {message.kind!r}")


def observation_message(env_id: int, observation: Mapping[str, Any], **fields: Scalar) -> Message:
    """env worker -> rollout: the observation of env `env_id` (arrays and scalar/text entries), plus any scalar
    fields the roles agree on (episode id, chunk index, reward of the last chunk ...)."""
    return _put_observation(Message("observation", {"env_id": int(env_id), **fields}), observation)


def observation_from(message: Message) -> tuple[int, dict[str, Any], dict[str, Scalar]]:
    """(env id, observation, the other fields) of an observation message."""
    _expect(message, "observation")
    env_id = _required(message, "env_id", int)
    rest = {k: v for k, v in message.fields.items() if k != "env_id" and not k.startswith(OBS_PREFIX)}
    return env_id, _get_observation(message), rest


def action_message(env_id: int, actions: np.ndarray, version: int, **fields: Scalar) -> Message:
    """rollout -> env worker: the action chunk [H, A] for env `env_id`, chosen by policy version `version`."""
    return Message("action", {"env_id": int(env_id), "version": int(version), **fields},
                   {"actions": np.asarray(actions, dtype=np.float32)})


def action_from(message: Message) -> tuple[int, np.ndarray, int]:
    """(env id, actions [H, A], version) of an action message."""
    _expect(message, "action")
    actions = _required_array(message, "actions")
    if actions.ndim != 2:
        raise RLProtocolError(f"action message from {message.sender} dropped: actions of shape {actions.shape} "
                              "(expected [H, A])")
    return _required(message, "env_id", int), actions, _required(message, "version", int)


_SAMPLE_INTS = ("env_id", "episode_id", "group_id", "chunk_index", "version")


def sample_message(sample: ChunkSample) -> Message:
    """rollout -> actor: one ChunkSample."""
    fields: dict[str, Scalar] = {name: int(getattr(sample, name)) for name in _SAMPLE_INTS}
    fields.update(reward=float(sample.reward), done=bool(sample.done))
    message = Message("chunk_sample", fields, {"trajectory": sample.trajectory, "log_prob": sample.log_prob})
    return _put_observation(message, sample.observation)


def sample_from(message: Message) -> ChunkSample:
    _expect(message, "chunk_sample")
    ints = {name: _required(message, name, int) for name in _SAMPLE_INTS}
    reward = _required(message, "reward", (int, float))
    try:
        return ChunkSample(**ints, observation=_get_observation(message),
                           trajectory=_required_array(message, "trajectory"),
                           log_prob=_required_array(message, "log_prob"),
                           reward=float(reward), done=_required(message, "done", bool))
    except ValueError as exc:
        raise RLProtocolError(f"chunk_sample message from {message.sender} dropped: {exc}") from None


_END_INTS = ("env_id", "episode_id", "group_id", "length", "version")


def episode_end_message(end: EpisodeEnd) -> Message:
    fields: dict[str, Scalar] = {name: int(getattr(end, name)) for name in _END_INTS}
    fields.update(success=bool(end.success), episode_return=float(end.episode_return))
    return Message("episode_end", fields)


def episode_end_from(message: Message) -> EpisodeEnd:
    _expect(message, "episode_end")
    ints = {name: _required(message, name, int) for name in _END_INTS}
    try:
        return EpisodeEnd(**ints, success=_required(message, "success", bool),
                          episode_return=float(_required(message, "episode_return", (int, float))))
    except ValueError as exc:
        raise RLProtocolError(f"episode_end message from {message.sender} dropped: {exc}") from None
