"""The mixed-link testbed: network namespaces joined by tbf-shaped veth pairs.
Skips with the reason where the machine does not allow namespaces."""

import json
import os
import subprocess
import sys
import time

import pytest

from hetcomm import testbed
from hetcomm.benchmarks import links

pytestmark = pytest.mark.netns


def _need_netns():
    ok, why = testbed.netns_support()
    if not ok:
        pytest.skip(why)


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def test_shaped_inter_node_link_is_measured_and_everything_is_cleaned_up(tmp_path):
    _need_netns()
    before = _namespaces()
    out = tmp_path / "topo.json"
    cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "2",
           "--inter-node-rate", "200mbit", "--", sys.executable, "-m", "hetcomm.cli", "topo", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    topo = data["topology"]
    assert topo["nodes"] == ["node0", "node0", "node1", "node1"]
    inter_bw = 1 / topo["links"]["inter"]["beta"]
    intra_bw = 1 / topo["links"]["intra"]["beta"]
    assert 0.5 * 25e6 < inter_bw < 1.3 * 25e6, inter_bw  # 200 Mbit/s = 25 MB/s
    assert intra_bw > 10 * inter_bw
    # the planner keeps big buckets off the slow link as much as it can
    big = [p for p in data["plans"] if p["bytes"] >= 1 << 24 and p["wire"] == "none"]
    assert big and all(p["algorithm"] in ("hierarchical", "halving_doubling") for p in big)
    # 2 nodes x 2 ranks: a compressed mode at the default algorithm goes across nodes only
    assert data["compressed_default"] == "hierarchical" and "compressed or cast across nodes only" in r.stdout
    # fp32 ("none") stays allreduce_hook's sum; the hierarchy's bytes on a node's link are named beside gloo's ring's
    assert "none at the default algorithm: native (allreduce_hook's sum; on gloo a ring over all 4 ranks, at least " \
        "1.5x of each bucket on each way of a node's link); algorithm='hierarchical': 1x" in r.stdout
    assert _namespaces() == before


def test_bench_allreduce_inside_the_testbed_is_correct(tmp_path):
    _need_netns()
    out = tmp_path / "ar.json"
    cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "2",
           "--inter-node-rate", "1gbit", "--", sys.executable, "-m", "hetcomm.cli", "bench", "allreduce",
           "-b", "256K", "-e", "256K", "-n", "2", "-w", "1", "--wires", "none,onebit", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(x["algorithm"], x["wire"]) for x in rows} >= {("native", "none"), ("ring", "none"),
                                                           ("hierarchical", "none"), ("hierarchical", "onebit"),
                                                           ("native", "onebit")}
    # random inputs: dense wires within rounding of the float64 sum; 1-bit flat
    # and across nodes loses nothing (results + residuals = the exact sums)
    assert all(x["wrong"] == 0 for x in rows), rows
    assert all(x["busbw_GBps"] > 0 for x in rows)


def test_bench_links_measures_the_shaped_rate_for_every_traffic_pattern(tmp_path):
    _need_netns()
    out = tmp_path / "links.json"
    cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "2",
           "--inter-node-rate", "200mbit", "--", sys.executable, "-m", "hetcomm.cli", "bench", "links",
           "-b", "1M", "-e", "1M", "-n", "2", "-w", "1", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {x["pattern"]: x for x in data["rows"]}
    assert set(rows) == set(links.PATTERNS)
    assert data["meta"]["rate_bits"] == 200e6  # the testbed's rate, handed down in HETCOMM_LINK_RATE
    # one, two and both-ways flows of 1 MiB: the link's bytes over the time are the shaped 200 Mbit/s
    # (a flow that also paid its connection set-up or lost packets shows as less; tbf's burst as a little more)
    for name in ("single", "shared", "exchange", "ring"):
        assert 0.4 < rows[name]["of_rate"] < 1.2, rows[name]
        assert rows[name]["min_ms"] <= rows[name]["time_ms"] <= rows[name]["max_ms"]
    assert rows["shared"]["link_bytes"] == 2 * rows["single"]["link_bytes"] == 2 * (1 << 20)
    assert rows["local"]["mbit_s"] > 3 * rows["single"]["mbit_s"]  # inside a node: its loopback, not the link


