"""ProcessGroupTransport and the compressed all-reduce algorithms on 2 and 4
gloo ranks, against closed-form sums and the single-process reference."""

import math

import pytest
import torch
import torch.distributed as dist

import hetcomm
from hetcomm import _C

from . import reference as ref
from .dist_harness import run_ranks


def _transport_ops(rank, world):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    assert (t.rank, t.size) == (rank, world) and t.name == "pg:gloo"
    out = {}
    x = torch.full((1000,), float(rank + 1))
    t.all_reduce_sum(x)
    out["all_reduce"] = x
    g = torch.empty(world * 3)
    t.all_gather(g, torch.full((3,), float(rank)))
    out["all_gather"] = g
    send = torch.tensor([rank * 100 + j for j in range(world)], dtype=torch.int32)
    recv = torch.empty_like(send)
    t.all_to_all(recv, send)
    out["all_to_all"] = recv
    # ring: send to the right, receive from the left
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.empty(5, dtype=torch.float64)
    if rank % 2 == 0:
        t.send(torch.full((5,), float(rank), dtype=torch.float64), right, 7)
        t.recv(buf, left, 7)
    else:
        t.recv(buf, left, 7)
        t.send(torch.full((5,), float(rank), dtype=torch.float64), right, 7)
    out["recv"] = buf
    for algorithm in ("native", "ring"):
        rs = torch.empty(3)
        t.reduce_scatter_sum(rs, torch.arange(world * 3, dtype=torch.float32) + 100 * rank, algorithm)
        out[f"reduce_scatter_{algorithm}"] = rs
    try:
        t.reduce_scatter_sum(torch.empty(2), torch.empty(world * 3))
    except ValueError as e:
        out["reduce_scatter_error"] = str(e)
    t.barrier()
    try:
        t.send(torch.zeros(1), rank, 0)
    except ValueError as e:
        out["self_send_error"] = str(e)
    out["counters"] = t.counters()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_transport_collectives_closed_form(world):
    results = run_ranks(_transport_ops, world)
    for rank, r in enumerate(results):
        assert torch.equal(r["all_reduce"], torch.full((1000,), world * (world + 1) / 2))
        assert torch.equal(r["all_gather"], torch.arange(world).float().repeat_interleave(3))
        assert r["all_to_all"].tolist() == [i * 100 + rank for i in range(world)]
        assert torch.equal(r["recv"], torch.full((5,), float((rank - 1) % world), dtype=torch.float64))
        assert "dst must be another rank" in r["self_send_error"]
        # block `rank` of sum_r (arange(3w) + 100 r)
        want = torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * world + 100 * world * (world - 1) / 2
        assert torch.equal(r["reduce_scatter_native"], want) and torch.equal(r["reduce_scatter_ring"], want)
        assert "world_size * output.numel()" in r["reduce_scatter_error"]
        c = r["counters"]
        # all_reduce 4000 B ring volume + all_gather (w-1)*12 + all_to_all (w-1)*4 + send 40
        # + reduce_scatter native (w-1)*12 + ring (w-1) sends of 12 B
        assert c["bytes_sent"] == 2 * (world - 1) * 4000 // world + 3 * (world - 1) * 12 + (world - 1) * 4 + 40
        assert c["calls"] == 7 + 2 * (world - 1)


