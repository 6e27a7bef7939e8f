"""Issue 16, class 6 and the README's pi05 commands: what the submitting machine can check is checked at validate,
render and --dry-run, not on a node hours later. A missing path on a filesystem this machine sees is an error; a
path on one it does not mount is a warning naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import embodyhpc
from tests.helpers import one_line_error

DEMO = "smoke_cpu"
CODE_ROOT = Path(embodyhpc.__file__).resolve().parents[1]


def _assert_rejected(result, *fragments: str) -> str:
    line = one_line_error(result, *fragments)
    return line


# ---------------------------------------------------------------- evaluation tasks

BAD_TASKS = [
    (["eval.tasks=[reach-v99]"], "reach-v99", "reach-v3"),
    (["eval.tasks=[reach-v3, pick-plcae-v3]"], "pick-plcae-v3", "pick-place-v3"),
    (["eval.tasks=[MT11]"], "MT11", "MT10"),
    (["eval.tasks=[pusht]"], "pusht", None),
    (["eval.suite=pusht", "eval.tasks=[reach-v3]"], "reach-v3", None),
    (["eval.tasks=['']"], "''", None),
    (["eval.tasks=[Reach-V3]"], "Reach-V3", "reach-v3"),
]


@pytest.mark.parametrize(("overrides", "task", "hint"), BAD_TASKS, ids=[t for _, t, _ in BAD_TASKS])
def test_unknown_eval_task_is_refused_at_validate(cli, overrides, task, hint):
    line = _assert_rejected(cli("validate", DEMO, *overrides), "eval.tasks", task, "override")
    if hint:
        assert f"did you mean {hint!r}" in line


@pytest.mark.parametrize("tasks", ["[MT10]", "[mt50]", "[reach-v3, MT10]", "[window-close-v3]"])
def test_known_metaworld_tasks_and_groups_pass(cli, tasks):
    result = cli("validate", DEMO, f"eval.tasks={tasks}", "eval.shards=1")
    assert result.code == 0, result.err


@pytest.mark.parametrize("task", ["pusht", "PushT-v0", "gym_pusht/PushT-v0"])
def test_pusht_aliases_pass(cli, task):
    result = cli("validate", DEMO, "eval.suite=pusht", f"eval.tasks=[{task}]", "eval.reference_policies=[random]",
                 "eval.shards=1")
    assert result.code == 0, result.err


def test_unknown_task_in_a_recipe_file_names_the_file(cli, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("eval:\n  tasks: [reach-v9]\n")
    _assert_rejected(cli("validate", str(recipe)), str(recipe), "eval.tasks")


def test_validate_checks_tasks_without_importing_a_simulator():
    code = ("import sys; from embodyhpc.validation import load_recipe\n"
            "try:\n    load_recipe('smoke_cpu', ['eval.tasks=[reach-v9]'])\nexcept Exception as e:\n    print(e)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('metaworld', 'mujoco', 'gym_pusht', 'torch')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(CODE_ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "reach-v9" in proc.stdout and proc.stdout.strip().endswith("[]"), proc.stdout


# ---------------------------------------------------------------- paths jobs will read

def test_missing_data_root_on_a_visible_filesystem_is_an_error(cli, tmp_path):
    missing = tmp_path / "no-such-dataset"
    _assert_rejected(cli("validate", DEMO, "data.format=lerobot", f"data.root={missing}"), "data.root",
                     "does not exist", "override")


def test_missing_relative_data_root_is_an_error(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _assert_rejected(cli("validate", DEMO, "data.format=hdf5", "data.root=data/demo.hdf5"), "data.root")


@pytest.mark.parametrize("hub_id", ["lerobot/pusht", "lerobot/aloha_sim_insertion_human", "user/my.dataset-v2"])
def test_hub_id_as_data_root_is_an_error(cli, tmp_path, monkeypatch, hub_id):
    monkeypatch.chdir(tmp_path)
    _assert_rejected(cli("validate", DEMO, "data.format=lerobot", f"data.root={hub_id}"), "data.root",
                     "hub id")


# smoke_cpu's model.action_horizon is 10: a policy recipe asks for a chunk of 10 actions (validation/data_checks.py)
CHUNK10 = "data.delta_timestamps={action: [" + ", ".join(str(i / 10) for i in range(10)) + "]}"


def test_a_local_folder_named_like_a_hub_id_is_fine(cli, tmp_path, monkeypatch):
    import shutil

    monkeypatch.chdir(tmp_path)
    (tmp_path / "lerobot").mkdir()  # a dataset validate can read (validation/data_checks.py checks the recipe)
    shutil.copytree(Path(__file__).resolve().parents[1] / "data" / "fixtures" / "lerobot_v30_sample",
                    tmp_path / "lerobot" / "pusht")
    result = cli("validate", DEMO, "data.format=lerobot", "data.root=lerobot/pusht", CHUNK10)
    assert result.code == 0, result.err
    assert "warning" not in result.err


@pytest.mark.parametrize("command", ["validate", "render"])
def test_path_on_an_unmounted_filesystem_is_a_warning_naming_it(cli, command):
    root = "/nonexistent-fs-embodyhpc/data/pick"
    result = cli(command, DEMO, "data.format=lerobot", f"data.root={root}", CHUNK10)
    assert result.code == 0, result.err
    assert f"warning: data.root={root}" in result.err and "not visible from this machine" in result.err


def test_missing_tokenizer_on_a_visible_filesystem_is_an_error(cli, tmp_path):
    _assert_rejected(cli("validate", DEMO, f"model.tokenizer_path={tmp_path}/tok.model"), "model.tokenizer_path")


def test_unset_tokenizer_of_a_full_model_warns_at_validate_and_fails_at_dry_run(cli, runs_root):
    args = ["recipes/pi05_fp8.yaml", "--site", "example_ib", "data.root=/nonexistent-fs-embodyhpc/pick",
            "site.account=me", f"job.runs_root={runs_root}"]
    result = cli("validate", *args)
    assert result.code == 0, result.err
    assert "model.tokenizer_path is unset" in result.err
    _assert_rejected(cli("submit", *args, "--dry-run"), "model.tokenizer_path", "unset")
    assert list(runs_root.iterdir()) == []


def test_readme_pi05_commands_work_as_written(cli):
    for command in ("validate", "render"):
        result = cli(command, "recipes/pi05_fp8.yaml", "--site", "example_ib", "data.root=/lustre/data/pick",
                     "site.account=me")
        assert result.code == 0, (command, result.err)


# ---------------------------------------------------------------- container python, templates, NCCL environment

def test_container_site_without_python_uses_the_containers_python3(cli):
    result = cli("render", DEMO, "--site", "example_ib", "site.account=me", "--job", "train")
    assert result.code == 0, result.err
    assert "python3 -u -m submitit.core._submit" in result.out
    assert sys.executable not in result.out


def test_site_python_still_wins_in_a_container(cli, tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"container": {"image": "img.sqsh"}, "python": "/opt/py/bin/python"}}))
    result = cli("render", DEMO, "--site", str(site), "--job", "train")
    assert result.code == 0, result.err
    assert "/opt/py/bin/python -u -m submitit" in result.out


@pytest.mark.parametrize("templates", ["missing", "broken", "refused include"])
def test_validate_applies_the_template_checks_of_render(cli, tmp_path, templates):
    folder = tmp_path / "templates"
    if templates != "missing":
        folder.mkdir()
        body = "{% if %}" if templates == "broken" else '{% include "/etc/passwd" %}'
        (folder / "report.sbatch.j2").write_text(body)
    site = tmp_path / "site.yaml"
    site.write_text(yaml.safe_dump({"site": {"templates_dir": str(folder)}}))
    for command in ("render", "validate"):
        _assert_rejected(cli(command, DEMO, "--site", str(site)), "site.templates_dir")


def test_dry_run_makes_the_nccl_environment_check_of_submit(cli, monkeypatch, runs_root):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth9")
    result = cli("submit", DEMO, "--site", "example_tcp", "site.account=me", f"job.runs_root={runs_root}",
                 "--dry-run")
    _assert_rejected(result, "NCCL_SOCKET_IFNAME", "eth9")
    assert list(runs_root.iterdir()) == []


def test_evaluating_existing_weights_does_not_need_the_dataset(tmp_path):
    """`embodyhpc eval --ckpt` reads no dataset: a training set deleted since is no reason to refuse it."""
    from embodyhpc.errors import ConfigError
    from embodyhpc.submit import preflight
    from embodyhpc.validation import load_recipe

    loaded = load_recipe(DEMO, ["data.format=lerobot", f"data.root={tmp_path}/gone", f"eval.weights={tmp_path}"])
    assert preflight(loaded, "/usr/bin/python3", submitting=True, eval_only=True) == []
    with pytest.raises(ConfigError, match="data.root"):
        preflight(loaded, "/usr/bin/python3", submitting=True)
