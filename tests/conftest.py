"""Shared fixtures: the CLI run in-process, a runs root per test, the local Slurm cluster; the gpu policy."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.budget import (  # noqa: F401 (hooks)
    carry_markers,
    order_by_weight,
    pytest_addoption,
    pytest_configure,
    pytest_sessionstart,
)
from tests.helpers import require

pytest_plugins = ("pytester",)  # tests/test_suite_rules.py runs the gpu policy on a tiny suite

REPO = Path(__file__).resolve().parents[1]
DEFAULT_SLURM_CONF = "/tmp/slurm-local/etc/slurm.conf"


@dataclass
class CliResult:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `embodyhpc ARGS` in this process through the real entry point (exit codes included)."""
    from embodyhpc.cli.main import main

    def run(*args: str) -> CliResult:
        monkeypatch.setattr(sys, "argv", ["embodyhpc", *args])
        capsys.readouterr()
        try:
            main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return CliResult(code, captured.out, captured.err)

    return run


@pytest.fixture
def runs_root(tmp_path) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    return root


def _slurm_up() -> tuple[bool, str]:
    os.environ.setdefault("SLURM_CONF", DEFAULT_SLURM_CONF)
    try:
        proc = subprocess.run(["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=15)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return False, f"sinfo unavailable: {exc}"
    if proc.returncode != 0:
        return False, f"sinfo failed: {proc.stderr.strip()}"
    return True, proc.stdout


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local 2-node cluster (tools/slurm-local.sh start). In CI its absence is a failure."""
    up, why = _slurm_up()
    if not up:
        message = (f"LOCAL SLURM CLUSTER NOT UP ({why}); start it with `bash tools/slurm-local.sh start` "
                   "or run `make test`")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return os.environ["SLURM_CONF"]


@pytest.fixture(autouse=True)
def _slurm_nodes_usable(request):
    """Every slurm test starts on usable nodes (tests/slurm_health.py: a lost node is healed and reported as a
    warning naming Slurm's reason; nodes still unusable after the bound fail the test with the cluster's state)."""
    if request.node.get_closest_marker("slurm") is not None:
        from tests import slurm_health

        request.getfixturevalue("slurm_cluster")  # skips (fails in CI) when it is down; sets SLURM_CONF

        try:
            healed = slurm_health.ensure_usable()
        except RuntimeError as exc:
            pytest.fail(str(exc))
        if healed:
            warnings.warn(pytest.PytestWarning(f"slurm cluster before {request.node.nodeid}: {healed}"), stacklevel=1)
    yield


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (tests/budget.py); the gpu policy (below)."""
    order_by_weight(items)
    carry_markers(items)
    ungrouped = [item.nodeid for item in items if item.get_closest_marker("slurm")
                 and "slurm" not in {m.args[0] for m in item.iter_markers("xdist_group") if m.args}]
    if ungrouped:  # two workers submitting at once would queue for the cluster's 2 nodes past their tests' bounds
        raise pytest.UsageError(f"tests marked slurm must carry pytest.mark.xdist_group('slurm'): {ungrouped}")
    gpu_policy(config, items)


# ---- the gpu policy: the one place that decides what a test marked `gpu` does ----
# Without a GPU (torch.cuda.is_available() is False: this project's CI, every CPU machine) a gpu-marked test is
# skipped with that reason. With one, it must pass or fail: a skip or xfail it takes anyway (a missing
# transformer-engine, flash-attn or nvidia-ml-py through tests.helpers.require, a skipif mark, a pytest.skip in its
# body) is turned into a failure naming the reason, so a GPU runner never reports a missing GPU library as a skip.
# tests/test_suite_rules.py checks the suite against skips that would hide a missing library anyway, and tests this
# policy with the GPU faked at torch.cuda.is_available.
GPU_PRESENT = pytest.StashKey[bool]()
NO_GPU_REASON = "needs an NVIDIA GPU (marked gpu); none on this machine"


def gpu_policy(config, items) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    config.stash[GPU_PRESENT] = present = torch.cuda.is_available()
    if not present:  # first of the item's skip marks: the reason a test's own skipif would give comes after
        for item in gpu_items:
            item.add_marker(pytest.mark.skipif(True, reason=NO_GPU_REASON), append=False)


def pytest_collection_finish(session):
    """On an xdist worker under --dist loadgroup: every test with an xdist_group must carry it in its node id (the
    only channel xdist 3.8 schedules groups by). With pytest 9.2 it silently does not (pytest-xdist issue 1386), and
    the Slurm tests and the shared trained runs would be spread over the workers: say so instead."""
    config = session.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        return
    lost = [item.nodeid for item in session.items if any(True for _ in item.iter_markers("xdist_group"))
            and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup lost the xdist_group of {len(lost)} tests (e.g. {lost[0]}): "
                                f"this pytest ({pytest.__version__}) and pytest-xdist do not group; install "
                                "pyproject.toml's pins (pytest < 9.2, pytest-xdist issue 1386)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.skipped and item.config.stash.get(GPU_PRESENT, False) and item.get_closest_marker("gpu"):
        reason = getattr(report, "wasxfail", None) or (
            report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr))
        report.outcome = "failed"
        report.longrepr = (f"gpu-marked test {'xfailed' if hasattr(report, 'wasxfail') else 'skipped'} on a "
                           f"machine with a GPU: {reason} -- a missing GPU library or kernel is a failure here "
                           "(tests/conftest.py gpu policy)")
        if hasattr(report, "wasxfail"):
            del report.wasxfail
    if report.failed and item.get_closest_marker("slurm") is not None:
        from tests import slurm_health

        report.sections.append(("slurm cluster at the failure", slurm_health.snapshot()))
    return report


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 for the session; yields its http URI.

    Backend: a sqlite file in a temp folder, initialised by embodyhpc's init_store first; artifacts are proxied by
    the server into that folder (`--artifacts-destination`). One worker, no job execution (FACTS: /health ~9 s).
    """
    import socket
    import time
    import urllib.request

    from embodyhpc.tracking.mlflow_run import init_store

    root = tmp_path_factory.mktemp("mlflow-server")
    backend = f"sqlite:///{root / 'mlflow.db'}"
    init_store(backend)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    uri = f"http://127.0.0.1:{port}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    log_path = root / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend,
             "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)

    def stop() -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)  # the server and its worker: a group of our own (start_new_session)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()

    deadline = time.monotonic() + 240  # a bound, not a speed: /health answered in 9-30 s here, later under load
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as response:
                if response.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            pytest.fail(f"mlflow server did not come up on {uri}: {log_path.read_text()[-3000:]}")
        time.sleep(0.3)
    try:
        yield uri
    finally:
        stop()


@pytest.fixture(scope="session")
def reach_demos(tmp_path_factory) -> Path:
    """MetaWorld reach-v3 expert demonstrations (4 episodes, one 32 px camera) as a LeRobot v3.0 dataset, for tests
    that train the demo recipe's policy for a few steps."""
    os.environ.setdefault("MUJOCO_GL", "egl")
    require("metaworld", "sim")
    from embodyhpc.sim.metaworld import generate_demos

    root = tmp_path_factory.mktemp("reach-demos") / "reach"
    generate_demos(root, tasks=["reach-v3"], episodes_per_task=4, seed=0, image_size=32, max_steps=120,
                   progress=False)
    return root


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> Path:
    """The demo's MetaWorld demonstrations (tests/launch/demo.py), made once per test run for every worker."""
    from tests.artifacts import build_once
    from tests.launch.demo import synth_demos

    return build_once(tmp_path_factory, "demo-data", synth_demos) / "metaworld-mt4"


@pytest.fixture(scope="session")
def pi05_demo_run(tmp_path_factory, demo_data) -> Path:
    """The pi0.5 demo run's folder (tests/launch/demo.py), trained and evaluated once per test run. Tests that read
    it carry `xdist_group("pi05-demo")`, so that one worker runs them after one another instead of waiting."""
    from tests.artifacts import build_once
    from tests.launch.demo import run_pi05_demo

    folder = build_once(tmp_path_factory, "pi05-demo", lambda out: run_pi05_demo(out, demo_data))
    return Path((folder / "run_dir").read_text())


@pytest.fixture
def fake_cuda(monkeypatch):
    """make(num_devices=2, initialized=True) -> tests.cuda_doubles.FakeCuda installed for this test only."""
    from tests.cuda_doubles import FakeCuda

    return lambda num_devices=2, **kwargs: FakeCuda(monkeypatch, num_devices, **kwargs)