def _compressed_allreduce(rank, world, n, chunk, ratio):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    g = torch.Generator().manual_seed(100 + rank)
    xs = [torch.randn(n, generator=g) for _ in range(3)]
    divisor = float(rank + 2)
    wres = torch.zeros(n)
    sres = torch.zeros(hetcomm.ops.server_residual_numel(n, world, rank))
    onebit, whist, shist = [], [], []
    before = t.counters()
    for x in xs:
        y = x.clone()
        t.allreduce_onebit(y, divisor, chunk, wres, sres)
        onebit.append(y)
        whist.append(wres.clone())
        shist.append(sres.clone())
    onebit_wire = {k: t.counters()[k] - before[k] for k in ("bytes_sent", "calls")}
    tres = torch.zeros(n)
    topk = []
    before = t.counters()["bytes_sent"]
    for x in xs:
        y = x.clone()
        t.allreduce_topk(y, divisor, ratio, True, tres)
        topk.append(y)
    topk_bytes = t.counters()["bytes_sent"] - before
    fres, fsres, fp8 = torch.zeros(n), torch.zeros(sres.numel()), []
    for x in xs:
        y = x.clone()
        t.allreduce_fp8(y, divisor, chunk, fres, fsres)
        fp8.append((y, fres.clone(), fsres.clone()))
    ires, isres, int3 = torch.zeros(n), torch.zeros(sres.numel()), []
    before = t.counters()["bytes_sent"]
    for x in xs:
        y = x.clone()
        t.allreduce_int3(y, divisor, chunk, ires, isres)
        int3.append((y, ires.clone(), isres.clone()))
    int3_bytes = t.counters()["bytes_sent"] - before
    return {"xs": xs, "divisor": divisor, "onebit": onebit, "whist": whist, "shist": shist, "topk": topk, "tres": tres,
            "topk_bytes": topk_bytes, "fp8": fp8, "onebit_wire": onebit_wire, "int3": int3, "int3_bytes": int3_bytes}


