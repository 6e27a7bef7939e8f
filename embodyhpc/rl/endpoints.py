"""The RL roles find each other through the run folder (a shared filesystem on a cluster), with no extra service:

    <run>/rl/secret.key                  the run's message key (32 random bytes, hex): created once, mode 0600
    <run>/rl/endpoints/<role>-<rank>.json  {"role", "rank", "host", "port", "session", "pid"}: where a server role
                                         (a rollout worker's Server, the actor's Puller) listens, written atomically
    <run>/rl/endpoints/dist-0.json       the torch.distributed init address (actor rank 0's host, a free port)

A server binds a free port on every interface and publishes its host name and port (`publish`); a client polls for
the file (`wait_for`, bounded: PeerTimeout naming the role, rank and seconds). `session` tells this start of the job
from an earlier one (a requeue or a resume reuses the run folder, and a stale file names a dead port): anything all
roles of one start share, e.g. f"{SLURM_JOB_ID}.{SLURM_RESTART_COUNT}"; a file of another session is ignored as if
absent, and replaced when its role publishes again.

The key is made by whichever role comes first (written to a private temp file, then hard-linked to its name: the
name appears whole or not at all, and only one writer wins), read by every other; a key file other users could
read, or one of the wrong length, is refused with a one-line error naming the file and the fix.

The names here should move to embodyhpc/rundir.py (the only module that spells a run-folder name) once it has an
`rl/` section: RL_DIR, ENDPOINTS_DIR, KEY_FILE and the <role>-<rank>.json pattern.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from embodyhpc.atomic import write_json_atomic
from embodyhpc.errors import RunFailure
from embodyhpc.rl.transport import PeerTimeout

RL_DIR = "rl"
ENDPOINTS_DIR = f"{RL_DIR}/endpoints"
KEY_FILE = f"{RL_DIR}/secret.key"
KEY_BYTES = 32
DIST_ROLE = "dist"  # the torch.distributed init address, published by actor rank 0
POLL_S = 0.2
_ROLE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}", re.ASCII)


class RendezvousError(RunFailure):
    """The run folder's RL files are not what they must be (a readable key, a malformed endpoint file)."""


def endpoint_file(run_dir: str | os.PathLike, role: str, rank: int) -> Path:
    if not _ROLE_RE.fullmatch(role) or isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"endpoint of role {role!r} rank {rank!r}: a lower-case role name and a rank >= 0")
    return Path(run_dir) / ENDPOINTS_DIR / f"{role}-{rank}.json"


def advertised_host() -> str:
    """The name peers reach this node by: EMBODYHPC_RL_HOST when the launcher sets it (127.0.0.1 locally, an
    interface's address where host names do not resolve between nodes), else the host name."""
    return os.environ.get("EMBODYHPC_RL_HOST") or socket.gethostname()


def publish(run_dir: str | os.PathLike, role: str, rank: int, *, port: int, session: str,
            host: str | None = None) -> Path:
    """Write where `role` `rank` listens (atomically: a reader sees the old file or this one)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port {port!r} of {role} {rank} is not a TCP port")
    path = endpoint_file(run_dir, role, rank)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_json_atomic(path, {"role": role, "rank": rank, "host": host or advertised_host(), "port": port,
                             "session": str(session), "pid": os.getpid()})
    return path


def _read_endpoint(path: Path, role: str, rank: int, session: str) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RendezvousError(f"{path}: not an endpoint file ({' '.join(str(exc).split())[:80]}); remove it and "
                              "start the job again") from None
    if not isinstance(data, dict) or data.get("session") != str(session):
        return None  # an earlier start's file (or another session's): not ours, wait for ours
    host, port = data.get("host"), data.get("port")
    if (data.get("role") != role or data.get("rank") != rank or not isinstance(host, str) or not host
            or isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise RendezvousError(f"{path}: malformed endpoint of {role} {rank} (host {host!r}, port {port!r}); remove "
                              "it and start the job again")
    return data


def wait_for(run_dir: str | os.PathLike, role: str, rank: int, *, session: str, timeout_s: float,
             poll_s: float = POLL_S) -> dict[str, Any]:
    """The endpoint `role` `rank` published in this session ({"host", "port", ...}); PeerTimeout when it did not
    within `timeout_s`."""
    path = endpoint_file(run_dir, role, rank)
    deadline = time.monotonic() + timeout_s
    while True:
        found = _read_endpoint(path, role, rank, session)
        if found is not None:
            return found
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"{role} {rank}", timeout_s, f"published no endpoint ({path})")
        time.sleep(min(poll_s, left))


def tcp_address(endpoint: dict[str, Any]) -> str:
    """The address a client connects to."""
    return f"tcp://{endpoint['host']}:{endpoint['port']}"


def free_port(host: str = "") -> int:
    """A TCP port free on this node now (the OS picks it). Between this and the bind of whoever uses it another
    process may take it: torch.distributed's store then fails to bind, loudly, and the job ends with that reason."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def publish_dist_init(run_dir: str | os.PathLike, *, session: str, host: str | None = None) -> str:
    """Actor rank 0: choose a free port, publish it; the init_method "tcp://host:port" every rank passes to
    torch.distributed.init_process_group."""
    port = free_port()
    path = publish(run_dir, DIST_ROLE, 0, port=port, session=session, host=host)
    return tcp_address(_read_endpoint(path, DIST_ROLE, 0, session) or {})


def wait_dist_init(run_dir: str | os.PathLike, *, session: str, timeout_s: float) -> str:
    """Every other rank: the init_method actor rank 0 published (bounded wait)."""
    return tcp_address(wait_for(run_dir, DIST_ROLE, 0, session=session, timeout_s=timeout_s))


# ---- the run's secret key ----
def key_file(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / KEY_FILE


def run_key(run_dir: str | os.PathLike) -> bytes:
    """The run's message key: created (0600) by the first role to ask, read by every other. Idempotent."""
    path = key_file(run_dir)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=".secret.")  # mkstemp: mode 0600
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(KEY_BYTES) + "\n")
            os.link(name, path)  # atomic, and fails if another role made it first: theirs is the key
        except FileExistsError:
            pass
        finally:
            os.unlink(name)
    return read_key(run_dir)


def read_key(run_dir: str | os.PathLike) -> bytes:
    """The key the run already has; RendezvousError (one line: the file and the fix) when it is missing, other
    users could read it, or it is not KEY_BYTES bytes of hex."""
    path = key_file(run_dir)
    try:
        info = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise RendezvousError(f"{path}: cannot read the run's RL key ({exc.strerror}); the first RL role creates it"
                              ) from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RendezvousError(f"{path}: the run's RL key is readable by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):o}); fix: chmod 600 {path}, or remove it to make a new one")
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise RendezvousError(f"{path}: not a key of {KEY_BYTES} hex bytes; remove it (the next start makes a new one)")
    return key
