"""What the cluster looks like (how to reduce over it: :mod:`hetcomm.planner`).

- :func:`discover`: per rank, node identity (hostname, or ``HETCOMM_NODE``),
  device model, memory, compute capability (nvidia-ml-py on GPUs, "cpu"
  otherwise), all-gathered.
- :mod:`hetcomm.probe`: point-to-point latency and bandwidth of a sample of
  rank pairs, fitted to alpha-beta per link class (intra-node, inter-node).
- :func:`detect`: discover + probe (or the cached / ``HETCOMM_TOPOLOGY``
  result), identical on every rank.

Environment knobs (each declared once, here):
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import socket
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

ENV_NODE = "HETCOMM_NODE"          # node identity of this rank (default: hostname)
ENV_TOPOLOGY = "HETCOMM_TOPOLOGY"  # path of a topology JSON to load instead of probing
ENV_ALGO = "HETCOMM_ALGO"          # force an algorithm for every bucket (native, ring, ...)
ENV_CACHE = "HETCOMM_CACHE_DIR"    # where measured topologies are cached (default: platformdirs' user cache dir)
ENV_CACHE_MAX_AGE = "HETCOMM_CACHE_MAX_AGE"  # seconds a cached topology is trusted (default 86400: a day)

log = logging.getLogger("hetcomm")

ALGORITHMS = ("native", "ring", "halving_doubling", "tree", "hierarchical")
WIRE_BYTES = {"none": 4.0, "fp16": 2.0, "bf16": 2.0}


@dataclass
class LinkClass:
    alpha: float  # seconds per message
    beta: float   # seconds per byte
    pairs: int = 0


@dataclass
class Topology:
    world: int
    nodes: List[str]                      # node of each rank
    devices: List[dict]                   # per rank: model, memory, capability
    links: Dict[str, LinkClass] = field(default_factory=dict)  # "intra", "inter"
    codec_gbps: float = 5.0               # this machine's 1-bit codec speed (GB/s of fp32 input)
    source: str = "probe"

    @property
    def node_ids(self) -> List[int]:
        return node_ids(self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def ranks_per_node(self) -> Optional[int]:
        counts = {n: self.nodes.count(n) for n in set(self.nodes)}
        return next(iter(counts.values())) if len(set(counts.values())) == 1 else None

    def ring_order(self) -> List[int]:
        """Ranks grouped by node: the ring crosses each inter-node link once."""
        ids = self.node_ids
        return sorted(range(self.world), key=lambda r: (ids[r], r))

    def link(self, a: int, b: int) -> LinkClass:
        cls = "intra" if self.nodes[a] == self.nodes[b] else "inter"
        return self.links.get(cls) or self.links.get("intra") or self.links.get("inter")

    def worst(self) -> LinkClass:
        return max(self.links.values(), key=lambda l: (l.beta, l.alpha))

    def to_json(self) -> dict:
        d = asdict(self)
        d["links"] = {k: asdict(v) for k, v in self.links.items()}
        return d

    @staticmethod
    def from_json(d: dict) -> "Topology":
        t = Topology(world=d["world"], nodes=list(d["nodes"]), devices=list(d["devices"]),  # validate() first
                     codec_gbps=float(d.get("codec_gbps", 5.0)), source=d.get("source", "file"))
        t.links = {k: LinkClass(alpha=float(v["alpha"]), beta=float(v["beta"]), pairs=int(v.get("pairs", 0)))
                   for k, v in d["links"].items()}
        return t


# ---- discovery ----------------------------------------------------------------------
def node_ids(nodes: List) -> List[int]:
    """Each rank's node as an id 0, 1, ... in the order the nodes first appear."""
    order: Dict[Any, int] = {}
    return [order.setdefault(n, len(order)) for n in nodes]


def node_name() -> str:
    """This rank's node: ``HETCOMM_NODE``, else the hostname."""
    return os.environ.get(ENV_NODE) or socket.gethostname()


def node_code() -> int:
    """This rank's node as a non-negative int64 (63 bits of its name's
    SHA-256): gathered with the options at a state's first step, so every
    state knows which ranks share a node without a collective of its own."""
    return int.from_bytes(hashlib.sha256(node_name().encode()).digest()[:8], "big") >> 1


