"""How often ``auto`` ended on each plan in ``hetcomm bench train`` JSON
files, and the mean step of the runs on each (bench/README "auto's decision:
the prediction stands within the hysteresis, a switch faster in every
cycle"); where lowrank's rounds were measured, how often each was chosen and
the window's medians, pipelined over together, per run (bench/README "lowrank's
rounds: the steps a window counts"):

    python bench/auto_choices.py FILE [FILE ...]
"""
import collections
import json
import statistics
import sys


def choices(path: str) -> dict:
    """{(optimizer, plan): [ms a step of each run that ended on it]}; plan:
    each bucket's mode@algorithm, joined."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = collections.defaultdict(list)
    for r in runs:
        if r.get("auto") is None:
            continue
        plan = ", ".join(f"{b['chosen']['mode']}@{b['chosen']['algorithm']}" for b in r["auto"]["buckets"].values())
        out[(r["optimizer"], plan)].append(1000 * r["s_per_step"])
    return out


def rounds(path: str) -> dict:
    """{optimizer: [(lowrank's rounds chosen, its window's median step
    pipelined over together's, or None where unmeasured)]}, the runs that
    measured them."""
    with open(path) as f:
        runs = json.load(f)["runs"]
    out = collections.defaultdict(list)
    for r in runs:
        lr = r.get("lowrank_rounds")
        if r.get("auto") is None or not lr:
            continue
        m = lr.get("median_s")
        out[r["optimizer"]].append((lr["rounds"], m["pipelined"] / m["together"] if m else None))
    return out


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path)
        for (optim, plan), steps in sorted(choices(path).items()):
            print(f"  {optim:6} {plan:40} {len(steps):3} runs  {statistics.mean(steps):6.2f} ms a step (mean)")
        for optim, chosen in sorted(rounds(path).items()):
            print(f"  {optim:6} lowrank's rounds: pipelined {sum(c == 'pipelined' for c, _ in chosen)} of "
                  f"{len(chosen)}, pipelined / together " + " ".join("-" if r is None else f"{r:.2f}" for _, r in chosen))
