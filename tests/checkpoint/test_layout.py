"""Folder rules without torch.distributed: what counts as a checkpoint, what retention may delete, `latest`."""

from __future__ import annotations

from embodyhpc.checkpoint import layout
from embodyhpc.checkpoint.layout import Listing, plan_retention


def _make(root, step, complete):
    folder = layout.step_dir(root, step)
    folder.mkdir(parents=True)
    if complete:
        layout.write_marker(folder, {"step": step})
    return folder


def test_only_marked_step_folders_count(tmp_path):
    _make(tmp_path, 2, complete=True)
    _make(tmp_path, 10, complete=True)
    _make(tmp_path, 12, complete=False)
    (tmp_path / "step-x").mkdir()
    (tmp_path / "step-3").write_text("a file, not a folder")
    (tmp_path / "notes").mkdir()
    listing = layout.list_steps(tmp_path)
    assert listing == Listing(complete=[2, 10], incomplete=[12])
    assert listing.newest_complete == 10  # numeric order, not string order
    assert layout.list_steps(tmp_path / "missing") == Listing([], [])


def test_retention_never_picks_the_newest_complete_or_the_save_in_flight():
    listing = Listing(complete=[1, 2, 3, 4], incomplete=[5, 7])
    assert plan_retention(listing, keep_latest_k=2, in_flight=7) == [1, 2, 5]
    assert plan_retention(listing, keep_latest_k=2) == [1, 2, 5, 7]
    assert plan_retention(listing, keep_latest_k=0) == [1, 2, 3, 5, 7]  # the newest survives whatever k says
    assert plan_retention(Listing([4], []), keep_latest_k=1) == []
    assert plan_retention(Listing([], [3]), keep_latest_k=2, in_flight=3) == []


def test_latest_is_replaced_whole_and_leaves_no_temporary_files(tmp_path):
    assert layout.read_latest(tmp_path) is None
    for step in (5, 10, 15):
        layout.write_latest(tmp_path, step)
        assert (tmp_path / "latest").read_text() == f"step-{step}\n"
        assert layout.read_latest(tmp_path) == tmp_path / f"step-{step}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_removed_folders_vanish_from_listings_at_once(tmp_path):
    folder = _make(tmp_path, 4, complete=True)
    (folder / "data.bin").write_bytes(b"x" * 1000)
    layout.remove_folder(folder)
    assert not folder.exists()
    assert layout.list_steps(tmp_path) == Listing([], [])
    assert list(tmp_path.iterdir()) == []
