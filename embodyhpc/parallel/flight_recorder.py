"""The NCCL flight recorder's settings, under the names the running torch reads: how many entries it keeps and where
it dumps them. A job sets them before its process group exists (launch/distributed.py); `embodyhpc smoke` too.

Plain environment handling, no torch import: the caller passes torch.__version__.
"""

from __future__ import annotations

import re
from collections.abc import MutableMapping
from pathlib import Path

from embodyhpc.config.nccl_values import FLIGHT_RECORDER_NAMES

# The flight recorder's size. torch 2.8 renamed TORCH_NCCL_TRACE_BUFFER_SIZE to TORCH_FR_BUFFER_SIZE; it still
# reads the old name but then every rank prints a deprecation warning, and a torch before 2.8 knows only the old
# one. The nodes' torch is known only in the job, so the job, not the sbatch script, exports it.
FR_BUFFER_NEW, FR_BUFFER_OLD = FLIGHT_RECORDER_NAMES
FR_RENAMED_IN = (2, 8)
FR_DEFAULT_ENTRIES = 2000  # what torch's flight-recorder tutorial recommends
# Where it dumps (a file-name prefix, torch appends the rank). Renamed like the size; torch reads the old name in
# every version (newer ones warn on each rank) and the new one surely from 2.9 (torchtitan switches there too), so
# the job switches at 2.9: at worst one warning per rank on 2.8, never a dump that goes to torch's default place.
FR_DUMP_NEW, FR_DUMP_OLD = "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"
FR_DUMP_RENAMED_IN = (2, 9)
_TRUE = ("1", "true", "t", "yes", "y")  # what torch's getCvarBool takes as true


def _torch_minor(torch_version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", torch_version)
    if match is None:
        raise ValueError(f"not a torch version: {torch_version!r}")
    return int(match[1]), int(match[2])


def flight_recorder_variable(torch_version: str) -> str:
    """The name the given torch reads the flight recorder's size from without a warning."""
    return FR_BUFFER_NEW if _torch_minor(torch_version) >= FR_RENAMED_IN else FR_BUFFER_OLD


def flight_recorder_dump_variable(torch_version: str) -> str:
    """The name the given torch reads the flight recorder's dump-file prefix from."""
    return FR_DUMP_NEW if _torch_minor(torch_version) >= FR_DUMP_RENAMED_IN else FR_DUMP_OLD


def set_flight_recorder_dump_file(environ: MutableMapping[str, str], torch_version: str, prefix: Path) -> str:
    """Leave one flight-recorder dump prefix in `environ`, under the name `torch_version` reads; return that name.

    A prefix the user set (extra_env, site.env, the shell) is kept, translated when it came under the other name;
    with both names set, the value torch itself would have used wins. Without one (or an empty one, which would dump
    into the working directory), `prefix`: the run directory's (rundir.flight_recorder_prefix), its folder created,
    so that a hang's traces survive the job instead of staying in the node's /tmp or the home cache.
    """
    name = flight_recorder_dump_variable(torch_version)
    other = FR_DUMP_OLD if name == FR_DUMP_NEW else FR_DUMP_NEW
    value = environ.get(name, environ.get(other))
    environ.pop(other, None)
    if not value:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)  # torch opens the file, it makes no folder
        value = str(prefix)
    environ[name] = value
    return name


def set_flight_recorder_size(environ: MutableMapping[str, str], torch_version: str) -> str | None:
    """Leave at most one flight-recorder size in `environ`, under the name `torch_version` reads; return that name.

    A size the user set is kept, translated when it came under the other name; with both names set, the value
    torch itself would have used wins (the new name on torch >= 2.8, the old one before). Without any, dumps on
    timeout (TORCH_NCCL_DUMP_ON_TIMEOUT, from network.dump_on_timeout) get FR_DEFAULT_ENTRIES entries to dump.
    """
    name = flight_recorder_variable(torch_version)
    other = FR_BUFFER_OLD if name == FR_BUFFER_NEW else FR_BUFFER_NEW
    value = environ.get(name, environ.get(other))
    environ.pop(other, None)
    if value is None and environ.get("TORCH_NCCL_DUMP_ON_TIMEOUT", "").strip().lower() in _TRUE:
        value = str(FR_DEFAULT_ENTRIES)
    if value is None:
        return None
    environ[name] = value
    return name
