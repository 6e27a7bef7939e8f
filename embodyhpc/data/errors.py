"""Errors about datasets on disk and the workers that read them.

DatasetError and SampleError are bad input the user fixes (exit code 2 through the CLI). DataWorkerError is a
training job's data pipeline failing at run time: one line that says which rank, which worker and why.
"""

from __future__ import annotations

from embodyhpc.errors import RunFailure, UserError


class DatasetError(UserError):
    """A dataset folder or file is missing, in an unsupported format, or inconsistent."""


class SampleError(DatasetError):
    """One sample cannot be read (a corrupt or truncated video, an unreadable HDF5 chunk): `where` names the file, the
    message the episode and frame. `data.on_bad_sample: skip` skips such samples (counted); the default fails."""


class DataWorkerError(RunFailure):
    """A training rank's data pipeline failed: a worker raised (its error, on one line), died or got stuck past
    data.batch_timeout_s. Every rank raises the same one (train/stream.py agrees on it), so the job ends with it."""
