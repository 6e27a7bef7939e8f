"""The RL roles' queues over pyzmq: request/reply, hostile peers dropped, back-pressure, dead peers bounded."""

from __future__ import annotations

import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from embodyhpc.rl.codec import Codec, Message, action_from, action_message, observation_from, observation_message
from embodyhpc.rl.endpoints import (
    RendezvousError,
    endpoint_file,
    key_file,
    publish,
    publish_dist_init,
    read_key,
    run_key,
    tcp_address,
    wait_dist_init,
    wait_for,
)
from embodyhpc.rl.transport import PeerTimeout, Puller, Pusher, Requester, Server

KEY = b"k" * 32


def codec(sender: str, max_bytes: int = 4 << 20) -> Codec:
    return Codec(KEY, sender=sender, max_bytes=max_bytes)


@pytest.fixture
def server():
    end = Server(codec("rollout-0"), timeout_s=2.0)
    yield end
    end.close()


def test_requests_are_answered_and_hostile_messages_dropped(server, caplog) -> None:
    env = Requester(server.address, codec("env-1"), peer="rollout 0", timeout_s=5.0)
    raw = zmq.Context.instance().socket(zmq.DEALER)  # a stranger on the network: no key
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.address)
    other_run = Requester(server.address, Codec(b"x" * 32, sender="env-9"), peer="rollout 0", timeout_s=5.0)
    try:
        raw.send_multipart([b'{"p":1}', b"\0" * 32])
        raw.send_multipart([b"just one frame"])
        other_run.send(observation_message(9, {"task": "rm -rf"}))  # signed with another run's key
        env.send(observation_message(3, {"observation.state": np.arange(4, dtype=np.float32), "task": "t"},
                                     chunk_index=2))
        got = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = server.poll(0.5)
        [(peer, message)] = got
        assert peer == "env-1"
        env_id, obs, rest = observation_from(message)
        assert env_id == 3 and rest == {"chunk_index": 2} and obs["observation.state"].tolist() == [0, 1, 2, 3]
        server.reply(peer, action_message(env_id, np.full((5, 4), 0.5), version=7))
        env_id, actions, version = action_from(env.recv())
        assert (env_id, version) == (3, 7) and actions.shape == (5, 4)
        while server.dropped < 3 and time.monotonic() < deadline:
            server.poll(0.2)
        warnings = sorted(r.getMessage() for r in caplog.records if r.name == "embodyhpc.rl.transport")
        assert server.dropped == 3 and len(warnings) == 3 and not any("\n" in w for w in warnings)
        assert [w.split(" dropped: ")[1].split(" (")[0] for w in warnings] == ["1 frames", "bad MAC", "bad MAC"]
        assert server.silent_peers(60.0, expected=["env-1", "env-2"]) == []
        assert server.silent_peers(0.0, expected=["env-1", "env-2"]) == ["env-1", "env-2"]
    finally:
        raw.close()
        other_run.close()
        env.close()


def test_a_dead_server_makes_the_requester_raise_within_its_bound(server) -> None:
    env = Requester(server.address, codec("env-0"), peer="rollout 0", timeout_s=0.3)
    outcome: dict = {}

    def ask() -> None:
        start = time.monotonic()
        try:
            env.request(observation_message(0, {"task": "t"}))
        except PeerTimeout as exc:
            outcome["error"], outcome["waited"] = exc, time.monotonic() - start

    server.close()  # the rollout worker died
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout=30)  # a wait without its bound would still be blocked here
    assert not thread.is_alive(), "the requester hung on a dead server"
    env.close()
    assert outcome["waited"] >= 0.3
    assert str(outcome["error"]).startswith("rollout 0 sent nothing for 0.3 s")


def test_heartbeats_are_absorbed(server) -> None:
    env = Requester(server.address, codec("env-0"), peer="rollout 0", timeout_s=5.0)
    try:
        env.heartbeat()
        env.send(observation_message(0, {"task": "t"}))
        got = []
        while not got:
            got = server.poll(5.0)
        assert [m.kind for _, m in got] == ["observation"]  # the heartbeat counted, not handed over
        server.heartbeat("env-0")
        server.reply("env-0", action_message(0, np.zeros((1, 1)), 0))
        assert env.recv().kind == "action"
        with pytest.raises(PeerTimeout, match="env-7 never sent a request"):
            server.reply("env-7", action_message(0, np.zeros((1, 1)), 0))
    finally:
        env.close()


def _kernel_buffer_bytes() -> int:
    """Most bytes the loopback TCP connection's send and receive buffers can hold (Linux's tcp_wmem/tcp_rmem)."""
    total = 0
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except OSError:
            total += 8 << 20
    return total


