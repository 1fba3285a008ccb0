"""The multi-process harness of the tests: hetcomm.launch.spawn_ranks (ranks
forked from a fork server that imported torch once, FileStore rendezvous,
gloo on 127.0.0.1; a failed or hung rank fails the test)."""

import contextlib
import logging

from hetcomm.launch import spawn_ranks as run_ranks  # noqa: F401


def each_mode(rank, world, fn, modes, *args):
    """A rank's body running ``fn(rank, world, mode, *args)`` for each mode in
    turn: a test's cases in one spawn (starting ranks is most of a short case's time)."""
    return {mode: fn(rank, world, mode, *args) for mode in modes}


@contextlib.contextmanager
def hetcomm_records(level: int = logging.WARNING):
    """The ``hetcomm`` logger's records at ``level`` and above while inside
    (a list, filled as they come), the logger let down to ``level`` meanwhile
    where it would drop them, then as it was."""
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record)

    logger = logging.getLogger("hetcomm")
    handler, before = Catch(level), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
