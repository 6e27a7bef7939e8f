"""The RL job as one heterogeneous Slurm job (rl.sbatch.j2, embodyhpc.slurm.hetjob): golden scripts of both forms
(het groups; site.het_jobs: false), the srun line executed with recorders (groups in order, a role per group,
hostile recipe text inert), the fallback's rank layout, refusals, the components' states summarised, and, on the
local cluster, a real 3-group job and its fallback through hetjob.submit with a program that reports its role."""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embodyhpc.config.rl_schema import ROLES
from embodyhpc.errors import ConfigError
from embodyhpc.orchestrate.plan import Job, kind_plan
from embodyhpc.rundir import make_run_dir
from embodyhpc.runinfo import JobRecord, RunInfo
from embodyhpc.slurm import commands, hetjob
from embodyhpc.slurm.render import render_jobs, shell_join
from embodyhpc.slurm.status import chain_status
from embodyhpc.validation import load_recipe

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
UPDATE = "EMBODYHPC_UPDATE_GOLDEN"
RUN_DIR = Path("/runs/golden/rl-20260101-000000")
PYTHON = "/opt/embodyhpc/venv/bin/python"
RECIPE = "rl_pi05_libero"
MODEL = ["model.init_weights=/models/pi05_libero_sft", "model.tokenizer_path=/models/paligemma/tokenizer.model"]
# (site, het_jobs): every shipped site in the heterogeneous form, two in the one-allocation form
GOLDEN_CASES = [(site, True) for site in ("example_ib", "example_roce", "example_tcp", "local")] + [
    ("example_ib", False), ("local", False)]
HOSTILE = "x; touch pwned && echo $(touch pwned) `touch pwned` '\"$HOME"


def _overrides(site: str, het_jobs: bool) -> list[str]:
    return [*MODEL, *([] if site == "local" else ["site.account=robotics"]),
            *([] if het_jobs else ["site.het_jobs=false"])]


def _script(site: str, het_jobs: bool, run_dir: Path = RUN_DIR) -> str:
    loaded = load_recipe(RECIPE, _overrides(site, het_jobs), site=site)
    return kind_plan(loaded, "rl", run_dir, PYTHON).jobs[0].script


@pytest.mark.parametrize(("site", "het_jobs"), GOLDEN_CASES,
                         ids=[f"{s}-{'het' if h else 'fallback'}" for s, h in GOLDEN_CASES])
def test_golden(site, het_jobs, tmp_path):
    text = _script(site, het_jobs)
    path = GOLDEN / f"{RECIPE}@{site}.rl{'' if het_jobs else '-fallback'}.sbatch"
    if os.environ.get(UPDATE):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run `{UPDATE}=1 pytest {__file__}`"
    if text != path.read_text():
        diff = "".join(difflib.unified_diff(path.read_text().splitlines(True), text.splitlines(True),
                                            str(path), "rendered now"))
        pytest.fail(f"the RL script drifted from {path.name}; if intended, accept with `{UPDATE}=1 pytest "
                    f"{__file__}` and review the diff:\n{diff}")
    script = tmp_path / "rl.sh"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def _components(script: str) -> list[dict[str, str]]:
    """The #SBATCH options of each component, split at `#SBATCH hetjob` (what sbatch does)."""
    components: list[dict[str, str]] = [{}]
    for line in script.splitlines():
        if line == "#SBATCH hetjob":
            components.append({})
        elif line.startswith("#SBATCH --"):
            name, _, value = line[len("#SBATCH --"):].partition("=")
            components[-1][name] = value
    return components


def test_het_components_are_the_groups_in_order_with_their_own_resources():
    components = _components(_script("example_roce", True))
    # recipes/rl_pi05_libero.yaml by hand: actor 2 nodes x 8 ranks x 12 cpus, rollout 1 x 8 x 8, env 2 x 4 x 8
    assert [(c["nodes"], c["ntasks-per-node"], c["cpus-per-task"], c["mem"], c.get("gres")) for c in components] == [
        ("2", "8", "12", "0", "gpu:8"), ("1", "8", "8", "0", "gpu:8"), ("2", "4", "8", "64G", None)]
    for c in components:  # every component: the time limit, the signal before it and requeue (the actor requeues)
        assert (c["time"], c["signal"], "requeue" in c, c["account"]) == ("48:00:00", "USR2@300", True, "robotics")
    assert "output" in components[0] and all("output" not in c for c in components[1:])  # the batch script's log
    one = _components(_script("example_ib", False))
    assert len(one) == 1 and (one[0]["nodes"], one[0]["ntasks-per-node"], one[0]["gpus-per-node"]) == ("5", "8", "8")


