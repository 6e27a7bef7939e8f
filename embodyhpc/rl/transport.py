"""Bounded queues between the RL roles over pyzmq: nothing waits forever and no queue grows without bound.

    env worker  --Requester (DEALER)-->  Server (ROUTER)  rollout worker     observations -> action chunks
    rollout     --Pusher (PUSH)------->  Puller (PULL)    actor              ChunkSample / EpisodeEnd stream

Every message goes through embodyhpc.rl.codec (signed with the run's key, no pickle). A message that fails to
decode is dropped with a one-line warning (and counted in `.dropped`); it never reaches the caller and never stops
the receiver. Sockets close with LINGER 0 (a dead peer never holds a closing role), and receiving sockets carry
MAXMSGSIZE = the codec's size limit (zmq drops a bigger frame, and its sender's connection, before holding it).
What a receiving socket may hold before anything is verified is therefore at most hwm x that limit per connection.

Bounds:
- `Pusher.push` blocks while the queue is full (SNDHWM on the pusher, RCVHWM on the puller: at most about
  2 x `hwm` messages plus the kernel's socket buffers are ever in flight), returns the seconds it waited
  (back-pressure, for the "time per role" metrics), and raises PeerTimeout after `timeout_s` of being full.
- `Requester.recv`, `Puller.pull` and `Puller.pull_many` raise PeerTimeout when the peer has been silent for their
  timeout; `Server.poll` returns [] after its timeout (a server has many peers: it asks `silent_peers`).

Heartbeats: liveness is decided by the receiver. A peer is alive while it sends anything (any message, including
the "heartbeat" kind, which the receiving classes count but never hand to the caller). A role that may be busy
longer than its peer's timeout (a rollout worker receiving weights, an actor step) sends `heartbeat()` meanwhile.
`Server.silent_peers(peer_timeout_s)` and `Puller.silent_peers(peer_timeout_s)` name the peers that sent nothing
for that long: dead, whatever the reason; the role decides what follows (redistribute, restart, end the job).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable

import zmq

from embodyhpc.errors import RunFailure
from embodyhpc.rl.codec import Codec, Message, RLProtocolError

log = logging.getLogger(__name__)

HEARTBEAT = "heartbeat"
DRAIN_LIMIT = 1024  # messages one Server.poll reads at most (the rest wait for the next poll)


class PeerTimeout(RunFailure):
    """A peer stayed silent (or a queue stayed full) past its bound: one line naming the peer and the seconds."""

    def __init__(self, peer: str, seconds: float, what: str = "sent nothing") -> None:
        self.peer = peer
        self.seconds = seconds
        super().__init__(f"{peer} {what} for {seconds:.1f} s (its timeout): the peer is dead, hung or unreachable")


def _ms(seconds: float) -> int:
    """zmq's poll timeout for `seconds`, rounded up (a poll never returns before the bound it stands for)."""
    return max(0, math.ceil(seconds * 1000))


def _context() -> zmq.Context:
    return zmq.Context.instance()


def _socket(kind: int, codec: Codec, *, hwm: int | None = None) -> zmq.Socket:
    sock = _context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, codec.max_bytes)
    if hwm is not None:
        if hwm < 1:
            raise ValueError(f"queue depth (HWM) must be >= 1, got {hwm}")
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    return sock


def _bind(sock: zmq.Socket, host: str, address: str | None) -> tuple[str, int]:
    """Bind `address`, or a free TCP port of `host` (an interface's address, or "*": every interface, what a
    cluster node binds; peers connect to the host name embodyhpc.rl.endpoints publishes). (address, port)."""
    if address is None:
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}", port
    sock.bind(address)
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return address, int(endpoint.rsplit(":", 1)[1]) if endpoint.startswith("tcp://") else 0


