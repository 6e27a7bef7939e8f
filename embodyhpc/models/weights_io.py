"""Reading safetensors checkpoints for any model: lazy file access, key conversion rules, the load report.

A model's published-weights adapter (its spec's `weights`: a PublishedWeights made of the family's conversions, e.g.
models/pi05/weights.py) maps published keys to its own with KeyRules; embodyhpc/checkpoint/sliced_weights.py reads
each rank's rows through them. Nothing here imports torch.distributed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"


class WeightsLayoutError(ValueError):
    """The checkpoint does not fit the model; the message names the keys."""


@dataclass(frozen=True)
class KeyRule:
    """One tensor of ours and its published counterpart; `kind` names the conversion (see the module table)."""

    ours: str
    theirs: str
    kind: str = "same"  # "same" | "position" (our [1, P, W] <-> their [P, W]) | "drop_gate" (final norm)

    def their_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "position":
            return tuple(ours[1:])
        if self.kind == "drop_gate":
            return (ours[0] // 2 * 3, *ours[1:])
        return tuple(ours)

    def to_theirs(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.kind == "position":
            return tensor.reshape(tensor.shape[1:])
        if self.kind == "drop_gate":
            return torch.cat([tensor, tensor.new_zeros(tensor.shape[0] // 2, *tensor.shape[1:])])
        return tensor

    def to_ours(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.kind == "position":
            return tensor.reshape(1, *tensor.shape)
        if self.kind == "drop_gate":
            return tensor[: tensor.shape[0] // 3 * 2]
        return tensor

    def read_rows(self, rows: Callable[[int, int], torch.Tensor], start: int, stop: int,
                  ours: tuple[int, ...]) -> torch.Tensor:
        """Rows start:stop (dim 0) of our tensor, reading only what they need from the file (`rows(a, b)` reads
        rows a:b of the published tensor): what a rank holding one FSDP shard reads."""
        if self.kind == "position":  # ours [1, P, W]: the one row is their whole [P, W] tensor
            return rows(0, ours[1]).reshape(1, *ours[1:]) if stop > start else torch.empty(0, *ours[1:])
        return rows(start, stop)  # "same", and "drop_gate" (our rows are their first 2D rows)


class SafetensorsCheckpoint:
    """Lazy read access to a safetensors file, or a folder with model.safetensors or a sharded index."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open  # the `train` extra; imported here so models/ imports without it

        path = Path(path)
        if path.is_dir():
            if (path / INDEX_FILE).is_file():
                path = path / INDEX_FILE
            elif (path / SINGLE_FILE).is_file():
                path = path / SINGLE_FILE
            else:
                raise FileNotFoundError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} in this folder")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such checkpoint file")
        if path.name.endswith(".json"):
            weight_map = index_weight_map(path)
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = None, [path.name]
        self.path = path
        self._handles = {name: safe_open(str(path.parent / name), framework="pt", device="cpu") for name in files}
        if weight_map is None:
            weight_map = {key: files[0] for key in self._handles[files[0]].keys()}
        else:
            held = {name: set(handle.keys()) for name, handle in self._handles.items()}
            lost = next((key for key, name in weight_map.items() if key not in held[name]), None)
            if lost is not None:
                raise WeightsLayoutError(f"{path}: the index puts {lost} in {weight_map[lost]}, which does not hold "
                                         "it (an index of another checkpoint, or a shard replaced)")
        self._file_of = weight_map

    def keys(self) -> list[str]:
        return list(self._file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._file_of[key]].get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        return self._handles[self._file_of[key]].get_tensor(key)

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor (dim 0), read without reading the rest (safetensors slices the file)."""
        view = self._handles[self._file_of[key]].get_slice(key)
        if not view.get_shape():  # 0-d
            return view[...]
        return view[start:stop]

    def dtype(self, key: str) -> str:
        return self._handles[self._file_of[key]].get_slice(key).get_dtype()


def index_weight_map(path: Path) -> dict[str, str]:
    """{tensor name: shard file} of a sharded index (model.safetensors.index.json). Every shard must be a plain file
    name beside the index: an index is data from whoever published the checkpoint, and a name such as
    "../../etc/passwd" or "/abs/path" would make every rank open a file outside the checkpoint's folder."""
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WeightsLayoutError(f"{path}: not a safetensors index (not valid JSON: {type(exc).__name__})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsLayoutError(f'{path}: no "weight_map": not a safetensors index')
    for key, shard in weight_map.items():
        if not isinstance(shard, str) or not _plain_file_name(shard):
            raise WeightsLayoutError(f"{path}: the index puts {key} in {shard!r}, which is not a file name beside "
                                     "the index (a shard outside the checkpoint's folder is never read)")
    return weight_map


def _plain_file_name(name: str) -> bool:
    return (name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name
            and not Path(name).is_absolute())


TensorSource = SafetensorsCheckpoint | Mapping[str, torch.Tensor]


# ---- the report ----
@dataclass
class LoadReport:
    """What a load did. `loaded`, `missing`, `unexpected` and `ignored` hold published key names (missing: keys the
    model needs that the checkpoint lacks); `mismatched`: (key, the model's shape, the checkpoint's shape)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    mismatched: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    key_prefix: str = ""  # "model." for LeRobot policy files

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def summary(self) -> str:
        return (f"{self.source}: {len(self.loaded)} loaded, {len(self.missing)} missing, "
                f"{len(self.unexpected)} unexpected, {len(self.mismatched)} shape mismatches, "
                f"{len(self.ignored)} ignored (unused by the model)")


# ---- matching a file against a family's key rules (each adapter's plan_load) ----
def listing(keys: list[str], limit: int = 8) -> str:
    """The first `limit` keys, and how many more."""
    more = f" (and {len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def match_rules(report: LoadReport, rules: list[KeyRule], in_file: Mapping[str, str],
                targets: Mapping[str, tuple[int, ...]], shape_of: Callable[[str], tuple[int, ...]],
                ignored: Callable[[str], bool]) -> list[tuple[KeyRule, str]]:
    """Fill `report` from the file's keys (`in_file`: the rule's published name -> the name in the file) and the
    model's shapes (`targets`: our name -> shape): loaded, missing, mismatched, and the file's other keys as ignored
    (`ignored` says which the model knowingly leaves unused) or unexpected. Returns (rule, key in the file) for each
    tensor to load."""
    to_load = []
    for rule in rules:
        key = in_file.get(rule.theirs)
        if key is None:
            report.missing.append(rule.theirs)
            continue
        expected, got = rule.their_shape(tuple(targets[rule.ours])), shape_of(key)
        if expected != got:
            report.mismatched.append((rule.theirs, expected, got))
            continue
        to_load.append((rule, key))
        report.loaded.append(rule.theirs)
    known = {r.theirs for r in rules}
    for canonical in in_file:
        if ignored(canonical):
            report.ignored.append(canonical)
        elif canonical not in known:
            report.unexpected.append(canonical)
    return to_load


def refuse_mismatches(report: LoadReport, source_name: str, *, strict: bool, hint: Callable[[str], str],
                      details: int = 6) -> None:
    """WeightsLayoutError, one line: shape mismatches (always, the first `details` with `hint`'s recipe key), missing
    and unexpected keys (when strict)."""
    if report.mismatched:
        text = "; ".join(f"{k}: model {list(e)} vs checkpoint {list(g)}{hint(k)}"
                         for k, e, g in report.mismatched[:details])
        raise WeightsLayoutError(f"{source_name}: {len(report.mismatched)} shape mismatch(es): {text}")
    if strict and (report.missing or report.unexpected):
        parts = []
        if report.missing:
            parts.append(f"missing {len(report.missing)} key(s): {listing(report.missing)}")
        if report.unexpected:
            parts.append(f"unexpected {len(report.unexpected)} key(s): {listing(report.unexpected)}")
        raise WeightsLayoutError(f"{source_name}: " + "; ".join(parts) + " (strict=False loads the rest)")


# ---- a family's adapter: its two pure conversions behind the model-level API ----
def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state-dict name, without transformer-engine's `_extra_state`."""
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.endswith("_extra_state")}


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the values of a parameter, also of a tensor subclass (torchao's float8 training wraps
    weights in one, which safetensors cannot write)."""
    if type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.detach()
    with torch.no_grad():
        return torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def refuse_sharded(tensors: Mapping[str, torch.Tensor]) -> None:
    for name, tensor in tensors.items():
        if type(tensor).__name__ == "DTensor" or type(getattr(tensor, "data", None)).__name__ == "DTensor":
            raise WeightsLayoutError(f"{name} is sharded (FSDP/DTensor): use "
                                     "embodyhpc.checkpoint.sliced_weights.load_weights_sharded on every rank")


class PublishedWeights:
    """A family's published-weights adapter (its spec's `weights`; the protocol is checkpoint/sliced_weights.py's
    WeightsAdapter), made of the family's two pure conversions, each keyed on the model's `shape`:

        plan_load(source, shape, targets, *, strict, source_name) -> (LoadReport, [(KeyRule, key in the file)])
        to_published(state, shape, *, placeholders, dtype) -> {published key: tensor}

    and the model-level load and save of unsharded models built on them (sharded ones: checkpoint.sliced_weights).
    `layout` goes into the metadata of the files written."""

    def __init__(self, layout: str, plan_load: Callable[..., tuple[LoadReport, list[tuple[KeyRule, str]]]],
                 to_published: Callable[..., dict[str, torch.Tensor]]) -> None:
        self.layout = layout
        self._plan_load, self._to_published = plan_load, to_published

    def plan_load(self, source: TensorSource, model: torch.nn.Module, targets: Mapping[str, tuple[int, ...]], *,
                  strict: bool, source_name: str) -> tuple[LoadReport, list[tuple[KeyRule, str]]]:
        return self._plan_load(source, model.shape, targets, strict=strict, source_name=source_name)

    def to_published(self, state: Mapping[str, torch.Tensor], model: torch.nn.Module, *, placeholders: bool = True,
                     dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self._to_published(state, model.shape, placeholders=placeholders, dtype=dtype)

    @torch.no_grad()
    def load(self, model: torch.nn.Module, path_or_dir: str | Path | TensorSource, *,
             strict: bool = True) -> LoadReport:
        """Published-layout weights (a .safetensors file, a folder with model.safetensors or a sharded index, or an
        in-memory dict) into `model`, cast to each tensor's dtype: copied in place one at a time into a materialised
        model, assigned (on the CPU) to a model still on the meta device."""
        tensors = model_tensors(model)
        refuse_sharded(tensors)
        if isinstance(path_or_dir, (str, Path)):
            source, name = SafetensorsCheckpoint(path_or_dir), str(path_or_dir)
        else:
            source, name = path_or_dir, "state dict"
        report, to_load = self.plan_load(source, model, {k: tuple(v.shape) for k, v in tensors.items()},
                                         strict=strict, source_name=name)
        get = source.get if isinstance(source, SafetensorsCheckpoint) else source.__getitem__
        converted = ((rule.ours, rule.to_ours(get(key))) for rule, key in to_load)
        if any(t.is_meta for t in tensors.values()):
            model.load_state_dict({k: v.to(tensors[k].dtype) for k, v in converted}, strict=False, assign=True)
        else:
            for ours, tensor in converted:
                tensors[ours].copy_(tensor)  # copy_ casts to the tensor's dtype and device
        return report

    def save(self, model: torch.nn.Module, path: str | Path, *, placeholders: bool = True,
             dtype: torch.dtype | None = None, key_prefix: str = "") -> Path:
        """The model's weights as one safetensors file in the published layout (a folder: its model.safetensors);
        returns the path. `key_prefix` names the keys as a framework's policy file does (LeRobot: "model.")."""
        from safetensors.torch import save_file

        tensors = model_tensors(model)
        refuse_sharded(tensors)
        path = Path(path)
        if path.suffix != ".safetensors":
            path = path / SINGLE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        published = self.to_published(tensors, model, placeholders=placeholders, dtype=dtype)
        save_file({key_prefix + k: v for k, v in published.items()}, str(path),
                  metadata={"format": "pt", "layout": self.layout})
        return path
