"""`data.datasets`: a weighted mixture of datasets, in place of the single `data.root`.

    data:
      format: lerobot
      datasets:
        - {root: /data/my_robot, weight: 3, embodiment: new_embodiment, eval: true}
        - {root: /data/droid_subset, weight: 1, embodiment: oxe_droid}

Each training sample is drawn from entry i with probability weight_i / sum(weights) (data/mixture.py), normalised
with entry i's own statistics, and (GR00T) fed to entry i's per-embodiment weights. Evaluation and export use one
entry's statistics: the one marked `eval: true`, else the first. Pure data and its own checks; what the datasets
hold (action and state dims, fps, cameras) is checked at validate (embodyhpc/validation/mixture_checks.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from embodyhpc.errors import ConfigError


@dataclass(frozen=True)
class DatasetEntry:
    root: str = ""
    """The dataset folder (a LeRobot v3.0/v2.1 folder or an HDF5 file, as data.root)."""
    weight: float = 1.0
    """Relative sampling weight (> 0): the entry's share of samples is weight / sum of the weights."""
    embodiment: str | None = None
    """GR00T: which per-embodiment weights the entry's samples use: an id 0..31 or one of GR00T's names
    (new_embodiment 31, gr1 24, agibot_genie1 26, oxe_droid 17); unset: model.options.embodiment_id. pi0.5 has one
    set of weights for every robot and reads no embodiment."""
    delta_timestamps: dict[str, list[float]] | None = None
    """This entry's {feature: [seconds, ...]}; unset: data.delta_timestamps (the same offsets in seconds are the
    same number of frames only at the same fps)."""
    eval: bool = False
    """Evaluation and export normalise with this entry's statistics (at most one entry; none marked: the first)."""


def check_sources(data: Any) -> None:
    """data.root or data.datasets, exactly one of them for a dataset on disk, and each entry sane (one line each)."""
    datasets = data.datasets
    if datasets is None:
        if data.format != "synthetic" and not data.root:
            raise ConfigError(f"format {data.format!r} needs a dataset folder", key="data.root",
                              related=("data.format", "data.datasets"),
                              fix="set data.root=/path/to/dataset (or data.datasets: a weighted list)")
        return
    if data.root:
        raise ConfigError("both data.root and data.datasets are set: one dataset or a mixture, not both",
                          key="data.datasets", related=("data.root",),
                          fix="remove data.root, or remove data.datasets")
    if data.format == "synthetic":
        raise ConfigError("a mixture of datasets on disk with data.format synthetic", key="data.datasets",
                          related=("data.format",), fix="set data.format=lerobot (or hdf5)")
    if not datasets:
        raise ConfigError("an empty list", key="data.datasets",
                          fix="list at least one {root, weight} entry, or use data.root")
    if data.gop_window_batches:
        raise ConfigError("regrouping by video file is not supported across a mixture of datasets",
                          key="data.gop_window_batches", related=("data.datasets",),
                          fix="set data.gop_window_batches=0")
    roots: dict[str, int] = {}
    for i, entry in enumerate(datasets):
        key = f"data.datasets[{i}]"
        if not entry.root or not entry.root.strip():
            raise ConfigError("no dataset folder", key=f"{key}.root", fix=f"set {key}.root=/path/to/dataset")
        if entry.root in roots:
            raise ConfigError(f"{entry.root} is listed twice (also data.datasets[{roots[entry.root]}])",
                              key=f"{key}.root", fix="list each dataset once and give it the sum of the weights")
        roots[entry.root] = i
        if not (math.isfinite(entry.weight) and entry.weight > 0):
            raise ConfigError(f"must be a positive finite number, got {entry.weight!r}", key=f"{key}.weight",
                              fix=f"set {key}.weight=1 (or remove the entry)")
    marked = [i for i, entry in enumerate(datasets) if entry.eval]
    if len(marked) > 1:
        raise ConfigError(f"entries {marked[0]} and {marked[1]} are both marked eval: true; evaluation and export "
                          "use one dataset's statistics", key=f"data.datasets[{marked[1]}].eval",
                          fix="mark one entry eval: true (unmarked, the first entry is used)")


def eval_index(datasets: list[DatasetEntry]) -> int:
    """The entry whose statistics evaluation and export use: the one marked eval, else the first."""
    return next((i for i, entry in enumerate(datasets) if entry.eval), 0)
