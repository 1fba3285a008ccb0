"""Topology discovery, probes, the alpha-beta fit and the planner."""

import json
import logging
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import planner, topology
from hetcomm import probe as probing
from hetcomm.topology import LinkClass, Topology

from . import models
from .dist_harness import hetcomm_records, run_ranks


def _topo(nodes, intra=(5e-6, 1 / 50e9), inter=(50e-6, 1 / 1.25e9)):
    t = Topology(world=len(nodes), nodes=nodes, devices=[{"model": "x"}] * len(nodes))
    t.links = {"intra": LinkClass(*intra), "inter": LinkClass(*inter)}
    if len(set(nodes)) == 1:
        del t.links["inter"]
    return t


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_probe_rounds_pair_everyone_once_in_disjoint_rounds(world):
    rounds = probing._rounds(world)
    pairs = [tuple(sorted(p)) for r in rounds for p in r]
    assert sorted(pairs) == [(a, b) for a in range(world) for b in range(a + 1, world)]
    for r in rounds:
        flat = [x for p in r for x in p]
        assert len(flat) == len(set(flat))


UNEVEN = ["a", "b", "a", "c", "c", "a", "d", "b", "a", "e", "e", "e"]  # 1-4 ranks a node, interleaved


@pytest.mark.parametrize("nodes_ranks", [(64, 8), (16, 8), (1, 16), (40, 1), (5, 3), (2, 5), (2, 2), (1, 2), (2, 1),
                                         UNEVEN])
def test_probe_samples_pairs(nodes_ranks):
    if isinstance(nodes_ranks, list):
        nodes, n, r = nodes_ranks, len(set(nodes_ranks)), 4
    else:
        n, r = nodes_ranks
        nodes = [f"n{i // r}" for i in range(n * r)]
    rounds = probing._schedule(nodes, max_rounds=8)
    assert 1 <= len(rounds) <= min(8, (r > 1) + n - 1 + n % 2)
    for rnd in rounds:
        flat = [x for p in rnd for x in p]
        assert len(flat) == len(set(flat))  # disjoint pairs
        inter = [p for p in rnd if nodes[p[0]] != nodes[p[1]]]
        assert len(inter) in (0, len(rnd))  # a round measures one link class
        per_node = [nodes[x] for p in inter for x in p]
        assert len(per_node) == len(set(per_node))  # one flow per node's link
    pairs = {tuple(sorted(p)) for rnd in rounds for p in rnd}
    classes = {"intra" if nodes[a] == nodes[b] else "inter" for a, b in pairs}
    assert classes == ({"intra"} if r > 1 else set()) | ({"inter"} if n > 1 else set())
    if n > 1:  # every node measures its link, with a different rank in each round
        assert {nodes[x] for p in pairs for x in p if nodes[p[0]] != nodes[p[1]]} == set(nodes)
        inter_rounds = [rnd for rnd in rounds if nodes[rnd[0][0]] != nodes[rnd[0][1]]]
        users = {x for rnd in inter_rounds for p in rnd for x in p}
        assert len(users) > n if r > 1 and len(inter_rounds) > 1 else len(users) <= n
    if r > 1:  # inside every node of two ranks or more
        assert {nodes[a] for a, b in pairs if nodes[a] == nodes[b]} == {x for x in nodes if nodes.count(x) > 1}


def test_fit_recovers_alpha_beta():
    nodes = ["a", "a", "b", "b"]
    small, large = 4096, 1 << 20
    intra, inter = (10e-6, 1e-10), (200e-6, 1e-8)
    meas = {}
    for a in range(4):
        for b in range(a + 1, 4):
            if nodes[a] == nodes[b]:  # (t_small, t_large): the default large size
                al, be = intra
                meas[(a, b)] = (al + small * be, al + large * be)
            else:  # what probe returns on a slow link: the large message it sized down
                (al, be), big = inter, 128 << 10
                meas[(a, b)] = (al + small * be, al + big * be, big)
    links = probing.fit(nodes, meas, small, large)
    assert links["intra"].pairs == 2 and links["inter"].pairs == 4
    assert links["intra"].alpha == pytest.approx(10e-6) and links["intra"].beta == pytest.approx(1e-10)
    assert links["inter"].alpha == pytest.approx(200e-6) and links["inter"].beta == pytest.approx(1e-8)