def _one_rank_not_finite(rank, world, n, flagged, pieces):
    """Each codec once with rank `flagged` saying its input is not finite, then
    once more with every rank finite (the wire must be clean after it)."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    g = torch.Generator().manual_seed(7 + rank)
    out = {}
    for name in ("onebit", "fp8", "int3", "topk"):
        x = torch.randn(n, generator=g)
        wres = torch.randn(n, generator=g) * 1e-2
        sres = torch.randn(hetcomm.ops.server_residual_numel(n, world, rank), generator=g) * 1e-2
        y, w0 = x.clone(), wres.clone()
        if name == "topk":
            ok = t.allreduce_topk(y, 2.0, 0.05, True, wres, finite=rank != flagged)
        else:
            ok = getattr(t, f"allreduce_{name}")(y, 2.0, 256, wres, sres, pieces, finite=rank != flagged)
        written = not torch.equal(wres, w0)
        after = x.clone()
        if name == "topk":
            again = t.allreduce_topk(after, 2.0, 0.05, True, wres)
        else:
            again = getattr(t, f"allreduce_{name}")(after, 2.0, 256, wres, sres, pieces)
        out[name] = {"ok": ok, "x_kept": torch.equal(y, x), "written": written, "again": again, "after": after}
    return out


@pytest.mark.parametrize("world,pieces", [(2, 1), (2, 3), (4, 1), (4, 3)])
def test_a_rank_that_flags_its_input_stops_every_rank_decoding(world, pieces):
    """collectives::Finite: one rank's input is not finite. Every rank learns
    it from the messages (no all-reduce of a flag first), the same on every
    rank, and decodes nothing into x. The flagged rank encoded nothing (its
    worker residual as it was); the others had written theirs (the caller puts
    them back: BucketReducer). The next call, every rank finite, sums as usual
    and gives every rank the same bits."""
    n = 700_001 if pieces > 1 else 5000
    res = run_ranks(_one_rank_not_finite, world, n, world - 1, pieces)
    for name in ("onebit", "fp8", "int3", "topk"):
        for rank, r in enumerate(res):
            assert r[name]["ok"] is False and r[name]["x_kept"], name
            assert r[name]["written"] == (rank != world - 1), (name, rank)
            assert r[name]["again"] is True
            assert torch.equal(r[name]["after"], res[0][name]["after"]) and torch.isfinite(r[name]["after"]).all()


def _topk_every_entry(rank, world, n):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 1e-3 + 1.0  # values bf16 cannot hold
    y, res = x.clone(), torch.zeros(n)
    t.allreduce_topk(y, 2.0, 1.0, True, res)
    return x, y, res, t.counters()["bytes_sent"]


def test_topk_of_every_entry_is_lossless():
    # ratio 1: nothing to save by rounding, so the values go as float32 and the sum is exact
    n = 1001
    (x0, y0, r0, sent), (x1, y1, r1, _) = run_ranks(_topk_every_entry, 2, n)
    want = x0 / 2 + x1 / 2
    assert torch.equal(y0, want) and torch.equal(y1, want)
    assert not torch.equal(want.to(torch.bfloat16).float(), want)  # bf16 values would have lost bits
    assert not r0.any() and not r1.any()
    message = 4 + 4 + 4 * -(-n // 2) + 4 * n
    assert sent == message == hetcomm.planner.topk_message_bytes(n, 1.0)


@pytest.mark.parametrize("world,n", [(2, 5000), (4, 100_003), (3, 70), (2, 65_536), (3, 131_073)])
def test_compressed_allreduce_matches_single_process_reference(world, n):
    chunk, ratio = 256, 0.05
    results = run_ranks(_compressed_allreduce, world, n, chunk, ratio)
    divisors = [r["divisor"] for r in results]
    # every rank holds the same bytes
    for r in results[1:]:
        for a, b in zip(r["onebit"] + r["topk"], results[0]["onebit"] + results[0]["topk"]):
            assert torch.equal(a, b)
    # onebit: replay each step of the two-phase algorithm from the residuals the
    # ranks held before it. The reference sums chunk scales in another order, so
    # a server-side sum within rounding of zero may take the other sign: allow
    # exactly those elements to differ.
    wres = [torch.zeros(n) for _ in range(world)]
    sres = [torch.zeros(hetcomm.ops.server_residual_numel(n, world, r)) for r in range(world)]
    for step in range(3):
        want, want_w, want_s, sums = ref.two_phase_allreduce([r["xs"][step] for r in results], wres, sres, divisors,
                                                          chunk)
        got = results[0]["onebit"][step]
        close = torch.isclose(got, want, rtol=1e-5, atol=1e-6)
        assert (~close).sum() <= max(1, n // 10_000)
        assert torch.all(sums[~close].abs() <= 1e-5 * sums.abs().max())
        seg = max(32, -(-(-(-n // world)) // 32) * 32)
        for r, res in enumerate(results):
            torch.testing.assert_close(res["whist"][step], want_w[r], rtol=1e-5, atol=1e-5)
            if world > 2:  # two ranks exchange whole messages: no sum is encoded again, no server residual
                ok = close[r * seg:(r + 1) * seg]
                torch.testing.assert_close(res["shist"][step][ok], want_s[r][ok], rtol=1e-5, atol=1e-5)
            else:
                assert res["shist"][step].numel() == 0
        wres = [res["whist"][step] for res in results]
        sres = [res["shist"][step] for res in results]
    # a message is the signs (a word per 32), the bf16 scales (two per int32) and a finiteness flag (an int32) of a
    # segment (two phases: an all-to-all, then an all-gather, a segment to each peer in each) or of the whole vector
    # on two ranks (one all-gather: the same bytes in one round)
    def message(numel):
        return 4 * (-(-numel // 32) + -(-(-(-numel // chunk)) // 2) + 1)
    if world == 2:
        assert results[0]["onebit_wire"] == {"bytes_sent": 3 * message(n), "calls": 3}
    else:
        assert results[0]["onebit_wire"] == {"bytes_sent": 3 * 2 * (world - 1) * message(min(seg, n)), "calls": 6}
    # top-k: sum of every rank's top-k of (x/d + residual), values rounded to bf16 (the residual keeps the rounding);
    # each entry 4 bytes (a 16-bit index inside its block of 2^16, padded to 4 bytes, and the value), a count per
    # block, the total
    k = hetcomm.ops.topk_count(n, ratio)
    message = 4 + 4 * -(-n // 2**16) + 4 * -(-k // 2) + 2 * k
    assert results[0]["topk_bytes"] == 3 * (world - 1) * message
    assert hetcomm.planner.topk_message_bytes(n, ratio) == message  # what auto's cost model counts
    tres = [torch.zeros(n) for _ in range(world)]
    for step in range(3):
        want = torch.zeros(n)
        for r in range(world):
            idx, val, tres[r] = ref.topk_wire(results[r]["xs"][step], tres[r], divisors[r], k)
            want[idx] += val
        torch.testing.assert_close(results[0]["topk"][step], want, rtol=1e-6, atol=1e-6)
    for r, res in enumerate(results):
        assert torch.equal(res["tres"], tres[r])
    # fp8 and int3: max-based scales (fp8's powers of two, int3's bf16 of max / 3) and rank-ordered sums make
    # the reference bit-exact, residuals included
    for wire, encode in (("fp8", ref.fp8_encode), ("int3", ref.int3_encode)):
        wres = [torch.zeros(n) for _ in range(world)]
        sres = [torch.zeros(hetcomm.ops.server_residual_numel(n, world, r)) for r in range(world)]
        for step in range(3):
            want, wres, sres, _ = ref.two_phase_allreduce([r["xs"][step] for r in results], wres, sres, divisors,
                                                          chunk, encode=encode)
            for r, res in enumerate(results):
                got, got_w, got_s = res[wire][step]
                assert torch.equal(got, want) and torch.equal(got_w, wres[r]) and torch.equal(got_s, sres[r])
            assert (want - sum(r["xs"][step] / d for r, d in zip(results, divisors))).abs().max() > 0  # lossy
    if world == 2:  # int3: 3 bits an element, 2 bytes a scale and the 4-byte flag, one message a step (one exchange)
        message = 4 * (3 * -(-n // 32) + -(-math.ceil(n / chunk) // 2)) + 4
        assert results[0]["int3_bytes"] == 3 * message


def _sweep_pieces(t, xs, reduce, worker_numel, server_numel, piece_counts):
    """Two steps per (pieces, wire) of ``reduce(y, wire, wres, sres, pieces)``
    with residuals carried: {(pieces, wire): (results, worker residual, server
    residual, bytes sent, calls)}."""
    out = {}
    for pieces in piece_counts:
        for wire in ("onebit", "fp8"):
            wres, sres, ys = torch.zeros(worker_numel), torch.zeros(server_numel), []
            before = t.counters()
            for x in xs:
                y = x.clone()
                reduce(y, wire, wres, sres, pieces)
                ys.append(y)
            after = t.counters()
            out[(pieces, wire)] = (ys, wres, sres, after["bytes_sent"] - before["bytes_sent"],
                                   after["calls"] - before["calls"])
    return out


def _assert_same_as_one_piece(out):
    """Every (pieces, wire) run left the one-piece run's sums and residuals bit
    for bit and sent its bytes."""
    for key, (ys, wres, sres, sent, _) in out.items():
        one = out[(1, key[1])]
        assert all(torch.equal(a, b) for a, b in zip(ys, one[0])), key
        assert torch.equal(wres, one[1]) and torch.equal(sres, one[2]), key
        assert sent == one[3], key


def _pieced(rank, world, n, chunk):
    """Two steps of onebit and fp8 (residuals carried) in 1, 2, 3, 7 and the
    automatic number of pieces; the bytes each sent."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    g = torch.Generator().manual_seed(7 + rank)
    xs = [torch.randn(n, generator=g) * (1 + 100 * (torch.rand(n, generator=g) < 0.01)) for _ in range(2)]

    def reduce(y, wire, wres, sres, pieces):
        getattr(t, f"allreduce_{wire}")(y, float(rank + 1), chunk, wres, sres, pieces=pieces)

    out = _sweep_pieces(t, xs, reduce, n, hetcomm.ops.server_residual_numel(n, world, rank), (1, 2, 3, 7, 0))
    error = None
    try:
        t.allreduce_onebit(torch.zeros(64), 1.0, 32, None, None, pieces=-1)
    except ValueError as e:
        error = str(e)
    return {"xs": xs, "out": out, "error": error}


