"""Random DDP training configurations through hetcomm.hook, and what must
hold in every one of them (tests/test_config_fuzz.py runs a fixed set of
seeds; ``HETCOMM_CONFIG_FUZZ=N`` there runs N seeds; ``python -m
tests.config_fuzz FIRST N`` runs seeds FIRST .. FIRST + N - 1 and prints each
configuration that breaks an invariant).

A configuration draws a mode, an optimizer (SGD plain / momentum / Nesterov,
torch's Adam and AdamW, hetcomm's AdamW), a model (an MLP, with frozen or
per-step unused parameters; a BatchNorm CNN, channels_last or not; a tied
embedding; in float32, bfloat16 or float64), 2-4 ranks (4 as two nodes of two), DDP's options (bucket size,
gradient_as_bucket_view, find_unused_parameters, static_graph, torch's Join
with uneven steps), and what a loop adds (two parameter groups, momentum attached, follow_lr,
per-rank batch sizes, no_sync micro-batches, bf16 autocast,
hetcomm.amp.GradScaler in a precision per rank with an overflow, clipping
through the state, an lr schedule, a checkpoint and a resume from it).

The invariants: no rank fails; every rank ends with the same weights, all
finite; a run resumed from its checkpoint (model, optimizer, state, scaler,
scheduler) ends on the straight run's weights to the bit (under ``auto``,
whose choices follow measured times, or resumed in another compression
through ``strict=False``, with the same weights on every rank).
The mode ``ddp`` is DDP's own all-reduce (no hook), the reference
``none`` must equal to the bit on 2 ranks.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import sys
import tempfile
import traceback
from typing import Any, Dict, List, Optional

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import topology

from . import models

MODES = ["none", "fp16", "bf16", "fp8", "int3", "onebit", "topk", "lowrank", "auto"]
OPTIMS = ["sgd", "sgdm", "nesterov", "adam", "adamw", "hetcomm-adamw"]
GRADIENT_MODES_WITH_A_STATE = ("onebit", "topk", "lowrank", "auto", "int3", "fp8")


class Net(nn.Module):
    def __init__(self, kind: str, unused: bool) -> None:
        super().__init__()
        self.kind = kind
        if kind == "conv":
            self.c1, self.bn = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.c2, self.fc = nn.Conv2d(16, 32, 3, padding=1), nn.Linear(32 * 8 * 8, 10)
        elif kind == "tied":
            self.emb, self.l1 = nn.Embedding(50, 64), nn.Linear(64, 64)
            self.head = nn.Linear(64, 50, bias=False)
            self.head.weight = self.emb.weight
        else:
            self.l1, self.l2, self.l3 = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 10)
            self.scale = nn.Parameter(torch.ones(()))
            if unused:
                self.unused = nn.Linear(7, 7)

    def forward(self, x: torch.Tensor, use_unused: bool = False) -> torch.Tensor:
        if self.kind == "conv":
            h = torch.relu(self.bn(self.c1(x)))
            return self.fc(torch.relu(self.c2(h)).flatten(1))
        if self.kind == "tied":
            return self.head(torch.tanh(self.l1(self.emb(x)))).mean(1)
        out = self.l3(torch.relu(self.l2(torch.relu(self.l1(x)))) * self.scale)
        if use_unused:
            out = out + self.unused(torch.ones(1, 7, dtype=out.dtype)).sum() * 0.01
        return out


def draw(seed: int) -> Dict[str, Any]:
    """The configuration of ``seed``, with the combinations DDP or hetcomm
    refuse by design left out (each refusal has its own test)."""
    r = random.Random(seed)
    mode, optim, model = r.choice(MODES), r.choice(OPTIMS), r.choice(["mlp", "mlp", "conv", "tied"])
    algorithm = r.choice([None, None, "ring", "tree", "halving_doubling"])
    cfg = dict(seed=seed, mode=mode, optim=optim, model=model,
               attach=mode in GRADIENT_MODES_WITH_A_STATE and optim != "sgd" and r.random() < 0.4,
               world=r.choice([2, 2, 3]), steps=r.choice([12, 25, 40]),
               unused=model == "mlp" and r.random() < 0.3, gabv=r.random() < 0.5,
               bucket_mb=r.choice([None, None, 0.05, 0.2]), channels_last=r.random() < 0.5,
               frozen=r.random() < 0.3, algorithm=None if mode == "lowrank" else algorithm,
               small=r.random() < 0.5, follow_lr=r.random() < 0.3, weigh=r.random() < 0.5,
               batch=r.choice([[8], [8, 4], [5, 9, 3]]), micro=r.choice([1, 1, 2]),
               autocast=r.random() < 0.25, clip=r.random() < 0.3, set_to_none=r.random() < 0.7,
               save_at=r.choice([5, 9]) if r.random() < 0.6 else None,
               static=r.random() < 0.2, join=r.random() < 0.2, nodes=r.random() < 0.3,
               scaler=r.random() < 0.4, overflow_at=r.choice([None, 3, 7, 11]), sched=r.random() < 0.4,
               dtype=r.choice(["float32"] * 4 + ["bfloat16", "float64"]), groups=r.random() < 0.4,
               resume_as=r.choice(MODES) if r.random() < 0.15 else None)
    if cfg["dtype"] != "float32":  # a model in another dtype: no autocast, no loss scaling (torch's rules)
        cfg.update(autocast=False, scaler=False)
    if cfg["nodes"]:
        cfg["world"] = 4
        cfg["batch"] = [5, 9, 3, 6] if len(cfg["batch"]) == 3 else cfg["batch"]
    if cfg["scaler"]:  # the scaler runs its own autocast; DDP's Join shadows no scaler
        cfg.update(autocast=False, join=False)
    if cfg["join"]:  # a joined rank shadows no clipping, no checkpoint and no micro-batches
        cfg.update(save_at=None, clip=False, micro=1)
    if cfg["resume_as"] == "lowrank" or (cfg["resume_as"] and not cfg["save_at"]):
        cfg["resume_as"] = None  # (lowrank takes no algorithm= of those drawn; no checkpoint, nothing to resume)
    if cfg["static"]:  # DDP's static graph runs neither no_sync nor unused parameters that change
        cfg.update(unused=False, micro=1)
    return cfg


def _param_groups(model: nn.Module) -> List[Dict[str, Any]]:
    """Two groups as recipes make them: weights, and biases and norms without weight decay at half the rate
    (each optimizer's own ``lr`` and ``weight_decay`` scaled by the group's factors below)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() > 1]},
            {"params": [p for p in params if p.dim() <= 1], "decay": 0.0, "rate": 0.5}]


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.05)
    if name == "sgdm":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    if name == "nesterov":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3)
    if name == "hetcomm-adamw":
        return hetcomm.optim.AdamW(params, lr=1e-3)
    return torch.optim.AdamW(params, lr=1e-3)


