"""compression="auto": per-bucket candidates from the cost model, verified by
measurement, agreed by every rank; plan changes keep error feedback whole."""

import functools
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import autoplan, autotrial, lowrank_guard, lowrank_share, plan, topology
from hetcomm import planner as planner_mod

from . import models
from .dist_harness import run_ranks
from .test_ddp import _train_span
from .test_lowrank import LAYOUT, N, _q_state

INF = float("inf")


def test_choose_takes_the_fastest_slowest_rank_whatever_each_rank_measured():
    # rank 1 is noisy: its view alone would pick candidate 0, rank 0's candidate 2
    times = [[3.0, 2.0, 1.0], [0.5, 2.1, 4.0]]
    assert autoplan.choose(times) == 1
    assert autoplan.choose(list(reversed(times))) == 1  # the order of ranks does not matter
    # ties go to the better predicted (earlier) candidate; unmeasured never wins
    assert autoplan.choose([[1.0, 1.0, INF]]) == 0
    assert autoplan.choose([[INF, 2.0]]) == 1


def test_choose_with_a_current_plan_switches_only_past_the_hysteresis():
    times = [[1.0, 0.95]]
    assert autoplan.choose(times) == 1
    assert autoplan.choose(times, current=0) == 0            # 5 % faster: noise, keep
    assert autoplan.choose([[1.0, 0.5]], current=0) == 1     # twice as fast: switch


def _decided(times, guarded=False, rechecking=False, admitted=False, cycles=None):
    """The round a planner's decision takes from ``times`` (seconds per rank
    and round; the candidates in order of prediction, the rounds too): int3
    across nodes, int3 flat, fp32; ``guarded``: the guarded lowrank offered,
    predicted fastest (its round first), ``admitted`` by its reading.
    ``cycles``: each rank's seconds per round and cycle (by default each
    cycle's the round's time)."""
    from types import SimpleNamespace

    auto = plan.Planner(SimpleNamespace(_rank_given=None, iter=0)).auto
    auto.modes = ("none", "int3")
    cands = [("int3", "hierarchical", 1.0), ("int3", "native", 2.8), ("none", "native", 12.0)]
    if guarded:
        auto.offer_guarded()
        if admitted:
            auto.guard.update(0.99, 30)
        cands = [("lowrank", "hierarchical", 0.5)] + cands
    auto.candidates = {"k": cands}
    auto._order = {"k": list(range(len(cands)))}
    auto._rechecking = rechecking
    if rechecking:
        auto.decided = {"k": 0}
    if cycles is None:
        cycles = [[[t] * autoplan.AUTO_REPEATS for t in r] for r in times]

    auto._gather_round_times = lambda engine, head=(): (torch.tensor([head] * len(times)), times, cycles)
    auto._decide(None)
    return auto.decided["k"]


def test_a_first_decision_keeps_the_best_predicted_round_within_the_hysteresis():
    """A first trial runs in the run's first, noisiest steps, and what it
    takes within the hysteresis sticks at every re-check: it keeps the best
    predicted round (round 0) unless another is 1 / AUTO_HYSTERESIS times
    faster, by the slowest rank, as a re-check keeps the running plan."""
    h = autoplan.AUTO_HYSTERESIS
    assert _decided([[1.0, 0.95, 5.0], [0.9, 0.9, 5.0]]) == 0            # 5 % faster: the prediction stands
    assert _decided([[1.0, h - 0.01, 5.0], [0.9, 0.5, 5.0]]) == 1         # past the hysteresis: measured wins
    assert _decided([[INF, 0.95, 5.0]]) == 1                              # round 0 unmeasured: the fastest
    assert _decided([[1.0, 0.95, 5.0]], rechecking=True) == 0            # a re-check: as before
    # the guarded lowrank predicted fastest leads the rounds; the default is the first round without it, and
    # lowrank wins by its own margin alone, not the hysteresis too
    p = autoplan.PROVISIONAL_MARGIN
    assert _decided([[p - 0.02, 1.0, 1.0, 5.0]], guarded=True) == 0
    assert _decided([[p + 0.02, 1.0, 0.95, 5.0]], guarded=True) == 1     # not by its margin: int3 across nodes
    assert _decided([[p + 0.02, 1.0, 0.8, 5.0]], guarded=True) == 2      # int3 flat past the hysteresis
    m = autoplan.LOWRANK_MARGIN
    assert _decided([[m + 0.02, 1.0, 0.95, 5.0]], guarded=True, admitted=True) == 1


def test_a_round_replaces_the_default_only_if_faster_in_every_cycle():
    """Past the hysteresis by its best step, a round replaces the running plan
    (a re-check) or the best predicted one (a first trial) only where it was
    faster in every cycle that ran both, by the slowest rank: the rounds take
    turns, so a cycle's steps met the same load, and one fast step is noise."""
    times = [[1.0, 0.8, 5.0], [0.9, 0.7, 5.0]]
    steady = [[[1.0, 1.1, 1.05], [0.8, 0.85, 0.9], [5.0] * 3], [[0.9, 1.0, 1.0], [0.7, 0.8, 0.85], [5.0] * 3]]
    noisy = [[[1.0, 1.1, 1.05], [0.8, 1.2, 1.1], [5.0] * 3], [[0.9, 1.0, 1.0], [0.7, 0.8, 0.85], [5.0] * 3]]
    for rechecking in (False, True):
        assert _decided(times, rechecking=rechecking, cycles=steady) == 1
        # cycle 2: round 1's slowest rank took 1.2 s against round 0's 1.1
        assert _decided(times, rechecking=rechecking, cycles=noisy) == 0
    assert autotrial.faster_in_every_cycle(noisy, 1, 0) is False
    assert autotrial.faster_in_every_cycle(noisy, 0, 1) is False  # nor the other way: no order
    assert autotrial.faster_in_every_cycle(steady, 1, 0) is True
    # a cycle that lacks either round does not count; with none left nothing speaks against it
    cut = [[[1.0, 1.1, INF], [0.8, 0.9, 2.0], [5.0, INF, INF]]]
    assert autotrial.faster_in_every_cycle(cut, 1, 0) is True
    assert autotrial.faster_in_every_cycle(cut, 2, 0) is False
    assert autotrial.faster_in_every_cycle([[[INF] * 3, [0.5, INF, INF]]], 1, 0) is True


def test_safe_modes_follow_the_optimizer():
    assert autoplan.safe_modes(None, True) == ("none", "bf16", "fp8", "int3")  # the gradient, with error feedback
    assert autoplan.safe_modes("adam", False) == ("none", "fp16")  # torch's Adam attached: dense only
    assert autoplan.safe_modes("sgd", True) == ("none", "bf16", "fp8")  # onebit missed the regression, top-k the LM
    assert autoplan.safe_modes("hetcomm-adamw", True) == ("none", "bf16")  # onebit of Adam's momentum missed digits
    # with attach_optimizer(total_steps=): the first fifth a warm-up, then 1-bit of the momentum reached digits too
    assert autoplan.safe_modes("sgd", True, warmed_up=True) == ("none", "bf16", "fp8", "onebit")
    assert autoplan.safe_modes("hetcomm-adamw", False, warmed_up=True) == ("none", "fp16", "onebit")
    assert autoplan.safe_modes("adam", True, warmed_up=True) == ("none", "bf16")
    assert autoplan.safe_modes(None, True, warmed_up=True) == ("none", "bf16", "fp8", "int3")


def _rank_predict(first, hopeless=None, fp32_order=None):
    """A cost model that ranks ``first`` best (the real one for the rest, a
    microsecond later; ``hopeless``: a wire predicted to take 10 s). It
    wraps the real model, also where a run before it in this process rigged it.
    ``fp32_order``: fp32's algorithms ranked in this order on every bucket,
    the rest after them, each at about the real model's time for native (its
    ranking follows the probe's measured links and the bucket's size, so
    under load two buckets may rank them apart)."""
    real = getattr(plan.planner.predict, "real", plan.planner.predict)

    def predict(topo, nbytes, algorithm, wire="none"):
        t, kind = real(topo, nbytes, algorithm, wire), plan.planner.Wire.of(wire).kind
        if t is not None and fp32_order and kind == "none" and kind != first:
            at = fp32_order.index(algorithm) if algorithm in fp32_order else len(fp32_order)
            return real(topo, nbytes, "native", wire) * (1.0 + 1e-3 * at) + 1e-6
        return None if t is None else 0.0 if kind == first else 10.0 + t if kind == hopeless else t + 1e-6
    predict.real = real
    return predict


def _auto_run(rank, world, steps, candidates, first, topk_ratio, big, attach, cache_dir, two_nodes=False,
              batch=8, guard=None, cut=True, ckpt=None, hopeless=None, static_graph=False, given_rank=None,
              device="cpu", fp32_order=None):
    """``guard``: settings of :mod:`hetcomm.lowrank_share` (FIRST and FIRST_SPAN
    of lowrank's first share window, every step read; no later window unless
    LATER is set), auto's modes fp32 and the guarded lowrank, which is the
    fastest round whenever a choice may take it. ``cut``: False, every trial
    round runs AUTO_REPEATS steps, whatever the first cycle measured.
    ``batch``: samples a rank, or a list of them per step. ``ckpt``:
    (folder, first step, step to save after): a run resumed from the
    folder's checkpoint when its first step is not 0, saving one there.
    ``static_graph``: DDP's (its buckets rebuilt in step 2's forward, not
    step 1's). ``given_rank``: HookState's ``matrix_approximation_rank``.
    ``device``: "cuda" puts the model, the batches and so the buckets on this
    rank's GPU. ``fp32_order``: :func:`_rank_predict`'s."""
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    if guard:
        for k, v in {"EVERY": 1, "LATER": 10_000, **guard}.items():  # the windows' constants or the guard's bars
            setattr(lowrank_guard if hasattr(lowrank_guard, k) else lowrank_share, k, v)
        autoplan.safe_modes = lambda *a, **k: ("none",)
        cut = False  # steps 1-9
        real = autotrial.choose

        def choose(times, current=None, hysteresis=autoplan.AUTO_HYSTERESIS):  # lowrank's round is the last
            return len(times[0]) - 1 if all(r[-1] < INF for r in times) else real(times, current, hysteresis)
        autotrial.choose = choose if not hasattr(real, "forced") else real
        choose.forced = True
    if two_nodes:
        os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    if first:
        plan.planner.predict = _rank_predict(first, hopeless, fp32_order)
    if not cut:  # no rule leaves a round out (fp32's own, AUTO_LINK_SPAN, against a fast round under load; nor one
        autotrial.AUTO_SPAN = autotrial.AUTO_LINK_SPAN = INF  # no faster than the kept round in the first cycle)
        autotrial.AUTO_DROP_SLOWER = False
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)) if big \
        else models.mlp(hidden=96)
    dev = models.rank_device(rank, device)
    ddp = models.ddp(model, rank, device, bucket_cap_mb=25 if big else 0.02, static_graph=static_graph)
    state = hetcomm.HookState("auto", candidates=candidates, topk_ratio=topk_ratio, min_compress_numel=0,
                              matrix_approximation_rank=given_rank)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    if attach:  # True, the run's total_steps (a warm-up of a fifth of them), or attach_optimizer's keywords
        state.attach_optimizer(opt, **(attach if isinstance(attach, dict) else {} if attach is True
                                       else {"total_steps": attach}))
    folder, start, save_at = ckpt or (None, 0, -1)
    path = folder and os.path.join(folder, f"rank{rank}.pt")
    if start:
        ck = torch.load(path, weights_only=True)  # a HookState's state is tensors and containers: torch's safe loader
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hetcomm"])
    probe = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    gap = []  # sum over steps of (exact mean gradient - what the hook delivered)
    total = None
    wires, layouts, ranks = [], [], []
    for step in range(start, steps):
        n = batch[step] if isinstance(batch, list) else batch
        x = torch.randn(n, 1024 if big else models.IN, generator=torch.Generator().manual_seed(step * 31 + rank)).to(dev)
        y = torch.randint(0, 10, (n,), generator=torch.Generator().manual_seed(step)).to(dev)
        # the exact mean gradient, from a plain copy of the model and the default group
        for q, p in zip(probe, model.parameters()):
            q.data.copy_(p.detach())
        out = torch.func.functional_call(model, dict(zip([n for n, _ in model.named_parameters()], probe)), (x,))
        exact = torch.autograd.grad(torch.nn.functional.cross_entropy(out, y), probe)
        exact = torch.cat([g.reshape(-1) for g in exact])
        torch.distributed.all_reduce(exact)
        exact /= world
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        diff = (exact.cpu() - models.flat_grads(model)).double()
        total = diff if total is None else total + diff
        gap.append(float(total.abs().max()))
        wires.append(sorted({p.mode for p in state.last_plans.values()}))
        layouts.append(sorted(state.last_plans))
        ranks.append(sorted({state._buckets.layouts[k][0] for k, p in state.last_plans.items() if p.mode == "lowrank"}))
        opt.step()
        if step + 1 == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hetcomm": state.state_dict()}, path)
    stats = state.stats()
    return {"params": models.flat_params(model), "plans": stats["plans"], "auto": stats["auto"], "gap": gap,
            "scale": float(models.flat_grads(model).abs().max()), "wires": wires, "layouts": layouts, "ranks": ranks,
            "share": stats.get("lowrank_share"), "saved_guard": state.state_dict()["auto"].get("guard"),
            "rounds": stats["lowrank_rounds"], "rounds_counted": {k: len(v) for k, v in state._rounds.times.items()},
            "rounds_start": state._rounds.start}


