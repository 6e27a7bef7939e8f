"""The values NCCL's (and torch's NCCL) numeric environment variables accept: one table, checked before a job.

NCCL almost never refuses a value. It reads its integers with strtoll(value, NULL, 0), so "7x" reads as 7, "010"
as 8 (octal) and "true" as 0; it then clamps an out-of-range value, falls back to its default, or passes it to
the driver, which masks it: NCCL_IB_RETRY_CNT=10 does not fit the 3-bit retry field of an InfiniBand queue pair
and becomes 10 & 7 = 2 retries, fewer than the default 7. A job with such a value runs, differently from what its
profile says. Every value is therefore checked here: a plain decimal integer (no plus sign, no leading zero, no unit)
within the range the ACCEPTED table gives, or for the topology levels one of NCCL's names.

Ranges read in NCCL 2.30 (src/transport/net_ib, net_socket.cc, graph/tuning.cc, init.cc) and the NCCL
environment-variable documentation. A variable not listed here is exported as it is.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from embodyhpc.errors import ConfigError

_DECIMAL = re.compile(r"-?(0|[1-9][0-9]*)")  # ASCII digits only: str.isdigit() would take "٧"
INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Accepted:
    """Integers low..high (high None: no upper bound), a multiple of `multiple_of`; `why` says where it comes from.
    `auto`: one more value, outside the range, that leaves the choice to NCCL (NCCL's own default)."""

    low: int
    high: int | None
    why: str
    multiple_of: int = 1
    auto: int | None = None

    def describe(self) -> str:
        span = f"{self.low}-{self.high}" if self.high is not None else f">= {self.low}"
        span += f", a multiple of {self.multiple_of}" if self.multiple_of > 1 else ""
        return f"{self.auto} (NCCL decides) or {span}" if self.auto is not None else span

    def allows(self, number: int) -> bool:
        return number == self.auto or (number >= self.low and (self.high is None or number <= self.high)
                                       and number % self.multiple_of == 0)


_FLAG = Accepted(0, 1, "0 or 1")
_CHANNELS = Accepted(1, 64, "NCCL uses at most 64 channels (MAXCHANNELS) and quietly caps larger values")

ACCEPTED: dict[str, Accepted] = {
    # InfiniBand / RoCE verbs: fields of the queue-pair attributes, masked by the driver when too wide
    "NCCL_IB_RETRY_CNT": Accepted(0, 7, "the queue pair's 3-bit retry count; drivers mask larger values"),
    "NCCL_IB_TIMEOUT": Accepted(1, 31, "5-bit exponent, 4.096 us x 2^n; 0 means wait forever"),
    "NCCL_IB_SL": Accepted(0, 15, "4-bit InfiniBand service level"),
    "NCCL_IB_TC": Accepted(0, 255, "8-bit traffic class"),
    "NCCL_IB_FIFO_TC": Accepted(0, 255, "8-bit traffic class"),
    # -1: NCCL finds the RoCE v2 GID itself (its default since 2.21; NCCL_IB_ADDR_FAMILY / NCCL_IB_ADDR_RANGE steer
    # it); else an entry of the port's GID table, which the queue pair's 8-bit sgid_index holds
    "NCCL_IB_GID_INDEX": Accepted(0, 255, "an entry of the port's GID table (show_gids lists them)", auto=-1),
    "NCCL_IB_QPS_PER_CONNECTION": Accepted(1, 128, "NCCL allocates at most 128 queue pairs per connection"),
    "NCCL_IB_DISABLE": _FLAG,
    "NCCL_IB_ADAPTIVE_ROUTING": _FLAG,
    "NCCL_IB_SPLIT_DATA_ON_QPS": _FLAG,
    "NCCL_IB_MERGE_NICS": _FLAG,
    "NCCL_IB_PCI_RELAXED_ORDERING": Accepted(0, 2, "0 off, 1 on, 2 when available"),
    "NCCL_IB_AR_THRESHOLD": Accepted(0, None, "a message size in bytes"),
    "NCCL_NET_GDR_READ": _FLAG,
    "NCCL_CROSS_NIC": Accepted(0, 2, "0 same rail, 1 cross rails, 2 NCCL decides"),
    "NCCL_NVLS_ENABLE": Accepted(0, 2, "0 off, 1 on, 2 NCCL decides"),
    "NCCL_P2P_DISABLE": _FLAG,
    "NCCL_SHM_DISABLE": _FLAG,
    # kernels: threads per block and channels (one CTA each)
    "NCCL_NTHREADS": Accepted(64, 512, "threads per block for the simple and LL protocols, whole warps",
                              multiple_of=32),
    "NCCL_LL128_NTHREADS": Accepted(160, 640, "threads per block for LL128, whole warps", multiple_of=32),
    "NCCL_MIN_NCHANNELS": _CHANNELS,
    "NCCL_MAX_NCHANNELS": _CHANNELS,
    "NCCL_MIN_CTAS": _CHANNELS,
    "NCCL_MAX_CTAS": _CHANNELS,
    "NCCL_BUFFSIZE": Accepted(1, INT32_MAX, "bytes per channel buffer, kept in a 32-bit int"),
    "NCCL_LL_BUFFSIZE": Accepted(1, INT32_MAX, "bytes, kept in a 32-bit int"),
    "NCCL_LL128_BUFFSIZE": Accepted(1, INT32_MAX, "bytes, kept in a 32-bit int"),
    # TCP sockets: helper threads and sockets per thread (at most 64 sockets in all, see PAIRS)
    "NCCL_SOCKET_NTHREADS": Accepted(1, 16, "NCCL starts at most 16 socket threads"),
    "NCCL_NSOCKS_PERTHREAD": Accepted(1, 64, "NCCL opens at most 64 sockets per connection"),
    # torch's process group (ProcessGroupNCCL) and its flight recorder
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": Accepted(0, 3, "0 off, 1 abort and tear down, 2 clean up only, 3 no clean-up"),
    "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": Accepted(1, None, "seconds"),
    "TORCH_FR_BUFFER_SIZE": Accepted(0, None, "flight-recorder entries (0 turns it off)"),
    "TORCH_NCCL_TRACE_BUFFER_SIZE": Accepted(0, None, "flight-recorder entries (0 turns it off)"),
}

# Topology levels: a name, or a legacy integer 0-5 that NCCL maps onto the names (and quietly caps at 5).
# NCCL compares names case-sensitively and ignores an unknown one without a word.
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS")
GDR_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS")
LEVELS: dict[str, tuple[str, ...]] = {"NCCL_P2P_LEVEL": P2P_LEVELS, "NCCL_NET_GDR_LEVEL": GDR_LEVELS}
LEGACY_LEVEL = Accepted(0, 5, "legacy level numbers")

# Pairs checked together: (first, second, the rule as text, whether the pair is fine)
PAIRS: tuple[tuple[str, str, str, Callable[[int, int], bool]], ...] = (
    ("NCCL_SOCKET_NTHREADS", "NCCL_NSOCKS_PERTHREAD", "their product is at most 64 sockets",
     lambda threads, socks: threads * socks <= 64),
    ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS", "the minimum is at most the maximum", lambda lo, hi: lo <= hi),
    ("NCCL_MIN_CTAS", "NCCL_MAX_CTAS", "the minimum is at most the maximum", lambda lo, hi: lo <= hi),
)

# The two names of the flight recorder's size (torch renamed it in 2.8): a job exports one of them.
FLIGHT_RECORDER_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def _integer(text: str) -> int | None:
    return int(text) if _DECIMAL.fullmatch(text) else None


def check_value(name: str, value: object, key: str) -> None:
    """Refuse `value` for variable `name` when NCCL (or torch) would misread, clamp, mask or ignore it."""
    text = str(value)
    if name in LEVELS:
        names = LEVELS[name]
        number = _integer(text)
        if text in names or (number is not None and LEGACY_LEVEL.allows(number)):
            return
        raise ConfigError(f"{name}={text!r} is not a level NCCL knows ({', '.join(names)}, or legacy 0-5; "
                          "names are case-sensitive)", key=key, fix=f"set {key}={names[-2]} (or another listed level)")
    accepted = ACCEPTED.get(name)
    if accepted is None:
        return
    number = _integer(text)
    if number is None:
        hint = " (write 1 for true, 0 for false)" if accepted == _FLAG else ""
        raise ConfigError(f"{name}={text!r} is not a plain decimal integer; NCCL would read it as something else"
                          f"{hint}", key=key, fix=f"set {key} to an integer in {accepted.describe()}")
    if not accepted.allows(number):
        raise ConfigError(f"{name}={text} is out of range: {accepted.describe()} ({accepted.why})", key=key,
                          fix=f"set {key} to a value in {accepted.describe()}")


def check_environment(env: Mapping[str, str], key_of: Callable[[str], str]) -> None:
    """Every variable of `env` this module knows, then the pairs; `key_of(name)` is the recipe key that set it."""
    for name, value in env.items():
        check_value(name, value, key_of(name))
    both = [name for name in FLIGHT_RECORDER_NAMES if name in env]
    if len(both) == 2:
        raise ConfigError(f"both {both[0]} and {both[1]} are set (the flight recorder's size under its new and "
                          "old name)", key=key_of(both[1]), related=(key_of(both[0]),),
                          fix="set one of them: the job exports it under the name its torch reads")
    for first, second, rule, fine in PAIRS:
        if first in env and second in env and not fine(int(env[first]), int(env[second])):
            raise ConfigError(f"{first}={env[first]} and {second}={env[second]} do not fit together: {rule}",
                              key=key_of(second), related=(key_of(first),),
                              fix=f"lower {key_of(first)} or {key_of(second)}")
