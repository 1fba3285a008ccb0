"""DDP's options for irregular training with hetcomm's hook: uneven inputs
(``model.join()``, torch's Join), ``find_unused_parameters`` and ``static_graph``;
a ``torch.compile``d DDP model; frozen parameters, ``ZeroRedundancyOptimizer`` and
a second optimizer beside an attached one; parameters in bf16 or fp16, the
whole model or one layer, and in fp64; a channels_last convolutional model; a
convolutional model with BatchNorm (buffers DDP broadcasts); copies of the model
(an EMA's deepcopy); a language model with tied weights under activation
checkpointing and gradient accumulation; a GAN's loops (a gradient thrown
away after its exchange, Lightning's toggle_optimizer).

Join: a rank whose inputs run out shadows the others' backward by running the hook
over zero buckets, without a ``set_local_batch_size``; the reduced gradient of
those steps is checked against a single-process gradient of the samples the
ranks still training had, scaled as DDP's ``divide_by_initial_world_size``
says."""

import contextlib
import logging
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm

from . import models
from .dist_harness import each_mode, hetcomm_records, run_ranks

STEPS = (3, 5, 7)  # each rank's number of batches: rank 0 joins first, rank 2 trains alone at the end
EQUAL = (16, 16, 16)
UNEQUAL = (8, 16, 24)


def _uneven(rank, world, how, sizes, even, mode="none", attach=False, clip=False):
    """Rank r trains STEPS[r] batches of sizes[r] inside ``ddp.join(even)``.
    ``how``: "torch" (DDP's own all-reduce), "weighted" (hetcomm,
    set_local_batch_size every step) or "unweighted" (hetcomm without it).
    Returns the parameters before and the gradient after each of this rank's
    steps, and the state's stats."""
    model = models.mlp(hidden=128)
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets
    state = None
    if how != "torch":
        state = hetcomm.HookState(mode, min_compress_numel=1000, topk_ratio=0.05)
        ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if attach:
        state.attach_optimizer(opt)
    out = {"params": [], "grads": [], "error": None}
    try:
        with ddp.join(divide_by_initial_world_size=even):
            for step in range(STEPS[rank]):
                x, y = models.batch(rank, step, sizes[rank])
                if how == "weighted":
                    state.set_local_batch_size(sizes[rank])
                out["params"].append(models.flat_params(model))
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ddp(x), y).backward()
                out["grads"].append(models.flat_grads(model))
                if clip:
                    state.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
    except RuntimeError as e:
        out["error"] = str(e)
    out["final"] = models.flat_params(model)
    out["stats"] = state.stats() if state is not None else None
    return out


def _reference(params, step, sizes, even):
    """The gradient DDP's join gives at ``step``: the full-batch gradient of
    the batches of the ranks still training, times their share of every rank's
    samples if ``even`` (divide_by_initial_world_size=True: a joined rank
    counts with zero gradient)."""
    active = [r for r in range(len(STEPS)) if step < STEPS[r]]
    g = models.full_batch_grad(params, [models.batch(r, step, sizes[r]) for r in active], hidden=128)
    return g * (sum(sizes[r] for r in active) / sum(sizes)) if even else g


EXACT_CASES = [("torch", EQUAL, True),  # checks the reference: DDP's own semantics
               ("weighted", EQUAL, True), ("weighted", UNEQUAL, True), ("weighted", UNEQUAL, False),
               ("unweighted", EQUAL, True)]


@pytest.fixture(scope="module")
def exact_runs():
    return {case: run_ranks(_uneven, 3, *case) for case in EXACT_CASES}


@pytest.mark.parametrize("how,sizes,even", EXACT_CASES)
def test_joined_ranks_leave_the_mean_over_the_remaining_samples(exact_runs, how, sizes, even):
    results = exact_runs[(how, sizes, even)]
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        assert len(r["grads"]) == STEPS[rank]
        for step, (params, grad) in enumerate(zip(r["params"], r["grads"])):
            want = _reference(params, step, sizes, even)
            rel = ((grad - want).norm() / want.norm()).item()
            assert rel <= 1e-6, (how, sizes, even, rank, step, rel)
        if how != "torch":
            assert r["stats"].get("join_steps", 0) == STEPS[-1] - STEPS[rank]  # the steps it shadowed
    for r in results[1:]:  # DDP hands the last rank's model to the joined ones at the end
        assert torch.equal(r["final"], results[0]["final"])


COMPRESSED_CASES = [("onebit", False), ("topk", False), ("lowrank", False), ("fp8", False),
                    ("onebit", True), ("topk", True)]


@pytest.fixture(scope="module")
def compressed_runs():
    return {case: run_ranks(_uneven, 3, "weighted", UNEQUAL, True, *case) for case in COMPRESSED_CASES}


@pytest.mark.parametrize("mode,attach", COMPRESSED_CASES)
def test_compressed_modes_train_on_through_the_join(compressed_runs, mode, attach):
    """The ranks still training get the same gradient on every step (so
    identical replicas), compressed, while the joined ones shadow them."""
    results = compressed_runs[(mode, attach)]
    for rank, r in enumerate(results):
        assert r["error"] is None, r["error"]
        assert r["stats"].get("join_steps", 0) == STEPS[-1] - STEPS[rank]
        assert r["stats"]["last_step"]["compression_ratio"] > 3, r["stats"]["last_step"]
    for step in range(STEPS[-1]):
        active = [r for rank, r in enumerate(results) if step < STEPS[rank]]
        for r in active[1:]:
            assert torch.equal(r["grads"][step], active[0]["grads"][step]), (mode, attach, step)
            assert torch.equal(r["params"][step], active[0]["params"][step]), (mode, attach, step)
        assert torch.isfinite(active[0]["grads"][step]).all()


