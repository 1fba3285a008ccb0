"""Mixed-speed ranks: a share of the global batch proportional to each rank's
measured speed, so fast GPUs stop waiting for slow ones.

- :func:`split_batch`: global batch + per-rank throughputs (+ optional caps) ->
  integer local batch sizes summing to the global batch.
- :class:`ThroughputMeter`: samples/s of a rank's own forward+backward
  (smoothed), excluding the time spent waiting for other ranks.
- :class:`UnevenBatchSampler`: a DataLoader ``batch_sampler`` like
  ``DistributedSampler`` with uneven shards: every global batch is one slice of
  the epoch's permutation, cut by the current split.
- :class:`Balancer`: wires them to a :class:`hetcomm.HookState` and rebalances
  every K steps, collectively, so every rank takes the same decision.
"""

from __future__ import annotations

import math
import time
from typing import Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from .topology import group_device


def split_batch(global_batch: int, throughputs: Sequence[float], caps: Optional[Sequence[int]] = None) -> List[int]:
    """Integer local batch sizes, proportional to ``throughputs``, summing to
    ``global_batch``, every rank >= 1 and <= its cap. Rounded to minimise the
    predicted step time, the largest ``size / throughput`` (a tie, which float
    rounding makes of speeds one ulp apart, goes to the faster rank, then the
    lower, so the result is deterministic and a faster rank never gets less)."""
    n = len(throughputs)
    if n == 0:
        raise ValueError("throughputs must name at least one rank")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < n:
        raise ValueError(f"global_batch must be an int >= the number of ranks ({n}), got {global_batch!r}")
    speeds = [float(t) for t in throughputs]
    if not all(math.isfinite(t) and t > 0 for t in speeds):
        raise ValueError(f"throughputs must be finite and > 0, got {list(throughputs)}")
    limit = [global_batch] * n if caps is None else [int(c) for c in caps]
    if len(limit) != n or any(c < 1 for c in limit):
        raise ValueError(f"caps must give every rank a cap >= 1, got {caps!r}")
    if sum(limit) < global_batch:
        raise ValueError(f"caps sum to {sum(limit)} < global_batch {global_batch}: the batch does not fit")
    # Water-filling: ranks whose proportional share exceeds their cap are pinned
    # at the cap; the rest share what is left in proportion to their speed.
    sizes = [1] * n
    pinned = [False] * n
    while True:
        free = [i for i in range(n) if not pinned[i]]
        budget = global_batch - sum(limit[i] for i in range(n) if pinned[i])
        total = sum(speeds[i] for i in free)
        ideal = {i: budget * speeds[i] / total for i in free}
        over = [i for i in free if ideal[i] > limit[i]]
        if not over:
            break
        for i in over:
            pinned[i] = True
    for i in range(n):
        if pinned[i]:
            sizes[i] = limit[i]
    free = [i for i in range(n) if not pinned[i]]
    for i in free:
        sizes[i] = max(1, min(limit[i], math.floor(ideal[i])))
    left = global_batch - sum(sizes)
    # Round to minimise the step, i.e. the slowest rank's time sizes[i] /
    # speeds[i]: each remaining sample goes to the rank that is done first with
    # it (largest remainder can give a slow rank one sample too many: 28 at
    # speeds 100:7 as 26/2 takes 0.286 time units, 27/1 takes 0.27).
    while left > 0:
        room = [i for i in free if sizes[i] < limit[i]]
        if not room:  # pragma: no cover - excluded by the caps check above
            raise ValueError("caps leave no room for the batch")
        i = min(room, key=lambda i: ((sizes[i] + 1) / speeds[i], -speeds[i], i))
        sizes[i] += 1
        left -= 1
    # The floor of one sample per rank can overshoot: take samples back, one
    # at a time, from the rank that finishes last.
    while left < 0:
        i = max((i for i in range(n) if sizes[i] > 1), key=lambda i: (sizes[i] / speeds[i], -speeds[i], -i))
        sizes[i] -= 1
        left += 1
    return sizes


class ThroughputMeter:
    """Smoothed samples/s of this rank's own compute (exponential moving
    average; ``alpha`` weighs the newest measurement)."""

    def __init__(self, alpha: float = 0.3, initial: Optional[float] = None) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.rate: Optional[float] = initial
        self.samples = 0

    def update(self, samples: int, seconds: float) -> None:
        if samples <= 0 or not seconds > 0:
            return
        r = samples / seconds
        self.rate = r if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * r
        self.samples += samples


