"""Shared pieces of the benchmarks: size sweeps, timing, tables, JSON."""

from __future__ import annotations

import json
import time
from typing import Callable, Dict, List, Optional

import torch

from ..topology import sync

def size_sweep(lo: int, hi: int, factor: int) -> List[int]:
    """lo, lo * factor, ... up to hi bytes (the CLI checks lo <= hi, factor >= 2)."""
    if lo < 1 or factor < 2 or lo > hi:
        raise ValueError(f"need 1 <= -b <= -e and -f >= 2, got {lo}, {hi}, {factor}")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def median_time(fn: Callable[[], object], iters: int, warmup: int, device: str = "cpu") -> float:
    """Median wall time of fn() in seconds (CUDA work included: synchronised)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def memory_bandwidth(nbytes: int = 256 << 20, iters: int = 5, device: str = "cpu") -> float:
    """Read+write GB/s of a large copy_ into an existing buffer (torch's
    threads on the CPU; a device-to-device copy on CUDA)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), iters, 1, device)
    return 2 * nbytes / t / 1e9


def print_table(rows: List[Dict], columns: List[tuple]) -> None:
    """columns: (key, header, format)."""
    print("  ".join(f"{h:>{max(len(h), 10)}}" for _, h, _ in columns))
    for r in rows:
        print("  ".join(f"{format(r[k], f):>{max(len(h), 10)}}" for k, h, f in columns))


def write_json(path: Optional[str], payload: Dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(payload, f, indent=2)
