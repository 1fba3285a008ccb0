"""The multi-process harness of the tests: hetcomm.launch.spawn_ranks (spawn,
FileStore rendezvous, gloo on 127.0.0.1; a failed or hung rank fails the test)."""

from hetcomm.launch import spawn_ranks as run_ranks  # noqa: F401
