"""The training run's export as an MLflow logged model: a pyfunc whose artifacts are the export folder.

    model = mlflow.pyfunc.load_model("models:/<model id>")       # needs embodyhpc installed (the class below)
    actions = model.predict({"observation.images.corner": images,  # [n, size, size, 3] uint8
                             "observation.environment_state": states,  # [n, state_dim] float32
                             "task": np.array(["reach"], dtype=object)})
    actions.shape == (n, model.action_horizon, action_dim)

At the end of a training job (rank 0, after the export and policy_io.json are written) `log_training_model` logs
it on the run's MLflow run as the logged model "policy", with a tensor signature from policy_io.json (the cameras,
their image size, the state key, the real action dims) and the recipe (model.action_horizon). Loading runs the
same code as an evaluation (embodyhpc.eval.trained.load_trained_policy: weights checked against export.json and
the recipe, fp32 on the CPU); predict samples one action chunk per observation row, with noise seeded 0 per row
(reproducible). A failure to log is a warning in the job log, never a failed training.
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlflow.pyfunc

MODEL_NAME = "policy"
EXPORT_ARTIFACT = "export"
IMAGE_PREFIX = "observation.images."
PROMPT_INPUT = "task"
ACTIONS_OUTPUT = "actions"


class PolicyModel(mlflow.pyfunc.PythonModel):
    """The exported policy behind MLflow's pyfunc interface (no state of its own: the weights are artifacts)."""

    def load_context(self, context):
        from embodyhpc.eval.trained import load_trained_policy

        self.policy = load_trained_policy(context.artifacts[EXPORT_ARTIFACT], execute_steps=1)

    def predict(self, context, model_input, params=None):
        import numpy as np

        columns = {key: np.asarray(value) for key, value in dict(model_input).items()}
        rows = {len(value) for value in columns.values()}
        if len(rows) != 1:
            raise ValueError(f"every input needs the same number of rows (observations), got {sorted(rows)}")
        n = rows.pop()
        observations = [{key: (str(value[i]) if key == PROMPT_INPUT else value[i]) for key, value in columns.items()}
                        for i in range(n)]
        for env in range(n):
            self.policy.reset(observations[env].get(PROMPT_INPUT, ""), 0, env=env)
        return np.stack(self.policy.predict_chunks(observations, list(range(n)))).astype(np.float32)


def io_spec(export_dir: Path) -> tuple[list, list]:
    """(inputs, outputs) of the signature, as embodyhpc.tracking.logged_model.TensorDesc lists."""
    from embodyhpc.checkpoint.integrity import CONFIG_FILE
    from embodyhpc.rundir import read_policy_io
    from embodyhpc.validation import load_config_file

    config = load_config_file(export_dir / CONFIG_FILE)
    io = read_policy_io(export_dir)
    size = io.get("image_size") or -1
    inputs = [(f"{IMAGE_PREFIX}{camera}", "uint8", (-1, size, size, 3)) for camera in io.get("cameras") or []]
    inputs.append((io.get("state_key") or config.model.state_key, "float32", (-1, -1)))
    inputs.append((PROMPT_INPUT, "str", (-1,)))
    action_dim = io.get("action_dim") or config.model.action_dim
    return inputs, [(ACTIONS_OUTPUT, "float32", (-1, config.model.action_horizon, action_dim))]


def log_training_model(uri: str, run_id: str, export_dir: str | Path, step: int = 0) -> str | None:
    """Log the export (of training step `step`) as the run's logged model, the run's output at that step; its id,
    or None (with a warning) when that failed."""
    from embodyhpc.tracking.logged_model import EXPORT_TAG, log_pyfunc_model

    export_dir = Path(export_dir)
    try:
        inputs, outputs = io_spec(export_dir)
        model_id = log_pyfunc_model(uri, run_id, name=MODEL_NAME, python_model=PolicyModel(),
                                    artifacts={EXPORT_ARTIFACT: str(export_dir)}, inputs=inputs, outputs=outputs,
                                    requirements=["embodyhpc"], tags={EXPORT_TAG: str(export_dir)}, step=step)
    except Exception as exc:  # noqa: BLE001 - the model record is a convenience; the export on disk is the result
        print(f"train: warning: the export {export_dir} was not logged as an MLflow model of run {run_id}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None
    print(f"train: logged model {model_id} ({MODEL_NAME}) on MLflow run {run_id}", flush=True)
    return model_id
