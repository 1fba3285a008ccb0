"""Integrations with training frameworks (imported on demand: hetcomm does not
depend on them)."""
