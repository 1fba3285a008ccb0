"""``compression="auto"``'s trials (a part of :class:`hetcomm.autoplan.AutoPlanner`):
which candidate each bucket runs in each round, the rounds left out as
hopeless, the times every rank all-gathers and the decision they give
(items 2-4 of :mod:`hetcomm.autoplan`'s account)."""

from __future__ import annotations

import logging
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

from . import lowrank_share

log = logging.getLogger("hetcomm")

AUTO_TOP = 3          # candidates by prediction kept for the trial (plus fp32 native)
AUTO_REPEATS = 3      # trial steps per candidate, interleaved (the minimum counts: the first may warm up)
AUTO_SETTLE = 100     # compressed steps from the first decision to the first re-check
AUTO_RECHECK = 1000   # compressed steps between later re-checks
AUTO_CONFIRM = 20     # compressed steps to a re-check that confirms one kept from the admitted lowrank by its margin
AUTO_HYSTERESIS = 0.9  # a re-check switches only to a candidate this much faster than the current one
AUTO_SPAN = 2.0       # re-checks leave out candidates measured this much slower than the chosen one ...
AUTO_FULL_EVERY = 4   # ... except every 4th re-check, which measures them all again
AUTO_LINK_SPAN = 1.25  # the first trial leaves out an fp32 round predicted this much slower than its fastest so far
AUTO_DROP_SLOWER = True  # ... and, after the first cycle, the rounds no faster than the kept one in it (_cannot_win)
INF = float("inf")     # a round's time where there is none (not measured, or not allowed)


def slowest(times: Sequence[Sequence[float]]) -> List[float]:
    """Each candidate's (round's) time by its slowest rank, from
    ``times[rank][candidate]`` (inf where a rank has none)."""
    return [max(col) for col in zip(*times)]


def choose(times: Sequence[Sequence[float]], current: Optional[int] = None,
           hysteresis: float = AUTO_HYSTERESIS) -> int:
    """The candidate to keep, from ``times[rank][candidate]`` (seconds; inf
    where not measured): the one whose slowest rank is fastest (ties: the
    earlier, better-predicted one). With a ``current`` choice, switch only to
    one at least ``1 / hysteresis`` times faster."""
    worst = slowest(times)
    best = min(range(len(worst)), key=lambda j: (worst[j], j))
    if current is not None and worst[best] > hysteresis * worst[current]:
        return current
    return best


def faster_in_every_cycle(cycles: Sequence[Sequence[Sequence[float]]], a: int, b: int) -> bool:
    """Whether round ``a`` was faster than round ``b`` in every cycle of the
    trial that ran both, by the slowest rank (``cycles[rank][round][k]``:
    seconds of cycle k's step, inf where there is none): the rounds take
    turns, so a cycle's two steps met the same load, and a round that won by
    its best step alone won by the noise of one step. True where no cycle
    ran both (nothing against it)."""
    slowest = [[max(r[c][k] for r in cycles) for k in range(len(cycles[0][c]))] for c in (a, b)]
    pairs = [(x, y) for x, y in zip(*slowest) if x < INF and y < INF]
    return all(x < y for x, y in pairs)


