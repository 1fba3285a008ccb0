"""`hetcomm bench ddp --grid`: the same `bench ddp` run in every cell of
{networks} x {model sizes} x {rank counts}, each cell a separate run of this
command (under ``hetcomm testbed`` for a shaped network: 2 nodes, the ranks
split evenly, the given rate on each node's link), and one table of how
``auto`` did against the best fixed choice and PyTorch's PowerSGD measured in
the same cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from . import common

LOOPBACK = "loopback"
# the fixed choices auto competes with (PyTorch's hooks included), and auto
DEFAULT_MODES = ["torch-allreduce", "torch-powersgd", "none", "bf16", "onebit", "topk", "auto"]


def _cell_command(network: str, ranks: int, params: int, modes: List[str], iters: int, warmup: int,
                  global_batch: int, json_path: str, rounds: int = 1) -> List[str]:
    hetcomm = [sys.executable, "-m", "hetcomm.cli"]
    bench = hetcomm + ["bench", "ddp", "--params", str(params), "--modes", ",".join(modes), "--iters", str(iters),
                       "--warmup", str(warmup), "--global-batch", str(global_batch), "--rounds", str(rounds),
                       "--json", json_path]
    if network == LOOPBACK:
        return bench + ["--ranks", str(ranks)]
    return hetcomm + ["testbed", "--nodes", "2", "--ranks-per-node", str(ranks // 2), "--inter-node-rate", network,
                      "--"] + bench


def summarise_cell(rows: List[Dict]) -> Dict:
    """auto's step time against the best fixed mode (every other mode of the
    cell, PyTorch's hooks included) and against torch-powersgd."""
    by = {r["mode"]: r for r in rows}
    fixed = [r for r in rows if r["mode"] != "auto" and not r["mode"].endswith("+bal")]
    best = min(fixed, key=lambda r: r["step_ms"]) if fixed else None
    auto = by.get("auto")
    ps = by.get("torch-powersgd")
    return {"best_mode": best["mode"] if best else None, "best_ms": best["step_ms"] if best else None,
            "auto_ms": auto["step_ms"] if auto else None, "auto_plans": auto["plans"] if auto else None,
            "auto_vs_best": auto["step_ms"] / best["step_ms"] if auto and best else None,
            "auto_vs_powersgd": auto["step_ms"] / ps["step_ms"] if auto and ps else None}


def main(networks: List[str], params: List[int], ranks: List[int], modes: List[str], iters: int, warmup: int,
         global_batch: int, json_path: Optional[str], timeout: float = 3600.0, rounds: int = 1) -> List[Dict]:
    for r in ranks:
        if r < 2 or r % 2:
            raise ValueError(f"--grid-ranks: each rank count must be even and >= 2 (2 nodes), got {r}")
    if any(n != LOOPBACK for n in networks):
        from ..testbed import netns_support

        ok, why = netns_support()
        if not ok:
            print(f"# shaped networks skipped: {why}", file=sys.stderr)
            networks = [n for n in networks if n == LOOPBACK]
    cells: List[Dict] = []
    with tempfile.TemporaryDirectory(prefix="hetcomm-grid-") as tmp:
        for network in networks:
            for p in params:
                for r in ranks:
                    path = os.path.join(tmp, f"{network}-{p}-{r}.json")
                    cmd = _cell_command(network, r, p, modes, iters, warmup, global_batch, path, rounds)
                    print(f"# cell {network} {p:,} params {r} ranks", file=sys.stderr, flush=True)
                    cell = {"network": network, "params": p, "ranks": r}
                    try:
                        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                    except subprocess.TimeoutExpired:
                        cell["error"] = f"timed out after {timeout:.0f} s"
                    else:
                        if done.returncode != 0 or not os.path.exists(path):
                            cell["error"] = f"exit {done.returncode}: {done.stderr.strip()[-400:]}"
                        else:
                            with open(path) as f:
                                res = json.load(f)
                            cell.update(rows=res["rows"], **summarise_cell(res["rows"]))
                    cells.append(cell)
                    common.write_json(json_path, {"partial": True, "cells": cells})
    print(f"# hetcomm bench ddp --grid: auto against the best fixed mode and torch-powersgd, measured in the "
          f"same cell (median step ms, {iters} timed steps x {rounds} round(s))")
    cols = [("network", "network", "s"), ("params", "params", ",d"), ("ranks", "ranks", "d"),
            ("best_mode", "best fixed", "s"), ("best_ms", "ms", ".1f"), ("auto_ms", "auto ms", ".1f"),
            ("auto_vs_best", "auto/best", ".2f"), ("auto_vs_powersgd", "auto/PowerSGD", ".2f"),
            ("auto_plans", "auto's plans", "s")]
    table = [{k: c.get(k) if c.get(k) is not None else "-" for k, _, _ in cols} for c in cells]
    common.print_table(table, [(k, h, f if all(isinstance(t[k], (int, float)) for t in table) else "s")
                               for k, h, f in cols])
    for c in cells:
        if "error" in c:
            print(f"# {c['network']} {c['params']:,} {c['ranks']}: {c['error']}")
    common.write_json(json_path, {"cells": cells, "modes": modes, "iters": iters, "warmup": warmup, "rounds": rounds,
                                  "global_batch": global_batch},
                      common.metadata(max(ranks), units={"best_ms": "milliseconds", "auto_ms": "milliseconds"}))
    return cells
