"""GPU-only tests. The CPU tests' bodies run on CUDA through two fixtures
(tests/conftest.py): `device` (kernels and ops: CUDA against the CPU, bit for
bit) and `place` (distributed tests: cpu-gloo, cuda-gloo with the ranks
sharing a GPU, cuda-nccl with one GPU per rank). Here, what has no CPU twin:
the kernels against the CPU at sizes up to 10^6, every algorithm and wire of
`hetcomm bench allreduce` on CUDA tensors against the same on CPU tensors,
hetcomm's own NCCL communicator against the process-group transport, and the
NCCL transport's collectives in closed form (marker cuda2). They skip cleanly
without a CUDA build of hetcomm and enough visible GPUs (decided at run time)."""

import pytest
import torch

import hetcomm
from hetcomm import ops, planner, topology
from hetcomm.benchmarks import allreduce

from . import models
from .dist_harness import run_ranks


@pytest.mark.cuda
@pytest.mark.parametrize("n", [1, 33, 2049, 10**6])
def test_cuda_kernels_match_the_cpu_bit_for_bit(n):
    g = torch.randn(n) * 3
    e = torch.randn(n) * 0.1
    for chunk in (32, 256, 2048):  # onebit's default, fp8's, and the register kernel's
        res_cpu, res_gpu = e.clone(), e.cuda()
        w_cpu, s_cpu = ops.sign_encode(g, res_cpu, 3.0, chunk)
        w_gpu, s_gpu = ops.sign_encode(g.cuda(), res_gpu, 3.0, chunk)
        assert torch.equal(w_gpu.cpu(), w_cpu) and torch.equal(s_gpu.cpu(), s_cpu)
        assert torch.equal(res_gpu.cpu(), res_cpu)
        assert torch.equal(ops.sign_decode(w_gpu, s_gpu, n, chunk).cpu(), ops.sign_decode(w_cpu, s_cpu, n, chunk))
        c_cpu, f_cpu = ops.fp8_encode(g, e.clone(), 3.0, chunk)
        c_gpu, f_gpu = ops.fp8_encode(g.cuda(), e.cuda(), 3.0, chunk)
        assert torch.equal(c_gpu.cpu(), c_cpu) and torch.equal(f_gpu.cpu(), f_cpu)
        i_res_cpu, i_res_gpu = e.clone(), e.cuda()
        i_cpu, is_cpu = ops.int3_encode(g, i_res_cpu, 3.0, chunk)
        i_gpu, is_gpu = ops.int3_encode(g.cuda(), i_res_gpu, 3.0, chunk)
        assert torch.equal(i_gpu.cpu(), i_cpu) and torch.equal(is_gpu.cpu(), is_cpu)
        assert torch.equal(i_res_gpu.cpu(), i_res_cpu)
        # decodes into a view one element in (misaligned: no 16-byte stores), accumulating
        base = torch.randn(n + 1)
        for decode, wire, scales in ((ops.sign_decode, (w_cpu, w_gpu), (s_cpu, s_gpu)),
                                     (ops.fp8_decode, (c_cpu, c_gpu), (f_cpu, f_gpu)),
                                     (ops.int3_decode, (i_cpu, i_gpu), (is_cpu, is_gpu))):
            want = decode(wire[0], scales[0], n, chunk, 0.5, base[1:].clone(), True)
            got = decode(wire[1], scales[1], n, chunk, 0.5, base.cuda()[1:], True)
            assert torch.equal(got.cpu(), want), (decode.__name__, chunk)
    for wire in ("float16", "bfloat16"):
        # whole tensors (four a thread) and views one element in (misaligned: one a thread)
        for lo in (0, 1):
            src, src_gpu = g[lo:], g.cuda()[lo:]
            h_cpu, h_gpu = ops.cast_encode(src, 3.0, wire), ops.cast_encode(src_gpu, 3.0, wire)
            assert torch.equal(h_gpu.cpu(), h_cpu), (wire, lo)
            out_gpu = torch.zeros(n + 1, device="cuda")[1:1 + src.numel()]  # a misaligned destination
            for dst in (None, out_gpu):
                assert torch.equal(ops.cast_decode(h_gpu, 0.5, dst).cpu(), ops.cast_decode(h_cpu, 0.5)), (wire, lo)
    idx_c, val_c = ops.topk_encode(g, None, 1.0, max(1, n // 100), exact=True)
    idx_g, val_g = ops.topk_encode(g.cuda(), None, 1.0, max(1, n // 100), exact=True)
    assert torch.equal(idx_g.cpu(), idx_c) and torch.equal(val_g.cpu(), val_c)
    # sampled: the GPU's compaction (blocks race for their slots) returns the CPU's selection, sorted
    k = max(1, n // 100)
    idx_c, val_c = ops.topk_encode(g, None, 1.0, k, exact=False)
    idx_g, val_g = ops.topk_encode(g.cuda(), None, 1.0, k, exact=False)
    assert torch.equal(idx_g.cpu(), idx_c) and torch.equal(val_g.cpu(), val_c)
    # ranked by |x| / denominator (an attached Adam's sqrt(v) + eps), the residual keeping the rest
    d = torch.rand(n, generator=torch.Generator().manual_seed(n)) * 4 + 0.25
    for exact in (True, False):
        res_cpu, res_gpu = e.clone(), e.cuda()
        idx_c, val_c = ops.topk_encode(g, res_cpu, 2.0, k, exact=exact, denominator=d)
        idx_g, val_g = ops.topk_encode(g.cuda(), res_gpu, 2.0, k, exact=exact, denominator=d.cuda())
        assert torch.equal(idx_g.cpu(), idx_c) and torch.equal(val_g.cpu(), val_c), exact
        assert torch.equal(res_gpu.cpu(), res_cpu), exact
    p, qt = torch.randn(max(1, n // 1000), 4), torch.randn(4, 777)
    assert torch.equal(ops.lowrank_outer(p.cuda(), qt.cuda()).cpu(), ops.lowrank_outer(p, qt))
    x2, r2 = torch.randn(p.shape[0], 777) * 5, torch.randn(p.shape[0], 777) * 1e-3
    x2g, r2g = x2.cuda(), r2.cuda()
    ops.lowrank_finish(p, qt, x2, r2, 3.0, 0.37)
    ops.lowrank_finish(p.cuda(), qt.cuda(), x2g, r2g, 3.0, 0.37)
    assert torch.equal(x2g.cpu(), x2) and torch.equal(r2g.cpu(), r2)
    x_cpu, m_cpu, x_gpu, m_gpu = g.clone(), e.clone(), g.cuda(), e.cuda()
    for x, m in ((x_cpu, m_cpu), (x_gpu, m_gpu)):
        ops.momentum_fold_in(x, m, 0.45)
        ops.momentum_handoff(x, m, 0.9)
    assert torch.equal(x_gpu.cpu(), x_cpu) and torch.equal(m_gpu.cpu(), m_cpu)


WIRES = ("none", "fp16", "bf16", "fp8", "onebit", "topk")


def _wires_on(device, rank, world):
    """Two calls of every algorithm x wire `hetcomm bench allreduce` runs (error
    feedback carried from the first into the second) on this rank's seeded input,
    the ranks split into two "nodes" for the hierarchical algorithm."""
    import torch.distributed as dist

    topo = topology.Topology(world=world, nodes=[f"node{r * 2 // world}" for r in range(world)],
                             devices=[{}] * world)
    t = hetcomm._C.ProcessGroupTransport(dist.group.WORLD, device)
    base = (torch.randn(5003, generator=torch.Generator().manual_seed(rank)) * 3).to(device)
    out = {}
    for algo in topology.ALGORITHMS:
        for wire in WIRES:
            if not planner.applies(topo, algo, wire):
                continue
            state = allreduce.wire_state(base.numel(), algo, wire, topo, rank, device)
            results = []
            for call in range(2):
                x = base * (call + 1)
                allreduce.reduce_once(t, x, algo, wire, topo, state, topk_ratio=0.05)
                results.append(x.cpu())
            out[f"{algo}/{wire}"] = results + [state["w"].cpu(), state["s"].cpu()]
    t.barrier()
    return out


def _wires_cpu_and_shared_gpu(rank, world):
    torch.cuda.set_device(0)
    return {"cpu": _wires_on(torch.device("cpu"), rank, world), "cuda": _wires_on(torch.device("cuda", 0), rank, world)}


@pytest.mark.cuda
@pytest.mark.parametrize("world", [2, 4])
def test_every_algorithm_and_wire_on_a_shared_gpu_equals_the_cpu_bit_for_bit(world):
    """CUDA tensors through the process-group transport (gloo: host copies) and
    the CUDA codecs give the very bits the CPU path gives, on every rank: with
    4 ranks (two "nodes" of two), and with 2, where the dense wires sum in one
    exchange of the whole vector and fp8 / onebit exchange whole compressed
    messages once."""
    results = run_ranks(_wires_cpu_and_shared_gpu, world)
    keys = results[0]["cpu"].keys()
    if world == 4:  # every algorithm x dense wire, fp8/onebit/topk native and hierarchical
        assert len(keys) == 5 * 3 + 2 * 3
    for rank, r in enumerate(results):
        for key in keys:
            for i, (c, g) in enumerate(zip(r["cpu"][key], r["cuda"][key])):
                assert torch.equal(c, g), (rank, key, i)
            # the reduced values (not the residuals) are the same on every rank
            for i in range(2):
                assert torch.equal(r["cuda"][key][i], results[0]["cuda"][key][i]), (rank, key, i)
    exact = sum(torch.randn(5003, generator=torch.Generator().manual_seed(r)) * 3 for r in range(world))
    assert torch.allclose(results[0]["cuda"]["ring/none"][0], exact, rtol=1e-5, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["none", "fp16", "onebit", "topk", "lowrank"])
def test_nccl_with_one_rank_equals_the_process_group_transport(mode):
    """hetcomm's own NCCL communicator (world 1) and the process-group transport
    run the same codecs on the same GPU: the same bits after 10 steps."""
    nccl = run_ranks(models.replicas, 1, mode, 10, "cuda", {}, backend="nccl")[0]
    pg = run_ranks(models.replicas, 1, mode, 10, "cuda", {"transport": "pg"})[0]
    assert torch.equal(nccl["params"], pg["params"])
    assert nccl["stats"]["iter"] == 10


def _mixed_precision_on_the_gpu(rank, world, modes, steps, overflow_at):
    """Rank 0 in bf16 autocast, rank 1 in fp16 autocast with loss scaling
    (hetcomm.amp.GradScaler on "cuda"), both on GPU 0; rank 1's loss overflows
    at ``overflow_at``. Per mode: this rank's parameters, skipped steps, losses."""
    from hetcomm import modes as mode_table

    precision = ("bf16", "fp16")[rank]
    out = {}
    for mode in modes:
        model = models.mlp(hidden=128)
        net = models.ddp(model, 0, "cuda", bucket_cap_mb=0.02)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        m = mode_table.get(mode)
        state = m.register(net, opt, total_steps=steps, min_compress_numel=1000)
        scaler = hetcomm.amp.GradScaler(state, "cuda", precision=precision)
        taken, skipped, losses = [], [], []
        opt.register_step_post_hook(lambda *_: taken.append(True))
        for step in range(steps):
            x, _ = models.batch(rank, step, 16)
            y = x[:, :models.OUT].argmax(1)  # a learnable rule (models.batch's labels are noise)
            opt.zero_grad()
            with scaler.autocast():
                loss = torch.nn.functional.cross_entropy(net(x.cuda()), y.cuda())
            losses.append(loss.item())
            if step == overflow_at and precision == "fp16":
                loss = loss * 1e9  # beyond fp16's range once scaled: the gradient overflows
            before = len(taken)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if len(taken) == before:
                skipped.append(step)
        out[mode] = {"params": models.flat_params(model), "skipped": skipped, "losses": losses,
                     "precisions": state.stats()["precisions"]}
        state.close()
    return out


@pytest.mark.cuda
def test_bf16_and_fp16_ranks_on_a_shared_gpu_stay_identical_and_skip_together():
    """hetcomm.amp on CUDA autocast (#19 ran it on the CPU's): a bf16 rank next to an
    fp16 + scaler rank, exact, fp8 and onebit of the momentum (its CUDA kernels in
    DDP): replicas bit-identical, the fp16 rank's overflow skipped on both, training."""
    modes, steps, overflow_at = ("none", "fp8", "onebit+m"), 60, 7
    r0, r1 = run_ranks(_mixed_precision_on_the_gpu, 2, modes, steps, overflow_at)
    for mode in modes:
        assert torch.equal(r0[mode]["params"], r1[mode]["params"]), mode
        assert r0[mode]["skipped"] == r1[mode]["skipped"] and overflow_at in r0[mode]["skipped"], mode
        assert len(r0[mode]["skipped"]) <= 3, (mode, r0[mode]["skipped"])  # the overflow, not a stuck scale
        assert r0[mode]["precisions"] == ["bf16", "fp16"]
        for r in (r0, r1):
            first, last = sum(r[mode]["losses"][:5]) / 5, sum(r[mode]["losses"][-5:]) / 5
            assert last < 0.7 * first, (mode, first, last)


def _cuda_at_a_ranks_start(rank, world):
    """What a rank forked from the launcher's fork server finds: torch's CUDA
    not initialised (torch refuses CUDA in a child forked after that), then a
    CUDA all-reduce over gloo that works (a driver initialised in the server
    would fail it with CUDA's initialization error)."""
    import torch.distributed as dist

    was_initialized = torch.cuda.is_initialized()
    x = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(x)
    return was_initialized, x.cpu()


@pytest.mark.cuda
def test_a_rank_forked_from_the_fork_server_starts_without_cuda_and_can_use_it():
    world = 2
    for rank, (was_initialized, x) in enumerate(run_ranks(_cuda_at_a_ranks_start, world)):
        assert not was_initialized, rank
        assert torch.equal(x, torch.full((4,), world * (world + 1) / 2)), rank


def _gpus(k):
    if not (hetcomm.build_info()["cuda"] and torch.cuda.device_count() >= k):
        pytest.skip(f"needs a CUDA build of hetcomm and {k} visible GPUs")


def _nccl_ops(rank, world):
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    t = hetcomm._C.NcclTransport(dist.distributed_c10d._get_default_store(), "test-nccl", rank, world, rank, 60.0)
    out = {}
    x = torch.full((1000,), float(rank + 1), device=dev)
    t.all_reduce_sum(x)
    out["all_reduce"] = x.cpu()
    g = torch.empty(world * 3, device=dev)
    t.all_gather(g, torch.full((3,), float(rank), device=dev))
    out["all_gather"] = g.cpu()
    send = torch.tensor([rank * 100 + j for j in range(world)], dtype=torch.int32, device=dev)
    recv = torch.empty_like(send)
    t.all_to_all(recv, send)
    out["all_to_all"] = recv.cpu()
    rs = torch.empty(3, device=dev)
    t.reduce_scatter_sum(rs, torch.arange(world * 3, dtype=torch.float32, device=dev) + 100 * rank)
    out["reduce_scatter"] = rs.cpu()
    buf = torch.empty(5, dtype=torch.float64, device=dev)
    t.send_recv(torch.full((5,), float(rank), dtype=torch.float64, device=dev), (rank + 1) % world, buf,
                (rank - 1) % world)
    out["recv"] = buf.cpu()
    for algorithm in ("native", "ring", "halving_doubling", "tree"):
        y = torch.arange(10001, dtype=torch.float32, device=dev) * (rank + 1)
        t.allreduce(y, algorithm)
        out[algorithm] = y.cpu()
    for algorithm in ("native", "ring", "tree"):  # empty buckets: nothing to send, no error
        t.allreduce(torch.empty(0, device=dev), algorithm)
    t.barrier()
    return out


@pytest.mark.cuda2
def test_nccl_transport_collectives_closed_form():
    _gpus(2)
    world = min(torch.cuda.device_count(), 4)
    for rank, r in enumerate(run_ranks(_nccl_ops, world, backend="nccl")):
        assert torch.equal(r["all_reduce"], torch.full((1000,), world * (world + 1) / 2))
        assert torch.equal(r["all_gather"], torch.arange(world).float().repeat_interleave(3))
        assert r["all_to_all"].tolist() == [i * 100 + rank for i in range(world)]
        want = torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32) * world + 100 * world * (world - 1) / 2
        assert torch.equal(r["reduce_scatter"], want)
        assert torch.equal(r["recv"], torch.full((5,), float((rank - 1) % world), dtype=torch.float64))
        for algorithm in ("native", "ring", "halving_doubling", "tree"):
            assert torch.equal(r[algorithm], torch.arange(10001, dtype=torch.float32) * (world * (world + 1) // 2))
