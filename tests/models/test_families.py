"""Model families own everything of theirs: a plug-in package (a family under embodyhpc/models/, a toy plug-in under
tests/plugins/) imports no other plug-in package, the shared modules of embodyhpc/models import no family, and the
rest of embodyhpc and the CLI reach a family only through its spec (the registry's "module:attr" strings), never
by import. Read from the source with `ast`, function-level and relative imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_FOLDERS = ("embodyhpc/models", "tests/plugins")  # every package directly inside one is a plug-in


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def plugin_packages(root: Path) -> set[str]:
    return {module_name(root, init.parent / "__init__.py") for folder in PLUGIN_FOLDERS
            for init in (root / folder).glob("*/__init__.py")}


def imported_names(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, module or module.attr) of every import in the file; relative imports made absolute."""
    module = module_name(root, path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[:len(parts) - node.level + 1], *([node.module] if node.module else [])])
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def owner(name: str, plugins: set[str]) -> str | None:
    return next((p for p in plugins if name == p or name.startswith(p + ".")), None)


def family_leaks(root: Path, tops: tuple[str, ...] = ("embodyhpc", "cli", "tests/plugins")) -> list[str]:
    """Imports of a plug-in package from outside it (tests and benchmarks of a family aside: they are its tests)."""
    plugins = plugin_packages(root)
    leaks = []
    for top in tops:
        for path in sorted((root / top).rglob("*.py")):
            own = owner(module_name(root, path), plugins)
            for line, name in imported_names(root, path):
                target = owner(name, plugins)
                if target is not None and target != own:
                    leaks.append(f"{path.relative_to(root)}:{line} imports {name}")
    return leaks


def test_each_family_is_reached_through_its_spec_only() -> None:
    assert {"embodyhpc.models.pi05", "embodyhpc.models.groot", "tests.plugins.mlp_policy"} <= plugin_packages(ROOT)
    assert family_leaks(ROOT) == []


def test_the_check_finds_a_planted_import(tmp_path) -> None:
    """A family importing another's module (in a function, and relatively), a shared module and a checkpoint module
    importing a family: each found; a family's import of itself and of the shared modules is not."""
    files = {
        "embodyhpc/models/spec.py": "",
        "embodyhpc/models/vision.py": "import embodyhpc.models.b\n",
        "embodyhpc/models/a/__init__.py": "from embodyhpc.models.a.x import f\nfrom embodyhpc.models.spec import S\n",
        "embodyhpc/models/a/x.py": "from .y import g\n\n\ndef f():\n    from embodyhpc.models.b.tower import T\n",
        "embodyhpc/models/a/y.py": "from ..vision import V\n",
        "embodyhpc/models/b/__init__.py": "",
        "embodyhpc/models/b/tower.py": "from ..a import x\n",
        "embodyhpc/checkpoint/export.py": "from embodyhpc.models import a\nfrom embodyhpc.models import spec\n",
        "cli/__init__.py": "",
        "tests/plugins/toy/__init__.py": "from tests.plugins.toy.model import M\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert family_leaks(tmp_path) == [
        "embodyhpc/checkpoint/export.py:1 imports embodyhpc.models.a",
        "embodyhpc/models/a/x.py:5 imports embodyhpc.models.b.tower.T",
        "embodyhpc/models/b/tower.py:1 imports embodyhpc.models.a.x",
        "embodyhpc/models/vision.py:1 imports embodyhpc.models.b",
    ]
