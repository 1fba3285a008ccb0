"""A simulated mixed cluster on one Linux machine.

- Mixed links: :class:`Cluster` builds one network namespace per node, joined
  through veth pairs to a bridge namespace, each node's link shaped with
  ``tc tbf`` (netem is not available here: no delay emulation); ranks of one
  node share its loopback. ``hetcomm testbed --nodes 2 --ranks-per-node 2
  --inter-node-rate 100mbit -- CMD`` runs CMD once per rank with the
  torch.distributed env:// variables set.
- Mixed speeds: per-rank CPU quotas (cgroup v1 ``cpu.cfs_quota_us`` or v2
  ``cpu.max``), so ranks really run at different speeds.
- Scheduling (``--sched batch``): every rank under SCHED_BATCH, which a
  cluster's ranks, each on cores of its own, are closer to than ranks
  sharing a few cores under the default policy (:data:`SCHED_POLICIES`).

:func:`hetcomm.launch.spawn_ranks` runs local ranks under such quotas.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence, Tuple

from . import topology

_V1 = "/sys/fs/cgroup/cpu"
_V2 = "/sys/fs/cgroup"
_PERIOD_US = 10_000  # a short period: throttling in small slices, not 75 ms stalls

# The ranks' scheduling policy. Under the default one (SCHED_OTHER), a rank's
# write to a peer on this machine wakes the peer's gloo thread, which then
# preempts the writer; where the writer held a gloo pair's lock (gloo takes it
# around each write), that pair's event loop polls its socket without pause
# until the writer runs again (gloo's Pair::handleEvents gives up on a lock it
# cannot take, and epoll reports the unread data again at once): measured at 1-4
# ms of one core about once a step on 4 ranks sharing 2 cores. On a cluster each
# rank has cores of its own, and no rank wakes another's threads on its cores.
# SCHED_BATCH wakeups do not preempt, so ranks that share a few cores run closer
# to that (bench/README "The testbed's scheduler").
SCHED_POLICIES = {name: getattr(os, const) for name, const in (("normal", "SCHED_OTHER"), ("batch", "SCHED_BATCH"))
                  if hasattr(os, const)}  # Linux's: none elsewhere, and importing this module still works there


def sched_policy() -> str:
    """This process's scheduling policy by the names of :data:`SCHED_POLICIES`
    (another Linux policy by its own, "idle", "fifo", "rr"); results record it."""
    if not hasattr(os, "sched_getscheduler"):
        return "unknown"
    policy = os.sched_getscheduler(0)
    names = {getattr(os, k): k[6:].lower() for k in ("SCHED_IDLE", "SCHED_FIFO", "SCHED_RR") if hasattr(os, k)}
    names.update({v: k for k, v in SCHED_POLICIES.items()})
    return names.get(policy, str(policy))


def cpu_quota_support() -> Tuple[bool, str]:
    """(usable, reason): whether this process may create CPU-quota cgroups."""
    if os.geteuid() != 0:
        return False, "CPU quotas need root (cgroup directories are root-owned)"
    if os.path.exists(os.path.join(_V1, "cpu.cfs_quota_us")) and os.access(_V1, os.W_OK):
        return True, "cgroup v1 cpu controller"
    if os.path.exists(os.path.join(_V2, "cgroup.controllers")):
        with open(os.path.join(_V2, "cgroup.controllers")) as f:
            if "cpu" in f.read().split() and os.access(_V2, os.W_OK):
                return True, "cgroup v2 cpu.max"
    return False, "no writable cgroup cpu controller on this machine"


class CpuQuota:
    """One cgroup limited to ``cpus`` cores' worth of time (0.25 = a quarter core)."""

    def __init__(self, name: str, cpus: float) -> None:
        ok, why = cpu_quota_support()
        if not ok:
            raise RuntimeError(f"hetcomm testbed: cannot set CPU quotas: {why}")
        if not cpus > 0:
            raise ValueError(f"rank cpu quota must be > 0, got {cpus}")
        self.v1 = why.startswith("cgroup v1")
        self.path = os.path.join(_V1 if self.v1 else _V2, name)
        os.makedirs(self.path, exist_ok=True)
        quota = max(1000, int(cpus * _PERIOD_US))  # the kernel minimum is 1 ms
        if self.v1:
            self._write("cpu.cfs_period_us", str(_PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
        else:
            self._write("cpu.max", f"{quota} {_PERIOD_US}")

    def _write(self, file: str, value: str) -> None:
        with open(os.path.join(self.path, file), "w") as f:
            f.write(value)

    def add_self(self) -> None:
        self._write("cgroup.procs", str(os.getpid()))

    def remove(self) -> None:
        root = os.path.dirname(self.path)
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                pids = f.read().split()
            for pid in pids:  # anything left goes back to the root group
                try:
                    with open(os.path.join(root, "cgroup.procs"), "w") as f:
                        f.write(pid)
                except OSError:
                    pass
            os.rmdir(self.path)
        except FileNotFoundError:
            pass


# ---- network namespaces: nodes joined by shaped links --------------------------------
def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


def netns_support() -> Tuple[bool, str]:
    """(usable, reason): whether this process may build network namespaces."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    name = f"hcprobe{os.getpid()}"
    r = _sh("ip", "netns", "add", name, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    _sh("ip", "netns", "del", name, check=False)
    return True, "ok"


def tbf_burst(rate: str) -> str:
    """The default token-bucket burst of a link of ``rate``: 1 ms of it, at least 8 KB.

    A link's bucket fills while the ranks compute, and a message under the
    burst then leaves at once, where a real link serializes it at its rate:
    the burst is time a step gets for free, at most once a step. 1 ms of the
    rate is the least with which tbf still reaches it here (bulk 1 MiB-16 MiB
    transfers: 1gbit at 0.97 of it with 1 ms, 0.54 with 0.13 ms; 100mbit at
    0.89 with 0.65-1.3 ms, 0.94 with 4 ms). Until 2026-12-06 the default was
    4 ms (50 KB at 100mbit): digits' int3 step on 2 nodes x 1 rank read 3.17
    ms under it and 4.69 under 1.3 ms, PowerSGD's 3.2 and 3.1 (bench/README
    "The testbed's burst")."""
    bits = _rate_bits(rate)
    return f"{max(64_000, bits // 1000) // 1000}kbit"


def check_burst(burst: str, name: str = "inter_burst") -> None:
    """ValueError naming ``name`` unless tc burst ``burst`` (bits) holds one 1514-byte frame."""
    if _rate_bits(burst) < 8 * 1514:
        raise ValueError(f"{name} must hold one 1514-byte frame (12112bit or more), got {burst!r}")


def _rate_bits(rate: str) -> int:
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for u, m in units.items():
        if rate.endswith(u):
            return int(float(rate[: -len(u)]) * m)
    raise ValueError(f"rate must end in bit, kbit, mbit or gbit, got {rate!r}")


class Cluster:
    """``nodes`` network namespaces, each joined to a bridge namespace by a
    veth pair whose two ends are shaped with tbf to ``inter_rate`` (None: not
    shaped). Ranks on one node talk over that namespace's loopback. Always
    cleaned up (namespaces take their veths and qdiscs with them)."""

    SUBNET = "10.77.0"

    def __init__(self, nodes: int, inter_rate: Optional[str] = None, inter_burst: Optional[str] = None) -> None:
        if nodes < 2:
            raise ValueError("a testbed cluster needs nodes >= 2 (one node is plain loopback)")
        if nodes > 200:
            raise ValueError("at most 200 nodes")
        if inter_rate is not None:
            _rate_bits(inter_rate)
        if inter_burst is not None:
            if inter_rate is None:
                raise ValueError("inter_burst needs inter_rate: an unshaped link has no token bucket")
            check_burst(inter_burst)
        self.nodes = nodes
        self.inter_rate = inter_rate
        self.inter_burst = inter_burst or (tbf_burst(inter_rate) if inter_rate else None)
        tag = f"hc{os.getpid() % 100000}"
        self.bridge_ns = f"{tag}br"
        self.node_ns = [f"{tag}n{i}" for i in range(nodes)]
        self.created: List[str] = []

    def address(self, node: int) -> str:
        return f"{self.SUBNET}.{node + 1}"

    def ifname(self, node: int) -> str:
        return f"vn{node}"

    def __enter__(self) -> "Cluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _shape(self, ns: str, dev: str) -> None:
        if self.inter_rate:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.inter_rate,
                "burst", self.inter_burst, "latency", "100ms")

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.bridge_ns)
        self.created.append(self.bridge_ns)
        b = self.bridge_ns
        _sh("ip", "netns", "exec", b, "ip", "link", "add", "br0", "type", "bridge")
        _sh("ip", "netns", "exec", b, "ip", "link", "set", "br0", "up")
        _sh("ip", "netns", "exec", b, "ip", "link", "set", "lo", "up")
        for i, ns in enumerate(self.node_ns):
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            # create the pair inside the bridge namespace, then move one end out
            _sh("ip", "netns", "exec", b, "ip", "link", "add", f"vb{i}", "type", "veth", "peer", "name", self.ifname(i))
            _sh("ip", "netns", "exec", b, "ip", "link", "set", self.ifname(i), "netns", ns)
            _sh("ip", "netns", "exec", b, "ip", "link", "set", f"vb{i}", "master", "br0")
            _sh("ip", "netns", "exec", b, "ip", "link", "set", f"vb{i}", "up")
            _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.address(i)}/24", "dev", self.ifname(i))
            _sh("ip", "netns", "exec", ns, "ip", "link", "set", self.ifname(i), "up")
            self._shape(ns, self.ifname(i))  # node -> bridge
            self._shape(b, f"vb{i}")         # bridge -> node

    def close(self) -> None:
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)
        self.created = []

    def run(self, command: List[str], ranks_per_node: int, rank_cpu: Optional[Sequence[float]] = None,
            timeout: float = 1800, env: Optional[dict] = None, sched: Optional[str] = None) -> int:
        """Runs ``command`` once per rank (torch.distributed env:// variables,
        GLOO_SOCKET_IFNAME, HETCOMM_NODE set). Rank 0 prints to this stdout,
        the others' output is shown if they fail. Returns rank 0's exit code;
        any failing rank stops all. ``sched="batch"`` starts every rank under
        Linux's SCHED_BATCH, ``"normal"`` under SCHED_OTHER (its threads
        inherit it; None: the caller's policy): see :data:`SCHED_POLICIES`."""
        if sched is not None and sched not in SCHED_POLICIES:
            raise ValueError(f"sched must be one of {sorted(SCHED_POLICIES)} or None, got {sched!r}")
        policy = SCHED_POLICIES.get(sched)
        world = self.nodes * ranks_per_node
        if rank_cpu is not None and len(rank_cpu) != world:
            raise ValueError(f"rank_cpu must give one quota per rank ({world})")
        if rank_cpu is not None and not all(c > 0 for c in rank_cpu):
            raise ValueError(f"rank_cpu quotas must be > 0 cores, got {list(rank_cpu)}")
        quotas: List[CpuQuota] = []
        port = 29000 + os.getpid() % 20000
        procs, logs = [], []
        # Each testbed run has links of its own: never reuse a topology cached for other ones.
        cache = tempfile.TemporaryDirectory(prefix="hetcomm-testbed-")
        try:
            for r, c in enumerate(rank_cpu or []):  # a failed quota still removes the ones made before it
                quotas.append(CpuQuota(f"hetcomm-{os.getpid()}-{r}", c))
            for node, ns in enumerate(self.node_ns):
                for local in range(ranks_per_node):
                    rank = node * ranks_per_node + local
                    e = dict(os.environ, **(env or {}))
                    e.update(MASTER_ADDR=self.address(0), MASTER_PORT=str(port), RANK=str(rank),
                             WORLD_SIZE=str(world), LOCAL_RANK=str(local), LOCAL_WORLD_SIZE=str(ranks_per_node),
                             **{topology.ENV_NODE: f"node{node}"}, GLOO_SOCKET_IFNAME=self.ifname(node), OMP_NUM_THREADS="1")
                    e.setdefault("HETCOMM_CACHE_DIR", cache.name)
                    if self.inter_rate:
                        e["HETCOMM_LINK_RATE"] = self.inter_rate  # for `hetcomm bench links`
                    log = None if rank == 0 else tempfile.TemporaryFile(mode="w+")
                    logs.append(log)
                    p = subprocess.Popen(["ip", "netns", "exec", ns] + list(command), env=e, stdout=log,
                                         stderr=subprocess.STDOUT if log else None,
                                         preexec_fn=(lambda: os.sched_setscheduler(0, policy, os.sched_param(0)))
                                         if policy is not None else None)
                    if quotas:
                        with open(os.path.join(quotas[rank].path, "cgroup.procs"), "w") as f:
                            f.write(str(p.pid))
                    procs.append(p)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                codes = [p.poll() for p in procs]
                if any(c not in (None, 0) for c in codes) or all(c is not None for c in codes):
                    break
                time.sleep(0.1)
            codes = [p.poll() for p in procs]
            for r, c in enumerate(codes):
                if c not in (None, 0) and logs[r] is not None:
                    logs[r].seek(0)
                    print(f"--- testbed rank {r} exited {c} ---\n{logs[r].read()[-4000:]}", file=sys.stderr)
            if any(c is None for c in codes):
                failed = any(c not in (None, 0) for c in codes)
                print("hetcomm testbed: ranks still running after another rank failed: stopped" if failed else
                      f"hetcomm testbed: the command ran past --timeout {timeout:g} s: stopped (pass --timeout "
                      "SECONDS for a longer run)", file=sys.stderr)
            return next((c for c in codes if c not in (None, 0)), codes[0] if codes[0] is not None else 124)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            for log in logs:
                if log is not None:
                    log.close()
            for q in quotas:
                q.remove()
            cache.cleanup()


def main(nodes: int, ranks_per_node: int, inter_rate: Optional[str], rank_cpu: Optional[List[float]],
         command: List[str], timeout: float, sched: Optional[str] = None, inter_burst: Optional[str] = None) -> int:
    ok, why = netns_support()
    if not ok:
        print(f"hetcomm testbed: cannot build network namespaces here: {why}", file=sys.stderr)
        return 2
    if not command:
        print("hetcomm testbed: give the command to run after --", file=sys.stderr)
        return 2

    def stop(signum, frame):
        raise KeyboardInterrupt

    scheduling = sched or f"{sched_policy()} (this process's)"
    old = signal.signal(signal.SIGTERM, stop)
    try:
        with Cluster(nodes, inter_rate, inter_burst) as cluster:
            link = f"{inter_rate} (tbf burst {cluster.inter_burst})" if inter_rate else "unshaped"
            print(f"hetcomm testbed: {nodes} nodes x {ranks_per_node} ranks, inter-node "
                  f"{link}, CPU quotas {rank_cpu or 'none'}, scheduling {scheduling}",
                  file=sys.stderr, flush=True)
            return cluster.run(command, ranks_per_node, rank_cpu, timeout, sched=sched)
    finally:
        signal.signal(signal.SIGTERM, old)
