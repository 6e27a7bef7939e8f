from __future__ import annotations

from collections import Counter

from embodyhpc.slurm.status import _array_count, _exit_code, _summarise_array


def test_array_count():
    assert _array_count("12_3") == 1
    assert _array_count("12_[0-3]") == 4
    assert _array_count("12_[2-5%4]") == 4
    assert _array_count("12_[1,3,5-6]") == 4


def test_exit_code():
    assert _exit_code("0:0") == 0 and _exit_code("1:0") == 1
    assert _exit_code("0:15") == 128 + 15  # killed by SIGTERM
    assert _exit_code("") is None


def test_array_summary():
    assert _summarise_array(Counter(COMPLETED=4)) == "COMPLETED"
    assert _summarise_array(Counter(COMPLETED=2, RUNNING=1, PENDING=1)) == "RUNNING"
    assert _summarise_array(Counter(COMPLETED=2, PENDING=2)) == "PENDING"
    assert _summarise_array(Counter(COMPLETED=3, FAILED=1)) == "FAILED"
    assert _summarise_array(Counter(CANCELLED=4)) == "CANCELLED"


def test_array_elements_sacct_has_not_reported_count_as_pending(monkeypatch):
    from embodyhpc.rundir import JobRecord, RunInfo
    from embodyhpc.slurm import status

    rows = {"5": [{"JobID": "5_0", "State": "COMPLETED", "ExitCode": "0:0", "Reason": "None"}]}
    monkeypatch.setattr(status, "_slurm_rows", lambda ids: rows)
    info = RunInfo(run_id="r", run_dir="/x", backend="slurm", recipe="x", site=None, overrides=[], python="p",
                   created="now", jobs={"eval": JobRecord("eval", job_id="5", array_size=4)})
    (eval_status,) = status.chain_status(info)
    assert eval_status.array_counts == {"COMPLETED": 1, "PENDING": 3}
    assert eval_status.state == "PENDING" and not eval_status.finished
