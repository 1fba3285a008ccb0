"""The argument types of the `hetcomm` command line: bad input is an argparse
error (one line naming the rule, exit 2), never a traceback."""

from __future__ import annotations

import argparse
import math
import os
import re
from typing import Any, Callable, List

_BINARY = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}


def _number(text: str, units: dict, what: str) -> int:
    t = str(text).strip()
    m = re.fullmatch(r"(\d+(?:\.\d*)?)\s*([KMGB]?)(I?B)?", t, re.IGNORECASE) if t else None
    if m is None or (units is _DECIMAL and m.group(3)):
        raise argparse.ArgumentTypeError(f"{what} must be a number with an optional suffix "
                                         f"({', '.join(k for k in units if k)}), got {text!r}")
    suffix = m.group(2).upper()
    if units is _BINARY and suffix == "B":  # "512B": bytes
        suffix = ""
    value = int(float(m.group(1)) * units[suffix])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{what} must be > 0, got {text!r}")
    return value


def size_bytes(text: str) -> int:
    """256K, 1M, 1MiB, 4GiB, 512 (bytes; K/M/G are powers of 1024)."""
    return _number(text, _BINARY, "size")


def param_count(text: str) -> int:
    """50K, 5M, 1B (a count: K/M/B are powers of 1000); at most 2**31 - 1 (one bucket's limit)."""
    n = _number(text, _DECIMAL, "parameter count")
    if n >= 2**31:
        raise argparse.ArgumentTypeError(f"parameter count must be below 2**31 (a DDP bucket's limit), got {text!r}")
    return n


def _int_at_least(text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if v < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
    return v


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return v


def quotas(text: str) -> List[float]:
    """0.25,0.75: CPU cores per rank, each > 0."""
    return [positive_float(c) for c in text.split(",")]


def comma_list(item: Callable[[str], object]) -> Callable[[str], list]:
    """1M,5M / 2,4: a non-empty comma-separated list of ``item``s."""
    def parse(text: str) -> list:
        items = [x for x in text.split(",") if x]
        if not items:
            raise argparse.ArgumentTypeError("expected a comma-separated list, got an empty one")
        return [item(x) for x in items]
    return parse


def network(text: str) -> str:
    """loopback (unshaped), or a tc rate for the testbed: 100mbit, 1gbit."""
    return "loopback" if text.strip().lower() == "loopback" else rate(text)


def choices_list(allowed, noun: str) -> Callable[[str], List[str]]:
    def parse(text: str) -> List[str]:
        items = [x for x in text.split(",") if x]
        bad = [x for x in items if x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"unknown {noun} {', '.join(map(repr, bad)) or '(empty list)'}; choose "
                                             f"from {', '.join(allowed)}")
        return items
    return parse


def checked(check: Callable[[str], Any]) -> Callable[[str], str]:
    """One value passed by ``check`` (a ValueError names the rule)."""
    def parse(text: str) -> str:
        try:
            check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text
    return parse


def mode_list(check: Callable[[str], Any]) -> Callable[[str], List[str]]:
    """Comma-separated modes, each passed by ``check`` (a ValueError names the rule)."""
    def parse(text: str) -> List[str]:
        items = [x for x in text.split(",") if x]
        if not items:
            raise argparse.ArgumentTypeError("unknown mode (empty list)")
        return [checked(check)(x) for x in items]
    return parse


def writable_path(text: str) -> str:
    """An output file: its folder must exist and be writable now, not after the run."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(folder) or not os.access(folder, os.W_OK) or (
            os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r} (no such folder, or not writable)")
    return text


def burst(text: str) -> str:
    """A tc tbf burst in bits that holds one 1514-byte frame: 400kbit, 1mbit, 12112bit."""
    from .testbed import check_burst

    text = text.strip().lower()
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit)", text):
        raise argparse.ArgumentTypeError(f"burst must look like 400kbit or 1mbit (bits), got {text!r}")
    try:
        check_burst(text, "burst")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def rate(text: str) -> str:
    """A tc rate: 100mbit, 1gbit, 500kbit."""
    if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit|bps|kbps|mbps|gbps)", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"rate must look like 100mbit or 1gbit, got {text!r}")
    return text.strip().lower()
