"""HookState.clip_grad_norm_: clipping by the norm of the gradient the ranks
reduced (what fp32's all-reduce hands over), not of what a lossy codec
handed back, checked against a single-process full-batch gradient."""

import math
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import clip, topology

from . import models
from .dist_harness import hetcomm_records, run_ranks

SIZES = [6, 10, 8]  # samples per rank (batch-size weighting on)
STEPS, START = 8, 2
MAX_NORM = 0.5  # below the gradient's norm on most steps: clipping acts


def _batch(rank, step):
    return models.batch(rank, step, SIZES[(rank + step) % len(SIZES)])


def _clipped(rank, world, mode, attach, scaled=False, algorithm="native", min_numel=0, device="cpu"):
    """``scaled``: loss scaling as a mixed cluster runs it, rank 0 in fp16
    (hetcomm's GradScaler, scale 2**10; fp32 compute, so the reduced gradient
    is the reference's), the others at scale 1: the sketch of rank 0's
    buckets (s g) must count as g. ``algorithm="hierarchical"`` (4 ranks):
    ranks 0, 1 on one node, 2, 3 on another (compressed across nodes only).
    ``min_numel``: buckets smaller go exact (a step's norm then has an exact
    part and a sketched one, as under ``compression="auto"``)."""
    if algorithm == "hierarchical":
        os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    model = models.mlp(hidden=96)
    ddp = models.ddp(model, rank, device, bucket_cap_mb=0.02)  # several buckets
    state = hetcomm.HookState(mode, min_compress_numel=min_numel, start_iter=START, topk_ratio=0.05,
                              algorithm=algorithm, **models.fixed_rank(mode))
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    if attach:
        state.attach_optimizer(opt)
    scaler = None
    if scaled:
        scaler = hetcomm.amp.GradScaler(state, device, precision="fp16" if rank == 0 else "fp32", init_scale=2.0 ** 10)
    out = {"params": [], "handed": [], "norm": [], "clipped": []}
    for step in range(STEPS):
        out["params"].append(models.flat_params(model))
        x, y = _batch(rank, step)
        state.set_local_batch_size(len(x))
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x.to(model[0].weight.device)), y.to(model[0].weight.device))
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
        else:
            loss.backward()
        out["handed"].append(models.flat_grads(model))
        norm = state.clip_grad_norm_(model.parameters(), MAX_NORM)
        again = state.clip_grad_norm_(model.parameters(), MAX_NORM)  # the clipped gradient's norm now
        unbounded = state.clip_grad_norm_(model.parameters(), math.inf)  # that norm again, nothing clipped
        out["norm"].append((norm.item(), again.item(), unbounded.item()))
        out["clipped"].append(models.flat_grads(model))
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    errors = out["errors"] = {}
    for name, call in (("norm_type", lambda: state.clip_grad_norm_(model.parameters(), 1.0, norm_type=1.0)),
                       ("max_norm", lambda: state.clip_grad_norm_(model.parameters(), 0.0)),
                       ("nan", lambda: state.clip_grad_norm_(model.parameters(), math.nan)),
                       ("parameters", lambda: state.clip_grad_norm_(list(model.parameters())[:1], 1.0)),
                       ("type", lambda: state.clip_grad_norm_(3, 1.0))):
        try:
            call()
        except ValueError as e:
            errors[name] = str(e)
    out["stats"] = state.stats()
    state.close()
    return out


def _full_batch_grad(params, step, world):
    return models.full_batch_grad(params, [_batch(r, step) for r in range(world)], hidden=96)


CASES = [("onebit", True), ("topk", True), ("onebit", False), ("lowrank", False), ("fp8", False),
         ("onebit", True, True), ("onebit", True, False, "hierarchical"),
         ("onebit", True, False, "native", 5000)]  # DDP's buckets of 10282 and 3168 elements: one goes exact


@pytest.fixture(scope="module")
def clipped_runs():
    return {case: run_ranks(_clipped, 4 if "hierarchical" in case else 3, *case) for case in CASES}


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_clips_by_the_reduced_gradients_norm(clipped_runs, case):
    _check_clipped(clipped_runs[case], case)