def test_auto_agrees_on_every_rank_and_keeps_replicas_identical(tmp_path):
    res = run_ranks(_auto_run, 4, 18, None, None, 0.01, False, True, str(tmp_path))
    r0 = res[0]
    assert r0["auto"]["modes"] == ["none", "bf16", "fp8"]  # SGD-momentum attached
    assert r0["rounds"] == {"state": "chosen", "rounds": "pipelined", "median_s": None}  # no lowrank: nothing to hold
    assert all(p["why"] == "measured" for p in r0["plans"].values()) and len(r0["plans"]) > 1
    for r in res[1:]:
        assert torch.equal(r["params"], r0["params"])
        assert {k: (p["mode"], p["algorithm"]) for k, p in r["plans"].items()} == \
            {k: (p["mode"], p["algorithm"]) for k, p in r0["plans"].items()}
    for b in r0["auto"]["buckets"].values():
        cands = [(c["mode"], c["algorithm"]) for c in b["candidates"]]
        # every candidate measured, but a round the first cycle left out as hopeless (its predicted communication
        # over 2x the first round's step: the probe's reading of loopback moves 10x with the machine's load), which
        # is pruned
        assert ("none", "native") in cands and b["chosen"] and all(c["comm_s"] or c["pruned"] for c in b["candidates"])


@pytest.mark.parametrize("batch, given_rank", [(8, None), (1, None), (8, 4)])
def test_auto_keeps_lowrank_only_where_the_ranks_read_its_rank_carries_their_gradient(tmp_path, batch, given_rank):
    # fp32 and lowrank (rank 4) for auto; its first trial (steps 1-9) measures lowrank fastest, and from step 10
    # lowrank runs provisionally at rank 16 until the ranks' shares of gradient energy in the top 4 singular
    # values, read in steps 12-14, admit rank 4 at step 15. One sample a rank: every weight gradient is of rank 1
    # (share 1): admitted. Eight (0.90 here; FIRST_DROP set to 0.95, and WAIT over 1: the top 8 singular values
    # carry all of an 8-sample gradient): refused, and fp32 pays what lowrank's error
    # feedback owed. With the rank given
    # (matrix_approximation_rank=4), nothing runs provisionally: fp32 until the reading, paying what the trial's
    # lowrank round (step 9) owed.
    res = run_ranks(_auto_run, 2, 18, None, None, 0.01, False, False, str(tmp_path), False, batch,
                    {"FIRST": 12, "FIRST_SPAN": 2, "FIRST_DROP": 0.95, "WAIT": 1.01}, True, None, None, False,
                    given_rank)
    r0, r1 = res
    assert r0["auto"]["modes"] == ["none", "lowrank"]
    guard = r0["auto"]["lowrank_guard"]
    assert guard == r1["auto"]["lowrank_guard"] == r0["saved_guard"] and guard["step"] == 14
    assert guard["changed_at"] == [14, guard["share"]]
    assert guard["share"] == pytest.approx(min(r0["share"]["share"], r1["share"]["share"]), abs=1e-8)
    assert r0["share"]["readings"] == 3 and r0["share"]["rank"] == 4
    assert batch == 1 or r0["share"]["share"] != r1["share"]["share"]
    tol = 1e-4 * r0["scale"] * 18
    if given_rank is None:
        assert r0["wires"][9:15] == [["lowrank"]] * 6 and r0["ranks"][9:15] == [[16]] * 6, r0["wires"]
        last_owed = 14
    else:
        assert r0["wires"][9] == ["lowrank"] and r0["ranks"][9] == [4], r0["wires"]
        assert all(w == ["none"] for w in r0["wires"][10:15]), r0["wires"]
        last_owed = 9
    if batch == 1:
        assert guard["state"] == "admitted" and guard["share"] > 0.999
        assert all(w == ["lowrank"] for w in r0["wires"][15:]) and r0["ranks"][15:] == [[4]] * 3, r0["wires"]
        assert r0["auto"]["lowrank_rank"] == 4
    else:
        assert guard["state"] == "refused" and guard["share"] < lowrank_guard.DROP
        assert all(w == ["none"] for w in r0["wires"][last_owed + 1:]), r0["wires"]
        for r in res:
            paid = max(r["gap"][last_owed + 1:])
            assert paid < tol and r["gap"][last_owed] > 100 * paid, r["gap"]  # owed, then paid
    assert torch.equal(r0["params"], r1["params"])


@pytest.mark.parametrize("second", ["admits", "refuses"])
@pytest.mark.parametrize("first_drop", [0.0, 0.95])
def test_a_reading_between_the_bars_leaves_lowrank_to_the_next_window_at_rank_8_where_that_carries_it(tmp_path, second,
                                                                                                      first_drop):
    # eight samples a rank in the first window (steps 12-14), its reading between the bars (FIRST_DROP 0), or under
    # FIRST_DROP (0.95: 0.90 at rank 4) where the top 8 singular values carry the gradient (all of it, 8 samples;
    # WAIT 0.965): the provisional lowrank (rank 16, from the trial's decision at step 10) goes on until the second
    # window (steps 20-22), at rank 8 from step 15: the top 8 singular values carried ADMIT or more. One sample a rank
    # there reads 1: rank 4 admitted at step 23. Eight again: a second reading between the bars refuses it, and fp32
    # runs from step 23, paying what lowrank's error feedback (at rank 8) owed
    batch = [8] * 20 + [1 if second == "admits" else 8] * 6
    res = run_ranks(_auto_run, 2, 26, None, None, 0.01, False, False, str(tmp_path), False, batch,
                    {"FIRST": 12, "FIRST_SPAN": 2, "LATER": 20, "SPAN": 2, "FIRST_DROP": first_drop})
    r0, r1 = res
    guard = r0["auto"]["lowrank_guard"]
    assert guard == r1["auto"]["lowrank_guard"] == r0["saved_guard"]
    assert guard["changed_at"] == [22, guard["share"]]
    assert guard["first"][0] == 14 and (first_drop == 0.0 or guard["first"][1] < first_drop)
    assert guard["share8"] == pytest.approx(1.0, abs=1e-6)  # the ranks' lowest at rank 8, of the last window
    assert r0["wires"][10:23] == [["lowrank"]] * 13, r0["wires"]
    assert r0["ranks"][10:23] == [[16]] * 5 + [[8]] * 8, r0["ranks"]
    if second == "admits":
        assert guard["state"] == "admitted" and guard["share"] > 0.999
        assert all(w == ["lowrank"] for w in r0["wires"][23:]) and r0["ranks"][23:] == [[4]] * 3, r0["wires"]
    else:
        assert guard["state"] == "refused" and guard["share"] < lowrank_guard.ADMIT
        assert all(w == ["none"] for w in r0["wires"][23:]), r0["wires"]
        tol = 1e-4 * r0["scale"] * 26
        for r in res:
            paid = max(r["gap"][23:])
            assert paid < tol and r["gap"][22] > 100 * paid, r["gap"]  # owed, then paid
    assert torch.equal(r0["params"], r1["params"])


def test_a_refused_lowrank_is_taken_back_by_a_later_reading_at_the_bar_and_measured_again(tmp_path, device):
    # eight samples a rank in the first window (steps 12-14): refused at step 15 (FIRST_DROP 0.95, WAIT over 1
    # here: the top 8 singular values carry all of an 8-sample gradient), fp32 from
    # there. A refused guard reads on: one sample a rank in the next window (steps 20-22) reads 1, so lowrank is
    # taken back at step 23 (a long learning-rate warm-up reads low at first: bench/README "A refused lowrank reads
    # again"). The trials since the refusal left it out, so a re-check of lowrank starts there: the current plan
    # (fp32) and lowrank in turns, three steps each (23-28; not the other fp32 candidate: the trial before measured
    # it), lowrank chosen at 29, at rank 4 (not provisionally at 16). On CUDA buckets too: the guard reads its ladder
    # (ranks 8 and 4) on the GPU
    batch = [8] * 20 + [1] * 16
    res = run_ranks(_auto_run, 2, 36, None, None, 0.01, False, False, str(tmp_path), False, batch,
                    {"FIRST": 12, "FIRST_SPAN": 2, "LATER": 20, "SPAN": 2, "FIRST_DROP": 0.95, "WAIT": 1.01},
                    True, None, None, False, None, device.type)
    r0, r1 = res
    guard = r0["auto"]["lowrank_guard"]
    assert guard == r1["auto"]["lowrank_guard"] == r0["saved_guard"]
    assert guard["state"] == "admitted" and guard["readmitted"] == 1 and guard["share"] > 0.999
    assert guard["changed_at"] == [22, guard["share"]] and guard["first"][0] == 14
    assert guard["first"][1] < 0.95
    assert r0["wires"][10:15] == [["lowrank"]] * 5 and r0["ranks"][10:15] == [[16]] * 5, r0["wires"]
    assert all(w == ["none"] for w in r0["wires"][15:23]), r0["wires"]
    assert r0["wires"][23:29] == [["none"], ["lowrank"]] * 3 and r0["ranks"][24] == [4], r0["wires"]
    assert r0["wires"][29:] == [["lowrank"]] * 7 and r0["ranks"][29:] == [[4]] * 7, r0["wires"]
    assert r0["auto"]["rechecks"] == 1 and r0["auto"]["lowrank_rank"] == 4
    tol = 1e-4 * r0["scale"] * 36
    for r in res:  # what the provisional lowrank owed at its refusal was paid while fp32 ran
        assert max(r["gap"][15:23]) < tol and r["gap"][14] > 100 * max(r["gap"][15:23]), r["gap"]
    assert torch.equal(r0["params"], r1["params"])


def test_an_admitted_guard_leaves_the_early_windows_unread_and_reads_from_later_on(tmp_path):
    # one sample a rank: admitted at step 15 by the first window (12-14). The early window 20-22 (EARLY 8) holds
    # eight-sample steps, which read 0.90 at rank 4, under DROP: read, they would drop lowrank at step 23. An
    # admitted guard leaves that window unread (its readings cost a spectrum on every rank) and reads the later
    # window 30-32 (LATER 30), one sample a rank again: still admitted, never dropped, lowrank at rank 4 throughout
    batch = [1] * 20 + [8] * 3 + [1] * 11
    res = run_ranks(_auto_run, 2, 34, None, None, 0.01, False, False, str(tmp_path), False, batch,
                    {"FIRST": 12, "FIRST_SPAN": 2, "EARLY": 8, "LATER": 30, "SPAN": 2})
    r0, r1 = res
    guard = r0["auto"]["lowrank_guard"]
    assert guard == r1["auto"]["lowrank_guard"] == r0["saved_guard"]
    assert guard["state"] == "admitted" and guard["changed_at"][0] == 14 and guard["readmitted"] == 0
    assert guard["step"] == 32 and guard["share"] > 0.999  # the later window's reading, not the early one's
    assert r0["share"]["step"] == 32 and r0["share"]["readings"] == 3
    assert r0["wires"][15:] == [["lowrank"]] * 19 and r0["ranks"][15:] == [[4]] * 19, r0["wires"]
    assert torch.equal(r0["params"], r1["params"])


def test_auto_measures_lowrank_rounds_on_the_steps_that_ran_lowrank(tmp_path):
    # one sample a rank: lowrank runs from the trial's decision (step 10), provisionally at rank 16, then at rank 4
    # admitted at step 15; steps 11-30 hold its buckets for the step's last one or pipeline them in turns (A B B A,
    # from step 11), each counted but the guard's reading steps 12 and 13 (together) and 14 (pipelined), and at step
    # 31 the ranks agree on the rounds. With eight samples a rank lowrank is refused at step 15 (its reading under
    # FIRST_DROP, set to 0.95, WAIT over 1): of steps 11-14 step 11 counted, fp32's steps after them not, so together
    # has no time and the rounds stay pipelined, unmeasured
    for batch, counted in ((1, {"pipelined": 9, "together": 8}), (8, {"pipelined": 1, "together": 0})):
        res = run_ranks(_auto_run, 2, 34, None, None, 0.01, False, False, str(tmp_path), False, batch,
                        {"FIRST": 12, "FIRST_SPAN": 2, "FIRST_DROP": 0.95, "WAIT": 1.01})
        r0, r1 = res
        assert r0["rounds_counted"] == r1["rounds_counted"] == counted
        assert r0["rounds"]["state"] == "chosen" and r0["rounds"] == r1["rounds"]
        if batch == 1:
            assert r0["rounds"]["rounds"] in ("pipelined", "together") and set(r0["rounds"]["median_s"]) == \
                {"pipelined", "together"}
        else:
            assert r0["rounds"] == {"state": "chosen", "rounds": "pipelined", "median_s": None}
        assert all(w == (["lowrank"] if batch == 1 else ["none"]) for w in r0["wires"][15:]), r0["wires"]
        assert torch.equal(r0["params"], r1["params"])


