"""`hetcomm bench ddp`: real DDP training steps, side by side, for PyTorch's
hooks (allreduce, fp16, PowerSGD rank 4 on one bucket) and hetcomm's modes
with and without batch balancing, on this machine or with per-rank CPU
quotas (``--rank-cpu 0.25,0.75``: ranks of really different speeds).

Per mode: step time (median), samples/s, bytes sent per step (ring-equivalent,
per rank), and the fraction of communication hidden behind backward: 1 -
(time backward still waits after its last bucket was handed over) / (time
some bucket's communication was in flight). The optimizer is SGD with momentum
0.9; hetcomm's compressed modes but lowrank compress the momentum
(``attach_optimizer``), as the README asks of momentum users of onebit and
top-k; lowrank compresses the gradient, as the README recommends and as
PyTorch's PowerSGD does, so their rows compare the same work. ``auto`` is
the README's one line, ``HookState("auto")`` without ``attach_optimizer``
(fp32, bf16, fp8 of the gradient and lowrank under its guard); ``auto+m``
attaches the optimizer (fp32, bf16, fp8 of the momentum). ``auto``'s trial
steps and its first re-check (``AUTO_SETTLE`` steps later) are part of its
warm-up, not timed: its steady state, what a long run sees.

``--device cuda``: the model and buckets on GPUs. With a GPU per rank the
ranks use NCCL (hetcomm its own NCCL communicator); with fewer GPUs than ranks
they share them round robin over gloo (hetcomm's default transport then uses
the process group: NCCL takes one rank per GPU). Times are taken after a device synchronisation, and
the host cannot see when a GPU's backward ends, so there the hidden fraction
is 1 - (step time - compute-only step time) / communication in flight."""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import modes as mode_table
from ..autoplan import AUTO_REPEATS, AUTO_SETTLE, AUTO_TOP
from ..balance import Balancer, ThroughputMeter
from ..launch import run_distributed, spawn_ranks
from ..plan import COMPRESSED
from . import common

IN, OUT = 256, 10
TORCH_MODES, HETCOMM_MODES = mode_table.TORCH, mode_table.HETCOMM
DEFAULT_MODES = ["torch-allreduce", "torch-fp16", "torch-powersgd", "none", "fp16", "onebit", "topk", "lowrank",
                 "none+bal", "onebit+bal", "topk+bal", "lowrank+bal"]
#: the compressions whose rows compress SGD's momentum (attach_optimizer); lowrank and auto the gradient (auto+m
#: the momentum)
ATTACHED = tuple(c for c in COMPRESSED if c != "lowrank")


def model_for(params: int, seed: int = 0, layers: int = 2) -> nn.Module:
    """An MLP IN -> h -> ... -> h -> OUT (``layers`` hidden layers of width h)
    with about ``params`` parameters."""
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    # (layers - 1) h^2 + (IN + OUT + layers) h + OUT = params
    a, b = layers - 1, IN + OUT + layers
    h = (params - OUT) / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * max(0, params - OUT))) / (2 * a)
    torch.manual_seed(seed)
    h = max(16, int(h))
    mods: List[nn.Module] = [nn.Linear(IN, h), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(h, h), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(h, OUT))


class _Timeline:
    """Wraps a comm hook to record when each bucket is handed over and when its
    reduction completes."""

    def __init__(self, inner):
        self.inner = inner
        self.intervals: List[List[float]] = []
        self.last_submit = 0.0

    def hook(self, state, bucket):
        t = time.monotonic()
        self.last_submit = t
        rec = [t, t]
        self.intervals.append(rec)
        fut = self.inner(state, bucket)

        def done(f):
            rec[1] = time.monotonic()
            return f.value()

        return fut.then(done)

    def take(self):
        iv, self.intervals = sorted(self.intervals), []
        busy, end = 0.0, -math.inf
        for a, b in iv:  # length of the union of in-flight intervals
            if b > end:
                busy += b - max(a, end)
                end = b
        return busy


def _split_balanced(mode: str):
    """(the mode without ``+bal``, whether it had it)."""
    return (mode[:-len("+bal")], True) if mode.endswith("+bal") else (mode, False)