class TrialRounds:
    """The trials' part of :class:`hetcomm.autoplan.AutoPlanner` (whose
    ``__init__`` holds the state these methods read and write: the
    candidates, the rounds' orders and times, the choices)."""

    def _order_of(self, key: str, prune: bool = False) -> List[int]:
        """The candidates of ``key`` in trial order: the current choice first
        (round 0 of a re-check), then by prediction, the guarded lowrank last
        unless it is predicted fastest and a bucket may run it now (round 0
        is what the first trial measures the others against, and chooses
        without them where they are hopeless: :meth:`_skip_hopeless`);
        ``prune``: without those measured hopeless (:attr:`pruned`)."""
        cands = self.candidates[key]
        first = self.decided.get(key)
        if first is not None and self._excluded(cands[first]):
            first = None
        out = self.pruned.get(key, set()) if prune else set()
        rest = [j for j, c in enumerate(cands) if j != first and c[:2] not in out and not self._excluded(c)]
        lead = next((j for j in rest if self._guarded(cands[j][0])), None)
        if lead is not None and not self._blocked(cands[lead]) and cands[lead][2] is not None and \
                all(cands[j][2] is None or cands[lead][2] < cands[j][2] for j in rest if j != lead):
            rest.remove(lead)
            rest.insert(0, lead)
        return rest if first is None else [first] + rest

    def _orders(self, prune: bool = False, fixed: Optional[Dict[str, int]] = None) -> Dict[str, List[int]]:
        """Every bucket's candidates in trial-round order, the rounds paired by
        name. Round 0: each bucket's own first (:meth:`_order_of`: its plan
        as it runs in a re-check, else its best predicted; ``fixed``: the
        candidates buckets already ran in it). Then one round per (mode,
        algorithm) that some bucket offers: every bucket that offers it runs
        it, the others their own first; a round that repeats another is not
        run twice. Those rounds go by their summed prediction, the guarded
        lowrank's last, unless it leads some bucket's order (its first in a
        first trial, its first or second in a re-check): then its round is
        round 0 of a first trial (on every bucket that offers it) or round 1
        of a re-check.

        Why by name: a step's buckets share the links and their collectives
        go out together, so the step a round measures is its plans' together.
        Paired by each bucket's c-th prediction, the cnn task's buckets on the
        2 x 2 testbed at 100 Mbit were ordered int3 across nodes, fp8 across
        nodes, int3 flat (the large) and int3 flat, int3 across nodes, fp8
        across nodes (the small): no round ran int3 across nodes on both, the
        fixed `int3`'s plan (bench/README "A convolutional task"); the wide
        model's lowrank, first on its large bucket and last on its small one,
        never ran on both, whose all-reduces go out together (36-41 ms a step
        there against 31-33: "lowrank's round on every bucket")."""
        own = {k: o for k, o in ((k, self._order_of(k, prune)) for k in self.candidates) if o}
        fixed = {k: j for k, j in (fixed or {}).items() if k in own}

        def name(k: str, j: int) -> Tuple[str, str]:
            return self.candidates[k][j][:2]

        def runs(k: str, n: Tuple[str, str]) -> int:  # n on bucket k, or k's own first
            return next((j for j in own[k] if name(k, j) == n), own[k][0])

        guarded = next((name(k, j) for k, o in own.items() for j in o if self._guarded(name(k, j)[0])), None)
        lead = 1 if self._rechecking else 0
        leads = guarded is not None and any(guarded in [name(k, j) for j in o[:lead + 1]] for k, o in own.items())
        first = {k: fixed.get(k, runs(k, guarded) if leads and not self._rechecking else o[0]) for k, o in own.items()}

        def rank(n: Tuple[str, str]) -> Tuple[int, float]:
            if n == guarded:
                return (-1 if leads else 1), 0.0
            ts = [self.candidates[k][runs(k, n)][2] for k in own]
            return 0, INF if any(t is None for t in ts) else sum(ts)
        names = sorted(dict.fromkeys(name(k, j) for k, o in own.items() for j in o), key=rank)
        if self._for_lowrank and guarded is not None:  # a re-check for lowrank: its round and round 0
            names = [guarded]
        rounds = [first]
        for n in names:
            r = {k: runs(k, n) for k in own}
            if r not in rounds:
                rounds.append(r)
        return {k: [r[k] for r in rounds] if k in own else [] for k in self.candidates}

    def _join(self, key: str) -> None:
        """A bucket planned while a trial runs (DDP hands its buckets over one
        by one in the first step; a resumed bucket whose candidates changed):
        in the trial's first step the rounds are paired again with it, what
        the others ran in round 0 kept; later (their rounds have run) it
        takes its own order."""
        if self.trial_start is not None and self.compressed_steps == self.trial_start:
            self._order = self._orders(fixed={k: o[0] for k, o in self._order.items() if o and k != key})
        else:
            self._order[key] = self._order_of(key)

    def _candidate_in_round(self, key: str, c: int) -> int:
        """The candidate of ``key`` that trial round ``c`` runs (a bucket with
        fewer candidates than rounds runs its first again)."""
        order = self._order[key]
        return order[c] if c < len(order) else order[0]

    def _round_candidates(self, c: int) -> List[Tuple[str, str, Optional[float]]]:
        """What trial round ``c`` runs: each bucket's candidate (buckets with
        candidates to try)."""
        return [self.candidates[k][self._candidate_in_round(k, c)] for k in self._order if self._order[k]]

    def _start_trial(self, full: bool = False) -> None:
        self.trial_start = self.compressed_steps
        self._rechecking = bool(self.decided)
        self._confirming = self._rechecking and self.confirm_at is not None and \
            self.compressed_steps >= self.confirm_at
        self.confirm_at = None  # a trial that starts for another reason measures what it would have
        # a re-check asked for lowrank (the guard's, a confirmation) measures its round against the running plans
        # alone, unless the schedule's is due too: the others were measured by the trial before, and on digits (2 x 2
        # testbed, 100 Mbit), where lowrank cannot win by its margin, such re-checks and the admission took int3 flat
        # from int3 across nodes at steps 40-60 on 7 and 11 runs of 16 (SGD-m, AdamW; bench/README "A re-check for
        # lowrank measures lowrank")
        self._for_lowrank = self._rechecking and not full and (self._confirming or self.lowrank_asks) and \
            self.compressed_steps < self.next_check
        self.lowrank_asks = False
        prune = False
        if self._rechecking:
            self.rechecks += 1
            self.confirms += self._confirming
            prune = not full and (self._confirming or (self.rechecks - self.confirms) % AUTO_FULL_EVERY != 0)
        self._order = self._orders(prune)
        self._step_times, self._times, self._kept, self._skipped = {}, {}, None, None

    def _in_trial(self) -> bool:
        if self.trial_start is None:
            return False
        t, first = self.compressed_steps - self.trial_start, len(self._cycle())
        return t < first or (self._kept is not None and t < first + (AUTO_REPEATS - 1) * len(self._kept))

    def _rounds(self) -> int:
        return max((len(o) for o in self._order.values()), default=0)

    def _cycle(self) -> List[int]:
        """The rounds of the trial's first cycle, in turn."""
        return [c for c in range(self._rounds()) if c not in (self._skipped or ())]

    def _round(self) -> int:
        """This step's trial round: rounds take turns, so a drifting load
        (another job, a warming cache) weighs on every candidate alike."""
        t, cycle = self.compressed_steps - self.trial_start, self._cycle()
        return cycle[t] if t < len(cycle) else self._kept[(t - len(cycle)) % len(self._kept)]

    def _skip_hopeless(self, engine) -> None:
        """The first trial's first cycle, before each round after round 0
        (each bucket's best predicted candidate): every rank all-gathers its
        step time of the rounds run so far; the rounds still to run whose
        *predicted* communication alone (the cost model's time of each
        bucket's collective, summed) is over AUTO_SPAN times the fastest of
        those rounds (by its slowest rank) are left out of the trial. A step
        ends after its buckets' collectives, whose bytes share the links, so
        such a round cannot be faster than the one measured (the topology
        probe's bandwidth at 100 Mbit is 0.88-1.0x the link's: the AUTO_SPAN
        margin is for a probe that misjudged it, and for a codec's time
        measured apart from the model's). A round of fp32 alone has no codec:
        its prediction is the links' time, at most 1 / 0.88 of it, so over
        AUTO_LINK_SPAN (1.25) times a measured round it cannot be the fastest
        (unless that round ran the guarded lowrank, whose own margin decides
        against the next round instead: AUTO_SPAN then).
        fp32 on the wide model at 100 Mbit: one step of 600 ms where fp8's
        takes 165. On the LSTM of ``hetcomm bench train`` (2 x 2 testbed, 100
        Mbit) fp32 is predicted at 109 ms where int3's round 0 took 48-109:
        measured against round 0's first step at 2x, it ran a step of 160-205
        ms in 9 runs of 10; so, in 5 of 10 (bench/README "The LSTM with AdamW
        on an Intel Xeon"). Re-checks measure what they keep (the first
        trial's skipped rounds are pruned, as hopeless, and measured again by
        the full re-checks)."""
        ran = self.compressed_steps - self.trial_start
        cycle = self._cycle()
        _, times, _ = self._gather_round_times(engine)
        worst = slowest(times)
        best = min(cycle[:ran], key=lambda c: (worst[c], c))

        def hopeless(c: int) -> bool:
            cands = self._round_candidates(c)
            if worst[best] == INF or any(cand[2] is None for cand in cands):
                return False
            link_only = all(cand[0] == "none" for cand in cands) and not self._runs_guarded(best)
            return sum(cand[2] for cand in cands) > (AUTO_LINK_SPAN if link_only else AUTO_SPAN) * worst[best]
        self._skipped = (self._skipped or []) + [c for c in cycle[ran:] if hopeless(c)]

    def _cut(self, engine) -> None:
        """After the trial's first cycle: every rank all-gathers its step
        time of each round; the rounds whose slowest rank took over
        AUTO_SPAN times the fastest round's run no more (their one time
        still counts in the decision, which they cannot win). The fastest
        may be lowrank's while it waits for its reading (a rank given): the decision among
        the others then rests on one step each until the re-check
        AUTO_SETTLE steps later measures them again (on the wide model at
        100 Mbit, where lowrank is admitted, repeating them would cost about
        1.4 s: two more steps each of fp8 and bf16 across nodes and of fp8
        flat, at their measured times). Nor do the rounds that
        :meth:`_decide` cannot take for having been no faster than the
        round it keeps in this cycle (:meth:`_cannot_win`); where that
        leaves the kept round alone, the trial ends here."""
        _, times, _ = self._gather_round_times(engine)
        worst = slowest(times)  # each round's one step of this first cycle, by its slowest rank
        best = min((w for w in worst if w < INF), default=INF)
        kept = [c for c in self._cycle() if worst[c] == INF or best == INF or worst[c] <= AUTO_SPAN * best]
        current = self._current_round()
        self._kept = [c for c in kept if not (AUTO_DROP_SLOWER and self._cannot_win(c, current, worst))]
        if AUTO_DROP_SLOWER and self._kept == [current]:
            self._kept = []

    def _current_round(self) -> Optional[int]:
        """The round a decision keeps unless another beats it past the
        hysteresis and in every cycle (:meth:`_decide`): a re-check's
        running plans (round 0, where they may run), a first trial's best
        predicted round without the guarded lowrank; None: none."""
        if self._rechecking:
            return 0 if self._allowed(0) else None
        return next((c for c in range(self._rounds()) if self._allowed(c) and not self._runs_guarded(c)), None)

    def _cannot_win(self, c: int, current: Optional[int], worst: Sequence[float]) -> bool:
        """Whether round ``c``, its step ``worst[c]`` in the trial's first
        cycle (by the slowest rank) no shorter than ``current``'s, can never
        be :meth:`_decide`'s choice: a round that replaces the kept one must
        be faster in every cycle. Not a round with the guarded lowrank
        against a kept round without it (lowrank's margin decides that, not
        the cycles; its times serve its admission too). On digits (2 x 2
        testbed, 100 Mbit) the re-check after step 100 measured lowrank's
        running round at 5.3-5.8 ms a step and int3 across nodes, int3 flat
        and fp8 across nodes at 6.9-13 ms in each of three cycles: two cycles
        of those three, about 30 ms a run (bench/README "A trial's rounds
        that cannot win")."""
        if current is None or c == current or worst[current] == INF:
            return False
        if self._runs_guarded(c) and not self._runs_guarded(current):
            return False
        return worst[c] >= worst[current]

    def _gather_round_times(self, engine, head: Sequence[int] = ()):
        """Every rank all-gathers ``head`` and its step time of each trial
        round in each cycle: (the ranks' heads, each rank's best seconds per
        round, each rank's seconds per round and cycle ``[rank][round][k]``,
        AUTO_REPEATS a round; inf where there is none). A round runs once a
        cycle, so its best is the best of its cycles."""
        import torch

        rounds = self._rounds()
        row = list(head)
        for c in range(rounds):
            ts = self._step_times.get(c, [])[:AUTO_REPEATS]
            row += [int(t * 1e9) for t in ts] + [-1] * (AUTO_REPEATS - len(ts))
        gathered = engine.submit_config(torch.tensor(row, dtype=torch.int64)).wait()
        at = len(head)
        per_cycle = [[[t / 1e9 if t >= 0 else INF for t in r[at + c * AUTO_REPEATS:at + (c + 1) * AUTO_REPEATS]]
                      for c in range(rounds)] for r in gathered.tolist()]
        return gathered[:, :len(head)], [[min(ts) for ts in r] for r in per_cycle], per_cycle

    def _decide(self, engine) -> None:
        """Every rank all-gathers its step time per trial round and cycle (and
        a fingerprint of its candidates); the round whose slowest rank was
        fastest gives every bucket its plan, where it replaces the default
        (a re-check's running plan, a first trial's best predicted round)
        only past the hysteresis and faster in every cycle."""
        keys = sorted(self.candidates)
        rounds = self._rounds()
        names = ";".join(f"{k}:" + ",".join(f"{m}/{a}" for m, a, _ in self.candidates[k]) for k in keys)
        fingerprints, times, cycles = self._gather_round_times(engine, [zlib.crc32(names.encode())])
        if (fingerprints != fingerprints[0]).any():
            raise ValueError("hetcomm: compression='auto' ranks planned different candidates for the same buckets "
                             "(different topologies or options): construct HookState alike on every rank")
        self.round_times = slowest(times)
        judged = [self._judged(r) for r in times]
        # A first trial keeps the best predicted round (the first, lowrank's aside) unless another was measured
        # 1 / AUTO_HYSTERESIS faster, as a re-check keeps the running plan: its steps are the run's first and
        # noisiest, and a choice within the hysteresis sticks at every re-check after.
        current = self._current_round()
        if current is not None and self._runs_guarded(choose(judged)) and not self._runs_guarded(current):
            # toward the guarded lowrank its margin (0.7) asks more than the hysteresis (0.9), not both: by both it
            # had to take 0.63x the current round, and a wide-model run measuring it at 0.636x kept int3 at 1.6x
            # lowrank's step for the rest of the run (away from lowrank both still apply: a band, no flapping)
            current = None
        best = choose(judged, current)
        held = None
        if current is not None and best != current and not faster_in_every_cycle(cycles, best, current):
            # past the hysteresis by its best step but not faster in every cycle: the noise of a step. On digits
            # (2 x 2 testbed, 100 Mbit, SCHED_BATCH) a re-check by the best step alone took int3 flat from int3
            # across nodes (8.26 against 9.40 ms) and the next took it back; by the best step 24 of 96 runs ended
            # on int3 flat (its steps 4-32 % slower), with this rule and the first trial's default 7 of 64, with
            # the default alone 6 of 16 (bench/README "auto's decision: the prediction stands within the
            # hysteresis, a switch faster in every cycle")
            held, best = best, current
        changed = 0
        for k in keys:
            j = self._candidate_in_round(k, best)
            changed += self.decided.get(k, j) != j
            self.decided[k] = j
            # what this trial measured hopeless is left out of the next pruned re-check; what it measured
            # within AUTO_SPAN is back in
            # (by its fastest round: a bucket runs its first in the rounds of names it does not offer)
            pruned, fastest = self.pruned.setdefault(k, set()), {}
            for c in range(rounds):
                i = self._candidate_in_round(k, c)
                fastest[i] = min(fastest.get(i, INF), self.round_times[c])
            for i, t in fastest.items():
                cand = self.candidates[k][i][:2]
                if t > AUTO_SPAN * self.round_times[best] and i != j:
                    pruned.add(cand)
                else:
                    pruned.discard(cand)
            per_bucket = self._times.get(k, {})
            self.measured[k] = [min(per_bucket[i]) if per_bucket.get(i) else None
                                for i in range(len(self.candidates[k]))]
        self.confirm_at = self.compressed_steps + AUTO_CONFIRM if self._rechecking and not self._confirming and \
            self._kept_by_margin(best) else None
        waits = not self._allowed(min(range(len(times[0])), key=lambda c: (self.round_times[c], c)))
        log.info("hetcomm: auto plan: trial round %d of %s (step ms, slowest rank)%s%s; buckets: %s%s", best,
                 ", ".join(f"{1000 * t:.4g}" for t in self.round_times),
                 "" if held is None else f" (round {held} faster by its best step, not in every cycle: round {best} "
                 "kept)",
                 f" - re-planned {changed} bucket(s)" if self._rechecking and changed else "",
                 "; ".join(f"[{k[:24]}] {self.candidates[k][self.decided[k]][0]}/"
                           f"{self.candidates[k][self.decided[k]][1]}" for k in keys),
                 f" (a faster round with lowrank waits for its reading at step {lowrank_share.next_close(self.s.iter)})"
                 if waits else f" (lowrank's round faster, not by its margin: a re-check confirms it {AUTO_CONFIRM} "
                 "steps on)" if self.confirm_at is not None else "")
        self._times, self._step_times = {}, {}
