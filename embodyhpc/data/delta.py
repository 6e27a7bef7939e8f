"""Delta timestamps in LeRobot's form ({key: [seconds, ...]}), shared by every reader.

Offsets are whole frames: each value must be a multiple of 1/fps (within the tolerance). A frame
outside its episode is replaced by the episode's nearest edge frame and flagged in `<key>_is_pad`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import numpy as np

from embodyhpc.data.errors import DatasetError

DEFAULT_TOLERANCE_S = 1e-4
"""How far a time may be from a frame and still be that frame (LeRobot's default): offsets, video timestamps."""


def delta_steps(delta_timestamps: Mapping[str, Sequence[float]] | None, features: Collection[str], fps: float,
                tolerance_s: float) -> dict[str, np.ndarray]:
    """{key: frame offsets (int64)}; a DatasetError names the key for unknown keys or off-grid times."""
    steps_by_key = {}
    for key, offsets_s in (delta_timestamps or {}).items():
        if key not in features:
            raise DatasetError(f"unknown feature {key!r}; this dataset has: {', '.join(features)}",
                               where="delta_timestamps", key=key)
        offsets_s = np.asarray(offsets_s, dtype=np.float64)
        if offsets_s.ndim != 1 or offsets_s.size == 0:
            raise DatasetError("expected a non-empty list of seconds", where="delta_timestamps", key=key)
        steps = np.round(offsets_s * fps)
        off_grid = np.abs(offsets_s - steps / fps) > tolerance_s
        if off_grid.any():
            raise DatasetError(f"{offsets_s[off_grid].tolist()} s are not multiples of 1/fps = {1 / fps} s "
                               f"(tolerance {tolerance_s} s)", where="delta_timestamps", key=key)
        steps_by_key[key] = steps.astype(np.int64)
    return steps_by_key


def clamp_to_episode(row: int, steps: np.ndarray, first: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows row+steps clamped into the episode's rows [first, end), and which of them were outside."""
    wanted = row + steps
    return np.clip(wanted, first, end - 1), (wanted < first) | (wanted >= end)
