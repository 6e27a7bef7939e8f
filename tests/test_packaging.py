"""The package as users get it: the wheel in a fresh venv, and a CLI that never loads torch."""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOK = "model.tokenizer_path=/models/paligemma/tokenizer.model"


@pytest.mark.slow
def test_wheel_installs_in_fresh_venv_and_lists_recipes(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(REPO)], check=True, timeout=300)
    wheel = next(dist.glob("embodyhpc-*.whl"))
    # every module and data file of the source tree is in the wheel, under its installed name
    import zipfile

    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if not n.startswith("embodyhpc-")}
    expected = {str(p.relative_to(REPO)) for p in (REPO / "embodyhpc").rglob("*.py")}
    for folder, package in (("cli", "embodyhpc/cli"), ("sbatch_templates", "embodyhpc/sbatch_templates"),
                            ("recipes", "embodyhpc/recipes")):
        expected |= {f"{package}/{p.relative_to(REPO / folder)}" for p in (REPO / folder).rglob("*")
                     if p.is_file() and p.suffix in (".py", ".yaml", ".j2") and "__pycache__" not in p.parts}
    assert expected <= in_wheel, sorted(expected - in_wheel)
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
