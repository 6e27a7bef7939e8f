"""Numeric NCCL variables: every value NCCL would misread, clamp, mask or ignore is refused before a job exists,
whichever path sets it (typed network field, network.extra_env, site.env, a site file, an override, the
submitting shell), with one line naming the key and the range; values inside the ranges pass unchanged."""

from __future__ import annotations

import pytest

from embodyhpc.config import nccl_values
from embodyhpc.config.network import NetworkConfig
from embodyhpc.config.schema import SiteConfig
from embodyhpc.errors import ConfigError
from embodyhpc.validation import load_recipe

DEMO = "smoke_cpu"

# (variable, value, a fragment of the message): values NCCL would take as something else
NOT_INTEGERS = [(name, value, "not a plain decimal integer") for name, value in [
    ("NCCL_IB_RETRY_CNT", "7x"),  # strtoll stops at x: 7, and the typo goes unseen
    ("NCCL_IB_RETRY_CNT", "x7"),  # strtoll reads 0
    ("NCCL_IB_RETRY_CNT", "07"),  # octal
    ("NCCL_IB_TIMEOUT", "022"),  # octal: 18, not 22
    ("NCCL_IB_RETRY_CNT", "0x7"),  # hex
    ("NCCL_IB_RETRY_CNT", "+7"),
    ("NCCL_IB_RETRY_CNT", " 7"),
    ("NCCL_IB_RETRY_CNT", "7 "),
    ("NCCL_IB_RETRY_CNT", "7.0"),
    ("NCCL_IB_TIMEOUT", "1e1"),
    ("NCCL_IB_RETRY_CNT", "7_0"),  # Python's int() would take it
    ("NCCL_IB_RETRY_CNT", "٧"),  # ARABIC-INDIC DIGIT SEVEN: str.isdigit() and int() take it
    ("NCCL_IB_RETRY_CNT", ""),
    ("NCCL_IB_RETRY_CNT", "seven"),
    ("NCCL_IB_RETRY_CNT", "0b111"),
    ("NCCL_IB_DISABLE", "true"),  # a YAML boolean turned into text
    ("NCCL_IB_DISABLE", "false"),
    ("NCCL_P2P_DISABLE", "yes"),
    ("NCCL_BUFFSIZE", "4MiB"),
    ("NCCL_BUFFSIZE", "4194304.5"),
    ("TORCH_FR_BUFFER_SIZE", "2k"),
    ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "10m"),
]]

OUT_OF_RANGE = [(name, value, "out of range") for name, value in [
    ("NCCL_IB_RETRY_CNT", "10"),  # the shipped example_ib value: masked to 2 retries
    ("NCCL_IB_RETRY_CNT", "8"),
    ("NCCL_IB_RETRY_CNT", "-1"),
    ("NCCL_IB_TIMEOUT", "0"),  # wait forever
    ("NCCL_IB_TIMEOUT", "32"),
    ("NCCL_IB_TIMEOUT", "-5"),
    ("NCCL_IB_SL", "16"),
    ("NCCL_IB_TC", "256"),
    ("NCCL_IB_FIFO_TC", "1000"),
    ("NCCL_IB_GID_INDEX", "256"),  # the queue pair's sgid_index is 8 bits
    ("NCCL_IB_GID_INDEX", "-2"),  # -1 is NCCL's "find it", nothing else below 0
    ("NCCL_IB_QPS_PER_CONNECTION", "0"),
    ("NCCL_IB_QPS_PER_CONNECTION", "129"),
    ("NCCL_IB_DISABLE", "2"),
    ("NCCL_IB_PCI_RELAXED_ORDERING", "3"),
    ("NCCL_NET_GDR_READ", "2"),
    ("NCCL_CROSS_NIC", "3"),
    ("NCCL_NVLS_ENABLE", "3"),
    ("NCCL_NTHREADS", "32"),
    ("NCCL_NTHREADS", "100"),  # not whole warps
    ("NCCL_NTHREADS", "576"),
    ("NCCL_NTHREADS", "1024"),
    ("NCCL_LL128_NTHREADS", "128"),
    ("NCCL_MIN_NCHANNELS", "0"),
    ("NCCL_MAX_NCHANNELS", "65"),
    ("NCCL_MIN_CTAS", "0"),
    ("NCCL_MAX_CTAS", "128"),
    ("NCCL_BUFFSIZE", "0"),
    ("NCCL_BUFFSIZE", "-4194304"),
    ("NCCL_BUFFSIZE", "2147483648"),  # does not fit NCCL's int
    ("NCCL_LL_BUFFSIZE", "0"),
    ("NCCL_SOCKET_NTHREADS", "0"),
    ("NCCL_SOCKET_NTHREADS", "17"),
    ("NCCL_NSOCKS_PERTHREAD", "0"),
    ("NCCL_NSOCKS_PERTHREAD", "65"),
    ("NCCL_IB_AR_THRESHOLD", "-1"),
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "4"),
    ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "0"),
    ("TORCH_FR_BUFFER_SIZE", "-1"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "-2000"),
]]

