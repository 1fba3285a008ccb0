"""Property-based fuzz of every function bound from C++ and of hetcomm.ops:
any argument gives a result or a Python exception, never a signal or a hang.
Run by tests/test_fuzz.py in a child process (a crash there fails the test
and names the input); ``python tests/fuzz_bindings.py LOG`` runs it alone."""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hetcomm import _C, ops

LOG = open(sys.argv[1] if len(sys.argv) > 1 else os.devnull, "w")
ERRORS = (ValueError, TypeError, RuntimeError, IndexError, OverflowError)
EXAMPLES = int(os.environ.get("HETCOMM_FUZZ_EXAMPLES", "150"))

ints = st.one_of(st.integers(-40, 5000), st.sampled_from([-2**63, -2**31, 2**31 - 1, 2**31, 2**63 - 1, 0, 1, 32]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 0.5, 1e-300, 1e308]))
dtypes = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
                          torch.bool])
shapes = st.one_of(st.tuples(st.integers(0, 300)), st.tuples(st.integers(0, 20), st.integers(0, 20)), st.just(()))


@st.composite
def tensors(draw, dtype=None):
    dt = draw(dtypes) if dtype is None else dtype
    t = torch.zeros(draw(shapes), dtype=dt)
    if t.numel() and (dt.is_floating_point):
        t.copy_(torch.randn(t.shape) * draw(st.sampled_from([1.0, 1e30, 0.0])))
    elif t.numel() and dt != torch.bool:
        t.copy_(torch.randint(-3, 400, t.shape))
    if draw(st.booleans()) and t.dim() == 2 and t.shape[0] > 1:
        t = t.t()  # not contiguous
    return t


opt_tensors = st.one_of(st.none(), tensors(), tensors(torch.float32))
node_lists = st.lists(st.integers(-2, 3), max_size=5)


def call(name, fn, *args):
    LOG.write(f"{name}{tuple(a if not isinstance(a, torch.Tensor) else (a.dtype, tuple(a.shape)) for a in args)}\n")
    LOG.flush()
    try:
        fn(*args)
    except ERRORS:
        pass


common = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@common
@given(tensors(), opt_tensors, floats, ints)
def fuzz_sign_encode(g, r, d, c):
    call("sign_encode", ops.sign_encode, g, r, d, c)


@common
@given(tensors(), tensors(), ints, ints, floats, opt_tensors, st.booleans())
def fuzz_sign_decode(w, s, n, c, a, out, acc):
    call("sign_decode", ops.sign_decode, w, s, n, c, a, out, acc)


@common
@given(tensors(), opt_tensors, floats, ints, tensors(), tensors(), ints, floats, opt_tensors, st.booleans())
def fuzz_int3(g, r, d, c, w, s, n, a, out, acc):
    call("int3_encode", ops.int3_encode, g, r, d, c)
    call("int3_decode", ops.int3_decode, w, s, n, c, a, out, acc)


@common
@given(tensors(), opt_tensors, floats, ints, st.booleans(), opt_tensors)
def fuzz_topk_encode(g, r, d, k, exact, denominator):
    call("topk_encode", ops.topk_encode, g, r, d, k, exact, denominator)


@common
@given(tensors(), tensors(), tensors(), floats)
def fuzz_scatter_add(i, v, out, a):
    call("scatter_add", ops.scatter_add, i, v, out, a)


@common
@given(tensors(), floats, st.sampled_from(["float16", "bfloat16", "fp8", ""]), tensors(), floats, opt_tensors)
def fuzz_casts(x, d, wire, h, mul, out):
    call("cast_encode", ops.cast_encode, x, d, wire)
    call("cast_decode", ops.cast_decode, h, mul, out)


@common
@given(tensors(), tensors(), opt_tensors, floats, st.lists(st.tuples(ints, ints, ints), max_size=4))
def fuzz_lowrank_ops(p, qt, out, eps, blocks):
    call("lowrank_outer", ops.lowrank_outer, p, qt, out)
    call("lowrank_finish", ops.lowrank_finish, p, qt, out, None, 1.0 + abs(eps), 0.5)
    call("lowrank_project", ops.lowrank_project, p, qt, out, 1.0 + abs(eps))
    call("lowrank_back_project", ops.lowrank_back_project, p, qt, out, 1.0 + abs(eps))
    call("orthonormalize_columns", ops.orthonormalize_columns, p, eps)
    call("orthonormalize_blocks", ops.orthonormalize_blocks, p, blocks, eps)


