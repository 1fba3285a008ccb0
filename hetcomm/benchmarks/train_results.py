"""What `hetcomm bench train`'s runs say, once they have run: each run's
target (fp32's final quality on its seed), whether and when it reached it,
its time against fp32's and PyTorch PowerSGD's (:func:`summarise`), the means
over seeds (:func:`aggregate`, leaving out the seeds where fp32 itself
diverged, :func:`ended_diverged`), and fp32's runs taken from an earlier run's
JSON (:func:`load_reference`)."""

from __future__ import annotations

import json
import math
from typing import Dict, List, Optional

import torch

from .tasks import TASKS

REFERENCE = "fp32"


def spiked_at(run: Dict) -> Optional[int]:
    """The step of the run's first evaluation far off its best so far
    (:meth:`Task.diverged` of the curve up to it: perplexity or MSE over 1.5x
    its lowest so far, accuracy 10 points under its best so far, or not
    finite), whether or not the run came back; None where there is none."""
    task = TASKS[run["task"]]
    values = [p[task.metric] for p in run["curve"]]
    return next((p["step"] for i, p in enumerate(run["curve"]) if task.diverged(values[:i + 1])), None)


def summarise(runs: List[Dict]) -> List[Dict]:
    """Adds to each run: target (fp32's final quality), reached (the final
    quality is within the task's tolerance of it), steps / time to the first
    evaluation within it, steps / time to the evaluation from which every one
    stays within it (``steps_to_stay``: a run that touches the target on one
    lucky evaluation and falls back, as one on digits' 359 test images can,
    has not yet stayed), ``spiked_at`` (:func:`spiked_at`), and the time
    ratios against fp32 and torch-powersgd (``vs_*`` by the first touch,
    ``stay_vs_*`` by the stay)."""
    ref = {(r["task"], r["optimizer"], r["seed"]): r for r in runs if r["mode"] == REFERENCE}
    for r in runs:
        task = TASKS[r["task"]]
        base = ref[(r["task"], r["optimizer"], r["seed"])]
        r["target"] = base["final"]
        r["fp32_diverged"] = ended_diverged(base)
        r["spiked_at"] = spiked_at(r)
        within = [r["finite"] and task.reached(p[task.metric], r["target"]) for p in r["curve"]]
        hit = next((p for p, ok in zip(r["curve"], within) if ok), None)
        if not within[-1]:
            hit = None  # touched the target and fell back: not reached
        stay = None
        if hit is not None:  # the first evaluation after the last one outside the tolerance
            stay = r["curve"][max((i + 1 for i, ok in enumerate(within) if not ok), default=0)]
        r["reached"] = hit is not None
        r["steps_to_target"] = hit["step"] if hit else None
        r["time_to_target_s"] = hit["time_s"] if hit else None
        r["steps_to_stay"] = stay["step"] if stay else None
        r["time_to_stay_s"] = stay["time_s"] if stay else None
    for r in runs:
        for other, key in ((REFERENCE, "vs_fp32"), ("torch-powersgd", "vs_powersgd")):
            o = next((x for x in runs if (x["task"], x["optimizer"], x["mode"], x["seed"]) ==
                      (r["task"], r["optimizer"], other, r["seed"])), None)
            both = o is not None and r["reached"] and o["reached"]
            r[key] = r["time_to_target_s"] / o["time_to_target_s"] if both and o["time_to_target_s"] else None
            r["stay_" + key] = r["time_to_stay_s"] / o["time_to_stay_s"] if both and o["time_to_stay_s"] else None
    return runs


def ended_diverged(run: Dict) -> bool:
    """Whether ``run`` ended far off its own best (Task.diverged of its
    curve); where fp32's run did, its final quality is no target."""
    task = TASKS[run["task"]]
    return task.diverged([p[task.metric] for p in run["curve"]])


