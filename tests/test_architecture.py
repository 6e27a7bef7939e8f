"""The architecture's rules, read from the source with `ast` (every import, function-level ones included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("embodyhpc", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*tops: str) -> dict[str, Path]:
    return {_module_name(p): p for top in tops for p in sorted((ROOT / top).rglob("*.py"))}


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def private_imports(modules: dict[str, Path]) -> list[str]:
    """`from a.b import _x` where a.b is outside the importing module's own package."""
    found = []
    for module, path in modules.items():
        own = _package_of(module, path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(module, path, node)
            if not source.startswith(PACKAGES):
                continue
            source_package = source.rpartition(".")[0] if (ROOT / (source.replace(".", "/") + ".py")).exists() \
                else source
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and source_package != own:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {alias.name} from {source}")
    return found


def test_no_module_imports_a_private_name_from_another_package() -> None:
    assert private_imports(_sources("embodyhpc", "cli", "tests", "bench", "tools")) == []


def test_the_private_import_check_finds_one(tmp_path, monkeypatch) -> None:
    """The check itself: a test module reaching into a package's private helper is found, a sibling isn't."""
    (tmp_path / "embodyhpc" / "a").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "embodyhpc" / "a" / "x.py").write_text("def _helper(): pass\n")
    (tmp_path / "embodyhpc" / "a" / "y.py").write_text("from embodyhpc.a.x import _helper\nfrom .x import _helper\n")
    (tmp_path / "tests" / "t.py").write_text("def f():\n    from embodyhpc.a.x import _helper, ok\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = private_imports(_sources("embodyhpc", "tests"))
    assert found == ["tests/t.py:2 imports _helper from embodyhpc.a.x"]