def _grown(one_way, largest=1 << 20, start=64 << 10, **kw):
    """The large message probe_next settles on for a link whose one-way time of n bytes is one_way(n)."""
    size = start
    while True:
        step = probing.probe_next(size, one_way(size), largest, **kw)
        if step < 0:
            return -step
        assert step == 2 * size
        size = step


@pytest.mark.parametrize("mbit,expected_kib", [(100, 512), (50, 256), (200, 1024), (10, 64), (1e5, 1024)])
def test_probe_sizes_its_large_message_to_the_link(mbit, expected_kib):
    """Doubled from 64 KiB while a transfer took at most half the 50 ms budget:
    at most 50 ms a transfer, never below 64 KiB, never above the largest; the
    same through a token bucket's burst, which one small message cannot tell
    (64 KiB mostly inside a 50 KB burst looks like 500 Mbit/s; at 10 Mbit 128 KiB
    is measured and found over the budget)."""
    rate = mbit * 1e6 / 8

    def plain(n):
        return 50e-6 + n / rate

    def shaped(n, burst=50_000):  # the burst at 1 GB/s, the rest at the rate
        return 50e-6 + min(n, burst) / 1e9 + max(n - burst, 0) / rate

    for link in (plain, shaped):
        size = _grown(link)
        assert size == expected_kib << 10
        assert link(size) <= probing.PROBE_BUDGET_S or size == probing.PROBE_SIZING
    assert _grown(plain, largest=256 << 10) == min(expected_kib, 256) << 10
    assert _grown(lambda n: n / 25e6, budget_s=4e-3) == 64 << 10  # 64 KiB: 2.6 ms > 2 ms
    assert _grown(lambda n: n / 25e6, budget_s=12e-3) == 256 << 10
    assert probing.probe_next(64 << 10, 1e-3, 64 << 10) == -(64 << 10)  # nothing larger allowed
    assert probing.probe_next(128 << 10, 0.06, 1 << 20) == -(64 << 10)  # over the budget: back to the last
    assert probing.probe_next(64 << 10, 0.06, 1 << 20) == -(64 << 10)  # never below the least


def test_the_large_message_repeats_for_its_budget_of_round_trips():
    """As many more exchanges of the large message as fit in PROBE_REPEATS_S
    of round trips, at least 2, never more than the probe's reps."""
    one_way = lambda nbytes, mbit: nbytes * 8 / (mbit * 1e6)  # noqa: E731
    assert probing.large_repeats(one_way(512 << 10, 100), 5) == 2  # 84 ms a round trip: 1 fits, 2 at least
    assert probing.large_repeats(one_way(64 << 10, 10), 5) == 2  # 10 Mbit: its 64 KiB in 52 ms
    assert probing.large_repeats(one_way(1 << 20, 1000), 5) == 5  # 1 Gbit: 17 ms a round trip, 8 would fit
    assert probing.large_repeats(0.02, 5) == 3 and probing.large_repeats(0.02, 5, budget_s=0.2) == 5
    assert probing.large_repeats(0.02, 1) == 1 and probing.large_repeats(0.0, 4) == 4


