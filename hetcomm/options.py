"""HookState's options: their rules (checked at construction) and what every
rank must agree on (checked collectively at the first step)."""

from __future__ import annotations

import os
import struct
import warnings
from datetime import timedelta
from typing import Any, Dict, Iterable, List, Literal, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import topology
from .plan import AUTO_MODES, COMPRESSED, MIN_START_ITER  # noqa: F401 (COMPRESSED: modes with per-bucket state, for hooks)
from .planner import DEFAULT_CHUNK
from .topology import ALGORITHMS

COMPRESSIONS = ("none", "fp16", "bf16", "auto-precision", "fp8", "int3", "onebit", "topk", "lowrank", "auto")
#: The 16-bit casts (auto-precision: whichever every rank's device has).
CASTS = ("fp16", "bf16", "auto-precision")
Compression = Literal["none", "fp16", "bf16", "auto-precision", "fp8", "int3", "onebit", "topk", "lowrank", "auto"]
Algorithm = Literal["native", "ring", "halving_doubling", "tree", "hierarchical", "auto"]
# What attach_optimizer saw (the auto mode's safe set depends on it).
ATTACHED = (None, "sgd", "adam", "hetcomm-adamw")
WARMUP_WIRES = ("none", "fp8")  # attach_optimizer(warmup_compression=...)
LOWRANK_WIRES = ("fp32", "bf16", "fp8")  # HookState(lowrank_wire=...)
#: A rank's compute precision as gathered at the first step (None: no hetcomm.amp.GradScaler).
_PRECISIONS = (None, "bf16", "fp16", "fp32")
SCALER_NAME = "hetcomm.amp.GradScaler (created before the first step)"
FOLLOW_NAME = "learning rate followed (follow_lr, or attach_optimizer)"


def precision_code(p: Optional[str]) -> int:
    return _PRECISIONS.index(p)


def precision_name(code: int) -> Optional[str]:
    return _PRECISIONS[code]


STATE_DICT_VERSION = 2


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    """An int or a float, not a bool (the numeric options' type check)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_chunk_size(chunk_size: Optional[int]) -> None:
    """The rule of ``chunk_size`` (elements per scale): None, or a positive multiple of 32 up to 2**30."""
    if chunk_size is not None and (not _is_int(chunk_size) or not 0 < chunk_size <= 2**30 or chunk_size % 32):
        raise ValueError(f"chunk_size must be None or a positive multiple of 32 up to 2**30, got {chunk_size!r}")


def chunk_for(chunk_size: Optional[int], mode: str) -> int:
    """Elements per scale of the onebit, fp8 or int3 codec (``mode``): the
    option, or the codec's default (planner.DEFAULT_CHUNK says why: 32 for
    onebit and int3, 256 for fp8). Other modes ignore it: their default is fp8's."""
    return chunk_size if chunk_size is not None else DEFAULT_CHUNK.get(mode, DEFAULT_CHUNK["fp8"])


