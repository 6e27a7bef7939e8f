"""Folder rules without torch.distributed: what counts as a checkpoint, what retention may delete, `latest`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


# ---- one parser for step folder names; the step a folder holds is its record's ----
def test_only_the_spelling_step_name_writes_is_a_step():
    from embodyhpc.rundir import MAX_STEP, parse_step

    assert [parse_step(layout.step_dir(Path("x"), n).name) for n in (0, 4, 10, MAX_STEP)] == [0, 4, 10, MAX_STEP]
    for name in ("step-0004", "step-00", "step-+4", "step--4", "step-4 ", " step-4", "step-4\n", "step-4.0",
                 "step-1_000", "step-٤", "step-４", f"step-{MAX_STEP + 1}", "step-" + "9" * 400, "step-", "Step-4",
                 "step-4/", "step-0x10"):
        assert parse_step(name) is None, name


def test_a_near_miss_says_what_is_wrong_and_other_names_are_none_of_its_business():
    from embodyhpc.rundir import MAX_STEP

    assert layout.misnamed_step("step-0004") == "a step written with leading zeros (embodyhpc writes step-4)"
    assert "past 9223372036854775807" in layout.misnamed_step(f"step-{MAX_STEP + 1}")
    assert "past" in layout.misnamed_step("step-" + "1" * 30)
    for name in ("step-+4", "step-4 ", "step-٤", "step-1_0"):
        assert "not a step as embodyhpc writes one" in layout.misnamed_step(name), name
    for name in ("step-4", "step-x", "step-1e3", "notes", "latest", ".retiring-step-4-abcd"):
        assert layout.misnamed_step(name) is None, name


def test_listing_keeps_near_misses_apart(tmp_path):
    _make(tmp_path, 4, complete=True)
    (tmp_path / "step-0008").mkdir()
    (tmp_path / "step-+9").mkdir()
    (tmp_path / "step-010").write_text("a file is never a step folder")
    listing = layout.list_steps(tmp_path)
    assert listing.complete == [4] and listing.incomplete == [] and listing.misnamed == ("step-+9", "step-0008")


@pytest.mark.parametrize("marker, trainer, problem", [
    ({"step": 6}, None, "named step-8 but its .complete records step 6"),
    ({"step": 8}, {"version": 1, "step": 6}, "named step-8 but its trainer.json records step 6"),
    ({"world_size": 2}, {"version": 1, "step": 6}, "its trainer.json records step 6"),
    ({"world_size": 2}, None, "neither .complete nor trainer.json records the step"),
    ({"step": -8}, None, "records step -8, not a whole number"),
    ({"step": 8.0}, None, "records step 8.0"),
    ({"step": None}, None, "records step None"),
    ("[8]", None, ".complete is not a JSON object"),
    ("{", None, ".complete is unreadable (not valid JSON)"),
    ({"step": 8}, "\xff", "trainer.json is unreadable"),
])
def test_a_folders_record_must_say_the_step_its_name_says(tmp_path, marker, trainer, problem):
    from embodyhpc.checkpoint.errors import NotACheckpointError

    folder = _make(tmp_path, 8, complete=False)
    (folder / ".complete").write_text(marker if isinstance(marker, str) else json.dumps(marker))
    if trainer is not None:
        (folder / "trainer.json").write_text(trainer if isinstance(trainer, str) else json.dumps(trainer))
    with pytest.raises(NotACheckpointError) as caught:
        layout.checkpoint_step(folder)
    line = caught.value.one_line()
    assert problem in line and str(folder) in line and "\n" not in line, line


def test_a_folder_whose_records_agree_holds_its_step(tmp_path):
    folder = _make(tmp_path, 8, complete=True)
    assert layout.checkpoint_step(folder) == 8
    (folder / "trainer.json").write_text(json.dumps({"version": 1, "step": 8, "sampler": None}))
    assert layout.checkpoint_step(folder) == 8
    (folder / ".complete").write_text(json.dumps({"world_size": 1}))  # an older marker: trainer.json says it
    assert layout.checkpoint_step(folder) == 8