def test_planner_prefers_hierarchy_for_big_buckets_on_slow_inter_node_links():
    t = _topo(["a"] * 4 + ["b"] * 4)
    big = planner.plan(t, 64 << 20)
    assert big["algorithm"] == "hierarchical"
    assert big["predicted_s"]["hierarchical"] < big["predicted_s"]["ring"]
    # latency-bound: two nodes' hierarchy crosses once (the leaders' pair exchange), so it wins small buckets too;
    # on four nodes it crosses 6 times, and halving-doubling's log2(8) rounds win
    small = planner.plan(t, 4096)
    assert small["algorithm"] == "hierarchical"
    assert small["predicted_s"]["hierarchical"] < min(small["predicted_s"][a] for a in ("tree", "halving_doubling"))
    assert planner.plan(_topo(list("aabbccdd")), 4096)["algorithm"] in ("tree", "halving_doubling")
    # compressed codecs: only flat or across-nodes candidates
    assert set(planner.plan(t, 64 << 20, "onebit")["predicted_s"]) == {"native", "hierarchical"}
    assert planner.plan(t, 64 << 20, "onebit")["algorithm"] == "hierarchical"
    # one node: no hierarchy to exploit
    assert "hierarchical" not in planner.plan(_topo(["a"] * 4), 1 << 20)["predicted_s"]


def test_planner_cost_grows_with_size_and_is_deterministic():
    t = _topo(["a", "a", "b", "b"])
    for algo in topology.ALGORITHMS:
        times = [planner.predict(t, s, algo) for s in (1 << 10, 1 << 16, 1 << 22)]
        assert times == sorted(times)
    assert planner.plan(t, 123456) == planner.plan(t, 123456)


def test_hetcomm_algo_overrides_the_planner(monkeypatch):
    t = _topo(["a", "a", "b", "b"])
    monkeypatch.setenv("HETCOMM_ALGO", "tree")
    assert planner.plan(t, 64 << 20) == dict(planner.plan(t, 64 << 20), algorithm="tree", forced=True)
    monkeypatch.setenv("HETCOMM_ALGO", "bogus")
    with pytest.raises(ValueError, match="HETCOMM_ALGO"):
        planner.plan(t, 1024)


def test_topology_json_round_trip():
    t = _topo(["a", "b"])
    assert Topology.from_json(json.loads(json.dumps(t.to_json()))).to_json() == dict(t.to_json(), source="probe")


def _detect(rank, world, cache_dir, given):
    os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    if given:
        os.environ["HETCOMM_TOPOLOGY"] = given
    t = topology.detect()
    devices = [str(topology.group_device(g, d)) for g in (None, dist.new_group())
               for d in (None, torch.device("cpu"), torch.device("cuda", 1))]
    sampled = probing.probe(t.nodes, reps=1)  # what detect measured (every pair would take 3 rounds)
    return {"topo": t.to_json(), "plan": planner.plan(t, 1 << 22), "order": t.ring_order(), "devices": devices,
            "sampled": sampled, "sampled_fit": probing.fit(t.nodes, sampled)}


def test_detect_measures_caches_and_agrees_on_every_rank(tmp_path):
    first = run_ranks(_detect, 4, str(tmp_path), None)
    t0 = first[0]["topo"]
    assert t0["nodes"] == ["node0", "node0", "node1", "node1"] and t0["source"] == "probe"
    assert set(t0["links"]) == {"intra", "inter"}
    assert all(l["alpha"] > 0 and l["beta"] > 0 for l in t0["links"].values())
    for r in first[1:]:
        assert r["topo"] == t0 and r["plan"] == first[0]["plan"]
    assert first[0]["order"] == [0, 1, 2, 3]
    # sampled: both nodes' insides, then the node pair through their first ranks; the same on every rank
    assert sorted(first[0]["sampled"]) == [(0, 1), (0, 2), (2, 3)]
    assert all(r["sampled"] == first[0]["sampled"] for r in first)
    links = first[0]["sampled_fit"]
    assert links["intra"].pairs == 2 and links["inter"].pairs == 1 and links["inter"].beta > 0
    assert {k: v["pairs"] for k, v in t0["links"].items()} == {"intra": 2, "inter": 1}
    # gloo groups take CPU tensors; a GPU asked for is kept
    assert first[0]["devices"] == ["cpu", "cpu", "cuda:1"] * 2
    cached = run_ranks(_detect, 4, str(tmp_path), None)
    assert cached[0]["topo"]["source"] == "cache" and cached[0]["topo"]["links"] == t0["links"]
    given = tmp_path / "given.json"
    given.write_text(json.dumps(dict(t0, codec_gbps=123.0)))
    loaded = run_ranks(_detect, 4, str(tmp_path / "none"), str(given))
    assert all(r["topo"]["codec_gbps"] == 123.0 and r["topo"]["source"] == str(given) for r in loaded)