def test_clipping_compressed_buckets_inside_a_join_is_a_clear_error():
    """clip_grad_norm_'s estimate is a collective of the ranks still training
    that a joined rank cannot shadow: the joined rank says so (the others then
    fail at the engine's timeout instead of hanging)."""
    results = run_ranks(_uneven, 2, "weighted", EQUAL, True, "onebit", False, True, check=False, pg_timeout=6,
                        timeout=120)
    r0 = results[0]
    assert r0 is not None and r0["error"] is not None, r0
    assert "throw_on_early_termination" in r0["error"] and "clip_grad_norm_" in r0["error"]
    assert len(r0["grads"]) == STEPS[0]
    assert results[1] is None or results[1]["error"] is not None


def _hooked(ddp, how, min_numel, lr=0.05, **options):
    """SGD-momentum at ``lr`` on ``ddp`` with DDP's own all-reduce (``how`` "torch") or
    hetcomm's hook in mode ``how`` ("+m": the momentum attached), HookState's
    ``options`` besides: (HookState or None, optimizer)."""
    state = None
    if how != "torch":
        state = hetcomm.HookState(how.split("+")[0], min_compress_numel=min_numel, **options)
        ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    if how.endswith("+m"):
        state.attach_optimizer(opt)
    return state, opt


class _Branchy(nn.Module):
    """A model whose head depends on the step (and rank): some parameters get
    no gradient on some ranks, one never does."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head_a, self.head_b = nn.Linear(32, 64), nn.Linear(64, 10), nn.Linear(64, 10)
        self.never = nn.Linear(64, 10)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.head_b(h) if use_b else self.head_a(h)


UNUSED_STEPS = 8


def _unused(rank, world, how, option):
    """``find_unused_parameters=True`` with the head switching per step and
    rank, or ``static_graph=True`` with one head always unused; DDP's own
    all-reduce (``how`` "torch") or hetcomm's hook in mode ``how``
    ("+m": SGD-momentum attached). Each step's gradients by name."""
    net = DDP(_Branchy(), bucket_cap_mb=0.001, **{option: True})  # a bucket or two per layer
    state, opt = _hooked(net, how, 100)
    grads = []
    for step in range(UNUSED_STEPS):
        x, y = models.batch(rank, step, 16)
        if state is not None:
            state.set_local_batch_size(16)
        opt.zero_grad(set_to_none=True)
        use_b = (step + rank) % 2 == 0 if option == "find_unused_parameters" else True
        nn.functional.cross_entropy(net(x, use_b), y).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in net.module.named_parameters()})
        opt.step()
    return {"grads": grads, "final": models.flat_params(net.module)}


@pytest.mark.parametrize("option", ["find_unused_parameters", "static_graph"])
def test_unused_parameters_reduce_as_ddp_does(option):
    """Mode none gives DDP's own gradients to the bit, None where DDP leaves
    one None (a parameter no rank used); compressed momentum keeps the
    replicas identical."""
    results = run_ranks(each_mode, 2, _unused, ["torch", "none", "onebit+m"], option)
    for r in results:
        for step in range(UNUSED_STEPS):
            theirs, ours = r["torch"]["grads"][step], r["none"]["grads"][step]
            assert theirs.keys() == ours.keys()
            for name, g in theirs.items():
                if g is None:
                    assert ours[name] is None and r["onebit+m"]["grads"][step][name] is None, (option, step, name)
                else:
                    assert torch.equal(g, ours[name]), (option, step, name)
        assert theirs["never.weight"] is None
    for how in ("none", "onebit+m"):
        assert torch.equal(results[0][how]["final"], results[1][how]["final"]), how
    assert not torch.equal(results[0]["onebit+m"]["final"], results[0]["none"]["final"])  # it compressed


COMPILE_STEPS = 5


def _compiled(rank, world, how):
    """``torch.compile`` of the DDP model (Dynamo's DDP optimizer splits the
    graph at the buckets; backend aot_eager: no C++ compile in the test),
    DDP's own all-reduce (``how`` "torch") or hetcomm's hook."""
    model = models.mlp(hidden=128)
    ddp = DDP(model)
    state, opt = _hooked(ddp, how, 1000)
    net = torch.compile(ddp, backend="aot_eager")
    grads = []
    for step in range(COMPILE_STEPS):
        x, y = models.batch(rank, step, 16)
        if state is not None:
            state.set_local_batch_size(16)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        grads.append(models.flat_grads(model))
        opt.step()
    return {"grads": grads, "final": models.flat_params(model), "iter": state.iter if state else None}


