"""Rendering: golden scripts for every shipped recipe x site, quoting, bash -n, admin templates."""

from __future__ import annotations

import difflib
import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from embodyhpc.config.load import shipped_recipes, shipped_sites
from embodyhpc.orchestrate.plan import kind_plan
from embodyhpc.slurm.render import JOB_KINDS
from embodyhpc.validation import load_recipe

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
RUN_DIR = Path("/runs/golden/demo-20260101-000000")
PYTHON = "/opt/embodyhpc/venv/bin/python"
UPDATE = "EMBODYHPC_UPDATE_GOLDEN"


def _script(loaded, kind: str, run_dir: Path, python: str) -> str:
    """One job's script as every consumer gets it: the plan's (its shape computed and rendered once)."""
    return kind_plan(loaded, kind, run_dir, python).jobs[0].script


def _overrides(recipe: str, site: str) -> list[str]:
    tokenizer = "model.tokenizer_path=/models/paligemma/tokenizer.model"
    if recipe.startswith("groot"):
        tokenizer = "model.tokenizer_path=/models/eagle2.5/tokenizer.json"
    cpu = ("smoke_cpu", "demo_metaworld_cpu", "demo_groot_metaworld_cpu", "rl_metaworld_cpu")
    out = [] if recipe in cpu else ["data.root=/data/lerobot/pick_place", tokenizer]
    out += ["model.init_weights=/models/pi05_base"] if recipe == "pi05_libero" else []
    out += ["model.init_weights=/models/pi05_libero_sft"] if recipe.startswith("rl_") else []
    return out + ([] if site == "local" else ["site.account=robotics"])


def _render_all(recipe: str, site: str) -> str:
    loaded = load_recipe(recipe, _overrides(recipe, site), site=site)
    return "".join(f"# ===== {kind}.sbatch =====\n{_script(loaded, kind, RUN_DIR, PYTHON)}"
                   for kind in JOB_KINDS)


CASES = [(r, s) for r in shipped_recipes() for s in shipped_sites()]


@pytest.mark.parametrize(("recipe", "site"), CASES, ids=[f"{r}@{s}" for r, s in CASES])
def test_golden(recipe, site):
    text = _render_all(recipe, site)
    path = GOLDEN / f"{recipe}@{site}.sbatch"
    if os.environ.get(UPDATE):
        path.write_text(text)
    assert path.is_file(), f"no golden file {path}: run `{UPDATE}=1 pytest {__file__}`"
    expected = path.read_text()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            str(path), "rendered now"))
        pytest.fail(f"rendered scripts drifted from {path.name}. If intended, accept with "
                    f"`{UPDATE}=1 pytest {__file__}` and review the golden diff:\n{diff}")


@pytest.mark.parametrize(("recipe", "site"), CASES, ids=[f"{r}@{s}" for r, s in CASES])
def test_every_rendered_script_is_valid_bash(recipe, site, tmp_path):
    loaded = load_recipe(recipe, _overrides(recipe, site), site=site)
    for kind in JOB_KINDS:
        script = tmp_path / f"{kind}.sh"
        script.write_text(_script(loaded, kind, RUN_DIR, PYTHON))
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert proc.returncode == 0, (kind, proc.stderr)


# relative marker (job.name may not hold '/'); scripts run with cwd = tmp_path
HOSTILE = "x; touch pwned && echo $(touch pwned) `touch pwned` '\"$HOME"


def test_hostile_recipe_values_render_inert(tmp_path):
    """Every recipe string that reaches a script is quoted: executing it touches nothing."""
    marker = tmp_path / "pwned"
    evil = HOSTILE
    quoted = json.dumps(evil)  # a YAML double-quoted scalar
    overrides = [f"{key}={quoted}" for key in (
        "site.partition", "site.account", "site.qos", "site.constraint",
        "network.extra_env.EVIL2", "network.socket_ifname", "site.extra_sbatch.comment")]
    overrides += [f"network.hcas=[{quoted}]", "network.fabric=ib"]
    # keys that choose what code runs come only from a site profile (a hostile admin is out of scope, but its
    # values are quoted all the same)
    site = tmp_path / "hostile_site.yaml"
    site.write_text(yaml.safe_dump({"site": {"env": {"EVIL": evil}, "python": evil, "modules": [evil],
                                             "container": {"image": evil, "workdir": evil, "extra_args": [evil]}}}))
    loaded = load_recipe("smoke_cpu", overrides, site=str(site))
    assert loaded.config.site.partition == evil
    run_dir = tmp_path / "run dir; touch pwned"
    for kind in JOB_KINDS:
        text = _script(loaded, kind, run_dir, loaded.config.site.python)
        # run the script for real with srun/module replaced by no-op recorders
        bindir = tmp_path / "bin"
        bindir.mkdir(exist_ok=True)
        for tool in ("srun", "module"):
            (bindir / tool).write_text("#!/bin/sh\nprintf '%s\\n' \"$@\" >> \"$RECORD\"\n")
            (bindir / tool).chmod(0o755)
        script = tmp_path / f"{kind}.sh"
        script.write_text(text)
        record = tmp_path / f"{kind}.args"
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(record), "HOME": str(tmp_path)}
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env,
                              cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert not marker.exists(), f"{kind}: recipe text was executed"
        args = record.read_text().splitlines()
        # the hostile strings arrive at srun as single, intact arguments
        if kind == "train":
            assert evil in args  # container image/workdir/extra arg
        assert str(run_dir / "submitit") in args


