"""A simulated mixed cluster on one Linux machine: N gloo ranks on 127.0.0.1,
each optionally confined to a CPU quota (cgroup v1 ``cpu.cfs_quota_us`` or v2
``cpu.max``) so ranks really run at different speeds.

:func:`spawn_ranks` is also the multi-process harness of the test suite:
a rank that raises or dies fails the run at once (the others are killed),
nothing waits longer than ``timeout``, and every cgroup it made is removed.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.multiprocessing as mp

_V1 = "/sys/fs/cgroup/cpu"
_V2 = "/sys/fs/cgroup"
_PERIOD_US = 10_000  # a short period: throttling in small slices, not 75 ms stalls


def cpu_quota_support() -> Tuple[bool, str]:
    """(usable, reason): whether this process may create CPU-quota cgroups."""
    if os.geteuid() != 0:
        return False, "CPU quotas need root (cgroup directories are root-owned)"
    if os.path.exists(os.path.join(_V1, "cpu.cfs_quota_us")) and os.access(_V1, os.W_OK):
        return True, "cgroup v1 cpu controller"
    if os.path.exists(os.path.join(_V2, "cgroup.controllers")):
        with open(os.path.join(_V2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split() and os.access(_V2, os.W_OK):
                return True, "cgroup v2 cpu.max"
    return False, "no writable cgroup cpu controller on this machine"


class CpuQuota:
    """One cgroup limited to ``cpus`` cores' worth of time (0.25 = a quarter core)."""

    def __init__(self, name: str, cpus: float) -> None:
        ok, why = cpu_quota_support()
        if not ok:
            raise RuntimeError(f"hetcomm testbed: cannot set CPU quotas: {why}")
        if not cpus > 0:
            raise ValueError(f"rank cpu quota must be > 0, got {cpus}")
        self.v1 = why.startswith("cgroup v1")
        self.path = os.path.join(_V1 if self.v1 else _V2, name)
        os.makedirs(self.path, exist_ok=True)
        quota = max(1000, int(cpus * _PERIOD_US))  # the kernel minimum is 1 ms
        if self.v1:
            self._write("cpu.cfs_period_us", str(_PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
        else:
            self._write("cpu.max", f"{quota} {_PERIOD_US}")

    def _write(self, file: str, value: str) -> None:
        with open(os.path.join(self.path, file), "w") as f:
            f.write(value)

    def add_self(self) -> None:
        self._write("cgroup.procs", str(os.getpid()))

    def remove(self) -> None:
        root = os.path.dirname(self.path)
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:  # anything left goes back to the root group
                try:
                    with open(os.path.join(root, "cgroup.procs"), "w") as f:
                        f.write(pid)
                except OSError:
                    pass
            os.rmdir(self.path)
        except FileNotFoundError:
            pass


def _entry(fn, rank, world, tmp, pg_timeout, cgroup, args):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    try:
        if cgroup:
            with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        store = dist.FileStore(os.path.join(tmp, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(tmp, f"result_{rank}.pt"))
        # Without a barrier before destroy, gloo sometimes aborts at exit.
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"error_{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)


def spawn_ranks(fn: Callable, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0,
                check: bool = True, rank_cpu: Optional[Sequence[float]] = None) -> List:
    """Runs ``fn(rank, world, *args)`` in ``world`` spawned gloo ranks (FileStore
    rendezvous) and returns each rank's result. ``rank_cpu`` confines rank r to
    ``rank_cpu[r]`` cores. With ``check=False`` a failed rank's result is None."""
    if rank_cpu is not None and len(rank_cpu) != world:
        raise ValueError(f"rank_cpu must give one quota per rank ({world}), got {list(rank_cpu)}")
    ctx = mp.get_context("spawn")
    quotas = [CpuQuota(f"hetcomm-{os.getpid()}-{r}", c) for r, c in enumerate(rank_cpu)] if rank_cpu else []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            procs = [ctx.Process(target=_entry, daemon=True,
                                 args=(fn, r, world, tmp, pg_timeout, quotas[r].path if quotas else None, args))
                     for r in range(world)]
            for p in procs:
                p.start()
            deadline = time.monotonic() + timeout
            failed = False
            while time.monotonic() < deadline:
                codes = [p.exitcode for p in procs]
                if check and any(c not in (None, 0) for c in codes):
                    failed = True
                    break
                if all(c is not None for c in codes):
                    break
                time.sleep(0.05)
            alive = [r for r, p in enumerate(procs) if p.exitcode is None]
            for p in procs:
                if p.exitcode is None:
                    p.kill()
            for p in procs:
                p.join(5)
            errors = [f"--- rank {r} ---\n" + open(os.path.join(tmp, f"error_{r}.txt")).read()
                      for r in range(world) if os.path.exists(os.path.join(tmp, f"error_{r}.txt"))]
            if check and (failed or errors):
                raise RuntimeError("rank(s) failed:\n" + "\n".join(errors or [f"exit codes {[p.exitcode for p in procs]}"]))
            if check and alive:
                raise RuntimeError(f"ranks {alive} still running after {timeout}s (hang)")
            return [torch.load(os.path.join(tmp, f"result_{r}.pt"), weights_only=False)
                    if os.path.exists(os.path.join(tmp, f"result_{r}.pt")) else None for r in range(world)]
    finally:
        for q in quotas:
            q.remove()
