"""Staging every dataset of a mixture (data.datasets): each one to its own node-local folder, one after the other.

    staged = stage_datasets(["/lustre/a", "/lustre/b"], nvme_dir="/nvme/stage", local_rank=0)  # ["/nvme/...", ...]

Each source gets `node_local_path(nvme_dir, src)` (distinct sources, distinct folders) and goes through
`stage_on_node` exactly as a single data.root does: local rank 0 copies, the other local ranks wait. The folders are
returned in the order of `roots`, so entry i of the mixture reads staged[i].
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from embodyhpc.staging.errors import StageInputError
from embodyhpc.staging.node import node_local_path, stage_on_node


def stage_datasets(roots: Sequence[str | os.PathLike], *, nvme_dir: str | os.PathLike, local_rank: int,
                   workers: int = 8, verify: bool | str = "quick", progress: bool = False,
                   stage_one: Callable[..., object] = stage_on_node) -> list[str]:
    """The node-local copy of every root, staged in order (see the module doc)."""
    dests = [node_local_path(nvme_dir, root) for root in roots]
    seen: dict[str, int] = {}
    for i, dest in enumerate(dests):
        if str(dest) in seen:
            raise StageInputError(f"data.datasets[{i}] ({roots[i]}) and data.datasets[{seen[str(dest)]}] would be "
                                  f"staged to the same folder {dest}", key=f"data.datasets[{i}].root",
                                  fix="list each dataset once")
        seen[str(dest)] = i
    for root, dest in zip(roots, dests, strict=True):
        stage_one(Path(root), dest, local_rank=local_rank, workers=workers, verify=verify, progress=progress)
    return [str(dest) for dest in dests]
