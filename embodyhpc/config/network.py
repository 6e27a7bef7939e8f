"""The `network:` section: how NCCL and PyTorch's process groups use the cluster fabric.

A site profile sets it once per cluster; every job exports `NetworkConfig.environment()`.
Each field's docstring says which variable it sets, what it does and when to change it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from embodyhpc.config import checks, nccl_values
from embodyhpc.errors import ConfigError

FABRICS = ("ethernet", "ib", "roce", "efa")
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")

# the typed fields behind the variables they set, so that a bad value names the key the user wrote
_FIELD_KEYS = {
    "NCCL_IB_GID_INDEX": "network.gid_index", "NCCL_NET_GDR_LEVEL": "network.gdr_level",
    "NCCL_CROSS_NIC": "network.cross_nic", "NCCL_IB_QPS_PER_CONNECTION": "network.qps_per_connection",
    "NCCL_IB_TIMEOUT": "network.ib_timeout", "NCCL_IB_RETRY_CNT": "network.ib_retry_cnt",
    "NCCL_BUFFSIZE": "network.buffsize_bytes", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "network.heartbeat_timeout_s",
}


@dataclass(frozen=True)
class NetworkConfig:
    fabric: str = "ethernet"
    """ethernet (TCP sockets only: NCCL_IB_DISABLE=1), ib (InfiniBand verbs), roce (RoCE v2 verbs),
    or efa (AWS libfabric plugin)."""
    hcas: list[str] = field(default_factory=list)
    """NCCL_IB_HCA: RDMA devices, e.g. [mlx5_0:1, mlx5_1:1]; empty = NCCL's own choice. List every
    rail that should carry traffic: a missing one silently halves bandwidth."""
    gid_index: int | None = None
    """NCCL_IB_GID_INDEX: the RoCE v2 GID table entry (0-255, commonly 3; `show_gids` lists them). Unset (not
    exported) or -1 (exported, so that a value inherited from elsewhere does not apply): NCCL >= 2.21 finds the
    RoCE v2 GID itself (its default, -1). Set it for an older NCCL, whose default is entry 0 (usually RoCE v1)."""
    socket_ifname: str | None = None
    """NCCL_SOCKET_IFNAME (bootstrap and TCP traffic), e.g. ib0, eth0, =eth0 (exact) or ^lo,docker (exclude).
    GLOO_SOCKET_IFNAME gets the same interface when it names one (Gloo knows no ^ exclusion lists)."""
    gdr_level: str | None = None
    """NCCL_NET_GDR_LEVEL: how far apart GPU and NIC may be for GPUDirect RDMA (LOC, PIX, PXB, PHB, SYS)."""
    cross_nic: int | None = None
    """NCCL_CROSS_NIC: 0 keeps rings on the same rail (rail-optimised fabrics), 1 allows crossing, 2 NCCL decides."""
    qps_per_connection: int | None = None
    """NCCL_IB_QPS_PER_CONNECTION (1-128): more queue pairs help adaptive routing on large fabrics."""
    ib_timeout: int | None = None
    """NCCL_IB_TIMEOUT (1-31): verbs timeout exponent (4.096 us * 2^n); raise on large/congested fabrics."""
    ib_retry_cnt: int | None = None
    """NCCL_IB_RETRY_CNT (0-7, NCCL's default 7): verbs retries before an error; a 3-bit field, so a larger
    value would be masked by the driver to fewer retries."""
    buffsize_bytes: int | None = None
    """NCCL_BUFFSIZE (bytes, below 2 GiB): per-channel buffer; larger can help bandwidth at the cost of memory."""
    nvls: bool | None = None
    """NCCL_NVLS_ENABLE: NVLink SHARP on NVSwitch systems; unset = NCCL decides."""
    nccl_debug: str = "WARN"
    """NCCL_DEBUG: WARN for production, INFO to see which transport and rings NCCL picked."""
    async_error_handling: bool = True
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=1: a failed collective aborts the job instead of hanging."""
    dump_on_timeout: bool = True
    """TORCH_NCCL_DUMP_ON_TIMEOUT: who was stuck where when a collective timed out. The flight recorder's size
    is not exported here: torch 2.8 renamed its variable and warns on every rank about the old name, and only the
    job knows the nodes' torch, so the job sets it (embodyhpc.parallel.flight_recorder.set_flight_recorder_size). A size
    set in extra_env or site.env under either name is kept, under the name that torch reads. The training job also
    points the dumps into the run (logs/flight-recorder/<job id>/, TORCH_FR_DUMP_TEMP_FILE) unless one of them
    sets TORCH_FR_DUMP_TEMP_FILE (or its old name, TORCH_NCCL_DEBUG_INFO_TEMP_FILE) itself."""
    heartbeat_timeout_s: int = 600
    """TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC: watchdog kills a hung process group after this long."""
    extra_env: dict[str, str] = field(default_factory=dict)
    """Anything else, exported verbatim (names validated, values quoted; the numeric NCCL ones must be in the
    range NCCL accepts, see embodyhpc.config.nccl_values)."""

    def __post_init__(self) -> None:
        checks.choice("network.fabric", self.fabric, FABRICS)
        checks.choice("network.nccl_debug", self.nccl_debug, NCCL_DEBUG_LEVELS)
        if self.fabric in ("ethernet", "efa") and self.hcas:
            raise ConfigError(f"fabric {self.fabric!r} does not use RDMA devices", key="network.hcas",
                              related=("network.fabric",), fix="set network.fabric=ib or roce, or remove network.hcas")
        checks.positive("network.heartbeat_timeout_s", self.heartbeat_timeout_s)
        checks.env_names("network.extra_env", dict(self.extra_env))
        nccl_values.check_environment(self.environment(), self.key_of)

    def key_of(self, name: str) -> str:
        """The recipe key that sets variable `name` (extra_env wins over a typed field, as in environment())."""
        if name in self.extra_env:
            return f"network.extra_env.{name}"
        return _FIELD_KEYS.get(name, "network")

    def conflicts(self, environ: Mapping[str, str]) -> dict[str, tuple[str, str]]:
        """{name: (value in `environ`, value of this profile)} where the two disagree."""
        return {name: (environ[name], value) for name, value in self.environment().items()
                if name in environ and environ[name] != value}

    def environment(self) -> dict[str, str]:
        """The variables every rank of a job gets, in a stable order."""
        env: dict[str, str] = {}
        if self.fabric == "ethernet":
            env["NCCL_IB_DISABLE"] = "1"
        elif self.fabric in ("ib", "roce"):
            env["NCCL_IB_DISABLE"] = "0"
        elif self.fabric == "efa":
            env["FI_PROVIDER"] = "efa"
            env["FI_EFA_USE_DEVICE_RDMA"] = "1"
        if self.hcas:
            env["NCCL_IB_HCA"] = ",".join(self.hcas)
        if self.gid_index is not None:
            env["NCCL_IB_GID_INDEX"] = str(self.gid_index)
        if self.socket_ifname:
            env["NCCL_SOCKET_IFNAME"] = self.socket_ifname
            if not self.socket_ifname.startswith("^"):
                env["GLOO_SOCKET_IFNAME"] = self.socket_ifname.removeprefix("=")
        optional = {
            "NCCL_NET_GDR_LEVEL": self.gdr_level,
            "NCCL_CROSS_NIC": self.cross_nic,
            "NCCL_IB_QPS_PER_CONNECTION": self.qps_per_connection,
            "NCCL_IB_TIMEOUT": self.ib_timeout,
            "NCCL_IB_RETRY_CNT": self.ib_retry_cnt,
            "NCCL_BUFFSIZE": self.buffsize_bytes,
        }
        env.update({k: str(v) for k, v in optional.items() if v is not None})
        if self.nvls is not None:
            env["NCCL_NVLS_ENABLE"] = "1" if self.nvls else "0"
        env["NCCL_DEBUG"] = self.nccl_debug
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "1" if self.async_error_handling else "0"
        if self.dump_on_timeout:  # the flight recorder's size: set in the job, under its torch's name
            env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
        env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(self.heartbeat_timeout_s)
        env.update({k: str(v) for k, v in self.extra_env.items()})
        return env
