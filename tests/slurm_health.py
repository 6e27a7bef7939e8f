"""The local cluster's health around each `slurm` test (tests/conftest.py): a node that is down, drained or not
responding when a test starts, and what the cluster looked like when a test failed.

Why: in one CI run every job of the `het` partition (3 nodes) stayed unfinished for its test's whole bound, six
tests in a row, after every 2-node test had passed; the log said only "timed out". A node the cluster lost
between tests makes every later multi-node test fail the same way, so each slurm test starts on usable nodes:
a node found down or not responding has its slurmd started again (tools/slurm-local.sh start, which only starts
what is missing) and is resumed, and the finding is reported as a warning that names the node, its state and
Slurm's reason (a "Kill task failed" drain means a step's processes outlived SIGKILL by UnkillableStepTimeout: on a
loaded 2-core machine, a process stuck in the kernel). A failed slurm test's report carries the queue, the nodes
and the controller's log tail."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
USABLE = {"idle", "mixed", "allocated", "completing", "planned"}  # planned: held for a pending job
BOUND_S = 90.0


def _run(*args: str) -> str:
    try:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"<{args[0]}: {exc}>"
    return proc.stdout if proc.returncode == 0 else f"<{' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}>"


def node_states() -> dict[str, tuple[str, str]]:
    """node -> (state, reason) from sinfo (a node in two partitions is listed once); {} if sinfo does not answer."""
    states = {}
    for line in _run("sinfo", "--noheader", "--Node", "--format=%N|%T|%E").splitlines():
        name, _, rest = line.partition("|")
        state, _, reason = rest.partition("|")
        if name and state and not line.startswith("<"):
            states[name] = (state.strip(), reason.strip())
    return states


def unusable(states: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The nodes a job cannot start on: any state but USABLE's, or one with a flag (`down*`, `idle*`: not
    responding; `drained`, `draining`, `fail`...)."""
    return {name: sr for name, sr in states.items() if sr[0] not in USABLE}


def ensure_usable(bound_s: float = BOUND_S) -> str:
    """'' if every node is usable; otherwise heal the nodes (slurmd started again, nodes resumed), wait for them
    within bound_s, and return what was found, for a warning. RuntimeError if they are still unusable then."""
    bad = unusable(node_states())
    if not bad:
        return ""
    found = "; ".join(f"{name} {state} ({reason})" for name, (state, reason) in sorted(bad.items()))
    for name in bad:  # first: `start` waits for every node to be usable
        _run("scontrol", "update", f"NodeName={name}", "State=RESUME")
    try:
        started = subprocess.run(["bash", str(REPO / "tools" / "slurm-local.sh"), "start"], capture_output=True,
                                 text=True, timeout=bound_s).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        started = f"tools/slurm-local.sh start: {exc}"
    deadline = time.monotonic() + bound_s
    while (still := unusable(node_states())) and time.monotonic() < deadline:
        time.sleep(1)
    if still:
        raise RuntimeError(f"slurm node(s) unusable before this test ({found}) and still after restarting slurmd "
                           f"and resuming them for {bound_s:.0f} s: {still}\n{started[-2000:]}\n{snapshot()}")
    return f"found {found}; slurmd restarted where dead and the nodes resumed"


def snapshot(log_lines: int = 30) -> str:
    """The queue, the nodes with their reasons, and the tail of the controller's log: what a failed slurm test's
    report carries."""
    from tests.conftest import DEFAULT_SLURM_CONF

    conf = Path(os.environ.get("SLURM_CONF", DEFAULT_SLURM_CONF))
    log = conf.parents[1] / "log" / "slurmctld.log"
    try:
        tail = "".join(log.read_text(errors="replace").splitlines(True)[-log_lines:])
    except OSError as exc:
        tail = f"<{log}: {exc}>"
    return (f"squeue:\n{_run('squeue', '--all', '--format=%i %P %T %r %N %M')}"
            f"sinfo:\n{_run('sinfo', '--Node', '--format=%N %P %T %E')}"
            f"{log} (last {log_lines} lines):\n{tail}")
