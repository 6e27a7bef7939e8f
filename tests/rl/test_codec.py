"""The RL message codec: round trips bit-exact, and every hostile message refused with one line naming the peer.

Hostile messages are built here by hand from the documented wire format (header JSON, then HMAC-SHA256 with the
key over b"embodyhpc-rl/1" and each frame prefixed with its 8-byte little-endian length, then raw little-endian
frames), signed with this test's own hmac: a message with a valid MAC reaches every check after it, and the
format is checked against its documentation, not against the encoder."""

from __future__ import annotations

import hashlib
import hmac
import json

import numpy as np
import pytest

from embodyhpc.rl.codec import (
    Codec,
    Message,
    RLProtocolError,
    action_from,
    action_message,
    episode_end_from,
    episode_end_message,
    observation_from,
    observation_message,
    sample_from,
    sample_message,
)
from embodyhpc.rl.samples import ChunkSample, EpisodeEnd

KEY = bytes(range(32))
PEER = "tcp://10.0.0.7:5555"


def sign(key: bytes, header: bytes, frames: list[bytes]) -> bytes:
    mac = hmac.new(key, b"embodyhpc-rl/1", hashlib.sha256)
    for frame in (header, *frames):
        mac.update(len(frame).to_bytes(8, "little") + frame)
    return mac.digest()


def hand_made(header: dict | bytes, frames: list[bytes] = (), key: bytes = KEY) -> list[bytes]:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return [raw, sign(key, raw, list(frames)), *frames]


def header(kind="action", fields=None, arrays=()) -> dict:
    return {"p": 1, "kind": kind, "from": "rollout-0", "fields": fields or {}, "arrays": list(arrays)}


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(KEY, sender="env-3", max_bytes=1 << 20)


def test_a_hand_made_message_decodes(codec) -> None:
    state = np.arange(6, dtype="<f4").reshape(2, 3)
    got = codec.decode(hand_made(header(fields={"env_id": 2, "version": 7}, arrays=[
        {"name": "actions", "dtype": "float32", "shape": [2, 3]}]), [state.tobytes()]), PEER)
    assert got.sender == "rollout-0" and got.fields == {"env_id": 2, "version": 7}
    env_id, actions, version = action_from(got)
    assert (env_id, version) == (2, 7) and np.array_equal(actions, state) and actions.dtype == np.float32


def test_round_trips_are_bit_exact(codec) -> None:
    rng = np.random.default_rng(0)
    observation = {"observation.images.corner": rng.integers(0, 256, (8, 8, 3), dtype=np.uint8),
                   "observation.state": rng.standard_normal(4).astype(np.float32), "task": "reach the red button"}
    sample = ChunkSample(env_id=1, episode_id=9, group_id=4, chunk_index=2, observation=observation,
                         trajectory=rng.standard_normal((5, 3, 2)), log_prob=rng.standard_normal((4, 3, 2)),
                         version=11, reward=1.0, done=True)
    back = sample_from(codec.decode(codec.encode(sample_message(sample)), PEER))
    for name in ("env_id", "episode_id", "group_id", "chunk_index", "version", "reward", "done"):
        assert getattr(back, name) == getattr(sample, name), name
    assert back.trajectory.tobytes() == sample.trajectory.tobytes()
    assert back.log_prob.tobytes() == sample.log_prob.tobytes()
    assert back.observation["task"] == "reach the red button"
    for key in ("observation.images.corner", "observation.state"):
        assert back.observation[key].dtype == observation[key].dtype
        assert np.array_equal(back.observation[key], observation[key])

    end = EpisodeEnd(env_id=1, episode_id=9, group_id=4, success=True, episode_return=3.25, length=40, version=11)
    assert episode_end_from(codec.decode(codec.encode(episode_end_message(end)), PEER)) == end

    every_dtype = {f"x.{name}": rng.integers(0, 2, (2, 3)).astype(name)
                   for name in ("uint8", "int32", "int64", "float16", "float32", "float64", "bool")}
    every_dtype["big_endian"] = np.arange(3, dtype=">f8")  # sent little-endian, same values
    env_id, obs, rest = observation_from(codec.decode(codec.encode(
        observation_message(5, every_dtype, episode_id=3, reward=0.5)), PEER))
    assert (env_id, rest) == (5, {"episode_id": 3, "reward": 0.5})
    for key, value in every_dtype.items():
        assert np.array_equal(obs[key], value) and obs[key].dtype.kind == value.dtype.kind, key

    _, actions, version = action_from(codec.decode(codec.encode(action_message(0, np.ones((5, 4)), 2)), PEER))
    assert actions.shape == (5, 4) and version == 2