def test_render_refuses_control_characters_even_from_code(tmp_path):
    import jinja2

    from embodyhpc.slurm.render import script_value

    with pytest.raises(jinja2.TemplateError):
        script_value("a\nb")


def test_site_templates_dir_overrides_one_template(tmp_path):
    (tmp_path / "report.sbatch.j2").write_text(
        '{% extends "base.sbatch.j2" %}\n{% block before_srun %}\necho site-{{ kind }}\n{% endblock %}\n')
    loaded = load_recipe("smoke_cpu", site=str(site_profile(tmp_path, templates_dir=str(tmp_path))))
    report = _script(loaded, "report", RUN_DIR, PYTHON)
    train = _script(loaded, "train", RUN_DIR, PYTHON)
    assert "echo site-report" in report and "site-" not in train
    assert train == _script(load_recipe("smoke_cpu"), "train", RUN_DIR, PYTHON)


def test_missing_templates_dir_is_a_config_error(cli, tmp_path):
    result = cli("render", "smoke_cpu", "--site", str(site_profile(tmp_path, templates_dir="/does/not/exist")))
    assert result.code == 2 and "site.templates_dir" in result.err and "does not exist" in result.err


def site_profile(folder: Path, **site: object) -> Path:
    """A site profile file setting `site.<key>` values (keys that choose code may come only from one)."""
    path = folder / "test_site.yaml"
    path.write_text(yaml.safe_dump({"site": site}))
    return path


def test_render_cli_prints_exactly_the_plans_script(cli, tmp_path):
    result = cli("render", "smoke_cpu", "--site", "local", "--job", "train", "--run-dir", str(tmp_path))
    assert result.code == 0, result.err
    loaded = load_recipe("smoke_cpu", site="local")
    import sys

    assert result.out == _script(loaded, "train", tmp_path, sys.executable)


def test_script_shape():
    loaded = load_recipe("pi05_fp8", _overrides("pi05_fp8", "example_ib"), site="example_ib")
    train = _script(loaded, "train", RUN_DIR, PYTHON)
    eval_ = _script(loaded, "eval", RUN_DIR, PYTHON)
    assert "#SBATCH --nodes=4\n" in train and "#SBATCH --ntasks-per-node=8\n" in train
    assert "#SBATCH --gpus-per-node=8\n" in train and "#SBATCH --exclusive\n" in train
    assert "#SBATCH --signal=USR2@300\n" in train and "#SBATCH --time=48:00:00\n" in train
    assert "export NCCL_IB_HCA=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1\n" in train
    assert "#SBATCH --array=0-29%30\n" in eval_ and "NCCL_IB_HCA" not in eval_
    assert "%A_%a_%t_log.out" in eval_ and "--gpus" not in eval_
    roce = load_recipe("pi05_fp8", _overrides("pi05_fp8", "example_roce"), site="example_roce")
    text = _script(roce, "train", RUN_DIR, PYTHON)
    assert "#SBATCH --gres=gpu:8\n" in text and "module load cuda/12.4\n" in text
    assert "export NCCL_IB_GID_INDEX=3\n" in text


@pytest.mark.parametrize(("site", "line"), [("example_ib", "#SBATCH --gpus-per-node=2\n"),
                                            ("example_roce", "#SBATCH --gres=gpu:2\n"), ("local", None)])
def test_eval_shards_request_gpus_in_the_site_style(site, line):
    loaded = load_recipe("pi05_fp8", [*_overrides("pi05_fp8", site), "eval.gpus_per_task=2"], site=site)
    eval_, export = (_script(loaded, kind, RUN_DIR, PYTHON) for kind in ("eval", "export"))
    if line is None:  # a site without GPU requests asks for none
        assert "gpu" not in eval_.lower().replace("gpu_request", "")
    else:
        assert line in eval_ and "#SBATCH --ntasks-per-node=1\n" in eval_
    assert "--gpus" not in export and "--gres" not in export  # the export job reads weights on a CPU