#: On CUDA buckets (ranks sharing the GPU): the sketch, the attached momentum and fp16 loss scaling
CUDA_CASES = [("onebit", True), ("topk", True), ("fp8", False), ("onebit", True, True)]


@pytest.mark.cuda
@pytest.mark.parametrize("case", CUDA_CASES, ids=lambda c: "-".join(map(str, c)))
def test_clips_cuda_buckets_by_the_reduced_gradients_norm(case):
    padded = tuple(case) + (False, "native", 0)[len(case) - 2:]
    _check_clipped(run_ranks(_clipped, 3, *padded, "cuda"), case)


def _check_clipped(results, case):
    """Every rank clips alike, by an estimate within 8 % of the full-batch
    gradient's norm (closer than the handed gradient's where the codec is lossy)."""
    mode, attach = case[:2]
    r0 = results[0]
    for r in results[1:]:  # every rank clips alike: replicas stay identical
        for step in range(STEPS):
            assert torch.equal(r["clipped"][step], r0["clipped"][step])
            assert torch.equal(r["params"][step], r0["params"][step])
    est_err, handed_err = [], []
    for step in range(STEPS):
        true = _full_batch_grad(r0["params"][step], step, len(results)).norm().item()
        handed = r0["handed"][step].norm().item()
        norm, again, unbounded = r0["norm"][step]
        if step < START:  # exact steps: the handed gradient is the reduced one, as torch measures it
            assert norm == pytest.approx(handed, rel=1e-6)
            assert norm == pytest.approx(true, rel=1e-5)
        else:
            est_err.append(abs(norm - true) / true)
            handed_err.append(abs(handed - true) / true)
        coef = min(1.0, MAX_NORM / (norm + 1e-6))
        torch.testing.assert_close(r0["clipped"][step], r0["handed"][step] * coef, rtol=1e-5, atol=1e-8)
        assert again == pytest.approx(min(norm, MAX_NORM), rel=1e-4)  # a second call: the clipped norm
        assert unbounded == pytest.approx(again, rel=1e-6)  # max_norm inf (after which "clipped" was read)
    assert max(est_err) < 0.08, (mode, attach, est_err)
    if clip.NormSketch.lossy(_plan(mode), attach or None):
        # the handed gradient's norm is off by more: the estimate is what makes the difference
        assert sum(handed_err) > 2 * sum(est_err), (mode, attach, handed_err, est_err)
    if "hierarchical" in case:  # onebit across the nodes only (the bytes inside them stay fp32's)
        assert {(p["mode"], p["algorithm"]) for p in r0["stats"]["plans"].values()} == {("onebit", "hierarchical")}
    elif 5000 in case:  # one bucket onebit, one exact
        assert sorted(p["mode"] for p in r0["stats"]["plans"].values()) == ["none", "onebit"], r0["stats"]["plans"]
    else:
        assert r0["stats"]["last_step"]["compression_ratio"] > 3


CLIP_AT = (1, 3, 4, 7)  # step 1 exact (it turns sketching on); 2, 5 and 6 sketched, their sums started, not clipped


def _clipped_now_and_then(rank, world):
    """Clipping on some steps only: a sum the last bucket started that no
    clip_grad_norm_ finished is waited for when the next one starts."""
    model = models.mlp(hidden=96)
    ddp = models.ddp(model, rank, bucket_cap_mb=0.02)
    state = hetcomm.HookState("onebit", start_iter=START)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    state.attach_optimizer(opt)
    out = {"params": [], "norm": {}}
    for step in range(STEPS):
        out["params"].append(models.flat_params(model))
        x, y = _batch(rank, step)
        state.set_local_batch_size(len(x))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        if step in CLIP_AT:
            out["norm"][step] = state.clip_grad_norm_(model.parameters(), MAX_NORM).item()
        opt.step()
    out["stats"] = state.stats()
    state.close()
    return out


def test_clipping_on_some_steps_only_estimates_the_steps_it_clips():
    runs = run_ranks(_clipped_now_and_then, 3)
    for r in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["params"], runs[0]["params"]))
        assert r["norm"] == runs[0]["norm"]
    for step, norm in runs[0]["norm"].items():
        true = _full_batch_grad(runs[0]["params"][step], step, 3).norm().item()
        assert abs(norm - true) / true < (1e-5 if step < START else 0.08), (step, norm, true)
    assert runs[0]["stats"]["clip"] == {"calls": len(CLIP_AT), "estimated_steps": 3}


