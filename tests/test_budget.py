"""The suite's own budget (tests/budget.py) and shared artifacts (tests/artifacts.py), on small suites of their own
run by a real pytest in a subprocess: what a run prints and writes, which test fails the fast loop and which does
not (a marked one, one whose time went into a shared fixture), and a build shared by processes at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each runs pytest (and its tests' sleeps) in subprocesses: seconds
REPO = Path(__file__).resolve().parents[1]
CONFTEST = """
from tests.budget import carry_markers, pytest_addoption, pytest_configure, pytest_sessionstart


def pytest_collection_modifyitems(config, items):
    carry_markers(items)
"""
INI = """[pytest]
markers =
    slow: slow
    slurm: slurm
    gpu: gpu
fast_test_budget_s = 0.4
budget_reference_s = 1.15
test_durations_file = durations.jsonl
"""


def suite(folder: Path, tests: str, *args: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    (folder / "conftest.py").write_text(CONFTEST)
    (folder / "pytest.ini").write_text(INI)
    (folder / "test_small.py").write_text(textwrap.dedent(tests))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("EMBODYHPC_TESTS_STARTED", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=folder,
                            env=env, capture_output=True, text=True, timeout=300)
    rows = [json.loads(line) for line in (folder / "durations.jsonl").read_text().splitlines()]
    return result, rows


SLOW_AND_MARKED = """
    import time
    import pytest

    def test_quick():
        pass

    def test_over_the_budget():
        time.sleep(1.0)

    @pytest.mark.slow
    def test_marked_slow():
        time.sleep(1.0)
"""


def test_a_fast_loop_run_fails_on_an_unmarked_test_over_its_budget_only(tmp_path):
    result, rows = suite(tmp_path, SLOW_AND_MARKED, "--fast-budget")
    assert result.returncode == 1, result.stdout  # every test passed; the budget failed the run
    assert "3 passed" in result.stdout
    [line] = [line for line in result.stdout.splitlines() if line.startswith("BUDGET: ")]
    assert "test_small.py::test_over_the_budget" in line and "test_marked_slow" not in line, line
    assert "fast_test_budget_s = 0.4 s" in line and "in the run and again alone" in line
    # every test's time, slowest first, then the run's summary
    times = {row["test"].split("::")[1]: row for row in rows if "test" in row}
    assert set(times) == {"test_quick", "test_over_the_budget", "test_marked_slow"}
    assert times["test_over_the_budget"]["s"] >= 1.0 and times["test_marked_slow"]["markers"] == ["slow"]
    assert [row["s"] for row in rows if "test" in row] == sorted((row["s"] for row in rows if "test" in row),
                                                                 reverse=True)
    assert rows[-1]["summary"]["tests"] == 3
    # =report (make test, which CI runs) finds the same test and says so without failing the run
    result, _ = suite(tmp_path, SLOW_AND_MARKED, "--fast-budget=report")
    assert result.returncode == 0, result.stdout
    [line] = [line for line in result.stdout.splitlines() if "OVER BUDGET (reported" in line]
    assert "test_small.py::test_over_the_budget" in line and "test_marked_slow" not in line, line
    assert not [line for line in result.stdout.splitlines() if line.startswith("BUDGET: ")]
    # the same suite without --fast-budget only reports
    result, _ = suite(tmp_path, SLOW_AND_MARKED)
    assert result.returncode == 0 and "BUDGET" not in result.stdout
    assert "slowest tests" in result.stdout and "test_small.py::test_over_the_budget" in result.stdout


def test_a_shared_fixture_is_the_suites_cost_not_the_first_tests(tmp_path):
    result, rows = suite(tmp_path, """
        import time
        import pytest

        @pytest.fixture(scope="session")
        def expensive():
            time.sleep(1.0)
            return 1

        def test_first_user(expensive):
            assert expensive == 1

        def test_second_user(expensive):
            assert expensive == 1
    """, "--fast-budget")
    assert result.returncode == 0, result.stdout
    assert "expensive (session)" in result.stdout  # listed among the shared fixtures
    first = next(row for row in rows if row.get("test", "").endswith("test_first_user"))
    assert first["s"] >= 1.0 and first["shared_s"] >= 1.0 and first["s"] - first["shared_s"] < 0.4


def test_a_run_over_the_suite_budget_says_so_without_failing(tmp_path):
    result, _ = suite(tmp_path, SLOW_AND_MARKED, "--suite-budget", "fast", "-o", "fast_suite_budget_s=0.5")
    assert result.returncode == 0, result.stdout  # a loaded machine must not fail CI: said, loudly
    assert "OVER BUDGET: the run took" in result.stdout and "over fast_suite_budget_s = 0.5 s" in result.stdout
    result, _ = suite(tmp_path, SLOW_AND_MARKED, "--suite-budget", "fast", "-o", "fast_suite_budget_s=600")
    assert result.returncode == 0 and "of fast_suite_budget_s = 600 s" in result.stdout
    assert "OVER BUDGET" not in result.stdout


def test_under_xdist_the_controller_judges_every_workers_tests(tmp_path):
    result, rows = suite(tmp_path, SLOW_AND_MARKED, "--fast-budget", "-n", "2")
    assert result.returncode == 1, result.stdout
    [line] = [line for line in result.stdout.splitlines() if line.startswith("BUDGET: ")]
    assert "test_over_the_budget" in line and "test_marked_slow" not in line
    assert len([row for row in rows if "test" in row]) == 3


def test_an_artifact_is_built_once_by_processes_asking_at_once(tmp_path):
    """Two processes ask for the same artifact at once: one builds it, the other waits and reuses it; a failed
    build fails the next asker at once with the first error instead of building again."""
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from tests.artifacts import build_once

        class Factory:  # what build_once reads of pytest's TempPathFactory
            def getbasetemp(self):
                return Path(sys.argv[1])

        def build(folder):
            with open(Path(sys.argv[1]) / "builds.log", "a") as log:
                log.write("built\\n")
            time.sleep(1.0)
            if sys.argv[2] == "fail":
                raise RuntimeError("the build broke")
            (folder / "data.txt").write_text("42")

        print((build_once(Factory(), "thing", build) / "data.txt").read_text())
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path), "ok"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [out.strip() for out, _ in outs] == ["42", "42"], outs
    assert (tmp_path / "builds.log").read_text() == "built\n"

    broken = tmp_path / "broken"
    broken.mkdir()
    first = subprocess.run([sys.executable, "-c", script.replace('"thing"', '"other"'), str(broken), "fail"],
                           env=env, capture_output=True, text=True, timeout=120)
    second = subprocess.run([sys.executable, "-c", script.replace('"thing"', '"other"'), str(broken), "ok"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode != 0 and "the build broke" in first.stderr
    assert second.returncode != 0 and "failed to build earlier in this run" in second.stderr
    assert "the build broke" in second.stderr and (broken / "builds.log").read_text() == "built\n"


def test_a_durations_file_that_cannot_be_written_is_one_line_not_a_crash(tmp_path):
    (tmp_path / "durations.jsonl").write_text("")  # suite() reads it back; the run writes elsewhere
    (tmp_path / "blocked").write_text("a file where the durations folder would be")
    result, _ = suite(tmp_path, SLOW_AND_MARKED, "-o", "test_durations_file=blocked/durations.jsonl")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "could not write" in result.stdout and "Traceback" not in result.stdout + result.stderr
