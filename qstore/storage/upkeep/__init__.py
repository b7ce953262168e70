"""Upkeep operations: rotate and prune the rings, counter rollup, rescue and promotion."""
