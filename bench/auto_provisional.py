"""auto with its first trial made to choose lowrank, so that lowrank runs
provisionally (at ``lowrank_guard.PROVISIONAL_RANK``, or the rank given) from
the trial's decision to the guard's first reading (steps 20-30), then at rank
4 where the reading admits it, or what the trial measured without it where it
refuses; against fp32 (bench/README "auto's lowrank at rank 16 until its
reading", "The wide model with SGD-m over 24 seeds"). Run once per rank:

    torchrun --nproc-per-node 2 bench/auto_provisional.py OUT.json                      (the LM, 2 seeds, both optimizers)
    torchrun --nproc-per-node 4 bench/auto_provisional.py OUT.json wide sgd 24 4 REF.json (rank 4 until the reading;
                                                                                         fp32's runs from REF.json)
"""
import json
import sys

from hetcomm import autoplan, lowrank_guard
from hetcomm.benchmarks import train

INF = float("inf")
_judged = autoplan.AutoPlanner._judged


def lowrank_first(self, times):
    """Round times as auto's decisions weigh them, but a round with the
    guarded lowrank that every rank measured and the guard allows counts as
    0 s: lowrank is taken at the first trial's decision and kept by the
    re-checks while the guard allows it."""
    return [0.0 if t < INF and any(self._guarded(c[0]) for c in self._round_candidates(i)) else t
            for i, t in enumerate(_judged(self, times))]


if __name__ == "__main__":
    out_path, task, optims, seeds, provisional, reference = (sys.argv[1:] + [None] * 6)[:6]
    autoplan.AutoPlanner._judged = lowrank_first
    if provisional:
        lowrank_guard.PROVISIONAL_RANK = int(provisional)
    runs = train.run(2, [task or "lm"], (optims or "sgd,adamw").split(","), ["fp32", "auto"] if not reference
                     else ["auto"], seeds=int(seeds or 2), reference=reference)
    if runs:  # rank 0
        out = [{k: r.get(k) for k in ("optimizer", "mode", "seed", "final", "target", "reached", "steps_to_target",
                                      "steps_to_stay")} |
               {"guard": (r.get("auto") or {}).get("lowrank_guard"), "provisional": lowrank_guard.PROVISIONAL_RANK,
                "plans": [(c["step"], c.get("plans")) for c in r["curve"] if c["step"] <= 60]} for r in runs]
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1)
        for r in out:
            print(r["optimizer"], r["seed"], r["mode"], round(r["final"], 4), r["steps_to_target"],
                  r["guard"] and r["guard"]["state"], [p for _, p in r["plans"][:2]])
