"""Where the suite's time goes, and the fast loop's budget (hooks registered by tests/conftest.py).

Every run prints the slowest tests and files at the end and writes every test's time to `test_durations_file`
(pyproject's [tool.pytest.ini_options]; one JSON object per line, slowest first, then a summary line). A test's time
is its setup + call + teardown, as pytest's own `--durations` counts it; under pytest-xdist the controller sees every
worker's reports, so the list covers the whole run.

`--fast-budget` (what `make test-fast` passes) fails the run when a test that ran took longer than
`fast_test_budget_s`; `--fast-budget=report` (the fast half of `make test`, which CI runs) prints the same finding
loudly without failing, because CI's machines are slower and busier than the project's and a green suite must not
turn red on a moment of load: the fast loop holds unit and contract tests; anything slower is marked `slow`
(or `slurm`), so it runs in `make test` and in CI but never silently in the loop a developer runs all day. The
budget is in seconds of the project's 2-core machine, and a test is judged on its own, not on a moment of load: one
found over it in the parallel run is timed again alone (one serial pytest run of every such test) and fails the run
only if it is over again, against the budget scaled by how much slower this machine runs a fixed piece of Python than
the project's (`budget_reference_s`; never below 1x). The suite budgets (`suite_budget_s` for the pytest part of
`make test`, `fast_suite_budget_s` for `make test-fast`) are printed beside the measured totals, and a run over one
(scaled alike) says so loudly at the end without failing: how long a whole run takes depends on the machine's load
too, and a busy CI machine must not turn a green suite red. `make test` counts both its halves from
EMBODYHPC_TESTS_STARTED (epoch seconds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

SLOWEST_SHOWN = 30
FILES_SHOWN = 15
EXEMPT_MARKERS = ("slow", "slurm", "gpu")  # the markers that keep a test out of `make test-fast`
MARKERS_PROPERTY = "budget_markers"
SHARED_PROPERTY = "budget_shared_setup_s"  # seconds of the setup spent on session, package or module fixtures
FIXTURES_PROPERTY = "budget_shared_fixtures"  # [(fixture (scope), seconds)] set up for this test
_SETTING_UP: list[pytest.Item] = []
_SHARED_DEPTH: list[str] = []


class _FixtureTiming:
    """A plugin of its own (registered in pytest_configure), not conftest hooks: pytest asks only the rootdir's
    conftests about session fixtures, and tests/conftest.py is not one."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        _SETTING_UP.append(item)
        try:
            return (yield)
        finally:
            _SETTING_UP.pop()

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        """Time every fixture broader than a function: its setup is charged to the suite, not to the test that
        happened to need it first (its report carries the seconds; the setup report is made after this returns)."""
        if fixturedef.scope == "function" or not _SETTING_UP:
            return (yield)
        outermost = not _SHARED_DEPTH
        _SHARED_DEPTH.append(fixturedef.argname)
        started = time.monotonic()
        try:
            return (yield)
        finally:
            _SHARED_DEPTH.pop()
            seconds = time.monotonic() - started
            item = _SETTING_UP[-1]
            properties = dict(item.user_properties)
            item.user_properties[:] = [(k, v) for k, v in item.user_properties
                                       if k not in (SHARED_PROPERTY, FIXTURES_PROPERTY)]
            # a shared fixture set up inside another is in the outer one's seconds already
            charged = properties.get(SHARED_PROPERTY, 0.0) + (seconds if outermost else 0.0)
            item.user_properties.append((SHARED_PROPERTY, charged))
            item.user_properties.append((FIXTURES_PROPERTY, [*properties.get(FIXTURES_PROPERTY, ()),
                                                             (f"{fixturedef.argname} ({fixturedef.scope})", seconds)]))


def carry_markers(items: list[pytest.Item]) -> None:
    """Each test's exempting markers travel in its reports (user_properties reach the xdist controller; keywords
    would also hold folder names such as tests/slurm)."""
    for item in items:
        item.user_properties.append((MARKERS_PROPERTY, [m for m in EXEMPT_MARKERS if item.get_closest_marker(m)]))