def validate(compression: str, start_iter: Optional[int], error_feedback: bool, chunk_size: Optional[int],
             min_compress_numel: int,
             topk_ratio: float, topk_exact: bool, matrix_approximation_rank: Optional[int], algorithm: Optional[str],
             transport: str, timeout: Optional[timedelta], process_group: Any, rank: Optional[int],
             candidates: Optional[Sequence[str]], lowrank_wire: Optional[str],
             pack: Optional[bool] = None) -> Dict[str, Any]:
    """The options after their rules, or a ValueError naming the argument."""
    if rank is not None:
        warnings.warn("HookState(rank=...) is deprecated: it is lowrank's matrix_approximation_rank (rank reads "
                      "like the process rank); pass matrix_approximation_rank=...", DeprecationWarning, stacklevel=3)
        if matrix_approximation_rank not in (None, rank):
            raise ValueError("pass matrix_approximation_rank or its deprecated alias rank, not both")
        matrix_approximation_rank = rank
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {COMPRESSIONS}, got {compression!r}")
    if start_iter is None:  # the default: the first step exact (auto: its trial then runs in DDP's rebuilt buckets)
        start_iter = MIN_START_ITER
    if not _is_int(start_iter) or start_iter < 0:
        raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
    if error_feedback and compression == "auto" and start_iter < MIN_START_ITER:
        raise ValueError(
            f"start_iter must be >= {MIN_START_ITER} with compression='auto' (got {start_iter}): its trial of the "
            "codecs runs in DDP's buckets as rebuilt in the second iteration")
    check_chunk_size(chunk_size)
    if not _is_int(min_compress_numel) or min_compress_numel < 0:
        raise ValueError(f"min_compress_numel must be an int >= 0, got {min_compress_numel!r}")
    if not _is_number(topk_ratio) or not 0.0 < float(topk_ratio) <= 1.0:
        raise ValueError(f"topk_ratio must be a number in (0, 1], got {topk_ratio!r}")
    if matrix_approximation_rank is not None and (not _is_int(matrix_approximation_rank) or
                                                  matrix_approximation_rank < 1):
        raise ValueError(f"matrix_approximation_rank (lowrank's rank) must be None (lowrank chooses 4, 8 or 16 by "
                         f"measurement) or an int >= 1, got {matrix_approximation_rank!r}")
    if lowrank_wire is not None and lowrank_wire not in LOWRANK_WIRES:
        raise ValueError(f"lowrank_wire must be None (bf16, fp8 across a slow link between nodes) or one of "
                         f"{LOWRANK_WIRES}, got {lowrank_wire!r}")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback must be a bool, got {error_feedback!r}")
    if not isinstance(topk_exact, bool):
        raise ValueError(f"topk_exact must be a bool, got {topk_exact!r}")
    if pack is not None and not isinstance(pack, bool):
        raise ValueError(f"pack must be None (int3 across a slow link between nodes), True or False, got {pack!r}")
    if algorithm is None:  # compression="auto" chooses the algorithm too
        algorithm = "auto" if compression == "auto" else "native"
    if algorithm != "auto" and algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be 'auto' or one of {ALGORITHMS}, got {algorithm!r}")
    if compression == "lowrank" and algorithm not in ("native", "auto", "hierarchical"):
        raise ValueError("algorithm must be 'native', 'hierarchical' or 'auto' with compression='lowrank'")
    if transport not in ("auto", "pg"):
        raise ValueError(f"transport must be 'auto' or 'pg', got {transport!r}")
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0):
        raise ValueError(f"timeout must be a positive datetime.timedelta or None, got {timeout!r}")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise ValueError(f"process_group must be a torch.distributed.ProcessGroup or None, got {process_group!r}")
    if candidates is not None:
        if compression != "auto":
            raise ValueError(f"candidates is for compression='auto' only (got compression={compression!r})")
        # a bool, a number or a string is not a sequence of modes (a string would iterate as letters)
        listed = list(candidates) if isinstance(candidates, Iterable) and not isinstance(candidates, str) else []
        if not listed or any(c not in AUTO_MODES for c in listed) or len(set(listed)) != len(listed):
            raise ValueError(f"candidates must be a non-empty sequence of distinct modes from {AUTO_MODES}, got "
                             f"{candidates!r}")
        candidates = tuple(sorted(listed, key=AUTO_MODES.index))
    return dict(compression=compression, start_iter=start_iter, error_feedback=error_feedback, chunk_size=chunk_size,
                min_compress_numel=min_compress_numel, topk_ratio=float(topk_ratio), topk_exact=topk_exact,
                matrix_approximation_rank=matrix_approximation_rank, lowrank_wire=lowrank_wire, algorithm=algorithm,
                transport=transport, candidates=candidates, pack=pack)


