"""Reference policies by name: the one registry that eval.reference_policies (validate and the evaluation array) and
`embodyhpc data synth --policy` read.

    register_reference_policy("zero", "mysite.policies:ZeroPolicy")   # factory(suite) -> Policy, "module:attr" ok
    policies = make_reference_policies(["expert", "random"], suite)   # those the suite can provide, in order

"expert" needs a suite with a scripted expert (`suite.has_expert`): suites without one leave that row out.
"replay" needs a suite given a dataset (`suite.replay_dataset`, LIBERO's eval.suite_options.replay_dataset): it
replays the dataset's actions as a check of the env conventions (eval/replay.py).
Importing this module imports no simulator and no numpy (validate reads the names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from embodyhpc.plugins import import_name

if TYPE_CHECKING:
    from embodyhpc.eval.policies import Policy
    from embodyhpc.eval.suites import Suite


@dataclass(frozen=True)
class ReferencePolicy:
    factory: str | Callable[[Any], Any]
    """(suite) -> Policy, or "module:attr" naming it (imported on first use)."""
    needs_expert: bool = False
    """Only for suites with a scripted expert."""
    needs_replay_dataset: bool = False
    """Only for suites given a dataset to replay (eval.suite_options.replay_dataset: eval/replay.py)."""


_REGISTRY: dict[str, ReferencePolicy] = {
    "expert": ReferencePolicy("embodyhpc.eval.policies:ExpertPolicy", needs_expert=True),
    "random": ReferencePolicy("embodyhpc.eval.policies:RandomPolicy"),
    "replay": ReferencePolicy("embodyhpc.eval.replay:ReplayPolicy", needs_replay_dataset=True),
}


def register_reference_policy(name: str, factory: str | Callable[[Any], Any], *, needs_expert: bool = False) -> None:
    _REGISTRY[name] = ReferencePolicy(factory, needs_expert)


def reference_policy_names() -> list[str]:
    return list(_REGISTRY)


def provides(name: str, suite: Suite) -> bool:
    """Whether `suite` can run the reference policy `name` (the expert only where the suite has one, the replay only
    where it was given a dataset)."""
    entry = _entry(name)
    if entry.needs_replay_dataset and not getattr(suite, "replay_dataset", None):
        return False
    return not entry.needs_expert or bool(suite.has_expert)


def make_reference_policy(name: str, suite: Suite) -> Policy:
    entry = _entry(name)
    if not provides(name, suite):
        raise ValueError(f"the {suite.name} suite has no scripted expert" if entry.needs_expert else
                         f"the {suite.name} suite was given no dataset to replay (eval.suite_options.replay_dataset)")
    factory = entry.factory
    return (import_name(factory) if isinstance(factory, str) else factory)(suite)


def make_reference_policies(names: Sequence[str], suite: Suite) -> dict[str, Policy]:
    """{name: policy} for the names the suite can provide, in the given order."""
    return {name: make_reference_policy(name, suite) for name in names if provides(name, suite)}


def _entry(name: str) -> ReferencePolicy:
    if name not in _REGISTRY:
        raise ValueError(f"unknown reference policy {name!r}; registered: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]
