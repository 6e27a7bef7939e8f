"""The result at a glance on the training run: a markdown table in its description (MLflow renders it on the run
page), a `success` tag and a `success_rate` metric, kept current after each evaluation on the run's curve.

    ### Result at step 600
    | task | trained | expert | random |
    |---|---|---|---|
    | reach-v3 | 0.80 [0.38, 0.96] 4/5 | 1.00 [0.57, 1.00] 5/5 | 0.00 [0.00, 0.43] 0/5 |
    | **all tasks** | ... | ... | ... |
    _Success rate [Wilson 95% interval] successes/episodes; updated after each evaluation (details: its run)._

    tag success = "0.90 [0.70, 0.97] (18/20)"   metric success_rate = 0.90 at step 600

The block sits at the top of the description, above what `submit` wrote there (which is kept); the evaluation of
the newest step wins (an evaluation of an earlier step that ends later leaves it alone).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embodyhpc.tracking.mlflow_values import MAX_TAG_VALUE_LENGTH, truncate

TRAINED = "trained"
HEADING = "### Result at step "
FOOTER = ("_Success rate [Wilson 95% interval] successes/episodes; updated after each evaluation (details: its "
          "evaluation run)._")
SUCCESS_TAG = "success"
SUCCESS_METRIC = "success_rate"
STEP_TAG = "embodyhpc.result_step"


def cell(stats: Mapping[str, Any]) -> str:
    """ "0.80 [0.38, 0.96] 4/5"; "n/a 0/5" when nothing was recorded."""
    count = f"{stats.get('successes', 0)}/{stats['recorded']}"
    if stats.get("success_rate") is None:
        return f"n/a {count} (of {stats['planned']} planned)"
    missing = stats["planned"] - stats["recorded"]
    return (f"{stats['success_rate']:.2f} [{stats['ci_low']:.2f}, {stats['ci_high']:.2f}] {count}"
            + (f" ({missing} missing)" if missing else ""))


def success_summary(results: Mapping[str, Any]) -> str | None:
    """The trained policy's overall result: "0.90 [0.70, 0.97] (18/20)"; None without one."""
    trained = results.get("policies", {}).get(TRAINED)
    if not trained or trained["overall"].get("success_rate") is None:
        return None
    o = trained["overall"]
    return f"{o['success_rate']:.2f} [{o['ci_low']:.2f}, {o['ci_high']:.2f}] ({o.get('successes', 0)}/{o['recorded']})"


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def result_table(results: Mapping[str, Any], step: int) -> str:
    """The markdown block: one row per task and one for all tasks, one column per policy (trained first)."""
    policies = results.get("policies", {})
    names = sorted(policies, key=lambda name: (name != TRAINED, name))
    tasks: list[str] = []
    for name in names:
        tasks += [task for task in policies[name]["tasks"] if task not in tasks]
    lines = [f"{HEADING}{step}", "", "| task | " + " | ".join(_escape(n) for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for task in tasks:
        row = [cell(policies[n]["tasks"][task]) if task in policies[n]["tasks"] else "" for n in names]
        lines.append(f"| {_escape(task)} | " + " | ".join(row) + " |")
    lines.append("| **all tasks** | " + " | ".join(f"**{cell(policies[n]['overall'])}**" for n in names) + " |")
    return "\n".join([*lines, "", FOOTER])


def with_result(description: str | None, block: str) -> str:
    """`description` with its result block (if any) replaced by `block`, at the top."""
    rest = description or ""
    if rest.startswith(HEADING) and FOOTER in rest:
        rest = rest.split(FOOTER, 1)[1].lstrip("\n")
    return truncate(f"{block}\n\n{rest}".rstrip("\n"), MAX_TAG_VALUE_LENGTH)


def update_training_run(mlflow_client: Any, run_id: str, results: Mapping[str, Any], step: int) -> bool:
    """Put the result of the evaluation of `step` at a glance on the training run (module doc), unless an
    evaluation of a later step is shown already. Returns whether it was."""
    from embodyhpc.tracking.mlflow_run import DESCRIPTION_TAG

    summary = success_summary(results)
    if summary is None:
        return False
    tags = mlflow_client.get_run(run_id).data.tags
    shown = tags.get(STEP_TAG)
    if shown is not None and shown.lstrip("-").isdigit() and int(shown) > step:
        return False
    mlflow_client.set_tag(run_id, DESCRIPTION_TAG, with_result(tags.get(DESCRIPTION_TAG), result_table(results, step)))
    mlflow_client.set_tag(run_id, SUCCESS_TAG, summary)
    mlflow_client.set_tag(run_id, STEP_TAG, str(step))
    return True