def _execute(script_text: str, tmp_path: Path, hosts: list[str]) -> tuple[list[str], list[str]]:
    """Run a rendered script with srun, scontrol and module replaced by recorders; srun's arguments and the
    hostfile it was given (site.het_jobs: false)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text('#!/bin/sh\nprintf \'%s\\n\' "$@" > "$RECORD"\n'
                                 '[ -z "$SLURM_HOSTFILE" ] || cp "$SLURM_HOSTFILE" "$RECORD.hosts"\n')
    (bindir / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' " + " ".join(hosts) + "\n")
    (bindir / "module").write_text("#!/bin/sh\n")
    for tool in ("srun", "scontrol", "module"):
        (bindir / tool).chmod(0o755)
    script, record = tmp_path / "rl.sh", tmp_path / "srun.args"
    script.write_text(script_text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(tmp_path),
           "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n[1-5]"}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    hostfile = Path(f"{record}.hosts")
    return record.read_text().splitlines(), hostfile.read_text().splitlines() if hostfile.exists() else []


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A site whose every value is hostile text (a site profile, so even the keys only it may set) and a run
    directory with shell in its name."""
    folder = tmp_path_factory.mktemp("hostile")
    site = folder / "hostile_site.yaml"
    site.write_text(yaml.safe_dump({"site": {"name": "hostile", "partition": HOSTILE, "qos": HOSTILE,
                                             "constraint": HOSTILE, "exclusive": True, "env": {"EVIL": HOSTILE},
                                             "python": HOSTILE, "modules": [HOSTILE],
                                             "extra_sbatch": {"comment": HOSTILE},
                                             "container": {"image": HOSTILE, "workdir": HOSTILE,
                                                           "extra_args": [HOSTILE]}}}))
    return site, folder / "run dir; touch pwned $(touch pwned)"


def test_het_srun_line_runs_each_group_with_its_role_and_hostile_text_stays_inert(hostile, tmp_path):
    site, run_dir = hostile
    loaded = load_recipe(RECIPE, MODEL, site=str(site))
    text = kind_plan(loaded, "rl", run_dir, loaded.config.site.python).jobs[0].script
    args, hosts = _execute(text, tmp_path, [])
    assert not (tmp_path / "pwned").exists(), "recipe text was executed"
    groups: list[list[str]] = [[]]
    for arg in args:  # srun's het step: components separated by ":" arguments
        if arg == ":":
            groups.append([])
        else:
            groups[-1].append(arg)
    assert len(groups) == len(ROLES) and not hosts
    command = [HOSTILE, "-u", "-m", "embodyhpc.launch.rl", str(run_dir)]
    for index, (role, group) in enumerate(zip(ROLES, groups, strict=True)):
        head = group if index else group[group.index("--kill-on-bad-exit=1") + 1:]
        assert head[0] == f"--het-group={index}", group
        assert head[-len(command) - 2:] == ["env", f"EMBODYHPC_RL_ROLE={role}", *command], group
        assert head[head.index("--output") + 1] == f"{run_dir}/submitit/77_{role}-%t_log.out"
        assert head[head.index("--container-image") + 1] == HOSTILE and HOSTILE in head[:-len(command)]