def local_device_info(device: Optional[torch.device] = None) -> dict:
    """This rank's node and device, without initialising CUDA (NVML only)."""
    info = {"node": node_name(), "model": "cpu",
            "memory_gb": None, "capability": None}
    if device is not None and device.type == "cuda":
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            name = pynvml.nvmlDeviceGetName(h)
            info["model"] = name.decode() if isinstance(name, bytes) else name
            info["memory_gb"] = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            info["capability"] = list(pynvml.nvmlDeviceGetCudaComputeCapability(h))
        except Exception as e:  # no NVML: still usable, just less described
            info["model"] = f"cuda (nvml unavailable: {type(e).__name__})"
    else:
        info["model"] = f"cpu ({platform.processor() or platform.machine()})"
        try:
            info["memory_gb"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        except (ValueError, OSError):
            pass
    return info


def group_device(group=None, device: Optional[torch.device] = None) -> torch.device:
    """Where tensors for collectives on ``group`` go: ``device`` when it is a
    GPU; else the CPU when the group has a CPU backend (gloo); else (a group
    with NCCL only) this rank's current GPU."""
    if device is not None and device.type == "cuda":
        return device
    pg = group if group is not None else dist.group.WORLD
    try:
        pg._get_backend(torch.device("cpu"))
        return torch.device("cpu")
    except RuntimeError:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        raise ValueError(f"hetcomm: the process group (backend {dist.get_backend(group)!r}) takes no CPU tensors "
                         "and no GPU is visible; use gloo for CPU training") from None


def sync(device) -> None:
    """Waits for the work queued on ``device`` (a torch.device or its name; a no-op on the CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def discover(group=None, device: Optional[torch.device] = None) -> List[dict]:
    infos: List[Optional[dict]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(infos, local_device_info(device), group=group)
    return infos  # type: ignore[return-value]


def _cluster_id(nodes: List[str], devices: List[dict]) -> str:
    return hashlib.sha256(json.dumps([nodes, [d.get("model") for d in devices]]).encode()).hexdigest()[:16]


def _cache_dir() -> str:
    if os.environ.get(ENV_CACHE):
        return os.environ[ENV_CACHE]
    import platformdirs  # the platform's convention: ~/.cache/hetcomm on Linux (XDG_CACHE_HOME honoured)

    return platformdirs.user_cache_dir("hetcomm", appauthor=False)


def _cache_path(nodes: List[str], devices: List[dict]) -> str:
    return os.path.join(_cache_dir(), f"topology-{_cluster_id(nodes, devices)}.json")


def cache_max_age_s() -> float:
    """HETCOMM_CACHE_MAX_AGE in seconds; a value that is not a number >= 0 is a warning and the default."""
    text = os.environ.get(ENV_CACHE_MAX_AGE, "86400")
    try:
        value = float(text)
        if math.isfinite(value) and value >= 0:
            return value
    except ValueError:
        pass
    log.warning("hetcomm: %s=%r is not a number of seconds >= 0; using 86400", ENV_CACHE_MAX_AGE, text)
    return 86400.0


def _finite(x, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def validate(d, nodes: List[str], devices: List[dict], cached: bool) -> Optional[str]:
    """Why a topology JSON cannot be used for this job (None: it can): its
    schema, world, hosts and device models, finite link figures; a cached one
    also its cluster identity and age (at most HETCOMM_CACHE_MAX_AGE seconds)."""
    if not isinstance(d, dict):
        return "not a JSON object"
    if d.get("world") != len(nodes):
        return f"it describes {d.get('world')!r} ranks, this job has {len(nodes)}"
    if d.get("nodes") != nodes:
        return f"its nodes {d.get('nodes')!r} are not this job's {nodes}"
    if not isinstance(d.get("devices"), list) or [x.get("model") if isinstance(x, dict) else None
                                                  for x in d["devices"]] != [x.get("model") for x in devices]:
        return "its device models are not this job's"
    links = d.get("links")
    if not isinstance(links, dict) or not links or not set(links) <= {"intra", "inter"}:
        return "its links must be a non-empty object with 'intra' and/or 'inter'"
    for name, link in links.items():
        if not isinstance(link, dict) or not _finite(link.get("alpha")) or not _finite(link.get("beta")) or \
                link["beta"] <= 0 or not isinstance(link.get("pairs", 0), int):
            return f"link {name!r} needs finite alpha >= 0 and beta > 0"
    if not _finite(d.get("codec_gbps", 5.0)) or d.get("codec_gbps", 5.0) <= 0:
        return "codec_gbps must be finite and > 0"
    if cached:
        if d.get("cluster") != _cluster_id(nodes, devices):
            return "it was measured on another cluster"
        created, now = d.get("created"), time.time()
        if not _finite(created) or created > now + 60:
            return "it has no valid creation time"
        if now - created > cache_max_age_s():
            return f"it is {(now - created) / 3600:.1f} h old (HETCOMM_CACHE_MAX_AGE={cache_max_age_s():.0f} s)"
    return None


def _read_json(path: str, own_only: bool) -> dict:
    """Reads a JSON file without following a symbolic link; a cache file must
    belong to this user."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd) as f:
        if own_only and hasattr(os, "getuid") and os.fstat(f.fileno()).st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to another user")
        return json.load(f)


def _load(path: str, nodes: List[str], devices: List[dict], cached: bool, measure: bool = True) -> Optional[dict]:
    """The topology at path if it is valid for this job, else None (warned;
    ``measure``: whether the links are probed instead)."""
    try:
        d = _read_json(path, own_only=cached)
        why = validate(d, nodes, devices, cached)
    except (OSError, ValueError) as e:  # unreadable, a link, truncated or not JSON
        why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.warning("hetcomm: ignoring the topology in %s (%s); %s", path, why,
                    "probing the links again" if measure else "using the discovered nodes")
        return None
    age = time.time() - d["created"] if _finite(d.get("created")) else None
    log.info("hetcomm: topology from %s%s", path, f" ({age / 3600:.1f} h old)" if age is not None else "")
    return d


def _save(topo: "Topology", nodes: List[str], devices: List[dict]) -> None:
    """Atomically (temporary file + rename, 0600, in a directory of this
    user's) writes the measured topology; a failure is a warning."""
    path = _cache_path(nodes, devices)
    try:
        base = os.path.dirname(path)
        os.makedirs(base, mode=0o700, exist_ok=True)
        st = os.lstat(base)
        if hasattr(os, "getuid") and (st.st_uid != os.getuid() or not os.path.isdir(base) or os.path.islink(base)):
            raise PermissionError(f"{base} is not a directory of this user's")
        fd, tmp = tempfile.mkstemp(prefix=".topology-", dir=base)  # mode 0600
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(dict(topo.to_json(), cluster=_cluster_id(nodes, devices), created=time.time()), f)
            os.replace(tmp, path)  # replaces a link at path, never writes through it
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("hetcomm: could not cache the topology in %s (%s)", path, e)


def detect(group=None, device: Optional[torch.device] = None, use_cache: bool = True,
           measure: bool = True) -> Topology:
    """Discover, then load (HETCOMM_TOPOLOGY, or the cache for this cluster:
    validated, never older than HETCOMM_CACHE_MAX_AGE) or probe. Collective;
    rank 0 decides and broadcasts, so every rank holds the same topology; a
    file that cannot be used is ignored with a warning and the links are probed.
    ``measure=False``: where no file applies, the discovered nodes and devices
    without links (``source`` "discover"), for a fixed ring or hierarchy,
    which needs to know only which ranks share a node; nothing is probed or
    cached."""
    infos = discover(group, device)
    nodes, devices = [i["node"] for i in infos], infos
    world = len(infos)
    payload: List[Optional[dict]] = [None]
    if dist.get_rank(group) == 0:
        given = os.environ.get(ENV_TOPOLOGY)
        if given:
            payload[0] = _load(given, nodes, devices, cached=False, measure=measure)
            if payload[0] is not None:
                payload[0]["source"] = given
        elif use_cache and os.path.lexists(_cache_path(nodes, devices)):
            payload[0] = _load(_cache_path(nodes, devices), nodes, devices, cached=True, measure=measure)
            if payload[0] is not None:
                payload[0]["source"] = "cache"
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(payload, src=src, group=group)
    if payload[0] is not None:
        return Topology.from_json(payload[0])
    if not measure:
        return Topology(world=world, nodes=nodes, devices=devices, source="discover")
    from .probe import fit, measure_codec_gbps, probe

    topo = Topology(world=world, nodes=nodes, devices=devices)
    device = group_device(group, device)
    topo.links = fit(nodes, probe(nodes, group, device=device))
    gbps: List[Optional[float]] = [measure_codec_gbps(device=device)]
    dist.broadcast_object_list(gbps, src=src, group=group)  # rank 0's speed for everyone: identical plans
    topo.codec_gbps = float(gbps[0])
    if dist.get_rank(group) == 0 and use_cache:
        _save(topo, nodes, devices)
    log.info("hetcomm: topology probed: %s", {k: (v.alpha, v.beta) for k, v in topo.links.items()})
    return topo
