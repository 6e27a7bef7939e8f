"""The models package: registry, and its boundaries (no torch.distributed; no torch when only the registry is
imported, so the CLI can list models quickly)."""

from __future__ import annotations

import ast
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import build_model, registered_models

MODELS_DIR = Path(__file__).resolve().parents[2] / "embodyhpc" / "models"


FULL_NEEDS = ["data.root=/datasets/x", "model.tokenizer_path=/models/paligemma/tokenizer.model"]


def run_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=MODELS_DIR.parents[1])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_registry() -> None:
    assert registered_models() == ["groot", "pi05"]
    with pytest.raises(ConfigError, match="model.name: unknown model 'pi1'; registered: groot, pi05"):
        build_model(dataclasses.replace(ModelConfig(), name="pi1"))


def test_importing_every_model_module_adds_no_torch_distributed_module() -> None:
    """`import torch` itself loads a few torch.distributed modules; ours must not load any more (FSDP, DTensor,
    process groups belong to embodyhpc/parallel)."""
    result = run_python(
        "import json, pkgutil, importlib, sys, torch\n"
        "before = {m for m in sys.modules if m.startswith('torch.distributed')}\n"
        "import embodyhpc.models as pkg\n"
        "names = [m.name for m in pkgutil.walk_packages(pkg.__path__, 'embodyhpc.models.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "from embodyhpc.config.schema import ModelConfig\n"
        "model = pkg.build_model(ModelConfig(size='tiny'))\n"
        "added = sorted(m for m in sys.modules if m.startswith('torch.distributed') and m not in before)\n"
        "print(json.dumps({'names': names, 'added': added}))\n")
    assert "embodyhpc.models.pi05.model" in result["names"] and "embodyhpc.models.fp8" in result["names"]
    assert result["added"] == []


def test_no_source_file_imports_torch_distributed() -> None:
    for path in MODELS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            assert not any(n.startswith("torch.distributed") for n in names), f"{path}: {names}"


def test_the_registry_does_not_import_torch() -> None:
    result = run_python("import json, sys, embodyhpc.models as m\n"
                        "print(json.dumps({'names': m.registered_models(), 'torch': 'torch' in sys.modules}))\n")
    assert result == {"names": ["groot", "pi05"], "torch": False}


@pytest.mark.parametrize("recipe", ["demo_metaworld_cpu", "smoke_cpu", "pi05_bf16", "pi05_fp8",
                                    "demo_groot_metaworld_cpu", "groot_n15_bf16"])
def test_shipped_recipes_build_their_model_on_meta(recipe: str) -> None:
    import torch

    from embodyhpc.config.load import load_recipe

    cpu_recipe = recipe in ("smoke_cpu", "demo_metaworld_cpu", "demo_groot_metaworld_cpu")
    config = load_recipe(recipe, overrides=[] if cpu_recipe else FULL_NEEDS).config
    precision = config.precision
    if precision.mode == "fp8" and precision.fp8_backend == "te":
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError:
            precision = None  # te's swap needs the package; tests/models/test_fp8.py checks the error
    with torch.device("meta"):
        model = build_model(config.model, precision)
    assert model.action_horizon == config.model.action_horizon and model.action_dim == config.model.action_dim