@pytest.mark.parametrize("world,n,chunk,auto", [(2, 600_011, 256, 4), (3, 9_001, 32, 1), (3, 900_001, 256, 2)])
def test_two_phase_in_pieces_is_bit_identical_to_one_piece(world, n, chunk, auto):
    """A bucket's exchange pipelined in pieces (encode piece p + 1 while piece
    p is on the wire) sends the same bytes and leaves the same sums and
    residuals as in one piece, bit for bit; fp8's are the reference's.
    ``auto``: the pieces a bucket of n elements gets on gloo (one per 2**17
    elements of a message, at most 4: of a rank's segment, n / world, in the
    two phases; of the whole bucket in the exchange of two ranks)."""
    results = run_ranks(_pieced, world, n, chunk)
    for res in results:
        _assert_same_as_one_piece(res["out"])
        for key, (*_, calls) in res["out"].items():
            # each piece is its own all-to-all and all-gather (2 per step, 2 steps), on two ranks one all-gather
            assert calls == (2 if world == 2 else 4) * (key[0] or auto), key
        assert "pieces must be >= 0" in res["error"]
    # every rank holds the same sums; fp8 in pieces against the single-process reference, bit for bit
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["out"][(0, "onebit")][0], results[0]["out"][(0, "onebit")][0]))
    divisors = [float(r + 1) for r in range(world)]
    wres = [torch.zeros(n) for _ in range(world)]
    sres = [torch.zeros(hetcomm.ops.server_residual_numel(n, world, r)) for r in range(world)]
    for step in range(2):
        want, wres, sres, _ = ref.two_phase_allreduce([r["xs"][step] for r in results], wres, sres, divisors, chunk,
                                                      encode=ref.fp8_encode)
        for pieces in (3, 0):
            assert torch.equal(results[0]["out"][(pieces, "fp8")][0][step], want)