@common
@given(tensors(), tensors(), floats)
def fuzz_momentum_ops(x, m, beta):
    call("momentum_fold_in", ops.momentum_fold_in, x, m, beta)
    call("momentum_handoff", ops.momentum_handoff, x, m, beta)


@common
@given(ints, ints, ints, floats, node_lists, st.lists(st.lists(ints, min_size=4, max_size=4), max_size=3))
def fuzz_size_helpers(n, world, rank, ratio, nodes, layout):
    call("onebit_segment_numel", ops.onebit_segment_numel, n, world, rank)
    call("server_residual_numel", ops.server_residual_numel, n, world, rank)
    call("topk_count", ops.topk_count, n, ratio)
    call("hierarchical_shard_numel", _C.hierarchical_shard_numel, n, nodes, rank)
    call("lowrank_q_numel", _C.lowrank_q_numel, torch.tensor(layout, dtype=torch.int64).reshape(-1, 4))


@common
@given(st.integers(0, 5000), st.integers(1, 9))
def fuzz_size_helpers_are_partitions(n, world):
    # Independent of the kernels: the segments and shards cover n exactly.
    assert sum(ops.onebit_segment_numel(n, world, r) for r in range(world)) == n
    assert all(ops.onebit_segment_numel(n, world, r) >= 0 for r in range(world))
    # one or two ranks exchange whole messages: no rank sums a segment, no server residual
    assert all(ops.server_residual_numel(n, world, r) == (ops.onebit_segment_numel(n, world, r) if world > 2 else 0)
               for r in range(world))
    nodes = [r // 2 for r in range(2 * world)]
    assert sum(_C.hierarchical_shard_numel(n, nodes, r) for r in (0, 1)) == n
    assert ops.topk_count(n, 1.0) == n and 0 <= ops.topk_count(n, 1e-9) <= n


TRANSPORT = None
ENGINE = None


@common
@given(tensors(), st.sampled_from(["native", "ring", "halving_doubling", "tree", "hierarchical", "x"]),
       node_lists, node_lists, st.sampled_from(["ring", "onebit", "int3", "topk", "zip"]), opt_tensors, opt_tensors, ints,
       floats)
def fuzz_transport_allreduce(x, algo, order, nodes, inter, res, sres, chunk, ratio):
    call("Transport.allreduce", TRANSPORT.allreduce, x, algo, order, nodes, inter, res, sres, chunk, ratio)


@common
@given(tensors(), floats, ints, floats, opt_tensors, opt_tensors, st.booleans(),
       st.lists(st.lists(ints, min_size=4, max_size=4), max_size=3), tensors(torch.float32),
       st.sampled_from(["fp32", "bf16", "fp16", ""]))
def fuzz_transport_compressed(x, d, chunk, ratio, r1, r2, exact, layout, q, wire):
    call("allreduce_onebit", TRANSPORT.allreduce_onebit, x, d, chunk, r1, r2)
    call("allreduce_int3", TRANSPORT.allreduce_int3, x, d, chunk, r1, r2)
    call("allreduce_topk", TRANSPORT.allreduce_topk, x, d, ratio, exact, r1, r2)
    call("allreduce_lowrank", TRANSPORT.allreduce_lowrank, x, d,
         torch.tensor(layout, dtype=torch.int64).reshape(-1, 4), q, r1, [], wire)


@common
@given(tensors(), tensors(), ints, ints)
def fuzz_transport_p2p(a, b, peer, tag):
    call("send", TRANSPORT.send, a, peer, tag)
    call("recv", TRANSPORT.recv, a, peer, tag)
    call("all_gather", TRANSPORT.all_gather, a, b)
    call("all_to_all", TRANSPORT.all_to_all, a, b)
    call("reduce_scatter_sum", TRANSPORT.reduce_scatter_sum, a, b, "native")
    call("set_nodes", TRANSPORT.set_nodes, [peer, tag][:abs(peer) % 3])


@common
@given(ints, tensors(), st.one_of(st.sampled_from(list(_C.Codec.__members__.values())), st.integers(-2, 8)), ints,
       floats, st.booleans(), opt_tensors, opt_tensors, st.booleans(),
       st.one_of(st.sampled_from(list(_C.Algo.__members__.values())), st.integers(-1, 6)), node_lists, node_lists,
       floats, opt_tensors, opt_tensors)
def fuzz_engine(index, buf, codec, chunk, ratio, exact, res, sres, last, algo, order, nodes, batch, denominator,
                first):
    def submit():
        ENGINE.submit_bucket(index, buf, codec, chunk, ratio, exact, res, sres, last, None, None, algo,
                             update_denominator=denominator, sum_first=first).wait()
    call("Engine.submit_bucket", submit)
    call("Engine.finish_sum", lambda: ENGINE.finish_sum().wait())
    call("Engine.set_topology", ENGINE.set_topology, order, nodes)
    call("Engine.set_nodes", ENGINE.set_nodes, nodes)
    call("Engine.submit_batch_size", lambda: ENGINE.submit_batch_size(batch).wait())
    call("Engine.submit_config", lambda: ENGINE.submit_config(buf.long() if buf.is_floating_point() else buf).wait())
    call("Engine.submit_sum", lambda: ENGINE.submit_sum(buf).wait())


@st.composite
def lowrank_inputs(draw):
    """(bucket, layout, Q state, residual): as often as not ones that fit together (float32 values that may be
    huge or not finite, a row of `rows` x `cols` at rank 0 or 1), else any."""
    if draw(st.booleans()):
        n = draw(st.integers(1, 300))
        buf = torch.randn(n) * draw(st.sampled_from([1.0, 1e30, 0.0]))
        if draw(st.booleans()):
            buf[draw(st.integers(0, n - 1))] = draw(st.sampled_from([float("inf"), float("-inf"), float("nan")]))
        rows = draw(st.sampled_from([d for d in range(1, min(n, 12) + 1) if n % d == 0]))
        rank = draw(st.integers(0, 1))
        res = draw(st.sampled_from([None, "zeros", "randn"]))
        res = None if res is None else torch.zeros(n) if res == "zeros" else torch.randn(n)
        return buf, [[0, rows, n // rows, rank]], torch.randn(n // rows * rank), res
    return (draw(tensors()), draw(st.lists(st.lists(ints, min_size=4, max_size=4), max_size=3)),
            draw(tensors(torch.float32)), draw(opt_tensors))


@common
@given(lowrank_inputs(), st.booleans(), st.booleans(), st.sampled_from(["sum", "bucket", "close"]))
def fuzz_engine_pipelined(inputs, last, hold, then):
    """The hook's lowrank buckets (pipeline=True): one that is not the step's last waits for the next job (after
    its first all-reduce, or before it: hold), which ends its step whatever kind it is; nothing hangs, whatever
    the input. An engine of its own per example (a
    failed job latches its engine)."""
    buf, layout, q, res = inputs
    engine = _C.Engine(dist.group.WORLD)

    before = [t.clone() if isinstance(t, torch.Tensor) else t for t in (buf, q, res)]

    def run():
        fut = engine.submit_bucket(0, buf, _C.Codec.lowrank, 32, 0.01, True, res, None, last,
                                   layout=torch.tensor(layout, dtype=torch.int64).reshape(-1, 4), q_state=q,
                                   pipeline=True, hold=hold)
        try:
            if then == "sum":
                engine.submit_sum(torch.ones(1)).wait()
            elif then == "bucket":
                engine.submit_bucket(1, torch.ones(4), _C.Codec.none, 32, 0.01, True, None, None, True).wait()
            else:
                engine.close()
        finally:
            fut.wait()
        if buf.is_floating_point() and not torch.isfinite(before[0]).all():
            # one rank, not finite: reduced exactly (x / 1), Q and the residual as they were
            for now, was in zip((buf, q, res), before):
                if isinstance(now, torch.Tensor):
                    torch.testing.assert_close(now, was, rtol=0, atol=0, equal_nan=True)
    call("Engine.submit_bucket(pipeline=True)", run)
    engine.close()


def main():
    global TRANSPORT, ENGINE
    dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
    TRANSPORT = _C.ProcessGroupTransport(dist.group.WORLD)
    for fn in [v for k, v in sorted(globals().items()) if k.startswith("fuzz_") and k != "fuzz_engine"]:
        fn()
    # A fresh engine per batch of examples: a failed job latches its engine.
    for _ in range(3):
        ENGINE = _C.Engine(dist.group.WORLD)
        fuzz_engine()
        del ENGINE  # dropped without close(), jobs possibly queued: must not deadlock
    print("fuzz ok")


if __name__ == "__main__":
    main()
