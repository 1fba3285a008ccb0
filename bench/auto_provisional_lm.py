"""auto on the language model with its first trial made to choose lowrank, so
that lowrank runs provisionally at rank 16 from the trial's decision to the
guard's first reading (steps 20-30, which refuses rank 4 there), then what
the trial measured without it; against fp32, 2 seeds x SGD-momentum / AdamW
(bench/README "auto's lowrank at rank 16 until its reading"):

    torchrun --nproc-per-node 2 bench/auto_provisional_lm.py results/auto_provisional16_lm_loopback.json
"""
import json
import sys

from hetcomm import autoplan
from hetcomm.benchmarks import train

INF = float("inf")
_choose = autoplan.choose


def lowrank_first(times, current=None, hysteresis=autoplan.AUTO_HYSTERESIS):
    """The guarded lowrank's round is the trial's last: taken wherever every rank measured it."""
    return len(times[0]) - 1 if all(r[-1] < INF for r in times) else _choose(times, current, hysteresis)


if __name__ == "__main__":
    autoplan.choose = lowrank_first
    runs = train.run(2, ["lm"], ["sgd", "adamw"], ["fp32", "auto"], seeds=2)
    if runs:  # rank 0
        out = [{k: r.get(k) for k in ("optimizer", "mode", "seed", "final", "target", "reached", "steps_to_target")} |
               {"guard": (r.get("auto") or {}).get("lowrank_guard"),
                "plans": [(c["step"], c.get("plans")) for c in r["curve"] if c["step"] <= 60]} for r in runs]
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
        for r in out:
            print(r["optimizer"], r["seed"], r["mode"], round(r["final"], 4), r["guard"] and r["guard"]["state"],
                  [p for _, p in r["plans"][:2]])
