"""Hardware preflight ("embodyhpc doctor"): GPUs through NVML, InfiniBand/RoCE ports from sysfs,
the runs-root filesystem, node-local NVMe, torch/NCCL versions and the exported NCCL variables.

Nothing here imports torch or nvidia-ml-py at module load; both are optional and probed lazily.
"""

from embodyhpc.hw.checks import Check, Status
from embodyhpc.hw.doctor import DoctorOptions, DoctorReport, recipe_scope, run_doctor
from embodyhpc.hw.gpu import GpuBackend, GpuHealth, GpuSample, NoGpuBackend, open_gpu_backend
from embodyhpc.hw.ib import GidEntry, IbPort, read_ib_ports
from embodyhpc.hw.preflight import NodeUnhealthy, PreflightResult, preflight, run_preflight_for_job
from embodyhpc.hw.report import nodes_to_exclude
from embodyhpc.hw.suggest import suggest_network, suggest_network_with_reasons

__all__ = [
    "Check", "DoctorOptions", "DoctorReport", "GidEntry", "GpuBackend", "GpuHealth", "GpuSample", "IbPort",
    "NoGpuBackend", "NodeUnhealthy", "PreflightResult", "Status", "nodes_to_exclude", "open_gpu_backend", "preflight",
    "read_ib_ports", "recipe_scope", "run_doctor", "run_preflight_for_job", "suggest_network",
    "suggest_network_with_reasons",
]
