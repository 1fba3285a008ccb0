"""What a bucket's error feedback owes when its plan or DDP's bucket layout
changes (a mixin of :class:`hetcomm.buckets.BucketStates`).

A plan switch folds the old codec's residuals into the bucket's *carry*
(this rank's part of the sum not yet delivered, added at the bucket's next
reduction); a rebuilt layout splits what the old buckets owed by parameter
and each new bucket adopts its parameters' parts as its carry. Every rank
sees the same plans and layouts, so every rank moves its debts alike.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from . import _C
from .bucket_keys import Signature, overlapping, sig_of

log = logging.getLogger("hetcomm")


class BucketDebts:
    """The carry's bookkeeping; the host class holds ``residuals``,
    ``server_residuals``, ``carry``, ``_carry_sent``, ``plan_of``, ``_loose``,
    ``_adopted``, ``_stores()``, ``_size(n)`` and ``_numel_of(sig)``."""

    def _carry_into_residual(self, key: str, numel: int, device: torch.device) -> None:
        """A plan whose worker residual is the whole bucket's, in the carry's
        units (lowrank, flat or across nodes; onebit, fp8 and int3 flat: each
        encodes x / divisor + residual, and a carry joins x as its contribution
        times the divisor), takes the bucket's carry into its residual here:
        the carry becomes the residual where there is none yet (after a plan
        switch, the usual case), else is added to it. The same sum, without
        the comm thread's copy of the bucket to add the carry to, the copy
        back and the carry's clearing, and without a fresh residual's zeros:
        on the wide model (4 loopback ranks on 2 cores) a lowrank step after
        an int3 step took 5-7 ms more CPU a rank than a steady one, 2.5 with
        this (bench/README "A carry joins the residual"). A non-finite step
        leaves the residual as it was (lowrank does not write it; the others
        put it back), so what the carry owed stays owed, as a held carry did."""
        carry = self.carry.pop(key, None)
        if carry is None:
            return
        self._carry_sent.pop(key, None)
        r = self.residuals.get(key)
        if r is None or r.numel() != numel:
            self.residuals[key] = carry.to(device)
        else:
            r.add_(carry.to(device))

    def _owe(self, key: str, numel: int, owed: Optional[torch.Tensor], offset: int, device) -> None:
        """Adds what a residual held back (this rank's part of the sum, at
        ``offset`` in the bucket; None: nothing) to the bucket's carry, made
        if it has none."""
        carry = self.carry.get(key)
        if carry is None and owed is not None and owed.numel() == numel:  # a whole bucket's residual: it is the carry
            carry = owed.to(device)
        else:
            carry = torch.zeros(numel, dtype=torch.float32, device=device) if carry is None else carry.to(device)
            if owed is not None:
                carry.narrow(0, offset, owed.numel()).add_(owed.to(device))
        self.carry[key] = carry
        self._carry_sent.pop(key, None)

    def _fold(self, key: str, numel: int, old, device, world: int, rank: int, node_of) -> None:
        mode, hierarchical = old
        worker_off, server_off = _C.state_offsets(numel, world, rank, list(node_of) if hierarchical else [],
                                                  hierarchical)
        r, s = self.residuals.pop(key, None), self.server_residuals.pop(key, None)
        self._owe(key, numel, r, 0 if r is None or r.numel() == numel else worker_off, device)  # lowrank's: whole
        self._owe(key, numel, s, server_off, device)
        # lowrank's Q stays: it is no debt but the warm start of the power iteration, the same on every rank, and a
        # bucket back on lowrank (a trial's or a re-check's next lowrank round) goes on from it, at a changed rank by
        # its first columns (lowrank_parts). Drawn afresh there, rank 4's first step on the wide model's gradient
        # took 0.12-0.15 less of its energy, on average (bench/README "lowrank's Q kept through a plan switch")
        self.plan_of.pop(key, None)

    def adopt(self, sig: Signature, key: str, numel: int, device: torch.device, world: int, rank: int,
              node_of: Sequence[int]) -> None:
        """Before a bucket's first reduction: when buckets of an earlier layout
        held some of its parameters (DDP rebuilt its buckets), what their error
        feedback still owes (residuals, server residuals, carries: this rank's
        part of the sums not yet delivered) is split by parameter and the
        bucket takes its parameters' parts as its carry, added to its next
        reduction. The earlier buckets' other state goes: lowrank's Q and the
        compressed momentum (a new bucket's momentum starts from the
        optimizer's buffer, see HookState). Every rank sees the same layouts,
        so every rank adopts alike.

        Once a bucket has searched, its later steps skip the search (a dense
        plan keeps no state under its key, and the search over every store
        cost 30-40 us a bucket a step on 7-11 buckets, all buckets' keys each
        time; bench/README "The hook's own CPU a bucket") until a
        bucket that shares a parameter with it searches (only such a bucket
        can leave state that is its owner), a release or a load."""
        if key in self._adopted and not self._loose:
            return
        if any(key in store for store in self._stores()):
            return
        mine = set(sig)
        self._adopted = {k for k in self._adopted if mine.isdisjoint(sig_of(k))}
        owners = {k for store in self._stores() for k in overlapping(sig, store)}
        for old in sorted(owners):
            self._release(old, device, world, rank, node_of)
        pieces = [self._loose.pop(n, None) for n in sig]
        self._adopted.add(key)
        if all(p is None for p in pieces):
            return
        held = self._numel_of(sig)
        if numel != held:
            log.warning("hetcomm: a rebuilt bucket of %d elements holds parameters of %d: what the earlier buckets' "
                        "error feedback owed its parameters is dropped", numel, held)
            return
        self.carry[key] = torch.cat([p.to(device) if p is not None
                                     else torch.zeros(self._size(n), dtype=torch.float32, device=device)
                                     for n, p in zip(sig, pieces)])
        self._carry_sent.pop(key, None)

    def _release(self, key: str, device: torch.device, world: int, rank: int, node_of: Sequence[int]) -> None:
        """A bucket of an earlier layout: its owed error feedback into the
        per-parameter pool, the rest of its state dropped."""
        self._adopted.clear()  # a layout changed: every bucket looks for its owners again
        sig = sig_of(key)
        numel = self._numel_of(sig)
        if key in self.plan_of:  # residuals (of any codec) into the carry, where they belong in the bucket
            self._fold(key, numel, self.plan_of[key], device, world, rank, node_of)
        carry = self.carry.get(key)
        self._carry_sent.pop(key, None)  # sent and added already: zero by now (the reduction zeroes it)
        for store in self._stores():
            store.pop(key, None)
        if carry is None:
            return
        if carry.numel() != numel:
            log.warning("hetcomm: a bucket of %d elements held parameters of %d: what its error feedback owed is "
                        "dropped at DDP's rebuild", carry.numel(), numel)
            return
        off = 0
        for n in sig:
            size = self._size(n)
            self._loose[n] = carry.narrow(0, off, size)
            off += size
