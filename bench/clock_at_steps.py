"""auto's training clock at fixed steps against PowerSGD's, from `hetcomm bench train --json` files that ran both
(`--modes torch-powersgd,auto`): per task x optimizer, the mean over seeds of auto's seconds at steps 40, 100, 200
and 600 (where evaluated) and the mean of the per-seed ratios to PowerSGD's clock at the same step. Where both take
about the same steps, this is what the plans auto ran cost, free of which evaluation first touched the target.

    python bench/clock_at_steps.py FILE [FILE ...]
"""
import statistics
import sys

from compare_seeds import BASE, load  # (bench/ is this script's directory)


def report(path) -> None:
    for (task, optim), runs in load(path).items():
        if "auto" not in runs or BASE not in runs:
            continue
        clock = {mode: {s: {p["step"]: p["time_s"] for p in r["curve"]} for s, r in by_seed.items()}
                 for mode, by_seed in runs.items()}
        cols = []
        for at in (40, 100, 200, 600):
            pairs = [(c[at], clock[BASE][s][at]) for s, c in clock["auto"].items()
                     if at in c and at in clock[BASE].get(s, {})]
            if pairs:
                cols.append(f"step {at}: {statistics.mean(a for a, _ in pairs):.2f} s, "
                            f"{statistics.mean(a / p for a, p in pairs):.2f}x")
        print(f"{path} ({task}, {optim}): " + "; ".join(cols))


if __name__ == "__main__":
    for p in sys.argv[1:]:
        report(p)
