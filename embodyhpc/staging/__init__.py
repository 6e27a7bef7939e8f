"""Staging a dataset to node-local NVMe before training reads it.

    from embodyhpc.staging import stage, stage_on_node, verify_staged

    stage("/lustre/datasets/pusht", "/nvme/pusht")            # CLI: embodyhpc stage SRC DEST
    stage_on_node(src, dest, local_rank=local_rank)            # in the job: local rank 0 copies, the rest wait
    verify_staged(dest)                                        # before training reads the copy

`stage` mirrors SRC into DEST with a pool of copy threads, hashing every byte as it is copied (the source is
read once; the hash goes into DEST/.embodyhpc-stage.json, manifest.py explains it), deletes files SRC no longer
has, checks free space before copying, resumes after a kill, and syncs DEST's filesystem once before the
manifest lists a file instead of an fsync per file. Restaging an unchanged tree is a stat walk: a staged file
is not read again while its size, mtime, inode and ctime match those recorded when its content was last
checked, and its source's size, mtime and inode match too. `verify="full"` (`staging.verify: full`,
`embodyhpc stage --verify full`) re-hashes the whole staged copy from the device on every run, for what stat
cannot see (bit rot); stage.py's docstring compares the modes. Pure Python: no torch, usable before
torch.distributed starts.
"""

from __future__ import annotations

from embodyhpc.staging.errors import (
    NodeStagingError,
    NotEnoughSpaceError,
    StagedDataError,
    StageInputError,
    StagingError,
)
from embodyhpc.staging.manifest import MANIFEST_NAME, file_hash, load_manifest
from embodyhpc.staging.node import job_id_from_env, node_local_path, stage_on_node
from embodyhpc.staging.stage import VERIFY_MODES, StageResult, stage
from embodyhpc.staging.verify import VerifyResult, verify_staged

__all__ = [
    "MANIFEST_NAME", "NodeStagingError", "VERIFY_MODES", "NotEnoughSpaceError", "StageInputError", "StageResult",
    "StagedDataError", "StagingError", "VerifyResult", "file_hash", "job_id_from_env", "load_manifest",
    "node_local_path", "stage", "stage_on_node", "verify_staged",
]