def aggregate(runs: List[Dict]) -> List[Dict]:
    """Per task, optimizer and mode over its seeds (those where fp32's own run
    did not diverge, :func:`ended_diverged`: against its blown-up final every
    mode "reaches" at once; their count is ``fp32_diverged_seeds``): the mean and spread of the
    final quality, fp32's mean, whether the mean is within the task's tolerance
    of fp32's mean, in how many seeds the run reached its own seed's target
    and in how many it spiked (:func:`spiked_at`), the mean time to target
    over the seeds that reached it, and the mean of the per-seed ratios to
    PowerSGD's time (over the seeds where both reached; with their count), by
    the first touch of the target and by the stay; also
    the ratio of the summed times over those seeds (first touch), which one
    seed's luck moves less than the mean of ratios."""
    out = []
    powersgd = {(r["task"], r["optimizer"], r["seed"]): r for r in runs if r["mode"] == "torch-powersgd"}
    keys = list(dict.fromkeys((r["task"], r["optimizer"], r["mode"]) for r in runs))
    diverged = {(r["task"], r["optimizer"], r["seed"]) for r in runs if r["mode"] == REFERENCE and ended_diverged(r)}
    for task_name, optim, mode in keys:
        cell = [r for r in runs if (r["task"], r["optimizer"]) == (task_name, optim)
                and (task_name, optim, r["seed"]) not in diverged]
        group = [r for r in cell if r["mode"] == mode]
        ref = [r["final"] for r in cell if r["mode"] == REFERENCE]
        left_out = len({r["seed"] for r in runs if (r["task"], r["optimizer"], r["mode"]) == (task_name, optim, mode)
                        and (task_name, optim, r["seed"]) in diverged})
        if not group:
            out.append({"task": task_name, "optimizer": optim, "mode": mode, "seeds": 0,
                        "fp32_diverged_seeds": left_out, "final_mean": None, "final_std": None, "fp32_mean": None,
                        "reached_mean": False, "reached_seeds": 0, "spiked_seeds": 0, "time_to_target_s": None,
                        "vs_powersgd": None, "vs_powersgd_seeds": 0, "stay_vs_powersgd": None,
                        "summed_vs_powersgd": None, "s_per_step": None})
            continue
        finals = torch.tensor([r["final"] for r in group], dtype=torch.float64)
        times = [r["time_to_target_s"] for r in group if r["reached"]]
        ratios = [r["vs_powersgd"] for r in group if r.get("vs_powersgd") is not None]
        stayed = [r["stay_vs_powersgd"] for r in group if r.get("stay_vs_powersgd") is not None]
        pairs = [(r["time_to_target_s"], powersgd[(task_name, optim, r["seed"])]["time_to_target_s"])
                 for r in group if r.get("vs_powersgd") is not None]
        mean, ref_mean = finals.mean().item(), sum(ref) / len(ref)
        out.append({"task": task_name, "optimizer": optim, "mode": mode, "seeds": len(group),
                    "fp32_diverged_seeds": left_out,
                    "final_mean": mean, "final_std": finals.std().item() if len(group) > 1 else 0.0,
                    "fp32_mean": ref_mean, "reached_mean": bool(math.isfinite(mean) and
                                                                TASKS[task_name].reached(mean, ref_mean)),
                    "reached_seeds": sum(r["reached"] for r in group),
                    "spiked_seeds": sum(spiked_at(r) is not None for r in group),
                    "time_to_target_s": sum(times) / len(times) if times else None,
                    "vs_powersgd": sum(ratios) / len(ratios) if ratios else None, "vs_powersgd_seeds": len(ratios),
                    "stay_vs_powersgd": sum(stayed) / len(stayed) if stayed else None,
                    "summed_vs_powersgd": sum(a for a, _ in pairs) / sum(b for _, b in pairs) if pairs else None,
                    "s_per_step": sum(r["s_per_step"] for r in group) / len(group)})
    return out


#: what a reference run of fp32 (``--reference``) must share with the runs it stands in for
REFERENCE_KEYS = ("task", "optimizer", "seed", "steps", "lr", "schedule", "device", "world_size", "clip")
#: the values of keys that runs written before them leave out
_REFERENCE_DEFAULTS = {"schedule": "constant", "device": "cpu", "clip": None}


def _reference_key(r: Dict, k: str):
    v = r.get(k, _REFERENCE_DEFAULTS.get(k))
    if k == "clip" and v is not None:  # PyTorch's hook clips by the handed norm; the count is the run's own
        return v["max_norm"]
    return v


def load_reference(path: str, wanted: List[Dict], bucket_mb: Optional[float] = None) -> List[Dict]:
    """fp32's runs from an earlier ``bench train --json`` at ``path``, one for
    each of ``wanted`` (dicts of REFERENCE_KEYS and ``evals``, the evaluated
    steps), with DDP's buckets as ``bucket_mb`` makes them (they order the
    sums); ValueError naming the first one the file lacks. fp32's runs are
    deterministic and do not depend on the link's speed, so a target measured
    once serves runs of other modes on any link; its times are that run's."""
    try:
        with open(path) as f:
            data = json.load(f)
        have = [r for r in data["runs"] if r["mode"] == REFERENCE]
        theirs = data.get("meta", {}).get("bucket_mb")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"--reference {path}: not a bench train JSON with runs ({e})") from None
    if theirs != bucket_mb:
        raise ValueError(f"--reference {path} ran with --bucket-mb {theirs}, this run with {bucket_mb}: DDP's "
                         "buckets order fp32's sums, so its runs would not be this run's")
    out = []
    for w in wanted:
        match = next((r for r in have if all(_reference_key(r, k) == w[k] for k in REFERENCE_KEYS)
                      and [p["step"] for p in r["curve"]] == w["evals"]), None)
        if match is None:
            said = ", ".join(f"{k} {w[k]}" for k in REFERENCE_KEYS)
            raise ValueError(f"--reference {path} has no fp32 run with {said} and evaluations at steps "
                             f"{w['evals'][0]}, {w['evals'][1] if len(w['evals']) > 1 else ''}... "
                             f"(run it once with the same --tasks/--optims/--seeds/--scale/--lr-scale/--schedule/"
                             f"--eval-every/--clip-grad-norm/--device)")
        out.append({**match, "reference_from": path})
    return out