BAD_LEVELS = [(name, value, "not a level NCCL knows") for name, value in [
    ("NCCL_P2P_LEVEL", "nvl"),  # NCCL compares case-sensitively and ignores an unknown name without a word
    ("NCCL_P2P_LEVEL", "NVLINK"),
    ("NCCL_P2P_LEVEL", "6"),  # legacy numbers stop at 5 (NCCL caps them silently)
    ("NCCL_P2P_LEVEL", "05"),
    ("NCCL_P2P_LEVEL", "-1"),
    ("NCCL_P2P_LEVEL", ""),
    ("NCCL_NET_GDR_LEVEL", "phb"),
    ("NCCL_NET_GDR_LEVEL", "NVL"),  # a P2P level, not a GPUDirect one
    ("NCCL_NET_GDR_LEVEL", "PHB "),
    ("NCCL_NET_GDR_LEVEL", "true"),
]]

HOSTILE = NOT_INTEGERS + OUT_OF_RANGE + BAD_LEVELS

# (variable, value): the ends of every range and the documented values, all accepted
GOOD = [("NCCL_IB_RETRY_CNT", "0"), ("NCCL_IB_RETRY_CNT", "7"), ("NCCL_IB_TIMEOUT", "1"), ("NCCL_IB_TIMEOUT", "31"),
        ("NCCL_IB_SL", "0"), ("NCCL_IB_SL", "15"), ("NCCL_IB_TC", "255"), ("NCCL_IB_GID_INDEX", "0"),
        ("NCCL_IB_GID_INDEX", "3"), ("NCCL_IB_GID_INDEX", "255"), ("NCCL_IB_GID_INDEX", "-1"),
        ("NCCL_IB_QPS_PER_CONNECTION", "1"), ("NCCL_IB_QPS_PER_CONNECTION", "128"),
        ("NCCL_NTHREADS", "64"), ("NCCL_NTHREADS", "96"), ("NCCL_NTHREADS", "512"), ("NCCL_MIN_NCHANNELS", "1"),
        ("NCCL_MAX_NCHANNELS", "64"), ("NCCL_MAX_CTAS", "64"), ("NCCL_BUFFSIZE", "8388608"),
        ("NCCL_BUFFSIZE", "2147483647"), ("NCCL_SOCKET_NTHREADS", "16"), ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_P2P_LEVEL", "NVL"), ("NCCL_P2P_LEVEL", "SYS"), ("NCCL_P2P_LEVEL", "0"), ("NCCL_P2P_LEVEL", "5"),
        ("NCCL_NET_GDR_LEVEL", "PHB"), ("NCCL_NET_GDR_LEVEL", "3"), ("NCCL_CROSS_NIC", "2"),
        ("NCCL_IB_DISABLE", "1"), ("TORCH_FR_BUFFER_SIZE", "0"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "0"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
        ("NCCL_ALGO", "Ring"), ("NCCL_IB_HCA", "=mlx5_0:1")]  # not numeric: exported as they are


def test_every_variable_of_the_table_has_hostile_cases():
    covered = {name for name, _, _ in HOSTILE}
    assert set(nccl_values.ACCEPTED) - covered <= {"NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_SPLIT_DATA_ON_QPS",
                                                   "NCCL_IB_MERGE_NICS", "NCCL_SHM_DISABLE", "NCCL_LL128_BUFFSIZE"}
    assert set(nccl_values.LEVELS) <= covered


@pytest.mark.parametrize(("name", "value", "message"), HOSTILE, ids=[f"{n}={v!r}" for n, v, _ in HOSTILE])
def test_hostile_value_in_extra_env_or_site_env_is_refused(name, value, message):
    with pytest.raises(ConfigError, match=message) as network_error:
        NetworkConfig(extra_env={name: value})
    text = network_error.value.one_line()
    assert f"network.extra_env.{name}:" in text and "fix: set network.extra_env." in text and "\n" not in text
    with pytest.raises(ConfigError, match=message) as site_error:
        SiteConfig(env={name: value})
    assert site_error.value.key == f"site.env.{name}"


@pytest.mark.parametrize(("name", "value"), GOOD, ids=[f"{n}={v}" for n, v in GOOD])
def test_values_in_range_pass_unchanged(name, value):
    assert NetworkConfig(extra_env={name: value}).environment()[name] == value
    assert SiteConfig(env={name: value}).env[name] == value


# typed network fields: the key in the message is the one the user wrote
BAD_FIELDS = [("network.ib_retry_cnt=10", "0-7"), ("network.ib_retry_cnt=-1", "0-7"),
              ("network.ib_timeout=0", "1-31"), ("network.ib_timeout=32", "1-31"),
              ("network.gid_index=256", "-1 (NCCL decides) or 0-255"),
              ("network.gid_index=-2", "-1 (NCCL decides) or 0-255"), ("network.qps_per_connection=0", "1-128"),
              ("network.buffsize_bytes=0", "1-2147483647"), ("network.buffsize_bytes=4294967296", "1-2147483647"),
              ("network.cross_nic=3", "0-2"), ("network.gdr_level=phb", "PHB"), ("network.gdr_level=NVL", "PHB"),
              ("network.gdr_level=9", "legacy 0-5")]


@pytest.mark.parametrize(("override", "fragment"), BAD_FIELDS, ids=[o for o, _ in BAD_FIELDS])
@pytest.mark.parametrize("command", ["validate", "render"])
def test_typed_field_out_of_range_exits_2_naming_override_key_and_range(cli, command, override, fragment):
    result = cli(command, DEMO, override)
    key = override.partition("=")[0]
    lines = result.err.strip().splitlines()
    assert result.code == 2 and result.out == "" and len(lines) == 1, result
    assert lines[0].startswith(f"error: override {override!r}: {key}: ") and fragment in lines[0]
    assert f"fix: set {key}" in lines[0]


OVERRIDE_PATHS = [
    ("network.extra_env.NCCL_IB_RETRY_CNT=10", "network.extra_env.NCCL_IB_RETRY_CNT", "out of range: 0-7"),
    ("network.extra_env={NCCL_IB_TIMEOUT: '022'}", "network.extra_env.NCCL_IB_TIMEOUT", "not a plain decimal"),
    ("site.env.NCCL_IB_SL=16", "site.env.NCCL_IB_SL", "out of range: 0-15"),
    ("site.env.NCCL_NTHREADS=100", "site.env.NCCL_NTHREADS", "a multiple of 32"),
    ("network.extra_env.NCCL_IB_DISABLE=yes", "network.extra_env.NCCL_IB_DISABLE", "write 1 for true"),
    ("site.env={NCCL_P2P_LEVEL: nvl}", "site.env.NCCL_P2P_LEVEL", "not a level"),
]


@pytest.mark.parametrize(("override", "key", "fragment"), OVERRIDE_PATHS, ids=[o for o, _, _ in OVERRIDE_PATHS])
def test_env_overrides_hit_the_same_check_and_submit_nothing(cli, runs_root, override, key, fragment):
    for args in (("validate", DEMO, override), ("submit", DEMO, "--local", f"job.runs_root={runs_root}", override)):
        result = cli(*args)
        lines = result.err.strip().splitlines()
        assert result.code == 2 and len(lines) == 1, result
        assert f"override {override!r}: {key}: " in lines[0] and fragment in lines[0] and "(fix: " in lines[0]
    assert list(runs_root.iterdir()) == []


def test_site_file_names_itself(cli, tmp_path):
    site = tmp_path / "cluster.yaml"
    site.write_text("site: {name: c, env: {NCCL_SOCKET_NTHREADS: '4'}}\n"
                    "network: {fabric: ib, ib_retry_cnt: 10, ib_timeout: 22}\n")
    result = cli("render", DEMO, "--site", str(site))
    assert result.code == 2
    assert result.err.startswith(f"error: {site}: network.ib_retry_cnt: NCCL_IB_RETRY_CNT=10 is out of range: 0-7")


PAIRS = [
    ({"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "8"}, "at most 64 sockets"),
    ({"NCCL_SOCKET_NTHREADS": "8", "NCCL_NSOCKS_PERTHREAD": "9"}, "at most 64 sockets"),
    ({"NCCL_MIN_NCHANNELS": "32", "NCCL_MAX_NCHANNELS": "16"}, "minimum is at most the maximum"),
    ({"NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "4"}, "minimum is at most the maximum"),
    ({"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, "set one of them"),
]


@pytest.mark.parametrize(("env", "message"), PAIRS, ids=[m for _, m in PAIRS])
def test_pairs_within_a_section_and_split_across_sections(cli, env, message):
    with pytest.raises(ConfigError, match=message):
        NetworkConfig(extra_env=env)
    with pytest.raises(ConfigError, match=message):
        SiteConfig(env=env)
    (first, first_value), (second, second_value) = env.items()
    result = cli("validate", DEMO, f"site.env.{first}={first_value}", f"network.extra_env.{second}={second_value}")
    assert result.code == 2 and message in result.err and f"network.extra_env.{second}" in result.err, result
    assert NetworkConfig(extra_env={"NCCL_SOCKET_NTHREADS": "16", "NCCL_NSOCKS_PERTHREAD": "4"})  # 64 is allowed


def test_shipped_sites_are_in_range_and_example_ib_retries_7_times():
    for site in ("example_ib", "example_roce", "example_tcp", "local"):
        loaded = load_recipe("pi05_bf16", ["site.account=a", "data.root=/d", "model.tokenizer_path=/t.model"],
                             site=site)
        assert loaded.config.network.environment()  # built and checked
    ib = load_recipe("pi05_bf16", ["site.account=a", "data.root=/d", "model.tokenizer_path=/t.model"],
                     site="example_ib").config.network.environment()
    assert ib["NCCL_IB_RETRY_CNT"] == "7" and ib["NCCL_IB_TIMEOUT"] == "22"


def test_submitting_shell_with_an_out_of_range_variable_is_refused(cli, runs_root, monkeypatch):
    """The profile does not set it, so the job would inherit it: the same ranges apply."""
    monkeypatch.setenv("NCCL_IB_RETRY_CNT", "10")
    result = cli("submit", DEMO, "--local", f"job.runs_root={runs_root}")
    assert result.code == 2 and list(runs_root.iterdir()) == []
    assert result.err.strip() == ("error: your environment: NCCL_IB_RETRY_CNT: NCCL_IB_RETRY_CNT=10 is out of range: "
                                  "0-7 (the queue pair's 3-bit retry count; drivers mask larger values) (fix: unset "
                                  "NCCL_IB_RETRY_CNT, or set network.extra_env.NCCL_IB_RETRY_CNT to a value in 0-7)")


@pytest.mark.parametrize(("overrides", "line"), [
    (["network.fabric=roce", "network.gid_index=-1"], "export NCCL_IB_GID_INDEX=-1"),
    (["network.fabric=roce", "network.gid_index=3"], "export NCCL_IB_GID_INDEX=3"),
    (["network.fabric=roce"], None),  # unset: not exported, NCCL finds the RoCE v2 GID
])
def test_roce_renders_with_or_without_a_gid_index(cli, overrides, line):
    result = cli("render", DEMO, *overrides)
    assert result.code == 0, result
    exported = [row for row in result.out.splitlines() if "NCCL_IB_GID_INDEX" in row]
    assert exported == ([line] if line else []) and "export NCCL_IB_DISABLE=0" in result.out.splitlines()
