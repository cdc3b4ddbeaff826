"""Issue 14, item 6: every bench in bench/ takes `--plot PATH` and turns its results into figures.

Each bench's `plot` is fed results of the shape its run produces; what it hands to
`bench/plot.save` (the panels) is checked against those results, so a figure cannot show
one number while the table prints another. When matplotlib (the `bench` extra) is
installed, the PNG is drawn too and must be a real, small PNG.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import plot  # noqa: E402

HELPERS = {"plot", "index_trace"}  # modules the benches import, not benches (index_study.py's trace)
BENCHES = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)


@pytest.fixture
def saved(monkeypatch):
    """Captures what a bench hands to plot.save instead of drawing it."""
    calls: list[dict] = []

    def fake_save(path, panels, title, note=""):
        calls.append({"path": path, "panels": panels, "title": title, "note": note})
        for p in panels:  # the shape save() itself requires
            assert all(len(v) == len(p.categories) for v in p.series.values()), p
            assert not p.labels or len(p.labels) == len(p.categories), p
        return Path(path)

    monkeypatch.setattr(plot, "save", fake_save)
    return calls


def bench(name: str):
    module = importlib.import_module(name)
    if hasattr(module, "save"):
        module.save = plot.save  # the module bound save at import: rebind to the patched one
    return module


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_takes_plot_path(name):
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--help"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "--plot PATH" in out.stdout, out.stdout


def test_vs_redis_pairs_each_workload_with_its_ratio(saved):
    rows = [("SET -c 50", 40_000.0, 30_000.0), ("GET -c 50 -P 16", 600_000.0, 150_000.0),
            ("SET 1 MiB -c 50", 1700.0, 1870.0)]
    bench("vs_redis").plot("x.png", rows, 3, 168, 212)
    small, large = saved[0]["panels"]
    assert small.categories == ["SET -c 50", "GET -c 50 -P 16"] and large.categories == ["SET 1 MiB -c 50"]
    assert small.series == {"redis-server": [40_000.0, 600_000.0], "quilld": [30_000.0, 150_000.0]}
    assert small.labels == ["0.75x", "0.25x"] and large.labels == ["1.10x"]
    assert "noisy" in saved[0]["note"] and "168 B" in saved[0]["note"]


def test_get_into_draws_mooncake_only_when_measured(saved):
    m = bench("get_into_bench")
    gets = {(s, k): 1.0 + i for i, s in enumerate(m.SIZES) for k in ("redis-py get", "redis-py pipeline x16",
                                                                     "get_many_into x16")}
    gets |= {(s, "get_into"): 2.0 + 2 * i for i, s in enumerate(m.SIZES)}
    puts = {(s, k): 1.0 for s in m.SIZES for k in ("redis-py set", "put", "put_blocks x16")}
    m.plot("x.png", gets, puts, None, 16, 1)
    assert len(saved[-1]["panels"]) == 2
    assert saved[-1]["panels"][0].labels == ["2.00x"] * len(m.SIZES)
    mc = {(who, s, op): (1.0 if who == "mooncake" else 1.5) for who in ("mooncake", "quilld")
          for s in m.MOONCAKE_SIZES for op in ("put", "get", "batch put", "batch get")}
    m.plot("x.png", gets, puts, mc, 16, 1)
    reads, writes = saved[-1]["panels"][2:]
    assert reads.series["quilld"] == [1.5] * 2 * len(m.MOONCAKE_SIZES) and reads.labels[0] == "1.50x"
    assert "x16 get" in reads.categories[-1] and "put" in writes.categories[0]


def test_ssd_bench_compares_with_dd_and_raw_reads(saved):
    rows = [{"demote_MBps": 700.0, "ingest_MBps": 560.0, "set_nossd_MBps": 900.0, "get_dram": 1.5,
             "get_off_cold": 0.3, "get_off_warm": 0.8, "get_on_cold": 0.35}]
    rec = {"empty_ms": [30], "empty_wall": [0.7], "wal_ms": [1990], "wal_wall": [5.5], "ckpt_ms": [1560],
           "ckpt_wall": [4.3], "wal_blocks": 100_352}
    bench("ssd_bench").plot("x.png", [1400.0], [720.0], [500.0], [0.6], rows, rec, True, "ext4 on /dev/vda", 1)
    writes, reads, restart = saved[0]["panels"]
    assert writes.series["MB/s"][0] == 1400.0 and writes.labels[3] == "0.50x"  # demotion / dd
    assert reads.labels[2] == "0.50x"  # SSD GET cold / raw preads
    assert restart.series["recovery"] == [0.03, 1.99, 1.56] and "100,352" in restart.title


def test_cluster_events_gateway_route_alloc(saved):
    bench("cluster_bench").plot("x.png", [(1, 3.8, 2.0, 0.7, 0.4)], [(3, 2.0, 4.0, 1.1)], 3)
    assert saved[-1]["panels"][0].labels == ["0.18x"] and len(saved[-1]["panels"]) == 3
    bench("events_bench").plot("x.png", {1: 30_000.0, 64: 120_000.0}, [("at rest", 0.5, 1.0)], 40_000)
    assert saved[-1]["panels"][0].series == {"events/s": [30_000.0, 120_000.0]}

    import argparse

    args = argparse.Namespace(concurrency=16, requests=300, rounds=1, seconds=2.0)
    bench("gateway_bench").plot("x.png", {"direct": [1.0, 2.0], "gateway": [2.0, 3.0]},
                                {"direct": [1000.0], "gateway": [400.0]}, args)
    assert saved[-1]["panels"][1].labels == ["1.00x", "0.40x"]
    resp = {"redis-py GET": (40.0, 80.0), "redis-py ROUTE json": (70.0, 140.0),
            "raw GET": (20.0, 40.0), "raw ROUTE PACKED": (50.0, 90.0)}
    bench("route_bench").plot("x.png", [("in-process", 80.0, 300.0)], resp, (30_400, 28_333, 0, 16_696), 623_000)
    ratios = saved[-1]["panels"][1].series
    assert ratios["JSON"] == [1.75, 0.0, 0.0] and ratios["PACKED"] == [0.0, 2.5, 0.0], ratios
    assert saved[-1]["panels"][2].series["across identities"] == [28_333, 0]
    bench("alloc_bench").plot("x.png", [(2.0, 500, 0.2)], 1_000_000)
    assert saved[-1]["panels"][0].series == {"ops/s": [500_000.0]}
    points = {"aggregated": [(5.0, 0.98), (10.0, 0.85)], "always": [(5.0, 1.0), (10.0, 0.5)],
              "auto": [(5.0, 1.0), (10.0, 0.95)]}
    disagg = bench("disagg_bench")
    disagg.plot("x.png", points, {"aggregated": 8.0, "always": 8.5, "auto": 10.0}, argparse.Namespace(
        ttft_slo_ms=1000.0, tpot_slo_ms=50.0, seconds=10.0))
    goodput, kept = saved[-1]["panels"]
    assert goodput.categories == ["5/s", "10/s"] and goodput.series["auto"] == [100.0, 95.0]
    assert kept.series == {"requests/s": [8.0, 8.5, 10.0]} and kept.labels == ["1.00x", "1.06x", "1.25x"]
    assert disagg.rate_at(points["aggregated"]) == pytest.approx(5.0 + 5.0 * (0.98 - 0.9) / (0.98 - 0.85))
    assert disagg.rate_at(points["auto"]) == 10.0 and disagg.rate_at([(5.0, 0.5)]) == 0.0


def test_dram_bound_bench_draws_each_tree_per_case(saved):
    m = bench("dram_bound_bench")
    MiB = m.MiB

    def run(peak, rss, errors=0, refused=0, evicted=0, cpu=1.0):
        return {"used_peak": peak * MiB, "used": 30 * MiB, "rss": rss * MiB, "evicted": evicted, "demoted": 9,
                "ssd_keys": 9, "errors": errors, "refused": refused, "keys": 9, "cpu_s": cpu}

    rows = [("this", "small", True, run(32.5, 165)), ("this", "block-ttl", True, run(33.0, 300, refused=4)),
            ("this", "small", False, run(32.0, 120, evicted=90_000, cpu=2.0))]
    m.plot("x.png", rows, 100_000)
    peak, rss, counts, cpu = saved[-1]["panels"]
    assert peak.categories == ["small", "block-ttl", "small, no SSD"] and peak.series == {"this": [32.5, 33.0, 32.0]}
    assert peak.labels == ["1.02x", "1.03x", "1.00x"] and "peak / maxmemory" in peak.title  # one tree: vs 32 MiB
    assert rss.series == {"this": [165.0, 300.0, 120.0]} and cpu.series == {"this": [1.0, 1.0, 2.0]}
    assert counts.series == {"writes -OOM": [0, 0, 0], "other client refused": [0, 4, 0], "evicted": [0, 0, 90_000]}
    assert "100,000 values" in saved[-1]["title"]
    two = [("main", "small", True, run(391.0, 473, errors=7)), ("new", "small", True, run(32.5, 165))]
    m.plot("x.png", two, 100_000)
    peak, rss, counts, _ = saved[-1]["panels"]
    assert peak.series == {"main": [391.0], "new": [32.5]} and peak.labels == ["0.08x"] and "new / main" in peak.title
    assert counts.series["main writes -OOM"] == [7] and counts.series["new writes -OOM"] == [0]


def test_sglang_bench_pairs_each_page_size_with_both_ratios(saved):
    import argparse

    m = bench("sglang_bench")
    sizes = [256 * m.KiB, 2 * m.MiB]
    speeds = {"file": (900.0, 3900.0), "quilld generic": (1800.0, 2400.0), "quilld v1": (2700.0, 7800.0)}
    summary = {}
    for i, size in enumerate(sizes):
        for side, (write, read) in speeds.items():
            summary |= {(size, side, "write"): write * (i + 1), (size, side, "read"): read * (i + 1),
                        (size, side, "write cpu"): 0.0002 * (i + 1), (size, side, "read cpu"): 0.0001 * (i + 1)}
    args = argparse.Namespace(pages=128, rounds=5, tcp=False, layout="page_first")
    m.plot("x.png", summary, sizes, args, False)
    writes, reads, write_cpu, read_cpu = saved[-1]["panels"]
    assert writes.categories == ["256 KiB", "2 MiB"] and list(writes.series) == list(m.SIDES)
    assert writes.series["file"] == [900.0, 1800.0] and writes.series["quilld v1"] == [2700.0, 5400.0]
    assert writes.labels == ["2.00x | 3.00x"] * 2 and reads.labels == ["0.62x | 2.00x"] * 2
    assert write_cpu.series["quilld generic"] == pytest.approx([0.2, 0.4])
    assert read_cpu.series["file"] == pytest.approx([0.1, 0.2])
    assert "SGLang not importable" in saved[-1]["note"] and "shared memory" in saved[-1]["note"]


def test_directory_sim_draws_bytes_messages_and_convergence_per_size(saved):
    def by(n, views, after):
        return {"placement": {"entry_messages_per_placement": 2.9},
                "crash 5%": {"all_views_without_them_s": views, "directory_converged_after_views_s": after},
                "join 10%": {"all_views_with_them_s": views / 2, "directory_converged_after_views_s": None}}
    held = {"held_bytes_per_entry": 250.0}
    rows = [(10, {"bytes_per_entry": 70.0, "today_bytes_per_entry": 118.0} | held, by(10, 3.0, 0.25)),
            (1000, {"bytes_per_entry": 55.0, "today_bytes_per_entry": 420.0} | held, by(1000, 14.0, 0.5))]
    bench("directory_sim").plot("x.png", rows, 3)
    size, msgs, crash, join = saved[-1]["panels"]
    assert size.categories == ["10 nodes", "1000 nodes"]
    assert size.series["sharded"] == pytest.approx([1e6 * (3 * 70 + 250) / 2**30, 1e6 * (3 * 55 + 250) / 2**30])
    assert size.series["full replication"] == pytest.approx([10 * 1e6 * 118 / 2**30, 1000 * 1e6 * 420 / 2**30])
    assert size.labels[1] == "1012.05x"  # owned and held: 3 x 55 + 250 bytes per entry
    assert msgs.series == {"full replication (N-1)": [9, 999], "sharded": [2.9, 2.9]}
    assert crash.series == {"views agree": [3.0, 14.0], "directory after": [0.25, 0.5]}
    assert join.series["directory after"] == [0.0, 0.0]


def test_consistency_cost_bench_draws_each_operation_for_both_trees(saved):
    rows = {"GET on the holder": [(0.14, 0.42), (0.141, 0.535)], "SET on another node": [(0.97, 2.0), (0.76, 1.64)]}
    bench("consistency_cost_bench").plot("x.png", rows, "45ad464", 3)
    p50, p99 = saved[-1]["panels"]
    assert p50.categories == ["GET on the holder", "SET on another node"]
    assert p50.series == {"this tree": [0.14, 0.97], "45ad464": [0.141, 0.76]}
    assert p99.series == {"this tree": [0.42, 2.0], "45ad464": [0.535, 1.64]}
    assert p50.labels == ["0.99x", "1.28x"]


def test_etcd_registry_bench_draws_each_phase_and_etcd_s_cost(saved):
    rows = [(100, {"start": [0.1, 0.2, 0.3], "crash": [4.0, 4.2], "join": [0.1, 0.5], "etcd_cpu": 0.03,
                   "etcd_rss_mib": 31.0})]
    bench("etcd_registry_bench").plot("x.png", rows, 5)
    start, crash, join, cost = saved[-1]["panels"]
    assert start.series == {"p50": [0.2], "max": [0.3]} and crash.series == {"p50": [4.1], "max": [4.2]}
    assert join.series["max"] == [0.5] and cost.series == {"CPU (cores x 100)": [3.0], "RSS (MiB)": [31.0]}


def test_registry_startup_bench_puts_the_modes_side_by_side(saved):
    bench("registry_startup_bench").plot("x.png", {"gossip": (0.5, 0.6), "etcd": (0.7, 0.9)}, 3)
    (panel,) = saved[-1]["panels"]
    assert panel.series == {"gossip": [0.5, 0.6], "etcd": [0.7, 0.9]} and panel.labels == ["1.40x", "1.50x"]


def test_cluster_route_bench_puts_the_cluster_beside_one_node(saved):
    bench("cluster_route_bench").plot("x.png", [("single node", 0.2, 3.6), ("12 hosts", 1.0, 4.8)], 12, 0.74)
    (panel,) = saved[-1]["panels"]
    assert panel.categories == ["single node", "12 hosts"] and panel.series == {"p50": [0.2, 1.0], "p99": [3.6, 4.8]}
    assert panel.labels == ["1.00x", "5.00x"] and "0.74 owner round trips" in saved[-1]["note"]


def test_pool_mget_bench_sets_the_pool_beside_one_node_and_redis(saved):
    rows = [("missing, 3 nodes", 70.0, 0, 94, 60, "-"), ("missing, 1 node", 11.0, 0, 65, "-", "-"),
            ("missing, redis", 5.0, 0, 14, "-", "-"), ("held on a, 3 nodes", 400.0, 8000, 113, 132, 96),
            ("held, 1 node", 10.0, 8000, 67, "-", "-"), ("held, redis", 4.0, 8000, 15, "-", "-")]
    bench("pool_mget_bench").plot("x.png", rows, 8000)
    (panel,) = saved[-1]["panels"]
    assert panel.categories == ["missing", "held"]
    assert panel.series == {"3 nodes": [70.0, 400.0], "1 node": [11.0, 10.0], "redis-server": [5.0, 4.0]}
    assert panel.labels == ["14.00x", "100.00x"] and "8000 keys" in panel.title


def test_save_writes_a_small_png(tmp_path):
    import matplotlib  # noqa: F401  (in the test extra as well as the `bench` extra: this must run)
    panels = [plot.Panel("a", ["x", "y"], {"ref": [1.0, 2.0], "quilld": [2.0, 1.0]}, "GB/s", ["2.00x", "0.50x"]),
              plot.Panel("b", ["z"], {"s": [3.0]}, "s")]
    out = plot.save(tmp_path / "sub" / "fig.png", panels, "title", "note")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 2_000 < len(data) < 100_000, len(data)
    with pytest.raises(ValueError, match="has 1 values for 2 categories"):
        plot.save(tmp_path / "bad.png", [plot.Panel("c", ["x", "y"], {"s": [1.0]}, "s")], "t")


def test_restore_freeze_and_holds_draw_what_they_print(saved):
    rows = {"quilld": (0.040, 0.004, 300), "redis-server": (0.160, 0.150, 20)}
    bench("restore_freeze_bench").plot("x.png", rows, 26.4, 293)
    took, worst = saved[-1]["panels"]
    assert took.series == {"redis-server": [160.0], "quilld": [40.0]} and took.labels == ["quilld 0.25x"]
    assert worst.series["quilld"] == [4.0]
    figures = [("hold", {"p50": 0.2, "p99": 4.6, "max": 12.0}, "ms"), ("puts", {"accepted": 15, "RSS growth (MiB)": 62.0}, "x")]
    bench("holds_bench").plot("x.png", figures, Path("/tree"))
    hold, put = saved[-1]["panels"]
    assert hold.categories == ["p50", "p99", "max"] and hold.series == {"quilld": [0.2, 4.6, 12.0]}
    assert put.series == {"quilld": [15, 62.0]}


def test_gateway_ttft_bench_draws_each_size_with_what_the_gateway_adds(saved):
    results = {4083: {"direct": (1.0, 2.0), "gateway, chars (no tokenizer)": (1.9, 3.5),
                      "gateway, tok (engine hashes)": (5.8, 9.7)},
               32806: {"direct": (2.0, 3.0), "gateway, chars (no tokenizer)": (3.5, 5.2),
                       "gateway, tok (engine hashes)": (11.6, 16.2)}}
    bench("gateway_ttft_bench").plot("x.png", results, 100)
    small, large = saved[-1]["panels"]
    assert small.categories == list(results[4083]) and small.series["p99"] == [2.0, 3.5, 9.7]
    assert large.series["p50"] == [2.0, 3.5, 11.6]
    assert small.labels == ["", "+0.9 ms", "+4.8 ms"] and large.labels[2] == "+9.6 ms"
    assert "100 sequential" in saved[-1]["note"]


def test_route_hash_and_gossip_news_draw_what_they_print(saved):
    rows = {4099: {"messages, engine hashing": 1.5, "tokens, engine hashing": 3.0, "tokens, quilld chain": 2.0}}
    bench("route_hash_bench").plot("x.png", rows, "sha256")
    (panel,) = saved[-1]["panels"]
    assert panel.series == {"ms": [1.5, 3.0, 2.0]} and panel.labels == ["0.75x", "1.50x", "1.00x"]
    m = bench("gossip_news_sim")
    m.plot("x.png", {100: {"idle meta": (7.0, 3.0), "before": (26.5, None), "news first": (10.0, 3.0)}})
    crash, join = saved[-1]["panels"]
    assert crash.series == {"idle meta": [7.0], "before": [26.5], "news first": [10.0]}
    assert join.series["before"] == [m.LIMIT] and join.categories == ["100 nodes"]
