"""InfiniBand/RoCE ports read from fake sysfs trees, and the checks against the rails a job uses."""

from __future__ import annotations

from embodyhpc.hw.checks import Status
from embodyhpc.hw.ib import IbPort, read_ib_ports
from embodyhpc.hw.ib_checks import HcaSpec, check_ib
from tests.hw import fake_sysfs as fs


def _statuses(checks):
    return [(c.name, c.status.value) for c in checks]


def test_ndr_ib_node_is_read_as_the_kernel_shows_it(tmp_path):
    ports = read_ib_ports(fs.ndr_ib_node(tmp_path))
    assert [p.name for p in ports] == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"]
    port = ports[0]
    assert (port.state, port.phys_state, port.rate, port.link_layer) == (
        "ACTIVE", "LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    assert port.active and port.rate_gbps == 400.0
    # only the populated GID slot; IB GIDs have no netdev
    assert [(g.index, g.gid, g.type, g.ndev) for g in port.gids] == [(0, fs.ib_gid(0), "IB/RoCE v1", None)]
    checks = check_ib(ports)
    assert _statuses(checks) == [("ib", "ok")]
    assert "4/4 ports ACTIVE (InfiniBand 400 Gb/sec (4X NDR))" in checks[0].reason


def test_devices_sort_naturally(tmp_path):
    for n in (10, 2, 1):
        fs.write_port(tmp_path, f"mlx5_{n}")
    fs.write_port(tmp_path, "mlx5_1", port=2)
    assert [p.name for p in read_ib_ports(tmp_path)] == ["mlx5_1:1", "mlx5_1:2", "mlx5_2:1", "mlx5_10:1"]


def test_roce_node_gid_table(tmp_path):
    ports = read_ib_ports(fs.roce_v2_node(tmp_path))
    port = ports[0]
    assert port.link_layer == "Ethernet" and port.rate_gbps == 200.0
    assert [(g.index, g.type, g.ndev) for g in port.gids] == [
        (0, "IB/RoCE v1", "ens1f0np0"), (1, "RoCE v2", "ens1f0np0"),
        (2, "IB/RoCE v1", "ens1f0np0"), (3, "RoCE v2", "ens1f0np0")]
    assert port.gid(3).gid == "0000:0000:0000:0000:0000:ffff:0a0a:0011" and port.gid(3).ipv4 == "10.10.0.17"
    assert port.gid(1).ipv4 is None and port.gid(1).link_local
    assert ports[1].gid(3).ipv4 == "10.11.0.17"
    assert _statuses(check_ib(ports, gid_index=3)) == [("ib", "ok")]


def test_wrong_gid_index_fails_with_the_setting_to_fix(tmp_path):
    ports = read_ib_ports(fs.roce_v2_node(tmp_path))
    v1 = check_ib(ports, gid_index=2)
    assert _statuses(v1)[1:] == [("ib.mlx5_0:1", "fail"), ("ib.mlx5_1:1", "fail")]
    assert "GID index 2 is IB/RoCE v1, not RoCE v2 (NCCL_IB_GID_INDEX)" in v1[1].reason
    empty = check_ib(ports, gid_index=7, from_profile=True)
    assert "has no GID at index 7 (network.gid_index)" in empty[1].reason


def test_gid_index_minus_one_leaves_the_gid_to_nccl(tmp_path):
    """network.gid_index=-1 (or NCCL_IB_GID_INDEX=-1 exported): NCCL searches the GID table itself, so no index
    is judged; the ports' own checks remain."""
    ports = read_ib_ports(fs.roce_v2_node(tmp_path))
    assert check_ib(ports, fabric="roce", gid_index=-1, from_profile=True) == check_ib(ports, fabric="roce",
                                                                                        from_profile=True)
    assert _statuses(check_ib(ports, gid_index=-1)) == [("ib", "ok")]


def test_port_down_warns_without_a_rail_list_and_fails_with_one(tmp_path):
    ports = read_ib_ports(fs.port_down_node(tmp_path))
    assert ports[2].state == "DOWN" and ports[2].phys_state == "Polling" and not ports[2].active
    loose = check_ib(ports)
    assert _statuses(loose) == [("ib", "ok"), ("ib.mlx5_2:1", "warn")]
    assert loose[0].reason.startswith("3/4 ports ACTIVE")
    assert loose[1].reason == "mlx5_2 port 1 is DOWN (phys Polling: no cable or no peer)"
    strict = check_ib(ports, hcas=["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"], fabric="ib", from_profile=True)
    assert ("ib.mlx5_2:1", "fail") in _statuses(strict)
    # a rail list that leaves the dead port out is fine
    assert _statuses(check_ib(ports, hcas="mlx5_0,mlx5_1,mlx5_3")) == [("ib", "ok")]


def test_init_state_means_no_subnet_manager(tmp_path):
    fs.write_port(tmp_path, "mlx5_0", state="2: INIT")
    check = check_ib(read_ib_ports(tmp_path), hcas="mlx5_0:1")[-1]
    assert check.status is Status.FAIL and "no subnet manager" in check.reason


def test_degraded_rail_rate_warns(tmp_path):
    ports = read_ib_ports(fs.ndr_ib_node(tmp_path, rates={"mlx5_3": "200 Gb/sec (4X HDR)"}))
    checks = check_ib(ports)
    assert ("ib.mlx5_3:1", "warn") in _statuses(checks)
    assert "other InfiniBand rails at 400 Gb/sec" in checks[-1].reason


def test_rail_list_entries_that_match_nothing_fail(tmp_path):
    ports = read_ib_ports(fs.ndr_ib_node(tmp_path))
    checks = check_ib(ports, hcas="=mlx5_0:1,mlx5_7:1")
    assert ("ib", "fail") in _statuses(checks)
    assert any("NCCL_IB_HCA entry mlx5_7:1 matches no RDMA port" in c.reason for c in checks)


def test_fabric_link_layer_mismatch_fails(tmp_path):
    ports = read_ib_ports(fs.roce_v2_node(tmp_path))
    checks = check_ib(ports, hcas=["mlx5_0:1"], fabric="ib", from_profile=True)
    assert ("ib.mlx5_0:1", "fail") in _statuses(checks)
    assert "link layer Ethernet, fabric ib needs InfiniBand" in checks[-1].reason


def test_ib_disabled_while_rails_are_up_warns(tmp_path):
    ports = read_ib_ports(fs.ndr_ib_node(tmp_path))
    assert ("ib", "warn") in _statuses(check_ib(ports, ib_disabled=True))


def test_node_without_rdma_devices(tmp_path):
    assert read_ib_ports(tmp_path / "missing") == []
    plain = check_ib([], root=str(tmp_path))
    assert _statuses(plain) == [("ib", "ok")] and "NCCL will use TCP sockets" in plain[0].reason
    expected = check_ib([], fabric="ib", from_profile=True)
    assert expected[0].status is Status.FAIL and "the job expects fabric ib" in expected[0].reason


def test_hca_spec_parsing():
    spec = HcaSpec.parse("^=mlx5_4,mlx5_5:1")
    assert spec.exclude and spec.exact and spec.entries == (("mlx5_4", None), ("mlx5_5", 1))
    assert HcaSpec.parse("") is None and HcaSpec.parse(None) is None
    prefix = HcaSpec.parse(["mlx5"])
    port = IbPort("mlx5_12", 1, "ACTIVE", "LinkUp", "400 Gb/sec (4X NDR)", "InfiniBand")
    assert prefix.select([port]) == ([port], [])
    assert HcaSpec.parse("^mlx5_12").select([port]) == ([], [])


def test_unreadable_attributes_do_not_crash(tmp_path):
    port_dir = fs.write_port(tmp_path, "mlx5_0", link_layer="Ethernet",
                             gids={3: (fs.ipv4_mapped("10.0.0.1"), "RoCE v2", "eth0")})
    (port_dir / "rate").unlink()
    (port_dir / "rate").mkdir()  # reading it fails, as sysfs attributes do with EINVAL
    (port_dir / "gid_attrs" / "ndevs" / "3").unlink()
    port = read_ib_ports(tmp_path)[0]
    assert port.rate == "unknown" and port.rate_gbps is None
    assert port.gid(3).type == "RoCE v2" and port.gid(3).ndev is None
