"""The multi-process harness of the tests: hetcomm.launch.spawn_ranks (ranks
forked from a fork server that imported torch once, FileStore rendezvous,
gloo on 127.0.0.1; a failed or hung rank fails the test)."""

from hetcomm.launch import spawn_ranks as run_ranks  # noqa: F401


def each_mode(rank, world, fn, modes, *args):
    """A rank's body running ``fn(rank, world, mode, *args)`` for each mode in
    turn: a test's cases in one spawn (starting ranks is most of a short case's time)."""
    return {mode: fn(rank, world, mode, *args) for mode in modes}
