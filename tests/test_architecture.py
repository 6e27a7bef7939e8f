"""The architecture's rules, read from the source with `ast` (every import, function-level ones included)."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("embodyhpc", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(*tops: str) -> dict[str, Path]:
    return {_module_name(p): p for top in tops for p in sorted((ROOT / top).rglob("*.py"))}


@functools.cache
def _parsed(path: Path, stamp: tuple[int, int]) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once per version of the file for all the checks (never changed by them)."""
    stat = path.stat()
    return _parsed(path, (stat.st_mtime_ns, stat.st_size))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(module, path).split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


# an import statement naming something that starts with "_" (on its line, after a backslash, or in parentheses):
# the files private_imports parses; any `from a import _x` matches
_NAMES_AN_UNDERSCORE = re.compile(r"\bimport\b(?:[^\n(]|\\\n)*\b_\w|\bimport\s*\([^)]*\b_\w")


def private_imports(modules: dict[str, Path]) -> list[str]:
    """`from a.b import _x` where a.b is outside the importing module's own package."""
    found = []
    for module, path in modules.items():
        if not _NAMES_AN_UNDERSCORE.search(path.read_text()):  # most files: no parse needed
            continue
        own = _package_of(module, path)
        for node in ast.walk(_tree(path)):
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
        for node in ast.walk(_tree(path)):
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


def package_of(module: str) -> str:
    """embodyhpc.config.load -> config, embodyhpc.rundir -> rundir, cli.main -> cli."""
    parts = module.split(".")
    return parts[1] if parts[0] == "embodyhpc" and len(parts) > 1 else parts[0]


def package_cycles(modules: dict[str, Path]) -> list[str]:
    """Each cycle between packages (any length), with the module imports that make its edges."""
    edges: dict[tuple[str, str], list[str]] = {}
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph(modules).items():
        graph.setdefault(package_of(module), set())
        for target in targets:
            pair = (package_of(module), package_of(target))
            if pair[0] != pair[1]:
                graph[pair[0]].add(pair[1])
                graph.setdefault(pair[1], set())
                edges.setdefault(pair, []).append(f"{module} -> {target}")
    found = []
    for component in (c for c in strongly_connected(graph) if len(c) > 1):
        inside = sorted(pair for pair in edges if pair[0] in component and pair[1] in component)
        found.append(f"{component}: " + "; ".join(f"{a} -> {b} ({', '.join(edges[a, b])})" for a, b in inside))
    return found


def test_the_package_graph_has_no_cycle() -> None:
    """Packages form layers: no loop of any length between them (function-level imports included)."""
    assert package_cycles(_sources(*PACKAGES)) == []


def test_the_package_check_finds_a_loop_no_module_loop_shows(tmp_path, monkeypatch) -> None:
    """a.x -> b.y -> c -> a (its __init__): no module imports itself back, the packages a, b, c do."""
    for folder in ("a", "b"):
        (tmp_path / "embodyhpc" / folder).mkdir(parents=True)
        (tmp_path / "embodyhpc" / folder / "__init__.py").write_text("")
    (tmp_path / "embodyhpc" / "a" / "__init__.py").write_text("VALUE = 1\n")
    (tmp_path / "embodyhpc" / "a" / "x.py").write_text("def f():\n    from embodyhpc.b import y\n")
    (tmp_path / "embodyhpc" / "b" / "y.py").write_text("import embodyhpc.c\n")
    (tmp_path / "embodyhpc" / "c.py").write_text("from embodyhpc.a import VALUE\n")
    (tmp_path / "embodyhpc" / "d.py").write_text("import embodyhpc.c\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    modules = _sources("embodyhpc")
    assert [c for c in strongly_connected(import_graph(modules)) if len(c) > 1] == []
    assert package_cycles(modules) == [
        "['a', 'b', 'c']: a -> b (embodyhpc.a.x -> embodyhpc.b.y); b -> c (embodyhpc.b.y -> embodyhpc.c); "
        "c -> a (embodyhpc.c -> embodyhpc.a)"]


def test_only_the_validation_step_builds_a_recipe_without_the_registries() -> None:
    """config/load.py's merge_recipe and read_config_file skip the registries' checks: commands load recipes
    through embodyhpc/validation. One library reads an export's config.yaml itself, for the one section it uses,
    checked by the model's spec (read_config_file's check)."""
    unchecked = {"merge_recipe", "read_config_file"}
    users = {}
    for module, path in _sources(*PACKAGES, "tests", "bench", "tools").items():
        text = path.read_text()
        if not any(name in text for name in unchecked):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and _absolute(module, path, node) == "embodyhpc.config.load":
                names = unchecked & {alias.name for alias in node.names}
                if names and package_of(module) not in ("config", "validation"):
                    users[module] = sorted(names)
    assert users == {"embodyhpc.checkpoint.export": ["read_config_file"]}


SLURM_TOOLS = frozenset({"sbatch", "squeue", "sacct", "scancel", "scontrol", "sinfo", "srun", "sstat"})
RUNNERS = {"subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
           "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp", "execlpe",
                  "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe",
                  "posix_spawn", "posix_spawnp"},
           "asyncio": {"create_subprocess_exec", "create_subprocess_shell"}}
