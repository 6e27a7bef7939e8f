"""Rules of the test suite itself: a missing project dependency fails under CI=true instead of hiding as a skip, and
on a machine with a GPU a missing GPU library fails the gpu-marked tests (tests/conftest.py's gpu policy).

Every test that needs an optional module goes through tests/helpers.py `require(module, extra)`; this file walks
tests/ with `ast` and refuses, anywhere else:
- `pytest.importorskip` (called or referenced), and skips taken inside `except ImportError`;
- a skip or xfail whose condition can be true because a library is missing: a `skipif`/`xfail` mark's condition,
  or the `if` tests (an `else` branch negated) around a `pytest.skip`/`xfail` call in a body. A condition is any
  boolean combination (and, or, not, nested, comparisons with None/False/True) of library probes: find_spec,
  functions and variables that import in a try, and named helpers built on them, in the test module or imported
  from the project (embodyhpc/, tests/); a helper whose truth cannot be told from its source counts as possibly
  "missing". Skipped when a library IS installed is fine (an error path that needs it absent);
- a skip whose condition is true without a GPU (torch.cuda.is_available(), device_count() < n) on a test not
  marked `gpu`: the marker is where the suite decides (tests/conftest.py skips gpu tests without a GPU and fails
  their skips with one);
- `require(<module>, "gpu")` at module level: it would skip the whole module at collection, before the gpu policy
  sees a test (require GPU libraries inside the gpu-marked test).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
HELPER = TESTS / "helpers.py"
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}
ABSENT, PRESENT, UNKNOWN = "absent", "present", "unknown"  # when a condition is true: library/device absent, ...
FLIP = {ABSENT: PRESENT, PRESENT: ABSENT, UNKNOWN: UNKNOWN}
SITES = re.compile(r"\b(skip\w*|xfail|importorskip|require)\b|\bexit\s*\(")
DEVICE_CALLS = {"is_available", "device_count", "is_bf16_supported", "get_device_capability"}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:  # bare `except:` catches ImportError too
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "") for t in types}
    return bool(names & (IMPORT_ERRORS | {"Exception", "BaseException"}))


def _imports(nodes: list[ast.stmt]) -> bool:
    """Whether statements import something (import, from-import, import_module, __import__, find_spec)."""
    return any(isinstance(n, ast.Import | ast.ImportFrom) or isinstance(n, ast.Call) and _called_name(n) in (
        "import_module", "__import__", "find_spec") for stmt in nodes for n in ast.walk(stmt))


def _import_tries(node: ast.AST):
    for inner in ast.walk(node):
        if isinstance(inner, ast.Try) and _imports(inner.body) and any(map(_catches_import_error, inner.handlers)):
            yield inner


def _uses_find_spec(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _called_name(n) == "find_spec" for n in ast.walk(node))


def _truthy_constant(node: ast.AST | None) -> bool | None:
    """True/False for a return value whose truth is known (None, constants, f-strings); None otherwise."""
    if node is None:
        return False
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, ast.JoinedStr):
        return True
    return None


def _flip(polarities: set) -> set:
    return {(kind, FLIP[pol]) for kind, pol in polarities}


def _is_device_call(node: ast.Call) -> bool:
    """torch.cuda.is_available(), torch.cuda.device_count(), torch.backends.<x>.is_available(), ..."""
    func = node.func
    if not isinstance(func, ast.Attribute) or func.attr not in DEVICE_CALLS:
        return False
    dotted = ast.unparse(func.value)
    return dotted.endswith("cuda") or dotted.startswith("torch.backends")


class _Module:
    """The probes of one source file, worked out on demand: probe(name) -> the set of (kind, polarity) the name's
    value (a variable, or a function's result) is true for; empty for a name that is no probe."""

    def __init__(self, tree: ast.Module) -> None:
        self.functions: dict[str, list[ast.FunctionDef]] = {}
        self.values: dict[str, list[ast.expr]] = {}  # name -> the expressions assigned to it
        self.try_names: dict[str, set] = {}  # names an import try sets: their polarity
        self.imported: dict[str, tuple[str, str]] = {}  # local name -> (module, name) from `from module import name`
        self.modules: dict[str, str] = {}  # local name -> module, from `import module [as name]`
        self._memo: dict[str, set] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.setdefault(node.name, []).append(node)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Name):
                        self.values.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.Try) and _imports(node.body) and any(map(_catches_import_error, node.handlers)):
                self._try_names(node)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = (node.module, alias.name)
                    self.modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    self.modules[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname \
                        else alias.name.split(".")[0]

    def _try_names(self, node: ast.Try) -> None:
        """Names an import try sets: true when the import worked, unless a handler sets them truthy."""
        for inner in ast.walk(ast.Module(body=node.body, type_ignores=[])):
            targets = inner.targets if isinstance(inner, ast.Assign) else []
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            if isinstance(inner, ast.Import | ast.ImportFrom):
                names = [alias.asname or alias.name.split(".")[0] for alias in inner.names]
            for name in names:
                self.try_names.setdefault(name, set()).add(("lib", PRESENT))
        for handler in (h for h in node.handlers if _catches_import_error(h)):
            for inner in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
                if isinstance(inner, ast.Assign):
                    truth = _truthy_constant(inner.value)
                    for target in (t for t in inner.targets if isinstance(t, ast.Name)):
                        self.try_names.setdefault(target.id, set()).add(
                            ("lib", ABSENT if truth else PRESENT if truth is False else UNKNOWN))

    def probe(self, name: str) -> set:
        if name not in self._memo:
            self._memo[name] = set()  # a recursive definition: no polarity from itself
            found = set(self.try_names.get(name, set()))
            for func in self.functions.get(name, []):
                found |= self._function_polarity(func)
            for value in self.values.get(name, []):
                found |= self.polarities(value)
            if name in self.imported and not found:
                module, original = self.imported[name]
                other = _project_module(module)
                found = other.probe(original) if other is not None else set()
            self._memo[name] = found
        return self._memo[name]

    def _function_polarity(self, func: ast.FunctionDef) -> set:
        """When the function's result is true: from its returns (a constant under an `if` takes the test's
        polarity; an import try's handler returning a falsy value makes the function true when present)."""
        found: set = set()
        tries = list(_import_tries(func))

        def visit(statements: list[ast.stmt], guards: set, in_handler: bool | None) -> None:
            for stmt in statements:
                if isinstance(stmt, ast.Return):
                    truth = _truthy_constant(stmt.value)
                    if in_handler is not None and truth is not None:
                        found.add(("lib", (ABSENT if truth else PRESENT) if in_handler else
                                   (PRESENT if truth else ABSENT)))
                    elif truth is None:
                        found.update(self.polarities(stmt.value) or (
                            {("lib", PRESENT)} if in_handler is False else set()))
                    elif guards:
                        found.update(guards if truth else _flip(guards))
                elif isinstance(stmt, ast.If):
                    test = self.polarities(stmt.test)
                    visit(stmt.body, guards | test, in_handler)
                    visit(stmt.orelse, guards | _flip(test), in_handler)
                elif isinstance(stmt, ast.Try):
                    is_import_try = any(stmt is t for t in tries)
                    visit(stmt.body, guards, False if is_import_try else in_handler)
                    for handler in stmt.handlers:
                        visit(handler.body, guards, True if is_import_try and _catches_import_error(handler)
                              else in_handler)
                    visit(stmt.orelse + stmt.finalbody, guards, in_handler)
                elif isinstance(stmt, ast.With | ast.For | ast.While):
                    visit(stmt.body, guards, in_handler)

        visit(func.body, set(), None)
        if tries and not found:
            found.add(("lib", PRESENT))  # an import try and a plain `return True` after it
        return found

    def polarities(self, node: ast.AST) -> set:
        """The (kind, polarity) pairs of the probes `node` is built on: when the condition can be true."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return _flip(self.polarities(node.operand))
        if isinstance(node, ast.NamedExpr):
            return self.polarities(node.value)
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, op, right = node.left, node.ops[0], node.comparators[0]
            on_left = self.polarities(left)
            inner = on_left | self.polarities(right)
            if not inner:
                return set()
            other = right if on_left else left
            truth = _truthy_constant(other) if isinstance(other, ast.Constant) else None
            if isinstance(op, ast.Is | ast.Eq) and truth is False or isinstance(op, ast.IsNot | ast.NotEq) \
                    and truth is True:
                return _flip(inner)
            if isinstance(op, ast.Is | ast.Eq) and truth is True or isinstance(op, ast.IsNot | ast.NotEq) \
                    and truth is False:
                return inner
            if isinstance(op, ast.Lt | ast.LtE) and other is right:
                return _flip(inner)  # device_count() < 2
            if isinstance(op, ast.Gt | ast.GtE) and other is right:
                return inner
            return {(kind, UNKNOWN) for kind, _ in inner}
        if isinstance(node, ast.Call):
            if _called_name(node) == "find_spec":
                return {("lib", PRESENT)}
            if _is_device_call(node):
                return {("device", PRESENT)}
            if isinstance(node.func, ast.Name) and self.probe(node.func.id):
                return self.probe(node.func.id)
            func = node.func
            if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in self.modules:
                other = _project_module(self.modules[func.value.id])
                if other is not None and other.probe(func.attr):
                    return other.probe(func.attr)
        if isinstance(node, ast.Name):
            return self.probe(node.id)
        return set().union(*(self.polarities(n) for n in ast.iter_child_nodes(node)))


_PARSED: dict[str, _Module | None] = {}


def _project_module(dotted: str) -> _Module | None:
    """The probes of a project module (embodyhpc.*, tests.*) named in an import; None for anything else, and for a
    module whose probes are being computed (an import cycle)."""
    if not dotted.startswith(("embodyhpc", "tests")):
        return None
    if dotted not in _PARSED:
        _PARSED[dotted] = None
        base = REPO.joinpath(*dotted.split("."))
        path = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        _PARSED[dotted] = _Module(ast.parse(path.read_text())) if path else None
    return _PARSED[dotted]


def _marked_gpu(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(d).replace("pytest.", "").startswith("mark.gpu") for d in decorators)


def _module_marked_gpu(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
               and "mark.gpu" in ast.unparse(n.value) for n in tree.body)


def _problem(polarities: set, gpu_marked: bool) -> str | None:
    if ("lib", ABSENT) in polarities or ("lib", UNKNOWN) in polarities:
        return "on a missing library (use tests.helpers.require; gpu tests fail on it where a GPU is)"
    if not gpu_marked and (("device", ABSENT) in polarities or ("device", UNKNOWN) in polarities):
        return "on a missing GPU without the gpu marker (mark the test pytest.mark.gpu instead)"
    return None


def import_skips(source: str, rel: str) -> list[str]:
    """Every skip the module doc refuses, as `rel:line: what (what to do)`."""
    if not SITES.search(source):
        return []  # each finding is at one of these names (parsing every file is most of the time)
    found = []
    tree = ast.parse(source)
    module = _Module(tree)
    module_gpu = _module_marked_gpu(tree)

    def conditional_skips(statements: list[ast.stmt], guards: set, gpu: bool) -> None:
        for stmt in statements:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                conditional_skips(stmt.body, set(), gpu or _marked_gpu(stmt.decorator_list))
                continue
            if isinstance(stmt, ast.If):
                test = module.polarities(stmt.test)
                conditional_skips(stmt.body, guards | test, gpu)
                conditional_skips(stmt.orelse, guards | _flip(test), gpu)
                continue
            for field in ("body", "orelse", "finalbody"):
                conditional_skips(getattr(stmt, field, []) or [], guards, gpu)
            for handler in getattr(stmt, "handlers", []):
                conditional_skips(handler.body, guards, gpu)
            calls = [n for n in ast.walk(stmt) if isinstance(n, ast.Call) and _called_name(n) in ("skip", "xfail")
                     and not isinstance(stmt, ast.If | ast.Try | ast.For | ast.While | ast.With)]
            for call in calls:
                why = _problem(guards, gpu)
                if why:
                    found.append(f"{rel}:{call.lineno}: skip {why}")

    conditional_skips(tree.body, set(), module_gpu)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            gpu = module_gpu or _marked_gpu(node.decorator_list)
            for decorator in node.decorator_list:
                for mark in ast.walk(decorator):
                    mark.gpu_marked = gpu  # type: ignore[attr-defined]
        if isinstance(node, ast.Call) and _called_name(node) in ("skipif", "xfail") and node.args \
                and not isinstance(node.args[0], ast.Constant):
            why = _problem(module.polarities(node.args[0]), getattr(node, "gpu_marked", module_gpu))
            if why:
                found.append(f"{rel}:{node.lineno}: {_called_name(node)} {why}")
        if isinstance(node, ast.Attribute | ast.Name) and (getattr(node, "attr", None) or getattr(node, "id", None)) \
                == "importorskip":
            found.append(f"{rel}:{node.lineno}: importorskip (use tests.helpers.require)")
        if isinstance(node, ast.Try):
            for handler in node.handlers:
                if not _catches_import_error(handler):
                    continue
                for inner in ast.walk(ast.Module(body=handler.body, type_ignores=[])):
                    if isinstance(inner, ast.Call) and _called_name(inner) in ("skip", "xfail", "exit"):
                        found.append(f"{rel}:{inner.lineno}: skip on an import error (use tests.helpers.require)")
    top_level = [n for stmt in tree.body if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                 for n in ast.walk(stmt)]
    for call in (n for n in top_level if isinstance(n, ast.Call) and _called_name(n) == "require"):
        extra = call.args[1] if len(call.args) > 1 else None
        if isinstance(extra, ast.Constant) and extra.value == "gpu":
            found.append(f"{rel}:{call.lineno}: require(..., 'gpu') at module level skips the module at "
                         "collection (require it inside the gpu-marked test)")
    return sorted(set(found), key=found.index)


def test_no_test_skips_on_an_import_error_outside_the_helper():
    files = [p for p in TESTS.rglob("*.py") if p != HELPER and "doubles" not in p.relative_to(TESTS).parts]
    assert len(files) > 50  # the walk really sees the suite
    problems = [hit for path in files for hit in import_skips(path.read_text(), str(path.relative_to(TESTS)))]
    assert problems == [], "\n".join(problems)


TE_AVAILABLE = ("import pytest, torch\ndef te_available():\n    try:\n        import transformer_engine\n"
                "    except ImportError:\n        return False\n    return True\n")


@pytest.mark.parametrize("source", [
    "import pytest\npytest.importorskip('metaworld')\n",
    "import pytest\nh5py = pytest.importorskip('h5py', reason='x')\n",
    "from pytest import importorskip\nimportorskip('torchao')\n",
    "import pytest\nskipper = pytest.importorskip\nskipper('gym_pusht')\n",
    "import pytest\ntry:\n    import h5py\nexcept ImportError:\n    pytest.skip('no h5py', allow_module_level=True)\n",
    "import pytest\ndef test_x():\n    try:\n        import mlflow\n    except ModuleNotFoundError as e:\n"
    "        pytest.skip(str(e))\n",
    "import pytest\ntry:\n    import h5py\nexcept (OSError, ImportError):\n    pytest.skip('x')\n",
    "import pytest\ntry:\n    import h5py\nexcept:\n    pytest.skip('x')\n",
    "import pytest\ntry:\n    import h5py\nexcept Exception:\n    pytest.xfail('x')\n",
    "from pytest import skip\ntry:\n    import h5py\nexcept ImportError:\n    if True:\n        skip('x')\n",
    "import importlib.util, pytest\n@pytest.mark.skipif(importlib.util.find_spec('h5py') is None, reason='x')\n"
    "def test_x():\n    pass\n",
    "import importlib.util, pytest\nHAVE = importlib.util.find_spec('h5py') is not None\n"
    "@pytest.mark.skipif(not HAVE, reason='x')\ndef test_x():\n    pass\n",
    "import pytest\ntry:\n    import h5py\n    HAVE_H5PY = True\nexcept ImportError:\n    HAVE_H5PY = False\n"
    "pytestmark = pytest.mark.skipif(not HAVE_H5PY, reason='x')\n",
    "import pytest\ndef has_mlflow():\n    try:\n        import mlflow\n    except ImportError:\n"
    "        return False\n    return True\n@pytest.mark.skipif(not has_mlflow(), reason='x')\ndef test_x():\n"
    "    pass\n",
    "import pytest\ntry:\n    import h5py\nexcept ImportError:\n    h5py = None\n"
    "@pytest.mark.skipif(h5py is None, reason='x')\ndef test_x():\n    pass\n",
    # boolean combinations, nested, of library and device probes (tests/models/test_fp8.py had the first)
    TE_AVAILABLE + "@pytest.mark.gpu\n@pytest.mark.skipif(not torch.cuda.is_available() or not te_available(), "
    "reason='x')\ndef test_x():\n    pass\n",
    TE_AVAILABLE + "@pytest.mark.skipif(torch.cuda.is_available() and not (te_available() and True), reason='x')\n"
    "def test_x():\n    pass\n",
    TE_AVAILABLE + "@pytest.mark.skipif(not any([te_available(), False]), reason='x')\ndef test_x():\n    pass\n",
    TE_AVAILABLE + "@pytest.mark.skipif(te_available() == False, reason='x')\ndef test_x():\n    pass\n",
    "import importlib.util, sys, pytest\n@pytest.mark.skipif(sys.platform == 'x' or "
    "importlib.util.find_spec('flash_attn') is None, reason='x')\ndef test_x():\n    pass\n",
    # a named helper built on a probe, in the module or imported from the project
    TE_AVAILABLE + "def ready():\n    return te_available() and torch.cuda.is_available()\n"
    "@pytest.mark.skipif(not ready(), reason='x')\ndef test_x():\n    pass\n",
    "import pytest\nfrom embodyhpc.models.attention import backend_unavailable_reason\n"
    "@pytest.mark.skipif(backend_unavailable_reason('flash_varlen', 'cuda') is not None, reason='x')\n"
    "def test_x():\n    pass\n",
    "import pytest\nfrom embodyhpc.models import attention\n"
    "@pytest.mark.skipif(bool(attention.backend_unavailable_reason('flash_varlen', 'cuda')), reason='x')\n"
    "def test_x():\n    pass\n",
    # skips and xfails in a body, under a condition on a library (an else branch counts negated)
    "import pytest\nfrom embodyhpc.models.attention import backend_unavailable_reason\n@pytest.mark.gpu\n"
    "def test_x():\n    if reason := backend_unavailable_reason('flash_varlen', 'cuda'):\n"
    "        pytest.skip(reason)\n",
    "import pytest\nfrom embodyhpc.models.attention import backend_unavailable_reason\n@pytest.mark.gpu\n"
    "def test_x():\n    reason = backend_unavailable_reason('flash_varlen', 'cuda')\n    if reason:\n"
    "        pytest.skip(reason)\n",
    TE_AVAILABLE + "def test_x():\n    if te_available():\n        pass\n    else:\n        pytest.skip('x')\n",
    "import importlib.util, pytest\nHAVE = importlib.util.find_spec('flash_attn')\ndef test_x():\n"
    "    if not HAVE:\n        pytest.xfail('x')\n",
    TE_AVAILABLE + "@pytest.mark.xfail(not te_available(), reason='x')\ndef test_x():\n    pass\n",
    TE_AVAILABLE + "@pytest.mark.parametrize('a', [pytest.param(1, marks=pytest.mark.skipif(not te_available(), "
    "reason='x'))])\ndef test_x(a):\n    pass\n",
    # a missing GPU skips a test the gpu marker does not name
    "import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_x():\n"
    "    pass\n",
    "import pytest, torch\n@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='x')\ndef test_x():\n"
    "    pass\n",
    "import pytest, torch\ndef test_x():\n    if not torch.cuda.is_available():\n        pytest.skip('x')\n",
    # a GPU library required at import: the whole module skips at collection
    "from tests.helpers import require\nrequire('transformer_engine.pytorch', 'gpu')\n",
])
def test_the_rule_catches_each_form_of_import_skip(source):
    assert import_skips(source, "tests/x.py"), source


@pytest.mark.parametrize("source", [
    "import pytest\n@pytest.mark.gpu\ndef test_x():\n    pytest.skip('backend unavailable')\n",
    "try:\n    import h5py\nexcept ImportError:\n    h5py = None\n",
    "from tests.helpers import require\nh5py = require('h5py', 'data')\n",
    # skipped when the optional package IS there (tests/models/test_fp8.py: the error path without it)
    "import pytest\ndef te_available():\n    try:\n        import transformer_engine\n    except ImportError:\n"
    "        return False\n    return True\n@pytest.mark.skipif(te_available(), reason='x')\ndef test_x():\n"
    "    pass\n",
    # a gpu-marked test: the gpu policy skips it without a GPU, the skipif only repeats it
    "import pytest, torch\n@pytest.mark.gpu\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\n"
    "def test_x():\n    pass\n",
    "import pytest, torch\npytestmark = [pytest.mark.gpu]\n@pytest.mark.skipif(torch.cuda.device_count() < 2, "
    "reason='x')\ndef test_x():\n    pass\n",
    # skipped when a GPU or a library IS there: a CPU-only path, an error path without the library
    "import pytest, torch\ndef test_x():\n    if torch.cuda.is_available():\n        pytest.skip('a GPU here')\n",
    "import pytest, torch\n@pytest.mark.skipif(torch.cuda.is_available(), reason='x')\ndef test_x():\n    pass\n",
    TE_AVAILABLE + "def test_x():\n    if not te_available():\n        pass\n    else:\n        pytest.skip('x')\n",
    # a GPU library required inside the test, where the gpu policy sees it; skips on other conditions
    "from tests.helpers import require\nimport pytest\n@pytest.mark.gpu\ndef test_x():\n"
    "    require('transformer_engine.pytorch', 'gpu')\n",
    "import pytest\ndef test_x(spec):\n    if spec.smoke is None:\n        pytest.skip('no smoke entry')\n",
    "import os, pytest\n@pytest.mark.skipif(os.geteuid() == 0, reason='root')\ndef test_x():\n    pass\n",
])
def test_the_rule_leaves_other_skips_alone(source):
    assert import_skips(source, "tests/x.py") == []