def test_a_compiled_ddp_model_reduces_through_the_hook():
    results = run_ranks(each_mode, 2, _compiled, ["torch", "none", "onebit+m"])
    for r in results:
        for step in range(COMPILE_STEPS):
            assert torch.equal(r["none"]["grads"][step], r["torch"]["grads"][step]), step
        assert r["none"]["iter"] == r["onebit+m"]["iter"] == COMPILE_STEPS  # the hook ran once a step
    for how in ("none", "onebit+m"):
        assert torch.equal(results[0][how]["final"], results[1][how]["final"]), how
    assert not torch.equal(results[0]["onebit+m"]["final"], results[0]["none"]["final"])  # it compressed


FROZEN_STEPS = 6


def _frozen(rank, world, how, zero):
    """Fine-tuning as users write it: the first layer frozen
    (``requires_grad_(False)``: DDP leaves it out of its buckets) but still in
    the optimizer's ``model.parameters()``, AdamW, optionally sharded by
    ``ZeroRedundancyOptimizer``; DDP's own all-reduce (``how`` "torch") or
    hetcomm's hook in mode ``how``. "onebit+m": SGD-momentum attached for the
    first two trainable tensors, a second SGD-momentum (not attached) for the
    rest. ``attach_error``: what attaching the ZeRO optimizer raised."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = models.mlp(hidden=128)
    frozen = list(model.parameters())[:2]
    for p in frozen:
        p.requires_grad_(False)
    before = [p.clone() for p in frozen]
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets
    state = None
    if how != "torch":
        state = hetcomm.HookState(how.split("+")[0], min_compress_numel=1000)
        ddp.register_comm_hook(state, hetcomm.hook)
    trainable = list(model.parameters())[2:]
    if how == "onebit+m":
        opts = [torch.optim.SGD(trainable[:2], lr=0.05, momentum=0.9),
                torch.optim.SGD(trainable[2:], lr=0.05, momentum=0.9)]
        state.attach_optimizer(opts[0])
    elif zero:
        opts = [ZeroRedundancyOptimizer(list(model.parameters()), optimizer_class=torch.optim.AdamW, lr=1e-3)]
    else:
        opts = [torch.optim.AdamW(model.parameters(), lr=1e-3)]
    attach_error = None
    if zero and state is not None:
        try:
            hetcomm.HookState("onebit").attach_optimizer(opts[0])
        except ValueError as e:
            attach_error = str(e)
    for step in range(FROZEN_STEPS):
        x, y = models.batch(rank, step, 16)
        if state is not None:
            state.set_local_batch_size(16)
        for opt in opts:
            opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        for opt in opts:
            opt.step()
    return {"final": models.flat_params(model), "frozen_kept": all(torch.equal(a, b) for a, b in zip(before, frozen)),
            "tail": torch.cat([p.detach().reshape(-1) for p in trainable[2:]]), "attach_error": attach_error,
            "ratio": state.stats()["last_step"]["compression_ratio"] if state is not None else None}


@pytest.mark.parametrize("zero", [False, True], ids=["adamw", "zero"])
def test_frozen_parameters_and_zero_redundancy_optimizer(zero):
    """Mode none equals DDP's own all-reduce to the bit with a frozen layer in
    the optimizer, sharded by ZeRO or not; the frozen layer never moves;
    compressed modes keep identical replicas; attaching a ZeRO optimizer is
    refused naming the reason."""
    hows = ["torch", "none", "fp8"] + ([] if zero else ["onebit+m"])
    results = run_ranks(each_mode, 2, _frozen, hows, zero)
    init = models.flat_params(models.mlp(hidden=128))
    for r in results:
        assert torch.equal(r["none"]["final"], r["torch"]["final"])
        for how in hows:
            assert r[how]["frozen_kept"], how
    for how in hows:
        assert torch.equal(results[0][how]["final"], results[1][how]["final"]), how
        assert not torch.equal(results[0][how]["final"], init), how  # it trained
    assert results[0]["fp8"]["ratio"] > 3 and not torch.equal(results[0]["fp8"]["final"], results[0]["none"]["final"])
    if zero:
        err = results[0]["none"]["attach_error"]
        assert err is not None and "ZeroRedundancyOptimizer" in err and "without attach_optimizer" in err, err
    else:  # the second optimizer's tensors move, reduced by the attached state's hook (its compressed momentum)
        r = results[0]["onebit+m"]
        tail0 = torch.cat([p.detach().reshape(-1) for p in list(models.mlp(hidden=128).parameters())[4:]])
        assert r["ratio"] > 3 and torch.isfinite(r["tail"]).all() and not torch.equal(r["tail"], tail0)


HALF_STEPS = 8


class _OneLayerIn(nn.Module):
    """The tests' MLP with its first layer in ``dtype`` and the rest in fp32
    (DDP buckets each dtype apart)."""

    def __init__(self, dtype):
        super().__init__()
        self.m, self.dtype = models.mlp(hidden=128), dtype
        self.m[0].to(dtype)

    def forward(self, x):
        h = self.m[0](x.to(self.dtype)).float()
        for layer in list(self.m)[1:]:
            h = layer(h)
        return h


def _half_params(rank, world, how, dtype, whole):
    """SGD-momentum on a model whose parameters are ``dtype`` (``whole``) or
    whose first layer is; DDP's own all-reduce (``how`` "torch") or hetcomm's
    hook in mode ``how`` ("+m": the momentum attached)."""
    net = models.mlp(hidden=128).to(dtype) if whole else _OneLayerIn(dtype)
    ddp = DDP(net, bucket_cap_mb=0.02)
    state, opt = _hooked(ddp, how, 1000)
    for step in range(HALF_STEPS):
        x, y = models.batch(rank, step, 16)
        if state is not None:
            state.set_local_batch_size(16)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.to(dtype) if whole else x).float(), y).backward()
        opt.step()
    return {"final": torch.cat([p.detach().float().reshape(-1) for p in net.parameters()]),
            "dtypes": sorted({str(p.dtype) for p in net.parameters()}),
            "ratio": state.stats()["last_step"]["compression_ratio"] if state is not None else None}


HALF_MODES = ["torch", "none", "fp8", "int3", "onebit+m", "topk+m", "lowrank"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=["bf16", "fp16", "fp64"])
@pytest.mark.parametrize("whole", [True, False], ids=["model", "one-layer"])
def test_half_and_double_parameters_reduce_through_the_hook(dtype, whole):
    """Mode none equals DDP's own all-reduce to the bit on buckets of bf16,
    fp16 or fp64 parameters; the compressed modes keep identical replicas
    and end near DDP's own run (8 steps: within 5 % of its parameters' norm,
    measured 0.02-2.1 %; bytes reread in the wrong dtype would be far off)."""
    results = run_ranks(each_mode, 2, _half_params, HALF_MODES, dtype, whole)
    want = {str(dtype)} | (set() if whole else {"torch.float32"})
    ref = results[0]["torch"]["final"]
    for how in HALF_MODES:
        r = results[0][how]
        assert set(r["dtypes"]) == want, r["dtypes"]
        assert torch.equal(r["final"], results[1][how]["final"]), how
        assert torch.isfinite(r["final"]).all(), how
        rel = ((r["final"] - ref).norm() / ref.norm()).item()
        if how == "none":
            assert rel == 0.0
        else:
            assert rel < 0.05, (how, rel)
        if how not in ("torch", "none"):
            assert r["ratio"] > 2.5 and rel > 0, (how, r["ratio"], rel)  # it compressed (none reads 2: fp32's bytes)


def _float64_default(rank, world, how, cache_dir):
    """``torch.set_default_dtype(torch.float64)`` (as scientific codes set
    it) before the model is built: float64 parameters, and every tensor made
    without a dtype float64 too. SGD-momentum, clipped through the state."""
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    torch.set_default_dtype(torch.float64)
    net = models.mlp(hidden=128)
    ddp = DDP(net, bucket_cap_mb=0.02)
    state, opt = _hooked(ddp, how, 1000)
    for step in range(HALF_STEPS):
        x, y = models.batch(rank, step, 16)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x.double()), y).backward()
        (state or torch.nn.utils).clip_grad_norm_(net.parameters(), 5.0)
        opt.step()
    return {"final": models.flat_params(net), "dtype": str(next(net.parameters()).dtype),
            "modes": sorted({p.mode for p in state.last_plans.values()}) if state is not None else None}


def test_a_float64_default_dtype_runs_every_mode(tmp_path):
    # lowrank's Q and auto (its lowrank candidate) were made in the default dtype: "flat must be a contiguous 1-D
    # float32 tensor" at the first compressed step; the topology probe's buffer was twice its bytes
    how_list = ["torch", "none", "lowrank", "auto", "onebit+m", "int3"]
    results = run_ranks(each_mode, 2, _float64_default, how_list, str(tmp_path))
    ref = results[0]["torch"]["final"]
    for how in how_list:
        r = results[0][how]
        assert r["dtype"] == "torch.float64" and torch.equal(r["final"], results[1][how]["final"]), how
        rel = ((r["final"] - ref).norm() / ref.norm()).item()
        assert rel == 0.0 if how in ("torch", "none") else 0 < rel < 0.05, (how, rel)
    assert results[0]["lowrank"]["modes"] == ["lowrank"]


class _WithEmpty(nn.Module):
    """The tests' MLP with a parameter of 0 elements (a table whose
    configured size is 0) and a 1-element one between its layers."""

    def __init__(self):
        super().__init__()
        self.m = models.mlp(hidden=128)
        self.empty, self.one = nn.Parameter(torch.empty(0, 128)), nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = torch.relu(self.m[0](x)) + self.empty.sum(0) + self.one
        return self.m[4](torch.relu(self.m[2](h)))


def _empty_param(rank, world, how):
    """8 steps of SGD-momentum on :class:`_WithEmpty`, in one bucket and in
    buckets of a few kB (the empty parameter in one of its own or beside
    others); hetcomm's runs clipped through the state."""
    out = {}
    for cap in (25, 0.0001):
        net = _WithEmpty()
        ddp = DDP(net, bucket_cap_mb=cap)
        state, opt = _hooked(ddp, how, 0)
        for step in range(HALF_STEPS):
            x, y = models.batch(rank, step, 16)
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            if state is not None:
                state.clip_grad_norm_(net.parameters(), 5.0)
            else:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 5.0)
            opt.step()
        out[cap] = models.flat_params(net)
    return out