def test_a_full_queue_blocks_the_pusher_then_raises_and_memory_stays_bounded() -> None:
    """A Puller that does not read: the Pusher accepts about 2 x HWM messages (its send queue, the puller's receive
    queue) plus what the kernel's socket buffers hold, then blocks, then raises PeerTimeout after its bound. Without
    the HWM zmq queues 1000 messages on each side (its default): past the bound."""
    hwm, size = 4, 1 << 20
    bound = 2 * hwm + _kernel_buffer_bytes() // size + 2
    cap = bound + 1  # far below zmq's default HWM of 1000 per side: a pusher without HWM gets here unblocked
    puller = Puller(codec("actor-0"), hwm=hwm, timeout_s=5.0)
    pusher = Pusher(puller.address, codec("rollout-0"), peer="actor 0", hwm=hwm, timeout_s=0.2)
    message = Message("chunk_sample", arrays={"x": np.zeros(size, np.uint8)})
    try:
        accepted, error = 0, None
        while accepted < cap:
            try:
                pusher.push(message)
            except PeerTimeout as exc:
                error = exc
                break
            accepted += 1
        assert error is not None, f"{accepted} messages of {size} bytes queued without blocking: no back-pressure"
        assert hwm <= accepted <= bound, (accepted, bound)
        assert str(error) == ("actor 0 read nothing (its queue stayed full) for 0.2 s (its timeout): the peer is "
                              "dead, hung or unreachable")

        # the reader wakes up: the blocked pusher goes on, having waited, and nothing was lost
        def drain_later() -> None:
            time.sleep(0.1)
            received = 0
            while received < accepted + 1:
                received += len(puller.pull_many(100, timeout_s=10.0))

        reader = threading.Thread(target=drain_later, daemon=True)
        reader.start()
        waited = pusher.push(message, timeout_s=20.0)
        reader.join(timeout=30)
        assert not reader.is_alive() and waited >= 0.05 and pusher.waited_s >= waited
        with pytest.raises(PeerTimeout, match="rollout workers sent nothing for 0.1 s"):
            puller.pull(timeout_s=0.1)
    finally:
        pusher.close()
        puller.close()


# ---- the rendezvous through the run folder (embodyhpc.rl.endpoints) ----
def test_the_run_key_is_made_once_private_and_checked(tmp_path) -> None:
    first = run_key(tmp_path)
    path = key_file(tmp_path)
    assert len(first) == 32 and run_key(tmp_path) == first == read_key(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["secret.key"]  # no temp file left behind
    path.chmod(0o644)
    with pytest.raises(RendezvousError, match=r"readable by other users \(mode 644\); fix: chmod 600"):
        read_key(tmp_path)
    path.chmod(0o600)
    path.write_text("abcd\n")
    with pytest.raises(RendezvousError, match="not a key of 32 hex bytes"):
        run_key(tmp_path)  # an existing key is never replaced behind the roles' backs


def test_roles_meet_through_the_run_folder(tmp_path) -> None:
    server = Server(codec("rollout-1"), host="127.0.0.1")
    env = None
    try:
        publish(tmp_path, "rollout", 1, port=server.port, session="42.0", host="127.0.0.1")
        endpoint = wait_for(tmp_path, "rollout", 1, session="42.0", timeout_s=5)
        env = Requester(tcp_address(endpoint), codec("env-0"), peer="rollout 1", timeout_s=5)
        env.send(observation_message(0, {"task": "t"}))
        got = []
        while not got:
            got = server.poll(5)
        assert got[0][0] == "env-0"
        # a file of an earlier start (a requeue) names a dead port: ignored until this start publishes its own
        with pytest.raises(PeerTimeout, match=r"rollout 1 published no endpoint \(.*rollout-1.json\) for 0.3 s"):
            wait_for(tmp_path, "rollout", 1, session="42.1", timeout_s=0.3, poll_s=0.05)
    finally:
        server.close()
        if env is not None:
            env.close()
    endpoint_file(tmp_path, "actor", 0).write_text('{"role": "actor", "rank": 0, "host": "", "port": 0, '
                                                   '"session": "s"}')
    with pytest.raises(RendezvousError, match="malformed endpoint of actor 0"):
        wait_for(tmp_path, "actor", 0, session="s", timeout_s=1)
    init = publish_dist_init(tmp_path, session="s", host="127.0.0.1")
    assert init.startswith("tcp://127.0.0.1:") and wait_dist_init(tmp_path, session="s", timeout_s=1) == init
