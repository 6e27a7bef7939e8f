"""What a model plug-in is: a folder (a Python package) plus a ModelSpec, found by `model.name`.

    # mymodels/act/__init__.py: torch-free; the heavy parts are named "module:attr" and imported on first use
    SPEC = ModelSpec(name="act", options=ActOptions, build="mymodels.act.model:build",
                     collate="mymodels.act.model:Collate", token_count="mymodels.act.model:tokens",
                     inference="mymodels.act.model:ActRunner")
    register_model(SPEC)                                            # in-process, or as a package entry point:
    # [project.entry-points."embodyhpc.models"]  act = "mymodels.act:SPEC"

Who calls what (the typed side is embodyhpc/models/protocol.py):
- `validate` (embodyhpc/validation, through `check_model_config` below): the name against `available_models()` (no
  model is imported: entry points are read from package metadata), the model's own options (model.options.*)
  against `spec.options`, a dataclass whose `__post_init__` checks its invariants, built with the recipe's own type
  rules; then the spec's `check`, model.size against its `sizes`, and the family keys of the model section
  (config/schema.py MODEL_FAMILY_KEYS) it does not declare in `keys`, refused when set.
- the training loop: `build` on the meta device, `tokenizer`, `collate` (DataLoader items -> a batch), `token_count`
  and `token_budget` (metrics), `weights` for model.init_weights (the key rules of published checkpoints; the
  sliced, per-rank read is embodyhpc/checkpoint/sliced_weights.py, since models/ never imports torch.distributed);
- embodyhpc/parallel: the built model's `fsdp_units()` and `init_rules()` (the model declares, parallel/ applies);
- the checkpointer and exports: the model's state_dict; `check_fits` builds the model on meta to compare shapes;
- evaluation (eval/trained.py): `inference`, a class built from the loaded model that acts in a suite;
- `embodyhpc smoke` (train/smoke.py): `smoke`, the model config and fixed batch it trains on every GPU path.
- `embodyhpc export --format lerobot` (checkpoint/lerobot_export.py): `lerobot_export`, the family's LeRobot folder.

pi0.5's options stay where existing recipes put them (model.size, model.state_input, ... directly under `model`):
those family keys are read by the families that declare them; a new plug-in's own options live under
`model.options` and its spec's `options` dataclass refuses unknown keys and wrong types with the same one-line
errors as every other key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embodyhpc.config import checks
from embodyhpc.config.schema import MODEL_FAMILY_KEYS
from embodyhpc.errors import ConfigError
from embodyhpc.plugins import entry_points, import_name

ENTRY_POINT_GROUP = "embodyhpc.models"


@dataclass(frozen=True)
class ModelSpec:
    """A model plug-in. Callables are "module:attr" strings (imported on first use: validating a recipe imports no
    torch) or the objects themselves."""

    name: str
    """`model.name` of recipes that select it."""
    build: Any
    """(model_cfg, precision_cfg) -> nn.Module following models/protocol.TrainablePolicy; called under
    torch.device("meta") by the loop, so parameters must be created by the constructor and filled by init_rules."""
    collate: Any
    """(model_cfg, tokenizer, normalizer) -> a picklable callable: list of dataset items -> a batch with `.to(device)`
    (LeRobot-style items: observation.images.*, the state at model.state_key, an action chunk, task)."""
    token_count: Any
    """(batch, model_cfg) -> int: the tokens (or samples, for a model without tokens) behind tokens_per_s."""
    inference: Any
    """A class, (model, config, *, normalizer, execute_steps, denoise_steps, num_action_dims) -> an evaluation policy
    (eval/policies.py: reset(task, seed), act(obs) -> action)."""
    options: type | None = None
    """A dataclass of the model's own options (model.options.*), checked in its __post_init__ at validate."""
    sizes: tuple[str, ...] = ()
    """The values model.size takes for this family, e.g. ("tiny", "full"); (): the family has one shape and reads
    no model.size (then refused unless left at its default)."""
    keys: tuple[str, ...] = ()
    """The family keys of the model section (config/schema.py MODEL_FAMILY_KEYS, size aside: `sizes` declares it)
    this family reads, e.g. ("attention_backend", "max_token_len"); their values are checked by `check`. Any other
    family key set away from its default is refused at validate, naming the key."""
    tokenizer: Any = None
    """model_cfg -> tokenizer, or None for a model that reads no text."""
    token_budget: Any = None
    """(batch, model_cfg) -> int: the token room of a packed batch (packing_efficiency); None: never packs."""
    tokenizer_file: tuple[tuple[str, tuple[str, str]], ...] = ()
    """(size, (what that size needs, an example path)) for sizes that read model.tokenizer_path: validate and render
    warn while it is unset, submit refuses."""
    check: Any = None
    """(model_cfg) -> None, run at validate after the options and before the sizes and keys: the model's own checks
    of the values of the keys it reads (its keys', limits on action_horizon, ...), raising one-line ConfigErrors;
    it must not import torch."""
    check_dataset: Any = None
    """(model_cfg, facts) -> warnings, run at validate when the training dataset is visible from the submitting
    machine (facts: embodyhpc/data/facts.py DatasetFacts, from metadata only): what the model's collate would refuse
    in a DataLoader worker hours later (a prompt budget the state and cameras do not fit, a state wider than the
    model reads), raised now as one-line ConfigErrors; warnings for what it would quietly cut."""
    weights: Any = None
    """A published-weights adapter (checkpoint/sliced_weights.WeightsAdapter) for model.init_weights from a
    published checkpoint; None: model.init_weights reads embodyhpc exports only."""
    smoke: Any = None
    """What `embodyhpc smoke` trains (models/protocol.SmokeModel): the sizes it smokes, the model config at a size
    and a fixed packed batch per rank; None: the model has no smoke (the command refuses it). Its module must not
    import torch at load: the command checks --size with it before anything heavy."""
    lerobot_export: Any = None
    """The family's LeRobot exporter (`embodyhpc export --format lerobot`, checkpoint/lerobot_export.py verifies the
    export and calls it; models/protocol.LeRobotExporter): writes LeRobot's policy folder of this family, refusing
    in one line, before writing anything, what that layout cannot hold; None: the command refuses the family."""

    def load(self, field: str) -> Any:
        """The callable named by `field`, imported on first use."""
        target = getattr(self, field)
        return import_name(target) if isinstance(target, str) else target

    def parse_options(self, options: Mapping[str, Any]) -> Any:
        """model.options as the spec's dataclass (None without one); one-line ConfigError for a wrong key or type."""
        from embodyhpc.config.coerce import build, field_types

        if self.options is None:
            if options:
                raise ConfigError(f"the {self.name} model takes no options", key=f"model.options.{next(iter(options))}",
                                  fix="remove model.options")
            return None
        allowed = field_types(self.options)
        for key in options:
            if key not in allowed:
                raise ConfigError(f"the {self.name} model has no option {key!r}", key=f"model.options.{key}",
                                  fix=f"use one of: {', '.join(allowed)}")
        try:
            return build(self.options, dict(options), "model.options.")
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(str(exc).splitlines()[0], key="model.options") from None