HOSTILE = {
    "bad MAC": lambda: hand_made(header(), key=b"another run's key 0123456789abcd"),
    "malformed header": lambda: hand_made(b"{not json"),
    "malformed header (expected keys": lambda: hand_made({"p": 1, "kind": "action"}),
    "unknown kind 'exec'": lambda: hand_made(header(kind="exec")),
    "dtype 'object' is not allowed": lambda: hand_made(header(arrays=[
        {"name": "a", "dtype": "object", "shape": [1]}]), [b"\0" * 8]),
    "dtype '<f4' is not allowed": lambda: hand_made(header(arrays=[
        {"name": "a", "dtype": "<f4", "shape": [1]}]), [b"\0" * 4]),
    "needs 24 bytes, its frame has 20": lambda: hand_made(header(arrays=[
        {"name": "a", "dtype": "float32", "shape": [2, 3]}]), [b"\0" * 20]),
    "shape": lambda: hand_made(header(arrays=[{"name": "a", "dtype": "uint8", "shape": [-1]}]), [b""]),
    "bool bytes other than 0 and 1": lambda: hand_made(header(arrays=[
        {"name": "a", "dtype": "bool", "shape": [2]}]), [b"\x01\x02"]),
    "1 array frames for 0 array descriptors": lambda: hand_made(header(), [b"\0"]),
    "not a scalar": lambda: hand_made(header(fields={"x": {"__reduce__": "os.system"}})),
    "not JSON": lambda: hand_made(b'{"p": 1, "kind": "action", "from": "r", "fields": {"x": NaN}, "arrays": []}'),
    "over the limit": lambda: hand_made(header(arrays=[
        {"name": "a", "dtype": "uint8", "shape": [2 << 20]}]), [b"\0" * (2 << 20)]),
    "1 frames": lambda: [b"{}"],
    "malformed header (maximum recursion": lambda: hand_made(b"[" * 60000),
    "malformed header ('utf-8' codec": lambda: hand_made(b"\xff\xfe{}"),
}


@pytest.mark.parametrize("what", list(HOSTILE))
def test_hostile_messages_are_refused_in_one_line(codec, what) -> None:
    with pytest.raises(RLProtocolError) as caught:
        codec.decode(HOSTILE[what](), PEER)
    text = str(caught.value)
    assert what in text and PEER in text and "\n" not in text, text


def test_a_replayed_header_with_other_frames_is_refused(codec) -> None:
    """A signed header and MAC lifted from one message and put on another's frames (or the frames re-cut)."""
    genuine = codec.encode(action_message(0, np.zeros((2, 2)), 1))
    forged = codec.encode(action_message(0, np.full((2, 2), 9.0), 1))
    for frames in ([genuine[0], genuine[1], forged[2]], [forged[0], genuine[1], forged[2]],
                   [genuine[0], genuine[1], genuine[2][:8], genuine[2][8:]]):
        with pytest.raises(RLProtocolError, match="bad MAC"):
            codec.decode(frames, PEER)


def test_the_encoder_refuses_what_the_decoder_would(codec) -> None:
    with pytest.raises(RLProtocolError, match="unknown kind"):
        codec.encode(Message("exec"))
    with pytest.raises(RLProtocolError, match="dtype complex128"):
        codec.encode(Message("action", arrays={"a": np.zeros(2, dtype=complex)}))
    with pytest.raises(RLProtocolError, match="not a finite number"):
        codec.encode(Message("action", {"reward": float("inf")}))
    with pytest.raises(RLProtocolError, match="limit"):
        codec.encode(Message("action", arrays={"a": np.zeros(2 << 20, dtype=np.uint8)}))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Codec(b"short", sender="env-0")
    with pytest.raises(RLProtocolError, match="field 'version' missing"):
        action_from(Message("action", {"env_id": 0}, {"actions": np.zeros((1, 1))}, sender="rollout-0"))