def test_auto_measures_lowrank_rounds_once_lowrank_runs_after_the_first_window(tmp_path):
    # lowrank refused at its first reading (step 9, eight samples a rank) runs in no step of 11-30, so that window
    # decides pipelined unmeasured; one sample a rank from step 30: a later window takes lowrank back (step 39), a
    # re-check measures it (steps 45-50, in turns with fp32) and chooses it, and the step after its first step of
    # lowrank alone opens another window (A B B A, 20 steps): the fp32 steps inside it not counted, the ranks agree
    steps = 72
    res = run_ranks(_auto_run, 2, steps, None, None, 0.01, False, False, str(tmp_path), False,
                    [8] * 30 + [1] * (steps - 30),
                    {"FIRST": 8, "FIRST_SPAN": 1, "FIRST_DROP": 0.95, "WAIT": 1.01, "LATER": 40, "SPAN": 2})
    r0, r1 = res
    assert r0["auto"]["lowrank_guard"]["readmitted"] == 1
    alone = [s for s, w in enumerate(r0["wires"]) if w == ["lowrank"]]
    assert not any(11 <= s + 1 <= 30 for s in alone) and alone[-1] == steps - 1  # (wires[s]: step s + 1)
    counted = r0["rounds_counted"]
    assert counted == r1["rounds_counted"] and counted["pipelined"] > 2 and counted["together"] > 2, counted
    # counted: the window's steps of lowrank alone whose step before ran it too; the re-check's lowrank steps
    # after its fp32 steps pay for the switch and are not (bench/README "lowrank's rounds, fixed for a run; a
    # re-check's steps after a switch")
    # (wires[s] holds the plans of the hook's step s, the numbering of the window's start)
    window = range(r0["rounds_start"], r0["rounds_start"] + 20)
    steady = [t for t in window if t in alone and t - 1 in alone]
    assert sum(counted.values()) == len(steady) < len([t for t in window if t in alone]), (counted, alone)
    assert r0["rounds"]["state"] == "chosen" and r0["rounds"] == r1["rounds"]
    assert set(r0["rounds"]["median_s"]) == {"pipelined", "together"}
    assert torch.equal(r0["params"], r1["params"])


def _resume_inside_a_window(rank, world, cache_dir, ckpt_dir, save_at):
    # the big model: its 1024 x 1024 matrix is read by the randomized range finder (lowrank_share's generator)
    args = (rank, world, 22, None, None, 0.01, True, False, cache_dir, False, 8,
            {"FIRST": 12, "FIRST_SPAN": 4, "ADMIT": 0.5, "DROP": 0.0})
    whole = _auto_run(*args)
    _auto_run(*args, ckpt=(ckpt_dir, 0, save_at))
    return whole, _auto_run(*args, ckpt=(ckpt_dir, save_at, -1))


@pytest.mark.parametrize("save_at", [4, 14, 17])
def test_auto_resumed_inside_its_trial_or_its_guards_window_goes_on_bit_for_bit(tmp_path, save_at):
    # the trial's three rounds (fp32 on two algorithms, lowrank) take turns in steps 1-9; the guard's window reads
    # steps 12-16, and at step 17 the ranks agree that it admits lowrank. A run saved after step 3 (inside the
    # trial), 13 (inside the window) or 16 (the window closed, not yet agreed on) and resumed must go on as the
    # whole run: the trial's rounds, the window's readings (and the random stream that estimates them), the
    # trial's times that pick the round once lowrank is admitted.
    for whole, resumed in run_ranks(_resume_inside_a_window, 2, str(tmp_path), str(tmp_path), save_at):
        assert whole["saved_guard"]["state"] == "admitted" and whole["saved_guard"]["changed_at"][0] == 16
        assert resumed["wires"] == whole["wires"][save_at:], (resumed["wires"], whole["wires"])
        assert resumed["saved_guard"] == whole["saved_guard"] and resumed["share"] == whole["share"]
        assert torch.equal(resumed["params"], whole["params"])


def _resume_while_waiting(rank, world, cache_dir, ckpt_dir):
    # the between-the-bars run (first reading at step 14, rank 8 from step 15; one sample a rank from step 20: rank 4
    # admitted at step 23), saved after step 17 and resumed there
    args = (rank, world, 26, None, None, 0.01, False, False, cache_dir, False, [8] * 20 + [1] * 6,
            {"FIRST": 12, "FIRST_SPAN": 2, "LATER": 20, "SPAN": 2, "FIRST_DROP": 0.0})
    whole = _auto_run(*args)
    _auto_run(*args, ckpt=(ckpt_dir, 0, 18))
    return whole, _auto_run(*args, ckpt=(ckpt_dir, 18, -1))


def test_auto_resumed_while_its_guard_waits_at_rank_8_goes_on_bit_for_bit(tmp_path):
    # saved while lowrank runs at rank 8 between two readings: the resumed run runs rank 8 (the guard's waits_at,
    # each matrix's Q of 8 columns), then rank 4 from step 23, as the whole run
    for whole, resumed in run_ranks(_resume_while_waiting, 2, str(tmp_path), str(tmp_path)):
        assert whole["ranks"][15:23] == [[8]] * 8 and whole["ranks"][23:] == [[4]] * 3, whole["ranks"]
        assert resumed["ranks"] == whole["ranks"][18:] and resumed["wires"] == whole["wires"][18:]
        assert resumed["saved_guard"] == whole["saved_guard"] and whole["saved_guard"]["state"] == "admitted"
        assert torch.equal(resumed["params"], whole["params"])


def _resume_with_other_candidates(rank, world, cache_dir, ckpt_dir, save_at):
    saved = _auto_run(rank, world, save_at, None, None, 0.01, False, False, cache_dir, ckpt=(ckpt_dir, 0, save_at))
    resumed = _auto_run(rank, world, save_at + 20, ("none", "topk"), None, 0.01, False, False, cache_dir,
                        ckpt=(ckpt_dir, save_at, -1))
    return saved, resumed


@pytest.mark.parametrize("save_at", [4, 20])
def test_auto_resumed_with_other_candidates_keeps_its_choice_or_runs_its_trial_again(tmp_path, save_at):
    # saved with auto's default candidates (fp32, bf16, fp8, lowrank guarded), resumed with fp32 and top-k: the
    # saved rounds name other candidates, so a trial starts at once with these (top-k runs in it): inside the
    # first trial (step 4) that trial again, after the decision (step 20) a re-check whose first round is each
    # bucket's kept choice
    res = run_ranks(_resume_with_other_candidates, 2, str(tmp_path), str(tmp_path), save_at)
    (saved, resumed), (_, other) = res
    assert torch.equal(resumed["params"], other["params"])
    assert ["topk"] in resumed["wires"][:6] and all(p["why"] == "measured" for p in resumed["plans"].values())
    modes = {c["mode"] for b in resumed["auto"]["buckets"].values() for c in b["candidates"]}
    if save_at == 4:
        assert modes <= {"none", "topk"}, modes
    else:
        kept = saved["wires"][-1]
        assert resumed["wires"][0] == kept and "topk" not in kept and set(kept) <= modes
        assert resumed["auto"]["rechecks"] == 1  # one, whatever the number of buckets


def test_the_guard_admits_lowrank_drops_it_under_its_lower_bar_and_takes_it_back_at_the_upper():
    g = lowrank_guard.Guard()
    assert g.update(lowrank_guard.ADMIT, 40) and g.state == "admitted"
    assert not g.update(lowrank_guard.DROP, 120) and g.state == "admitted"  # between the bars: kept
    assert g.update(lowrank_guard.DROP - 1e-3, 220) and g.state == "refused" and not g.runs()
    assert not g.update(lowrank_guard.ADMIT - 1e-3, 420) and g.state == "refused"  # between the bars: stays out
    assert g.changed_at == [220, lowrank_guard.DROP - 1e-3] and g.readmitted == 0
    assert g.update(lowrank_guard.ADMIT, 820) and g.state == "admitted" and g.runs()  # taken back at ADMIT ...
    assert not g.provisional and g.readmitted == 1 and g.changed_at == [820, lowrank_guard.ADMIT]
    assert g.update(lowrank_guard.DROP - 1e-3, 1620) and g.state == "refused"  # ... and dropped again under DROP
    assert g.update(1.0 - 1e-3, 3220, 1.0) and g.state == "admitted" and g.readmitted == 2
    h = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)
    assert h.update(lowrank_guard.FIRST_DROP - 1e-3, 40) and h.state == "refused" and not h.provisional
    # refused at its first reading (a long learning-rate warm-up reads low at first): a later window at ADMIT takes
    # it back, at its rank (no longer provisionally)
    assert not h.update(lowrank_guard.FIRST_DROP, 60) and h.state == "refused"
    assert h.update(lowrank_guard.ADMIT, 90) and h.state == "admitted" and not h.provisional and h.readmitted == 1
    # under FIRST_DROP where the top WAIT_RANK singular values carry WAIT or more (a long warm-up's first windows on
    # the wide model; the language model reads under it): it waits at its provisional rank, as between the bars, or
    # at WAIT_RANK where they carry ADMIT or more (what admits rank 4)
    for share8, at in ((lowrank_guard.ADMIT, lowrank_guard.WAIT_RANK), (lowrank_guard.ADMIT - 1e-3, 16),
                       (lowrank_guard.WAIT, 16), (lowrank_guard.WAIT - 1e-3, None), (None, None)):
        waits = at is not None
        w = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)
        assert w.rank_now == lowrank_guard.PROVISIONAL_RANK == 16  # before any reading
        assert w.update(lowrank_guard.FIRST_DROP - 1e-3, 30, share8) is not waits and w.share8 == share8
        assert w.provisional is waits and w.state == ("pending" if waits else "refused")
        assert w.rank_now == (at or 16) and w.waits_at == (8 if at == 8 else None)
        if waits:  # ... and the next windows decide as they would between the bars, each setting the rank
            r = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)  # a checkpoint while it waits
            r.load_state_dict(w.state_dict())
            assert r.rank_now == at and r.state_dict() == w.state_dict()
            assert not w.update(lowrank_guard.FIRST_DROP - 0.1, 60, lowrank_guard.WAIT) and w.provisional
            assert w.rank_now == 16
            assert not w.update(lowrank_guard.FIRST_DROP, 90, 1.0) and w.rank_now == lowrank_guard.WAIT_RANK
            assert w.update(lowrank_guard.FIRST_DROP - 0.1, 100, lowrank_guard.WAIT - 1e-3) and w.state == "refused"
            assert w.waits_at is None
            x = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)
            x.update(lowrank_guard.FIRST_DROP - 1e-3, 30, share8)
            assert x.update(lowrank_guard.ADMIT - 1e-3, 120, 1.0) and x.state == "refused"  # the deadline's bar
    given = lowrank_guard.Guard()  # matrix_approximation_rank given: it waits without running lowrank at any rank
    assert not given.update(lowrank_guard.FIRST_DROP - 1e-3, 30, 1.0) and given.rank_now is None
    assert given.state == "pending" and not given.provisional
    # from FIRST_DROP up to ADMIT (under DROP too: a first window inside a learning-rate warm-up), the first reading
    # decides nothing, lowrank going on provisionally; the second decides at ADMIT
    for first in (lowrank_guard.ADMIT - 1e-3, lowrank_guard.DROP - 1e-3, lowrank_guard.FIRST_DROP):
        for second, state in ((lowrank_guard.ADMIT, "admitted"), (lowrank_guard.ADMIT - 1e-3, "refused")):
            p = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)
            assert not p.update(first, 40) and p.state == "pending" and p.provisional
            assert p.changed_at is None and p.share == first
            q = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)  # a checkpoint between the readings
            q.load_state_dict(p.state_dict())
            assert q.update(second, 120) and q.state == state and q.changed_at == [120, second]
            assert not q.provisional and q.runs() is (state == "admitted")
    # the windows before the deadline's (steps 50-60, 80-90) admit at ADMIT and refuse under FIRST_DROP only; the
    # deadline's (100-120) refuses under ADMIT
    assert lowrank_share.deadline() == 120
    for later, state in (([0.95, lowrank_guard.ADMIT], "admitted"), ([lowrank_guard.FIRST_DROP - 1e-3], "refused"),
                         ([lowrank_guard.FIRST_DROP, lowrank_guard.ADMIT - 1e-3, lowrank_guard.ADMIT - 1e-3],
                          "refused")):
        p = lowrank_guard.Guard(lowrank_guard.PROVISIONAL_RANK)
        for share, step in zip([0.95] + later, [30, 60, 90, 120]):
            decided = p.update(share, step)
            assert decided is (p.state != "pending") and p.provisional is (p.state == "pending")
        assert p.state == state and p.changed_at == [step, share]
    k = lowrank_guard.Guard()
    k.load_state_dict(g.state_dict())
    assert k.state_dict() == {"state": "admitted", "share": 1.0 - 1e-3, "step": 3220,
                              "changed_at": [3220, 1.0 - 1e-3], "first": [40, lowrank_guard.ADMIT], "readmitted": 2,
                              "share8": 1.0, "waits_at": None}


@pytest.mark.parametrize("warmup", ["none", None])
def test_auto_with_the_warm_up_offers_onebit_after_a_fifth_of_the_run(tmp_path, warmup):
    # total_steps 40: steps 0-7 warm up (exact, or from step 2 fp8: the default), then auto's trial (onebit
    # predicted first) and its choice
    attach = {"total_steps": 40, **({} if warmup is None else {"warmup_compression": warmup})}
    res = run_ranks(_auto_run, 2, 30, None, "onebit", 0.01, False, attach, str(tmp_path))
    r0 = res[0]
    assert r0["auto"]["modes"] == ["none", "bf16", "fp8", "onebit"]
    assert max(r0["gap"][:2]) <= 1e-6 * r0["scale"]  # steps 0 and 1 deliver the exact mean gradient
    if warmup == "none":
        assert max(r0["gap"][2:8]) <= 1e-6 * r0["scale"]
    else:  # fp8 with error feedback: off by what the residuals hold (a few % of a gradient: 3-8 % here), not more
        assert 1e-6 * r0["scale"] < max(r0["gap"][2:8]) <= 0.15 * r0["scale"], r0["gap"][:8]
    assert any(c["mode"] == "onebit" for b in r0["auto"]["buckets"].values() for c in b["candidates"])
    assert torch.equal(res[1]["params"], r0["params"])


