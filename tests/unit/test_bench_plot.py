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


def test_save_writes_a_small_png(tmp_path):
    import matplotlib  # noqa: F401  (in the test extra as well as the `bench` extra: this must run)
    panels = [plot.Panel("a", ["x", "y"], {"ref": [1.0, 2.0], "quilld": [2.0, 1.0]}, "GB/s", ["2.00x", "0.50x"]),
              plot.Panel("b", ["z"], {"s": [3.0]}, "s")]
    out = plot.save(tmp_path / "sub" / "fig.png", panels, "title", "note")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 2_000 < len(data) < 100_000, len(data)
    with pytest.raises(ValueError, match="has 1 values for 2 categories"):
        plot.save(tmp_path / "bad.png", [plot.Panel("c", ["x", "y"], {"s": [1.0]}, "s")], "t")
