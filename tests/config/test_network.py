"""Network profiles: the exact environment each fabric exports, and conflicts with a user's shell."""

from __future__ import annotations

import pytest

from embodyhpc.config.network import NetworkConfig
from embodyhpc.errors import ConfigError


def test_ib_profile_environment_exactly():
    env = NetworkConfig(fabric="ib", hcas=["mlx5_0:1", "mlx5_1:1"], socket_ifname="ib0", gdr_level="PHB",
                        cross_nic=0, qps_per_connection=4, ib_timeout=22, ib_retry_cnt=7, nvls=False,
                        extra_env={"NCCL_ALGO": "Ring"}).environment()
    assert env == {
        "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1", "NCCL_SOCKET_IFNAME": "ib0",
        "GLOO_SOCKET_IFNAME": "ib0", "NCCL_NET_GDR_LEVEL": "PHB", "NCCL_CROSS_NIC": "0",
        "NCCL_IB_QPS_PER_CONNECTION": "4", "NCCL_IB_TIMEOUT": "22", "NCCL_IB_RETRY_CNT": "7",
        "NCCL_NVLS_ENABLE": "0", "NCCL_DEBUG": "WARN", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "600", "NCCL_ALGO": "Ring"}


def test_roce_leaves_the_gid_to_nccl_unless_told():
    """NCCL (>= 2.21) finds the RoCE v2 GID itself: NCCL_IB_GID_INDEX defaults to -1 (NCCL's connect.cc:
    NCCL_PARAM(IbGidIndex, "IB_GID_INDEX", -1), and only a negative index makes it search the GID table)."""
    auto = NetworkConfig(fabric="roce", hcas=["mlx5_0:1"]).environment()
    assert "NCCL_IB_GID_INDEX" not in auto and auto["NCCL_IB_DISABLE"] == "0"
    # -1 is exported: it overrides an index inherited from a node's profile, as NCCL's own default would
    assert NetworkConfig(fabric="roce", gid_index=-1).environment()["NCCL_IB_GID_INDEX"] == "-1"
    for index in (0, 3, 255):
        env = NetworkConfig(fabric="roce", gid_index=index, hcas=["mlx5_0:1"]).environment()
        assert env["NCCL_IB_GID_INDEX"] == str(index)


@pytest.mark.parametrize("index", [-2, -100, 256, 1000, True, False, 3.0, 2.5, "three", "", " 3", "0x3", "03"],
                         ids=repr)
def test_other_gid_indexes_are_refused_naming_the_key(index):
    """What NCCL would misread: a GID table index is 8 bits (the queue pair's sgid_index), -1 asks NCCL, and
    strtoll would read True/False/'0x3'/'03' as something else."""
    with pytest.raises(ConfigError, match="NCCL_IB_GID_INDEX=.*(out of range: -1 .NCCL decides. or 0-255|not a "
                                          "plain decimal integer)") as info:
        NetworkConfig(fabric="roce", gid_index=index)
    text = info.value.one_line()
    assert text.startswith("network.gid_index: ") and "fix: set network.gid_index" in text and "\n" not in text


def test_tcp_and_efa_profiles():
    tcp = NetworkConfig(fabric="ethernet", socket_ifname="^lo,docker").environment()
    assert tcp["NCCL_IB_DISABLE"] == "1" and tcp["NCCL_SOCKET_IFNAME"] == "^lo,docker"
    assert "GLOO_SOCKET_IFNAME" not in tcp  # Gloo has no exclusion lists
    assert NetworkConfig(socket_ifname="=eth0").environment()["GLOO_SOCKET_IFNAME"] == "eth0"
    efa = NetworkConfig(fabric="efa").environment()
    assert efa["FI_PROVIDER"] == "efa" and "NCCL_IB_DISABLE" not in efa
    with pytest.raises(ConfigError, match="does not use RDMA"):
        NetworkConfig(fabric="ethernet", hcas=["mlx5_0:1"])


def test_conflicts_only_where_values_differ():
    profile = NetworkConfig(fabric="ib", hcas=["mlx5_0:1"])
    assert profile.conflicts({"NCCL_IB_HCA": "mlx5_0:1", "NCCL_DEBUG": "INFO", "HOME": "/root"}) == {
        "NCCL_DEBUG": ("INFO", "WARN")}
