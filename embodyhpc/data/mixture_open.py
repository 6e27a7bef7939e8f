"""Opening a recipe's data.datasets for training: the MixtureDataset, one state normaliser per dataset, and the file
beside the checkpoints that keeps every dataset's statistics.

Statistics. Each dataset's samples are normalised with that dataset's own meta/stats.json (meta/episodes_stats.jsonl
for LeRobot v2.1), not model.norm_stats (a file or `init` there is refused at validate): a mixture joins robots
whose states have different ranges, and one robot's numbers applied to another's state would feed the policy
garbage. Evaluation and export read one set, the
entry marked `eval: true` (else the first): it is saved as normalization.json as for a single dataset, and all of
them in DATASETS_NORM_FILE, with a digest of what each dataset holds (`dataset_identity`).

Resume. A resumed run keeps the statistics it trained with: the run's own DATASETS_NORM_FILE (`run_normalizer`), not
the datasets' files read again, and a run whose datasets no longer are the checkpointed ones (another dataset at an
entry, another weight) is refused in one line before anything beside the checkpoints is rewritten; the sampler's
state in each checkpoint holds the same digests (data/mixture.py MixtureSampler).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from embodyhpc.config.data_mixture import eval_index
from embodyhpc.config.schema import DataConfig
from embodyhpc.data.errors import DatasetError
from embodyhpc.data.info import dataset_identity
from embodyhpc.data.mixture import MixtureDataset, MixtureNormalizer
from embodyhpc.data.normalize import StateNormalizer

DATASETS_NORM_FILE = "normalization_datasets.json"
"""Every dataset's statistics of a mixture run, beside normalization.json (the evaluation entry's)."""


def entry_delta_timestamps(data: DataConfig, index: int) -> dict[str, list[float]]:
    """data.datasets[index]'s delta_timestamps, else data.delta_timestamps."""
    own = data.datasets[index].delta_timestamps  # type: ignore[index]
    chosen = own if own is not None else data.delta_timestamps
    return {key: list(value) for key, value in chosen.items()}


def open_mixture(data: DataConfig, *, seed: int, open_one: Callable[..., Any] | None = None) -> MixtureDataset:
    """The recipe's datasets as one MixtureDataset drawn by weight (data/mixture.py)."""
    if open_one is None:
        from embodyhpc.data import open_dataset as open_one
    entries = data.datasets or []
    members = [open_one(entry.root, entry_delta_timestamps(data, i)) for i, entry in enumerate(entries)]
    return MixtureDataset(members, [entry.weight for entry in entries], seed=seed,
                          embodiments=[entry.embodiment for entry in entries],
                          identities=[dataset_identity(entry.root) for entry in entries])


def mixture_normalizer(data: DataConfig, key: str, mode: str) -> MixtureNormalizer:
    """One StateNormalizer per dataset, from its own statistics; called directly, the evaluation entry's."""
    entries = data.datasets or []
    return MixtureNormalizer([StateNormalizer.from_dataset(entry.root, key, mode) for entry in entries],
                             eval_index(entries))


def run_normalizer(data: DataConfig, model_cfg: Any, run_checkpoints: str | os.PathLike) -> MixtureNormalizer:
    """The statistics (of model_cfg.state_key, by model_cfg.state_norm) a mixture run trains with: on resume
    (DATASETS_NORM_FILE in `run_checkpoints`) the run's own, after checking that each entry is still the dataset they
    were computed from (one-line DatasetError otherwise); on a fresh run, each dataset's own (`mixture_normalizer`)."""
    path = Path(run_checkpoints) / DATASETS_NORM_FILE
    if not path.is_file():
        return mixture_normalizer(data, model_cfg.state_key, model_cfg.state_norm)
    saved = json.loads(path.read_text())["datasets"]
    entries = data.datasets or []
    if len(saved) != len(entries):
        raise DatasetError(f"the run trained on {len(saved)} datasets (data.datasets), this recipe lists "
                           f"{len(entries)}", where=str(path), fix="resume with the run's data.datasets, or start a "
                                                                   "new run")
    for i, (old, entry) in enumerate(zip(saved, entries, strict=True)):
        if old.get("identity") not in (None, dataset_identity(entry.root)):
            raise DatasetError(f"data.datasets[{i}] ({entry.root}) is not the dataset the run trained on "
                               f"({old.get('root')}): its metadata differ", where=str(path),
                               fix="resume with the run's data.datasets, or start a new run")
    return read_dataset_stats(run_checkpoints)


def save_dataset_stats(folder: str | os.PathLike, normalizer: MixtureNormalizer, roots: list[str]) -> Path:
    """DATASETS_NORM_FILE in `folder`: {eval_index, datasets: [{root, identity, key, mode, offset, scale}, ...]}."""
    body = normalizer.to_dict()
    for entry, root in zip(body["datasets"], roots, strict=True):
        entry["root"] = root
        entry["identity"] = dataset_identity(root)
    path = Path(folder) / DATASETS_NORM_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    tmp.replace(path)  # whole or not at all, as StateNormalizer.save
    return path


def read_dataset_stats(folder: str | os.PathLike) -> MixtureNormalizer:
    """The MixtureNormalizer save_dataset_stats wrote."""
    body = json.loads((Path(folder) / DATASETS_NORM_FILE).read_text())
    return MixtureNormalizer([StateNormalizer(d["key"], d["mode"], tuple(d["offset"]), tuple(d["scale"]))
                              for d in body["datasets"]], int(body["eval_index"]))
