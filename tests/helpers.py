"""Polling helpers for tests that wait on real jobs."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def run_dir_from(out: str) -> Path:
    """The run directory from `embodyhpc submit --json` output."""
    return Path(json.loads(out)["run_dir"])


def statuses(cli, run_dir: Path) -> dict[str, dict]:
    result = cli("status", str(run_dir), "--json")
    assert result.code == 0, result.err
    return {job["kind"]: job for job in json.loads(result.out)["jobs"]}


DOUBLES = Path(__file__).resolve().parent / "doubles"


TE_DOUBLE_CUDA = "EMBODYHPC_TE_DOUBLE_CUDA"
"""Set to 1, the transformer-engine double stands for a GPU node: its constructor and forward accept CPU tensors as
CUDA ones (tests/doubles/transformer_engine/pytorch/module/base.py). Unset, it refuses as TE does without CUDA."""


def use_doubles(*packages: str, gpu_node: bool = False) -> None:
    """Make `import <package>` load the CPU double in tests/doubles (first on sys.path, cached modules dropped).
    For worker processes; tests use the fixtures built on it (tests/models/conftest.py). `gpu_node`: this process
    stands for a GPU node (TE_DOUBLE_CUDA); without it the doubles refuse what their library refuses without CUDA."""
    import os
    import sys

    if str(DOUBLES) not in sys.path:
        sys.path.insert(0, str(DOUBLES))
    if gpu_node:
        os.environ[TE_DOUBLE_CUDA] = "1"
    else:
        os.environ.pop(TE_DOUBLE_CUDA, None)
    drop_modules(*packages)


def drop_modules(*packages: str) -> None:
    import sys

    for name in list(sys.modules):
        if name.split(".")[0] in packages:
            del sys.modules[name]


REPO_ROOT = Path(__file__).resolve().parents[1]


def project_extras() -> frozenset[str]:
    """The extras pyproject.toml declares ([project.optional-dependencies])."""
    import tomllib

    return frozenset(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def ci_extras() -> frozenset[str]:
    """The extras `make setup` installs (the Makefile's `-e '.[...]'`): CI has every one of them."""
    import re

    makefile = REPO_ROOT / "Makefile"
    found = re.search(r"-e '\.\[([a-z0-9_,-]+)\]'", makefile.read_text())
    assert found, f"{makefile}: no `pip install -e '.[extras]'` line; tests/helpers.py reads the CI extras from it"
    return frozenset(found.group(1).split(","))


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()


def require(module: str, extra: str):
    """Import `module` (a dependency from the pyproject extra `extra`) or stop the test.

    Locally a missing module skips loudly (what to install). Under CI=true a module from an extra that
    `make setup` installs is a FAILURE: a skip would hide a missing part of the project. A module from the `gpu`
    extra (CI does not install it) skips on a machine without a GPU and FAILS on one with a GPU, as the gpu-marked
    tests' policy in tests/conftest.py does. The only place tests may skip on an import error
    (tests/test_suite_rules.py checks it)."""
    import importlib
    import os

    import pytest

    if extra not in project_extras():
        pytest.fail(f"require({module!r}, {extra!r}): pyproject.toml has no extra {extra!r} "
                    f"(it has {sorted(project_extras())})", pytrace=False)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        reason = (f"MISSING DEPENDENCY {module!r} ({type(exc).__name__}: {exc}); "
                  f"install it with: pip install -e '.[{extra}]'")
        if os.environ.get("CI") == "true" and extra in ci_extras():
            pytest.fail(f"{reason} — CI installs the [{extra}] extra, so this is a failure, not a skip",
                        pytrace=False)
        if extra == "gpu" and _gpu_present():
            pytest.fail(f"{reason} — this machine has a GPU, so a missing GPU library is a failure, not a skip",
                        pytrace=False)
        pytest.skip(reason, allow_module_level=True)


def one_line_error(result, *fragments: str) -> str:
    """A CLI refusal (tests/conftest.py `cli`): exit 2, one `error:` line holding every fragment; returns the line."""
    assert result.code == 2, (result.code, result.out, result.err)
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]
