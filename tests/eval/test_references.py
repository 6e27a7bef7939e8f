"""Reference policies through one registry: validate, the evaluation array and `data synth` read the same names."""

from __future__ import annotations

import json

import pytest

from embodyhpc.errors import ConfigError
from embodyhpc.eval import references, suites
from embodyhpc.eval.policies import RandomPolicy
from embodyhpc.validation import load_recipe
from tests.eval.fake_suite import ConstantPolicy, LineSuite

pytestmark = pytest.mark.sim  # steps a simulator


class ClosingLineSuite(LineSuite):
    """The line suite as the evaluation array uses suites (`with make_suite(...) as suite`)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@pytest.fixture
def registries(monkeypatch):
    """Registrations made by a test end with it."""
    monkeypatch.setattr(references, "_REGISTRY", dict(references._REGISTRY))
    monkeypatch.setattr(suites, "_REGISTRY", dict(suites._REGISTRY))


def test_the_shipped_names_and_a_suite_without_expert(registries):
    assert references.reference_policy_names() == ["expert", "random", "replay"]
    made = references.make_reference_policies(["expert", "random", "replay"], LineSuite(["a"]))
    # no expert in the line suite, and no dataset to replay
    assert list(made) == ["random"] and isinstance(made["random"], RandomPolicy)
    with pytest.raises(ValueError, match="the line suite has no scripted expert"):
        references.make_reference_policy("expert", LineSuite(["a"]))
    with pytest.raises(ValueError, match="the line suite was given no dataset to replay"):
        references.make_reference_policy("replay", LineSuite(["a"]))
    with pytest.raises(ValueError, match="unknown reference policy 'zero'; registered: expert, random, replay"):
        references.make_reference_policy("zero", LineSuite(["a"]))


def test_validate_reads_the_registry(registries):
    with pytest.raises(ConfigError, match=r"eval.reference_policies"):
        load_recipe("smoke_cpu", ["eval.reference_policies=[zero]"])
    with pytest.raises(ConfigError, match=r"eval.reference_policies.*none is given.*replay_dataset"):
        load_recipe("smoke_cpu", ["eval.reference_policies=[random,replay]"])
    references.register_reference_policy("zero", lambda suite: ConstantPolicy(0.0))
    assert load_recipe("smoke_cpu", ["eval.reference_policies=[zero,random]"]).config.eval.reference_policies == [
        "zero", "random"]


def test_an_evaluation_shard_runs_a_registered_reference_policy(registries, tmp_path):
    """The evaluation array's dispatch (launch/eval.py) goes through the registry: a policy registered there gets
    its row, in the recipe's order, without any code naming it."""
    from embodyhpc.launch.eval import eval_shard_task, shard_file
    from embodyhpc.orchestrate.api import start_run
    from embodyhpc.rundir import make_run_dir

    suites.register_suite("line", ClosingLineSuite)
    references.register_reference_policy("forward", lambda suite: ConstantPolicy(1.0))
    loaded = load_recipe("smoke_cpu", ["eval.suite=line", "eval.tasks=[a]", "eval.shards=1",
                                       "eval.reference_policies=[forward,expert,random]", "eval.videos_per_task=0",
                                       f"job.runs_root={tmp_path}"])
    run = tmp_path / "run"
    assert make_run_dir(run)
    start_run(loaded, run, backend="local", python="/venv/bin/python", mlflow_run_id=None)
    result = eval_shard_task(str(run), 0)
    assert list(result["policies"]) == ["forward", "random"]  # the line suite has no expert
    records = [json.loads(line) for line in shard_file(run, "forward", 0).read_text().splitlines()]
    assert records and all(r["policy"] == "forward" for r in records)
    assert any(r["success"] for r in records)  # always forward reaches the goal from the nearer starts
