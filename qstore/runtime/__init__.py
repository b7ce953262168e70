"""The worker runtime: tasks, the worker, its completion batcher, the maintainer and the outage log."""