def test_a_parameter_of_no_elements_trains_in_every_mode():
    # lowrank (and auto, whose candidates hold it) divided by its 0 rows; the attached momentum was placed at the
    # empty gradient's data_ptr, which is no offset into the bucket (an IndexError at a garbage offset)
    how_list = ["torch", "none", "lowrank", "auto", "onebit+m", "topk+m", "int3"]
    results = run_ranks(each_mode, 2, _empty_param, how_list)
    for cap in (25, 0.0001):
        ref = results[0]["torch"][cap]
        for how in how_list:
            r = results[0][how][cap]
            assert torch.equal(r, results[1][how][cap]), (how, cap)
            rel = ((r - ref).norm() / ref.norm()).item()
            assert rel == 0.0 if how in ("torch", "none") else 0 < rel < 0.05, (how, cap, rel)


def _one_rank(rank, world, how):
    """8 steps of SGD-momentum on one rank (``torchrun --nproc-per-node 1``,
    as people debug a script) in buckets of a few kB; "topk-lossless": top-k
    at ratio 1."""
    net = models.mlp(hidden=128)
    ddp = DDP(net, bucket_cap_mb=0.0001)
    _, opt = _hooked(ddp, how.replace("-lossless", ""), 0, topk_ratio=1.0 if how == "topk-lossless" else 0.05)
    for step in range(HALF_STEPS):
        x, y = models.batch(rank, step, 16)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return models.flat_params(net)


