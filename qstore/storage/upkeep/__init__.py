"""Upkeep operations: rotate and prune the rings, counter rollup, rescue and promotion, the
deferred wheel, and the purge of released unique keys."""