class Run:
    """One rank's model, DDP, optimizer and what the configuration adds."""

    def __init__(self, cfg: Dict[str, Any], rank: int) -> None:
        self.cfg, self.rank = cfg, rank
        torch.manual_seed(cfg["seed"])
        self.model = Net(cfg["model"], cfg["unused"])
        if cfg["model"] == "conv" and cfg["channels_last"]:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.model = self.model.to(getattr(torch, cfg["dtype"]))
        if cfg["frozen"] and cfg["model"] == "mlp":
            self.model.l1.bias.requires_grad_(False)
        kw: Dict[str, Any] = dict(find_unused_parameters=cfg["unused"], gradient_as_bucket_view=cfg["gabv"],
                                  static_graph=cfg["static"])
        if cfg["bucket_mb"]:
            kw["bucket_cap_mb"] = cfg["bucket_mb"]
        self.ddp = DDP(self.model, **kw)
        self.opt = _optimizer(cfg["optim"], _param_groups(self.model) if cfg["groups"] else self.ddp.parameters())
        for group in self.opt.param_groups:  # the second group's factors, on the optimizer's own settings
            group["lr"] *= group.pop("rate", 1.0)
            group["weight_decay"] *= group.pop("decay", 1.0)
        self.state: Optional[hetcomm.HookState] = None
        self.scaler: Optional[hetcomm.amp.GradScaler] = None
        if cfg["mode"] != "ddp":
            options: Dict[str, Any] = {"min_compress_numel": 64} if cfg["small"] else {}
            if cfg["algorithm"]:
                options["algorithm"] = cfg["algorithm"]
            self.state = hetcomm.HookState(cfg["mode"], **options)
            if cfg["attach"]:
                self.state.attach_optimizer(self.opt, total_steps=cfg["steps"])
            elif cfg["follow_lr"] and cfg["optim"] in ("sgd", "sgdm", "nesterov"):
                self.state.follow_lr(self.opt)
            self.ddp.register_comm_hook(self.state, hetcomm.hook)
            if cfg["scaler"]:
                self.scaler = hetcomm.amp.GradScaler(self.state, "cpu", precision=["fp16", "bf16", "fp32"][rank % 3],
                                                     init_scale=2.0 ** 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda k: 1.0 - k / 100.0) if cfg["sched"] else None

    def _batch(self, g: torch.Generator, n: int):
        kind = self.cfg["model"]
        if kind == "conv":
            return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)
        if kind == "tied":
            return torch.randint(0, 50, (n, 6), generator=g), torch.randint(0, 50, (n,), generator=g)
        return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)

    def step(self, i: int) -> None:
        cfg, rank, state, scaler = self.cfg, self.rank, self.state, self.scaler
        g = torch.Generator().manual_seed(1000 * cfg["seed"] + 17 * i + rank)
        n, micro = cfg["batch"][rank % len(cfg["batch"])], cfg["micro"]
        if cfg["weigh"] and state is not None:
            state.set_local_batch_size(n * micro)
        for m in range(micro):
            x, y = self._batch(g, n)
            x = x.to(getattr(torch, cfg["dtype"])) if x.is_floating_point() else x
            with self.ddp.no_sync() if m < micro - 1 else contextlib.nullcontext():
                cast = scaler.autocast() if scaler is not None else torch.autocast(
                    "cpu", dtype=torch.bfloat16, enabled=cfg["autocast"])
                with cast:
                    use = cfg["unused"] and (i + rank) % 3 == 0
                    out = self.ddp(x, use_unused=use) if cfg["model"] == "mlp" else self.ddp(x)
                loss = nn.functional.cross_entropy(out.float(), y) / micro
                if scaler is not None and i == cfg["overflow_at"] and rank == 0:
                    loss = loss * float("inf")  # an overflow on one rank: every rank skips the step
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if cfg["clip"]:
            if scaler is not None:
                scaler.unscale_(self.opt)
            if state is not None:
                state.clip_grad_norm_(self.ddp.parameters(), 1.0)
            else:
                nn.utils.clip_grad_norm_(self.ddp.parameters(), 1.0)
        if scaler is not None:
            scaler.step(self.opt)
            scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=cfg["set_to_none"])
        if self.sched is not None:
            self.sched.step()

    def save(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"model": self.model.state_dict(), "opt": self.opt.state_dict(),
                    "hetcomm": self.state.state_dict() if self.state is not None else None,
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "sched": self.sched.state_dict() if self.sched is not None else None}, buf)
        return buf.getvalue()

    def load(self, saved: bytes) -> None:
        """A checkpoint of this configuration, or (``resume_as``: this run in another compression) of the one it
        was saved in, through ``strict=False``."""
        ck = torch.load(io.BytesIO(saved), weights_only=True)
        self.model.load_state_dict(ck["model"])
        self.opt.load_state_dict(ck["opt"])
        for part, key in ((self.scaler, "scaler"), (self.sched, "sched")):
            if part is not None:
                part.load_state_dict(ck[key])
        if self.state is not None:
            self.state.load_state_dict(ck["hetcomm"], strict=not self.cfg.get("resume_as"))

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


