"""auto's training clock at fixed steps against PowerSGD's, from `hetcomm bench train --json` files that ran both
(`--modes torch-powersgd,auto`): per optimizer, the mean over seeds of auto's seconds at steps 40, 100, 200 and 600
(where evaluated) and the mean of the per-seed ratios to PowerSGD's clock at the same step. Where both take about
the same steps, this is what the plans auto ran cost, free of which evaluation first touched the target.

    python bench/clock_at_steps.py FILE [FILE ...]
"""
import json
import statistics
import sys


def main(files) -> None:
    for f in files:
        with open(f) as fh:
            runs = json.load(fh)["runs"]
        clocks = {}
        for r in runs:
            clocks.setdefault((r["optimizer"], r["seed"]), {})[r["mode"]] = {p["step"]: p["time_s"] for p in r["curve"]}
        for opt in sorted({o for o, _ in clocks}):
            cols = []
            for at in (40, 100, 200, 600):
                pairs = [(v["auto"][at], v["torch-powersgd"][at]) for (o, _), v in clocks.items()
                         if o == opt and at in v.get("auto", {}) and at in v.get("torch-powersgd", {})]
                if pairs:
                    cols.append(f"step {at}: {statistics.mean(a for a, _ in pairs):.2f} s, "
                                f"{statistics.mean(a / p for a, p in pairs):.2f}x")
            if cols:
                print(f"{f} ({opt}): " + "; ".join(cols))


if __name__ == "__main__":
    main(sys.argv[1:])
