"""Simulator suites for evaluation: one interface over MetaWorld, PushT, LIBERO and whatever a site adds.

    from embodyhpc.eval.suites import make_suite

    with make_suite("metaworld", ["MT10"], cameras=["corner"], image_size=64) as suite:
        env = suite.make_env("reach-v3", seed=100, episode=3)   # the same triple, the same initial state
        obs = env.reset()           # {"observation.state", "observation.environment_state",
                                    #  "observation.images.corner", "task"}
        obs, reward, success, done = env.step(action)
        env.close()                 # hands the simulator back to the suite for the next episode

Observations are keyed and typed like the LeRobot demo datasets (embodyhpc.sim.metaworld), so a policy
trained on those reads them as they are: vectors float32, images uint8 (H, W, 3), "task" the instruction.

An episode is the triple (task, seed, episode) of embodyhpc.eval.shards.Episode and maps to one initial state on
every machine. MetaWorld: goal variant `episode % 50` of `MT1(task, seed + episode // 50)`, exactly the demo
generator's `make_env(task, seed, variant)`, so evaluating with a seed the demos were not generated with gives
held-out goal variants. PushT: `reset(seed=episode_seed(task, seed, episode))`. LIBERO: the task's fixed initial
state `episode % 50` (suite_libero.py).

Suites shipped: "metaworld" (50 v3 tasks; "MT10" and "MT50" expand; scripted experts), "pusht" (gym-pusht, task
"pusht"; no expert) and "libero" (`<benchmark>/<index>` tasks, a benchmark name expands; no expert). Simulators are
imported only when a suite is made.

Adding a simulator (a site's own)
---------------------------------
Write a class with the `Suite` members below whose `make_env` returns an `EvalEnv`, and a factory
`factory(tasks, *, cameras, image_size, **options) -> Suite` (a class whose __init__ takes them). Its keyword-only
options are what `eval.suite_options` may set (suite_option_names); a `task_names` attribute (the names, or a
callable returning them) lets `validate` refuse an unknown task before anything runs (suite_task_names). Declare it
as a package entry point, which evaluation jobs, `validate` and `make_suite` find without any import on your side
(tests/plugins/walk_suite is one, added from its folder alone):

    [project.entry-points."embodyhpc.eval_suites"]
    mysim = "mysite.mysim_suite:MySimSuite"

In one process (a test, a notebook), `register_suite` does the same without a package:

    from embodyhpc.eval.suites import register_suite
    register_suite("mysim", "mysite.mysim_suite:MySimSuite")   # "module:attr" (imported on first use) or a callable

Keep observation keys the ones your training dataset uses, make `make_env(task, seed, episode)` a pure function
of its arguments (the evaluation is sharded over machines and must not depend on which shard ran an episode),
report success from the simulator's own criterion, and set `has_expert = False` unless you ship a scripted policy
(`expert_policy(task)`), in which case reports get an expert reference row.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from embodyhpc.plugins import entry_points, import_name

if TYPE_CHECKING:  # numpy loads with a suite or a rollout: validate and render read names only
    import numpy as np

ENTRY_POINT_GROUP = "embodyhpc.eval_suites"

Obs = dict[str, Any]


@runtime_checkable
class EvalEnv(Protocol):
    """One episode's simulator: `reset()` puts it in the episode's initial state."""

    task: str
    seed: int
    episode: int
    action_dim: int
    fps: int
    """Control steps per simulated second (video frame rate)."""

    def reset(self) -> Obs: ...

    def step(self, action: np.ndarray) -> tuple[Obs, float, bool, bool]:
        """(observation, reward, success at this step, done: the simulator cannot go on)."""
        ...

    def render(self) -> np.ndarray:
        """A uint8 (H, W, 3) frame of the current state for videos (the suite's video camera)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Suite(Protocol):
    name: str
    tasks: list[str]
    """The expanded task names, in order."""
    cameras: tuple[str, ...]
    has_expert: bool

    def instruction(self, task: str) -> str: ...

    def max_steps(self, task: str) -> int: ...

    def action_bounds(self, task: str) -> tuple[np.ndarray, np.ndarray]: ...

    def features(self, task: str) -> dict[str, dict[str, Any]]:
        """{observation key: {"dtype", "shape"}} of what `reset`/`step` return ("task" excluded)."""
        ...

    def make_env(self, task: str, seed: int, episode: int) -> EvalEnv: ...

    def expert_policy(self, task: str) -> Callable[[Obs], np.ndarray]:
        """The task's scripted expert as a function obs -> action (only where has_expert)."""
        ...

    def close(self) -> None: ...


SuiteFactory = Callable[..., Suite]
_REGISTRY: dict[str, SuiteFactory | str] = {
    "metaworld": "embodyhpc.eval.suite_metaworld:MetaWorldSuite",
    "pusht": "embodyhpc.eval.suite_pusht:PushTSuite",
    "libero": "embodyhpc.eval.suite_libero:LiberoSuite",
}


def register_suite(name: str, factory: SuiteFactory | str, *, replace: bool = False) -> None:
    """Make `make_suite(name, ...)` build a suite with `factory` ("module:attr" is imported on first use)."""
    if name in _REGISTRY and not replace:
        raise ValueError(f"an evaluation suite named {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = factory


def available_suites() -> list[str]:
    """Registered suite names and those declared as entry points (nothing is imported)."""
    return sorted(set(_REGISTRY) | set(entry_points(ENTRY_POINT_GROUP)))


def _resolve(name: str) -> SuiteFactory:
    factory = _REGISTRY.get(name)
    if factory is None:
        entry = entry_points(ENTRY_POINT_GROUP).get(name)
        if entry is None:
            raise ValueError(f"unknown evaluation suite {name!r}; available: {', '.join(available_suites())} "
                             f"(sites add theirs with register_suite or a {ENTRY_POINT_GROUP!r} entry point)")
        return entry.load()
    if isinstance(factory, str):
        factory = _REGISTRY[name] = import_name(factory)
    return factory


_SHARED_OPTIONS = {"self", "tasks", "cameras", "image_size"}


def suite_factory(name: str) -> SuiteFactory:
    """What `make_suite(name, ...)` calls (imported on first use): a class or function that a worker process can
    be handed by name (embodyhpc.eval.vector)."""
    return _resolve(name)


def suite_option_names(name: str) -> list[str]:
    """The suite-specific keyword options `make_suite(name, ...)` takes (eval.suite_options), from its signature.

    A "module:attr" registration not imported yet is read from its source (`ast`): validating a recipe then loads no
    simulator and no numpy. Anything else (entry points, callables, a class without its own __init__) is imported.
    """
    import inspect

    registered = _REGISTRY.get(name)
    if isinstance(registered, str):
        names = _keyword_options_in_source(registered)
        if names is not None:
            return names
    factory = _resolve(name)
    target = factory.__init__ if inspect.isclass(factory) else factory
    return [p.name for p in inspect.signature(target).parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.name not in _SHARED_OPTIONS]


def _keyword_options_in_source(target: str) -> list[str] | None:
    module, _, attr = target.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read(), spec.origin)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == attr:
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            if init is None:
                return None
            return [a.arg for a in init.args.kwonlyargs if a.arg not in _SHARED_OPTIONS]
        if isinstance(node, ast.FunctionDef) and node.name == attr:
            return [a.arg for a in node.args.kwonlyargs if a.arg not in _SHARED_OPTIONS]
    return None


def suite_task_names(name: str) -> list[str] | None:
    """The task names a registered suite accepts, when its factory lists them (a `task_names` attribute: a sequence
    of names, or a callable returning one), so that `validate` refuses an unknown task before anything runs; None
    when it does not say."""
    names = getattr(_resolve(name), "task_names", None)
    if callable(names):
        names = names()
    return None if names is None else [str(n) for n in names]


def make_suite(name: str, tasks: Sequence[str], *, cameras: Sequence[str] = (), image_size: int = 64,
               **options: Any) -> Suite:
    """The suite `name` over `tasks` (suite-specific names or groups such as "MT10").

    cameras: rendered into every observation as "observation.images.<camera>" (uint8, image_size square).
    options: suite-specific (e.g. video_camera, video_size).
    """
    if isinstance(tasks, str):
        tasks = [tasks]
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    return _resolve(name)(list(tasks), cameras=tuple(cameras), image_size=image_size, **options)


def episode_seed(task: str, seed: int, episode: int) -> int:
    """A 32-bit seed that depends on (task, seed, episode) only: for simulators and stochastic policies."""
    import numpy as np

    if seed < 0 or episode < 0:
        raise ValueError(f"seed and episode must be >= 0, got seed={seed}, episode={episode}")
    return int(np.random.SeedSequence([zlib.crc32(task.encode()), seed, episode]).generate_state(1)[0])


def check_action(action: Any, action_dim: int) -> np.ndarray:
    import numpy as np

    array = np.asarray(action, dtype=np.float32).reshape(-1)
    if array.shape != (action_dim,):
        raise ValueError(f"expected an action of {action_dim} values, got shape {np.shape(action)}")
    if not np.all(np.isfinite(array)):
        raise ValueError(f"action has non-finite values: {array}")
    return array


__all__ = ["ENTRY_POINT_GROUP", "EvalEnv", "Suite", "available_suites", "check_action", "episode_seed",
           "make_suite", "register_suite", "suite_factory", "suite_option_names", "suite_task_names"]
