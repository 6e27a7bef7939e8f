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


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours an imported name lands in (`a.b.c` may be the module a.b's attribute c)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports, anywhere in its body (function-level imports included)."""
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                names = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            graph[module] |= {t for t in map(lambda n: _target(n, modules), names) if t and t != module}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iteratively (no recursion limit): every component, each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                found.append(sorted(component))
    return found


def test_no_import_cycle_longer_than_two() -> None:
    """A loop of three or more modules is a layering mistake (a pair, like a module and its fast path, is not)."""
    loops = [c for c in strongly_connected(import_graph(_sources(*PACKAGES))) if len(c) > 2]
    assert loops == []


def test_the_cycle_check_finds_a_loop_hidden_in_a_function(tmp_path, monkeypatch) -> None:
    (tmp_path / "embodyhpc" / "a").mkdir(parents=True)
    (tmp_path / "embodyhpc" / "a" / "__init__.py").write_text("")
    (tmp_path / "embodyhpc" / "a" / "x.py").write_text("from embodyhpc.a import y\n")
    (tmp_path / "embodyhpc" / "a" / "y.py").write_text("from . import z\n")
    (tmp_path / "embodyhpc" / "a" / "z.py").write_text("def f():\n    from embodyhpc.a.x import g\n")
    (tmp_path / "embodyhpc" / "b.py").write_text("import embodyhpc.a.x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    components = strongly_connected(import_graph(_sources("embodyhpc")))
    assert [c for c in components if len(c) > 1] == [["embodyhpc.a.x", "embodyhpc.a.y", "embodyhpc.a.z"]]


def _imports_from(prefix: str, modules: dict[str, Path]) -> dict[str, list[str]]:
    graph = import_graph(modules)
    return {module: sorted(t for t in targets if t == prefix or t.startswith(prefix + "."))
            for module, targets in graph.items()}


def test_slurm_imports_no_job_code() -> None:
    """embodyhpc/slurm only talks to Slurm: the jobs it runs are named, not imported."""
    found = _imports_from("embodyhpc.launch", _sources(*PACKAGES))
    assert {m: t for m, t in found.items() if m.startswith("embodyhpc.slurm") and t} == {}


def test_orchestration_imports_no_job_code() -> None:
    """Both backends resolve tasks by their import name (orchestrate.plan.TASKS), so job code can call the
    orchestration API without a loop."""
    found = _imports_from("embodyhpc.launch", _sources(*PACKAGES))
    assert {m: t for m, t in found.items() if m.startswith("embodyhpc.orchestrate") and t} == {}
    assert any(m.startswith("embodyhpc.orchestrate.") for m in found)  # the package exists and was read


def test_job_code_starts_chains_through_the_orchestration_api() -> None:
    graph = import_graph(_sources(*PACKAGES))
    assert "embodyhpc.orchestrate.api" in graph["embodyhpc.launch.checkpoint_eval"]
    assert not any("embodyhpc.submit" in targets for module, targets in graph.items()
                   if module.startswith("embodyhpc.") and module not in ("embodyhpc.submit", "embodyhpc.resume"))


# the names in a run directory: every module other than embodyhpc/rundir.py asks it for them
NAME_OWNERS = {
    "embodyhpc/rundir.py": {"run.json", "resolved.yaml", "policy_io.json", "metrics.jsonl", "train_result.json",
                            "train_attempts.jsonl", "spine-state.pt", "report.json", "report.md", "report.txt",
                            "history.jsonl", "smoke.json", "smoke-request.json", "checkpoints", "exports", "evals",
                            "submitit", "scripts", "attempts", ".embodyhpc.lock"},
}
NOT_YET_MOVED: set[tuple[str, str]] = set()


def _code_strings(tree: ast.AST) -> list[ast.Constant]:
    """String constants that can name a file: not documentation (a string statement), not a dict key (a JSON
    field), not prose (a message with spaces may mention a path to the user)."""
    skip = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    skip |= {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys if key}
    return [node for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in skip and " " not in node.value]


def spelled_names(modules: dict[str, Path]) -> list[str]:
    """`file:line spells NAME` for each run-directory or export-folder name outside the module that owns it."""
    found = []
    for path in modules.values():
        rel = path.relative_to(ROOT).as_posix()
        for node in _code_strings(ast.parse(path.read_text(), str(path))):
            for segment in node.value.split("/"):
                for owner, names in NAME_OWNERS.items():
                    if segment in names and rel != owner and (rel, segment) not in NOT_YET_MOVED:
                        found.append(f"{rel}:{node.lineno} spells {segment!r} (ask {owner})")
    return found


def test_only_rundir_spells_a_run_directory_name() -> None:
    assert spelled_names(_sources(*PACKAGES)) == []


def test_the_name_check_finds_a_spelled_path(tmp_path, monkeypatch) -> None:
    (tmp_path / "embodyhpc").mkdir()
    (tmp_path / "embodyhpc" / "rundir.py").write_text('RUN_JSON = "run.json"\n')
    (tmp_path / "embodyhpc" / "job.py").write_text(
        '"""Reads run.json (a docstring may say so)."""\n'
        'def f(run, step):\n    return run / "logs/metrics.jsonl", run / f"checkpoints/step-{step}"\n'
        'MESSAGE, JSON = "pass RUN/checkpoints/step-N", {"evals": 1}\n')
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert spelled_names(_sources("embodyhpc")) == [
        "embodyhpc/job.py:3 spells 'metrics.jsonl' (ask embodyhpc/rundir.py)",
        "embodyhpc/job.py:3 spells 'checkpoints' (ask embodyhpc/rundir.py)"]
