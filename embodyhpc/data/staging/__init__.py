"""Staging a dataset to node-local NVMe before training reads it.

    from embodyhpc.data.staging import stage, stage_on_node, verify_staged

    stage("/lustre/datasets/pusht", "/nvme/pusht")            # CLI: embodyhpc stage SRC DEST
    stage_on_node(src, dest, local_rank=local_rank)            # in the job: local rank 0 copies, the rest wait
    verify_staged(dest)                                        # before training reads the copy

`stage` mirrors SRC into DEST with a pool of copy threads, skips files unchanged since the last run (by
size and mtime, recorded with a content hash in DEST/.embodyhpc-stage.json), deletes files SRC no longer has,
checks free space before copying, resumes after a kill, and re-hashes the copy to catch damaged files
(manifest.py explains the hash). Pure Python: no torch, usable before torch.distributed starts.
"""

from __future__ import annotations

from embodyhpc.data.staging.errors import (
    NodeStagingError,
    NotEnoughSpaceError,
    StagedDataError,
    StageInputError,
    StagingError,
)
from embodyhpc.data.staging.manifest import MANIFEST_NAME, file_hash, load_manifest
from embodyhpc.data.staging.node import job_id_from_env, node_local_path, stage_on_node
from embodyhpc.data.staging.stage import StageResult, stage
from embodyhpc.data.staging.verify import VerifyResult, verify_staged

__all__ = [
    "MANIFEST_NAME", "NodeStagingError", "NotEnoughSpaceError", "StageInputError", "StageResult",
    "StagedDataError", "StagingError", "VerifyResult", "file_hash", "job_id_from_env", "load_manifest",
    "node_local_path", "stage", "stage_on_node", "verify_staged",
]
