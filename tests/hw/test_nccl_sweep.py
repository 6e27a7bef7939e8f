"""tools/nccl_sweep.py: bandwidth arithmetic, variants, table; a real sweep on the local 2-node Slurm cluster."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "nccl_sweep.py"
_spec = importlib.util.spec_from_file_location("nccl_sweep", TOOL)
sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sweep)


def _row(variant, op, size, busbw, time_s=1e-3):
    return {"variant": variant, "op": op, "size_bytes": size, "iters": 5, "time_s": time_s,
            "algbw_gbps": busbw, "busbw_gbps": busbw}


def test_bus_bandwidth_follows_the_nccl_tests_definitions():
    algbw = sweep.alg_bandwidth(4 * 10**9, 0.5)
    assert algbw == 8.0  # decimal GB/s
    assert sweep.bus_bandwidth("all_reduce", algbw, 2) == 8.0  # 2(n-1)/n = 1 on two ranks
    assert sweep.bus_bandwidth("all_reduce", algbw, 8) == 14.0  # 2 * 7/8
    assert sweep.bus_bandwidth("all_gather", algbw, 8) == 7.0  # 7/8
    assert sweep.bus_bandwidth("all_gather", algbw, 2) == 4.0
    assert sweep.bus_bandwidth("all_reduce", algbw, 1) == 0.0  # nothing moves on one rank
    assert sweep.alg_bandwidth(1024, 0.0) == 0.0
    with pytest.raises(ValueError):
        sweep.bus_bandwidth("broadcast", 1.0, 2)


def test_sizes_and_variants_parse():
    assert [sweep.parse_size(s) for s in ("1KiB", "64MiB", "4096", "1GB", "2k")] == [1024, 64 << 20, 4096, 10**9,
                                                                                    2048]
    assert sweep.format_size(64 << 20) == "64 MiB" and sweep.format_size(1000) == "1000 B"
    assert sweep.parse_variant("qps4:NCCL_IB_QPS_PER_CONNECTION=4, NCCL_BUFFSIZE=8388608") == (
        "qps4", {"NCCL_IB_QPS_PER_CONNECTION": "4", "NCCL_BUFFSIZE": "8388608"})
    assert sweep.parse_variant("base:") == ("base", {})
    for bad in ("noname", ":A=1", "x:A", "x:1A=2", "retry:NCCL_IB_RETRY_CNT=10", "qps:NCCL_IB_QPS_PER_CONNECTION=0x4",
                "socks:NCCL_SOCKET_NTHREADS=16,NCCL_NSOCKS_PERTHREAD=8"):
        with pytest.raises(ValueError):
            sweep.parse_variant(bad)
    with pytest.raises(ValueError):
        sweep.parse_size("12 parsecs")
    name, env = sweep.site_variant("example_ib")
    assert name == "site:example_ib" and env["NCCL_IB_HCA"] == "mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1"
    assert env["NCCL_IB_QPS_PER_CONNECTION"] == "4" and env["GLOO_SOCKET_IFNAME"] == "ib0"


def test_best_variant_is_judged_at_the_large_sizes_and_the_table_shows_every_row():
    rows = [_row("lat", "all_reduce", 1024, 0.9), _row("lat", "all_reduce", 64 << 20, 10.0),
            _row("bw", "all_reduce", 1024, 0.1), _row("bw", "all_reduce", 64 << 20, 40.0),
            _row("lat", "all_gather", 1024, 0.8), _row("lat", "all_gather", 64 << 20, 12.0),
            _row("bw", "all_gather", 1024, 0.1), _row("bw", "all_gather", 64 << 20, 30.0)]
    best = sweep.best_variant(rows)
    assert best == {"variant": "bw", "score_gbps": 35.0, "sizes_bytes": [64 << 20]}
    assert sweep.best_variant([]) is None
    table = sweep.format_table(rows, best).splitlines()
    assert table[0].split() == ["variant", "op", "size", "iters", "time_us", "algbw", "GB/s", "busbw", "GB/s"]
    assert len(table) == 2 + len(rows) + 1
    assert table[5].split() == ["bw", "all_reduce", "64", "MiB", "5", "1000.0", "40.000", "40.000"]
    assert table[-1] == "best: bw (mean bus bandwidth 35.000 GB/s at 64 MiB)"


def test_worker_measures_on_one_process_without_slurm():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29731", NCCL_DEBUG="INFO")
    proc = subprocess.run([sys.executable, str(TOOL), "--worker", "--backend", "gloo", "--sizes", "1KiB,64KiB",
                           "--iters", "2", "--warmup", "1", "--variant-keys", "NCCL_DEBUG"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = [x for x in proc.stdout.splitlines() if x.startswith(sweep.RESULT_MARK)][0]
    out = json.loads(line[len(sweep.RESULT_MARK):])
    assert out["world_size"] == 1 and out["env_seen"] == {"NCCL_DEBUG": "INFO"}
    assert [(r["op"], r["size_bytes"]) for r in out["results"]] == [
        ("all_reduce", 1024), ("all_reduce", 65536), ("all_gather", 1024), ("all_gather", 65536)]
    assert all(r["algbw_gbps"] > 0 and r["busbw_gbps"] == 0 and r["iters"] >= 1 for r in out["results"])


@pytest.mark.slurm
@pytest.mark.xdist_group("slurm")  # one worker: the cluster has 2 nodes
def test_sweep_on_the_local_two_node_cluster(slurm_cluster):
    variants = {"small_buf": {"NCCL_BUFFSIZE": "1048576", "NCCL_DEBUG": "WARN"},
                "big_buf": {"NCCL_BUFFSIZE": "8388608", "NCCL_DEBUG": "INFO"}}
    command = [sys.executable, str(TOOL), "--json", "--backend", "gloo", "--nodes", "2", "--sizes", "1KiB,64KiB",
               "--iters", "3", "--warmup", "1", "--budget-s", "0.2", "--step-timeout-s", "100"]
    for name, env in variants.items():
        command += ["--variant", f"{name}:" + ",".join(f"{k}={v}" for k, v in env.items())]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=400,
                          env={**os.environ, "SLURM_CONF": slurm_cluster})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["errors"] == {} and report["env_seen"] == variants  # each step ran with its variables
    got = {(r["variant"], r["op"], r["size_bytes"]): r for r in report["results"]}
    assert set(got) == {(v, op, size) for v in variants for op in ("all_reduce", "all_gather")
                        for size in (1024, 65536)}
    for row in got.values():
        assert row["world_size"] == 2 and row["time_s"] > 0 and row["algbw_gbps"] > 0 and row["busbw_gbps"] > 0
        factor = 1.0 if row["op"] == "all_reduce" else 0.5  # 2(n-1)/n and (n-1)/n with n = 2
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
    assert report["best"]["variant"] in variants and report["best"]["env"] == variants[report["best"]["variant"]]
    assert "best: " in sweep.format_table(report["results"], report["best"])