def float_bits(x: float) -> int:
    """x's IEEE-754 bits as an int64: floats agreed across ranks are compared exactly."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(v: int) -> float:
    return struct.unpack("<d", struct.pack("<q", v))[0]


ENV_NAME = f"{topology.ENV_ALGO} (environment)"


def config(s) -> List[Tuple[str, int]]:
    """(name, value) of everything HookState ``s`` must agree on across ranks,
    as exact int64 values (floats by their bits)."""
    forced = os.environ.get(topology.ENV_ALGO) or ""
    mask = sum(1 << AUTO_MODES.index(c) for c in s.candidates) if s.candidates else 0
    return [
        ("hetcomm version", STATE_DICT_VERSION),
        ("compression", COMPRESSIONS.index(s.compression)),
        ("candidates", mask),
        # before start_iter, which they set: a differing warm-up is named by the argument that differs
        ("total_steps (attach_optimizer)", s._total_steps or 0),
        ("warmup_fraction (attach_optimizer)", float_bits(s._warmup_fraction or 0.0)),
        ("start_iter", s.start_iter),
        ("error_feedback", int(s.error_feedback)),
        ("chunk_size", s.chunk_size or 0),  # 0: each mode's default
        ("min_compress_numel", s.min_compress_numel),
        ("topk_ratio", float_bits(s.topk_ratio)),
        ("topk_exact", int(s.topk_exact)),
        ("matrix_approximation_rank", s._rank_given or 0),  # 0: lowrank chooses it (RankLadder)
        ("lowrank_wire", -1 if s.lowrank_wire is None else LOWRANK_WIRES.index(s.lowrank_wire)),
        ("pack", -1 if s.pack is None else int(s.pack)),  # every rank packs a bucket's messages, or none does
        # a compressed mode's default decides by the nodes (negotiation.across_nodes), "native" given does not
        ("algorithm", -1 if s._algorithm_default else (("auto",) + ALGORITHMS).index(s.algorithm)),
        ("transport", ("auto", "pg").index(s.transport)),
        ("batch-size weighting (set_local_batch_size called before the first step)", int(s._local_batch is not None)),
        ("iter (steps done; was the state restored on every rank?)", s.iter),
        ("momentum (attach_optimizer)", float_bits(s._beta or 0.0)),
        ("optimizer kind (attach_optimizer)", ATTACHED.index(s._attached)),
        ("exact_every (attach_optimizer)", s._exact_every),
        ("warmup_compression (attach_optimizer)", WARMUP_WIRES.index(s._warmup_compression)),
        (FOLLOW_NAME, len(s._lr_source) if s._lr_source is not None else 0),  # how many optimizers
        (SCALER_NAME, int(s._scaler is not None)),
        (ENV_NAME, 0 if not forced else (1 + ALGORITHMS.index(forced) if forced in ALGORITHMS else -1)),
    ]


_SHOW = {"compression": lambda v: COMPRESSIONS[v],
         "candidates": lambda v: [m for i, m in enumerate(AUTO_MODES) if v >> i & 1] or "default",
         "topk_ratio": bits_float,
         "momentum (attach_optimizer)": bits_float,
         "warmup_fraction (attach_optimizer)": bits_float,
         "optimizer kind (attach_optimizer)": lambda v: ATTACHED[v] or "none",
         "warmup_compression (attach_optimizer)": lambda v: WARMUP_WIRES[v],
         "lowrank_wire": lambda v: "default" if v < 0 else LOWRANK_WIRES[v],
         FOLLOW_NAME: lambda v: "no" if not v else "yes" if v == 1 else f"yes, {v} optimizers",
         SCALER_NAME: lambda v: "yes" if v else "no",
         "algorithm": lambda v: "default" if v < 0 else (("auto",) + ALGORITHMS)[v],
         ENV_NAME: lambda v: "unset" if v == 0 else (ALGORITHMS[v - 1] if v > 0 else "invalid")}


def check_agreement(cfg: List[Tuple[str, int]], gathered: torch.Tensor) -> Optional[str]:
    """Raise the same ValueError on every rank if a column of ``gathered``
    ([world, len(cfg)]) differs; return the agreed HETCOMM_ALGO (None: unset)."""
    for col, (name, _) in enumerate(cfg):
        column = gathered[:, col].tolist()
        if len(set(column)) > 1:
            fmt = _SHOW.get(name, lambda v: v)
            per_rank = ", ".join(f"rank {r}: {fmt(v)!r}" for r, v in enumerate(column))
            fix = ("set the same environment on every rank" if "environment" in name else
                   "create one on every rank (precision 'bf16' or 'fp32' where a rank needs no loss scaling), so "
                   "every rank reduces unscaled gradients and skips the same steps" if name == SCALER_NAME else
                   "construct HookState with the same arguments on every rank")
            raise ValueError(f"hetcomm: HookState option {name} differs across ranks ({per_rank}); {fix}")
    forced = int(gathered[0, [n for n, _ in cfg].index(ENV_NAME)])
    if forced < 0:
        raise ValueError(f"hetcomm: {topology.ENV_ALGO} must be one of {ALGORITHMS}, got "
                         f"{os.environ.get(topology.ENV_ALGO)!r}")
    return ALGORITHMS[forced - 1] if forced else None
