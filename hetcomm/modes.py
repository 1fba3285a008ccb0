"""One table of the training modes that the demo, the benchmarks and the tests name.

A mode is one of PyTorch's own comm hooks (``torch-allreduce``, alias
``fp32``; ``torch-fp16``; ``torch-powersgd``: rank 4, error feedback and warm
start, compressed from step 2, as hetcomm's lowrank) or a hetcomm
:class:`~hetcomm.HookState` with its defaults. Suffixes: ``+m`` compresses
the optimizer's momentum (:meth:`HookState.attach_optimizer`), ``+lr``
compresses the gradient with error feedback in the units of the optimizer's
learning rate (:meth:`HookState.follow_lr`), ``-no-ef``
turns error feedback off (to show what it buys), ``-w8`` / ``-w32`` after ``+m``
send the warm-up's gradient in fp8 / fp32 (``attach_optimizer(warmup_compression=
"fp8" / "none")``; plain ``+m`` takes its default, fp8 since the runs are given
their ``total_steps``); ``-rN`` after ``lowrank``
or ``torch-powersgd`` sets the rank (``lowrank-r16+m``, ``torch-powersgd-r8``);
``-cN`` after ``onebit``, ``fp8`` or ``int3`` the elements per scale (``onebit-c256+m``);
``-kN`` after ``topk`` the entries it sends, N per mille (HookState's ``topk_ratio
= N / 1000``; ``topk-k30+m``: 3 %);
``-sN`` after a hetcomm mode compresses from step N (HookState's
``start_iter``; ``lowrank-s0``: from the first step, PowerSGD's hook cannot);
``-pN`` last after ``+m`` makes the warm-up N % of the run
(``attach_optimizer(warmup_fraction=N / 100)``; ``onebit+m-p5``); ``@ALGO``
at the very end of a hetcomm mode sets HookState's ``algorithm``
(``fp8@hierarchical``, ``onebit+m-p5@ring``; ``fp8@native`` compresses flat
where ``fp8``, HookState's default, goes across nodes only on several nodes);
``-fp32`` / ``-bf16`` / ``-fp8`` at the end of a lowrank or auto mode (before ``@ALGO``) sends lowrank's factors in
float32 / bf16 / fp8 (HookState's ``lowrank_wire``; by default bf16, fp8 across a link measured under 40 Mbit/s;
``lowrank-fp32``, ``lowrank-r8+m-fp32@native``; the tables in bench/README before "bf16 by default" ran
``lowrank`` in float32).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

import torch
from torch import nn

from .options import LOWRANK_WIRES, check_chunk_size
from .topology import ALGORITHMS

POWERSGD_RANK = 4
POWERSGD_START = 2


@dataclass(frozen=True)
class Mode:
    name: str
    hook: str  # PyTorch's "allreduce", "fp16", "powersgd", or "hetcomm"
    options: Mapping[str, Any] = field(default_factory=dict)  # HookState keyword arguments
    attach: bool = False  # compress the optimizer's momentum
    follow: bool = False  # error feedback follows the optimizer's learning rate (HookState.follow_lr)
    warmup: Optional[str] = None  # attach_optimizer's warmup_compression (None: its default; -w8 "fp8", -w32 "none")
    rank: int = POWERSGD_RANK  # torch-powersgd's matrix_approximation_rank (lowrank's is in options)
    warmup_fraction: Optional[float] = None  # attach_optimizer's warmup_fraction (-pN: N / 100; None: its default)

    @property
    def is_torch(self) -> bool:
        return self.hook != "hetcomm"

    def ddp_options(self, bucket_cap_mb: Optional[float] = None) -> Dict[str, Any]:
        """DDP keyword arguments for this mode: PyTorch's PowerSGD hook gets
        one bucket (on gloo it fails with "collective mismatch" from its
        second compressed bucket on: an MLP of 64 -> 1000 -> 1000 -> 10 on 2
        ranks, torch 2.13); the others ``bucket_cap_mb`` if given."""
        if self.hook == "powersgd":
            return {"bucket_cap_mb": 10_000}
        return {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}

    def comm_hook(self, **overrides) -> Tuple[Any, Callable, Optional[Any]]:
        """(hook state, hook) for ``DDP.register_comm_hook``, and hetcomm's
        HookState (None for PyTorch's hooks). ``overrides`` are HookState
        keywords (hetcomm modes only)."""
        if self.is_torch:
            if overrides:
                raise ValueError(f"mode {self.name!r} is PyTorch's hook: it takes no HookState options, got "
                                 f"{sorted(overrides)}")
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

            if self.hook == "powersgd":
                ps = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=self.rank,
                                                 start_powerSGD_iter=POWERSGD_START, use_error_feedback=True,
                                                 warm_start=True)
                return ps, powerSGD_hook.powerSGD_hook, None
            return None, (default_hooks.allreduce_hook if self.hook == "allreduce"
                          else default_hooks.fp16_compress_hook), None
        import hetcomm

        state = hetcomm.HookState(**{**self.options, **overrides})
        return state, hetcomm.hook, state

    def register(self, ddp: nn.parallel.DistributedDataParallel, optimizer: Optional[torch.optim.Optimizer] = None,
                 total_steps: Optional[int] = None, **overrides):
        """Registers the mode's hook on ``ddp`` (attaching ``optimizer`` for
        ``+m``, with the run's ``total_steps`` for the warm-up); returns
        hetcomm's HookState, or None for PyTorch's hooks."""
        if self.attach and optimizer is None:
            raise ValueError(f"mode {self.name!r} compresses the optimizer's momentum: pass the optimizer")
        if self.follow and optimizer is None:
            raise ValueError(f"mode {self.name!r} follows the optimizer's learning rate: pass the optimizer")
        hook_state, hook, state = self.comm_hook(**overrides)
        if self.attach:
            state.attach_optimizer(optimizer, total_steps=total_steps, warmup_compression=self.warmup,
                                   warmup_fraction=self.warmup_fraction)
        if self.follow:
            state.follow_lr(optimizer)
        ddp.register_comm_hook(hook_state, hook)
        return state

    @property
    def plain(self) -> bool:
        """hetcomm's HookState with its defaults: no ``+m``, no ``-no-ef``, all of auto's candidates."""
        return (self.hook == "hetcomm" and not self.attach and not self.follow
                and self.options.get("error_feedback", True) and "candidates" not in self.options)

    def torch_bytes(self, model: nn.Module, world: int, steps: Optional[int] = None) -> float:
        """Bytes a PyTorch hook sends per step and rank once compressing (the
        ring-equivalent volume, the convention of hetcomm's stats); with
        ``steps``, the mean over a run's first ``steps`` steps (PowerSGD sends
        its first ``POWERSGD_START`` dense)."""
        if not self.is_torch:
            raise ValueError(f"mode {self.name!r} counts its bytes in HookState.stats()")
        if self.hook == "powersgd" and steps is not None:
            dense = ring_bytes(sum(p.numel() for p in model.parameters()), world)
            start = min(steps, POWERSGD_START)
            return (start * dense + max(steps - start, 0) * self.torch_bytes(model, world)) / max(steps, 1)
        if self.hook == "powersgd":
            floats = 0
            for p in model.parameters():  # P and Q of each matrix worth compressing, the rest dense
                if p.dim() > 1:
                    n, m = p.shape[0], p.numel() // p.shape[0]
                    r = min(n, m, self.rank)
                    floats += (n + m) * r if n * m > 2 * (n + m) * r else n * m
                else:
                    floats += p.numel()
            return ring_bytes(floats, world)
        return ring_bytes(sum(p.numel() for p in model.parameters()), world, 2 if self.hook == "fp16" else 4)


def ring_bytes(numel: int, world: int, width: int = 4) -> int:
    """What a ring all-reduce of ``numel`` elements of ``width`` bytes sends per rank."""
    return 2 * (world - 1) * numel * width // world if world > 1 else 0


def _table() -> Dict[str, Mode]:
    table = {n: Mode(n, hook) for n, hook in (("torch-allreduce", "allreduce"), ("fp32", "allreduce"),
                                               ("torch-fp16", "fp16"), ("torch-powersgd", "powersgd"))}
    for c in ("none", "fp16", "bf16", "auto-precision", "fp8", "int3", "onebit", "topk", "lowrank", "auto"):
        table[c] = Mode(c, "hetcomm", {"compression": c})
    for c in ("fp8", "int3", "onebit", "topk", "lowrank", "auto"):
        table[f"{c}+m"] = Mode(f"{c}+m", "hetcomm", {"compression": c}, attach=True)
        table[f"{c}+lr"] = Mode(f"{c}+lr", "hetcomm", {"compression": c}, follow=True)
    for c in ("onebit", "topk", "lowrank", "auto"):
        for suffix, wire in (("w8", "fp8"), ("w32", "none")):
            table[f"{c}+m-{suffix}"] = Mode(f"{c}+m-{suffix}", "hetcomm", {"compression": c}, attach=True,
                                            warmup=wire)
    # auto without its guarded lowrank: what the guard's readings and lowrank's re-checks cost where lowrank does
    # not win (bench/README "A re-check for lowrank measures lowrank")
    table["auto-no-lowrank"] = Mode("auto-no-lowrank", "hetcomm",
                                    {"compression": "auto", "candidates": ("none", "bf16", "fp8", "int3")})
    for c in ("onebit", "topk"):
        table[f"{c}-no-ef"] = Mode(f"{c}-no-ef", "hetcomm", {"compression": c, "error_feedback": False})
    return table


MODES: Dict[str, Mode] = _table()
#: PyTorch's hooks, and hetcomm's compressions as they are (no suffix)
TORCH = tuple(n for n, m in MODES.items() if m.is_torch)
HETCOMM = tuple(n for n, m in MODES.items() if m.plain)


def _part(name: str, base: str) -> Mode:
    """The mode ``base`` that ``name`` adds a suffix to; its error names ``name``."""
    try:
        return get(base)
    except ValueError as e:
        raise ValueError(f"mode {name!r}: {e}") from None


def get(name: str, choices: Optional[Iterable[str]] = None) -> Mode:
    """The mode called ``name``; ValueError naming the choices (``choices``,
    else every mode) when there is none."""
    allowed = list(choices) if choices is not None else list(MODES)
    if choices is None and "@" in name:
        base, _, algorithm = name.rpartition("@")
        m = _part(name, base)
        if m.is_torch:
            raise ValueError(f"mode {name!r}: @ALGO is for hetcomm's modes; {base} is PyTorch's hook")
        if algorithm not in ("auto",) + ALGORITHMS:
            raise ValueError(f"mode {name!r}: the algorithm after @ must be one of auto, {', '.join(ALGORITHMS)}")
        return replace(m, name=name, options={**m.options, "algorithm": algorithm})
    packed = next((w for w in ("zstd", "raw") if name.endswith(f"-{w}")), None) if choices is None else None
    if packed is not None:
        m = _part(name, name[:-len(packed) - 1])
        if m.is_torch:
            raise ValueError(f"mode {name!r}: -{packed} (HookState's pack) is for hetcomm's modes")
        return replace(m, name=name, options={**m.options, "pack": packed == "zstd"})
    wire = next((w for w in LOWRANK_WIRES if name.endswith(f"-{w}")), None) if choices is None else None
    if wire is not None:
        m = _part(name, name[:-len(wire) - 1])
        if m.options.get("compression") not in ("lowrank", "auto"):
            raise ValueError(f"mode {name!r}: -{wire} (the factors' wire) is for hetcomm's lowrank and auto modes")
        return replace(m, name=name, options={**m.options, "lowrank_wire": wire})
    start = _START.match(name) if choices is None else None
    if start:
        m = _part(name, start.group(1))
        if m.is_torch:
            raise ValueError(f"mode {name!r}: -sN (compressed from step N) is for hetcomm's modes; PyTorch's "
                             f"PowerSGD starts at {POWERSGD_START}")
        return replace(m, name=name, options={**m.options, "start_iter": int(start.group(2))})
    share = _SHARE.match(name) if choices is None else None
    if share:
        m = _part(name, share.group(1))
        percent = int(share.group(2))
        if not m.attach:
            raise ValueError(f"mode {name!r}: -pN (the warm-up's percent of the run) is for +m modes")
        if not 0 < percent < 100:
            raise ValueError(f"mode {name!r}: the warm-up's percent after -p must be in 1..99")
        return replace(m, name=name, warmup_fraction=percent / 100)
    ranked = _RANKED.match(name) if choices is None else None
    if ranked:
        base, letter, n, suffix = ranked.group(1), ranked.group(2), int(ranked.group(3)), ranked.group(4) or ""
        if letter != {"lowrank": "r", "torch-powersgd": "r", "topk": "k"}.get(base, "c"):
            raise ValueError(f"mode {name!r}: -rN is for lowrank and torch-powersgd, -cN for onebit, fp8 and int3, "
                             f"-kN for topk")
        if letter == "r" and n < 1:
            raise ValueError(f"mode {name!r}: the rank after -r must be >= 1")
        if letter == "k" and not 1 <= n <= 1000:
            raise ValueError(f"mode {name!r}: the per mille after -k must be in 1..1000")
        if base + suffix not in MODES:
            raise ValueError(f"mode {name!r}: {base} has no {suffix} form")
        m = MODES[base + suffix]
        if letter == "c":  # HookState's rule, checked when the mode is named (a bench: before any run)
            try:
                check_chunk_size(n)
            except ValueError as e:
                raise ValueError(f"mode {name!r}: the elements per scale after -c: {e}") from None
            return replace(m, name=name, options={**m.options, "chunk_size": n})
        if letter == "k":
            return replace(m, name=name, options={**m.options, "topk_ratio": n / 1000})
        if m.is_torch:
            return replace(m, name=name, rank=n)
        return replace(m, name=name, options={**m.options, "matrix_approximation_rank": n})
    if name not in allowed or name not in MODES:
        ranks = (" (lowrank and torch-powersgd also as lowrank-rN, torch-powersgd-rN: rank N; onebit, fp8 and "
                 "int3 as onebit-cN, fp8-cN, int3-cN: N elements per scale; topk as topk-kN: N per mille of the entries; a +m mode "
                 "as X+m-pN: a warm-up of N % of the run; "
                 "a hetcomm mode as X-sN: compressed from step N (HookState's start_iter), X@ALGO: its algorithm; "
                 "a lowrank or auto mode as X-fp32 / X-bf16 / X-fp8: lowrank's factors in float32 / bf16 / fp8; "
                 "a hetcomm mode as X-zstd / X-raw: its messages packed or not, HookState's pack)"
                 ) if choices is None else ""
        raise ValueError(f"mode must be one of {', '.join(allowed)}{ranks}; got {name!r}")
    return MODES[name]


_START = re.compile(r"^(.+)-s(\d+)$")
_SHARE = re.compile(r"^(.+)-p(\d+)$")
_RANKED = re.compile(r"^(lowrank|torch-powersgd|onebit|fp8|int3|topk)-([rck])(\d+)(\+m(?:-w8|-w32)?|\+lr)?$")
