"""Listing the source: stats on the calling thread for a fast filesystem, in pooled batches for a slow one."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from embodyhpc.staging import tree


class CountingPool(ThreadPoolExecutor):
    def __init__(self) -> None:
        super().__init__(4)
        self.batches: list[int] = []

    def map(self, fn, *iterables, **kwargs):  # type: ignore[override]
        batches = list(iterables[0])
        self.batches.extend(len(b) for b in batches)
        return super().map(fn, batches, **kwargs)


@pytest.fixture
def source(tmp_path) -> Path:
    root = tmp_path / "src"
    for i in range(150):
        path = root / f"chunk-{i // 40}" / f"file-{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x" * i)
    return root


def truth(root: Path) -> dict[str, tuple[int, int, int]]:
    out = {}
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            out[path.relative_to(root).as_posix()] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


@pytest.mark.parametrize("inline_below_s, pooled", [(float("inf"), False), (0.0, True)])
def test_source_stats_go_to_the_pool_only_when_the_filesystem_is_slow(source, monkeypatch, inline_below_s, pooled):
    monkeypatch.setattr(tree, "_INLINE_STAT_S", inline_below_s)
    with CountingPool() as pool:
        files, dirs, fast = tree.scan_source(str(source), pool)

    assert {rel: (f.size, f.mtime_ns, f.ino) for rel, f in files.items()} == truth(source)
    assert sorted(dirs) == [f"chunk-{i}" for i in range(4)]
    assert all(f.rel == rel for rel, f in files.items())
    assert fast is not pooled
    if pooled:  # everything after the probe, in batches of at most _STAT_BATCH
        assert sum(pool.batches) == 150 - tree._PROBE_STATS
        assert max(pool.batches) <= tree._STAT_BATCH and len(pool.batches) >= 2
    else:
        assert pool.batches == []


def test_a_tree_smaller_than_the_probe_is_listed_whole(tmp_path):
    (tmp_path / "a").write_bytes(b"1")
    (tmp_path / "b").write_bytes(b"22")
    with CountingPool() as pool:
        files, _, _ = tree.scan_source(str(tmp_path), pool)
    assert {rel: f.size for rel, f in files.items()} == {"a": 1, "b": 2} and pool.batches == []