def test_a_slow_candidate_predicted_first_is_dropped_after_measuring(tmp_path):
    # top-k of every entry (ratio 1): all-gathers 8 bytes per element from every
    # rank after a full sort, far slower than fp32's all-reduce, but the (rigged)
    # cost model ranks it first, and fp32's ring second (the real model's choice on 2 ranks, one exchange, but
    # it reads the probe's links, which a loaded machine can measure otherwise)
    res = run_ranks(functools.partial(_auto_run, fp32_order=("ring",)), 2, 13, ("none", "topk"), "topk", 1.0, True,
                    False, str(tmp_path))
    for r in res:
        (b,) = r["auto"]["buckets"].values()
        # fp32 both ways: the predicted best dense algorithm and native
        assert [(c["mode"], c["algorithm"]) for c in b["candidates"]] == \
            [("topk", "native"), ("none", "ring"), ("none", "native")]
        assert b["chosen"]["mode"] == "none", b
        assert all(p["mode"] == "none" for p in r["plans"].values())
        # measured over AUTO_SPAN x fp32's step in the trial's first cycle, top-k runs no more (was 3 steps)
        assert [w for w in r["wires"]].count(["topk"]) == 1, (r["wires"], r["auto"]["round_step_s"])


def test_the_first_trial_leaves_out_rounds_whose_predicted_communication_cannot_win(tmp_path):
    # the cost model (rigged) ranks bf16 first and predicts fp32 at 10 s a bucket: after the first round (bf16,
    # step 1; a few ms) the ranks agree that no fp32 round can be faster, so the trial runs bf16 alone (steps 1-3);
    # fp32 is pruned from the next re-check. With the real cost model every candidate runs
    # (test_auto_agrees_on_every_rank_and_keeps_replicas_identical).
    # Saved after step 2 (inside the trial, the rounds left out agreed) and resumed: the same wires and parameters.
    res = run_ranks(_skipping_and_resumed, 2, str(tmp_path), str(tmp_path))
    for whole, resumed in res:
        assert whole["wires"][:1] == [["none"]] and whole["wires"][1:] == [["bf16"]] * 7, whole["wires"]
        for b in whole["auto"]["buckets"].values():
            assert b["chosen"]["mode"] == "bf16"
            assert all(c["pruned"] == (c["mode"] == "none") for c in b["candidates"]), b["candidates"]
        times = whole["auto"]["round_step_s"]
        assert times[0] < 1.0 and len(times) > 1 and all(t == float("inf") for t in times[1:]), times
        assert resumed["wires"] == whole["wires"][3:] and torch.equal(resumed["params"], whole["params"])
    assert torch.equal(res[0][0]["params"], res[1][0]["params"])


def _skipping_and_resumed(rank, world, cache_dir, ckpt_dir):
    args = (rank, world, 8, ("none", "bf16"), "bf16", 0.01, False, False, cache_dir, False, 8, None, True)
    whole = _auto_run(*args, hopeless="none")
    _auto_run(*args, ckpt=(ckpt_dir, 0, 3), hopeless="none")
    return whole, _auto_run(*args, ckpt=(ckpt_dir, 3, -1), hopeless="none")


def _plain_and_static(rank, world, cache_dir):
    args = (rank, world, 10, ("none", "bf16"), "bf16", 0.01, False, False, cache_dir, False, 8, None, True)
    return [_auto_run(*args, hopeless="none", static_graph=static) for static in (False, True)]


def test_the_first_trial_runs_from_step_1_and_again_in_buckets_rebuilt_after_it(tmp_path):
    # DDP rebuilds its buckets in step 1's forward: the trial (bf16, the rigged cost model's first; fp32 left out)
    # runs from step 1 in the final buckets. With static_graph=True the rebuild comes in step 2's: the trial begun
    # in step 1's buckets starts again, and auto plans the rebuilt buckets alone (nothing kept for the old one)
    for plain, static in run_ranks(_plain_and_static, 2, str(tmp_path)):
        for r in (plain, static):
            assert r["wires"][0] == ["none"] and r["wires"][1:] == [["bf16"]] * 9, r["wires"]
            assert sorted(r["auto"]["buckets"]) == r["layouts"][-1], (sorted(r["auto"]["buckets"]), r["layouts"])
            assert all(b["chosen"]["mode"] == "bf16" for b in r["auto"]["buckets"].values())
        assert plain["layouts"][1] == plain["layouts"][-1] and len(plain["layouts"][-1]) > 1
        assert static["layouts"][1] != static["layouts"][2] == static["layouts"][-1]
        assert torch.equal(plain["params"], static["params"])  # bf16 and fp32 steps alike, whatever the buckets


@pytest.mark.parametrize("world,two_nodes", [(2, False), (4, True)])
def test_a_plan_change_delivers_the_error_feedback_it_owed(tmp_path, world, two_nodes):
    # Trial rounds in turn (the cost model rigged to rank onebit first): onebit
    # flat, [onebit hierarchical on two nodes,] fp32, from step 1 on. At each
    # switch the old plan's residuals (worker and server, flat or per node
    # shard) are folded into the next reduction, so once fp32 runs the sum of
    # delivered gradients equals the sum of exact ones.
    # fp32's algorithms ranked alike on every bucket (by the real model, the probe's links and each bucket's size
    # ranked them apart once under load: a round then ran fp32 on one bucket and onebit on the other)
    steps = 1 + 3 * 4
    res = run_ranks(functools.partial(_auto_run, fp32_order=("hierarchical", "ring")), world, steps,
                    ("none", "onebit"), "onebit", 0.01, False, False, str(tmp_path), two_nodes, 8, None, False)
    fp32 = [("none", "hierarchical" if two_nodes else "ring"), ("none", "native")]
    for b in res[0]["auto"]["buckets"].values():
        cands = [(c["mode"], c["algorithm"]) for c in b["candidates"]]
        assert cands == [("onebit", "native"), ("onebit", "hierarchical")][:2 if two_nodes else 1] + fp32, cands
    # rounds in turn from step 1, AUTO_REPEATS = 3 cycles: fp32 on every bucket in each cycle's last two rounds
    exact = [s for s in range(1, 1 + 3 * len(cands)) if (s - 1) % len(cands) >= len(cands) - 2]
    assert [res[0]["wires"][s] for s in exact] == [["none"]] * 6, res[0]["wires"]
    for r in res:
        assert r["wires"] == res[0]["wires"]
        tol = 1e-4 * r["scale"] * steps
        assert r["gap"][0] < 1e-6                      # the first step: exact
        assert r["gap"][1] > 100 * tol                 # onebit owes something
        assert max(r["gap"][s] for s in exact) < tol, (r["gap"], r["wires"])  # paid back at each switch to fp32
    for r in res[1:]:
        assert torch.equal(r["params"], res[0]["params"])


def _carry_or_residual(rank, world, codec, pipeline):
    """One reduction of a bucket whose earlier plan owes ``c``, two ways: the
    carry handed to the engine (joining x as c times the divisor), and the
    carry taken into the worker residual (BucketStates._carry_into_residual).
    Each rank's x, residual r and carry c differ."""
    import torch.distributed as dist

    from hetcomm import _C

    layout, n = torch.tensor(LAYOUT), N
    g = torch.Generator().manual_seed(rank)
    x, r, c = torch.randn(n, generator=g), 0.05 * torch.randn(n, generator=g), 0.1 * torch.randn(n, generator=g)
    out = []
    for residual, carry in ((r.clone(), c.clone()), (r + c, None)):
        engine = _C.Engine(dist.group.WORLD, torch.device("cpu"))
        buf = x.clone()
        lowrank = codec == "lowrank"
        q = _q_state(LAYOUT) if lowrank else None
        size = 0 if lowrank else _C.server_residual_numel(n, world, rank)
        server = torch.zeros(size) if size else None
        engine.submit_bucket(0, buf, getattr(_C.Codec, codec), 32, 0.01, True, residual, server, True,
                             layout=layout if lowrank else None, q_state=q, carry=carry, pipeline=pipeline).wait()
        engine.close()
        out.append((buf, residual, carry))
    return out


@pytest.mark.parametrize("codec,world,pipeline", [("lowrank", 2, True), ("lowrank", 3, False), ("int3", 2, False),
                                                  ("int3", 3, False), ("fp8", 3, False), ("onebit", 2, False)])
