"""ARCHITECTURE.md's package table is the rule: every package imports only what its row allows (every import,
function-level ones included), and every package has a row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "ARCHITECTURE.md"


def allowed_imports(text: str) -> dict[str, set[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"[a-z_]+", cells[0]) and cells[0] != "package":
            rows[cells[0]] = {name.strip() for name in cells[2].split(",") if name.strip()}
    return rows


def package_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root).parts
    if rel[0] == "cli":
        return "cli"
    return rel[1] if len(rel) > 2 else Path(rel[1]).stem


def actual_imports(root: Path) -> dict[str, set[str]]:
    known = {p.stem if p.is_file() else p.name for p in (root / "embodyhpc").iterdir()
             if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    found: dict[str, set[str]] = {}
    for path in [*(root / "embodyhpc").rglob("*.py"), *(root / "cli").rglob("*.py")]:
        if path.name == "__init__.py" and path.parent == root / "embodyhpc":
            continue
        me = package_of(path, root)
        targets = found.setdefault(me, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            for name in names:
                parts = name.split(".")
                if parts[0] == "embodyhpc" and len(parts) > 1 and parts[1] in known and parts[1] != me:
                    targets.add(parts[1])
    return found


def violations(root: Path, table: dict[str, set[str]]) -> list[str]:
    found = actual_imports(root)
    problems = [f"{pkg}: no row in ARCHITECTURE.md" for pkg in sorted(set(found) - set(table))]
    for pkg, targets in sorted(found.items()):
        for target in sorted(targets - table.get(pkg, targets)):
            problems.append(f"{pkg} imports {target}, which its row does not allow")
    return problems


def test_packages_import_only_what_the_map_allows() -> None:
    assert violations(ROOT, allowed_imports(MAP.read_text())) == []


def test_the_map_check_finds_an_import_its_row_does_not_allow(tmp_path) -> None:
    for folder in ("embodyhpc/a", "embodyhpc/b", "cli"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "embodyhpc" / "a" / "x.py").write_text("def f():\n    from embodyhpc.b import y\n")
    (tmp_path / "embodyhpc" / "c.py").write_text("import embodyhpc.a\n")
    table = allowed_imports("| package | owns | may import |\n|---|---|---|\n| a | x | |\n| b | y | a |\n")
    assert violations(tmp_path, table) == ["c: no row in ARCHITECTURE.md", "cli: no row in ARCHITECTURE.md",
                                           "a imports b, which its row does not allow"]