def _momentum_folded(rank, world, n, chunk):
    """Two steps of onebit and fp8 with momentum compression folded into the
    exchange (1, 3 and automatic pieces), and the same done around a one-piece
    exchange with the whole-bucket ops: {(pieces or "around", wire): (results,
    momentum, worker residual, server residual)}."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    g = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(n, generator=g) for _ in range(2)]
    m0 = torch.randn(n, generator=torch.Generator().manual_seed(5))  # the same on every rank, as the hook's m
    divisor, beta = float(rank + 1), 0.9
    alpha = beta * divisor / world  # what the engine folds in: beta * m in the weighted mean
    out = {}
    for how in ("around", 1, 3, 0):
        for wire in ("onebit", "fp8"):
            allreduce = getattr(t, f"allreduce_{wire}")
            m, wres = m0.clone(), torch.zeros(n)
            sres, ys = torch.zeros(hetcomm.ops.server_residual_numel(n, world, rank)), []
            for x in xs:
                y = x.clone()
                if how == "around":
                    hetcomm.ops.momentum_fold_in(y, m, alpha)
                    allreduce(y, divisor, chunk, wres, sres, pieces=1)
                    hetcomm.ops.momentum_handoff(y, m, beta)
                else:
                    allreduce(y, divisor, chunk, wres, sres, pieces=how, momentum=m, momentum_alpha=alpha, beta=beta)
                ys.append(y)
            out[(how, wire)] = (ys, m, wres, sres)
    errors = []
    for bad in (dict(momentum=torch.zeros(n - 1)), dict(momentum=torch.zeros(n), beta=1.0)):
        try:
            t.allreduce_onebit(torch.zeros(n), 1.0, chunk, None, None, **bad)
        except ValueError as e:
            errors.append(str(e))
    return {"out": out, "errors": errors}


def test_momentum_folded_into_the_pieces_is_the_fold_around_the_exchange():
    """Momentum compression inside the two phases (fold in before a piece is
    encoded, hand over once it is decoded) leaves the results, the momentum
    and both residuals bit for bit as folding in and handing over the whole
    bucket around a one-piece exchange; bad momentum arguments are errors."""
    for res in run_ranks(_momentum_folded, 2, 600_011, 256):
        out = res["out"]
        for (how, wire), (ys, m, wres, sres) in out.items():
            ref_ys, ref_m, ref_wres, ref_sres = out[("around", wire)]
            assert all(torch.equal(a, b) for a, b in zip(ys, ref_ys)), (how, wire)
            assert torch.equal(m, ref_m) and torch.equal(wres, ref_wres) and torch.equal(sres, ref_sres), (how, wire)
        assert "momentum must hold x's numel = 600011 elements, got 600010" in res["errors"][0]
        assert "beta must be in [0, 1), got 1" in res["errors"][1]


def _hierarchical_pieced(rank, world, n, chunk):
    """Hierarchical (2 nodes x 2 ranks) with onebit / fp8 across nodes, in 1, 3
    and the automatic number of pieces, two steps with residuals carried."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    node_of = [0, 0, 1, 1]
    shard = _C.hierarchical_shard_numel(n, node_of, rank)
    g = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(n, generator=g) for _ in range(2)]

    def reduce(y, wire, wres, sres, pieces):
        t.allreduce(y, "hierarchical", node_of=node_of, inter=wire, residual=wres, server_residual=sres,
                    chunk=chunk, pieces=pieces)

    out = _sweep_pieces(t, xs, reduce, shard, hetcomm.ops.server_residual_numel(shard, 2, node_of[rank]), (1, 3, 0))
    return {"out": out, "xs": xs}


