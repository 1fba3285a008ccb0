"""What HookState agrees on with the other ranks before its first bucket: the
process group, the comm engine (hetcomm's own NCCL communicator or the
process group), every rank's options and device capabilities (one
all-gather; a mismatch is the same ValueError on every rank), the candidate
modes of ``compression="auto"`` and the measured topology."""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from datetime import timedelta
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from . import _C, autoplan, options, plan, topology

log = logging.getLogger("hetcomm")

_live_states: "weakref.WeakSet[Any]" = weakref.WeakSet()  # HookStates with an engine or a group of their own
_nccl_count = 0  # NCCL communicators made by this process (the same sequence on every rank)


@atexit.register
def _close_states() -> None:
    # Stop comm threads before the interpreter goes away (they take the GIL
    # to complete futures), and let go of process groups while Python can
    # still free them: a gloo group freed during finalization aborts.
    for state in list(_live_states):
        state.close()
    destroy_doomed()


#: Groups of states freed by the garbage collector, destroyed at the next safe point (destroy_own_group)
_doomed: list = []


def destroy_own_group(group, now: bool = True) -> None:
    """Frees a gloo group a HookState made for itself once its comm thread
    stopped (a local act: no rank waits for another), so that a process
    making many states (a sweep, a notebook) does not keep each one's gloo
    threads and sockets (3 and 5 a state, measured) until
    ``destroy_process_group()``. Any other backend's group is left to that:
    an NCCL communicator's abort may be collective. ``now`` False (a state
    freed by the garbage collector, which runs at whatever allocation set it
    off, inside c10d's own ``new_group`` too): it is destroyed at the next
    state's first group, the next ``close()`` or exit (:func:`destroy_doomed`)."""
    _doomed.append(group)
    if now:
        destroy_doomed()


def destroy_doomed() -> None:
    """Destroys the groups :func:`destroy_own_group` was given, those put off first."""
    while _doomed:
        group = _doomed.pop(0)
        if not dist.is_initialized():
            continue  # destroy_process_group() ran: every group went with it
        try:
            if dist.get_backend(group) == "gloo":
                dist.destroy_process_group(group)
        except (ValueError, RuntimeError):
            pass  # not a group c10d knows any more


def inside_c10d() -> bool:
    """Whether c10d's Python code (``torch.distributed.distributed_c10d``:
    ``new_group``, ``destroy_process_group``) is on the stack: a state freed
    by the garbage collector from inside it has its group destroyed later,
    not in the middle of c10d's bookkeeping of another. (A CI run once failed
    in ``new_group``'s ``connectFullMesh``, a peer closing the connection,
    where a collection could have freed a state; the failure itself was a
    group destroyed on fast ranks while a slow one still connected, now
    closed by the barrier in ``_group``.)"""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.distributed.distributed_c10d":
            return True
        frame = frame.f_back
    return False


def across_nodes(topo) -> bool:
    """Whether a compressed mode left at the default algorithm runs its
    compressed buckets hierarchically on ``topo``: several nodes, the same
    number of ranks on each, more than one (with one rank a node the
    hierarchy is the flat exchange; with unequal nodes it does not apply)."""
    return equal_nodes_of_several(topo.node_ids)


def equal_nodes_of_several(node_of: list) -> bool:
    """:func:`across_nodes`' rule on each rank's node id."""
    per_node = {node_of.count(n) for n in set(node_of)}
    return len(per_node) == 1 and len(set(node_of)) > 1 and per_node != {1}


def link_loads(node_of: list) -> Tuple[float, float]:
    """Each bucket's share on each way of a node's link: gloo's ring over all
    W ranks (ranks numbered by node; at least this), the hierarchy over N
    nodes: 2 (W - 1) / W and 2 (N - 1) / N."""
    world, nodes = len(node_of), len(set(node_of))
    return 2 * (world - 1) / world, 2 * (nodes - 1) / nodes


def default_group_timeout() -> Optional[timedelta]:
    """The default process group's timeout (None where the backend hides it)."""
    try:
        pg = dist.group.WORLD
        return pg._get_backend(topology.group_device(pg)).options._timeout
    except Exception:
        return None


def _moves_cuda_with_nccl(group) -> bool:
    """Whether ``group`` sends CUDA tensors with NCCL ("nccl" or
    "cpu:gloo,cuda:nccl"); gloo for CUDA tensors is the user's choice to keep."""
    backend = str(dist.get_backend(group)).lower()
    if ":" not in backend:
        return backend == "nccl"
    return any(part.strip() == "cuda:nccl" for part in backend.split(","))


def _device_supports_bf16(device: torch.device) -> bool:
    """CPU counts as bf16-capable; CUDA needs compute capability >= 8.0."""
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return major >= 8
    return True