def _started_sums(rank, world):
    """The engine's sum_first: a bucket's job starts a sum over the ranks
    before its own collectives, and finish_sum hands it over."""
    engine = hetcomm._C.Engine(torch.distributed.group.WORLD)
    out = {"buckets": [], "sums": {}, "errors": []}
    for call in (lambda: engine.finish_sum().wait(),
                 lambda: engine.submit_bucket(0, torch.ones(8), hetcomm._C.Codec.none, 2048, 0.5, True, None, None,
                                              True, sum_first=torch.ones(2, 2)).wait()):
        try:
            call()
            out["errors"].append(None)
        except Exception as e:
            out["errors"].append(str(e))
    for step, codec in enumerate((hetcomm._C.Codec.onebit, hetcomm._C.Codec.fp8, hetcomm._C.Codec.none)):
        buf = torch.full((64,), float(rank + 1 + step))
        first = torch.arange(5.0) * (rank + 1) + step
        engine.submit_bucket(0, buf, codec, 2048, 0.5, True, torch.zeros(64), None, True, sum_first=first).wait()
        out["buckets"].append(buf)
        if step != 1:  # step 1's sum is started and never finished: step 2's start waits for it
            out["sums"][step] = engine.finish_sum().wait()
    engine.close()
    return out


def test_a_bucket_starts_a_sum_that_finish_sum_hands_over():
    w = 3
    for r in run_ranks(_started_sums, w):
        assert "finish_sum: no bucket started a sum" in r["errors"][0]
        assert "sum_first must be a 1-D floating-point vector" in r["errors"][1]
        for step in (0, 2):  # closed form: sum over ranks of arange(5) (rank + 1) + step
            assert r["sums"][step].tolist() == (torch.arange(5.0) * w * (w + 1) / 2 + w * step).tolist()
        for step, buf in enumerate(r["buckets"]):  # the bucket itself reduced as ever: the mean of rank + 1 + step
            torch.testing.assert_close(buf, torch.full((64,), (w + 1) / 2 + step), rtol=0.02, atol=0)


def _plan(mode):
    from hetcomm.plan import BucketPlan
    return BucketPlan(mode, "native", "fixed")


def test_bad_arguments_are_clear_errors(clipped_runs):
    errors = clipped_runs[("onebit", True)][0]["errors"]
    assert "norm_type must be 2.0" in errors["norm_type"]
    assert "max_norm must be a number > 0" in errors["max_norm"] and "nan" in errors["nan"]
    assert "parameters must hold every parameter of the compressed buckets" in errors["parameters"]
    assert "parameters must be a tensor or an iterable of tensors" in errors["type"]