def test_one_rank_runs_every_mode():
    # top-k read its ranks' counts as int32 from a row whose stride, with one rank, was the header's length in
    # bytes: "self.stride(0) must be divisible by 4" for most bucket sizes
    how_list = ["torch", "none", "topk-lossless", "topk", "topk+m", "onebit", "int3", "lowrank", "auto"]
    res = run_ranks(each_mode, 1, _one_rank, how_list)[0]
    ref = res["torch"]
    for how in how_list:
        rel = ((res[how] - ref).norm() / ref.norm()).item()
        if how in ("none", "topk-lossless"):
            assert rel < 1e-6, (how, rel)
        else:
            assert torch.isfinite(res[how]).all() and rel < 0.5, (how, rel)


def _channels_last(rank, world, optimizer, total_steps):
    """A small convolutional net in channels_last (DDP keeps its weights'
    gradients in the bucket in NHWC order), its momentum attached under
    top-k at ratio 1 (lossless: the hook's momentum is then the optimizer's,
    to float rounding). After each step, the largest gap between the
    momentum the hook keeps for its buckets and the optimizer's own, read
    through each parameter's strides, relative to the buffer's largest value."""
    from hetcomm.buckets import sig_of

    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(), nn.Flatten(),
                        nn.Linear(8 * 4 * 4, 10)).to(memory_format=torch.channels_last)
    ddp = DDP(net, bucket_cap_mb=0.001)
    state = hetcomm.HookState("topk", topk_ratio=1.0, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    adam = optimizer == "adamw"
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3) if adam else \
        torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state.attach_optimizer(opt, total_steps=total_steps)
    gaps = []
    for step in range(10):
        g = torch.Generator().manual_seed(step * 7 + rank)
        x = torch.randn(16, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        gap = 0.0
        for key, m in state._buckets.momentum.items():
            if key not in state.last_plans:  # a bucket of the first step's layout
                continue
            off = 0
            for n in sig_of(key):  # DDP packs a bucket's parameters in this order
                p = state._buckets.params.param(n)
                theirs = opt.state[p]["exp_avg"] / 0.1 if adam else opt.state[p]["momentum_buffer"]
                mine = m.narrow(0, off, p.numel()).as_strided(p.shape, p.stride())
                gap = max(gap, ((mine - theirs).abs().max() / theirs.abs().max()).item())
                off += p.numel()
        gaps.append(gap)
    return {"gaps": gaps, "cl": net[0].weight.is_contiguous(memory_format=torch.channels_last)
            and not net[0].weight.is_contiguous()}


@pytest.mark.parametrize("optimizer,total_steps", [("sgd", None), ("sgd", 20), ("adamw", 20)])
def test_a_channels_last_models_momentum_is_laid_out_as_ddps_bucket(optimizer, total_steps):
    """The momentum the hook starts from (read from the optimizer at DDP's
    rebuilt buckets, step 1, and where the warm-up of total_steps=20 ends,
    step 4) is laid out in the bucket as DDP lays the gradients: by each
    weight's strides. Read in logical order (before), the channels_last
    weights' momenta were scrambled: 107-135 % of the buffer apart, decaying
    by beta a step."""
    r = run_ranks(_channels_last, 2, optimizer, total_steps)[0]
    assert r["cl"]
    assert max(r["gaps"]) < 1e-5, r["gaps"]


def _copies(rank, world):
    """deepcopy of the DDP model (whose hook holds the state), of its module
    (what an EMA copies) and pickling the state, after a step; then a step."""
    import copy
    import pickle

    model = models.mlp()
    ddp = DDP(model)
    state = hetcomm.HookState("fp8", min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    models.train_step(ddp, opt, rank, 0, 8, state)
    out = {}
    for name, copy_of in (("ddp", lambda: copy.deepcopy(ddp)), ("module", lambda: copy.deepcopy(ddp.module)),
                          ("pickle", lambda: pickle.dumps(state))):
        try:
            made = copy_of()
            out[name] = torch.equal(models.flat_params(made), models.flat_params(model)) if name == "module" else made
        except TypeError as e:
            out[name] = str(e)
    models.train_step(ddp, opt, rank, 1, 8, state)
    out["steps"] = state.iter
    return out


def test_copying_the_ddp_model_names_its_module_and_the_state_dict():
    """A HookState holds a process group and a comm thread: copying the DDP
    model or pickling the state is a TypeError naming what to copy or save
    instead (torch's own message named a ProcessGroup); copying the module
    works, and training goes on."""
    for r in run_ranks(_copies, 2):
        assert r["module"] is True and r["steps"] == 2
        for name in ("ddp", "pickle"):
            assert "ddp.module" in r[name] and "state_dict()" in r[name], r[name]


def _batchnorm_cnn() -> nn.Module:
    """A small residual CNN with BatchNorm after every convolution (as
    ResNets): weights and biases of 16-32 elements beside the convolutions'
    in DDP's buckets, running statistics as buffers DDP broadcasts."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))

    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(), Block(16),
                         nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                         nn.ReLU(), Block(32), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def _batchnorm(rank, world, how):
    """12 steps of SGD-momentum on :func:`_batchnorm_cnn` in buckets of ~20 kB
    (each rank its own images, whose label's diagonal pixel is lit), then a
    forward in eval mode (DDP broadcasts rank 0's buffers). Returns the
    parameters and the buffers, and the first and last losses."""
    net = _batchnorm_cnn()
    ddp = DDP(net, bucket_cap_mb=0.02)
    _, opt = _hooked(ddp, how, 0)
    losses = []
    for step in range(12):
        g = torch.Generator().manual_seed(1000 * step + rank)
        y = torch.randint(0, 10, (16,), generator=g)
        x = torch.randn(16, 1, 12, 12, generator=g) * 0.5
        x[torch.arange(16), 0, y, y] += 3.0
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ddp.eval()
    with torch.no_grad():
        ddp(torch.zeros(2, 1, 12, 12))
    buffers = torch.cat([b.double().reshape(-1) for b in net.buffers()])
    return {"params": models.flat_params(net), "buffers": buffers, "losses": losses}


def test_a_batchnorm_cnn_trains_in_every_mode_with_its_buffers_in_step():
    """BatchNorm's small weights share buckets with the convolutions', and
    DDP broadcasts its running statistics at each forward beside the hook's
    reductions: ``none`` gives DDP's own bits, parameters and buffers; every
    compressed mode keeps the replicas identical and learns (its loss down
    by a tenth, its parameters within 10 % of DDP's after 12 steps; onebit+m,
    compressed from step 2, is 4 % away, the others under 1 %)."""
    results = run_ranks(each_mode, 2, _batchnorm, EVERY_MODE)
    ref = results[0]["torch"]
    assert ref["buffers"].abs().sum() > 0 and ref["losses"][-1] < 0.8 * ref["losses"][0], ref["losses"]
    _every_mode_learns_in_step(results, ("params", "buffers"))
    assert torch.equal(results[0]["none"]["buffers"], ref["buffers"])


EVERY_MODE = ["torch", "none", "fp8", "int3", "onebit+m", "lowrank", "auto"]


def _every_mode_learns_in_step(results, parts=("params",)):
    """Each mode of :data:`EVERY_MODE` in ``results`` (per rank, per mode: the
    ``parts`` and the losses) kept the ranks' ``parts`` identical, lowered
    its loss by a tenth, and ended with parameters DDP's own (``torch`` and
    ``none``) or 0 < rel < 0.1 from them (the compressed modes)."""
    ref = results[0]["torch"]
    for how in EVERY_MODE:
        r = results[0][how]
        for part in parts:
            assert torch.equal(r[part], results[1][how][part]), (how, part)
        rel = ((r["params"] - ref["params"]).norm() / ref["params"].norm()).item()
        assert rel == 0.0 if how in ("torch", "none") else 0 < rel < 0.1, (how, rel)
        assert r["losses"][-1] < 0.9 * r["losses"][0], (how, r["losses"])


class _TiedLM(nn.Module):
    """A causal transformer whose output layer is its embedding (one
    parameter used twice: its gradient sums both uses), each block under
    activation checkpointing (``reentrant``: torch's reentrant variant, which
    DDP runs only with ``static_graph=True``)."""

    def __init__(self, vocab, ctx, reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, 32)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.pos = nn.Parameter(torch.randn(ctx, 32) * 0.02)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.reentrant = reentrant
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, idx):
        h = self.embed(idx) + self.pos
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, self.mask, None, True, use_reentrant=self.reentrant)
        return self.head(self.norm(h))


def _tied_lm(rank, world, how, reentrant):
    """10 steps of SGD-momentum on :class:`_TiedLM` over generated text, each
    step two micro-batches of 8 windows (the first under ``no_sync``); one of
    16 under ``static_graph``, which DDP does not run with ``no_sync`` (torch
    2.13's reducer fails an internal assert, without hetcomm too). Returns the
    parameters, the losses and whether the output layer is still the
    embedding."""
    from hetcomm.benchmarks.tasks import grammar_text

    text = grammar_text(6000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    net = _TiedLM(len(chars), 24, reentrant)
    ddp = DDP(net, bucket_cap_mb=0.01, static_graph=reentrant)
    _, opt = _hooked(ddp, how, 0, lr=0.15)
    g = torch.Generator().manual_seed(rank)
    losses, micros = [], 1 if reentrant else 2
    for step in range(10):
        opt.zero_grad()
        total = 0.0
        for micro in range(micros):
            w = data[torch.randint(0, len(data) - 25, (16 // micros,), generator=g)[:, None] + torch.arange(25)]
            with ddp.no_sync() if micro < micros - 1 else contextlib.nullcontext():
                out = ddp(w[:, :-1])
                loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), w[:, 1:].reshape(-1)) / micros
                loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    return {"params": models.flat_params(net), "losses": losses, "tied": net.head.weight is net.embed.weight}


@pytest.mark.parametrize("reentrant", [False, True], ids=["checkpoint", "reentrant-static-graph"])
def test_a_tied_lm_under_activation_checkpointing_and_accumulation_trains_in_every_mode(reentrant):
    """Tied weights (the embedding is the output layer: one parameter in
    DDP's buckets, its gradient from both uses), every block recomputed in
    backward, each step two micro-batches with ``no_sync`` on the first
    (one under the reentrant variant's ``static_graph``):
    ``none`` gives DDP's bits, every mode keeps the replicas identical and
    the weights tied, and learns (loss down by a tenth, parameters within
    10 % of DDP's)."""
    results = run_ranks(each_mode, 2, _tied_lm, EVERY_MODE, reentrant)
    assert all(results[0][how]["tied"] for how in EVERY_MODE)
    _every_mode_learns_in_step(results)


def _gan_start() -> nn.Module:
    """A GAN's discriminator."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))


class _GanPair(nn.Module):
    """A generator and a discriminator in one module (one DDP model), as a LightningModule holds them."""

    def __init__(self):
        super().__init__()
        self.d = _gan_start()
        self.g = nn.Linear(8, 32)

    def forward(self, z, x=None):
        fake = self.g(z)
        return self.d(fake) if x is None else self.d(x) - self.d(fake.detach())


def _toggled(rank, opt_d, opt_g, pair, ddp, step):
    """Lightning's GAN step with toggle_optimizer: the generator's step with D's parameters not requiring a
    gradient (DDP reduces their zeros), then D's with the generator's off; each optimizer zeroes after its step."""
    z = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
    x = models.batch(rank, step, 16)[0] + 1
    for opt, loss in ((opt_g, lambda: nn.functional.softplus(-ddp(z)).mean()),
                      (opt_d, lambda: nn.functional.softplus(-ddp(z, x)).mean())):
        own = {id(p) for group in opt.param_groups for p in group["params"]}
        for p in pair.parameters():
            p.requires_grad_(id(p) in own)
        loss().backward()
        opt.step()
        opt.zero_grad()
    for p in pair.parameters():
        p.requires_grad_(True)


def _discarded(rank, world, mode, how):
    """A GAN's loop on D: D's step, then the generator's backward through D's
    DDP model, D's gradient of it zeroed before D's next step (``how``:
    "reduced" through the hook, "no_sync", "none": not run; "accumulate": two
    reduced backwards, then D's step; "overflow": one backward a step, rank 0's
    gradient not finite at step 3 and that step's optimizer step skipped, as
    GradScaler does; "lbfgs": LBFGS's step, its closure's backwards inside
    it; "toggle": :func:`_toggled`; "manual": a hand-written step in place
    of the optimizer's). A second optimizer (the generator's, on
    a parameter of its own) steps after the generator's backward. D's final
    parameters and hetcomm's warnings."""
    with hetcomm_records() as records:
        if how == "toggle":  # both in one DDP model: DDP reduces the switched-off parameters' zeros
            pair = _GanPair()
            ddp = DDP(pair, find_unused_parameters=True)
            state, _ = _hooked(ddp, mode, 0)
            opt_d = torch.optim.SGD(pair.d.parameters(), lr=0.05, momentum=0.9)
            opt_g = torch.optim.SGD(pair.g.parameters(), lr=0.05)
            for step in range(6):
                _toggled(rank, opt_d, opt_g, pair, ddp, step)
            state.close()
            warned = [r.getMessage() for r in records if "before any optimizer" in r.getMessage()]
            return {"params": models.flat_params(pair), "warned": warned}
        d = _gan_start()
        ddp = DDP(d)
        state, opt = _hooked(ddp, mode, 0)
        z = nn.Parameter(torch.zeros(32))  # the generator (at lr 0: D's runs compare to the bit)
        opt_g = torch.optim.SGD([z], lr=0.0)
        softplus = nn.functional.softplus
        if how == "lbfgs":  # a closure's backwards inside the optimizer's step: consumed there
            opt = torch.optim.LBFGS(d.parameters(), lr=0.1, max_iter=3)
        for step in range(6):
            x = models.batch(rank, step, 16)[0]
            if how == "lbfgs":

                def closure():
                    opt.zero_grad()
                    loss = softplus(-ddp(x + 1)).mean() + softplus(ddp(x)).mean()
                    loss.backward()
                    return loss

                opt.step(closure)
                continue
            opt.zero_grad()
            loss = softplus(-ddp(x + 1)).mean() + softplus(ddp((x + z).detach())).mean()
            if how == "overflow" and step == 3 and rank == 0:
                loss = loss * float("inf")
            loss.backward()
            if how == "accumulate":
                softplus(-ddp(x - 1)).mean().backward()
            if how == "manual":  # a hand-written step, no optimizer: the parameters updated in place
                with torch.no_grad():
                    for p in d.parameters():
                        p -= 0.05 * p.grad
            elif all(torch.isfinite(p.grad).all() for p in d.parameters()):
                opt.step()
            if how in ("reduced", "no_sync"):
                with ddp.no_sync() if how == "no_sync" else contextlib.nullcontext():
                    softplus(-ddp(x + z)).mean().backward()
                opt_g.step()
        if state is not None:
            state.close()
    warned = [r.getMessage() for r in records if "before any optimizer stepped" in r.getMessage()]
    return {"params": models.flat_params(d), "warned": warned}


def test_a_gradient_thrown_away_after_its_exchange_is_warned_once():
    """A GAN's generator step through the discriminator's DDP model reduces a
    gradient no optimizer applies: with error feedback, what that message owed
    and repaid goes into D's next steps. hetcomm warns once, naming no_sync,
    which leaves D's run exactly as without that backward. Not warned: the
    same under no_sync, without error feedback (mode none), where the step
    skipped was not finite (it left the state untouched), or for LBFGS's
    closure, whose backwards run inside its step, for a hand-written step
    (the parameters updated in place), or for a GAN's two steps
    through one DDP model with Lightning's toggle_optimizer (the other
    model's parameters switched off: a step notes only one that requires a
    gradient; the switched-off ones' slots are put back after the backward:
    tests/test_unused.py).
    Accumulating without no_sync reads the
    same, and is told how to save the exchanges."""
    runs = {(m, h): run_ranks(_discarded, 2, m, h) for m, h in (
        ("int3", "reduced"), ("int3", "no_sync"), ("int3", "none"), ("none", "reduced"), ("int3", "accumulate"),
        ("int3", "overflow"), ("int3", "lbfgs"), ("int3", "toggle"), ("int3", "manual"))}
    for r in runs[("int3", "reduced")]:
        assert len(r["warned"]) == 1 and "step 1 reduced buckets with error feedback (int3)" in r["warned"][0]
        assert "ddp.no_sync()" in r["warned"][0] and "GAN" in r["warned"][0]
    alone, no_sync, reduced = (runs[("int3", h)][0]["params"] for h in ("none", "no_sync", "reduced"))
    assert torch.equal(no_sync, alone)  # the generator's backward under no_sync touched nothing of hetcomm's
    assert (reduced - alone).norm() > 0.05 * (alone - models.flat_params(_gan_start())).norm()  # what it leaks
    for key in (("int3", "no_sync"), ("int3", "none"), ("none", "reduced"), ("int3", "overflow"), ("int3", "lbfgs"),
                ("int3", "toggle"), ("int3", "manual")):
        assert all(r["warned"] == [] for r in runs[key]), (key, runs[key][0]["warned"])
    for r in runs[("int3", "accumulate")]:
        assert len(r["warned"]) == 1 and "accumulate gradients" in r["warned"][0]


def _wide_first_layer():
    """176k elements (704 KB: one DDP bucket by default), 135k of them in the first layer (DDP's last bucket)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(models.IN, 4096), nn.ReLU(), nn.Linear(4096, models.OUT))


def _one_bucket(rank, world, mode, bucket_cap_mb):
    """Four steps of _wide_first_layer: the hetcomm logger's INFO records
    about a step of one bucket, and the step's buckets."""
    with hetcomm_records(logging.INFO) as records:
        kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
        ddp = DDP(_wide_first_layer(), **kwargs)
        state = hetcomm.HookState(mode)
        ddp.register_comm_hook(state, hetcomm.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        for step in range(4):
            models.train_step(ddp, opt, rank, step, 8, state)
        buckets = len(state.last_plans)
        state.close()
    seen = [(r.levelno, r.getMessage()) for r in records if "in one bucket" in r.getMessage()]
    return {"seen": seen, "buckets": buckets}


def test_a_compressed_model_in_one_ddp_bucket_is_told_of_bucket_cap_mb_once():
    """A model DDP holds whole in its first bucket (under 1 MiB) exchanges its
    gradient only once backward has ended: compressed (int3, flat on one node),
    rank 0 is told once, at INFO, with the bucket's size and half of it as
    DDP's bucket_cap_mb; rank 1 is not. Not told: the same model in buckets of
    0.1 MB (two a step, the last as large as the hint asks), or in fp32 on one
    node (nothing slow to hide)."""
    told = run_ranks(_one_bucket, 2, "int3", None)
    numel = sum(p.numel() for p in _wide_first_layer().parameters())
    first = sum(p.numel() for p in _wide_first_layer()[0].parameters())
    assert first >= hetcomm.hooks.ONE_BUCKET_HINT and numel * 4 < 2 ** 20
    mb = numel * 4 / 2 ** 20
    assert told[0]["buckets"] == 1 and len(told[0]["seen"]) == 1, told[0]
    level, message = told[0]["seen"][0]
    assert level == logging.INFO and f"in one bucket ({mb:.2f} MB)" in message
    assert f"bucket_cap_mb={mb / 2:.2g})" in message
    assert told[1]["seen"] == []
    split = run_ranks(_one_bucket, 2, "int3", 0.1)
    assert split[0]["buckets"] == 2 and all(r["seen"] == [] for r in split)
    dense = run_ranks(_one_bucket, 2, "none", None)
    assert dense[0]["buckets"] == 1 and all(r["seen"] == [] for r in dense)