class _Receiver:
    """What every receiving end shares: decode or drop (counted, logged), the last time each sender was heard."""

    def __init__(self, codec: Codec, name: str) -> None:
        self.codec = codec
        self.name = name
        self.dropped = 0
        self.last_error = ""
        self.last_seen: dict[str, float] = {}
        self._started = time.monotonic()

    def _decode(self, frames: list[bytes], where: str) -> Message | None:
        """The message (heartbeats included), or None when it was dropped."""
        try:
            message = self.codec.decode(frames, where)
        except RLProtocolError as exc:
            self.dropped += 1
            self.last_error = str(exc)
            log.warning("%s: %s", self.name, exc)
            return None
        self.last_seen[message.sender] = time.monotonic()
        return message

    def silent_peers(self, peer_timeout_s: float, expected: Iterable[str] = ()) -> list[str]:
        """Senders silent for more than `peer_timeout_s`: those heard before, and those `expected` but never heard
        (counted from this end's start)."""
        now = time.monotonic()
        seen = {sender: self._started for sender in expected} | self.last_seen
        return sorted(p for p, t in seen.items() if now - t > peer_timeout_s)


class Requester(_Receiver):
    """The env worker's end: `send` observations, `recv` the replies (any number in flight), `request` = both.
    `peer` names the server in errors ("rollout 0"). Its routing id is the codec's sender name."""

    def __init__(self, address: str, codec: Codec, *, peer: str, timeout_s: float, hwm: int = 64,
                 on_receive: Callable[[], None] | None = None) -> None:
        super().__init__(codec, f"{codec.sender} -> {peer}")
        self.peer = peer
        self.timeout_s = float(timeout_s)
        self.on_receive = on_receive  # called at every valid message, heartbeats included (the env worker's beat)
        self.sock = _socket(zmq.DEALER, codec, hwm=hwm)
        self.sock.setsockopt(zmq.ROUTING_ID, codec.sender.encode())
        self.sock.connect(address)

    def send(self, message: Message, timeout_s: float | None = None) -> None:
        """Queue `message` for the server; PeerTimeout when its queue stays full for `timeout_s`."""
        frames = self.codec.encode(message)
        bound = self.timeout_s if timeout_s is None else timeout_s
        if not self.sock.poll(_ms(bound), zmq.POLLOUT):
            raise PeerTimeout(self.peer, bound, "accepted nothing")
        self.sock.send_multipart(frames, zmq.NOBLOCK)

    def heartbeat(self) -> None:
        self.send(Message(HEARTBEAT))

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next reply; PeerTimeout when the server sent nothing valid (not even a heartbeat) for `timeout_s`."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTimeout(self.peer, bound)
            if not self.sock.poll(_ms(left), zmq.POLLIN):
                continue
            message = self._decode(self.sock.recv_multipart(zmq.NOBLOCK), self.peer)
            if message is None:
                continue
            if self.on_receive is not None:
                self.on_receive()
            if message.kind != HEARTBEAT:
                return message
            deadline = time.monotonic() + bound  # the server is alive: the bound starts again

    def request(self, message: Message, timeout_s: float | None = None) -> Message:
        self.send(message, timeout_s)
        return self.recv(timeout_s)

    def close(self) -> None:
        self.sock.close(linger=0)


class Server(_Receiver):
    """The rollout worker's end: `poll` gathers requests from every env worker, `reply(peer, message)` answers.
    Binds `address`, or a free port of `host` (`.address` and `.port` say which)."""

    def __init__(self, codec: Codec, *, host: str = "127.0.0.1", address: str | None = None,
                 timeout_s: float = 120.0, hwm: int = 64) -> None:
        super().__init__(codec, f"{codec.sender} server")
        self.timeout_s = float(timeout_s)
        self.sock = _socket(zmq.ROUTER, codec, hwm=hwm)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone peer raises instead of vanishing
        self.address, self.port = _bind(self.sock, host, address)
        self._peers: dict[str, bytes] = {}

    def poll(self, timeout_s: float) -> list[tuple[str, Message]]:
        """[(peer, message)] of the requests ready within `timeout_s` (waits for the first, then takes what is
        queued, heartbeats aside); [] when none came. `peer` is the sender's name (checked by the MAC)."""
        out: list[tuple[str, Message]] = []
        deadline = time.monotonic() + timeout_s
        for _ in range(DRAIN_LIMIT):  # bounded work per call, even under a flood of messages that are dropped
            wait_ms = 0 if out else _ms(deadline - time.monotonic())
            if not self.sock.poll(wait_ms, zmq.POLLIN):
                break
            identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
            message = self._decode(frames, f"connection {identity[:64]!r}")
            if message is None:
                continue
            self._peers[message.sender] = identity
            if message.kind != HEARTBEAT:
                out.append((message.sender, message))
        return out

    def reply(self, peer: str, message: Message, timeout_s: float | None = None) -> None:
        """Send `message` to `peer`; PeerTimeout when its queue stays full for `timeout_s`, or it is gone."""
        identity = self._peers.get(peer)
        if identity is None:
            raise PeerTimeout(peer, 0.0, "never sent a request")
        frames = self.codec.encode(message)
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        while True:
            try:
                self.sock.send_multipart([identity, *frames], zmq.NOBLOCK)
                return
            except zmq.Again:  # its queue is full
                pass
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                raise PeerTimeout(peer, bound, "is no longer connected: it was silent") from None
            if time.monotonic() >= deadline:
                raise PeerTimeout(peer, bound, "read nothing")
            time.sleep(0.005)

    def heartbeat(self, peer: str) -> None:
        """Tell `peer` this server is alive (while it is busy longer than the peer's timeout)."""
        self.reply(peer, Message(HEARTBEAT))

    def close(self) -> None:
        self.sock.close(linger=0)