def test_link_patterns_pair_the_ranks_of_two_nodes():
    nodes = [[0, 1], [2, 3]]
    plan = {p: [links._plan(p, r, nodes) for r in range(4)] for p in links.PATTERNS}
    assert plan["single"] == [([2], [], 1), ([], [], 1), ([], [0], 1), ([], [], 1)]
    assert plan["shared"] == [([2], [], 2), ([3], [], 2), ([], [0], 2), ([], [1], 2)]
    assert plan["exchange"] == [([2], [2], 2), ([3], [3], 2), ([0], [0], 2), ([1], [1], 2)]
    assert plan["ring"] == [([1], [3], 1), ([2], [0], 1), ([3], [1], 1), ([0], [2], 1)]
    assert plan["local"] == [([1], [1], 1), ([0], [0], 1), ([], [], 1), ([], [], 1)]
    assert links.rate_bits("100mbit") == 1e8 and links.rate_bits(None) is None


def test_bench_links_outside_a_cluster_says_how_to_run_it(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="run it inside `hetcomm testbed`"):
        links.main([1024], None, 1, 0, None)


def test_a_failing_rank_fails_the_testbed_run(tmp_path):
    _need_netns()
    before = _namespaces()
    cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "1", "--",
           sys.executable, "-c", "import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    assert "testbed rank 1 exited 3" in r.stderr
    assert _namespaces() == before


def test_a_run_past_its_timeout_is_stopped_and_says_how_to_give_it_longer(tmp_path):
    _need_netns()
    before = _namespaces()
    cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "1", "--timeout",
           "2", "--", sys.executable, "-c", "import time; time.sleep(60)"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 30
    assert r.returncode == 124
    assert "ran past --timeout 2 s: stopped (pass --timeout SECONDS" in r.stderr, r.stderr[-2000:]
    assert _namespaces() == before


_POLICY_PROBE = """
import os, sys, threading
from hetcomm import testbed
seen = [testbed.sched_policy()]
t = threading.Thread(target=lambda: seen.append(testbed.sched_policy()))  # a thread started later, as gloo's
t.start(); t.join()
open(os.path.join(sys.argv[1], 'policy_' + os.environ['RANK']), 'w').write(','.join(seen))
"""


def test_sched_sets_every_ranks_policy_and_its_threads_and_no_flag_keeps_the_callers(tmp_path):
    _need_netns()
    before = _namespaces()
    # the testbed started under SCHED_BATCH: --sched normal sets SCHED_OTHER, no --sched keeps the caller's
    for flag, sched in (("batch", "batch"), ("normal", "normal"), (None, "batch")):
        out = tmp_path / str(flag)
        out.mkdir()
        cmd = [sys.executable, "-m", "hetcomm.cli", "testbed", "--nodes", "2", "--ranks-per-node", "2"]
        cmd += ["--sched", flag] if flag else []
        r = subprocess.run(cmd + ["--", sys.executable, "-c", _POLICY_PROBE, str(out)], capture_output=True,
                           text=True, timeout=120,
                           preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)))
        assert r.returncode == 0, r.stderr[-3000:]
        assert (f"scheduling {sched}" if flag else "scheduling batch (this process's)") in r.stderr
        assert {f.name: f.read_text() for f in out.iterdir()} == {f"policy_{k}": f"{sched},{sched}" for k in range(4)}
    assert _namespaces() == before
    with pytest.raises(ValueError, match="sched must be one of"):
        testbed.Cluster.run(None, ["true"], 1, sched="idle")


def test_testbed_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rate must end in"):
        testbed.Cluster(2, "fast")
    with pytest.raises(ValueError, match="nodes >= 2"):
        testbed.Cluster(1)
    # 1 ms of the rate, at least 8 KB
    assert testbed.tbf_burst("1gbit") == "1000kbit" and testbed.tbf_burst("100mbit") == "100kbit"
    assert testbed.tbf_burst("10mbit") == "64kbit"
    assert testbed.Cluster(2, "100mbit").inter_burst == "100kbit"
    assert testbed.Cluster(2, "100mbit", "400kbit").inter_burst == "400kbit"
    assert testbed.Cluster(2).inter_burst is None
    with pytest.raises(ValueError, match="inter_burst needs inter_rate"):
        testbed.Cluster(2, None, "400kbit")
    with pytest.raises(ValueError, match="one 1514-byte frame"):
        testbed.Cluster(2, "100mbit", "8kbit")
