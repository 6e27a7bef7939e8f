"""What the rest of embodyhpc may call on a model and its batches: the contract a model plug-in implements.

Who calls what:
- the training loop (train/loop.py): `model(batch)` -> an output with `.loss` (a scalar tensor; backward is the
  loop's), `model.train()`, `parameters()`; batches come from the spec's collate and only need `.to(device)`;
- embodyhpc/parallel: `fsdp_units()` (the blocks to shard one by one: parallel/ never guesses them), `init_rules()`
  (how each parameter is filled after a meta-device build: embodyhpc/models/init.py), and optionally
  `fsdp_forward_methods()` (methods besides forward that run the sharded model, e.g. sampling);
- the checkpointer and exports: `state_dict()` / `load_state_dict()` (plain nn.Module);
- evaluation: the spec's `inference` class wraps the model and implements EvalPolicy;
- `embodyhpc smoke`: the spec's `smoke` object implements SmokeModel.
- `embodyhpc export --format lerobot`: the spec's `lerobot_export` implements LeRobotExporter.
- reinforcement learning (embodyhpc/rl, Flow-SDE): `flow_velocity_fn(batch)` and `flow_velocities(batch, x, t)`
  (FlowPolicy below), in rl's time convention whatever the family's own; the inference class's
  `observation_batch(observations)` rebuilds the batch a stored observation was acted on with.

Every torch.nn.Module that adds fsdp_units, init_rules and init_weights satisfies TrainablePolicy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from pathlib import Path

    import numpy as np
    import torch
    from torch import nn

    from embodyhpc.models.init import Rule


@runtime_checkable
class Batch(Protocol):
    def to(self, device: torch.device | str) -> Batch: ...


class Output(Protocol):
    loss: torch.Tensor


@runtime_checkable
class TrainablePolicy(Protocol):
    def __call__(self, batch: Any) -> Output: ...

    def fsdp_units(self) -> list[nn.Module]: ...

    def init_rules(self, fqn: str, module: nn.Module) -> Mapping[str, Rule]: ...

    def init_weights(self, seed: int | None = None) -> None: ...

    def train(self, mode: bool = True) -> Any: ...

    def parameters(self, recurse: bool = True) -> Any: ...

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


@runtime_checkable
class FlowPolicy(Protocol):
    """What RL (embodyhpc/rl/flow_sde.py) calls on a flow-matching model, in ONE time convention for every family:
    t in [0, 1], t = 1 pure noise, t = 0 the action, v = dx/dt (a family with another convention converts inside).
    Plain torch, gradients flow (the caller disables them for rollouts)."""

    def flow_velocity_fn(self, batch: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """v(x [N, H, A], t [N] float64) -> [N, H, A]; the batch's prefix (images, text, state) is encoded once, in
        this call, and reused by every call of the returned function. Unsharded models only (rollout workers)."""
        ...

    def flow_velocities(self, batch: Any, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """[N, K, H, A]: the velocities of the K denoising inputs x [N, K, H, A] at times t [K] in one call, equal to
        flow_velocity_fn step by step; listed by fsdp_forward_methods() so a sharded actor can differentiate it."""
        ...


@runtime_checkable
class EvalPolicy(Protocol):
    """What embodyhpc/eval runs: the spec's inference class, built by eval/trained.py with the loaded model."""

    step: int | None

    def reset(self, task: str, seed: int) -> None: ...

    def act(self, obs: Mapping[str, Any]) -> np.ndarray: ...


class SmokeModel(Protocol):
    """What `embodyhpc smoke` (train/smoke.py) trains of a model: built from `config(...)` with the spec's `build`,
    then `steps` times micro_batch_step(model, batch, precision, noise=noise, time=flow_time) on one fixed batch
    (so the loss must fall). Its module imports no torch at load (--size is checked with `sizes` first)."""

    sizes: tuple[str, ...]
    """The model.size values smoke trains (small enough for tens of steps on one GPU)."""
    other_sizes: str
    """Why the model's other sizes are not smoked: the --size error says it."""

    def config(self, size: str, attention_backend: str) -> Any:
        """The config.schema.ModelConfig smoke builds at `size` with `attention_backend`."""
        ...

    def fixed_batch(self, model_cfg: Any, rank: int) -> tuple[Any, torch.Tensor, torch.Tensor, int]:
        """(a packed batch with `.to(device)`, its noise, its flow times, the tokens it puts through the model),
        seeded by `rank`: the same every call."""
        ...


class LeRobotExporter(Protocol):
    """What `embodyhpc export --format lerobot` (checkpoint/lerobot_export.py) calls once the export is verified: it
    writes the family's LeRobot policy folder at `out_dir` (creating it) from the export's weights `state`, the
    model its recipe builds (`model`, on the meta device), the recipe's `model` section, the dataset's features
    (policy_io.json as a dict, {} without one) and the state statistics training used (data.normalize.
    StateNormalizer, or None). What LeRobot's layout cannot hold is refused (errors.UserError, one line) before
    anything is written; the command copies the tokenizer training read beside it afterwards."""

    def __call__(self, out_dir: Path, state: dict[str, torch.Tensor], model: nn.Module, model_cfg: Any, *,
                 policy_io: dict[str, Any], normalizer: Any, execute_steps: int) -> None: ...
