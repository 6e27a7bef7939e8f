"""A recipe's data.datasets (a weighted mixture) against the datasets' metadata, where the recipe is resolved.

Each entry is checked as a single data.root is (validation/data_checks.py: its delta_timestamps, or the shared ones,
on its frame grid and within its episodes, model.state_key present, the model family's own fit), its errors named
`data.datasets[i] (<root>)` with the entry's key. Then what must agree across the entries:
- cameras: every entry has the same camera keys. Refused otherwise, not padded: a blank image in a camera slot is
  an input the policy would learn to read as "this robot", and the families stack cameras by key, so a missing one
  shifts every later slot;
- action dims: each entry's at most model.action_dim (entries with fewer are zero-padded, and the padded dims masked
  out of the loss); a wider one is refused (pi0.5 alone would trim it, and a trimmed dim is never learned);
- state dims: each entry's at most model.state_dim where the family reads that key (pi0.5 pads every robot's state
  to it); GR00T pads to its state encoder's 64 (its own check);
- model.norm_stats: not a file nor `init` (one set of statistics; each entry is normalised with its own);
- fps: entries may differ, as long as each one's offsets are whole frames of its own fps (entry-level check above;
  the fix names the entry's own delta_timestamps). Different rates are reported as a warning: one chunk of offsets
  in seconds spans a different number of frames on each.
The model family's own fit (its spec's check_dataset) is given the entry's facts as EntryFacts: which entry, its
embodiment (GR00T refuses a name it does not know here, not at the first batch) and the width its state is
zero-padded to (pi0.5 writes model.state_dim state bins into a prompt, not the dataset's width).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embodyhpc.data.facts import DatasetFacts
from embodyhpc.errors import ConfigError, UserError
from embodyhpc.validation.data_checks import Where, check_recipe_data


@dataclass(frozen=True)
class EntryFacts(DatasetFacts):
    """A mixture entry's dataset facts, as its model family's check_dataset sees them."""

    entry: int = 0
    """Its index in data.datasets (errors name data.datasets[entry].*)."""
    embodiment: str | None = None
    """data.datasets[entry].embodiment as the recipe gives it (None: unset)."""
    state_padded_to: int | None = None
    """The width every sample's state is zero-padded to in a mixture (model.state_dim, for a family that reads it)."""


def check_mixture(cfg: Any, where: Where) -> list[str]:
    """Errors (one-line ConfigError naming the entry, its root and the key) and warnings for data.datasets."""
    entries = cfg.data.datasets or []
    if not entries or cfg.data.format == "synthetic":
        return []
    from embodyhpc.data.facts import dataset_facts
    from embodyhpc.models.spec import model_spec

    if cfg.model.norm_stats not in ("auto", "dataset"):  # a file or init's: single-dataset settings (paths.py)
        raise ConfigError(f"model.norm_stats={cfg.model.norm_stats} names one set of statistics, and a mixture "
                          "normalises each dataset with its own (data/mixture_open.py): it would not be read",
                          key="model.norm_stats", related=("data.datasets",), where=where("model.norm_stats"),
                          fix="remove model.norm_stats (or set model.norm_stats=dataset)")
    warnings: list[str] = []
    seen: list[tuple[int, Any]] = []
    spec = model_spec(cfg.model.name)
    for i, entry in enumerate(entries):
        name = f"data.datasets[{i}] ({entry.root})"
        if not Path(entry.root).expanduser().exists():
            warnings.append(f"{name}: not visible from this machine; the job checks it on the cluster")
            continue
        try:
            facts = dataset_facts(entry.root)
        except UserError as exc:
            raise ConfigError(f"{name}: {exc.one_line()}", key=f"data.datasets[{i}].root") from None
        fields = {f.name: getattr(facts, f.name) for f in dataclasses.fields(facts)}
        padded = cfg.model.state_dim if "state_dim" in spec.keys else None
        own = EntryFacts(**fields, entry=i, embodiment=entry.embodiment, state_padded_to=padded)
        offsets = entry.delta_timestamps if entry.delta_timestamps is not None else cfg.data.delta_timestamps
        single = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, datasets=None, root=entry.root,
                                                                   delta_timestamps=offsets))
        try:
            warnings += [f"{name}: {w}" for w in check_recipe_data(single, where, dataset_visible=True, facts=facts,
                                                                   model_facts=own)]
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc.message}", key=_entry_key(exc.key, i, entry), related=exc.related,
                              where=exc.where, fix=exc.fix) from None
        seen.append((i, facts))
    if not seen:
        return warnings
    first_i, first = seen[0]
    for i, facts in seen:
        name = f"data.datasets[{i}] ({entries[i].root})"
        if facts.cameras != first.cameras:
            raise ConfigError(f"{name}: cameras {facts.cameras} differ from data.datasets[{first_i}]'s "
                              f"{first.cameras}; a mixture's datasets must have the same camera keys",
                              key=f"data.datasets[{i}].root", related=(f"data.datasets[{first_i}].root",),
                              fix="mix datasets with the same cameras (rename or drop cameras with `embodyhpc data "
                                  "convert`), or train on them separately")
        action = facts.features.get("action", ())
        if action and action[-1] > cfg.model.action_dim:
            raise ConfigError(f"{name}: {action[-1]} action dims, more than model.action_dim="
                              f"{cfg.model.action_dim} that every dataset's actions are padded to",
                              key=f"data.datasets[{i}].root", related=("model.action_dim",),
                              fix=f"set model.action_dim={action[-1]}")
        state = facts.features.get(cfg.model.state_key, ())
        if "state_dim" in spec.keys and state and state[-1] > cfg.model.state_dim:
            raise ConfigError(f"{name}: the state {cfg.model.state_key!r} has {state[-1]} dims, more than "
                              f"model.state_dim={cfg.model.state_dim} that a mixture's states are padded to",
                              key=f"data.datasets[{i}].root", related=("model.state_dim",),
                              fix=f"set model.state_dim={state[-1]}")
        if facts.fps != first.fps:
            warnings.append(f"{name} records at {facts.fps:g} fps, data.datasets[{first_i}] at {first.fps:g}: "
                            "the same offsets in seconds are a different number of frames on each")
    return warnings


def _entry_key(key: str | None, i: int, entry: Any) -> str | None:
    """A single-dataset check's key, as the entry's: data.root -> data.datasets[i].root, and the entry's own
    delta_timestamps when it has them."""
    if key is None:
        return None
    if key == "data.root":
        return f"data.datasets[{i}].root"
    if key.startswith("data.delta_timestamps") and entry.delta_timestamps is not None:
        return f"data.datasets[{i}]" + key.removeprefix("data")
    return key
