"""A shared runs root (a site profile's job.runs_root) holds other users' private (0700) run folders.

`runs` skips and counts them, every command that takes a RUN says so on one line (exit 2) instead of a
PermissionError traceback, `latest` is your newest run, and `submit` makes experiment folders the next user can add
runs to. The permissions are met for real: as root (which reads every folder), the commands run in a child process
that drops to another uid and gid (65534, nobody); as another user, the other user's folders are made unreadable to
us (mode 000), which is the same EACCES. Where neither can be done the tests skip, loudly; with CI=true they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DRIVER = REPO / "tests" / "cli_driver.py"
OTHER_UID = 65534  # the user the commands run as when the suite runs as root (nobody)
THIRD_UID = 65533  # one more user, for a folder two users share
AS_ROOT = os.geteuid() == 0

pytestmark = pytest.mark.slow  # a few interpreter starts as another user (about 1-3 s a test)


def _unavailable(why: str) -> None:
    message = f"CANNOT RUN AS ANOTHER USER HERE ({why}): the shared-runs-root cases are untested"
    if os.environ.get("CI") == "true":
        pytest.fail(message + " — CI must run them", pytrace=False)
    pytest.skip(message)


def _as(uid: int | None, args: list[str], cwd: Path, gid: int | None = None, **env: str
        ) -> subprocess.CompletedProcess:
    """`args` as user `uid` with group `gid` (default: the uid's number; None uid: as we are), in a minimal
    environment."""
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), "LANG": "C.UTF-8",
                   "MLFLOW_DISABLE_TELEMETRY": "true", **env}
    ids: dict = {}
    gid = uid if gid is None else gid
    if uid is not None and shutil.which("setpriv"):  # util-linux: it can still reach an interpreter under /root
        args = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", *args]
    elif uid is not None:
        ids = {"user": uid, "group": gid, "extra_groups": []}
    return subprocess.run(args, cwd=cwd, env=environment, capture_output=True, text=True, timeout=120, **ids)


def run_cli(shared: dict, *commands: list[str], uid: int | None = None) -> list[dict]:
    """Each command line through the real entry point, as the other user; their results in order."""
    listing = shared["dir"] / f"commands-{os.urandom(4).hex()}.json"
    listing.write_text(json.dumps([list(c) for c in commands]))
    listing.chmod(0o644)
    proc = _as(shared["uid"] if uid is None else uid, [sys.executable, str(DRIVER), str(listing)], shared["dir"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def make_run(root: Path, experiment: str, name: str, *, mode: int = 0o700, owner: int | None = None) -> Path:
    run = root / experiment / name
    for sub in ("submitit", "logs", "eval", "checkpoints/step-1", "export"):
        (run / sub).mkdir(parents=True, exist_ok=True)
    (run / "resolved.yaml").write_text("job:\n  name: x\ntrain:\n  steps: 10\n")
    (run / "run.json").write_text(json.dumps({
        "run_id": name, "run_dir": str(run), "backend": "local", "recipe": "smoke_cpu", "site": None,
        "overrides": [], "python": "python", "created": "2026-11-25T17:00:00+0000",
        "jobs": {"train": {"kind": "train", "job_id": "77", "state": "COMPLETED", "exit_code": 0}}}))
    (run / "submitit" / "77_0_log.out").write_text("hello from 77\n")
    for path in [run, *run.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
        if owner is not None:
            os.chown(path, owner, owner)
    run.chmod(mode)
    return run


@pytest.fixture(scope="module")
def shared():
    """/tmp/…/runs: my run (older), someone else's private run (newer), someone else's run in an open folder with a
    private run.json, and someone else's private experiment folder."""
    base = Path(tempfile.mkdtemp(prefix="embodyhpc-shared-", dir="/tmp"))
    try:
        base.chmod(0o755)
        if AS_ROOT:
            probe = _as(OTHER_UID, [sys.executable, "-c", "import embodyhpc.cli.main"], base)
            if probe.returncode != 0:
                _unavailable(f"a process as uid {OTHER_UID} cannot import embodyhpc: {probe.stderr.strip()[-200:]}")
        root = base / "runs"
        me = OTHER_UID if AS_ROOT else None
        closed = 0o700 if AS_ROOT else 0o000  # not root: our own folders, closed to us
        mine = make_run(root, "demo", "mine-20261125-100000", mode=0o755, owner=me)
        theirs = make_run(root, "demo", "theirs-20261126-100000", mode=closed)
        open_run = make_run(root, "demo", "open-20261126-110000", mode=0o755)
        (open_run / "run.json").chmod(0o600 if AS_ROOT else 0o000)
        hidden = make_run(root, "private-exp", "hidden-20261127-100000", mode=0o755)
        hidden.parent.chmod(closed)
        parts = make_run(root, "demo", "parts-20261124-100000", mode=0o755, owner=me)  # mine, with closed parts
        (parts / "eval" / "report.json").write_text('{"outcome": "complete", "why": "x", "headline": {}}')
        (parts / "evals" / "step-5").mkdir(parents=True)
        for folder in (parts / "eval", parts / "evals"):
            os.chown(folder, os.geteuid(), os.getegid())
            folder.chmod(closed)
        (root / "shared-exp").mkdir(mode=0o755)
        for folder in (root, root / "demo", root / "shared-exp"):
            folder.chmod(0o755)
        site = base / "site.yaml"
        site.write_text(f"site:\n  name: shared\njob:\n  runs_root: {root}\n")
        site.chmod(0o644)
        yield {"dir": base, "root": root, "mine": mine, "theirs": theirs, "open": open_run, "hidden": hidden,
               "parts": parts, "site": site, "uid": me}
    except PermissionError as exc:  # subprocess could not change user (no CAP_SETUID in this container)
        _unavailable(str(exc))
    finally:
        for folder, subfolders, _ in os.walk(base):  # top-down: open each folder before walking into it
            for name in subfolders:
                os.chmod(os.path.join(folder, name), 0o755)
        shutil.rmtree(base, ignore_errors=True)


def _one_line(result: dict, *fragments: str) -> str:
    assert result["code"] == 2, result
    lines = result["err"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result["err"], result
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def test_runs_lists_what_it_can_read_and_counts_the_rest(shared):
    root = str(shared["root"])
    text, data, demo, by_site = run_cli(shared, ["runs", "--runs-root", root], ["runs", "--runs-root", root, "--json"],
                                        ["runs", "--runs-root", root, "--json", "--experiment", "demo"],
                                        ["runs", "--site", str(shared["site"]), "--json"])
    assert text["code"] == 0, text
    assert "demo/mine-20261125-100000" in text["out"] and "theirs" not in text["out"]
    assert "not listed: 3 folders you cannot read" in text["out"]
    if AS_ROOT:
        assert "owner root" in text["out"]
    listed = json.loads(data["out"])
    assert [row["name"] for row in listed["runs"]] == ["demo/mine-20261125-100000", "demo/parts-20261124-100000"]
    assert sorted(listed["unreadable"]) == ["demo/open-20261126-110000", "demo/theirs-20261126-100000", "private-exp"]
    assert sorted(json.loads(demo["out"])["unreadable"]) == ["demo/open-20261126-110000",
                                                             "demo/theirs-20261126-100000"]
    site_listed = json.loads(by_site["out"])  # the site profile's job.runs_root: the same listing
    assert [r["name"] for r in site_listed["runs"]] == [r["name"] for r in listed["runs"]]
    assert site_listed["unreadable"] == listed["unreadable"]


def test_latest_is_your_newest_run_not_someone_elses(shared):
    status, as_json = run_cli(shared, ["status", "latest", "--runs-root", str(shared["root"])],
                              ["status", "latest", "--site", str(shared["site"]), "--json"])
    assert status["code"] == 0, status
    assert status["out"].startswith(f"run {shared['mine']} ")  # theirs-20261126 and open-20261126 are newer
    assert json.loads(as_json["out"])["run_dir"] == str(shared["mine"])


def test_every_command_naming_an_unreadable_run_says_so_on_one_line(shared, tmp_path):
    root, theirs, opened = str(shared["root"]), shared["theirs"], shared["open"]
    out = shared["dir"] / "exported"
    commands = [
        ["status", "theirs-20261126-100000", "--runs-root", root],      # its name
        ["status", "demo/theirs-20261126-100000", "--runs-root", root],  # EXPERIMENT/NAME
        ["status", "theirs", "--runs-root", root],                       # a unique start
        ["status", str(theirs)],                                          # its folder
        ["status", str(theirs), "--json"],
        ["status", "--watch", str(theirs)],
        ["logs", "theirs", "--runs-root", root],
        ["logs", str(theirs), "-f"],
        ["cancel", "theirs", "--runs-root", root],
        ["resume", "theirs", "--runs-root", root, "--dry-run"],
        ["eval", "--ckpt", "theirs", "--runs-root", root, "--local"],
        ["eval", "--ckpt", str(theirs / "checkpoints" / "step-1"), "--local"],
        ["eval", "--ckpt", str(theirs / "export"), "--local"],
        ["export", str(theirs / "export"), "--out", str(out)],
        ["status", "open-20261126-110000", "--runs-root", root],         # an open folder, a private run.json
        ["logs", str(opened)],
        ["cancel", str(opened)],
    ]
    results = run_cli(shared, *commands)
    for command, result in zip(commands, results, strict=True):
        line = _one_line(result, "Permission denied", "fix:")
        if AS_ROOT:
            assert "belongs to root, mode 0" in line, (command, line)
    assert not out.exists()


def test_a_name_in_a_folder_you_cannot_read_is_not_searched(shared):
    (result,) = run_cli(shared, ["status", "hidden-20261127-100000", "--runs-root", str(shared["root"])])
    _one_line(result, "no run of that name", "1 folder there you cannot read not searched")


def test_your_own_run_in_the_shared_root_still_works(shared):
    root = str(shared["root"])
    status, logs, cancel = run_cli(shared, ["status", "mine", "--runs-root", root],
                                   ["logs", "mine-20261125-100000", "--runs-root", root],
                                   ["cancel", "demo/mine-20261125-100000", "--runs-root", root])
    assert status["code"] == 0 and "COMPLETED" in status["out"], status
    assert logs["code"] == 0 and "hello from 77" in logs["out"], logs
    assert cancel["code"] == 0, cancel


def test_a_run_of_yours_with_folders_you_cannot_read_shows_what_it_can(shared):
    parts = str(shared["parts"])
    status, as_json, logs = run_cli(shared, ["status", parts], ["status", parts, "--json"],
                                    ["logs", "parts", "--runs-root", str(shared["root"])])
    assert status["code"] == 0 and "report: unreadable:" in status["out"] and "Permission denied" in status["out"]
    assert json.loads(as_json["out"])["report"]["outcome"] == "unreadable"
    assert logs["code"] == 0 and "hello from 77" in logs["out"], logs


def test_submit_into_an_experiment_folder_you_may_not_write_is_one_line(shared):
    if not AS_ROOT:
        _unavailable("the experiment folder must belong to another user")
    before = sorted(os.listdir(shared["root"] / "shared-exp"))
    (result,) = run_cli(shared, ["submit", "smoke_cpu", "--local", f"job.runs_root={shared['root']}",
                                 "job.experiment=shared-exp", "tracking.enabled=false"])
    _one_line(result, "job.experiment", "permission denied", "belongs to root, mode 0755")
    assert sorted(os.listdir(shared["root"] / "shared-exp")) == before  # nothing created


@pytest.mark.parametrize("root_mode, group", [(0o1777, None), (0o2775, OTHER_UID)],
                         ids=["world-writable-sticky", "group-writable-setgid"])
def test_an_experiment_folder_takes_the_runs_roots_permissions(shared, root_mode, group):
    """One user submits the first run of an experiment to a shared root; another user's run then goes in the same
    experiment folder (with the umask's 0755 the second user could not). The setgid root is the usual site setup:
    a project group both users are in."""
    if not AS_ROOT:
        _unavailable("two users are needed")
    root = shared["dir"] / f"root-{root_mode:o}"
    root.mkdir()
    if group is not None:
        os.chown(root, -1, group)
    root.chmod(root_mode)
    make = ("import os, sys; os.umask(0o022); from embodyhpc.rundir import new_run_dir; "
            "print(new_run_dir(sys.argv[1], 'exp', 'n'))")
    first = _as(OTHER_UID, [sys.executable, "-c", make, str(root)], shared["dir"], gid=group)
    assert first.returncode == 0, first.stderr
    assert (root / "exp").stat().st_mode & 0o7777 == root_mode
    second = _as(THIRD_UID, [sys.executable, "-c", make, str(root)], shared["dir"], gid=group)
    assert second.returncode == 0, second.stderr
    made = [Path(first.stdout.strip()), Path(second.stdout.strip())]
    assert [p.parent for p in made] == [root / "exp"] * 2 and made[0] != made[1]
    assert [p.stat().st_uid for p in made] == [OTHER_UID, THIRD_UID]
    assert all(p.stat().st_mode & 0o777 == 0o700 for p in made)  # runs stay private