class Pusher:
    """The rollout worker's stream to the actor: `push` blocks while the queue is full (back-pressure) and returns
    the seconds it waited; PeerTimeout after `timeout_s` of a full queue. `peer` names the actor in errors."""

    def __init__(self, address: str, codec: Codec, *, peer: str, hwm: int, timeout_s: float) -> None:
        self.codec = codec
        self.peer = peer
        self.timeout_s = float(timeout_s)
        self.sock = _socket(zmq.PUSH, codec, hwm=hwm)
        self.sock.connect(address)
        self.waited_s = 0.0  # in total, for the metrics

    def push(self, message: Message, timeout_s: float | None = None) -> float:
        frames = self.codec.encode(message)
        bound = self.timeout_s if timeout_s is None else timeout_s
        start = time.monotonic()
        while True:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
                break
            except zmq.Again:  # full: wait until it has room, at most until the bound
                left = start + bound - time.monotonic()
                if left <= 0:
                    raise PeerTimeout(self.peer, bound, "read nothing (its queue stayed full)") from None
                self.sock.poll(_ms(left), zmq.POLLOUT)
        waited = time.monotonic() - start
        self.waited_s += waited
        return waited

    def heartbeat(self, timeout_s: float | None = None) -> float:
        return self.push(Message(HEARTBEAT), timeout_s)

    def close(self) -> None:
        self.sock.close(linger=0)


class Puller(_Receiver):
    """The actor's end of the stream: binds (every rollout worker's Pusher connects), `pull` / `pull_many`.
    Binds `address`, or a free port of `host` (`.address` and `.port` say which). `peer` names the senders in
    errors."""

    def __init__(self, codec: Codec, *, hwm: int, timeout_s: float, host: str = "127.0.0.1",
                 address: str | None = None, peer: str = "rollout workers") -> None:
        super().__init__(codec, f"{codec.sender} puller")
        self.peer = peer
        self.timeout_s = float(timeout_s)
        self.sock = _socket(zmq.PULL, codec, hwm=hwm)
        self.address, self.port = _bind(self.sock, host, address)

    def pull(self, timeout_s: float | None = None) -> Message:
        """The next message; PeerTimeout when no peer sent anything valid (heartbeats included) for `timeout_s`."""
        return self.pull_many(1, timeout_s)[0]

    def pull_many(self, max_messages: int, timeout_s: float | None = None) -> list[Message]:
        """Waits (bounded as `pull`) for the first message, then takes what is already queued, up to
        `max_messages`, without waiting more."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + bound
        out: list[Message] = []
        while len(out) < max_messages:
            if not out and time.monotonic() >= deadline:  # also under a flood of messages that are dropped
                raise PeerTimeout(self.peer, bound)
            if not self.sock.poll(0 if out else _ms(deadline - time.monotonic()), zmq.POLLIN):
                if out:
                    break
                continue
            message = self._decode(self.sock.recv_multipart(zmq.NOBLOCK), self.peer)
            if message is None:
                continue
            if message.kind == HEARTBEAT:
                deadline = time.monotonic() + bound  # a peer is alive: the bound starts again
            else:
                out.append(message)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
