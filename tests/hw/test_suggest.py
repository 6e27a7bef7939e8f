"""`--suggest-network` turns each fake tree into a `network:` section that NetworkConfig accepts."""

from __future__ import annotations

from embodyhpc.config.network import NetworkConfig
from embodyhpc.hw.ib import read_ib_ports
from embodyhpc.hw.suggest import roce_v2_gid_index, suggest_network, suggest_network_with_reasons
from tests.hw import fake_sysfs as fs


def _valid(section: dict) -> dict:
    NetworkConfig(**section)  # raises ConfigError when the suggestion does not fit the schema
    return section


def test_ib_node_gives_every_rail(tmp_path):
    section = _valid(suggest_network(read_ib_ports(fs.ndr_ib_node(tmp_path))))
    assert section == {"fabric": "ib", "hcas": ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"]}
    env = NetworkConfig(**section).environment()
    assert env["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1" and env["NCCL_IB_DISABLE"] == "0"


def test_port_down_is_left_out_and_said_so(tmp_path):
    section, reasons = suggest_network_with_reasons(read_ib_ports(fs.port_down_node(tmp_path)))
    assert _valid(section) == {"fabric": "ib", "hcas": ["mlx5_0:1", "mlx5_1:1", "mlx5_3:1"]}
    assert any("mlx5_2:1" in r and "not ACTIVE" in r for r in reasons)


def test_roce_node_gives_the_ipv4_mapped_roce_v2_index(tmp_path):
    section = _valid(suggest_network(read_ib_ports(fs.roce_v2_node(tmp_path))))
    assert section == {"fabric": "roce", "hcas": ["mlx5_0:1", "mlx5_1:1"], "gid_index": 3}
    assert NetworkConfig(**section).environment()["NCCL_IB_GID_INDEX"] == "3"


def test_ipv4_mapped_v2_beats_a_lower_global_ipv6_v2_entry(tmp_path):
    table = fs.roce_gid_table("192.168.100.1", "ens1f0np0", v2_index=5)
    table[3] = ("fd00:0000:0000:0000:0000:0000:0000:0001", "RoCE v2", "ens1f0np0")
    table[4] = ("fd00:0000:0000:0000:0000:0000:0000:0001", "IB/RoCE v1", "ens1f0np0")
    fs.write_port(tmp_path, "mlx5_0", link_layer="Ethernet", rate="100 Gb/sec (4X EDR)", gids=table)
    port = read_ib_ports(tmp_path)[0]
    assert roce_v2_gid_index(port) == 5
    del table[5]
    fs.write_port(tmp_path, "mlx5_1", link_layer="Ethernet", rate="100 Gb/sec (4X EDR)", gids=table)
    assert roce_v2_gid_index(read_ib_ports(tmp_path)[1]) == 3  # global IPv6 is the fallback


def test_rails_that_disagree_on_the_index_keep_the_majority(tmp_path):
    for n, v2_index in enumerate((3, 3, 5)):
        fs.write_port(tmp_path, f"mlx5_{n}", link_layer="Ethernet", rate="200 Gb/sec (4X HDR)",
                      gids=fs.roce_gid_table(f"10.0.{n}.2", f"eth{n}", v2_index=v2_index))
    section, reasons = suggest_network_with_reasons(read_ib_ports(tmp_path))
    assert _valid(section) == {"fabric": "roce", "hcas": ["mlx5_0:1", "mlx5_1:1"], "gid_index": 3}
    assert any("left out mlx5_2:1" in r for r in reasons)


def test_link_local_only_roce_falls_back_to_ethernet(tmp_path):
    table = {k: v for k, v in fs.roce_gid_table("10.0.0.2", "eth0").items() if k < 2}
    fs.write_port(tmp_path, "mlx5_0", link_layer="Ethernet", rate="100 Gb/sec (4X EDR)", gids=table)
    section, reasons = suggest_network_with_reasons(read_ib_ports(tmp_path))
    assert _valid(section) == {"fabric": "ethernet"}
    assert any("no routable RoCE v2 GID" in r for r in reasons)


def test_ib_rails_win_over_an_ethernet_storage_nic_and_other_vendors(tmp_path):
    fs.ndr_ib_node(tmp_path)
    fs.write_port(tmp_path, "mlx5_4", link_layer="Ethernet", rate="200 Gb/sec (4X HDR)",
                  gids=fs.roce_gid_table("10.50.0.9", "ens9f0np0"))
    fs.write_port(tmp_path, "irdma0", link_layer="Ethernet", rate="25 Gb/sec (1X EDR)",
                  gids=fs.roce_gid_table("10.60.0.9", "eno1"))
    section, reasons = suggest_network_with_reasons(read_ib_ports(tmp_path))
    assert _valid(section)["hcas"] == ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1"]
    assert any("irdma0:1" in r for r in reasons) and any("mlx5_4:1" in r for r in reasons)


def test_no_rdma_devices_gives_ethernet(tmp_path):
    assert _valid(suggest_network(read_ib_ports(tmp_path / "none"))) == {"fabric": "ethernet"}