def check_model_config(model_cfg: Any) -> ModelSpec:
    """The model section against its family's spec (the part of validate that needs the registry): the name, the
    options, the spec's own check, the size among its sizes, no family key it does not read. Returns the spec."""
    import dataclasses

    spec = model_spec(model_cfg.name)
    spec.parse_options(model_cfg.options)
    if spec.check is not None:
        spec.load("check")(model_cfg)
    defaults = {f.name: f.default for f in dataclasses.fields(model_cfg)}
    if spec.sizes:
        checks.choice("model.size", model_cfg.size, spec.sizes)
    unread = [key for key in MODEL_FAMILY_KEYS
              if not (bool(spec.sizes) if key == "size" else key in spec.keys)
              and getattr(model_cfg, key) != defaults[key]]
    if unread:  # every one at once: a recipe written for another family usually sets several
        resets = " ".join(f"model.{key}={_as_override(defaults[key])}" for key in unread)
        also = "" if len(unread) == 1 else f", nor {', '.join('model.' + key for key in unread[1:])}"
        raise ConfigError(f"the {spec.name} model does not read it{also} (its own options go under model.options)",
                          key=f"model.{unread[0]}",
                          fix=f"remove {'it' if len(unread) == 1 else 'them'} from the recipe, or override back to "
                              f"the defaults: {resets}")
    return spec


def _as_override(value: Any) -> str:
    """A default as a key=value override writes it (YAML: null, true/false)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


# the shipped models, each in its folder
_REGISTRY: dict[str, ModelSpec | str] = {"pi05": "embodyhpc.models.pi05:SPEC", "groot": "embodyhpc.models.groot:SPEC"}


def register_model(spec: ModelSpec) -> None:
    """Make `model.name: <spec.name>` select `spec` in this process (entry points reach job processes too)."""
    _REGISTRY[spec.name] = spec


def available_models() -> list[str]:
    """Registered model names and those declared as entry points (nothing is imported)."""
    return sorted(set(_REGISTRY) | set(entry_points(ENTRY_POINT_GROUP)))


def model_spec(name: str) -> ModelSpec:
    """The spec of `model.name`; a one-line ConfigError naming the registered models for an unknown one."""
    spec = _REGISTRY.get(name)
    if spec is None:
        entry = entry_points(ENTRY_POINT_GROUP).get(name)
        if entry is None:
            known = available_models()
            raise ConfigError(f"unknown model {name!r}; registered: {', '.join(known)}", key="model.name",
                              fix=f"set model.name to one of them, or register yours (register_model or a "
                                  f"{ENTRY_POINT_GROUP!r} entry point)")
        spec = entry.load()  # not cached: the installed entry points decide, as in a fresh process
    elif isinstance(spec, str):
        spec = _REGISTRY[name] = import_name(spec)
    if not isinstance(spec, ModelSpec) or spec.name != name:
        raise ConfigError(f"the plug-in registered as {name!r} is not a ModelSpec named {name!r} "
                          f"(got {type(spec).__name__})", key="model.name")
    return spec
