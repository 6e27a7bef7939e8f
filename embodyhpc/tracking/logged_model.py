"""A trained policy as an MLflow logged model of its training run (MLflow 3: a LoggedModel entity linked to the run,
its files under the model's artifacts), with a tensor signature.

The model is created in the training run's experiment (`create_logged_model(experiment_id=...)`; MLflow's own
`Model.log(run_id=...)` without an active run puts it in the Default experiment) and is the run's output (the run
page's "Logged models"). No metric is copied from the run at logging time (MLflow would link the run's step-0
metrics: system metrics, not results); an evaluation of the export links its own (`link_metrics`, with the
evaluation as the dataset), so the model page shows success.

    log_pyfunc_model(uri, run_id, name="policy", python_model=PolicyModel(), artifacts={"export": "<run>/export"},
                     inputs=[("observation.images.top", "uint8", (-1, 224, 224, 3)), ("task", "str", (-1,))],
                     outputs=[("actions", "float32", (-1, 50, 7))], requirements=["embodyhpc"])

The python model is pickled by reference: its class lives in an importable package (embodyhpc.launch.policy_model),
so loading the model needs that package installed, and the weights travel as the model's artifacts, not in the
pickle. The tracking URI is set for the call only (the job process may log elsewhere afterwards).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

TensorDesc = tuple[str, str, tuple[int, ...]]
"""(name, numpy dtype name, shape with -1 for a free dimension)."""


def tensor_signature(inputs: Sequence[TensorDesc], outputs: Sequence[TensorDesc]) -> Any:
    """An mlflow.models.ModelSignature of named tensors (numpy dtype names; "str" for text, as object arrays)."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    def schema(descs: Sequence[TensorDesc]) -> Schema:
        return Schema([TensorSpec(np.dtype(object if dtype == "str" else dtype), tuple(shape), name=name)
                       for name, dtype, shape in descs])

    return ModelSignature(inputs=schema(inputs), outputs=schema(outputs))


@contextlib.contextmanager
def quiet_model_logging() -> Iterator[None]:
    """What MLflow prints while it logs a pyfunc model, off for that call only: its UserWarnings (no input example,
    no type hints, cloudpickle), its INFO/WARNING log lines, the artifacts' download/upload progress bars."""
    import logging
    import warnings

    from embodyhpc.environ import patched_environ

    logger = logging.getLogger("mlflow")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), patched_environ({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
            warnings.filterwarnings("ignore", category=UserWarning, module=r"mlflow(\.|$)")
            yield
    finally:
        logger.setLevel(level)


def log_pyfunc_model(uri: str, run_id: str, *, name: str, python_model: Any, artifacts: Mapping[str, str],
                     inputs: Sequence[TensorDesc], outputs: Sequence[TensorDesc], requirements: Sequence[str],
                     tags: Mapping[str, str] | None = None, step: int = 0) -> str:
    """Log `python_model` (an mlflow.pyfunc.PythonModel) with `artifacts` as a model of run `run_id` of `uri`, in
    that run's experiment, the run's output at `step`; the model's id. The run's status is left as it is (no run is
    started or ended here)."""
    import mlflow
    import mlflow.pyfunc
    from mlflow.entities import LoggedModelOutput
    from mlflow.models import Model
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri  # set for this call, then put back

    from embodyhpc.tracking.mlflow_run import CLI_HTTP_ENV, bounded_http, client, init_store

    init_store(uri)
    # an unreachable server costs seconds, not MLflow's default minutes of retries, at the end of a job
    with bounded_http(CLI_HTTP_ENV), _use_tracking_uri(uri):
        mlflow_client = client(uri)
        run = mlflow_client.get_run(run_id)
        model = mlflow_client.create_logged_model(
            experiment_id=run.info.experiment_id, name=name, source_run_id=run_id, model_type="policy",
            tags={key: str(value) for key, value in (tags or {}).items()}, params=dict(run.data.params))
        # Model.log with the model made above and no run: it writes the files into that model, starts and ends no
        # run (the training run's status stays) and copies none of the run's metrics to the model
        with quiet_model_logging():  # the job's log is read with `embodyhpc logs`: no advice, no progress bar
            info = Model.log(artifact_path=None, name=name, flavor=mlflow.pyfunc, model_id=model.model_id,
                             python_model=python_model, artifacts=dict(artifacts),
                             signature=tensor_signature(inputs, outputs), pip_requirements=list(requirements))
        mlflow_client.log_outputs(run_id, [LoggedModelOutput(model.model_id, step=step)])
    return info.model_id


EXPORT_TAG = "embodyhpc.export"
"""The export folder a logged model was made from (what an evaluation of that folder looks the model up by)."""


def find_logged_model(mlflow_client: Any, experiment_id: str, source_run_id: str, export: str) -> str | None:
    """The id of the newest logged model of run `source_run_id` made from the export folder `export`, or None."""
    found = mlflow_client.search_logged_models(
        experiment_ids=[experiment_id], filter_string=f"source_run_id = '{source_run_id}'",
        order_by=[{"field_name": "creation_time", "ascending": False}])
    def same(tagged: str | None) -> bool:  # the same folder, however the two processes spelled it
        return tagged is not None and os.path.realpath(tagged) == os.path.realpath(export)

    return next((m.model_id for m in found if same((m.tags or {}).get(EXPORT_TAG))), None)