def test_fallback_lays_ranks_out_group_by_group_on_the_nodes(tmp_path):
    text = _script("local", False, tmp_path / "run")
    hosts = ["a1", "a2", "r1", "e1", "e2"]
    args, layout = _execute(text, tmp_path, hosts)
    # by hand: actor 2 nodes x 8 ranks, rollout 1 x 8, env 2 x 4; rank i runs on line i of the hostfile
    assert layout == ["a1"] * 8 + ["a2"] * 8 + ["r1"] * 8 + ["e1"] * 4 + ["e2"] * 4
    assert "--ntasks=32" in args and "--distribution=arbitrary" in args and ":" not in args
    assert args[-5:] == [PYTHON, "-u", "-m", "embodyhpc.launch.rl", str(tmp_path / "run")]
    bindir = tmp_path / "bin"  # an allocation that does not hold the groups' nodes stops before srun
    (bindir / "scontrol").write_text("#!/bin/sh\nprintf '%s\\n' a1 a2\n")
    proc = subprocess.run(["bash", str(tmp_path / "rl.sh")], capture_output=True, text=True,
                          env={"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(tmp_path / "again")})
    assert proc.returncode == 1 and "has 2 nodes" in proc.stderr and not (tmp_path / "again").exists()


def test_what_one_allocation_cannot_do_is_refused_in_one_line(cli):
    result = cli("render", RECIPE, "--site", "local", *MODEL, "site.het_jobs=false", "rl.resources.env.partition=cpu")
    errors = [line for line in result.err.splitlines() if not line.startswith("warning:")]  # the paths: elsewhere
    assert result.code == 2 and len(errors) == 1, result.err
    assert "site.het_jobs" in errors[0] and "env: cpu" in errors[0] and "actor: debug" in errors[0]
    assert cli("render", RECIPE, "--site", "local", *MODEL, "rl.resources.env.partition=cpu").code == 0  # het: fine
    loaded = load_recipe(RECIPE, MODEL, site="local")  # Slurm runs no heterogeneous job as an array
    shape = kind_plan(loaded, "rl", RUN_DIR, PYTHON).jobs[0].shape
    with pytest.raises(ConfigError, match="no heterogeneous job as an array") as caught:
        render_jobs(loaded, [dataclasses.replace(shape, array_size=4, array_parallelism=4)], RUN_DIR)
    assert "\n" not in caught.value.one_line()


# sacct --allocations and squeue as the local cluster printed them for a 2-group job (975) and a running one (978)
SACCT_DONE = "975+0|COMPLETED|0:0|None|n1|00:00:07\n975+1|COMPLETED|0:0|None|n2|00:00:07\n"


def _status(monkeypatch, job_id: str, sacct: str, squeue: str = "", run_dir: Path = Path("/runs/r")):
    monkeypatch.setattr(commands, "run", lambda args, **kw: sacct if args[0] == "sacct" else squeue)
    info = RunInfo(run_id="r", run_dir=str(run_dir), backend="slurm", recipe=RECIPE, site="local", overrides=[],
                   python=PYTHON, created="2026-01-01T00:00:00+0000")
    info.jobs["rl"] = JobRecord(kind="rl", job_id=job_id)
    return chain_status(info)[0]


@pytest.mark.parametrize(("states", "summary"), [
    (["COMPLETED", "COMPLETED", "COMPLETED"], "COMPLETED"),
    (["COMPLETED", "FAILED", "COMPLETED"], "FAILED"),  # one failed group fails the job
    (["RUNNING", "FAILED", "RUNNING"], "FAILED"),  # ... at once, while the others are torn down
    (["CANCELLED", "NODE_FAIL", "CANCELLED"], "NODE_FAIL"),
    (["RUNNING", "COMPLETED", "RUNNING"], "RUNNING"),
    (["COMPLETED", "COMPLETING", "COMPLETED"], "COMPLETING"),
    (["PENDING", "PENDING", "PENDING"], "PENDING"),
    (["REQUEUED", "PENDING", "PENDING"], "REQUEUED"),
    (["TIMEOUT", "TIMEOUT", "TIMEOUT"], "TIMEOUT"),
    ([], "UNKNOWN"),
])
def test_component_states_summarise_into_the_jobs_state(states, summary):
    assert hetjob.summarise_states(states) == summary


def test_status_reads_every_component_of_the_job(monkeypatch):
    done = _status(monkeypatch, "975", SACCT_DONE)
    assert (done.state, done.nodes, done.exit_code, done.job_id) == ("COMPLETED", "n1,n2", 0, "975")
    failed = _status(monkeypatch, "975", SACCT_DONE.replace("975+1|COMPLETED|0:0", "975+1|FAILED|1:0"))
    assert (failed.state, failed.exit_code) == ("FAILED", 1)
    squeue = "978+0|RUNNING|None|n1\n978+1|RUNNING|None|n2\n978+2|PENDING|Resources|\n"
    running = _status(monkeypatch, "978", "", squeue)
    assert (running.state, running.nodes, running.reason) == ("RUNNING", "n1,n2", "Resources")


def test_a_job_is_not_done_before_sacct_reports_every_component(monkeypatch, tmp_path):
    """sacct's rows as the local cluster printed them around a 3-group job's end (job 998, polled every 0.4 s):
    first the job as `998` alone, seconds later its three components."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "rl.sbatch").write_text(_script("local", True))  # what sbatch got: 3 components
    running = ("998|PENDING|None|None|n1|00:00:00\n998+0|RUNNING|None|None|n1|00:00:01\n"
               "998+1|RUNNING|None|None|n2|00:00:01\n998+2|RUNNING|None|None|n3|00:00:01\n")
    assert _status(monkeypatch, "998", running, run_dir=tmp_path).state == "RUNNING"  # the stale `998` row: no
    early = _status(monkeypatch, "998", "998|COMPLETED|0:0|None|n1|00:00:02\n", run_dir=tmp_path)
    assert early.state == "UNKNOWN" and not early.finished
    every = "".join(f"998+{i}|COMPLETED|0:0|None|n{i + 1}|00:00:02\n" for i in range(3))
    done = _status(monkeypatch, "998", every, run_dir=tmp_path)
    assert (done.state, done.nodes) == ("COMPLETED", "n1,n2,n3")


# ---- on the local cluster (tools/slurm-local.sh: its partition `het` has 3 nodes, one per group) ----

def _describe_job(tmp_path: Path, het_jobs: bool) -> tuple[Job, Path, RunInfo, Path]:
    """The RL job of a tiny RL recipe, its program replaced by `python -m embodyhpc.rl.roles --describe OUT`: one
    actor rank, two rollout workers, one env worker, one node each."""
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"name": "local-het", "partition": "het", "gpu_request": "none",
                                             "het_jobs": het_jobs}, "network": {"fabric": "ethernet"}}))
    overrides = [*MODEL, "resources.time=00:05:00", "resources.signal_delay_s=30", "rl.actor_ranks=1",
                 "rl.rollout_workers=2", "rl.env_workers=1", "rl.micro_batch_size=8", "train.global_batch_size=8"]
    for role in ROLES:
        overrides += [f"rl.resources.{role}.nodes=1", f"rl.resources.{role}.gpus_per_node=0",
                      f"rl.resources.{role}.cpus_per_task=1", f"rl.resources.{role}.mem=300M"]
    loaded = load_recipe(RECIPE, overrides, site=str(site))
    run_dir, out = tmp_path / "run", tmp_path / "roles"
    assert make_run_dir(run_dir)
    out.mkdir()
    job = kind_plan(loaded, "rl", run_dir, sys.executable).jobs[0]
    shape = dataclasses.replace(job.shape, command=shell_join([sys.executable, "-m", "embodyhpc.rl.roles",
                                                               "--describe", str(out)]))
    job = dataclasses.replace(job, shape=shape, script=render_jobs(loaded, [shape], run_dir)[0])
    info = RunInfo(run_id=run_dir.name, run_dir=str(run_dir), backend="slurm", recipe=RECIPE, site=str(site),
                   overrides=overrides, python=sys.executable, created="2026-01-01T00:00:00+0000")
    return job, run_dir, info, out


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
@pytest.mark.parametrize("het_jobs", [True, False], ids=["hetjob", "one-allocation"])
def test_every_role_gets_its_rank_on_the_local_cluster(slurm_cluster, tmp_path, het_jobs):
    from tests.helpers import wait_for

    job, run_dir, info, out = _describe_job(tmp_path, het_jobs)
    record = hetjob.submit(job, run_dir, info, [])
    assert RunInfo.load(run_dir).jobs["rl"].job_id == record.job_id
    try:
        status = wait_for(lambda: (s := chain_status(info)[0]).finished and s, 120, f"rl job {record.job_id} ended")
    finally:
        commands.cancel([record.job_id])  # nothing left behind if it did not end
    assert status.state == "COMPLETED", status
    roles = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("role-*.json")}
    assert sorted(roles) == [0, 1, 2, 3]
    expected = [("actor", 0), ("rollout", 0), ("rollout", 1), ("env", 0)]  # actor=1, rollout=2, env=1
    assert [(roles[r]["role"], roles[r]["role_rank"]) for r in range(4)] == expected
    assert all(roles[r]["sizes"] == {"actor": 1, "rollout": 2, "env": 1} for r in roles)
    hosts = [roles[r]["host"] for r in range(4)]
    assert hosts[1] == hosts[2] and len({hosts[0], hosts[1], hosts[3]}) == 3  # a node per group, in both forms
    logs = {p.name for p in (run_dir / "submitit").iterdir()}
    if het_jobs:
        assert set(status.nodes.split(",")) == {"n1", "n2", "n3"}  # every component's node, read back
        # each group's processes log under the job's id and their role (embodyhpc logs finds J_*); srun's %t in a
        # het step is not the global rank (seen: 3 -> 5), so only the prefix is certain
        for role, count in (("actor", 1), ("rollout", 2), ("env", 1)):
            assert sum(n.startswith(f"{record.job_id}_{role}-") and n.endswith(".out") for n in logs) == count, logs


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")
def test_a_failed_group_fails_the_whole_het_job(slurm_cluster, tmp_path):
    from tests.helpers import wait_for

    job, run_dir, info, out = _describe_job(tmp_path, True)
    # the env group's program fails (a role it cannot be: the launcher's check), the others would succeed
    script = job.script.replace("env EMBODYHPC_RL_ROLE=env ", "env EMBODYHPC_RL_ROLE=learner ")
    assert script != job.script
    record = hetjob.submit(dataclasses.replace(job, script=script), run_dir, info, [])
    try:
        status = wait_for(lambda: (s := chain_status(info)[0]).finished and s, 120, "the rl job ended")
    finally:
        commands.cancel([record.job_id])
    assert status.state == "FAILED", status
