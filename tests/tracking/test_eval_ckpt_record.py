"""`eval --ckpt` is an evaluation record of its own, and the training run shows its result at a glance, read back
from a real sqlite store. Inputs are written by hand (test_eval_logging.results): every expected number is one the
test chose or computed from Wilson's formula, never one the code under test produced."""

from __future__ import annotations

from embodyhpc.tracking import mlflow_run as mr
from embodyhpc.tracking.evaluation import eval_params, log_evaluation, settings_hash
from tests.tracking.test_eval_logging import EVAL, TASKS, history, results, wilson

SUBMIT_TEXT = "**pi05 (tiny)** on MetaWorld demos"


def evaluate(uri: str, run_id: str, step: int, successes: tuple[int, int], *, adhoc: bool = False,
             weights: str | None = None) -> str:
    params = eval_params(EVAL, step=step, weights=weights or f"/runs/x/exports/step-{step}", tasks=TASKS)
    return log_evaluation(uri, run_id, step=step, results=results(successes), params=params, outcome="complete",
                          why="all shards reported", summary=None, artifacts=[], start_ms=None, end_ms=None,
                          adhoc=adhoc)


def interval(k: int, n: int) -> str:
    low, high = wilson(k, n)
    return f"{k / n:.2f} [{low:.2f}, {high:.2f}]"


def test_an_adhoc_evaluation_leaves_the_curve_and_the_result_and_is_found(sqlite_uri):
    run_id = mr.create_run(sqlite_uri, experiment="adhoc", run_name="train", status="RUNNING",
                           description=SUBMIT_TEXT)
    evaluate(sqlite_uri, run_id, 200, (1, 1))
    evaluate(sqlite_uri, run_id, 400, (3, 4))
    before = mr.find_run(sqlite_uri, run_id)
    curve = {key: history(sqlite_uri, run_id, key) for key in before["metrics"]}
    weights = "/runs/x/exports/step-400"
    adhoc = evaluate(sqlite_uri, run_id, 400, (5, 5), adhoc=True, weights=weights)  # 10/10 at the same step

    after = mr.find_run(sqlite_uri, run_id)
    assert {key: history(sqlite_uri, run_id, key) for key in after["metrics"]} == curve  # no point added
    assert curve["eval/trained/success_rate"] == [(200, 0.2), (400, 0.7)]
    for tag in ("success", "mlflow.note.content"):
        assert after["tags"][tag] == before["tags"][tag], tag  # the result is still training's own
    assert after["tags"]["success"] == f"{interval(7, 10)} (7/10)"

    child = mr.find_run(sqlite_uri, adhoc)
    assert child["parent_run_id"] == run_id  # nested under the training run
    same = settings_hash(eval_params(EVAL, step=400, weights=weights, tasks=TASKS))  # the curve's settings too
    assert child["name"] == f"ckpt-eval step 400 5ep x2 tasks {same}"  # what and how much, by name
    assert child["tags"]["embodyhpc.evaluation"] == "ad-hoc"
    assert mr.latest_metrics(sqlite_uri, adhoc)["eval/trained/success_rate"] == 1.0
    # from the training run: a tag naming the evaluation; from the weights: a search by the tag the child carries
    [(key, value)] = [(k, v) for k, v in after["tags"].items() if k.startswith("embodyhpc.eval_ckpt/")]
    assert key.startswith("embodyhpc.eval_ckpt/step-400/") and value.startswith("1.00 [0.72, 1.00] (10/10)")
    assert adhoc in value and weights in value
    found = mr.client(sqlite_uri).search_runs([after["experiment_id"]],
                                              filter_string=f"tags.`embodyhpc.weights` = '{weights}'")
    assert {r.info.run_id: r.data.tags["embodyhpc.evaluation"] for r in found}[adhoc] == "ad-hoc"


def test_the_training_run_states_its_result_at_a_glance(sqlite_uri):
    """The description's table (every task and all tasks, trained vs references, k/n and interval) above what
    submit wrote, the `success` tag and `success_rate`, following the newest step evaluated: a late evaluation of an
    earlier step leaves them alone."""
    run_id = mr.create_run(sqlite_uri, experiment="glance", run_name="train", status="RUNNING",
                           description=SUBMIT_TEXT)
    evaluate(sqlite_uri, run_id, 200, (1, 2))
    evaluate(sqlite_uri, run_id, 600, (4, 5))
    evaluate(sqlite_uri, run_id, 400, (0, 0))  # ends last, an earlier step
    tags = mr.find_run(sqlite_uri, run_id)["tags"]
    assert tags["success"] == f"{interval(9, 10)} (9/10)"
    description = tags["mlflow.note.content"]
    lines = description.splitlines()
    assert lines[0] == "### Result at step 600" and description.count("### Result") == 1
    assert lines[2] == "| task | trained | expert | random |"
    # per task, the interval the (hand-written) results carry: [0.00, 0.60] for the trained rows, [0.00, 0.50] random
    assert "| reach-v3 | 0.80 [0.00, 0.60] 4/5 | n/a 0/0 (of 5 planned) | 0.00 [0.00, 0.50] 0/5 |" in lines
    low, high = wilson(0, 10)
    assert (f"| **all tasks** | **{interval(9, 10)} 9/10** | **n/a 0/0 (of 10 planned)** | "
            f"**0.00 [{low:.2f}, {high:.2f}] 0/10** |") in lines
    assert description.endswith("\n\n" + SUBMIT_TEXT)  # what submit wrote stays, once
    assert history(sqlite_uri, run_id, "success_rate") == [(200, 0.3), (400, 0.0), (600, 0.9)]
    assert history(sqlite_uri, run_id, "eval/reach-v3/success_rate") == [(200, 0.2), (400, 0.0), (600, 0.8)]