class Negotiation:
    """HookState's first-step agreement and its comm engine (a mixin: the
    attributes are HookState's)."""

    def _rank(self) -> int:
        return self._rank_and_world()[0]

    def _world(self) -> int:
        return self._rank_and_world()[1]

    def _rank_and_world(self) -> Tuple[int, int]:
        if self._placement is None:
            group = self._group()
            self._placement = (dist.get_rank(group), dist.get_world_size(group))
        return self._placement

    def _group(self) -> dist.ProcessGroup:
        if self._closed:
            raise RuntimeError("hetcomm: this HookState was closed (HookState.close() was called): make a new one")
        if self._process_group is None:
            if not dist.is_initialized():
                raise RuntimeError("hetcomm: torch.distributed is not initialized (call init_process_group first)")
            destroy_doomed()  # (here, not inside new_group: a state freed meanwhile waits for the next)
            group = dist.new_group(timeout=self._timeout or default_group_timeout())
            if dist.get_backend(group) == "gloo":
                # A gloo group this state may destroy on its own (destroy_own_group) is connected on every rank
                # before any rank goes on: new_group returns on a rank once its own pairs connected, and a state
                # dropped or closed at once (a GradScaler holds it weakly) destroyed the group under a slower
                # rank still connecting ("Connection closed by peer" in its connectFullMesh; a CI flake: 15 in 200
                # runs of test_amp's fixture with a core kept busy, none in 100 with this barrier)
                dist.barrier(group=group)
            self._process_group = group
            self._own_group = os.getpid()
            _live_states.add(self)
        return self._process_group

    def _drain(self) -> None:
        if self._engine is not None:
            self._engine.drain()

    def _ensure_engine(self, device: Optional[torch.device] = None):
        """The comm engine, made for the first bucket's device: hetcomm's own
        NCCL communicator for CUDA buckets (transport "auto" in a CUDA build),
        else the process group, with control tensors where it takes them."""
        if self._engine is None:
            device = device if device is not None else torch.device("cpu")
            if device.type == "cuda" and self.transport == "auto" and _C.build_info()["cuda"] and \
                    _moves_cuda_with_nccl(self._group()):
                self._engine = _C.Engine.with_nccl(self._nccl_transport(device))
            else:
                self._engine = _C.Engine(self._group(), topology.group_device(self._group(), device))
            _live_states.add(self)
        return self._engine

    def _nccl_transport(self, device: torch.device):
        """hetcomm's own communicator: rank 0's unique id travels through the
        default group's store, under a key every rank derives the same way."""
        global _nccl_count
        _nccl_count += 1
        store = dist.distributed_c10d._get_default_store()
        timeout = (self._timeout or default_group_timeout())
        return _C.NcclTransport(store, f"hetcomm/nccl/{_nccl_count}", dist.get_rank(self._group()),
                                dist.get_world_size(self._group()), device.index or 0,
                                timeout.total_seconds() if timeout else 600.0)

    def _negotiate(self, bucket_device: torch.device) -> None:
        """First step: all-gather the options and device capabilities; every
        rank raises the same ValueError if any option differs."""
        engine = self._ensure_engine(bucket_device)
        cfg = options.config(self)
        capable = _device_supports_bf16(bucket_device)
        own = [v for _, v in cfg] + [int(capable), options.precision_code(self.precision), topology.node_code()]
        gathered = engine.submit_config(torch.tensor(own, dtype=torch.int64)).wait()
        self._forced_algo = options.check_agreement(cfg, gathered)
        node_of = topology.node_ids(gathered[:, len(cfg) + 2].tolist())
        engine.set_nodes(node_of)  # stats()' bytes across nodes
        self._hint_exact_hierarchy(node_of, bucket_device)
        if self.pack and not _C.build_info()["zstd"]:
            log.warning("hetcomm: pack=True, but this rank found no libzstd (libzstd.so.1): every rank sends its "
                        "onebit, fp8 and int3 messages raw; install zstd's library (e.g. apt install libzstd1)")
        bf16_everywhere = bool(gathered[:, len(cfg)].all())
        if self._scaler is not None:
            self.precisions = [options.precision_name(int(c)) for c in gathered[:, len(cfg) + 1]]
            log.info("hetcomm: compute precision per rank: %s", ", ".join(
                f"{r} {p}" for r, p in enumerate(self.precisions)))
        self._weighted = self._local_batch is not None
        if self.compression == "auto":
            auto = self._planner.auto
            modes = self.candidates or autoplan.safe_modes(self._attached, bf16_everywhere,
                                                          self._total_steps is not None)
            if "bf16" in modes and not bf16_everywhere:
                raise ValueError("hetcomm: candidates include 'bf16' but some rank's device has no native bf16 "
                                 "(CUDA compute capability < 8.0): use 'fp16' there")
            auto.modes = tuple(modes)
            if not self.candidates and self._attached is None:
                # lowrank of the gradient: offered on the reading of its rank's share (hetcomm.lowrank_guard.Guard)
                auto.offer_guarded()
            if "lowrank" not in auto.modes:
                self._rounds.settle()  # no lowrank buckets: nothing to hold
            log.info("hetcomm: compression='auto' chooses per bucket among %s%s", ", ".join(auto.modes),
                     " (lowrank while the ranks' share readings keep it: steps 20-30 first%s)" % (
                         f", at rank {auto.guard.provisional_rank} until then" if auto.guard.provisional else "")
                     if auto.guard is not None else "")
        if (self.algorithm in ("auto", "ring", "hierarchical") or self.compression == "auto" or
                self._algorithm_default) and self.topology is None:
            self._detect_topology(bucket_device)
        if self._algorithm_default:
            self._across_nodes = across_nodes(self.topology)
            if self._across_nodes and self._rank() == 0:
                log.info("hetcomm: %d nodes x %d ranks: compression %r runs across nodes only (float32 inside a "
                         "node, the hierarchical algorithm); algorithm='native' compresses every rank's exchange",
                         self.topology.num_nodes, self.topology.ranks_per_node(), self.compression)
        self._packed_modes = plan.packed_by_default(self.topology)  # once: packs() is per bucket and step
        self._lowrank_wire_default = plan.lowrank_wire_by_default(self.topology)
        if self.compression == "auto-precision":
            self.resolved_compression = "bf16" if bf16_everywhere else "fp16"
        self._warn_gradient_sign_under_momentum()
        self._negotiated = True

    def _hint_exact_hierarchy(self, node_of: list, bucket_device: torch.device) -> None:
        """``compression="none"`` at its default algorithm sums as
        ``allreduce_hook`` does, on the group's own all-reduce. On gloo over
        several nodes of the same number (> 1) of ranks that is a ring over
        every rank, which puts 2 (W - 1) / W of each bucket on each way of a
        node's link, where ``algorithm="hierarchical"`` (float32 sums inside
        the nodes first, the same float32 sum in another order) puts 2 (N -
        1) / N: 1.5x against 1x on 2 nodes x 2 ranks. The ``hetcomm`` logger
        says so once at INFO, on rank 0 (README "A compressed mode
        compresses what crosses nodes")."""
        if self.compression != "none" or not self._algorithm_left or self._rank() != 0 or \
                not equal_nodes_of_several(node_of):
            return
        if bucket_device.type == "cuda" and _moves_cuda_with_nccl(self._group()):
            return  # NCCL's own all-reduce plans its rings and trees by the topology
        log.info("hetcomm: compression='none' sums as allreduce_hook does, on gloo's all-reduce over all %d ranks: "
                 "at least %.2gx of each bucket on each way of a node's link to the others; "
                 "algorithm='hierarchical' sums inside each node first and puts %.2gx there (the same float32 sum, "
                 "added in another order)", len(node_of), *link_loads(node_of))

    def _warn_gradient_sign_under_momentum(self) -> None:
        """onebit of the *gradient* under an optimizer that keeps a momentum
        of it (seen where the state follows its rate: ``follow_lr``, as
        Lightning's strategy does for an SGD): measured to miss fp32's
        quality (README "Limits"); the ``hetcomm`` logger says so once, on
        rank 0, naming the fixes."""
        opt = self._lr_source() if self._lr_source is not None else None
        if self.compression != "onebit" or self._attached is not None or opt is None or self._rank() != 0:
            return
        groups = getattr(opt, "param_groups", [])
        momentum = max((float(g.get("momentum", 0) or 0) for g in groups), default=0.0)
        kind = f"SGD with momentum {momentum:g}" if momentum > 0 else \
            type(opt).__name__ if any("betas" in g for g in groups) else None
        if kind is not None:
            log.warning("hetcomm: compression='onebit' compresses the gradient, and the optimizer (%s) keeps a "
                        "momentum of it: measured in hetcomm bench train, that misses fp32's quality (over twice "
                        "fp32's loss on the regression task). Compress the momentum instead, "
                        "state.attach_optimizer(opt, total_steps=N), or use compression='auto'", kind)

    def _detect_topology(self, device: Optional[torch.device] = None) -> None:
        # A fixed ring or hierarchy needs the nodes only; the links are measured for the planner's predictions
        measure = self.algorithm == "auto" or self.compression == "auto"
        self.topology = topology.detect(self._group(), device, measure=measure)
        if self.algorithm == "hierarchical" and self.topology.ranks_per_node() is None:
            raise ValueError("algorithm 'hierarchical' needs the same number of ranks on every node, found "
                             f"{self.topology.nodes}")
        # (lowrank's hierarchy sums its factors inside the node too: it compresses on one node)
        if self.algorithm == "hierarchical" and self.topology.num_nodes == 1 and self.topology.world > 1 and \
                self.compression in plan.COMPRESSED + options.CASTS and self.compression != "lowrank":
            log.warning("hetcomm: algorithm 'hierarchical' with all %d ranks on one node (%s): its sum is in fp32 "
                        "inside a node and nothing crosses nodes, so compression %r sends every bucket in fp32 "
                        "here; algorithm='native' compresses on one node (a node is a hostname or HETCOMM_NODE)",
                        self.topology.world, self.topology.nodes[0], self.compression)
        self._ensure_engine().set_topology(self.topology.ring_order(), self.topology.node_ids)
