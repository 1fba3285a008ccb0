"""Shared pieces of the benchmarks: size sweeps, timing, tables, JSON."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..testbed import sched_policy
from ..topology import node_name, sync

# The arguments ``hetcomm.cli.main`` was called with (the command line, or what a caller in Python passed): what
# :func:`metadata` records as the command. None: this process's own ``sys.argv``.
_command: Optional[List[str]] = None


def set_command(argv: List[str]) -> None:
    """Record ``hetcomm ARGV`` as the command of the results this process writes."""
    global _command
    _command = list(argv)


def size_sweep(lo: int, hi: int, factor: int) -> List[int]:
    """lo, lo * factor, ... up to hi bytes (the CLI checks lo <= hi, factor >= 2)."""
    if lo < 1 or factor < 2 or lo > hi:
        raise ValueError(f"need 1 <= -b <= -e and -f >= 2, got {lo}, {hi}, {factor}")
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= factor
    return sizes


def rank_device(rank: int, device: str = "cpu") -> torch.device:
    """This rank's device for ``device`` ("cpu" or "cuda": the GPU of its
    LOCAL_RANK, or of ``rank``, modulo the GPUs; ranks share GPUs when there
    are fewer), made current."""
    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def backend_for(device: str, ranks: int) -> str:
    """NCCL with a GPU per rank; else gloo (ranks sharing GPUs, or the CPU)."""
    world = int(os.environ.get("WORLD_SIZE", ranks))
    return "nccl" if device == "cuda" and torch.cuda.device_count() >= world else "gloo"


def require_device(device: str, command: str) -> None:
    """A clear error where ``device`` is "cuda" without a visible GPU and a CUDA build of hetcomm."""
    import hetcomm

    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not (torch.cuda.is_available() and hetcomm.build_info()["cuda"]):
        raise SystemExit(f"{command} --device cuda: needs a visible GPU and a CUDA build of hetcomm "
                         "(build_info()['cuda'])")


def median_time(fn: Callable[[], object], iters: int, warmup: int, device: str = "cpu") -> float:
    """Median time of fn() in seconds: wall time on the CPU; on CUDA the GPU's
    time between events around each call (calls queued back to back)."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        sync(device)
        marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in marks:
            start.record()
            fn()
            end.record()
        sync(device)
        times = sorted(start.elapsed_time(end) / 1e3 for start, end in marks)
        return times[len(times) // 2]
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def timed_steps(ddp, opt: torch.optim.Optimizer, task, rank: int, steps: int) -> List[float]:
    """Seconds of each of ``steps`` training steps of ``ddp`` on ``task``'s
    batches for ``rank`` (the bench scripts that time a run step by step)."""
    times = []
    for step in range(steps):
        t = time.perf_counter()
        x, y = task.batch_for(step, rank)
        opt.zero_grad()
        task.loss(ddp(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def segment_ms(runs: Sequence[Sequence[float]], segments: Sequence[Tuple[int, int]]) -> str:
    """``"A-B: ms  C-D: ms ..."``: per segment of steps [A, B) the mean over
    ``runs`` (each one's seconds a step, :func:`timed_steps`) of each run's
    mean ms a step there; segments past the runs' steps left out."""
    steps = min(len(r) for r in runs)
    return "  ".join(f"{a}-{b}: {1000 * statistics.mean(statistics.mean(r[a:b]) for r in runs):.2f}"
                     for a, b in segments if b <= steps)


def memory_bandwidth(nbytes: int = 256 << 20, iters: int = 5, device: str = "cpu") -> float:
    """Read+write GB/s of a large copy_ into an existing buffer (torch's
    threads on the CPU; a device-to-device copy on CUDA)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = median_time(lambda: dst.copy_(src), iters, 1, device)
    return 2 * nbytes / t / 1e9


class Table:
    """A table printed a row at a time, as rows finish (nccl-tests' way):
    columns are (key, header, format[, width]); a column is as wide as its
    header, its width or 10, whichever is most."""

    def __init__(self, columns: List[tuple]) -> None:
        self.columns = [(c[0], c[1], c[2], max(len(c[1]), c[3] if len(c) > 3 else 10)) for c in columns]

    def header(self) -> None:
        print("  ".join(f"{h:>{w}}" for _, h, _, w in self.columns), flush=True)

    def row(self, r: Dict) -> None:
        print("  ".join(f"{format(r[k], f):>{w}}" for k, _, f, w in self.columns), flush=True)


def print_table(rows: List[Dict], columns: List[tuple]) -> None:
    """columns: (key, header, format); each column fits its widest cell."""
    cols = [(k, h, f, max([10, len(h)] + [len(format(r[k], f)) for r in rows])) for k, h, f in columns]
    t = Table(cols)
    t.header()
    for r in rows:
        t.row(r)


def pyplot(who: str):
    """matplotlib.pyplot on the file-only Agg backend, or None (with a note on
    stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print(f"hetcomm {who}: matplotlib is not installed, no PNG written (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def finish_axis(ax, title: str, xlabel: str, ylabel: str) -> None:
    """The labels, grid and legend every hetcomm plot's panels share."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def save_figure(plt, fig, path: str, dpi: int = 100) -> bool:
    """Lays out, writes and closes ``fig``; True (the plot functions' "written")."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def metadata(world: int, **extra) -> Dict:
    """What a result file needs to be read later: the command, versions and
    build, the machine, the date (UTC) and the run's own settings."""
    import datetime
    import platform
    import sys

    import hetcomm

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {"command": " ".join(["hetcomm"] + (sys.argv[1:] if _command is None else _command)), "world_size": world,
            "hetcomm": hetcomm.__version__, "torch": torch.__version__, "build": hetcomm.build_info(),
            "python": platform.python_version(), "host": platform.node(), "gpus": gpus,
            "sched": sched_policy(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), **extra}


@contextlib.contextmanager
def denormals_flushed(device: str = "cpu"):
    """Inside: this thread (and the threads it starts: they inherit its
    floating-point environment) treats subnormal float32 inputs and results
    as zero, on the CPU (``torch.set_flush_denormal``; a GPU's kernels are
    untouched); after: the default again. A momentum that decays where a
    gradient stays exactly zero (a unit no input reaches, an entry top-k
    does not send) passes through the subnormal range, where each operation
    on it takes the CPU tens of times longer: one rank's SGD-momentum step
    of the wide model went from 1.0 to 8.7 ms between steps 600 and 1600
    (250 k subnormal entries of 1.1 M; fp32's mean of 4 ranks' gradients: 71
    k and 2.2 ms, AdamW's 195 k and 4.3 -> 6.6 ms), the 2 x 2 testbed's
    floor with no gradient exchanged from 8.9 to 23 ms a step over 2500
    steps. It slows a mode whose delivered gradient keeps exact zeros for
    hundreds of steps (fp32's) where another need not be slowed, so every
    run of ``hetcomm bench train`` flushes them
    (bench/README "Subnormal momenta on the CPU"). Threads started before
    (gloo's) keep the default."""
    flush = device == "cpu" and torch.set_flush_denormal(True)
    try:
        yield flush
    finally:
        if flush:
            torch.set_flush_denormal(False)


def write_json(path: Optional[str], payload: Dict, meta: Optional[Dict] = None) -> None:
    """payload as JSON at path (nothing when path is None), with ``meta`` (see
    :func:`metadata`) first."""
    if path:
        with open(path, "w") as f:
            json.dump({"meta": meta, **payload} if meta is not None else payload, f, indent=2)


def off_node_share() -> float:
    """Of this rank's peers, the share on other nodes (hostname or
    HETCOMM_NODE; collective: every rank calls it): a PyTorch hook's
    all-reduce counts that share of its bytes as across nodes, the
    convention of ``HookState.stats()`` for a backend's collective."""
    names: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(names, node_name())
    mine = names[dist.get_rank()]
    return sum(n != mine for n in names) / max(len(names) - 1, 1)


def plan_summary(state) -> Dict[str, int]:
    """What a HookState's last step ran: buckets per "wire/algorithm" (e.g. what auto chose)."""
    out: Dict[str, int] = {}
    for p in state.last_plans.values():
        k = f"{p.mode}/{p.algorithm}"
        out[k] = out.get(k, 0) + 1
    return out


def auto_record(state) -> Optional[Dict]:
    """What ``compression="auto"`` did in a run (its modes, trial rounds'
    times, re-checks, buckets and lowrank guard), or None for other modes."""
    auto = state.stats().get("auto") if state is not None else None
    return {k: auto[k] for k in ("modes", "round_step_s", "rechecks", "buckets", "lowrank_guard")
            if k in auto} if auto else None