SLURM_LIBRARIES = ("submitit.slurm", "submitit.AutoExecutor", "submitit.SlurmExecutor")
_STARTS = re.compile(r"subprocess|submitit|\b(os|asyncio)\b")  # a module naming none of them starts no process


class _CommandFinder:
    """The strings a command line (argv list or shell string) is statically made of: literals, names bound in the
    same function or the module (assignments, +=, append/extend/insert, for loops), names imported from other modules
    of ours, the arguments the module's own calls of a wrapper function pass it."""

    def __init__(self, module: str, modules: dict[str, Path], finders: dict[str, _CommandFinder]) -> None:
        self.module, self.modules, self.finders = module, modules, finders
        self.tree = _tree(modules[module])
        self.bindings: dict[tuple[int, str], list[ast.AST]] = {}  # (id of the function or 0, name) -> values
        self.imported: dict[str, tuple[str, str]] = {}
        self.functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.scope: dict[int, ast.AST | None] = {}
        self._visit(self.tree, None)

    def _visit(self, node: ast.AST, scope: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            self.scope[id(child)] = scope
            self._bind(child, scope)
            self._visit(child, child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope)

    def _bind(self, node: ast.AST, scope: ast.AST | None) -> None:
        targets: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(node, ast.Assign):
            targets = [(t, node.value) for t in node.targets]
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            targets = [(node.target, node.value)]
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            targets = [(node.target, node.iter)]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[node.name] = node
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                self.imported[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name) and node.func.attr in ("append", "extend", "insert"):
            targets = [(node.func.value, arg) for arg in node.args]
        for target, value in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    self.bindings.setdefault((id(scope) if scope else 0, name.id), []).append(value)

    def strings(self, node: ast.AST, seen: set | None = None) -> set[str]:
        seen = set() if seen is None else seen
        found = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        for name in (n for n in ast.walk(node) if isinstance(n, ast.Name)):
            scope = self.scope.get(id(name))
            key = (self.module, id(scope) if scope else 0, name.id)
            if key in seen:
                continue
            seen.add(key)
            values = self.bindings.get((key[1], name.id)) or self.bindings.get((0, name.id), [])
            for value in values:
                found |= self.strings(value, seen)
            found |= self._parameter(name, scope, seen) | self._imported(name.id, seen)
        return found

    def _imported(self, name: str, seen: set) -> set[str]:
        source, attr = self.imported.get(name, ("", ""))
        if source not in self.modules or source == self.module:
            return set()
        if source not in self.finders:
            self.finders[source] = _CommandFinder(source, self.modules, self.finders)
        other = self.finders[source]
        return set().union(*(other.strings(value, seen) for value in other.bindings.get((0, attr), [])))

    def _parameter(self, name: ast.Name, function: ast.AST | None, seen: set) -> set[str]:
        """A parameter of the function the name is used in: what the module's own calls of it pass."""
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return set()
        params = [a.arg for a in (*function.args.posonlyargs, *function.args.args)]
        if name.id not in params and name.id not in [a.arg for a in function.args.kwonlyargs]:
            return set()
        found: set[str] = set()
        for call in (c for c in ast.walk(self.tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                     and c.func.id == function.name):
            position = params.index(name.id) if name.id in params else None
            args = [a for i, a in enumerate(call.args) if i == position]
            args += [k.value for k in call.keywords if k.arg == name.id]
            for arg in args:
                found |= self.strings(arg, seen)
        return found


def _runner(func: ast.AST, aliases: dict[str, str]) -> bool:
    """subprocess.run, sp.Popen (import subprocess as sp), check_output (from subprocess import ...), os.system..."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr in RUNNERS.get(aliases.get(func.value.id, ""), ())
    return isinstance(func, ast.Name) and func.id in aliases and "." in aliases[func.id] and \
        aliases[func.id].rpartition(".")[2] in RUNNERS.get(aliases[func.id].rpartition(".")[0], ())


def slurm_commands(modules: dict[str, Path]) -> list[str]:
    """`file:line runs <tool>` for each process start whose command names a Slurm tool, and each use of submitit's
    Slurm side, outside embodyhpc/slurm."""
    found: list[str] = []
    finders: dict[str, _CommandFinder] = {}
    for module, path in modules.items():
        if package_of(module) == "slurm" and module.startswith("embodyhpc.") or not _STARTS.search(path.read_text()):
            continue
        tree = _tree(path)
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module in RUNNERS:
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _runner(node.func, aliases):
                if module not in finders:
                    finders[module] = _CommandFinder(module, modules, finders)
                finder = finders[module]
                command = node.args[:1] + [k.value for k in node.keywords if k.arg in ("args", "command", "cmd")]
                texts = set().union(*(finder.strings(part) for part in command)) if command else set()
                words = {Path(word).name for text in texts for word in text.split()}
                found += [f"{rel}:{node.lineno} runs {tool}" for tool in sorted(words & SLURM_TOOLS)]
            named = ast.unparse(node) if isinstance(node, (ast.Attribute, ast.ImportFrom)) else ""
            if isinstance(node, ast.ImportFrom):
                named = ".".join(filter(None, [node.module, *[a.name for a in node.names][:1]]))
            if any(named == lib or named.startswith(lib + ".") for lib in SLURM_LIBRARIES):
                found.append(f"{rel}:{node.lineno} runs {named}")
    return sorted(found, key=lambda line: (line.split(":")[0], int(line.split(":")[1].split()[0]), line))


def test_only_slurm_runs_slurm_commands() -> None:
    assert slurm_commands(_sources(*PACKAGES)) == []


def test_the_slurm_command_check_finds_calls_through_names_lists_and_wrappers(tmp_path, monkeypatch) -> None:
    (tmp_path / "embodyhpc" / "slurm").mkdir(parents=True)
    (tmp_path / "embodyhpc" / "names.py").write_text('STATUS = ["squeue", "--me"]\n')
    (tmp_path / "embodyhpc" / "slurm" / "commands.py").write_text(
        'import subprocess\ndef f():\n    subprocess.run(["sbatch", "x.sh"])\n')  # its own package: allowed
    (tmp_path / "embodyhpc" / "job.py").write_text(
        "import os\nimport subprocess as sp\nfrom subprocess import check_output\n"
        "from embodyhpc.names import STATUS\nimport submitit\n"
        "SACCT = ['sacct', '-j']\n"
        "def fine():\n    sp.run(['git', 'rev-parse', 'HEAD'])\n"                   # 7: not Slurm
        "def by_name():\n    cmd = SACCT + ['1']\n    check_output(cmd)\n"        # 11
        "def shell(job):\n    os.system(f'scancel {job}')\n"                       # 13
        "def wrapped(argv):\n    return sp.run(argv, check=True)\n"                # 15
        "def through_wrapper():\n    wrapped(['srun', 'hostname'])\n"
        "def full_path():\n    sp.Popen(['/usr/bin/sbatch', 'x.sh'])\n"            # 19
        "def looped():\n    for tool in ('sinfo', 'sstat'):\n        sp.run([tool])\n"  # 22
        "def appended():\n    argv = ['timeout', '5']\n    argv.append('scontrol')\n    sp.call(argv)\n"  # 26
        "def imported():\n    sp.run([*STATUS])\n"                                 # 28
        "ex = submitit.AutoExecutor(folder='x')\n")                                 # 29
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert slurm_commands(_sources("embodyhpc")) == [
        "embodyhpc/job.py:11 runs sacct", "embodyhpc/job.py:13 runs scancel", "embodyhpc/job.py:15 runs srun",
        "embodyhpc/job.py:19 runs sbatch", "embodyhpc/job.py:22 runs sinfo", "embodyhpc/job.py:22 runs sstat",
        "embodyhpc/job.py:26 runs scontrol", "embodyhpc/job.py:28 runs squeue",
        "embodyhpc/job.py:29 runs submitit.AutoExecutor"]


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
# the same word as a run-directory name, meaning something else: run.json's `attempts` field (embodyhpc/runinfo.py)
FIELD_NAMES: set[tuple[str, str]] = {("embodyhpc/runinfo.py", "attempts")}


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
        for node in _code_strings(_tree(path)):
            for segment in node.value.split("/"):
                for owner, names in NAME_OWNERS.items():
                    if segment in names and rel != owner and (rel, segment) not in NOT_YET_MOVED | FIELD_NAMES:
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
