"""A bucket's identity: the tuple of its parameters' numbers (its signature)
and the state_dict key that names it; and where a gradient lies in it."""

from __future__ import annotations

from typing import List, Tuple

Signature = Tuple[int, ...]


def key_of(sig: Signature) -> str:
    """The state_dict key of a bucket signature: its parameter numbers."""
    return ",".join(map(str, sig))


def sig_of(key: str) -> Signature:
    """The bucket signature a state_dict key names (key_of's inverse)."""
    return tuple(int(n) for n in key.split(","))


def overlapping(sig: Signature, keys) -> List[str]:
    """The keys among ``keys``, other than ``sig``'s own, whose buckets hold
    one of ``sig``'s parameters: buckets of a layout DDP has since rebuilt."""
    mine, own = set(sig), key_of(sig)
    return [k for k in keys if k != own and not mine.isdisjoint(sig_of(k))]


def offset_in(grad, buffer) -> int:
    """The element offset of ``grad``, a view into a bucket's ``buffer``,
    from the buffer's start. (A gradient of no elements may point anywhere:
    callers skip it.)"""
    return (grad.data_ptr() - buffer.data_ptr()) // buffer.element_size()
