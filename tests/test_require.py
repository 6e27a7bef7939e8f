"""tests/helpers.py `require` (what a missing optional module does to a test, by extra, under CI or not, with or
without a GPU) and tests/conftest.py's policy for gpu-marked tests (skip without a GPU; fail, naming why, where a
GPU is present and the test would skip or xfail)."""

from __future__ import annotations

import pytest
import torch
from _pytest.outcomes import Failed, Skipped

from tests.helpers import ci_extras, project_extras, require

MISSING = "embodyhpc_no_such_module_for_tests"


def test_require_returns_the_module_when_installed(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("json", "train").dumps([1]) == "[1]"


def test_require_skips_loudly_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Skipped, match=f"MISSING DEPENDENCY '{MISSING}'.*pip install -e '.\\[sim\\]'"):
        require(MISSING, "sim")


@pytest.mark.parametrize("extra", sorted(ci_extras()))
def test_require_fails_under_ci_for_every_extra_ci_installs(monkeypatch, extra):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match=f"MISSING DEPENDENCY '{MISSING}'.*CI installs the \\[{extra}\\] extra"):
        require(MISSING, extra)


def test_require_fails_under_ci_when_the_module_is_broken(monkeypatch, tmp_path):
    """An installed module whose import raises (a CUDA-only wheel on CPU, a missing shared library) counts as
    missing: CI fails on it too."""
    (tmp_path / "broken_dep_for_tests.py").write_text("raise ImportError('libnvrtc.so.13: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match="libnvrtc"):
        require("broken_dep_for_tests", "data")


def test_require_skips_under_ci_for_an_extra_ci_does_not_install_without_a_gpu(monkeypatch):
    not_in_ci = sorted(project_extras() - ci_extras())
    assert not_in_ci == ["gpu"]  # nvidia-ml-py and transformer-engine: no GPU in CI
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Skipped, match=MISSING):
        require(MISSING, "gpu")


@pytest.mark.parametrize("ci", ["true", None])
def test_require_fails_for_a_missing_gpu_library_on_a_machine_with_a_gpu(monkeypatch, ci):
    if ci:
        monkeypatch.setenv("CI", ci)
    else:
        monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the hardware boundary: a GPU node
    with pytest.raises(Failed, match="has a GPU, so a missing GPU library is a failure"):
        require(MISSING, "gpu")


def test_require_refuses_an_extra_pyproject_does_not_declare(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Failed, match="pyproject.toml has no extra 'simulators'"):
        require("json", "simulators")


def test_ci_extras_are_those_make_setup_installs():
    assert {"train", "data", "fp8", "sim", "track"} <= ci_extras() <= project_extras()


# ---- the gpu policy (tests/conftest.py), on a tiny suite with the GPU faked at torch.cuda.is_available ----
GPU_SUITE = '''
import pytest
from tests.helpers import require

@pytest.mark.gpu
def test_missing_library():
    require("embodyhpc_no_such_gpu_library", "gpu")

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="flash-attn is not installed")
def test_skip_mark():
    pass

@pytest.mark.gpu
def test_skip_in_body():
    pytest.skip("backend unavailable")

@pytest.mark.gpu
def test_xfail_in_body():
    pytest.xfail("no kernel for this dtype")

@pytest.mark.gpu
def test_runs():
    pass

def test_unmarked_skip():
    pytest.skip("not a gpu test")
'''


@pytest.fixture
def gpu_suite(pytester, monkeypatch):
    """A tiny suite under tests/conftest.py's gpu policy; run(gpu=...) runs it in this process with
    torch.cuda.is_available faked (the hardware boundary) and returns {test name: (outcome, report text)}."""
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs an NVIDIA GPU\n")
    pytester.makeconftest("from tests.conftest import gpu_policy, pytest_runtest_makereport  # noqa: F401\n\n"
                          "def pytest_collection_modifyitems(config, items):\n    gpu_policy(config, items)\n")
    pytester.makepyfile(test_gpu_suite=GPU_SUITE)

    def run(gpu: bool) -> dict[str, tuple[str, str]]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
        reports = pytester.inline_run("-p", "no:cacheprovider").getreports("pytest_runtest_logreport")
        outcomes: dict[str, tuple[str, str]] = {}
        for report in reports:  # the first phase that did not pass says what the test did
            name = report.nodeid.split("::")[-1]
            if name not in outcomes and (not report.passed or report.when == "call"):
                outcome = "error" if report.failed and report.when != "call" else report.outcome
                outcomes[name] = (outcome, str(report.longrepr))
        return outcomes

    return run


def test_with_a_gpu_a_gpu_test_that_skips_or_xfails_fails_naming_why(gpu_suite):
    outcomes = gpu_suite(gpu=True)
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
        "test_missing_library": "failed", "test_skip_mark": "error", "test_skip_in_body": "failed",
        "test_xfail_in_body": "failed", "test_runs": "passed", "test_unmarked_skip": "skipped"}
    missing = outcomes.pop("test_missing_library")[1]  # require() itself fails there (tests/test_require.py)
    assert "MISSING DEPENDENCY 'embodyhpc_no_such_gpu_library'" in missing and "has a GPU" in missing, missing
    for name, reason in (("test_skip_mark", "flash-attn is not installed"),
                         ("test_skip_in_body", "backend unavailable"),
                         ("test_xfail_in_body", "no kernel for this dtype")):
        assert "on a machine with a GPU: " in outcomes[name][1] and reason in outcomes[name][1], outcomes[name]


def test_without_a_gpu_every_gpu_test_skips_with_the_reason(gpu_suite):
    from tests.conftest import NO_GPU_REASON

    outcomes = gpu_suite(gpu=False)
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == dict.fromkeys(
        ("test_missing_library", "test_skip_mark", "test_skip_in_body", "test_xfail_in_body", "test_runs",
         "test_unmarked_skip"), "skipped")
    assert [name for name, (_, text) in outcomes.items() if NO_GPU_REASON in text] == [
        "test_missing_library", "test_skip_mark", "test_skip_in_body", "test_xfail_in_body", "test_runs"]
