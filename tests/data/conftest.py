"""Fixtures for dataset tests: the LeRobot v3.0 sample written by LeRobot 0.4.4 and what LeRobot read from it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE_ROOT = FIXTURES / "lerobot_v30_sample"


@pytest.fixture(scope="session")
def sample_root() -> Path:
    return SAMPLE_ROOT


@pytest.fixture(scope="session")
def expected() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "sample_expected.npz", allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


@pytest.fixture(scope="session")
def expected_delta_timestamps() -> dict[str, list[float]]:
    return json.loads((FIXTURES / "sample_expected.json").read_text())["delta_timestamps"]


def writable_copy(source: Path, root: Path) -> Path:
    """`source` (a committed dataset fixture, possibly read-only in a checkout) copied to `root`, writable."""
    shutil.copytree(source, root)
    for path in root.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return root


@pytest.fixture
def sample_copy(tmp_path) -> Path:
    """A writable copy of the sample, for tests that break it."""
    return writable_copy(SAMPLE_ROOT, tmp_path / "sample")
