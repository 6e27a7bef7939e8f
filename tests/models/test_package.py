"""The models package: registry, and its boundaries (no torch.distributed; no torch when only the registry is
imported, so the CLI can list models quickly)."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embodyhpc.config.schema import ModelConfig
from embodyhpc.errors import ConfigError
from embodyhpc.models import ModelSpec, build_model, model_spec, registered_models

MODELS_DIR = Path(__file__).resolve().parents[2] / "embodyhpc" / "models"


FULL_NEEDS = ["data.root=/datasets/x", "model.tokenizer_path=/models/paligemma/tokenizer.model"]
SHIPPED = {"groot", "pi05"}
THIRD = "mlp = tests.plugins.mlp_policy:SPEC"  # tests/plugins' toy family, installed as a third family would be


def run_python(code: str, env: dict[str, str] | None = None) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=MODELS_DIR.parents[1], env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(params=["shipped", "third family"])
def third_family(request, tmp_path, monkeypatch) -> Path | None:
    """None, or a site folder (on sys.path) whose dist-info declares the toy family as an `embodyhpc.models` entry
    point: the registry tests hold with a third family registered, with nothing outside its folder edited."""
    if request.param == "shipped":
        return None
    dist = tmp_path / "site" / "third_family-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: third-family\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[embodyhpc.models]\n{THIRD}\n")
    monkeypatch.syspath_prepend(str(dist.parent))
    return dist.parent


def test_registry(third_family) -> None:
    """The shipped families are there, every registered one is a ModelSpec of its name whose required parts load,
    and an unknown name is refused naming them all."""
    names = registered_models()
    assert SHIPPED <= set(names) and names == sorted(names) and ("mlp" in names) == (third_family is not None)
    for name in names:
        spec = model_spec(name)
        assert isinstance(spec, ModelSpec) and spec.name == name
        assert all(callable(spec.load(part)) for part in ("build", "collate", "token_count", "inference")), name
    with pytest.raises(ConfigError) as caught:
        build_model(dataclasses.replace(ModelConfig(), name="pi1"))
    assert str(caught.value).startswith(f"model.name: unknown model 'pi1'; registered: {', '.join(names)}")


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


def test_the_registry_does_not_import_torch(third_family) -> None:
    env = None if third_family is None else {**os.environ, "PYTHONPATH": str(third_family)}
    result = run_python("import json, sys, embodyhpc.models as m\n"
                        "print(json.dumps({'names': m.registered_models(), 'torch': 'torch' in sys.modules}))\n", env)
    assert SHIPPED <= set(result["names"]) and ("mlp" in result["names"]) == (third_family is not None)
    assert result["torch"] is False


@pytest.mark.parametrize("recipe", ["demo_metaworld_cpu", "smoke_cpu", "pi05_bf16", "pi05_fp8",
                                    "demo_groot_metaworld_cpu", "groot_n15_bf16"])
def test_shipped_recipes_build_their_model_on_meta(recipe: str) -> None:
    import torch

    from embodyhpc.validation import load_recipe

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
