"""Software that decides how collectives run: torch, its CUDA and NCCL, and the exported NCCL variables.

A node whose torch or NCCL differs from its neighbours', or that inherits a stray NCCL_* variable
from someone's shell profile, is a classic cause of hangs that show up only at scale: the report
records all of them so that nodes can be compared.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "TORCH_FR_", "GLOO_")  # TORCH_FR_: the flight recorder (torch >= 2.8)
NOT_AVAILABLE = "n/a"


def _nccl_text(version: object) -> str:
    # torch returns (major, minor, patch) since 1.12; older builds returned NCCL_VERSION_CODE as an int
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    if isinstance(version, int):
        # NCCL_VERSION_CODE is major*10000 + minor*100 + patch from 2.9 on, major*1000 + ... before
        major, rest = divmod(version, 10000 if version >= 10000 else 1000)
        minor, patch = divmod(rest, 100)
        return f"{major}.{minor}.{patch}"
    return str(version)


def torch_versions() -> dict[str, str]:
    """torch, CUDA (the build's, not the driver's) and NCCL; "n/a" where the build has none.

    Imports torch: call it from the doctor, never from `embodyhpc --help` paths.
    """
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return {"torch": "not installed", "cuda": NOT_AVAILABLE, "nccl": NOT_AVAILABLE}
    cuda = getattr(torch.version, "cuda", None)
    nccl = NOT_AVAILABLE
    if cuda:  # CPU builds have no NCCL; asking them raises
        try:
            nccl = _nccl_text(torch.cuda.nccl.version())
        except (AttributeError, RuntimeError) as exc:
            nccl = f"{NOT_AVAILABLE} ({exc})"
    return {"torch": str(torch.__version__), "cuda": cuda or NOT_AVAILABLE, "nccl": nccl}


def exported_nccl_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """NCCL_*, TORCH_NCCL_*, TORCH_FR_* and GLOO_* variables of the environment, sorted by name."""
    env = os.environ if environ is None else environ
    return {k: env[k] for k in sorted(env) if k.startswith(ENV_PREFIXES)}
