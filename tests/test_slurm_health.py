"""tests/slurm_health.py, the check every slurm test starts with, against sinfo lines recorded on the local cluster
(a killed slurmd: `idle*` then `down*`/Not responding; `scontrol update State=DRAIN`: `drained`; a pending job's
nodes under backfill: `planned`), with Slurm's commands replaced by a recorder."""

from __future__ import annotations

import subprocess

import pytest

from tests import slurm_health

RECORDED = {
    "healthy": "n1|idle|none\nn1|idle|none\nn2|mixed|none\nn3|planned|none\n",
    "lost": "n1|idle|none\nn2|down*|Not responding\nn3|drained|probe\n",
    "late": "n1|allocated|none\nn2|idle*|none\nn3|completing|none\n",
    "kill": "n1|draining|Kill task failed\nn2|fail|none\nn3|idle|none\n",
}


def test_the_states_a_job_cannot_start_on_are_unusable(monkeypatch):
    seen = {}
    for name, text in RECORDED.items():
        monkeypatch.setattr(slurm_health, "_run", lambda *args, text=text: text)
        seen[name] = sorted(slurm_health.unusable(slurm_health.node_states()))
    assert seen == {"healthy": [], "lost": ["n2", "n3"], "late": ["n2"], "kill": ["n1", "n2"]}
    monkeypatch.setattr(slurm_health, "_run", lambda *args: "<sinfo: exit 1: no controller>")
    assert slurm_health.node_states() == {}  # a cluster that does not answer: the slurm_cluster fixture says so


class _Cluster:
    """sinfo answers `before` until the nodes were resumed and slurm-local.sh started (in that order), then
    `after`; every command is recorded."""

    def __init__(self, before: str, after: str) -> None:
        self.before, self.after, self.calls = before, after, []

    def run(self, *args: str) -> str:
        self.calls.append(args[:3])
        if args[0] != "sinfo":
            return ""
        return self.after if ("start", "slurm-local.sh", "start") in self.calls else self.before

    def subprocess_run(self, argv, **kwargs):
        self.calls.append(("start", argv[1].rsplit("/", 1)[-1], argv[2]))
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture
def cluster(monkeypatch):
    def make(before: str, after: str) -> _Cluster:
        fake = _Cluster(before, after)
        monkeypatch.setattr(slurm_health, "_run", fake.run)
        monkeypatch.setattr(slurm_health.subprocess, "run", fake.subprocess_run)
        monkeypatch.setattr(slurm_health.time, "sleep", lambda s: None)
        return fake
    return make


def test_usable_nodes_are_left_alone(cluster):
    fake = cluster(RECORDED["healthy"], RECORDED["healthy"])
    assert slurm_health.ensure_usable() == ""
    assert [c[0] for c in fake.calls] == ["sinfo"]


def test_lost_nodes_are_resumed_then_slurmd_started_and_the_finding_named(cluster):
    fake = cluster(RECORDED["lost"], RECORDED["healthy"])
    found = slurm_health.ensure_usable()
    assert "n2 down* (Not responding)" in found and "n3 drained (probe)" in found and "n1" not in found
    resumes = [c for c in fake.calls if c[0] == "scontrol"]
    assert sorted(resumes) == [("scontrol", "update", "NodeName=n2"), ("scontrol", "update", "NodeName=n3")]
    start = fake.calls.index(("start", "slurm-local.sh", "start"))
    assert all(fake.calls.index(r) < start for r in resumes)  # `start` waits for usable nodes: resume first


def test_nodes_still_lost_after_the_bound_fail_with_the_cluster_snapshot(cluster, monkeypatch, tmp_path):
    conf = tmp_path / "etc" / "slurm.conf"
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "slurmctld.log").write_text("".join(f"line {i}\n" for i in range(50)))
    monkeypatch.setenv("SLURM_CONF", str(conf))
    cluster(RECORDED["kill"], RECORDED["kill"])
    with pytest.raises(RuntimeError, match="Kill task failed") as caught:
        slurm_health.ensure_usable(bound_s=0.0)
    text = str(caught.value)
    assert "still after restarting slurmd" in text and "line 49" in text and "line 19\n" not in text


def test_a_start_that_hangs_is_bounded_and_named(cluster, monkeypatch):
    cluster(RECORDED["lost"], RECORDED["lost"])

    def hangs(argv, **kwargs):
        raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
    monkeypatch.setattr(slurm_health.subprocess, "run", hangs)
    with pytest.raises(RuntimeError, match=r"slurm-local.sh start: Command .* timed out after 0.0 seconds"):
        slurm_health.ensure_usable(bound_s=0.0)
