"""The one launcher of hetcomm's demo, benchmarks and tests.

:func:`spawn_ranks` runs a function in local ranks (processes forked by
multiprocessing's fork server, FileStore rendezvous, gloo on the loopback
interface or NCCL with a GPU per rank): a rank that raises or dies fails the
run at once (the others are killed), nothing waits longer than ``timeout``,
every CPU-quota cgroup it made (:class:`hetcomm.testbed.CpuQuota`) is
removed, and a rank ends when the process that started it does (killed by a
signal too: ``kill``, a CI job's cancel). :func:`run_distributed` joins the
job instead when it runs under torchrun or ``hetcomm testbed``.
torch.distributed does the rendezvous and the sockets; this only starts and
watches processes.
"""

from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Callable, List, Optional, Sequence

import torch
import torch.multiprocessing as mp

from .testbed import CpuQuota


# What the fork server imports once, before it forks any rank (see _context).
_PRELOAD = ["torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "hetcomm"]


def _context():
    """Ranks fork from multiprocessing's fork server, which imported torch,
    torch._dynamo (DDP's constructor imports it) and hetcomm once: a spawned
    rank imports them anew, 7-8 s of CPU each on a slow 2-core machine. The
    server forks before any rank's threads, CUDA or process group exist, so a
    rank starts as clean as a spawned one. Its environment is the server's,
    from the server's start: :func:`_entry` replaces it with the caller's of
    the moment, which reaches everything read at run time (hetcomm's
    variables, gloo's, CUDA's; multiprocessing itself moves a rank to the
    caller's working folder of the moment); what a library read when it
    loaded (OpenMP's thread count) stays the server's, and each rank sets
    torch's threads to 1. The standard streams stay the server's too: a rank
    prints where the server's output went when it started."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _exit_with_parent() -> None:
    """Ends this rank when the process that started it ends. A rank is the
    fork server's child, not the caller's: the caller killed by SIGTERM (no
    Python cleanup runs) left its ranks training on, for as long as the job
    took, with no one to read their results (measured: a `hetcomm bench
    train` killed that way, its 4 ranks ran on another 10 minutes and kept
    the fork server alive). multiprocessing hands each rank a sentinel of its
    parent, readable once the parent is gone; a daemon thread waits on it."""
    parent = mp.parent_process()
    if parent is None or parent.sentinel is None:
        return
    from multiprocessing.connection import wait

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="hetcomm_parent", daemon=True).start()


def _entry(fn, rank, world, tmp, pg_timeout, cgroup, args, backend, env):
    _exit_with_parent()
    os.environ.clear()  # the caller's environment as it is now, not the fork server's from its start
    os.environ.update(env)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # local ranks talk over loopback only
    import torch.distributed as dist

    # A rank killed by a signal (an abort in C++, a segfault) leaves its Python stacks here for the report.
    fault = open(os.path.join(tmp, f"fault_{rank}.txt"), "w")
    faulthandler.enable(file=fault, all_threads=True)
    try:
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        if backend == "nccl":  # one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(tmp, f"result_{rank}.pt"))
        del result
        # What fn built and a reference cycle keeps (DDP and a comm hook's state hold the group) is freed
        # now, while the group lives; and without a barrier before destroy, gloo sometimes aborts at exit.
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # The rank's work is saved and its group destroyed: leave without the interpreter's teardown, where
    # gloo's threads freed late abort the process now and then ("terminate called without an active
    # exception", SIGABRT after a run that succeeded: a CI flake of the PowerSGD baseline test).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _failure(tmp: str, rank: int, code: Optional[int]) -> Optional[str]:
    """What a failed rank left: its Python traceback, or, killed by a signal,
    the signal and the stacks faulthandler wrote."""
    error = os.path.join(tmp, f"error_{rank}.txt")
    if os.path.exists(error):
        return f"--- rank {rank} ---\n" + open(error).read()
    if code is None or code >= 0:
        return None
    fault = os.path.join(tmp, f"fault_{rank}.txt")
    stacks = open(fault).read().strip() if os.path.exists(fault) else ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"--- rank {rank}: killed by {name} ---\n" + (stacks or "(no Python stack was written)")


def spawn_ranks(fn: Callable, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0,
                check: bool = True, rank_cpu: Optional[Sequence[float]] = None, backend: str = "gloo") -> List:
    """Runs ``fn(rank, world, *args)`` in ``world`` local ranks (FileStore
    rendezvous; gloo, or ``backend="nccl"`` with rank r on GPU r) and returns
    each rank's result. ``rank_cpu`` confines rank r to ``rank_cpu[r]`` cores.
    With ``check=False`` a failed rank's result is None."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if rank_cpu is not None and len(rank_cpu) != world:
        raise ValueError(f"rank_cpu must give one quota per rank ({world}), got {list(rank_cpu)}")
    ctx = _context()
    quotas: List[CpuQuota] = []
    try:
        for r, c in enumerate(rank_cpu or []):  # inside the try: a failed quota removes the ones made before it
            quotas.append(CpuQuota(f"hetcomm-{os.getpid()}-{r}", c))
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_entry, daemon=True,
                                 args=(fn, r, world, tmp, pg_timeout, quotas[r].path if quotas else None, args,
                                       backend, dict(os.environ)))
                     for r in range(world)]
            deadline = time.monotonic() + timeout
            failed = False
            try:
                for p in procs:
                    p.start()
                while time.monotonic() < deadline:
                    codes = [p.exitcode for p in procs]
                    if check and any(c not in (None, 0) for c in codes):
                        failed = True
                        break
                    if all(c is not None for c in codes):
                        break
                    time.sleep(0.05)
            finally:  # also on the way out of an exception here (Ctrl-C: KeyboardInterrupt)
                alive = [r for r, p in enumerate(procs) if p.pid is not None and p.exitcode is None]
                for r in alive:
                    procs[r].kill()
                for p in procs:
                    if p.pid is not None:
                        p.join(5)
            # the ranks killed above are not reported as failures of their own
            errors = [e for r, p in enumerate(procs) if r not in alive and (e := _failure(tmp, r, p.exitcode))]
            if check and (failed or errors):
                stopped = f" (ranks {alive} stopped after the failure)" if alive else ""
                raise RuntimeError("rank(s) failed:\n" + "\n".join(
                    errors + [f"exit codes {[p.exitcode for p in procs]}{stopped}"]))
            if check and alive:
                raise RuntimeError(f"ranks {alive} still running after {timeout}s (hang)")
            return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False)
                    if os.path.exists(os.path.join(tmp, f"result_{r}.pt")) else None for r in range(world)]
    finally:
        for q in quotas:
            q.remove()


def joined() -> bool:
    """Whether this process is a rank of a job started by torchrun or the
    testbed (RANK and WORLD_SIZE set), rather than one that spawns its own."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def run_distributed(fn: Callable, ranks: int, *args, backend: str = "gloo"):
    """Under torchrun or the testbed (RANK / WORLD_SIZE set): join that job
    (env://, gloo or NCCL with LOCAL_RANK's GPU) and run ``fn(rank, world,
    *args)`` here; returns rank 0's result (None on other ranks). Otherwise
    spawn ``ranks`` local ranks and return rank 0's result."""
    if joined():
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, init_method="env://")
        try:
            result = fn(dist.get_rank(), dist.get_world_size(), *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return result if int(os.environ["RANK"]) == 0 else None
    return spawn_ranks(fn, ranks, *args, timeout=3600, backend=backend)[0]
