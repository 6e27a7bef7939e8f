"""The terminal views at 80 columns with what Slurm really prints (sacct --parsable2 and squeue rows as the tools
write them: OUT_OF_MEMORY, "CANCELLED by 0", NODE_FAIL, PREEMPTED, hostlists, long pending reasons), the MLflow
link `status` prints, `doctor` on a login node and `recipes show` of a recipe with mandatory values."""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import quote

import pytest

from tests.test_runs import job, log_steps, make_run, report

# rows as `sacct --noheader --parsable2 --allocations --format=JobID,State,ExitCode,Reason,NodeList,Elapsed` prints
# them (recorded from Slurm 23.11's output format; "CANCELLED by 0" is how sacct shows a job root cancelled)
SACCT = """\
5001234|OUT_OF_MEMORY|0:125|None|gpu-a100-[001-004,010]|00:41:07
5001235_0|COMPLETED|0:0|None|gpu-a100-017|00:03:11
5001235_1|NODE_FAIL|0:0|None|gpu-a100-018|00:01:02
5001235_2|PREEMPTED|0:0|None|gpu-a100-019|00:02:00
5001235_3|CANCELLED by 0|0:15|None|gpu-a100-020|00:00:09
5001236|PENDING|0:0|DependencyNeverSatisfied|None assigned|00:00:00
"""
WIDTH = 80


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """sacct/squeue doubles on PATH printing the rows of the file returned (SACCT unless a test rewrites it)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    rows = tmp_path / "sacct.txt"
    rows.write_text(SACCT)
    (bin_dir / "sacct").write_text(f"#!/bin/sh\ncat {rows}\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\n")
    for tool in ("sacct", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    return rows


def _slurm_run(root: Path) -> Path:
    return make_run(root, "demo", "demo-metaworld-20261125-100000", backend="slurm", driver=None,
                    train=job("train", None, "5001234"), eval=job("eval", None, "5001235", array_size=4),
                    report=job("report", None, "5001236"))


def _columns(header: str) -> list[int]:
    """Where each column of a header line starts."""
    return [i for i, c in enumerate(header) if c != " " and (i == 0 or header[i - 1] == " " and
                                                            (i < 2 or header[i - 2] == " "))]


def test_status_fits_80_columns_with_real_slurm_states_and_hostlists(cli, tmp_path, slurm):
    run = _slurm_run(tmp_path / "runs")
    result = cli("status", str(run))
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("JOB"))):]
    table = table[:next(i for i, line in enumerate(table) if line.startswith("report  ")) + 3]
    assert all(len(line) <= WIDTH for line in table), "\n".join(table)
    starts = _columns(table[0])
    assert [table[0][i:].split()[0] for i in starts] == ["JOB", "ID", "STATE", "EXIT", "NODES", "PROGRESS"]
    rows = {line.split()[0]: line for line in table[1:] if not line.startswith(" ")}
    for kind, line in rows.items():  # every cell starts under its header, after a gap
        for start in starts[:5]:
            assert line[start] != " " and (start == 0 or line[start - 2:start] == "  "), (kind, line)
    state_at, nodes_at = starts[2], starts[4]
    assert rows["train"][state_at:].split()[0] == "OUT_OF_MEMORY"  # whole, not cut at a fixed width
    assert rows["eval"][state_at:].split()[0] == "NODE_FAIL"  # the worst of its elements
    assert rows["train"][nodes_at:].split()[0] == "gpu-a100-[001-004,010]"  # fits 80: shown whole
    def last_column(kind: str) -> str:  # the row's last column with its wrapped lines (each under the column)
        at = table.index(rows[kind])
        more = table[at + 1:at + 8]
        more = more[:next((i for i, line in enumerate(more) if not line.startswith(" ")), len(more))]
        assert all(line[:starts[5]].isspace() and line[starts[5]] != " " for line in more), more
        return " ".join(line[starts[5]:] for line in [rows[kind], *more])

    assert last_column("eval") == "1/4 done, 1 cancelled, 1 node_fail, 1 preempted"
    assert last_column("report").replace(" ", "") == "DependencyNeverSatisfied"  # long words break, nothing lost


def test_status_cuts_only_a_hostlist_too_long_for_the_terminal(cli, tmp_path, slurm):
    hosts = "gpu-a100-[001-004,010,012-020,031-040,100-163],gpu-h100-[001-016]"
    slurm.write_text(SACCT.replace("gpu-a100-[001-004,010]", hosts))
    lines = cli("status", str(_slurm_run(tmp_path / "runs"))).out.splitlines()
    header = next(line for line in lines if line.startswith("JOB"))
    train = next(line for line in lines if line.startswith("train "))
    nodes = train[_columns(header)[4]:].rstrip()
    assert len(train) <= WIDTH and nodes.endswith("…") and hosts.startswith(nodes[:-1]) and len(nodes) > 12
    assert train.split()[2] == "OUT_OF_MEMORY"
    assert json.loads(cli("status", str(_slurm_run(tmp_path / "r2")), "--json").out)["jobs"][0]["nodes"] == hosts


@pytest.mark.parametrize("other", ["abl-lr3e-4-20261125-090000", "demo-metaworld-20261125-100000"])
def test_runs_fits_80_columns_and_its_sacct_note_goes_to_stderr(cli, tmp_path, slurm, other):
    root = tmp_path / "runs"
    done = make_run(root, "demo", "demo-metaworld-20261125-100000", steps=600, train=job("train", "COMPLETED"),
                    report=job("report", "COMPLETED", "103"))
    log_steps(done, 600)
    report(done, "0.90 [0.70, 0.97] (20/20 episodes)")
    running = make_run(root, "demo", "demo-metaworld-20261125-110000", steps=600, train=job("train", "RUNNING"),
                       eval=job("eval", "PENDING", None, array_size=4))
    log_steps(running, 120)
    make_run(root, "abl", other, backend="slurm", driver=None, steps=100000,  # OUT_OF_MEMORY (train)
             train=job("train", None, "5001234"), eval=job("eval", None, "5001235", array_size=4))
    result = cli("runs", "--runs-root", str(root))
    lines = result.out.splitlines()
    assert all(len(line) <= WIDTH for line in lines), result.out
    assert len(lines) == 4 and lines[0].split()[:2] == ["RUN", "STATE"]
    names = [line.split()[0] for line in lines[1:]]
    clash = other.startswith("demo")  # two experiments hold that name: only EXPERIMENT/NAME tells them apart
    assert all(("/" in name) == clash for name in names), names
    for name in names:  # what the RUN column shows is what RUN arguments accept
        assert json.loads(cli("status", name, "--runs-root", str(root), "--json").out)["run_dir"].endswith(
            name.rpartition("/")[2])
    assert any("OUT_OF_MEMORY" in line for line in lines) and any("0.90 [0.70, 0.97]" in line for line in lines)
    starts = _columns(lines[0])
    for line in lines[1:]:
        assert all(line[i] != " " and line[i - 2:i] == "  " for i in starts[1:3]), line
    (Path(os.environ["PATH"].split(":")[0]) / "sacct").write_text(
        "#!/bin/sh\necho 'sacct: error: Problem talking to the database: Connection refused' >&2\nexit 1\n")
    fallback = cli("runs", "--runs-root", str(root))
    assert fallback.code == 0 and "sacct failed" not in fallback.out and "Connection refused" in fallback.err
    assert fallback.out.splitlines()[0].split()[0] == "RUN"


def test_status_prints_the_mlflow_link_of_the_run(cli, tmp_path, monkeypatch):
    from embodyhpc.tracking import mlflow_run

    run = make_run(tmp_path / "runs", "demo", "demo-metaworld-20261125-100000")
    data = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**data, "mlflow_run_id": "0a1b2c3d4e5f"}))
    (run / "resolved.yaml").write_text("job:\n  name: x\ntrain:\n  steps: 100\n"
                                       "tracking:\n  mlflow_uri: https://mlflow.example.org\n")
    asked = []
    monkeypatch.setattr(mlflow_run, "find_run", lambda uri, run_id: asked.append((uri, run_id)) or
                        {"experiment_id": "7"})  # the store's answer for that run
    lines = cli("status", str(run)).out.splitlines()
    assert asked == [("https://mlflow.example.org", "0a1b2c3d4e5f")]
    # MLflow's UI route of a run's page, with the model-training screens MLflow 3.17 needs (README, "MLflow")
    url = f"https://mlflow.example.org/#/experiments/7/runs/{quote('0a1b2c3d4e5f')}?workflowType=machine_learning"
    assert lines[-1] == f"MLflow run 0a1b2c3d4e5f: {url}"
    (run / "resolved.yaml").write_text("job: [not, a, mapping\n")  # a damaged recipe costs the link, not the status
    damaged = cli("status", str(run))
    assert damaged.code == 0 and damaged.out.splitlines()[-1].startswith("MLflow run 0a1b2c3d4e5f (no link: ")


# what sinfo prints on a login node whose slurm.conf comes from DNS SRV records that do not resolve (configless
# Slurm, 23.11), on stderr, exit 1
SINFO_DOWN = """\
sinfo: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host
sinfo: error: fetch_config: DNS SRV lookup failed
sinfo: error: _establish_config_source: failed to fetch config
sinfo: fatal: Could not establish a configuration source
"""


@pytest.fixture
def login_node(tmp_path, monkeypatch):
    """A login node: sbatch/srun/sinfo on PATH, no GPU (NVML absent), outside any Slurm job."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sbatch", "srun"):
        (bin_dir / tool).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sinfo-err").write_text(SINFO_DOWN)
    (bin_dir / "sinfo").write_text(f"#!/bin/sh\ncat {bin_dir / 'sinfo-err'} >&2\nexit 1\n")
    for tool in ("sbatch", "srun", "sinfo"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for name in ("SLURMD_NODENAME", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    from embodyhpc.hw import doctor as hw_doctor
    from embodyhpc.hw import versions

    monkeypatch.setattr(hw_doctor, "open_gpu_backend", _no_gpu)  # NVML's answer on a node without a driver
    # the real probe imports torch (seconds): its answer on a CPU build stands in
    monkeypatch.setattr(hw_doctor, "torch_versions", lambda: {"torch": "2.5.1", "cuda": versions.NOT_AVAILABLE,
                                                              "nccl": versions.NOT_AVAILABLE})
    return bin_dir


def _no_gpu():
    from embodyhpc.hw import NoGpuBackend

    return NoGpuBackend("NVML did not start: NVML Shared Library Not Found")


GPU_RECIPE = ["pi05_fp8", "data.root=/tmp/x", "--probe-mb", "0"]
ONE_NODE = ["resources.nodes=1", "parallelism.dp_replicate=1", "parallelism.dp_shard=-1"]


def test_doctor_on_a_login_node_whose_slurm_does_not_answer(cli, login_node):
    result = cli("doctor", *GPU_RECIPE)
    assert result.err.splitlines() == ["note: no Slurm cluster reachable (Could not establish a configuration "
                                       "source): judged for a run on this machine"]
    assert "sinfo: error" not in result.out + result.err and "EXCLUDE" not in result.out
    assert result.code == 1 and result.out.splitlines()[-3].startswith("this machine (")  # the verdict, then skips
    assert "failed: gpus, nvme" in result.out


def test_doctor_on_a_login_node_judges_no_compute_node_hardware(cli, login_node, monkeypatch):
    (login_node / "sinfo").write_text("#!/bin/sh\necho debug\n")  # Slurm answers
    result = cli("doctor", *GPU_RECIPE, "job.runs_root=/dev/shm", *ONE_NODE)
    names = [line.split()[1] for line in result.out.splitlines() if line.startswith("  ") and line.split()[0] in
             ("ok", "WARN", "FAIL")]
    assert "gpus" not in names and "nvme" not in names and "EXCLUDE" not in result.out, result.out
    skipped = [line for line in result.out.splitlines() if line.startswith("  -     ")]
    assert skipped[0].startswith("  -     gpus, nvme: not judged, this is a login node"), result.out
    assert result.code == 0, result.out
    monkeypatch.setenv("SLURMD_NODENAME", "gpu-017")  # the same inside a job: a compute node, judged, excluded
    inside = cli("doctor", *GPU_RECIPE, "job.runs_root=/dev/shm", *ONE_NODE)
    assert inside.code == 1 and inside.out.splitlines()[-1].startswith("EXCLUDE THIS NODE: gpu-017"), inside.out


def test_recipes_show_marks_what_a_shipped_recipe_leaves_to_set(cli):
    import yaml

    from embodyhpc.config.load import find_recipe

    source = yaml.safe_load(find_recipe("pi05_libero").text)  # the shipped file: which keys it leaves ???
    left = sorted(f"{section}.{key}" for section, values in source.items() if isinstance(values, dict)
                  for key, value in values.items() if value == "???")
    assert left == ["data.root", "model.init_weights"]
    result = cli("recipes", "show", "pi05_libero")
    assert result.code == 0, result.err
    shown = yaml.safe_load(result.out)
    assert [shown[k.split(".")[0]][k.split(".")[1]] for k in left] == ["???", "???"]
    assert sum("???  # must be set" in line for line in result.out.splitlines()) == 2
    assert result.err.strip() == "note: data.root, model.init_weights: yours to set (??? above), e.g. " \
                                 "data.root=... model.init_weights=..."
    given = cli("recipes", "show", "pi05_libero", "data.root=/data/libero", "model.init_weights=/w/pi05")
    assert "???" not in given.out and given.err == "" and yaml.safe_load(given.out)["data"]["root"] == "/data/libero"
    bad = cli("recipes", "show", "pi05_libero", "train.steps=-3")  # other errors still refuse, in one line
    assert bad.code == 2 and "train.steps" in bad.err
