"""A trained policy as an MLflow logged model of its training run (MLflow 3: a LoggedModel entity linked to the run,
its files under the model's artifacts), with a tensor signature.

    log_pyfunc_model(uri, run_id, name="policy", python_model=PolicyModel(), artifacts={"export": "<run>/export"},
                     inputs=[("observation.images.top", "uint8", (-1, 224, 224, 3)), ("task", "str", (-1,))],
                     outputs=[("actions", "float32", (-1, 50, 7))], requirements=["embodyhpc"])

The python model is pickled by reference: its class lives in an importable package (embodyhpc.launch.policy_model),
so loading the model needs that package installed, and the weights travel as the model's artifacts, not in the
pickle. The tracking URI is set for the call only (the job process may log elsewhere afterwards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


def log_pyfunc_model(uri: str, run_id: str, *, name: str, python_model: Any, artifacts: Mapping[str, str],
                     inputs: Sequence[TensorDesc], outputs: Sequence[TensorDesc], requirements: Sequence[str],
                     tags: Mapping[str, str] | None = None) -> str:
    """Log `python_model` (an mlflow.pyfunc.PythonModel) with `artifacts` on run `run_id` of `uri`; the model's id.
    The run's status is left as it is (no run is started or ended here)."""
    import mlflow
    import mlflow.pyfunc
    from mlflow.models import Model
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri  # set for this call, then put back

    from embodyhpc.tracking.mlflow_run import CLI_HTTP_ENV, bounded_http, init_store

    init_store(uri)
    # Model.log with run_id logs into that run without starting or ending it (pyfunc.log_model would need an
    # active run, whose end would change the training run's status); an unreachable server costs seconds, not
    # MLflow's default minutes of retries, at the end of a job
    with bounded_http(CLI_HTTP_ENV), _use_tracking_uri(uri):
        info = Model.log(artifact_path=None, name=name, flavor=mlflow.pyfunc, run_id=run_id,
                         python_model=python_model, artifacts=dict(artifacts),
                         signature=tensor_signature(inputs, outputs), pip_requirements=list(requirements),
                         tags=dict(tags or {}))
    return info.model_id
