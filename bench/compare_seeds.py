"""Seed-by-seed comparison of `hetcomm bench train --seeds N --json` files
against PyTorch's PowerSGD (bench/README's 24-seed rows):

    python bench/compare_seeds.py RESULT.json [RESULT.json ...]
    python bench/compare_seeds.py --merge A.json B.json ...   # one report: B's seeds added to A's (--first-seed)

For each task x optimizer in a file, per mode: seeds reached; steps to the first touch and to the stay, summed over
the seeds every mode reached; mean final quality; median ms a step; each
seed's steps. Against torch-powersgd (where the file has it): the seeds with
more / fewer steps and the mean difference (standard error), and the time to
the first touch as the mean (median) of per-seed ratios and as the ratio of
the summed times (bench train's own, `hetcomm.benchmarks.train_results.aggregate`),
the same two for the stay; where fp32 ran in the same invocation (no --reference), each mode's time to the
first touch over fp32's too. Seeds where fp32 itself diverged are left out
(`train_results.ended_diverged` of fp32's run). Per mode also its spikes, over every seed:
"seed@step" at the first evaluation far off the run's best so far
(`train_results.spiked_at`), and "*" where the run ends so. (fp32 taken from a
--reference file ran elsewhere, loopback: its times are that run's, its steps
compare.)"""
import json
import statistics as st
import sys

from hetcomm.benchmarks import train_results as results

BASE = "torch-powersgd"


def load(*paths):
    """{(task, optimizer): {mode: {seed: run}}}: a file may hold several cells, and several files one cell (the
    seeds of a run with --first-seed added to an earlier run's; a seed twice is an error)."""
    out = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        for r in data["runs"]:
            by_seed = out.setdefault((r["task"], r["optimizer"]), {}).setdefault(r["mode"], {})
            if r["seed"] in by_seed:
                raise ValueError(f"{path}: seed {r['seed']} of {r['mode']} on {r['task']} with {r['optimizer']} is "
                                 "in an earlier file too (--merge adds seeds, it does not replace them)")
            by_seed[r["seed"]] = r
    return out


def report(*paths):
    for (task, optim), runs in load(*paths).items():
        report_cell(f"{' + '.join(paths)} ({task}, {optim})", runs)


def report_cell(name, runs):
    # a seed whose fp32 run diverged has no target (every mode "reaches" it at once): left out, as aggregate does
    diverged = sorted(s for s, r in runs.get(results.REFERENCE, {}).items() if results.ended_diverged(r))
    seeds = sorted(set.intersection(*[{s for s, r in by_seed.items() if r["reached"]} for by_seed in runs.values()])
                   - set(diverged))
    print(f"{name}: {len(seeds)} seeds reached by every mode"
          + (f" (fp32 diverged on seeds {', '.join(map(str, diverged))}: left out)" if diverged else ""))
    for mode, by_seed in runs.items():
        first = sum(by_seed[s]["steps_to_target"] for s in seeds)
        stay = sum(by_seed[s]["steps_to_stay"] for s in seeds)
        each = " ".join(str(r["steps_to_target"]) if r["reached"] else "-" for _, r in sorted(by_seed.items()))
        at = {s: results.spiked_at(r) for s, r in sorted(by_seed.items())}
        spikes = [f"{s}@{step}" + ("*" if results.ended_diverged(by_seed[s]) else "")
                  for s, step in at.items() if step is not None]
        print(f"  {mode:16s} reached {sum(r['reached'] for r in by_seed.values()):2d}/{len(by_seed)}  first touch "
              f"{first:5d}  stay {stay:5d}  final {st.mean(r['final'] for r in by_seed.values()):.2f}  step "
              f"{1e3 * st.median(r['s_per_step'] for r in by_seed.values()):.1f} ms  {each}  spiked "
              f"{len(spikes)}{': ' + ' '.join(spikes) if spikes else ''}")
    ref = runs.get(results.REFERENCE, {})
    if seeds and ref and not any(r.get("reference_from") for r in ref.values()):
        # fp32 ran in the same invocation (not taken from a --reference file): its times compare
        for mode, by_seed in runs.items():
            if mode == results.REFERENCE:
                continue
            ratios = [by_seed[s]["time_to_target_s"] / ref[s]["time_to_target_s"] for s in seeds]
            summed = sum(by_seed[s]["time_to_target_s"] for s in seeds) / sum(ref[s]["time_to_target_s"] for s in seeds)
            print(f"  {mode} vs fp32 (run beside it): time to the first touch {st.mean(ratios):.2f}x (median "
                  f"{st.median(ratios):.2f}x, summed {summed:.2f}x)")
    if BASE not in runs or len(seeds) < 2:
        return
    base = runs[BASE]
    means = {m["mode"]: m for m in results.aggregate([r for by_seed in runs.values() for r in by_seed.values()])}
    for mode, by_seed in runs.items():
        if mode == BASE:
            continue
        diffs = [by_seed[s]["steps_to_target"] - base[s]["steps_to_target"] for s in seeds]
        mean = means[mode]  # bench train's own: over the seeds where this mode and PowerSGD reached
        stay_summed = sum(by_seed[s]["time_to_stay_s"] for s in seeds) / sum(base[s]["time_to_stay_s"] for s in seeds)
        print(f"  {mode} vs PowerSGD: more steps on {sum(d > 0 for d in diffs)} seeds, fewer on "
              f"{sum(d < 0 for d in diffs)}, {st.mean(diffs):+.1f} a seed (standard error "
              f"{st.stdev(diffs) / len(diffs) ** 0.5:.1f}); time to the first touch {mean['vs_powersgd']:.2f}x "
              f"(median {st.median(by_seed[s]['vs_powersgd'] for s in seeds):.2f}x, summed "
              f"{mean['summed_vs_powersgd']:.2f}x), to the stay {mean['stay_vs_powersgd']:.2f}x (summed "
              f"{stay_summed:.2f}x)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--merge"]:
        report(*sys.argv[2:])
    else:
        for p in sys.argv[1:]:
            report(p)