def _rescaled_warnings(rank, world, clip_with, mode="onebit", attach=True, view=False):
    """A loop that clips after every step with torch's clip_grad_norm_ (the
    handed gradient's norm), with hetcomm's, or scales the gradients up
    (``view``: DDP's gradient_as_bucket_view=True)."""
    with hetcomm_records() as records:
        model = models.mlp(hidden=96)
        ddp = DDP(model, bucket_cap_mb=0.02, gradient_as_bucket_view=view)
        state = hetcomm.HookState(mode, min_compress_numel=0, start_iter=START)
        ddp.register_comm_hook(state, hetcomm.hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if attach:
            state.attach_optimizer(opt)
        for step in range(6):
            x, y = _batch(rank, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            if clip_with == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            elif clip_with == "hetcomm" or (clip_with == "late" and step >= 3):
                state.clip_grad_norm_(model.parameters(), 0.05)
            else:  # "up": multiplied by 2, not a clip
                for p in model.parameters():
                    p.grad.mul_(2.0)
            opt.step()
        state.close()
    messages = [r.getMessage() for r in records]
    return [m for m in messages if "were multiplied by" in m or "was first called" in m]


def test_torchs_clip_after_a_lossy_step_is_a_warning_once():
    # torch's clip of the handed gradient: warned once, naming the fix; hetcomm's clip, a scale-up,
    # and torch's clip where nothing is lossy (fp8 of the gradient): not warned
    # (gradient_as_bucket_view=True: .grad is the bucket, told from a copy kept at the end of backward)
    for view in (False, True):
        warned = run_ranks(_rescaled_warnings, 2, "torch", "onebit", True, view)[0]
        assert len(warned) == 1 and "use state.clip_grad_norm_" in warned[0], (view, warned)
        assert "after step 2," in warned[0]  # the first compressed step (start_iter=2)
    for clip_with, mode, attach, view in (("hetcomm", "onebit", True, True), ("up", "onebit", True, False),
                                          ("up", "topk", False, True), ("torch", "fp8", False, True)):
        assert run_ranks(_rescaled_warnings, 2, clip_with, mode, attach, view)[0] == [], (clip_with, mode, attach)
    # hetcomm's first called after a lossy step it could not sketch (step 3): said once, that step by the handed norm
    late = run_ranks(_rescaled_warnings, 2, "late")[0]
    assert len(late) == 1 and "first called after step 3" in late[0], late


def test_the_sketch_estimates_a_matrix_with_one_large_column():
    """Single process: the squared norm of the sketch against the exact one,
    over 20 buckets' signs, for a gradient whose norm is mostly one column of
    a 2048- or 1024-wide matrix (with 2048 sums, a power of two, that column
    lands in one sum: a standard deviation of 100 %)."""
    torch.manual_seed(0)
    for rows, cols in ((256, 2048), (512, 1024)):
        x = torch.randn(rows, cols) * torch.where(torch.arange(cols) == 7, 100.0, 1.0)
        ratios = []
        for b in range(20):
            sk = clip.NormSketch()
            sk.begin_step(0, 1.0, 1.0)
            sk.add(f"{b},{b + 1}", x.reshape(-1), [], {})
            ratios.append((sk.vec.double().square().sum() / x.double().square().sum()).item())
        t = torch.tensor(ratios)
        assert abs(t.mean().item() - 1) < 0.05 and t.std().item() < 0.1, (cols, ratios)


class _TwoHeads(torch.nn.Module):
    """A body and two heads, one per step (as a multi-task model runs): the
    other head gets no gradient on any rank that step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(models.IN, 128)
        self.a, self.b = torch.nn.Linear(128, 10), torch.nn.Linear(128, 10)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.b(h) if use_b else self.a(h)


def _unused_head(rank, world, mode):
    """``find_unused_parameters=True``, gradients set to None, head b on every
    third step: DDP leaves the unused head's gradients None. Each step clipped
    through the state (torch's clip for ``mode`` "torch")."""
    net = DDP(_TwoHeads(), find_unused_parameters=True, bucket_cap_mb=0.01)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    state = None
    if mode != "torch":
        state = hetcomm.HookState(mode.split("+")[0], min_compress_numel=0)
        net.register_comm_hook(state, hetcomm.hook)
        if mode.endswith("+m"):
            state.attach_optimizer(opt)
    norms = []
    for step in range(12):
        x, y = models.batch(rank, step, 16)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(x, step % 3 == 0), y).backward()
        clip_fn = state.clip_grad_norm_ if state is not None else torch.nn.utils.clip_grad_norm_
        norms.append(clip_fn(net.parameters(), MAX_NORM).item())
        opt.step()
    return {"norms": norms, "params": models.flat_params(net.module)}


def test_a_parameter_no_rank_used_this_step_is_no_missing_parameter():
    # It was: "parameters must hold every parameter of the compressed buckets ... 2 of them are missing", for
    # model.parameters() itself, whenever a head went unused in a step (its gradient None, its zeros sketched)
    modes = ["torch", "none", "onebit+m", "int3"]
    res = {m: run_ranks(_unused_head, 2, m) for m in modes}
    for m in modes:
        assert torch.equal(res[m][0]["params"], res[m][1]["params"]), m
    assert res["none"][0]["norms"] == pytest.approx(res["torch"][0]["norms"], rel=1e-6)
    for m in ("onebit+m", "int3"):  # the reduced gradient's estimated norm, near fp32's on the first steps
        assert res[m][0]["norms"][:3] == pytest.approx(res["torch"][0]["norms"][:3], rel=0.08), m