def test_a_carry_taken_into_the_worker_residual_reduces_as_the_carry_did(codec, world, pipeline):
    # BucketStates hands lowrank (flat or across nodes) and flat onebit / fp8 / int3 no carry: it joins their worker
    # residual, whose units are the carry's (each encodes x / divisor + residual; the carry joins x times the
    # divisor). Reduced either way, the sum and the new residual are the same, up to float32's rounding of a sum
    for (buf, res, carry), (buf2, res2, _) in run_ranks(_carry_or_residual, world, codec, pipeline):
        assert torch.equal(carry, torch.zeros_like(carry))  # the engine added the carry and cleared it
        torch.testing.assert_close(buf2, buf, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(res2, res, rtol=1e-5, atol=1e-6)


def test_a_switch_between_whole_bucket_residuals_keeps_the_residual_and_hands_no_carry():
    # int3 flat -> lowrank: the owed residual is the whole bucket's; it becomes the carry and the carry lowrank's
    # residual, the same tensor (no pass over the bucket). int3 across nodes -> lowrank: the shard's residual lands
    # at its offset in the new residual, zeros elsewhere. lowrank -> int3 across nodes: a shard-sized residual
    # cannot hold it, so the carry goes to the engine as before
    from hetcomm import buckets

    numel, key, node_of = 1000, "0,1", [0, 0, 1, 1]
    bs = buckets.BucketStates()

    def plan_of(mode, algorithm):
        return plan.BucketPlan(mode=mode, algorithm=algorithm, why="trial")

    def state(mode, algorithm):
        return bs.state_for(plan_of(mode, algorithm), key, numel, torch.device("cpu"), error_feedback=True, world=4,
                            rank=1, node_of=node_of)

    r, _, carry = state("int3", "native")
    assert carry is None and r.numel() == numel
    r.copy_(torch.arange(numel, dtype=torch.float32))
    lr, _, carry = state("lowrank", "native")
    assert carry is None and lr is r and torch.equal(lr, torch.arange(numel, dtype=torch.float32))
    shard, _, carry = state("int3", "hierarchical")
    assert carry is not None and torch.equal(carry, torch.arange(numel, dtype=torch.float32))  # lowrank's, owed
    assert shard.numel() < numel
    carry.zero_()  # the engine added it to the reduction and cleared it
    shard.fill_(1.0)
    bs.begin_step(0)
    lr, _, carry = state("lowrank", "hierarchical")
    off = hetcomm._C.state_offsets(numel, 4, 1, node_of, True)[0]
    want = torch.zeros(numel)
    want[off:off + shard.numel()] = 1.0
    assert carry is None and torch.equal(lr, want)


def test_a_bucket_back_on_lowrank_after_other_plans_goes_on_from_its_q():
    # lowrank's Q is the power iteration's warm start (the same on every rank), not a debt: a switch to int3 (a
    # trial's next round, a re-check's) and back finds it as lowrank's last step left it, also after steps on the
    # other plan; back at another rank (auto's lowrank after its first reading) it keeps its first columns
    from types import SimpleNamespace

    from hetcomm import buckets

    buf = torch.zeros(64 * 32 + 32)
    bucket = SimpleNamespace(buffer=buf, grads=[buf[:64 * 32].view(64, 32), buf[64 * 32:]])
    key = "0,1"
    bs = buckets.BucketStates()

    def step(mode, rank=None):
        bs.begin_step(0)
        bs.state_for(plan.BucketPlan(mode=mode, algorithm="native", why="trial"), key, buf.numel(),
                     torch.device("cpu"), error_feedback=True, world=2, rank=0, node_of=[0, 1])
        q = bs.lowrank_q_state(key, bs.lowrank_parts(bucket, key, rank)) if mode == "lowrank" else None
        bs.end_step()
        return q

    left = torch.randn(32 * 8)
    step("lowrank", 8).copy_(left)  # as a step leaves Q (cols x rank, row-major)
    for _ in range(3):
        step("int3")
    assert torch.equal(step("lowrank", 8), left)
    step("int3")
    q4, first = step("lowrank", 4).view(32, 4), left.view(32, 8)[:, :4]
    torch.testing.assert_close(q4.T @ q4, torch.eye(4), atol=1e-5, rtol=0)  # orthonormal, as every step's Q
    torch.testing.assert_close(q4 @ (q4.T @ first), first, atol=1e-5, rtol=0)  # ... spanning the first 4 columns


def _forced(rank, world, cache_dir):
    os.environ["HETCOMM_ALGO"] = "ring"
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hetcomm.HookState("auto", min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    state.attach_optimizer(opt)
    for step in range(16):
        models.train_step(ddp, opt, rank, step, 8)
    return state.stats()["auto"]


def test_hetcomm_algo_still_forces_the_algorithm_under_auto(tmp_path):
    res = run_ranks(_forced, 2, str(tmp_path))
    for b in res[0]["buckets"].values():
        for c in b["candidates"]:
            assert c["algorithm"] == ("ring" if c["mode"] in ("none", "bf16") else "native") or \
                (c["mode"], c["algorithm"]) == ("none", "native")


def _run_then_resume(rank, world, ckpt_dir, opt_name, choices_only):
    """24 steps saving at 20 (after the trial: without an attached optimizer
    it has 5 rounds, lowrank's included, in steps 1-15), then a fresh DDP
    model and HookState resumed from that checkpoint for the last 4 (as a
    restarted job builds them). ``choices_only``: the checkpoint as an
    earlier hetcomm saved it, auto's choices without its candidates."""
    whole = _train_span(rank, world, ckpt_dir, 0, 24, 20, "small", "auto", opt_name)
    if choices_only:
        path = os.path.join(ckpt_dir, f"rank{rank}.pt")
        ck = torch.load(path, weights_only=False)
        for k in ("candidates", "order", "round_times"):
            del ck["hetcomm"]["auto"][k]
        torch.save(ck, path)
    return whole, _train_span(rank, world, ckpt_dir, 20, 24, -1, "small", "auto", opt_name)


@pytest.mark.parametrize("opt_name,choices_only", [("sgd-attach", False), ("sgd", False), ("sgd", True)])
def test_auto_resumes_its_decisions_bit_for_bit(tmp_path, opt_name, choices_only):
    # Also when every bucket was decided dense and no tensor state was saved:
    # the decisions are per bucket, so the first resumed step still regroups.
    for a, b in run_ranks(_run_then_resume, 2, str(tmp_path), opt_name, choices_only):
        assert torch.equal(a["params"], b["params"]) and b["plans"] == a["plans"]


def _held_carry_run(rank, world, cache_dir, last_trial):
    # Rank 0's gradient is exactly zero from step 1 on, so its top-k residual
    # (and the carry folded from it when the bucket switches to fp32) is zero;
    # rank 1's is not. Rank 1's gradients are NaN from the last trial step on
    # for two steps (skipped, as GradScaler skips them), so both ranks hold
    # their carry back: the ranks must then agree that it is still owed,
    # whatever each one's carry holds.
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    plan.planner.predict = _rank_predict("topk")
    autotrial.choose = lambda times, current=None: 1  # round 1 = fp32: the decided plan is dense
    # ... whatever a loaded machine times: every cycle runs both rounds (the trial's length), and fp32 replaces the
    # best predicted round (top-k) without being faster in every cycle (under load it was not, and top-k stayed)
    autotrial.AUTO_SPAN = autotrial.AUTO_LINK_SPAN = INF
    autotrial.AUTO_DROP_SLOWER = False
    autotrial.faster_in_every_cycle = lambda *args: True
    torch.manual_seed(0)
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hetcomm.HookState("auto", candidates=("none", "topk"), topk_ratio=0.05, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    delivered = exact = None
    nan_steps = (last_trial, last_trial + 1)
    for step in range(last_trial + 4):
        x = torch.randn(8, models.IN, generator=torch.Generator().manual_seed(step * 31 + rank))
        y = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        scale = 0.0 if rank == 0 and step >= 1 else (float("nan") if rank == 1 and step in nan_steps else 1.0)
        (torch.nn.functional.cross_entropy(ddp(x), y) * scale).backward()
        g = models.flat_grads(model).double()
        if step not in nan_steps:
            assert torch.isfinite(g).all(), step
            mine = torch.autograd.grad(torch.nn.functional.cross_entropy(model(x), y) * scale, list(model.parameters()))
            mine = torch.cat([t.reshape(-1) for t in mine]).double()
            torch.distributed.all_reduce(mine)
            exact = mine / world if exact is None else exact + mine / world
            delivered = g if delivered is None else delivered + g
            opt.step()
        else:
            assert not torch.isfinite(g).all(), step  # every rank sees the NaN, as with allreduce_hook
    plans = {p["mode"] for p in state.stats()["plans"].values()}
    return {"params": models.flat_params(model), "gap": float((delivered - exact).abs().max()), "plans": plans,
            "scale": float(exact.abs().max())}


def test_a_held_back_carry_stays_owed_on_every_rank(tmp_path):
    last_trial = 1 + autoplan.AUTO_REPEATS * 2 - 1  # the rounds alternate top-k, fp32 from step 1 on
    res = run_ranks(_held_carry_run, 2, str(tmp_path), last_trial, timeout=120.0, pg_timeout=20.0)
    for r in res:
        assert r["plans"] == {"none"}
        assert r["gap"] < 1e-5 * max(r["scale"], 1.0), r  # the held carry was delivered after the NaN steps
    assert torch.equal(res[0]["params"], res[1]["params"])


def _momentum_run(rank, world, cache_dir, compression, candidates, weight_decay):
    os.environ["HETCOMM_CACHE_DIR"] = cache_dir
    torch.manual_seed(0)
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    kwargs = {"candidates": candidates} if compression == "auto" else {}
    state = hetcomm.HookState(compression, min_compress_numel=0, start_iter=2, **kwargs)  # the same start, both
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9, weight_decay=weight_decay)
    state.attach_optimizer(opt)
    gap = 0.0  # per-bucket momentum against the optimizer's own buffer, on the dense warm-up steps
    for step in range(12):
        models.train_step(ddp, opt, rank, step, 8)
        if compression == "onebit" and step < state.start_iter:
            state._drain()
            for sig in state._buckets.step_layout:  # the buckets of the step just done
                m = state._buckets.momentum[",".join(map(str, sig))]
                ref = [opt.state[state._buckets.params.param(n)]["momentum_buffer"] for n in sig]
                gap = max(gap, float((m - torch.cat([b.reshape(-1) for b in ref])).abs().max()))
    return {"params": models.flat_params(model), "gap": gap,
            "plans": sorted({p["mode"] for p in state.stats()["plans"].values()}),
            "mirrored": sorted(state._buckets.momentum)}


def _momentum_runs(rank, world, cache_dir, weight_decay):
    """Fixed onebit, auto restricted to onebit, and exact (with weight decay
    only), one after another in one job."""
    return (_momentum_run(rank, world, cache_dir, "onebit", None, weight_decay),
            _momentum_run(rank, world, cache_dir, "auto", ("onebit",), weight_decay),
            _momentum_run(rank, world, cache_dir, "none", None, weight_decay) if weight_decay else None)


def _adam_moment_gap(rank, world, optimizer):
    torch.manual_seed(0)
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = hetcomm.HookState("onebit", min_compress_numel=0, start_iter=6)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = (hetcomm.optim.AdamW if optimizer == "hetcomm" else torch.optim.AdamW)(ddp.parameters(), lr=1e-3)
    state.attach_optimizer(opt)
    gaps = []  # per step: max |(1 - beta1) m - exp_avg| over the step's buckets, relative to max |exp_avg|
    for step in range(state.start_iter):  # the dense warm-up: m and exp_avg see the same gradients
        models.train_step(ddp, opt, rank, step, 8)
        state._drain()
        gap, scale = 0.0, 0.0
        for sig in state._buckets.step_layout:
            m = state._buckets.momentum[",".join(map(str, sig))]
            ref = torch.cat([opt.state[state._buckets.params.param(n)]["exp_avg"].reshape(-1) for n in sig])
            gap = max(gap, float(((1 - 0.9) * m - ref).abs().max()))
            scale = max(scale, float(ref.abs().max()))
        gaps.append(gap / scale)
    return {"gaps": gaps, "layouts": len({tuple(map(tuple, state._buckets.step_layout))})}


@pytest.mark.parametrize("optimizer", ["hetcomm", "torch"])
def test_adam_first_moment_of_rebuilt_buckets_starts_from_the_optimizer(optimizer):
    # DDP rebuilds its buckets after the first step; a new bucket's compressed
    # first moment starts from the optimizer's exp_avg / (1 - beta1), not zero
    # (zero would lose step 0's gradient: a gap of ~|exp_avg| at step 1).
    r = run_ranks(_adam_moment_gap, 2, optimizer)[0]
    assert max(r["gaps"]) < 1e-5, r["gaps"]


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_auto_seeds_the_compressed_momentum_from_the_optimizer(tmp_path, weight_decay):
    # A fixed onebit run follows the optimizer's momentum per bucket during its
    # dense warm-up (a bucket first seen starts from the optimizer's buffer);
    # auto keeps no copy on dense plans and takes the optimizer's buffer at its
    # first compressed step. Without weight decay the two are the same numbers
    # (bit for bit); with it the decay's momentum moves into the compressed
    # part, and training stays where the fixed run goes.
    fixed, auto, exact = zip(*run_ranks(_momentum_runs, 2, str(tmp_path), weight_decay))
    assert auto[0]["plans"] == fixed[0]["plans"] == ["onebit"]
    # DDP rebuilds its buckets after the first step: the new buckets' momentum
    # starts from the optimizer's, not from zero
    assert weight_decay or fixed[0]["gap"] == 0.0
    assert torch.equal(auto[0]["params"], auto[1]["params"])
    if weight_decay == 0.0:
        assert torch.equal(auto[0]["params"], fixed[0]["params"])
    else:  # far closer to the fixed run than 1-bit compression itself moves it from exact training
        apart = float((auto[0]["params"] - fixed[0]["params"]).abs().max())
        compression = float((fixed[0]["params"] - exact[0]["params"]).abs().max())
        assert apart < 0.25 * compression, (apart, compression)


class _OneRankEngine:
    """What the planner asks of the engine, for one rank: its round times come back as the all-gather."""

    def last_step_buckets(self):
        return []

    def submit_config(self, row):
        fut = torch.futures.Future()
        fut.set_result(row.view(1, -1))
        return fut


def _clocked_planner(monkeypatch, modes):
    """The planner alone for one rank, on a clock of its own (``[seconds]``),
    one slow link (12.5 MB/s) between two nodes, auto's modes ``modes``:
    (the state, the Planner, its AutoPlanner, the clock, the engine)."""
    from types import SimpleNamespace

    topo = topology.Topology(world=2, nodes=["a", "b"], devices=[{}] * 2,
                             links={"inter": topology.LinkClass(50e-6, 1 / 12.5e6)})
    state = SimpleNamespace(algorithm="native", _forced_algo=None, topology=topo, resolved_compression="auto",
                            min_compress_numel=0, start_iter=0, topk_ratio=0.01, _compressed_at=lambda step: True)
    plans = plan.Planner(state)
    plans.auto.modes = modes
    clock = [0.0]
    monkeypatch.setattr(autoplan.time, "monotonic", lambda: clock[0])
    return state, plans, plans.auto, clock, _OneRankEngine()


def test_rechecks_settle_early_then_skip_hopeless_candidates_but_remeasure_them(monkeypatch):
    """The planner alone, on a clock of its own: fp32 costs 10 per step, fp8
    1.0 and onebit 1.2. The first trial picks fp8 (faster in every cycle
    than onebit, its best predicted round) and finds fp32 hopeless (over
    AUTO_SPAN x) after one step of it, which it does not repeat; the first
    re-check comes AUTO_SETTLE steps later and leaves fp32 out, and runs
    onebit once: no faster than fp8 in that first cycle, it cannot win (a
    switch must be faster in every cycle). Every AUTO_FULL_EVERY-th re-check
    measures fp32 again. When onebit becomes clearly faster (0.5, past the
    hysteresis) a re-check measures it in every cycle and switches to it."""
    state, plans, planner, clock, engine = _clocked_planner(monkeypatch, ("none", "fp8", "onebit"))
    cost = {"none": 10.0, "fp8": 1.0, "onebit": 1.2}
    ran = []  # (compressed step, mode, why)
    for step in range(3 * autoplan.AUTO_RECHECK + autoplan.AUTO_SETTLE + 60):
        if step == autoplan.AUTO_SETTLE + 2 * autoplan.AUTO_RECHECK:
            cost["onebit"] = 0.5
        planner.begin_step(engine)
        p = plans.plan(1 << 20, "0", 0, step, lambda: None)
        ran.append((planner.compressed_steps, p.mode, p.why))
        clock[0] += cost[p.mode]
        planner.end_step(True)
    trials = [(s, m) for s, m, why in ran if why == "trial"]
    first = [m for s, m in trials if s < 7]
    assert sorted(m for s, m in trials[:3]) == ["fp8", "none", "onebit"]  # a cycle: each round once
    assert sorted(first) == ["fp8"] * 3 + ["none"] + ["onebit"] * 3  # fp32 once: 10 > AUTO_SPAN x 1.0
    settle = [m for s, m in trials if 7 + autoplan.AUTO_SETTLE <= s < 7 + autoplan.AUTO_SETTLE + 6]
    assert settle == ["fp8", "onebit"]  # fp32 left out; onebit, 1.2 against fp8's 1.0 in the first cycle, once
    assert ran[7 + autoplan.AUTO_SETTLE + 2] == (7 + autoplan.AUTO_SETTLE + 2, "fp8", "measured")
    starts = [s for (s, _), (p, _) in zip(trials[1:], trials) if s != p + 1]  # where each re-check began
    assert starts[0] == 7 + autoplan.AUTO_SETTLE
    assert all(b - a > autoplan.AUTO_RECHECK for a, b in zip(starts, starts[1:]))
    assert len(starts) == autoplan.AUTO_FULL_EVERY
    rounds = [[m for s, m in trials if a <= s < a + 9] for a in starts]
    assert [sorted(r) for r in rounds[:2]] == [["fp8", "onebit"]] * 2
    assert sorted(rounds[2]) == ["fp8"] * 3 + ["onebit"] * 3  # onebit at 0.5: faster in the first cycle, measured on
    assert sorted(rounds[3]) == ["fp8", "none", "onebit"]  # every AUTO_FULL_EVERY-th re-check measures every one,
    # fp8 (1.0) and fp32 once against onebit's 0.5
    # the third re-check measured onebit's new speed and switched to it; the fourth kept it
    assert ran[-1][1] == "onebit" and ran[-1][2] == "measured"
    assert planner.rechecks == autoplan.AUTO_FULL_EVERY and planner.pruned["0"] == {("none", "native")}
    # and what is left out is saved with the decisions
    sd = planner.state_dict()
    assert sd["pruned"] == {"0": [["none", "native"]]} and sd["rechecks"] == autoplan.AUTO_FULL_EVERY
    fresh = plan.Planner(state).auto
    fresh.load_state_dict(sd)
    assert fresh.pruned == planner.pruned and fresh.rechecks == planner.rechecks


@pytest.mark.parametrize("link_span", [autotrial.AUTO_LINK_SPAN, autotrial.AUTO_SPAN])
def test_the_first_trial_leaves_out_an_fp32_round_whose_link_time_alone_cannot_win(monkeypatch, link_span):
    """The planner alone, on a clock of its own, one slow link (12.5 MB/s):
    fp32's all-reduce of a 4 MiB bucket is predicted at 0.336 s. Round 0
    (fp8) takes 0.45 s in the run's first step, 0.2 after; bf16 0.25. Against
    round 0's step fp32 is not hopeless; against bf16's, measured next, a
    round that runs no codec (predicted by the links' time alone) over 1.25x
    it cannot be the fastest, so fp32 does not run. With fp32's margin as
    wide as a codec round's (AUTO_SPAN, 2x) it runs a step of 0.6 s."""
    monkeypatch.setattr(autotrial, "AUTO_LINK_SPAN", link_span)
    _, plans, planner, clock, engine = _clocked_planner(monkeypatch, ("none", "bf16", "fp8"))
    cost = {"none": 0.6, "bf16": 0.25, "fp8": 0.2}
    preds = {}
    for m, _, t in planner._candidates(1 << 20, lambda: None):
        preds.setdefault(m, t)
    assert 1.25 * cost["bf16"] < preds["none"] < 1.25 * 0.45 and preds["bf16"] < cost["fp8"], preds
    ran = []
    for step in range(12):
        planner.begin_step(engine)
        p = plans.plan(1 << 20, "0", 0, step, lambda: None)
        ran.append((p.mode, p.why))
        clock[0] += 0.45 if step == 0 else cost[p.mode]
        planner.end_step(True)
    trial = [m for m, why in ran if why == "trial"]
    assert trial[:2] == ["fp8", "bf16"] and sorted(trial) == ["bf16"] * 3 + ["fp8"] * 3 + ["none"] * (link_span > 1.5)
    assert ran[-1] == ("fp8", "measured")


def _guarded_planner_run(monkeypatch, first_share, cost, readings=None, resume_at=None):
    """The planner alone, one 1M-element bucket on a clock of its own, steps
    0 .. 2 LATER + 29: lowrank guarded, its guard's first reading
    ``first_share`` (at step 0; None: none, lowrank provisional until
    ``readings`` give one); a step costs ``cost[mode]`` (a callable: of the
    step and the rank lowrank runs at), 5 more where the guard reads.
    ``readings``: {step: this rank's window means, set before that step
    begins}; ``resume_at``: before that step a new planner goes on from the
    old one's ``state_dict()`` (its first step after it untimed, as a
    resumed run's). (auto, [(step, mode, why)], the trial steps, the first
    step after the first trial, whether a step reads)."""
    from types import SimpleNamespace

    topo = topology.Topology(world=2, nodes=["a", "b"], devices=[{}] * 2,
                             links={"inter": topology.LinkClass(50e-6, 1 / 12.5e9)})
    share = SimpleNamespace(last=None)
    state = SimpleNamespace(algorithm="native", _forced_algo=None, topology=topo, resolved_compression="auto",
                            min_compress_numel=0, start_iter=0, topk_ratio=0.01, iter=0, _rank_given=None,
                            matrix_approximation_rank=4, lowrank_wire="bf16", _compressed_at=lambda step: True,
                            _lowrank_share=share, _rank_ladder=SimpleNamespace(rank=4))
    def planner(saved=None):
        plans = plan.Planner(state)
        plans.auto.modes = ("none", "bf16", "fp8")
        plans.auto.offer_guarded()
        if saved is not None:
            plans.auto.load_state_dict(saved)
        return plans, plans.auto

    plans, auto = planner()
    assert first_share is None or auto.guard.update(first_share, 0)
    layout = torch.tensor([[0, 1024, 1024, 16]])
    clock = [0.0]
    monkeypatch.setattr(autoplan.time, "monotonic", lambda: clock[0])
    engine = _OneRankEngine()

    def reads(step):
        return lowrank_share.LowrankShare.due(step) and not auto.skips_reading(step)

    ran = []  # (step, plan, why)
    for step in range(2 * lowrank_share.LATER + 30):
        state.iter = step
        if step == resume_at:
            plans, auto = planner(auto.state_dict())
        if step in (readings or {}):
            share.last = readings[step]
        auto.begin_step(engine)
        p = plans.plan(1 << 20, "0", 0, step, lambda r=None: layout)
        ran.append((step, p.mode, p.why))
        c = cost[p.mode]
        at_rank = auto.lowrank_rank() or state._rank_ladder.rank  # as HookState._lowrank_rank
        clock[0] += (c(step, at_rank) if callable(c) else c) + (5.0 if reads(step) else 0.0)
        auto.end_step(True)
    trial = [s for s, _, why in ran if why == "trial"]
    decided = next(s for s, _, why in ran if why != "trial")  # the first trial's end
    return auto, ran, trial, decided, reads


def test_a_recheck_due_inside_a_share_window_waits_until_its_rounds_miss_every_reading(monkeypatch):
    """The planner alone, on a clock of its own, lowrank guarded and
    admitted: the first re-check falls due AUTO_SETTLE steps after the first
    decision, inside the later window (LATER .. LATER + SPAN), whose reading
    steps cost more than any plan (a spectrum on every rank). It waits for
    the window to close, so that no trial round is timed on a reading step,
    and keeps the fastest plan."""
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": 1.0, "none": 10.0}  # lowrank not by its margin
    auto, ran, trial, decided, reads = _guarded_planner_run(monkeypatch, 0.99, cost)
    due = decided + autoplan.AUTO_SETTLE
    window = lowrank_share.window_of(due)
    assert window == lowrank_share.LATER and not auto.skips_reading(window)  # the case: due inside a read window
    recheck = [s for s in trial if s > decided]
    assert recheck[0] == lowrank_share.next_close(due) + 1 and not any(reads(s) for s in recheck), recheck
    assert recheck == list(range(recheck[0], recheck[-1] + 1))  # one re-check, its rounds in a row
    assert auto.rechecks == 1 and ran[-1][1:] == ("fp8", "measured")


def test_a_refused_lowrank_taken_back_is_measured_once_its_rounds_miss_every_reading(monkeypatch):
    """The planner alone, on a clock of its own: lowrank refused at the
    start, the trials measure the others; the window 80-90 reads it back
    (ADMIT or more). The re-check that measures it again waits until its
    rounds miss every reading (the next window, 100-120, is read: admitted,
    the guard skips only the windows before it) and then chooses lowrank,
    faster by more than its margin. Taken back while no trial ran, it used
    to start a re-check at once, whose rounds fell on 100 and 105."""
    back = 90  # the close of the window 80-90; this rank's means of it, at WAIT_RANK and at rank 4
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": 0.5, "none": 10.0}
    auto, ran, trial, decided, reads = _guarded_planner_run(
        monkeypatch, 0.5, cost, {back + 1: {"step": back, "share": 0.99, "ladder": [0.995, 0.99]}})
    assert auto.guard.state == "admitted" and auto.guard.readmitted == 1 and auto.guard.changed_at == [back, 0.99]
    assert "lowrank" not in {m for s, m, _ in ran if s <= back}  # refused until then: the trials left it out
    recheck = [s for s in trial if s > decided]
    assert recheck[0] == lowrank_share.next_close(back + 1) + 1 and not any(reads(s) for s in recheck), recheck
    assert recheck == list(range(recheck[0], recheck[-1] + 1))  # one re-check, its rounds in a row ...
    assert "lowrank" in {m for s, m, _ in ran if s in recheck}  # ... which measured lowrank
    assert auto.rechecks == 1 and ran[-1][1:] == ("lowrank", "measured")


@pytest.mark.parametrize("later", [0.65, 0.72])
def test_a_recheck_takes_lowrank_by_its_margin_alone(monkeypatch, later):
    """The planner alone, lowrank admitted from the start: the first trial
    times it at 0.9x fp8's step (not by its margin: fp8 runs), the re-check
    at ``later``. At 0.65x (by the margin, 0.7) it takes lowrank: the
    hysteresis (0.9) is not asked on top, by which lowrank had to take 0.63x
    (a wide-model run on the testbed kept int3 at 1.6x lowrank's step,
    measuring it at 0.636x). At 0.72x fp8 stays, and a second re-check
    confirms it (faster, not by the margin)."""
    def lowrank(step, rank):
        return 0.9 if step < 50 else later  # the first trial's steps, then the re-check's (after step 120)
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": lowrank, "none": 10.0}
    auto, ran, trial, decided, reads = _guarded_planner_run(monkeypatch, 0.99, cost)
    kept = later >= autoplan.LOWRANK_MARGIN
    assert decided < 50 and ran[decided][1] == "fp8" and (auto.rechecks, auto.confirms) == (1 + kept, kept)
    assert min(s for s in trial if s > decided) > 50
    assert ran[-1][1:] == ("lowrank" if later < autoplan.LOWRANK_MARGIN else "fp8", "measured")


def test_lowrank_admitted_at_another_rank_than_the_trial_timed_is_measured_again_at_once(monkeypatch):
    """The planner alone: before its reading lowrank runs provisionally at
    rank 16, where it takes 1.2x fp8's step, and fp8 wins the first trial;
    the reading of steps 20-30 admits it, at rank 4, where it takes 0.5x. A
    re-check starts at once (step 31: admitted, the guard reads no window
    before 100), measures lowrank at rank 4 against the running plan alone
    and takes it; the next is the schedule's, AUTO_SETTLE steps after the
    first decision (after the window 100-120), and keeps it. It waited for
    that re-check: on the 2 x 2 testbed the wide model's large bucket ran
    int3 at 68-80 ms a step there, lowrank at 44-49, on 8 runs of 20."""
    close = lowrank_share.FIRST + lowrank_share.FIRST_SPAN  # 30

    def lowrank(step, rank):
        return 1.2 if rank == lowrank_guard.PROVISIONAL_RANK else 0.5
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": lowrank, "none": 10.0}
    auto, ran, trial, decided, reads = _guarded_planner_run(
        monkeypatch, None, cost, {close + 1: {"step": close, "share": 0.99, "ladder": [0.995, 0.99]}})
    assert auto.guard.state == "admitted" and auto.guard.changed_at == [close, 0.99]
    assert decided < close and {m for s, m, _ in ran[decided:close + 1]} == {"fp8"}  # fp8 won the first trial
    recheck = [s for s in trial if s > decided]
    after = next(s for s in range(close + 1, len(ran)) if ran[s][2] != "trial")  # the first re-check's end
    assert recheck[0] == close + 1 and after > close + 1, recheck
    assert {m for s, m, _ in ran[close + 1:after]} == {"fp8", "lowrank"}  # lowrank against the plan alone
    settle = next(s for s in recheck if s > after)
    # the schedule's re-check, AUTO_SETTLE steps after the first decision (the one of lowrank moves it not)
    assert decided + autoplan.AUTO_SETTLE <= settle < after + autoplan.AUTO_SETTLE and auto.rechecks == 2, \
        (decided, after, settle)
    assert {ran[s][1:] for s in range(after, settle)} == {("lowrank", "measured")}, ran[after:after + 5]
    assert ran[-1][1:] == ("lowrank", "measured")


def test_lowrank_admitted_without_winning_leaves_the_plan_the_first_decision_kept(monkeypatch):
    """The planner alone: bf16 takes 0.95x fp32's step, within the
    hysteresis, so the first trial keeps fp32 (the best predicted here, the
    guarded lowrank aside); lowrank, 1.2x at rank 16, is admitted at step 30
    and measured at rank 4 at 0.8x, not by its margin. Its admission
    re-picked the last trial's fastest round by its time alone (bf16, for
    the rest of the run: a re-check then kept it within the hysteresis);
    now the plan the decision kept stands, and the re-check at the
    admission measures lowrank against it alone."""
    close = lowrank_share.FIRST + lowrank_share.FIRST_SPAN

    def lowrank(step, rank):
        return 1.2 if rank == lowrank_guard.PROVISIONAL_RANK else 0.8
    cost = {"none": 1.0, "bf16": 0.95, "fp8": 1.3, "lowrank": lowrank}
    auto, ran, trial, decided, reads = _guarded_planner_run(
        monkeypatch, None, cost, {close + 1: {"step": close, "share": 0.99, "ladder": [0.995, 0.99]}})
    assert auto.guard.state == "admitted" and "bf16" in {m for s, m, _ in ran if s < decided}
    assert {m for s, m, why in ran if why != "trial"} == {"none"}, ran
    recheck = [s for s in trial if close < s < close + 2 * autoplan.AUTO_REPEATS + 1]
    assert recheck[0] == close + 1 and {ran[s][1] for s in recheck} == {"none", "lowrank"}, ran


def test_lowrank_that_won_the_trial_provisionally_is_not_measured_again_at_its_admission(monkeypatch):
    """The same, lowrank at 0.6x fp8's step at rank 16 too: it won the first
    trial provisionally, runs on after its admission, and the first
    re-check comes AUTO_SETTLE steps after the first decision, not at the
    admission."""
    close = lowrank_share.FIRST + lowrank_share.FIRST_SPAN
    def lowrank(step, rank):
        return 0.6 if rank == lowrank_guard.PROVISIONAL_RANK else 0.5
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": lowrank, "none": 10.0}
    auto, ran, trial, decided, reads = _guarded_planner_run(
        monkeypatch, None, cost, {close + 1: {"step": close, "share": 0.99, "ladder": [0.995, 0.99]}})
    assert auto.guard.state == "admitted" and ran[decided][1] == "lowrank"
    assert min(s for s in trial if s > decided) >= decided + autoplan.AUTO_SETTLE
    assert auto.rechecks == 1 and ran[-1][1:] == ("lowrank", "measured")


@pytest.mark.parametrize("at_rank_4", [0.5, 0.8])
def test_lowrank_that_won_the_trial_by_its_provisional_margin_alone_is_measured_again_at_its_admission(
        monkeypatch, at_rank_4):
    """The planner alone: at rank 16 lowrank takes 0.8x fp8's step, between
    its margins: it wins the first trial provisionally (by 0.9) and runs
    until its reading (it used to lose by 0.7: on the wide model at 100 Mbit
    int3 then ran steps 11-30 at 1.5x lowrank's step). The reading of steps
    20-30 admits it at rank 4: the full margin takes fp8, and a re-check
    measures lowrank at rank 4 at once. At 0.5x it takes lowrank; at 0.8x,
    not by the margin, fp8 stays."""
    close = lowrank_share.FIRST + lowrank_share.FIRST_SPAN

    def lowrank(step, rank):
        return 0.8 if rank == lowrank_guard.PROVISIONAL_RANK else at_rank_4
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": lowrank, "none": 10.0}
    auto, ran, trial, decided, reads = _guarded_planner_run(
        monkeypatch, None, cost, {close + 1: {"step": close, "share": 0.99, "ladder": [0.995, 0.99]}})
    assert auto.guard.state == "admitted"
    assert decided < close and {m for s, m, _ in ran[decided:close + 1]} == {"lowrank"}  # provisionally
    recheck = [s for s in trial if s > decided]
    after = next(s for s in range(close + 1, len(ran)) if ran[s][2] != "trial")
    assert recheck[0] == close + 1 and "lowrank" in {m for s, m, _ in ran[close + 1:after]}, recheck
    assert ran[after][1:] == ("lowrank" if at_rank_4 < autoplan.LOWRANK_MARGIN else "fp8", "measured")
    assert [m for s, m, why in ran if why != "trial"][-1] == ran[after][1]  # (at 0.8 its confirmations keep fp8)


def _recheck_starts(ran, trial, after):
    """The first step of each re-check after step ``after``."""
    return [s for s in trial if s > after and ran[s - 1][2] != "trial"]


@pytest.mark.parametrize("confirmed", [0.5, 0.8])
@pytest.mark.parametrize("resume_at", [None, 45, 62])
def test_a_recheck_that_kept_a_round_without_lowrank_by_its_margin_alone_is_confirmed_once(
        monkeypatch, confirmed, resume_at):
    """The planner alone: lowrank wins the first trial provisionally (0.8x
    fp8's step at rank 16), is admitted at step 30 at rank 4, and the
    re-check then measures it against fp8 alone (bf16 was measured by the
    trial before) at 0.8x: faster than fp8, not by its margin (0.7), so fp8
    runs. Its one-step rounds are noisy (on the wide model at 100 Mbit such
    a re-check kept int3 on 1-3 runs of 12, at 1.5x lowrank's step until the
    next re-check 100 steps later), so another re-check confirms it
    AUTO_CONFIRM steps later, lowrank against fp8 again. Measured there at
    0.5x it takes lowrank; at 0.8x fp8 stays, and the next re-check is the
    schedule's, AUTO_SETTLE steps after the first decision (the re-checks of
    lowrank move it not), not another confirmation; its keep by the margin
    alone is confirmed in turn. A run resumed while the confirmation is due
    (45) or runs (62) goes on the same."""
    close = lowrank_share.FIRST + lowrank_share.FIRST_SPAN

    def lowrank(step, rank):
        return 0.8 if rank == lowrank_guard.PROVISIONAL_RANK or step < 50 else confirmed
    cost = {"fp8": 1.0, "bf16": 1.3, "lowrank": lowrank, "none": 10.0}
    readings = {close + 1: {"step": close, "share": 0.99, "ladder": [0.995, 0.99]}}
    auto, ran, trial, decided, reads = _guarded_planner_run(monkeypatch, None, cost, readings, resume_at)
    starts = _recheck_starts(ran, trial, decided)
    assert starts[0] == close + 1  # lowrank won provisionally, lost by the full margin at its admission
    after = next(s for s in range(starts[0], len(ran)) if ran[s][2] != "trial")
    assert ran[after][1:] == ("fp8", "measured")
    assert starts[1] == after + autoplan.AUTO_CONFIRM, (after, starts)  # confirmed once, soon
    admission = [s for s in trial if starts[0] <= s < starts[1]]
    confirm = [s for s in trial if starts[1] <= s < starts[2]]
    for steps in (admission, confirm):  # lowrank against the running plan alone (not bf16, measured before)
        assert {ran[s][1] for s in steps} == {"fp8", "lowrank"} and len(steps) == 2 * autoplan.AUTO_REPEATS
    end = confirm[-1] + 1
    assert starts[2] >= decided + autoplan.AUTO_SETTLE  # the schedule's, which neither moved
    if confirmed < autoplan.LOWRANK_MARGIN:
        assert {ran[s][1:] for s in range(end, len(ran)) if s not in trial} == {("lowrank", "measured")}
        assert auto.confirms == 1 and len(starts) == 3  # a re-check that took lowrank asks no confirmation
    else:  # the schedule's re-check keeps fp8 by the margin alone too: confirmed AUTO_CONFIRM steps after it
        assert ran[end][1:] == ("fp8", "measured")
        after = next(s for s in range(starts[2], len(ran)) if ran[s][2] != "trial")
        assert auto.confirms == 2 and len(starts) == 4 and starts[3] == after + autoplan.AUTO_CONFIRM, (after, starts)
    assert auto.rechecks == len(starts)
    if resume_at is not None:  # the same decisions as the run not interrupted ...
        whole, uninterrupted, _, _, _ = _guarded_planner_run(monkeypatch, None, cost, readings)
        assert (auto.rechecks, auto.confirms) == (whole.rechecks, whole.confirms)

        def decisions(r):
            return [(m, why) for (_, _, before), (_, m, why) in zip(r, r[1:]) if before == "trial" != why]
        assert decisions(ran) == decisions(uninterrupted)
        # ... the re-checks at the same steps (a confirmation resumed while it runs is still one of lowrank alone,
        # which leaves the schedule as it was) ...
        assert starts == _recheck_starts(uninterrupted, [s for s, _, why in uninterrupted if why == "trial"], decided)
        if resume_at < starts[1]:  # ... and, resumed outside a trial, the same steps: nothing was left untimed
            assert ran == uninterrupted
    # a re-check the guard asked for (at lowrank's admission, where it waits for a window's readings) is saved too
    auto.lowrank_asks = True
    fresh = plan.Planner(auto.s).auto
    fresh.modes = ("none", "bf16", "fp8")
    fresh.offer_guarded()
    fresh.load_state_dict(auto.state_dict())
    assert fresh.lowrank_asks and fresh.next_check == auto.next_check


def test_a_recheck_keeps_no_lowrank_measured_slower_or_refused_and_asks_no_confirmation():
    """_kept_by_margin, the rule alone: a decision without lowrank is
    confirmed only where lowrank is admitted and its round measured faster
    than the kept one's; not where it was slower, nor before it is admitted
    (a provisional lowrank's reading decides again), nor after its refusal,
    nor where the decision took lowrank."""
    from types import SimpleNamespace

    planner = plan.Planner(SimpleNamespace(_rank_given=None, iter=0)).auto
    planner.modes = ("none", "fp8")
    planner.offer_guarded()
    planner.candidates = {"k": [("fp8", "native", None), ("none", "native", None), ("lowrank", "native", None)]}
    planner._order = {"k": [0, 1, 2]}
    planner.round_times = [1.0, 3.0, 0.8]
    assert planner.guard.provisional and not planner._kept_by_margin(0)
    planner.guard.update(0.99, 30)
    assert planner.guard.state == "admitted"
    assert planner._kept_by_margin(0) and not planner._kept_by_margin(2)
    planner.round_times = [1.0, 3.0, 1.1]
    assert not planner._kept_by_margin(0)
    planner.round_times = [1.0, 3.0, 0.8]
    planner.guard.update(0.5, 120)
    assert planner.guard.state == "refused" and not planner._kept_by_margin(0)


def test_the_guarded_lowrank_wins_only_by_its_margin():
    """The planner alone: a round with the guarded lowrank is chosen only
    where its time is at most LOWRANK_MARGIN times the best round's without
    it (an approximation must buy a clear speed-up), PROVISIONAL_MARGIN
    while it runs provisionally (its reading decides again); a round it may
    not run yet (a rank given, no reading) is never chosen; lowrank listed in
    candidates= (unguarded) is timed as it is."""
    from types import SimpleNamespace

    state = SimpleNamespace(_rank_given=None, iter=0)
    planner = plan.Planner(state).auto
    planner.modes = ("none", "fp8")
    planner.offer_guarded()
    planner.candidates = {"k": [("fp8", "native", None), ("none", "native", None), ("lowrank", "native", None)]}
    planner._order = {"k": [0, 1, 2]}
    m, p = autoplan.LOWRANK_MARGIN, autoplan.PROVISIONAL_MARGIN
    assert m < p < 1
    assert planner.guard.provisional  # before the first reading lowrank runs (at rank 16)
    for lowrank, chosen in ((0.95, 0), (p + 0.01, 0), (p - 0.01, 2), (m - 0.01, 2), (0.3, 2)):
        times = [1.0, 3.0, lowrank]
        assert autoplan.choose([planner._judged(times)]) == chosen, lowrank
    planner.guard.update(0.95, 30)  # between the bars: lowrank waits for the next reading, at rank 16 meanwhile
    assert planner.guard.provisional and autoplan.choose([planner._judged([1.0, 3.0, 0.3])]) == 2
    assert autoplan.choose([planner._judged([1.0, 3.0, p + 0.01])]) == 0  # still by its provisional margin
    assert autoplan.choose([planner._judged([1.0, 3.0, p - 0.01])]) == 2
    planner.guard.update(0.99, 120)
    assert planner.guard.state == "admitted" and autoplan.choose([planner._judged([1.0, 3.0, 0.3])]) == 2
    for lowrank, chosen in ((p - 0.01, 0), (m + 0.01, 0), (m - 0.01, 2)):  # admitted: by the full margin
        assert autoplan.choose([planner._judged([1.0, 3.0, lowrank])]) == chosen, lowrank
    given = plan.Planner(SimpleNamespace(_rank_given=4, iter=0)).auto  # a rank given: not before admission
    given.modes = ("none", "fp8")
    given.offer_guarded()
    given.candidates, given._order = planner.candidates, planner._order
    assert not given.guard.provisional and autoplan.choose([given._judged([1.0, 3.0, 0.3])]) == 0
    listed = plan.Planner(SimpleNamespace(_rank_given=None, iter=0)).auto  # candidates=(..., "lowrank")
    listed.modes = ("none", "fp8", "lowrank")
    listed.candidates, listed._order = planner.candidates, planner._order
    assert autoplan.choose([listed._judged([1.0, 3.0, 0.9])]) == 2


def _testbed_wide_buckets():
    """A planner's state on the 2 x 2 testbed's probed links (a slow intra-node
    latency, as a busy 2-core machine measures it), and the wide model's two
    buckets, (numel, layout), at rank 16, where auto's lowrank runs until its
    first reading (10 x 1024 goes dense there): the large one, then the small."""
    from types import SimpleNamespace

    topo = topology.Topology(world=4, nodes=["a", "a", "b", "b"], devices=[{}] * 4,
                             links={"intra": topology.LinkClass(616e-6, 1 / 4.95e9),
                                    "inter": topology.LinkClass(1e-7, 1 / 13.0e6)})
    state = SimpleNamespace(algorithm="auto", _forced_algo=None, topology=topo, _rank_given=None, iter=0,
                            matrix_approximation_rank=4, lowrank_wire="bf16", topk_ratio=0.01)
    big = (1024 * 1024 + 1024 + 10 * 1024 + 10, torch.tensor([[0, 1024, 1024, 16], [1048576, 1, 1024, 0],
                                                               [1049600, 10, 1024, 0], [1059840, 1, 10, 0]]))
    small = (64 * 1024 + 1024, torch.tensor([[0, 1024, 64, 16], [65536, 1, 1024, 0]]))
    return state, big, small


def test_the_guarded_lowrank_runs_one_algorithm_on_every_bucket():
    """The planner alone, on the 2 x 2 testbed's probed links (a slow
    intra-node latency, as a busy 2-core machine measures it): bucket by
    bucket the cost model puts the wide model's large bucket across nodes and
    its small one flat, and two buckets of different algorithms cannot send
    their all-reduces together (39-41 ms a step against 30-32 with one
    algorithm, bench/README). Every bucket's guarded lowrank takes the first
    one's algorithm."""
    state, big, small = _testbed_wide_buckets()
    topo = state.topology
    fractions = [plan.lowrank_fraction(lay, n, "bf16") for n, lay in (big, small)]
    own = [min(("native", "hierarchical"), key=lambda a: planner_mod.predict(topo, n * 4, a, plan.wire_of(
        "lowrank", 0.01, f))) for (n, _), f in zip((big, small), fractions)]
    assert own == ["hierarchical", "native"]  # what each bucket alone would take: the case this guards against
    auto = plan.Planner(state).auto
    auto.modes = ("none", "bf16", "fp8")
    auto.offer_guarded()
    cands = [auto._candidates(n, lambda r=None, lay=lay: lay) for n, lay in (big, small)]
    guarded = [[c for c in cs if c[0] == "lowrank"] for cs in cands]
    assert [[c[1] for c in g] for g in guarded] == [["hierarchical"], ["hierarchical"]]
    # saved with the choices: a resumed run's buckets (DDP may have rebuilt them) take it, not their own prediction
    resumed = plan.Planner(state).auto
    resumed.modes = ("none", "bf16", "fp8")
    resumed.offer_guarded()
    resumed.load_state_dict(auto.state_dict())
    fresh = plan.Planner(state).auto
    fresh.modes = ("none", "bf16", "fp8")
    fresh.offer_guarded()
    for planner_, algo in ((resumed, "hierarchical"), (fresh, "native")):
        cands = planner_._candidates(small[0], lambda r=None: small[1])
        assert [c[1] for c in cands if c[0] == "lowrank"] == [algo]


def test_the_guarded_lowrank_runs_in_one_round_on_every_bucket():
    """The planner alone, on the 2 x 2 testbed's probed links, the wide
    model's two buckets handed over as DDP hands them (the large first):
    bucket by bucket the prediction puts lowrank first on the large bucket
    and last on the small one, and round c runs each bucket's c-th
    candidate, so no round ran lowrank on both, whose all-reduces go out
    together (on the testbed the trials kept int3 on the small bucket: 36-40
    ms a step, against 30-36 with lowrank on both; bench/README "lowrank's
    round on every bucket"). The first trial's round 0 runs it on both; a
    re-check's round 1 (round 0: the plans as they run), also where one
    bucket runs it now and the other does not."""
    state, big, small = _testbed_wide_buckets()
    auto = plan.Planner(state).auto
    auto.modes = ("none", "bf16", "fp8", "int3")
    auto.offer_guarded()
    for index, (key, (n, lay)) in enumerate((("5,4,3,2", big), ("1,0", small))):
        assert auto.plan(n, key, index, lambda r=None, lay=lay: lay).why == "trial"

    def names(key, order=None):
        return [auto.candidates[key][j][0] for j in (auto._order[key] if order is None else order)]
    # what each bucket's own order would be: the case this guards against
    assert names("5,4,3,2", auto._order_of("5,4,3,2"))[0] == "lowrank"
    assert names("1,0", auto._order_of("1,0"))[-1] == "lowrank"
    assert sorted(names("1,0")) == sorted(names("1,0", auto._order_of("1,0")))  # the same candidates, moved
    assert [c[0] for c in auto._round_candidates(0)] == ["lowrank", "lowrank"]
    assert all("lowrank" not in [c[0] for c in auto._round_candidates(c)] for c in range(1, auto._rounds()))

    def recheck(decided):
        auto.trial_start = None
        auto.decided = {k: [c[0] for c in auto.candidates[k]].index(m) for k, m in decided.items()}
        auto._start_trial(full=True)
        return [[c[0] for c in auto._round_candidates(c)] for c in range(auto._rounds())]
    rounds = recheck({"5,4,3,2": "int3", "1,0": "int3"})
    assert rounds[:2] == [["int3", "int3"], ["lowrank", "lowrank"]] and \
        all("lowrank" not in r for r in rounds[2:])
    rounds = recheck({"5,4,3,2": "lowrank", "1,0": "int3"})  # round 0 as they run; round 1 lowrank on both
    assert rounds[:2] == [["lowrank", "int3"], ["lowrank", "lowrank"]], rounds
    assert names("5,4,3,2")[:2] == ["lowrank", "lowrank"] and names("1,0").count("lowrank") == 1
    rounds = recheck({"5,4,3,2": "lowrank", "1,0": "lowrank"})  # both on it: nothing to move
    assert rounds[0] == ["lowrank", "lowrank"] and all("lowrank" not in r for r in rounds[1:])


def test_trial_rounds_pair_the_buckets_candidates_by_name(monkeypatch):
    """The planner alone, on a clock of its own, the cnn task's two buckets
    on a 2 x 2 topology with a slow intra-node latency (1 ms, as a busy
    2-core testbed measured it): the cost model orders the large bucket
    int3 across nodes, fp8 across nodes, int3 flat and the small one int3
    flat, int3 across nodes, fp8 across nodes, so pairing each bucket's c-th
    candidate never ran int3 across nodes on both (bench/README "A
    convolutional task"). A step costs 1.0 with int3 across nodes on both,
    1.2 with any other compressed pair, 10 with fp32 on both. Round 0 runs
    each bucket's best predicted; then a round per name runs it on every
    bucket that offers it; the trial picks int3 across nodes on both, and a
    re-check pairs by name too, round 0 the plans as they run."""
    from types import SimpleNamespace

    topo = topology.Topology(world=4, nodes=["a", "a", "b", "b"], devices=[{}] * 4,
                             links={"intra": topology.LinkClass(1e-3, 1 / 4.95e9),
                                    "inter": topology.LinkClass(1e-7, 1 / 13.0e6)})
    state = SimpleNamespace(algorithm="auto", _forced_algo=None, topology=topo, resolved_compression="auto",
                            min_compress_numel=0, start_iter=0, topk_ratio=0.01, iter=0,
                            _compressed_at=lambda step: True)
    plans = plan.Planner(state)
    auto = plans.auto
    auto.modes = ("none", "bf16", "fp8", "int3")
    buckets = (("3,2", 264970), ("1,0", 19040))  # as DDP hands them over: the large first
    own = {k: [c[:2] for c in auto._candidates(n, lambda r=None: None)] for k, n in buckets}
    hier, flat = ("int3", "hierarchical"), ("int3", "native")
    large, small = own["3,2"], own["1,0"]
    assert large[:3] == [hier, ("fp8", "hierarchical"), flat] and \
        small[:3] == [flat, hier, ("fp8", "hierarchical")]  # the case this guards against
    assert [list(p) for p in zip(large, small)].count([hier, hier]) == 0

    def cost(pair):
        return 10.0 if pair == [("none", "native")] * 2 else 1.0 if pair == [hier, hier] else 1.2
    clock = [0.0]
    monkeypatch.setattr(autoplan.time, "monotonic", lambda: clock[0])
    engine = _OneRankEngine()
    ran = []  # (step, [(mode, algorithm) per bucket], why)
    for step in range(autoplan.AUTO_SETTLE + 40):
        state.iter = step
        auto.begin_step(engine)
        ps = [plans.plan(n, k, i, step, lambda r=None: None) for i, (k, n) in enumerate(buckets)]
        pair = [(p.mode, p.algorithm) for p in ps]
        ran.append((step, pair, ps[0].why))
        clock[0] += cost(pair)
        auto.end_step(True)
    first = [pair for s, pair, why in ran if why == "trial" and s < autoplan.AUTO_SETTLE]
    assert first[0] == [hier, flat]  # round 0: each bucket's best predicted
    names = set(large) | set(small)
    for name in names:  # a round runs each name on every bucket that offers it, the others their first
        assert [name if name in own[k] else own[k][0] for k, _ in buckets] in first, name
    assert len({tuple(p) for p in first}) == 1 + len(names)  # no round twice in the first cycle
    assert first.count([hier, hier]) == autoplan.AUTO_REPEATS
    after = [pair for s, pair, why in ran if why == "measured"]
    assert after and all(pair == [hier, hier] for pair in after)
    recheck = [pair for s, pair, why in ran if why == "trial" and s >= autoplan.AUTO_SETTLE]
    assert recheck[0] == [hier, hier] and [flat, flat] in recheck
    assert auto.pruned == {"3,2": {("none", "native")}, "1,0": {("none", "native")}}


_ONE_MATRIX = torch.tensor([[0, 1024, 1024, 16]])  # lowrank's layout of a bucket of one 1024 x 1024 matrix


def _guarded_planner(given=None):
    """The planner alone for one rank, one slow link (12.5 MB/s) between two
    nodes, auto's modes fp32, bf16, fp8 and the guarded lowrank (``given``:
    HookState's ``matrix_approximation_rank``)."""
    from types import SimpleNamespace

    topo = topology.Topology(world=2, nodes=["a", "b"], devices=[{}] * 2,
                             links={"inter": topology.LinkClass(50e-6, 1 / 12.5e6)})
    state = SimpleNamespace(algorithm="native", _forced_algo=None, topology=topo, resolved_compression="auto",
                            min_compress_numel=0, start_iter=0, topk_ratio=0.01, iter=0, _rank_given=given,
                            matrix_approximation_rank=4, lowrank_wire="bf16", _compressed_at=lambda step: True)
    plans = plan.Planner(state)
    plans.auto.modes = ("none", "bf16", "fp8")
    plans.auto.offer_guarded()
    return plans


def _clocked_steps(monkeypatch, planner_now, cost):
    """``steps(n)``: n steps of the Planner ``planner_now()`` returns, one
    bucket of :data:`_ONE_MATRIX`, each taking ``cost[mode]`` seconds of a
    clock of its own (``steps.cost``): [(mode, why)] a step."""
    clock = [0.0]
    monkeypatch.setattr(autoplan.time, "monotonic", lambda: clock[0])
    engine = _OneRankEngine()

    def steps(n):
        plans, ran = planner_now(), []
        for step in range(n):
            plans.auto.begin_step(engine)
            p = plans.plan(1 << 20, "0", 0, step, lambda r=None: _ONE_MATRIX)
            ran.append((p.mode, p.why))
            clock[0] += cost[p.mode]
            plans.auto.end_step(True)
        return ran
    steps.cost = cost
    return steps


def test_the_guarded_lowrank_predicted_fastest_is_the_first_round_and_a_refusal_runs_the_trial_without_it(
        monkeypatch):
    """The planner alone, on a clock of its own, one slow link (12.5 MB/s):
    lowrank is predicted fastest, so the first trial measures it first, and
    the rounds whose predicted communication alone is over AUTO_SPAN times its
    step (fp8, bf16, fp32) do not run at all: lowrank is chosen, provisionally
    (rank 16). Refused by the guard, the buckets do not fall back to fp32:
    the first trial runs again without lowrank, from the best predicted
    round (fp8), fp32 hopeless against it, bf16 once (slower than fp8 in the
    first cycle, it cannot win); refused while the first trial
    still runs, at its end too (not lowrank, all it measured). With a rank
    given (lowrank may not run before its reading) lowrank stays the last
    round."""
    plans = _guarded_planner()
    auto = plans.auto
    steps = _clocked_steps(monkeypatch, lambda: plans, {"lowrank": 0.03, "fp8": 0.1, "bf16": 0.18, "none": 0.35})
    cost = steps.cost
    layout = _ONE_MATRIX
    preds = {m: t for m, _, t in auto._candidates(1 << 20, lambda r=None: layout)}
    assert preds["lowrank"] < cost["lowrank"] < preds["fp8"] / autoplan.AUTO_SPAN  # the others hopeless
    assert steps(autoplan.AUTO_REPEATS) == [("lowrank", "trial")] * autoplan.AUTO_REPEATS
    assert steps(5) == [("lowrank", "measured")] * 5 and auto.lowrank_rank() == lowrank_guard.PROVISIONAL_RANK
    assert auto.guard.update(lowrank_guard.FIRST_DROP - 0.01, 30) and auto.guard.state == "refused"
    auto._repick()
    assert not auto.decided and auto.trial_start is not None  # the first trial again
    again = steps(2 * autoplan.AUTO_REPEATS)
    # no fp32; bf16, no faster than fp8 in the first cycle, runs once (it cannot win), and the trial ends there
    assert again == [("fp8", "trial"), ("bf16", "trial")] + [("fp8", "measured")] * (2 * autoplan.AUTO_REPEATS - 2)
    # refused while that first trial still ran: its decision (lowrank, all it measured) is not taken
    plans = _guarded_planner()
    auto = plans.auto
    assert steps(1) == [("lowrank", "trial")]
    assert auto.guard.update(lowrank_guard.FIRST_DROP - 0.01, 30)
    auto._repick()  # the running trial decides
    assert steps(autoplan.AUTO_REPEATS - 1) == [("lowrank", "trial")] * (autoplan.AUTO_REPEATS - 1)
    again = steps(2 * autoplan.AUTO_REPEATS + 1)
    assert again == [("fp8", "trial"), ("bf16", "trial")] + [("fp8", "measured")] * (2 * autoplan.AUTO_REPEATS - 1)
    given = _guarded_planner(4).auto
    cands = given._candidates(1 << 20, lambda r=None: layout)
    given.candidates = {"0": cands}
    assert [cands[j][0] for j in given._order_of("0")] == ["fp8", "bf16", "none", "lowrank"]


@pytest.mark.parametrize("drop", [True, False])
def test_a_trial_runs_no_more_of_a_round_no_faster_than_the_kept_one_but_lowrank_runs_on(monkeypatch, drop):
    """The planner alone, on a clock of its own: lowrank (0.15 s a step) is
    predicted fastest and runs first; the round a decision keeps is fp8's
    (0.1 s), the best predicted without lowrank. bf16 (0.18 s), no faster
    than fp8 in the first cycle, cannot replace it (a switch is faster in
    every cycle), so it runs no more; lowrank, slower too, runs its cycles,
    whose times its margin weighs (and its admission later). Without the
    rule (``AUTO_DROP_SLOWER`` False) bf16 runs AUTO_REPEATS steps, and the
    decision is the same."""
    monkeypatch.setattr(autotrial, "AUTO_DROP_SLOWER", drop)
    plans = _guarded_planner()
    steps = _clocked_steps(monkeypatch, lambda: plans, {"lowrank": 0.15, "fp8": 0.1, "bf16": 0.18, "none": 0.35})
    first = steps(3)
    assert first == [("lowrank", "trial"), ("fp8", "trial"), ("bf16", "trial")]  # fp32 hopeless: not run
    rest = steps(2 * autoplan.AUTO_REPEATS + 1)
    trial = first + [r for r in rest if r[1] == "trial"]
    assert sorted(m for m, _ in trial) == sorted(["lowrank", "fp8"] * autoplan.AUTO_REPEATS +
                                                 ["bf16"] * (1 if drop else autoplan.AUTO_REPEATS))
    assert rest[-1] == ("fp8", "measured")
    assert plans.auto._kept == ([0, 1] if drop else [0, 1, 2])