class UnevenBatchSampler(Sampler[List[int]]):
    """Per-rank batches of uneven size for ``DataLoader(batch_sampler=...)``.

    Each epoch is one permutation of ``range(dataset_len)`` (seeded by ``seed``
    and the epoch, the same on every rank). Step s takes the next
    ``sum(sizes)`` indices and rank r gets its slice. Every rank runs the same
    number of steps; no index is dropped or repeated within an epoch: the
    remainder (``dataset_len % global_batch``) is spread over the last step.
    The split can change for steps not yet produced (:meth:`set_batch_sizes`).
    """

    def __init__(self, dataset_len: int, batch_sizes: Sequence[int], rank: int, seed: int = 0,
                 shuffle: bool = True) -> None:
        if not 0 <= rank < len(batch_sizes):
            raise ValueError(f"rank must be in [0, {len(batch_sizes)}), got {rank}")
        if sum(batch_sizes) > dataset_len:
            raise ValueError(f"global batch {sum(batch_sizes)} exceeds dataset_len {dataset_len}")
        self.dataset_len = dataset_len
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._schedule = [(0, list(batch_sizes))]  # (from step, sizes)
        self._produced = 0  # steps of this epoch already handed out
        self._check(batch_sizes)

    def _check(self, sizes: Sequence[int]) -> None:
        if len(sizes) != len(self._schedule[0][1]) or any(int(b) < 1 for b in sizes):
            raise ValueError(f"batch_sizes must give each of the {len(self._schedule[0][1])} ranks >= 1, got {sizes}")

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_batch_sizes(self, sizes: Sequence[int], from_step: int) -> None:
        """Use ``sizes`` from step ``from_step`` of the current epoch on (and in
        later epochs). The global batch must stay the same."""
        self._check(sizes)
        if sum(sizes) != sum(self._schedule[-1][1]):
            raise ValueError(f"the global batch must stay {sum(self._schedule[-1][1])}, got {sum(sizes)}")
        if from_step < self._produced:
            raise ValueError(f"step {from_step} was already handed out (up to {self._produced - 1})")
        self._schedule.append((from_step, list(sizes)))

    def sizes_at(self, step: int) -> List[int]:
        sizes = self._schedule[0][1]
        for start, s in self._schedule:
            if start <= step:
                sizes = s
        return sizes

    @property
    def global_batch(self) -> int:
        return sum(self._schedule[0][1])

    def __len__(self) -> int:
        return self.dataset_len // self.global_batch

    def _step_sizes(self, step: int, steps: int) -> List[int]:
        sizes = self.sizes_at(step)
        if step == steps - 1:
            rem = self.dataset_len - steps * self.global_batch
            if rem:
                sizes = [a + b for a, b in zip(sizes, split_batch(rem, sizes))] if rem >= len(sizes) else \
                    [a + (1 if i < rem else 0) for i, a in enumerate(sizes)]
        return sizes

    def __iter__(self) -> Iterator[List[int]]:
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + self.epoch)
            perm = torch.randperm(self.dataset_len, generator=gen, device="cpu")
        else:
            perm = torch.arange(self.dataset_len)
        steps = len(self)
        pos = 0
        self._produced = 0
        for step in range(steps):
            sizes = self._step_sizes(step, steps)
            start = pos + sum(sizes[:self.rank])
            pos += sum(sizes)
            self._produced = step + 1
            yield perm[start:start + sizes[self.rank]].tolist()
        # a new epoch starts with the latest split
        self._schedule = [(0, self._schedule[-1][1])]
        self._produced = 0


