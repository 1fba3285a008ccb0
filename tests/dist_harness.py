"""A small multi-process harness: spawn N gloo ranks on 127.0.0.1 (FileStore
rendezvous), run fn(rank, world, *args) in each, return the per-rank results.
A rank that raises or dies fails the test at once (the others are killed);
nothing waits longer than `timeout` seconds."""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp


def _entry(fn, rank, world, tmp, pg_timeout, args):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    try:
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


def run_ranks(fn, world: int, *args, timeout: float = 180.0, pg_timeout: float = 60.0, check: bool = True):
    """Returns [result of rank 0, ..., rank world-1]. With check=False, a rank
    that exits abnormally yields an Exception-free None result (see exitcodes)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, tmp, pg_timeout, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        failed = None
        while time.monotonic() < deadline:
            codes = [p.exitcode for p in procs]
            if check and any(c not in (None, 0) for c in codes):
                failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
                break
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
        alive = [p for p in procs if p.exitcode is None]
        for p in alive:
            p.kill()
        for p in procs:
            p.join(5)
        errors = []
        for r in range(world):
            path = os.path.join(tmp, f"error_{r}.txt")
            if os.path.exists(path):
                errors.append(f"--- rank {r} ---\n" + open(path).read())
        if check and (failed or errors):
            raise AssertionError("rank(s) failed:\n" + "\n".join(errors or [f"exit codes {[p.exitcode for p in procs]}"]))
        if alive and check:
            raise AssertionError(f"ranks {[procs.index(p) for p in alive]} still running after {timeout}s (hang)")
        results = []
        for r in range(world):
            path = os.path.join(tmp, f"result_{r}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results
