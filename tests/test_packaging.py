"""The package as users get it: the wheel in a fresh venv, and a CLI that never loads torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOK = "model.tokenizer_path=/models/paligemma/tokenizer.model"
# pyproject's package-dir: installed package -> source folder
MAPPED = {"embodyhpc": "embodyhpc", "embodyhpc.cli": "cli", "embodyhpc.sbatch_templates": "sbatch_templates",
          "embodyhpc.recipes": "recipes"}


def source_packages(root: Path) -> set[str]:
    """Every package of the source tree under its installed name (a folder with an __init__.py)."""
    return {".".join([package, *init.parent.relative_to(root / folder).parts])
            for package, folder in MAPPED.items() for init in (root / folder).rglob("__init__.py")}


def discovered_packages(root: Path) -> set[str]:
    """The packages setuptools would build from `root` with its pyproject.toml, found as a build finds them."""
    code = ("import json; from setuptools.dist import Distribution\n"
            "d = Distribution(); d.parse_config_files(); d.set_defaults()\n"
            "print(json.dumps([d.packages, d.package_dir]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    packages, package_dir = json.loads(proc.stdout.strip().splitlines()[-1])
    assert package_dir == MAPPED, "pyproject's package-dir changed: update MAPPED"
    return set(packages)


def test_every_package_is_built_without_a_list_to_edit(tmp_path):
    """pyproject.toml names folders, not packages: a package added to the tree (a new model family, here planted in
    a copy of the tree's packages) is in the wheel with nothing else edited."""
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    for folder in MAPPED.values():
        for init in (REPO / folder).rglob("__init__.py"):
            copy = tmp_path / init.relative_to(REPO)
            copy.parent.mkdir(parents=True, exist_ok=True)
            copy.write_text("")
    planted = tmp_path / "embodyhpc" / "models" / "toy_family"
    planted.mkdir()
    (planted / "__init__.py").write_text("")
    expected = source_packages(tmp_path)
    assert "embodyhpc.models.toy_family" in expected and source_packages(REPO) <= expected
    assert expected <= discovered_packages(tmp_path)


def clean_source(dest: Path) -> Path:
    """The files a wheel is built from, as a fresh checkout holds them: a build from the working tree itself would
    also pack the modules an earlier build left in its ignored build/ folder (moved or deleted ones included)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).is_file():
            shutil.copy2(REPO / name, dest / name)
    for folder in MAPPED.values():
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    return dest


@pytest.mark.slow
def test_wheel_installs_in_fresh_venv_and_lists_recipes(tmp_path):
    dist = tmp_path / "dist"
    (tmp_path / "source").mkdir()
    source = clean_source(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(source)], check=True, timeout=300)
    wheel = next(dist.glob("embodyhpc-*.whl"))
    # the wheel holds every module and data file of the source tree, under its installed name, and nothing else
    import zipfile

    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("embodyhpc-")}
    expected = {str(p.relative_to(REPO)) for p in (REPO / "embodyhpc").rglob("*.py")}
    for folder, package in (("cli", "embodyhpc/cli"), ("sbatch_templates", "embodyhpc/sbatch_templates"),
                            ("recipes", "embodyhpc/recipes")):
        expected |= {f"{package}/{p.relative_to(REPO / folder)}" for p in (REPO / folder).rglob("*")
                     if p.is_file() and p.suffix in (".py", ".yaml", ".j2") and "__pycache__" not in p.parts}
    assert in_wheel == expected, (sorted(expected - in_wheel), sorted(in_wheel - expected))
    assert {f"{p.replace('.', '/')}/__init__.py" for p in source_packages(REPO)} <= in_wheel
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip = [str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cli = str(env_dir / "bin" / "embodyhpc")
    listing = subprocess.run([cli, "recipes", "list"], cwd=elsewhere, capture_output=True, text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    assert "smoke_cpu" in listing.stdout and "pi05_fp8" in listing.stdout
    assert "example_ib" in listing.stdout and "local" in listing.stdout
    rendered = subprocess.run([cli, "render", "pi05_fp8", "--site", "example_roce", "data.root=/d", TOK,
                               "site.account=a", "--job", "eval"], cwd=elsewhere, capture_output=True, text=True,
                              timeout=60)
    assert rendered.returncode == 0, rendered.stderr
    assert "#SBATCH --array=0-29%30" in rendered.stdout
    # nothing was read from the source tree
    assert str(REPO) not in rendered.stdout


@pytest.mark.parametrize("args", [["--help"], ["render", "pi05_fp8", "data.root=/d", TOK], ["recipes", "list"],
                                  ["validate", "smoke_cpu"]])
def test_cli_paths_never_import_torch_or_submitit(args):
    code = ("import sys; from embodyhpc.cli.main import main; sys.argv=['embodyhpc', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "bad = [m for m in ('torch', 'submitit', 'numpy') if m in sys.modules]\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
