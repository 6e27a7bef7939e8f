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