def pytest_addoption(parser):
    group = parser.getgroup("embodyhpc budget")
    group.addoption("--fast-budget", nargs="?", const="fail", default=None, choices=("fail", "report"),
                    help="judge every test that ran against fast_test_budget_s: fail the run on one over it "
                         "(make test-fast), or =report: say so without failing (make test, which CI runs)")
    group.addoption("--suite-budget", choices=("fast", "full"), default=None,
                    help="check the run's wall time against fast_suite_budget_s or suite_budget_s")
    # the numbers themselves live in pyproject.toml only: a budget it does not set is an error where it is needed
    parser.addini("fast_test_budget_s", "the most seconds a test in `make test-fast` may take")
    parser.addini("fast_suite_budget_s", "the most seconds `make test-fast`'s pytest may take")
    parser.addini("suite_budget_s", "the most seconds the pytest part of `make test` may take")
    parser.addini("budget_reference_s", "seconds the project's machine takes for calibrate()'s fixed work")
    parser.addini("test_durations_file", "where each run writes every test's time (relative to the rootdir)",
                  default=".cache/test-durations.jsonl")


def calibrate() -> float:
    """Seconds this machine takes to start a Python process that imports torch (the best of three: a busy moment
    is not the machine's speed): what the fast loop's slowest tests (2-rank jobs, CLI subprocesses) are made of.
    Budgets scale by this over budget_reference_s, never below 1x."""
    def once() -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True, timeout=300)
        return time.perf_counter() - started

    return min(once() for _ in range(3))


