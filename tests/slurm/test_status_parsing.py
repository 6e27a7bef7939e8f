from __future__ import annotations

from collections import Counter

from embodyhpc.slurm.status import array_task_count, exit_code_of, summarise_array


def test_array_count():
    assert array_task_count("12_3") == 1
    assert array_task_count("12_[0-3]") == 4
    assert array_task_count("12_[2-5%4]") == 4
    assert array_task_count("12_[1,3,5-6]") == 4


def test_exit_code():
    assert exit_code_of("0:0") == 0 and exit_code_of("1:0") == 1
    assert exit_code_of("0:15") == 128 + 15  # killed by SIGTERM
    assert exit_code_of("") is None


def test_array_summary():
    assert summarise_array(Counter(COMPLETED=4)) == "COMPLETED"
    assert summarise_array(Counter(COMPLETED=2, RUNNING=1, PENDING=1)) == "RUNNING"
    assert summarise_array(Counter(COMPLETED=2, PENDING=2)) == "PENDING"
    assert summarise_array(Counter(COMPLETED=3, FAILED=1)) == "FAILED"
    assert summarise_array(Counter(CANCELLED=4)) == "CANCELLED"


def test_array_elements_sacct_has_not_reported_count_as_pending(monkeypatch):
    from embodyhpc.runinfo import JobRecord, RunInfo
    from embodyhpc.slurm import status

    rows = {"5": [{"JobID": "5_0", "State": "COMPLETED", "ExitCode": "0:0", "Reason": "None"}]}
    monkeypatch.setattr(status, "_slurm_rows", lambda ids: rows)
    info = RunInfo(run_id="r", run_dir="/x", backend="slurm", recipe="x", site=None, overrides=[], python="p",
                   created="now", jobs={"eval": JobRecord("eval", job_id="5", array_size=4)})
    (eval_status,) = status.chain_status(info)
    assert eval_status.array_counts == {"COMPLETED": 1, "PENDING": 3}
    assert eval_status.state == "PENDING" and not eval_status.finished


def test_a_run_and_its_evaluations_are_read_with_one_sacct_and_one_squeue(monkeypatch):
    """`embodyhpc status` of a run with in-training evaluations asks Slurm once, not once per evaluation."""
    from embodyhpc.runinfo import JobRecord, RunInfo
    from embodyhpc.slurm import status

    calls: list[list[str]] = []
    sacct = {"7": "7|COMPLETED|0:0|None|n1|00:01:00", "8": "8|RUNNING|0:0|None|n2|00:00:10",
             "9": "9|PENDING|0:0|Dependency||00:00:00"}

    def run(argv, check=True):
        calls.append(argv)
        if argv[0] == "sacct":
            ids = next(a for a in argv if a.startswith("--jobs=")).split("=", 1)[1].split(",")
            return "\n".join(sacct[i] for i in ids)
        return ""

    monkeypatch.setattr(status.commands, "run", run)

    def info(name: str, jobs: dict[str, str]) -> RunInfo:
        return RunInfo(run_id=name, run_dir=f"/runs/{name}", backend="slurm", recipe="x", site=None, overrides=[],
                       python="p", created="now", jobs={k: JobRecord(k, job_id=j) for k, j in jobs.items()})

    train, step20, step40 = info("t", {"train": "7"}), info("e20", {"export": "8"}), info("e40", {"export": "9"})
    result = status.chains_status([train, step20, step40])

    assert [c[0] for c in calls] == ["sacct", "squeue"]
    assert [[(s.kind, s.state) for s in chain] for chain in result] == [
        [("train", "COMPLETED")], [("export", "RUNNING")], [("export", "PENDING")]]
    assert result[2][0].reason == "Dependency" and result[0][0].nodes == "n1"