def _ddp_algorithm(rank, world, mode, algorithm, cache_dir):
    os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hetcomm.HookState(mode, algorithm=algorithm, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    grads, steps, sent, across = [], [], 0, 0
    with hetcomm_records(logging.INFO) as records:
        for step in range(6):
            models.train_step(ddp, opt, rank, step, 8)
            grads.append(models.flat_grads(model))
            total = state.stats()["total"]
            # each step: its buckets' (mode, algorithm, why), the bytes this rank sent, of them to other nodes
            steps.append((sorted({(p.mode, p.algorithm, p.why) for p in state.last_plans.values()}),
                          total["bytes_sent"] - sent, total["bytes_sent_across_nodes"] - across))
            sent, across = total["bytes_sent"], total["bytes_sent_across_nodes"]
    stats = state.stats()
    topo = state.topology
    return {"params": models.flat_params(model), "grads": grads, "codec_s": stats["total"]["codec_s"],
            "plans": {k: p["algorithm"] for k, p in stats["plans"].items()}, "steps": steps,
            "topology": None if topo is None else (topo.source, sorted(topo.links), topo.node_ids),
            "hinted": [r.getMessage() for r in records if "sums as allreduce_hook does" in r.getMessage()]}


ALGORITHM_CASES = [("none", "auto"), ("none", "ring"), ("none", "hierarchical"), ("fp16", "halving_doubling"),
                   ("none", "tree"), ("onebit", "hierarchical"), ("topk", "hierarchical"), ("onebit", "auto"),
                   ("lowrank", "hierarchical"), ("lowrank", "auto"), ("fp8", "hierarchical"), ("fp8", None),
                   ("topk", None), ("lowrank", None), ("fp8", "native"), ("bf16", None), ("fp16", "native"),
                   ("none", None), ("none", "native")]


def _unprobed(*args, **kwargs):
    raise AssertionError("a fixed ring or hierarchy probed the links")


def _ddp_algorithms(rank, world, cache_dir):
    # First, with no topology cached: a fixed hierarchy or ring learns the nodes and probes nothing
    real_probe, probing.probe = probing.probe, _unprobed
    try:
        unprobed = {("unprobed", case): _ddp_algorithm(rank, world, *case, os.path.join(cache_dir, "empty"))
                    for case in (("fp8", "hierarchical"), ("none", "ring"), ("fp8", None))}
    finally:
        probing.probe = real_probe
    return {**unprobed, **{case: _ddp_algorithm(rank, world, *case, cache_dir) for case in ALGORITHM_CASES}}


@pytest.fixture(scope="module")
def algorithm_runs(tmp_path_factory):
    """Every case in one spawn of 4 ranks (2 nodes x 2), each its own DDP model and HookState."""
    return run_ranks(_ddp_algorithms, 4, str(tmp_path_factory.mktemp("algo-cache")), timeout=600)


@pytest.mark.parametrize("mode,algorithm", ALGORITHM_CASES[:-1])
def test_ddp_with_each_algorithm_keeps_replicas_identical(algorithm_runs, mode, algorithm):
    res = [r[(mode, algorithm)] for r in algorithm_runs]
    for r in res[1:]:
        assert torch.equal(r["params"], res[0]["params"])
    if mode == "none":
        # exact algorithms: the same gradients as the process group's own all-reduce, to rounding
        ref = algorithm_runs[0][("none", "native")]
        for a, b in zip(res[0]["grads"], ref["grads"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if algorithm == "auto":
        assert res[0]["plans"] and all(p in topology.ALGORITHMS for p in res[0]["plans"].values())
    if mode in ("fp8", "onebit", "topk", "lowrank"):  # the codecs' time is counted, across nodes of a hierarchy too
        assert all(r["codec_s"] > 0 for r in res), [r["codec_s"] for r in res]


@pytest.mark.parametrize("mode,algorithm", [("fp8", "hierarchical"), ("none", "ring"), ("fp8", None)])
def test_a_fixed_ring_or_hierarchy_knows_the_nodes_without_probing(algorithm_runs, mode, algorithm):
    """No topology cached: the nodes are discovered, no link is probed (the
    probe raises in these runs), and training gives the bits it gives with a
    measured topology (the auto case before it probed and cached one). A
    compressed mode's default algorithm (None) learns the nodes the same way."""
    for r in algorithm_runs:
        assert r[("unprobed", (mode, algorithm))]["topology"] == ("discover", [], [0, 0, 1, 1])
        assert r[(mode, algorithm)]["topology"][0] == "cache" and r[(mode, algorithm)]["topology"][1]
        assert torch.equal(r[("unprobed", (mode, algorithm))]["params"], r[(mode, algorithm)]["params"])
    assert set(algorithm_runs[0][("unprobed", (mode, algorithm))]["plans"].values()) <= \
        {algorithm or "hierarchical", "native"}


@pytest.mark.parametrize("mode", ["fp8", "topk", "lowrank"])
def test_a_compressed_mode_crosses_nodes_hierarchically_by_default(algorithm_runs, mode):
    """2 nodes x 2 ranks, algorithm left at its default: the compressed steps
    run the hierarchy (exact inside a node, compressed across nodes), sending
    what algorithm='hierarchical' sends and not what 'native' sends; the
    dense step before start_iter goes over the hierarchy too, exact in fp32
    inside and across nodes (gloo's ring would put 1.5x the bucket on each way
    of the link); algorithm='native' given keeps every step flat."""
    for r in algorithm_runs:
        default, hier = r[(mode, None)]["steps"], r[(mode, "hierarchical")]["steps"]
        assert default[0][0] == [("none", "hierarchical", "warm-up")], default[0]  # start_iter 1 (the default)
        assert default[0][1] == hier[0][1] > 0  # the bytes of algorithm='hierarchical''s exact step
        for step in range(1, 6):
            assert default[step][0] == [(mode, "hierarchical", "across nodes")], default[step]
            assert default[step][1] == hier[step][1] > 0
        if mode == "fp8":
            flat = r[(mode, "native")]["steps"]
            assert all(flat[step][0] == [(mode, "native", "fixed")] for step in range(1, 6)), flat
            assert all(flat[step][1] != default[step][1] for step in range(1, 6))


def test_a_16_bit_cast_crosses_nodes_hierarchically_by_default(algorithm_runs):
    """bf16 at the default algorithm on 2 nodes x 2 ranks: every step over
    the hierarchy, the node's sum in float32 and 16 bits across, so half the
    exact hierarchy's bytes cross (gloo's ring of 16 bits would put 1.5x the cast
    bucket on each way of the link); algorithm='native' given casts every
    rank's gradient on the group's own all-reduce."""
    for r in algorithm_runs:
        cast, exact = r[("bf16", None)]["steps"], r[("none", "hierarchical")]["steps"]
        for step in range(6):
            assert cast[step][0] == [("bf16", "hierarchical", "across nodes")], cast[step]
            assert cast[step][2] * 2 == exact[step][2] > 0
        flat = r[("fp16", "native")]["steps"]
        assert all(flat[step][0] == [("fp16", "native", "fixed")] for step in range(6)), flat
    # the first step (the same parameters in both runs) within bf16's rounding (8 bits) of the exact sum
    cast, exact = algorithm_runs[0][("bf16", None)]["grads"][0], algorithm_runs[0][("none", "native")]["grads"][0]
    assert 0 < (cast - exact).norm() <= 2 ** -8 * exact.norm()


def test_fp32_at_its_default_algorithm_sums_as_allreduce_hook_and_names_the_hierarchy_once(algorithm_runs):
    """HookState("none") at its default algorithm on 2 nodes x 2 ranks: every
    step on the group's own all-reduce, the bits of algorithm='native' (what
    allreduce_hook sums); rank 0 is told once, at INFO, that gloo's ring over
    the 4 ranks puts 1.5x each bucket on each way of a node's link and the
    hierarchy 1x; nobody is told where the algorithm is given."""
    for rank, r in enumerate(algorithm_runs):
        default, native = r[("none", None)], r[("none", "native")]
        assert all(torch.equal(a, b) for a, b in zip(default["grads"], native["grads"]))
        assert all(step[0] == [("none", "native", "fixed")] for step in default["steps"]), default["steps"]
        assert len(default["hinted"]) == (1 if rank == 0 else 0), default["hinted"]
        assert native["hinted"] == [] and r[("none", "hierarchical")]["hinted"] == []
    message = algorithm_runs[0][("none", None)]["hinted"][0]
    assert "over all 4 ranks: at least 1.5x of each bucket" in message and "puts 1x there" in message
    assert "algorithm='hierarchical'" in message


def _exact_steps_across_nodes(rank, world, cache_dir):
    os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    # DDP's buckets after step 0: the last two layers (10,282 elements) and the first (IN x 96 + 96 = 3,168), under
    # min_compress_numel: sent dense on every step
    state = hetcomm.HookState("onebit", min_compress_numel=4000)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    state.attach_optimizer(opt, exact_every=3)
    plans = []
    for step in range(8):
        models.train_step(ddp, opt, rank, step, 8)
        plans.append(sorted((p.mode, p.algorithm, p.why) for p in state.last_plans.values()))
    state.close()
    return {"plans": plans, "params": models.flat_params(model)}


def test_an_attached_adams_exact_steps_cross_nodes_over_the_hierarchy(tmp_path):
    """2 nodes x 2 ranks, onebit with an AdamW attached at the default
    algorithm: its exact steps of the buckets it compresses are summed in
    fp32 over the hierarchy (gloo's ring puts 1.5x the bucket on each way of
    the link, the hierarchy 1x), a bucket under min_compress_numel stays on
    the process group's own all-reduce; the replicas stay bit-identical."""
    runs = run_ranks(_exact_steps_across_nodes, 4, str(tmp_path))
    plans = runs[0]["plans"]
    exact = [p for step in plans for p in step if p[2] == "exact step"]
    small = [p for step in plans for p in step if p[2] == "small bucket"]
    assert exact and set(exact) == {("none", "hierarchical", "exact step")}, plans
    assert small and set(small) == {("none", "native", "small bucket")}, plans
    assert ("onebit", "hierarchical", "across nodes") in {p for step in plans for p in step}, plans
    assert all(r["plans"] == plans and torch.equal(r["params"], runs[0]["params"]) for r in runs[1:])


def _hierarchy_on_one_node(rank, world, cache_dir):
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    out = {}
    with hetcomm_records() as records:
        for mode, algorithm in (("fp8", "hierarchical"), ("none", "hierarchical"), ("fp8", None),
                                ("lowrank", "hierarchical"), ("bf16", "hierarchical")):
            model = models.mlp(hidden=96)
            ddp = DDP(model)
            state = hetcomm.HookState(mode, algorithm=algorithm, min_compress_numel=0)
            ddp.register_comm_hook(state, hetcomm.hook)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
            for step in range(4):
                models.train_step(ddp, opt, rank, step, 8)
            total = state.stats()["total"]
            out[mode if algorithm else "default"] = ([r.getMessage() for r in records], total["bytes_sent"],
                                                     total["fp32_bytes"],
                                                     {p["algorithm"] for p in state.stats()["plans"].values()})
            records.clear()
            state.close()
    return out


def test_a_compressed_hierarchy_on_one_node_says_it_compresses_nothing(tmp_path):
    """Every rank on one node: the hierarchy's sum is exact inside the node and
    nothing crosses nodes, so fp8 sends fp32's bytes; each rank warns once,
    naming the way to compress there (algorithm 'native'); fp32 is not warned about.
    fp8 with the default algorithm compresses flat there, silently. lowrank's
    hierarchy sums its factors inside the node: it compresses there, unwarned.
    A 16-bit cast's hierarchy casts across nodes only: it is warned about too."""
    for r in run_ranks(_hierarchy_on_one_node, 2, str(tmp_path)):
        warned, sent, fp32, _ = r["bf16"]
        assert fp32 > 0 and sent == fp32 and len(warned) == 1, (sent, fp32, warned)
        assert "compression 'bf16' sends every bucket in fp32" in warned[0]
        warned, sent, fp32, _ = r["fp8"]
        assert fp32 > 0 and 0 <= sent - fp32 <= 16  # fp32's bytes (and the overflow check's 4-byte flags)
        assert len(warned) == 1 and "algorithm 'hierarchical' with all 2 ranks on one node" in warned[0]
        assert "compression 'fp8' sends every bucket in fp32" in warned[0] and "algorithm='native'" in warned[0]
        assert r["none"][0] == []
        warned, sent, fp32, algorithms = r["default"]
        # two dense steps (start_iter 2), then two in fp8: well under fp32's bytes
        assert warned == [] and algorithms == {"native"} and sent < 0.75 * fp32
        warned, sent, fp32, algorithms = r["lowrank"]
        assert warned == [] and algorithms == {"hierarchical"} and sent < 0.75 * fp32


def test_the_default_goes_across_nodes_only_on_equal_nodes_of_several_ranks():
    from hetcomm.negotiation import across_nodes

    assert across_nodes(_topo(["a", "a", "b", "b"])) and across_nodes(_topo(["a"] * 4 + ["b"] * 4 + ["c"] * 4))
    assert not across_nodes(_topo(["a"] * 4))  # one node: compress flat
    assert not across_nodes(_topo(["a", "b", "c"]))  # a rank a node: the hierarchy is the flat exchange
    assert not across_nodes(_topo(["a", "a", "b"]))  # unequal nodes: the hierarchy does not apply


def test_bad_algorithm_is_a_value_error():
    with pytest.raises(ValueError, match="algorithm"):
        hetcomm.HookState(algorithm="butterfly")
    with pytest.raises(ValueError, match="lowrank"):
        hetcomm.HookState("lowrank", algorithm="ring")


def test_planner_lowrank_goes_hierarchical_on_slow_links_and_flat_on_one_node():
    two_nodes = _topo(["a"] * 4 + ["b"] * 4, inter=(50e-6, 1 / 12.5e6))  # 100 Mbit/s between nodes
    p = planner.plan(two_nodes, 64 << 20, "lowrank:0.02")
    assert set(p["predicted_s"]) == {"native", "hierarchical"} and p["algorithm"] == "hierarchical"
    assert planner.plan(_topo(["a"] * 4), 64 << 20, "lowrank:0.02")["algorithm"] == "native"
    # sending less is predicted faster
    assert planner.predict(two_nodes, 1 << 24, "native", "lowrank:0.01") < \
        planner.predict(two_nodes, 1 << 24, "native", "lowrank:0.1")


def test_the_cost_model_sends_a_16_bit_casts_hierarchy_in_float32_inside_nodes():
    """A 16-bit cast over the hierarchy: the exact hierarchy's float32
    reduce-scatter inside the nodes, half its bytes across and in the
    all-gather; at 100 Mbit between nodes the planner picks it over every flat
    algorithm."""
    intra_beta, inter_beta = 1 / 50e9, 1 / 12.5e6
    slow = _topo(["a", "a", "b", "b"], intra=(5e-6, intra_beta), inter=(50e-6, inter_beta))
    nbytes = 4 << 20
    exact = planner.predict(slow, nbytes, "hierarchical")
    cast = planner.predict(slow, nbytes, "hierarchical", "bf16")
    cast_time = 2 * nbytes / (slow.codec_gbps * 1e9 * 4) / 2  # each rank casts its half of the bucket
    # 2 ranks a node: the all-gather sends half the bucket in 2 bytes, not 4; across, the link carries both
    # ranks' halves at once, the whole bucket in 2 bytes
    saved = nbytes / 2 / 2 * intra_beta + nbytes / 2 * inter_beta
    assert cast == pytest.approx(cast_time + exact - saved)
    assert planner.plan(slow, nbytes, "bf16")["algorithm"] == "hierarchical"


def test_lowranks_share_of_the_bytes_counts_its_wire():
    from hetcomm.plan import lowrank_fraction

    # a 40 x 24 matrix at rank 3 ((40 + 24) x 3 floats), a dense vector of 30, a 16 x 16 matrix at rank 2
    layout = torch.tensor([[0, 40, 24, 3], [960, 1, 30, 0], [990, 16, 16, 2]])
    floats = 64 * 3 + 30 + 32 * 2
    assert lowrank_fraction(layout, 1246) == floats / 1246
    assert lowrank_fraction(layout, 1246, "bf16") == floats / 2 / 1246  # 2 bytes an element


def test_wire_formats_parse_print_and_reject():
    assert planner.Wire.of("topk") == planner.Wire("topk", 0.01)
    assert planner.Wire.of("lowrank:0.25") == planner.Wire("lowrank", 0.25)
    assert planner.Wire.of("onebit") == planner.Wire("onebit") and planner.Wire.of("onebit").fraction is None
    assert str(planner.Wire("topk", 0.05)) == "topk:0.05" and str(planner.Wire("bf16")) == "bf16"
    assert [planner.Wire.of(w).dense for w in planner.WIRES] == [True, True, True, False, False, False, False, False]
    for bad in ("zip", "onebit:0.1", "topk:", "topk:x", "lowrank:2"):
        with pytest.raises(ValueError, match="unknown wire format"):
            planner.Wire.of(bad)
    with pytest.raises(ValueError, match="unknown algorithm 'rings'"):
        planner.predict(_topo(["a", "a"]), 1024, "rings")


def test_the_algorithm_table_says_where_each_wire_runs():
    two_by_two, one_per_node, one_node = _topo(["a", "a", "b", "b"]), _topo(["a", "b"]), _topo(["a"] * 4)
    for name in topology.ALGORITHMS:
        for wire in planner.WIRES:
            flat_ok = planner.Wire.of(wire).dense or name in ("native", "hierarchical")
            assert planner.carries(name, wire) == flat_ok
            # hierarchical: several equal nodes; with one rank per node only a compressed wire gains from it
            want = flat_ok and (name != "hierarchical" or wire in ("fp8", "int3", "onebit", "topk", "lowrank"))
            assert planner.applies(one_per_node, name, wire) == want, (name, wire)
            assert planner.applies(two_by_two, name, wire) == flat_ok, (name, wire)
            assert planner.applies(one_node, name, wire) == (flat_ok and name != "hierarchical"), (name, wire)
            # the cost model predicts exactly where the algorithm applies
            assert (planner.predict(two_by_two, 1 << 20, name, wire) is not None) == flat_ok