def rank_body(rank: int, world: int, cfg: Dict[str, Any], cache: str) -> Dict[str, Any]:
    """The straight run (saving at ``save_at``) and the run resumed from that
    checkpoint, on this rank: the weights of each, or the error."""
    if cfg["nodes"]:
        os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    os.environ["HETCOMM_CACHE_DIR"] = cache
    try:
        run, saved = Run(cfg, rank), None
        if cfg["join"]:  # uneven inputs: odd ranks run out of batches 3 steps early
            with run.ddp.join():
                for i in range(cfg["steps"] - 3 * (rank % 2)):
                    run.step(i)
        else:
            for i in range(cfg["steps"]):
                if i == cfg["save_at"]:
                    saved = run.save()
                run.step(i)
        out: Dict[str, Any] = {"weights": models.flat_params(run.model), "resumed": None}
        run.close()
        if saved is not None:
            again = Run(dict(cfg, mode=cfg["resume_as"]) if cfg["resume_as"] else cfg, rank)
            again.load(saved)
            for i in range(cfg["save_at"], cfg["steps"]):
                again.step(i)
            out["resumed"] = models.flat_params(again.model)
            again.close()
        return out
    except Exception as e:  # reported with the configuration
        return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"}


def run_config(cfg: Dict[str, Any], spawn) -> List[Dict[str, Any]]:
    with tempfile.TemporaryDirectory() as cache:
        return spawn(rank_body, cfg["world"], cfg, cache, timeout=300, check=False)


def problems(cfg: Dict[str, Any], ranks: List[Optional[Dict[str, Any]]]) -> List[str]:
    """What the ranks' results break of the invariants (empty: nothing)."""
    if any(r is None for r in ranks):
        return ["a rank died or hung"]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return ["error: " + errors[0]]
    out = []
    first = ranks[0]
    if not all(torch.equal(r["weights"], first["weights"]) for r in ranks):
        out.append("the replicas differ")
    if not torch.isfinite(first["weights"]).all():
        out.append("a weight is not finite")
    if first["resumed"] is not None:
        if not all(torch.equal(r["resumed"], first["resumed"]) for r in ranks):
            out.append("the resumed replicas differ")
        elif cfg["mode"] != "auto" and not cfg["resume_as"] and not torch.equal(first["resumed"], first["weights"]):
            d = (first["resumed"] - first["weights"]).abs().max().item()
            out.append(f"the resumed run ends off the straight run (max |difference| {d:.3g})")
    return out


if __name__ == "__main__":
    from hetcomm.launch import spawn_ranks

    start, count = int(sys.argv[1]), int(sys.argv[2])
    bad = 0
    for seed in range(start, start + count):
        cfg = draw(seed)
        found = problems(cfg, run_config(cfg, spawn_ranks))
        bad += bool(found)
        print("BAD" if found else "ok ", seed, cfg, *found, sep="\n    " if found else " ", flush=True)
    print(f"{bad} of {count} configurations broke an invariant")
