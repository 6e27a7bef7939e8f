"""Rules of the test suite itself: a missing project dependency fails under CI=true instead of hiding as a skip.

Every test that needs an optional module goes through tests/helpers.py `require(module, extra)`; this file walks
tests/ with `ast` and refuses `pytest.importorskip` and skips taken inside `except ImportError` anywhere else.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped

from tests.helpers import ci_extras, project_extras, require

TESTS = Path(__file__).resolve().parent
HELPER = TESTS / "helpers.py"
IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError"}


def _called_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:  # bare `except:` catches ImportError too
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    names = {t.attr if isinstance(t, ast.Attribute) else getattr(t, "id", "") for t in types}
    return bool(names & (IMPORT_ERRORS | {"Exception", "BaseException"}))


def _import_probes(tree: ast.Module) -> set[str]:
    """Names that say whether a module imports: functions or variables set inside a try that catches ImportError,
    and variables assigned from importlib's find_spec."""
    probes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                isinstance(inner, ast.Try) and any(map(_catches_import_error, inner.handlers))
                for inner in ast.walk(node)):
            probes.add(node.name)
        if isinstance(node, ast.Try) and any(map(_catches_import_error, node.handlers)):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Assign):
                    probes |= {target.id for target in inner.targets if isinstance(target, ast.Name)}
        if isinstance(node, ast.Assign) and _uses_find_spec(node.value):
            probes |= {target.id for target in node.targets if isinstance(target, ast.Name)}
    return probes


def _uses_find_spec(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and _called_name(n) == "find_spec" for n in ast.walk(node))


def _skips_when_missing(condition: ast.AST, probes: set[str]) -> bool:
    """A skipif condition true when a module is missing: `not <probe>`, `<probe> is None`, find_spec(...) is None."""
    if _uses_find_spec(condition):
        return True
    if isinstance(condition, ast.UnaryOp) and isinstance(condition.op, ast.Not):
        operand = condition.operand.func if isinstance(condition.operand, ast.Call) else condition.operand
        return isinstance(operand, ast.Name) and operand.id in probes
    if isinstance(condition, ast.Compare) and isinstance(condition.left, ast.Name) and condition.left.id in probes:
        return any(isinstance(c, ast.Constant) and c.value in (None, False) for c in condition.comparators)
    return False


def import_skips(source: str, rel: str) -> list[str]:
    """`importorskip` anywhere (called or referenced), skip calls inside handlers that catch ImportError, and
    `skipif` conditions that are true when a module is missing."""
    found = []
    tree = ast.parse(source)
    probes = _import_probes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _called_name(node) == "skipif" and node.args \
                and _skips_when_missing(node.args[0], probes):
            found.append(f"{rel}:{node.lineno}: skipif on a missing module (use tests.helpers.require)")
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
    return found


def test_no_test_skips_on_an_import_error_outside_the_helper():
    files = [p for p in TESTS.rglob("*.py") if p != HELPER and "doubles" not in p.relative_to(TESTS).parts]
    assert len(files) > 50  # the walk really sees the suite
    problems = [hit for path in files for hit in import_skips(path.read_text(), str(path.relative_to(TESTS)))]
    assert problems == [], "\n".join(problems)


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
    "import pytest, torch\n@pytest.mark.skipif(not torch.cuda.is_available(), reason='x')\ndef test_x():\n"
    "    pass\n",
])
def test_the_rule_leaves_other_skips_alone(source):
    assert import_skips(source, "tests/x.py") == []


MISSING = "embodyhpc_no_such_module_for_tests"


def test_require_returns_the_module_when_installed(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require("json", "train").dumps([1]) == "[1]"


def test_require_skips_loudly_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Skipped, match=f"MISSING DEPENDENCY '{MISSING}'.*pip install -e '.\\[sim\\]'"):
        require(MISSING, "sim")


@pytest.mark.parametrize("extra", sorted(ci_extras()))
def test_require_fails_under_ci_for_every_extra_ci_installs(monkeypatch, extra):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match=f"MISSING DEPENDENCY '{MISSING}'.*CI installs the \\[{extra}\\] extra"):
        require(MISSING, extra)


def test_require_fails_under_ci_when_the_module_is_broken(monkeypatch, tmp_path):
    """An installed module whose import raises (a CUDA-only wheel on CPU, a missing shared library) counts as
    missing: CI fails on it too."""
    (tmp_path / "broken_dep_for_tests.py").write_text("raise ImportError('libnvrtc.so.13: cannot open')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match="libnvrtc"):
        require("broken_dep_for_tests", "data")


def test_require_skips_under_ci_for_an_extra_ci_does_not_install(monkeypatch):
    not_in_ci = sorted(project_extras() - ci_extras())
    assert not_in_ci == ["gpu"]  # nvidia-ml-py and transformer-engine: no GPU in CI
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Skipped, match=MISSING):
        require(MISSING, "gpu")


def test_require_refuses_an_extra_pyproject_does_not_declare(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Failed, match="pyproject.toml has no extra 'simulators'"):
        require("json", "simulators")


def test_ci_extras_are_those_make_setup_installs():
    assert {"train", "data", "fp8", "sim", "track"} <= ci_extras() <= project_extras()