def _run_mode(rank: int, world: int, mode: str, cfg: Dict) -> Dict:
    base, balanced = _split_balanced(mode)
    spec = mode_table.get(base)
    dev = common.rank_device(rank, cfg.get("device", "cpu"))
    model = model_for(cfg["params"], layers=cfg["layers"]).to(dev)
    numel = sum(p.numel() for p in model.parameters())
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                              **spec.ddp_options(cfg["bucket_mb"]))
    algorithm = cfg.get("algorithm", "default")
    # "default": HookState's own (auto chooses the algorithm too; a compressed mode goes across nodes only); a
    # mode's own @ALGO stands either way
    options = spec.options
    own = options.get("algorithm")
    overrides = {} if base in TORCH_MODES or own is not None or algorithm == "default" else {"algorithm": algorithm}
    if options.get("compression") == "lowrank" and "matrix_approximation_rank" not in options:
        # PowerSGD's rank, side by side with its hook: a run's own lowrank reads its rank at step 30 (these runs
        # are shorter, and their random labels' gradient would take the ladder's top, 16)
        overrides["matrix_approximation_rank"] = mode_table.POWERSGD_RANK
    hook_state, inner, state = spec.comm_hook(**overrides)
    tl = _Timeline(inner)

    def hook(state, bucket):  # DDP wants these parameter names
        return tl.hook(state, bucket)

    ddp.register_comm_hook(hook_state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    attached = options.get("compression") in ATTACHED or spec.attach
    if attached:
        # momentum compression, as the README asks of SGD-momentum users of
        # onebit and top-k (auto+m then offers fp8 of the momentum; 1-bit and
        # top-k only when listed in candidates=). Not lowrank's: it
        # approximates the gradient, as PyTorch's PowerSGD does (README: use
        # lowrank without attach_optimizer); nor plain auto's, the README's one line
        state.attach_optimizer(opt)
    # auto's first steps after start_iter try its candidates, and its first re-check AUTO_SETTLE steps later
    # measures them again in steady state: not counted (what a long run sees)
    trial = AUTO_REPEATS * (AUTO_TOP + 1)
    warmup = cfg["warmup"] + (state.start_iter + trial + AUTO_SETTLE + trial
                              if options.get("compression") == "auto" else 0)
    gb = cfg["global_batch"]
    if balanced:
        bal = Balancer(state, gb, dataset_len=gb * 10_000, rebalance_every=3, lag=0, threshold=0.05)
    meter = ThroughputMeter(alpha=0.5)
    gen = torch.Generator().manual_seed(rank)
    times, exposed, busy = [], [], []
    local = gb // world + (1 if rank < gb % world else 0)
    # batch-size weighting (one small all-reduce per step) where the batches differ, as a user would
    uneven = gb % world != 0
    for step in range(warmup + cfg["steps"]):
        b = bal.sizes[rank] if balanced else local
        x, y = torch.randn(b, IN, generator=gen).to(dev), torch.randint(0, OUT, (b,), generator=gen).to(dev)
        common.sync(dev)
        dist.barrier()
        t0 = time.monotonic()
        if balanced:
            with bal.step(b):
                nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            if state is not None and uneven:
                state.set_local_batch_size(b)
            nn.functional.cross_entropy(ddp(x), y).backward()
        common.sync(dev)
        t_bwd = time.monotonic()
        opt.step()
        opt.zero_grad(set_to_none=False)
        common.sync(dev)
        t1 = time.monotonic()
        meter.update(b, tl.last_submit - t0)
        comm = tl.take()
        if step >= warmup:
            times.append(t1 - t0)
            exposed.append(max(0.0, t_bwd - tl.last_submit))
            busy.append(comm)
    times.sort()
    plans, auto = "-", None
    if state is not None:
        stats = state.stats()
        sent = stats["last_step"]["bytes_sent"]
        across = stats["last_step"]["bytes_sent_across_nodes"]
        plans = " ".join(f"{n}x{c}" if c > 1 else n for n, c in sorted(common.plan_summary(state).items()))
        auto = stats.get("auto")
        state.close()
    else:
        sent = spec.torch_bytes(model, world)
        across = round(sent * common.off_node_share())
    if dev.type == "cuda":  # exposed: what the step takes beyond compute alone
        exposed = [max(0.0, t - cfg["solo_step_s"]) for t in times]
    return {**_timing(times, exposed, busy, gb), "bytes_per_step": sent, "bytes_across_nodes_per_step": across,
            "compute_rate": meter.rate,
            "local_batch": bal.sizes[rank] if balanced else local, "params": numel, "plans": plans,
            "momentum_compressed": attached,
            **({"auto": auto} if auto else {})}


def _timing(times: List[float], exposed: List[float], busy: List[float], global_batch: int) -> Dict:
    """Median step, samples/s and hidden fraction of the timed steps (kept, so
    that rounds can be pooled: :func:`_pool`)."""
    times = sorted(times)
    hidden = 1.0 - sum(exposed) / sum(busy) if sum(busy) > 0 else 1.0
    return {"step_ms": 1000 * times[len(times) // 2], "samples_per_s": global_batch / times[len(times) // 2],
            "hidden": min(1.0, max(0.0, hidden)), "_steps": (times, exposed, busy)}


def _pool(rounds: List[Dict], global_batch: int) -> Dict:
    """One mode's rounds as one result: the timed steps of every round pooled
    (median over all of them), the rest from the last round."""
    times, exposed, busy = ([x for r in rounds for x in r["_steps"][i]] for i in range(3))
    out = {**rounds[-1], **_timing(times, exposed, busy, global_batch), "rounds": len(rounds)}
    out["round_step_ms"] = [r["step_ms"] for r in rounds]
    del out["_steps"]
    return out


def _solo_rate(rank: int, world: int, cfg: Dict) -> float:
    """This rank's samples/s training alone (no DDP, no communication; all
    ranks at once, so ranks sharing a GPU share it here too)."""
    dev = common.rank_device(rank, cfg.get("device", "cpu"))
    model = model_for(cfg["params"], layers=cfg["layers"]).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    b = cfg["global_batch"] // world
    gen = torch.Generator().manual_seed(rank)
    times = []
    for step in range(cfg["warmup"] + cfg["steps"]):
        x, y = torch.randn(b, IN, generator=gen).to(dev), torch.randint(0, OUT, (b,), generator=gen).to(dev)
        common.sync(dev)
        t0 = time.monotonic()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        common.sync(dev)
        if step >= cfg["warmup"]:
            times.append(time.monotonic() - t0)
    return b / sorted(times)[len(times) // 2]


def _worker(rank: int, world: int, modes: List[str], cfg: Dict) -> List[Dict[str, Dict]]:
    out = {"_solo": {"rate": _solo_rate(rank, world, cfg)}}
    cfg = dict(cfg, solo_step_s=(cfg["global_batch"] // world) / out["_solo"]["rate"])
    dist.barrier()
    # rounds take turns (mode a, b, c, a, b, c, ...): a drifting load weighs on every mode alike
    runs: Dict[str, List[Dict]] = {m: [] for m in modes}
    for _ in range(cfg["rounds"]):
        for mode in modes:
            runs[mode].append(_run_mode(rank, world, mode, cfg))
            dist.barrier()
    for mode in modes:
        out[mode] = _pool(runs[mode], cfg["global_batch"])
    every: List[Optional[Dict]] = [None] * world
    dist.all_gather_object(every, out)
    return every


def check_mode(mode: str) -> None:
    """ValueError unless ``mode`` is one of PyTorch's or hetcomm's plain modes
    (onebit-cN, fp8-cN, topk-kN, lowrank-rN, torch-powersgd-rN forms too),
    ``auto+m``, or a hetcomm mode with ``+bal``."""
    base, _ = _split_balanced(mode)
    try:
        known = mode_table.get(base) if "+" not in base or base == "auto+m" else None
    except ValueError:
        known = None
    if known is None or (base != mode and known.is_torch):
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(TORCH_MODES + HETCOMM_MODES)} (onebit-cN, "
                         "fp8-cN, topk-kN, lowrank-rN, torch-powersgd-rN too), auto+m (auto with "
                         "attach_optimizer), +bal for hetcomm's")


def run(ranks: int, modes: List[str], params: int, global_batch: int, steps: int, warmup: int,
        rank_cpu: Optional[List[float]] = None, algorithm: str = "default", device: str = "cpu", layers: int = 2,
        bucket_mb: float = 25, rounds: int = 1) -> Dict:
    for m in modes:
        check_mode(m)
    common.require_device(device, "hetcomm bench ddp")
    backend = common.backend_for(device, ranks)
    cfg = {"params": params, "global_batch": global_batch, "steps": steps, "warmup": warmup, "algorithm": algorithm,
           "device": device, "backend": backend, "layers": layers, "bucket_mb": bucket_mb,
           "rounds": rounds}
    if rank_cpu is None:  # here, or inside the testbed / torchrun
        per_rank = run_distributed(_worker, ranks, modes, cfg, backend=backend)
        if per_rank is None:
            return {}
    else:
        per_rank = spawn_ranks(_worker, ranks, modes, cfg, rank_cpu=rank_cpu, timeout=3600)[0]
    ranks = len(per_rank)
    rows = []
    for mode in modes:
        r0 = per_rank[0][mode]
        rows.append({"mode": mode, **r0, "local_batches": "/".join(str(pr[mode]["local_batch"]) for pr in per_rank),
                     "compute_rates": [pr[mode]["compute_rate"] for pr in per_rank]})
    # ideal: every rank busy all the time = the sum of each rank's solo speed
    ideal = sum(pr["_solo"]["rate"] for pr in per_rank)
    summary = {"ideal_samples_per_s": ideal, "solo_rates": [pr["_solo"]["rate"] for pr in per_rank]}
    plain = next((r for r in rows if r["mode"] == "torch-allreduce"), None)
    for r in rows:
        r["of_ideal"] = r["samples_per_s"] / ideal
        if plain:
            r["vs_plain_ddp"] = r["samples_per_s"] / plain["samples_per_s"]
    return {"ranks": ranks, "rank_cpu": rank_cpu, "cfg": cfg, "rows": rows, "summary": summary}


def main(ranks: int, modes: Optional[List[str]], params: int, global_batch: int, steps: int, warmup: int,
         rank_cpu: Optional[List[float]], json_path: Optional[str], algorithm: str = "default",
         device: str = "cpu", layers: int = 2, bucket_mb: float = 25, rounds: int = 1) -> Dict:
    res = run(ranks, modes or DEFAULT_MODES, params, global_batch, steps, warmup, rank_cpu, algorithm, device,
              layers, bucket_mb, rounds)
    if not res:  # not rank 0
        return res
    cfg = res["cfg"]
    where = "CPU" if device == "cpu" else \
        f"{torch.cuda.get_device_name(0)} x{min(torch.cuda.device_count(), res['ranks'])}"
    print(f"# hetcomm bench ddp: {res['ranks']} {cfg['backend']} ranks on {where}, CPU quotas {rank_cpu or 'none'}, "
          f"hetcomm algorithm {algorithm}, "
          f"{res['rows'][0]['params']:,} parameters ({layers} hidden layers, DDP buckets of {bucket_mb} MB), "
          f"global batch {global_batch}, {steps} timed steps" +
          (f" x {rounds} rounds (modes take turns; the median over all)" if rounds > 1 else ""))
    cols = [("mode", "mode", "s"), ("step_ms", "step ms", ".1f"), ("samples_per_s", "samples/s", ".1f"),
            ("bytes_per_step", "bytes/step", ",d"), ("bytes_across_nodes_per_step", "across", ",d"),
            ("hidden", "hidden", ".2f"), ("local_batches", "batches", "s")]
    cols += [("of_ideal", "of ideal", ".2f")]
    if "vs_plain_ddp" in res["rows"][0]:  # torch-allreduce ran
        cols += [("vs_plain_ddp", "vs DDP", ".2f")]
    cols += [("plans", "bucket plans", "s")]
    solo = ", ".join(f"{r:.0f}" for r in res["summary"]["solo_rates"])
    print(f"# ideal = sum of each rank's solo speed (training alone, samples/s: {solo}) = "
          f"{res['summary']['ideal_samples_per_s']:.1f} samples/s; vs DDP = vs torch-allreduce")
    common.print_table(res["rows"], cols)
    common.write_json(json_path, res, common.metadata(res["ranks"], device=device, iters=steps, warmup=warmup,
                                                      units={"step_ms": "milliseconds", "bytes_per_step": "B"}))
    return res