def test_hierarchical_in_pieces_is_bit_identical_to_one_piece():
    """The across-nodes stage of hierarchical onebit / fp8 runs over a subgroup
    of point-to-point calls; in pieces it sends the same bytes and leaves the
    same sums and residuals, bit for bit, in more calls (auto: 4 pieces for a
    shard of ~550K elements, which the two nodes exchange whole). fp8's sums
    are the reference's bit for bit: exact node sums, then each local
    index's shard of them exchanged across the two nodes (encoded once, the
    decoded messages summed in node order), residuals carried."""
    n, chunk = 1_100_003, 256
    results = run_ranks(_hierarchical_pieced, 4, n, chunk)
    for res in (r["out"] for r in results):
        _assert_same_as_one_piece(res)
        for wire in ("onebit", "fp8"):  # each piece adds one exchange (one peer across: a send and a receive)
            assert res[(3, wire)][4] - res[(1, wire)][4] == 2 * 2 * 2, res[(3, wire)][4]
            assert res[(0, wire)][4] - res[(1, wire)][4] == 3 * 2 * 2
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["out"][(0, "onebit")][0], results[0]["out"][(0, "onebit")][0]))
    half = n // 2  # the two local indices' shards: [0, n / 2) and [n / 2, n)
    wres = {(li, nd): None for li in range(2) for nd in range(2)}
    for step in range(2):
        node_sums = [results[2 * nd]["xs"][step] + results[2 * nd + 1]["xs"][step] for nd in range(2)]
        want = torch.zeros(n)
        for li, (a, b) in enumerate(((0, half), (half, n))):
            prev = [wres[(li, nd)] if wres[(li, nd)] is not None else torch.zeros(b - a) for nd in range(2)]
            out, new_w, _, _ = ref.two_phase_allreduce([s[a:b] for s in node_sums], prev, [None, None], [1.0, 1.0],
                                                       chunk, encode=ref.fp8_encode)
            want[a:b] = out
            for nd in range(2):
                wres[(li, nd)] = new_w[nd]
        for r in results:
            assert torch.equal(r["out"][(0, "fp8")][0][step], want), step
    for rank, r in enumerate(results):  # this rank's worker residual: its node's, for its local index's shard
        assert torch.equal(r["out"][(0, "fp8")][1], wres[(rank % 2, rank // 2)])
