"""Learning-rate schedule: linear warm-up, then cosine decay to zero at the last step.

The schedule is a pure function of the number of optimizer steps already taken, so a resumed run needs no saved
scheduler state: the loop rebuilds `LambdaLR(optimizer, fn, last_epoch=resumed_step - 1)` and gets the same
learning rate the uninterrupted run had. `embodyhpc resume` with a raised train.steps rebuilds it with the new total:
the schedule is stretched, not continued (a cosine that reached zero would have nothing left to continue with).

Convention (the one LambdaLR imposes): optimizer step k (1-based) runs with `lr * fn(k - 1)`. Hence:
- fn(0) = 1 / (warmup_steps + 1): the first step already moves (a zero-lr first step would waste it), and
  fn(warmup_steps) = 1 is the peak;
- fn(total_steps) = 0: the value after the last step (never used for an update), so the decay ends exactly there.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def warmup_cosine(warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """A LambdaLR `lr_lambda`: the multiplier of the peak learning rate after `step` optimizer steps.

    warmup_steps may be 0 (start at the peak); it must be below total_steps, or no step would decay.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps} "
                         f"total_steps={total_steps} (lower train.warmup_steps)")

    def multiplier(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return multiplier