class Budget:
    """Collects each test's phases (on the controller when xdist runs workers) and judges them at the end."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.wall_s = 0.0
        self.suite_line = ""
        self.problems: list[str] = []
        self._scale: float | None = None
        self.seconds: dict[str, float] = defaultdict(float)
        self.markers: dict[str, tuple[str, ...]] = {}
        self.outcomes: dict[str, str] = {}
        self.notes: list[str] = []
        self.shared: dict[str, float] = {}
        self.fixtures: dict[str, float] = {}

    def record(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration
        properties = dict(report.user_properties)
        self.markers.setdefault(report.nodeid, tuple(properties.get(MARKERS_PROPERTY, ())))
        if report.when == "setup":
            self.shared[report.nodeid] = float(properties.get(SHARED_PROPERTY, 0.0))
            for name, s in properties.get(FIXTURES_PROPERTY, ()):
                self.fixtures[name] = max(self.fixtures.get(name, 0.0), s)
        if report.when == "call" or report.outcome != "passed":
            self.outcomes.setdefault(report.nodeid, report.outcome)
        if report.when == "call":
            self.outcomes[report.nodeid] = report.outcome

    def own_seconds(self, node: str) -> float:
        """A test's time less the shared fixtures it happened to set up first (those are the suite's cost)."""
        return self.seconds[node] - self.shared.get(node, 0.0)

    def over_fast_budget(self, limit_s: float) -> list[tuple[str, float]]:
        """Tests that ran (not skipped) without an exempting marker and took longer than the limit on their own."""
        return sorted(((node, self.own_seconds(node)) for node in self.seconds
                       if self.own_seconds(node) > limit_s and not self.markers.get(node)
                       and self.outcomes.get(node) != "skipped"), key=lambda item: -item[1])

    def speed_scale(self, config: pytest.Config) -> float:
        """How many times longer budgets are on this machine (calibrate() over budget_reference_s, at least 1),
        measured once per run and only when a budget is in doubt."""
        if self._scale is None:
            self._scale = max(1.0, calibrate() / _ini_float(config, "budget_reference_s"))
        return self._scale

    def by_file(self) -> list[tuple[str, float, int]]:
        files: dict[str, list[float]] = defaultdict(list)
        for node, s in self.seconds.items():
            files[node.split("::")[0]].append(s)
        return sorted(((f, sum(v), len(v)) for f, v in files.items()), key=lambda item: -item[1])


WEIGHTS = Path(__file__).resolve().parent / "durations.json"


def order_by_weight(items: list[pytest.Item]) -> None:
    """Put the heaviest test files first, each file's tests together and in their order (module fixtures are set up
    once per worker), so that xdist's workers start on the longest work instead of ending on it.

    The weights are seconds per file from an earlier run (tests/durations.json; `make test-weights` writes it anew
    from .cache/test-durations-*.jsonl); a file it does not list weighs nothing and keeps its place among those."""
    try:
        weights = json.loads(WEIGHTS.read_text())
    except (OSError, ValueError):
        return
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], index)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::")[0]
        return -float(weights.get(path, 0.0)), first[path]

    items.sort(key=key)  # stable: each file's tests keep their order


def _ini_float(config: pytest.Config, name: str) -> float:
    value = config.getini(name)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise pytest.UsageError(f"pyproject.toml [tool.pytest.ini_options] {name} = {value!r}: set it to a number "
                                f"of seconds above 0")
    return seconds


def pytest_configure(config):
    config.pluginmanager.register(_FixtureTiming(), "embodyhpc-fixture-timing")
    if hasattr(config, "workerinput"):  # an xdist worker: the controller keeps the books
        return
    config.stash[_KEY] = Budget()


_KEY = pytest.StashKey[Budget]()


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session):
    budget = session.config.stash.get(_KEY, None)
    if budget is not None:
        budget.started = time.monotonic()
        session.config.pluginmanager.register(_Reporter(budget), "embodyhpc-budget-reporter")


class _Reporter:
    def __init__(self, budget: Budget) -> None:
        self.budget = budget

    def pytest_runtest_logreport(self, report):
        self.budget.record(report)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        budget = self.budget
        config = session.config
        wall_s = time.monotonic() - budget.started
        started = os.environ.get("EMBODYHPC_TESTS_STARTED")
        if started and started.isdigit():  # make test: both halves count against suite_budget_s
            wall_s = max(wall_s, time.time() - int(started))
        problems = []
        if config.getoption("fast_budget"):
            limit = _ini_float(config, "fast_test_budget_s")
            over = budget.over_fast_budget(limit)
            if over:
                scale = budget.speed_scale(config)
                confirmed = _time_alone(config, over, limit * scale)
                if confirmed:
                    failing = config.getoption("fast_budget") == "fail"
                    (problems if failing else budget.notes).append(
                        ("" if failing else "OVER BUDGET (reported; make test-fast fails on it): ") +
                        f"{len(confirmed)} test(s) in the fast loop took longer than fast_test_budget_s = {limit:g} s "
                        f"(x{scale:.2f} for this machine's speed) on their own, in the run and again alone; make them "
                        f"faster or mark them slow: " + ", ".join(f"{node} ({s:.1f} s)" for node, s in confirmed))
                else:
                    budget.notes.append(f"{len(over)} test(s) over fast_test_budget_s in the parallel run were "
                                        f"within it alone: " + ", ".join(node for node, _ in over))
        suite = config.getoption("suite_budget")
        if suite:
            name = "fast_suite_budget_s" if suite == "fast" else "suite_budget_s"
            limit = _ini_float(config, name)
            budget.suite_line = f"pytest took {wall_s:.0f} s of {name} = {limit:g} s"
            if wall_s > limit and session.testscollected:
                scale = budget.speed_scale(config)
                budget.suite_line += f" (x{scale:.2f} for this machine's speed: {limit * scale:.0f} s)"
                if wall_s > limit * scale:  # said loudly, not a failure: a loaded machine must not fail CI
                    budget.notes.append(f"OVER BUDGET: the run took {wall_s:.0f} s, over {name} = {limit:g} s "
                                        f"x{scale:.2f}: the slowest tests, files and fixtures are listed above")
        budget.problems = problems
        budget.wall_s = wall_s
        _write(config, budget, wall_s)
        if problems and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        budget = self.budget
        seconds = sorted(budget.seconds.items(), key=lambda item: -item[1])
        if not seconds:
            return
        tr = terminalreporter
        tr.section(f"the {min(SLOWEST_SHOWN, len(seconds))} slowest tests (setup + call + teardown)")
        for node, s in seconds[:SLOWEST_SHOWN]:
            marks = ",".join(budget.markers.get(node, ())) or "-"
            tr.write_line(f"{s:8.1f} s  {marks:<10} {node}")
        files = budget.by_file()
        tr.section(f"the {min(FILES_SHOWN, len(files))} slowest files")
        for path, s, n in files[:FILES_SHOWN]:
            tr.write_line(f"{s:8.1f} s  {n:5d} tests  {path}")
        shared = sorted(budget.fixtures.items(), key=lambda item: -item[1])
        if shared and shared[0][1] >= 1:
            tr.section("the slowest shared fixtures (charged to the suite, not to the first test that used them)")
            for name, s in shared[:10]:
                tr.write_line(f"{s:8.1f} s  {name}")
        total = sum(s for _, s in seconds)
        tr.write_line(f"wall {budget.wall_s:.0f} s; test time {total:.0f} s over {len(seconds)} "
                      f"tests; every test's time: {_path(config)}")
        if budget.suite_line:
            tr.write_line(budget.suite_line)
        for note in budget.notes:
            tr.write_line(f"budget: {note}")
        for problem in budget.problems:
            tr.write_line(f"BUDGET: {problem}", red=True, bold=True)


def _path(config: pytest.Config) -> Path:
    return Path(config.rootpath) / config.getini("test_durations_file")


def _write(config: pytest.Config, budget: Budget, wall_s: float) -> None:
    path = _path(config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        with tmp.open("w") as f:
            for node, s in sorted(budget.seconds.items(), key=lambda item: -item[1]):
                f.write(json.dumps({"test": node, "s": round(s, 3), "shared_s": round(budget.shared.get(node, 0.0), 3),
                                    "markers": list(budget.markers.get(node, ())),
                                    "outcome": budget.outcomes.get(node, "")}) + "\n")
            f.write(json.dumps({"summary": {"wall_s": round(wall_s, 1), "tests": len(budget.seconds),
                                            "args": config.invocation_params.args}}) + "\n")
        tmp.replace(path)
    except OSError as exc:  # a read-only checkout still gets the printed summary
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"could not write {path}: {exc}")


def _time_alone(config: pytest.Config, over: list[tuple[str, float]], limit: float) -> list[tuple[str, float]]:
    """Run the tests of `over` again in one serial pytest process (no xdist, nothing else of this run beside them)
    and return those still over `limit` (already scaled to this machine), with their times. If they cannot be timed
    alone, the run's own times judge them."""
    out = Path(config.rootpath) / ".cache" / f"budget-rerun-{os.getpid()}.jsonl"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
               "-o", f"test_durations_file={out.relative_to(config.rootpath)}", *(node for node, _ in over)]
    try:
        subprocess.run(command, cwd=config.rootpath, capture_output=True, timeout=120 + 30 * len(over), check=False)
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        alone = {row["test"]: row["s"] - row.get("shared_s", 0.0) for row in rows if "test" in row}
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return [(node, s) for node, s in over if s > limit]
    finally:
        out.unlink(missing_ok=True)
    # over in both: the run may have been slowed by its neighbours, the rerun by costs the run shared (a fork
    # server, the first import of a library)
    both = [(node, min(s, alone.get(node, s))) for node, s in over]
    return [(node, s) for node, s in both if s > limit]


def write_weights(sources: list[Path]) -> dict[str, float]:
    """tests/durations.json from the durations files of a run: seconds per test file, files of a second or more."""
    files: dict[str, float] = defaultdict(float)
    for source in sources:
        for row in map(json.loads, source.read_text().splitlines()):
            if "test" in row:
                files[row["test"].split("::")[0]] += row["s"]
    weights = {path: round(s) for path, s in sorted(files.items(), key=lambda item: -item[1]) if s >= 1}
    WEIGHTS.write_text(json.dumps(weights, indent=1) + "\n")
    return weights


if __name__ == "__main__":  # make test-weights
    found = sorted(Path(".cache").glob("test-durations-*.jsonl"))
    if not found:
        sys.exit("no .cache/test-durations-*.jsonl: run `make test` first")
    print(f"{WEIGHTS}: {len(write_weights(found))} files weighed from {', '.join(map(str, found))}")
