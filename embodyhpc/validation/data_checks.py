"""A training recipe against its dataset, checked where the recipe is resolved (validate, render, submit, resume):
what would otherwise fail in a DataLoader worker after the job waited in the queue.

From the recipe alone (any dataset): an action chunk is asked for (data.delta_timestamps.action), with exactly
model.action_horizon offsets. With the dataset visible from this machine (its metadata only, embodyhpc/data/facts.py):
- every data.delta_timestamps key is a feature of the dataset, every offset a whole number of frames at its fps;
- model.state_key is a feature of the dataset;
- the action chunk fits in an episode: an offset as long as the longest episode leaves no sample a whole chunk (an
  error: the horizon cannot be served), one as long as the shortest leaves those episodes none (a warning);
- the model's own fit (its spec's check_dataset): prompt budget against the state and the longest task, state and
  action widths.
The warm-up against train.steps is config/limits.py's (it needs no dataset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from embodyhpc.errors import ConfigError, UserError

ACTION_KEY = "action"  # the feature every policy learns to predict, as a chunk (train/loop.py reads the same)

Where = Callable[[str], "str | None"]


def _layer(where: Where, key: str) -> str | None:
    """The layer that set `key` or, for a mapping set as a whole or in parts, any of its entries."""
    found = where(key)
    if found is None and key == "data.delta_timestamps":
        found = where(f"{key}.{ACTION_KEY}")
    return found


def check_recipe_data(cfg: Any, where: Where, *, dataset_visible: bool, facts: Any = None,
                      model_facts: Any = None) -> list[str]:
    """Errors (ConfigError naming the key and the layer that set it) and warnings for a policy-training recipe;
    nothing for the synthetic stand-in. `dataset_visible`: data.root exists on this machine (validation/paths.py).
    `facts`: data.root's, when the caller read them; `model_facts`: what the model's own fit is given instead (a
    mixture's entry: validation/mixture_checks.py EntryFacts)."""
    if cfg.data.format == "synthetic" or not cfg.data.root:
        return []
    _check_action_chunk(cfg, where)
    if not dataset_visible:
        return []
    from embodyhpc.data.facts import dataset_facts

    try:
        facts = facts if facts is not None else dataset_facts(cfg.data.root)
    except UserError as exc:  # a DatasetError: the file and what is wrong with it
        raise ConfigError(exc.one_line(), key="data.root", where=where("data.root")) from None
    _check_delta_timestamps(cfg, facts, where)
    _check_episode_span(cfg, facts, where)
    warnings = _episode_warnings(cfg, facts)
    if cfg.model.state_key not in facts.features:
        vectors = [k for k, shape in facts.features.items() if len(shape) == 1 and not k.startswith("observation.im")]
        raise ConfigError(f"the dataset has no {cfg.model.state_key!r} (its vector features: {', '.join(vectors)})",
                          key="model.state_key", where=where("model.state_key"),
                          fix="name a vector feature of the dataset")
    return warnings + _model_fit(cfg, model_facts if model_facts is not None else facts, where)


def _action_offsets_fix(horizon: int, fps: float | None) -> str:
    if fps:
        return f"set data.delta_timestamps.action to {[round(i / fps, 6) for i in range(horizon)]}"
    return f"set data.delta_timestamps.action to {horizon} offsets, [i / fps for i in range({horizon})]"


def _check_action_chunk(cfg: Any, where: Where) -> None:
    horizon = cfg.model.action_horizon
    offsets = cfg.data.delta_timestamps.get(ACTION_KEY)
    if offsets is None:
        raise ConfigError(f"no action chunk requested: the model predicts {horizon} steps (model.action_horizon)",
                          key="data.delta_timestamps", related=("model.action_horizon",),
                          where=_layer(where, "data.delta_timestamps"), fix=_action_offsets_fix(horizon, None))
    if len(offsets) != horizon:
        raise ConfigError(f"asks for an action chunk of {len(offsets)} steps, the model predicts {horizon} "
                          f"(model.action_horizon={horizon}): every micro-batch would fail",
                          key="data.delta_timestamps.action", related=("model.action_horizon",),
                          where=_layer(where, "data.delta_timestamps.action"), fix=_action_offsets_fix(horizon, None))


def _check_delta_timestamps(cfg: Any, facts: Any, where: Where) -> None:
    from embodyhpc.data.delta import DEFAULT_TOLERANCE_S, delta_steps

    try:
        delta_steps(cfg.data.delta_timestamps, facts.features, facts.fps, DEFAULT_TOLERANCE_S)
    except UserError as exc:  # unknown feature, or an offset off the frame grid; exc.key names the feature
        if exc.key not in facts.features:
            fix = "name features of the dataset (listed above), or remove the key"
        elif exc.key == ACTION_KEY:
            fix = _action_offsets_fix(cfg.model.action_horizon, facts.fps)
        else:
            fix = f"use multiples of 1/fps = {1 / facts.fps:g} s"
        key = f"data.delta_timestamps.{exc.key}"
        raise ConfigError(f"{exc.message} (dataset at {facts.fps:g} fps)", key=key,
                          where=where(key) or _layer(where, "data.delta_timestamps"), fix=fix) from None


def _action_frames(cfg: Any, facts: Any) -> tuple[int, int]:
    """(the furthest frame ahead, the furthest behind) the action chunk reads, in frames."""
    steps = [round(offset * facts.fps) for offset in cfg.data.delta_timestamps[ACTION_KEY]]
    return max(max(steps), 0), max(-min(steps), 0)


def _check_episode_span(cfg: Any, facts: Any, where: Where) -> None:
    ahead, behind = _action_frames(cfg, facts)
    span = max(ahead, behind)
    if facts.longest_episode and span >= facts.longest_episode:
        horizon = cfg.model.action_horizon
        raise ConfigError(f"the action chunk reaches {span} frames from its sample, and the longest episode of the "
                          f"dataset has {facts.longest_episode} frames: no sample has a whole chunk, every one is "
                          f"padding past the episode's edge (model.action_horizon={horizon})",
                          key="data.delta_timestamps.action", related=("model.action_horizon",),
                          where=_layer(where, "data.delta_timestamps.action"),
                          fix=f"ask for a chunk within {facts.longest_episode - 1} frames of its sample (model."
                              "action_horizon and data.delta_timestamps.action)")


def _episode_warnings(cfg: Any, facts: Any) -> list[str]:
    ahead, behind = _action_frames(cfg, facts)
    span = max(ahead, behind)
    if facts.shortest_episode and span >= facts.shortest_episode:
        return [f"model.action_horizon={cfg.model.action_horizon}: the action chunk reaches {span} frames and the "
                f"shortest episode has {facts.shortest_episode}: its samples never get a whole chunk (the rest is "
                "padding, masked out of the loss)"]
    return []


def _model_fit(cfg: Any, facts: Any, where: Where) -> list[str]:
    """The model plug-in's own check against the dataset (ModelSpec.check_dataset), its errors named by layer."""
    from embodyhpc.models.spec import model_spec

    spec = model_spec(cfg.model.name)
    if spec.check_dataset is None:
        return []
    try:
        return list(spec.load("check_dataset")(cfg.model, facts))
    except ImportError as exc:  # the model's libraries are not installed here (a login node without torch)
        return [f"model {cfg.model.name}: not checked against the dataset here ({exc}); the job checks it"]
    except ConfigError as exc:
        if exc.key == "model.tokenizer_path":  # reported by validation/paths.py (unset, or carried by init weights)
            return []
        if exc.where is not None or exc.key is None:
            raise
        raise ConfigError(exc.message, key=exc.key, related=exc.related, where=where(exc.key), fix=exc.fix) from None