class Balancer:
    """Throughput-proportional batch split for a DDP training loop.

    ::

        state = hetcomm.HookState("onebit"); ddp.register_comm_hook(state, hetcomm.hook)
        bal = hetcomm.balance.Balancer(state, global_batch=256, dataset_len=len(ds))
        loader = DataLoader(ds, batch_sampler=bal.sampler)
        for epoch in range(E):
            bal.sampler.set_epoch(epoch)
            for x, y in loader:
                with bal.step(len(x)):          # tells the hook the batch size, times this rank's compute
                    loss_fn(ddp(x), y).backward()
                opt.step(); opt.zero_grad()

    Every ``rebalance_every`` steps the ranks all-gather their measured speeds
    (on the default process group, between steps) and adopt a new split when
    some rank's share would change by more than ``threshold`` (hysteresis: no
    flapping on noise). The new split applies from ``lag`` steps later, the
    same step on every rank (DataLoader prefetching makes a later start safe).
    """

    def __init__(self, state, global_batch: int, dataset_len: int, *, rebalance_every: int = 20,
                 threshold: float = 0.1, lag: int = 4, caps: Optional[Sequence[int]] = None,
                 initial_speeds: Optional[Sequence[float]] = None, seed: int = 0, alpha: float = 0.3) -> None:
        if rebalance_every < 1 or lag < 0 or not 0 <= threshold < 1:
            raise ValueError("need rebalance_every >= 1, lag >= 0 and 0 <= threshold < 1")
        self.state = state
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.caps = list(caps) if caps is not None else None
        self.rebalance_every = rebalance_every
        self.threshold = threshold
        self.lag = lag
        self.meter = ThroughputMeter(alpha)
        speeds = list(initial_speeds) if initial_speeds is not None else [1.0] * self.world
        self.sizes = split_batch(global_batch, speeds, self.caps)
        self.sampler = UnevenBatchSampler(dataset_len, self.sizes, self.rank, seed=seed)
        self.steps = 0
        self.history: List[tuple] = []  # (step, sizes, measured samples/s per rank) of every adopted split

    def step(self, batch_size: int) -> "_StepTimer":
        self.state.set_local_batch_size(batch_size)
        return _StepTimer(self, batch_size)

    def _record(self, batch_size: int, seconds: float) -> None:
        self.meter.update(batch_size, seconds)
        self.steps += 1
        if self.world > 1 and self.steps % self.rebalance_every == 0:
            self.rebalance()

    def rebalance(self) -> bool:
        """Collective: all ranks must call it at the same step. Returns whether the split changed."""
        device = group_device()  # the default group: gloo on CPU, or NCCL on this rank's GPU
        mine = torch.tensor([self.meter.rate or 0.0, float(self.sampler._produced)], dtype=torch.float64, device=device)
        gathered = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(self.world)]
        dist.all_gather(gathered, mine)
        speeds = [float(g[0]) for g in gathered]
        produced = max(int(g[1]) for g in gathered)  # DataLoader prefetch may differ: take the furthest
        if not all(s > 0 for s in speeds):
            return False
        proposal = split_batch(sum(self.sizes), speeds, self.caps)
        change = max(abs(p - s) / s for p, s in zip(proposal, self.sizes))
        if change <= self.threshold:
            return False
        from_step = produced + self.lag
        self.sampler.set_batch_sizes(proposal, from_step)
        self.sizes = proposal
        self.history.append((self.steps, list(proposal), speeds))
        return True


class _StepTimer:
    """Times this rank's compute for one step: from entering the block to the
    hook call for DDP's last bucket (after that a rank only waits for others).
    On a GPU, between CUDA events: from one recorded on entering to the one the
    hook records on the backward stream at the last bucket (the host only
    queues the kernels)."""

    def __init__(self, balancer: Balancer, batch_size: int) -> None:
        self.b = balancer
        self.batch_size = batch_size

    def __enter__(self):
        self.t0 = time.monotonic()
        self.step = self.b.state.iter
        self.start_event = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.start_event = torch.cuda.Event(enable_timing=True)
            self.start_event.record()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.b._record(self.batch_size, self._gpu_seconds() or self._host_seconds())
        return False

    def _host_seconds(self) -> float:
        end = self.b.state.last_bucket_time or time.monotonic()
        if end < self.t0:
            end = time.monotonic()
        return end - self.t0

    def _gpu_seconds(self) -> Optional[float]:
        last = self.b.state.last_bucket_event
        if self.start_event is None or last is None or last[0] != self.step:
            return None
        try:
            last[1].synchronize()
            return self.start_event.elapsed_time(last[1]) / 1000.0
        except RuntimeError:  # events on two devices (set_device not called): the host's clock
            return None
