"""What every operation of one install is given: the install's declaration and the
per-process routing state its operations share."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from qstore.config import DEFAULT_SHARDS, QueueStorageConfig
from qstore.schema import StorageSchema

__all__ = ["DEFAULT_SHARDS", "SHARD_CACHE_TTL", "LaneRouter", "StorageContext"]

#: How long an enqueue-shard count read from ``queue_meta`` is reused (seconds).
SHARD_CACHE_TTL = 5.0


class LaneRouter:
    """Per-process lane routing for the COPY path: the shard rotor (the key-less rows of one
    batch share one pick) and a short-lived cache of ``queue_meta.enqueue_shards`` by
    *logical* queue.
    The cache only keeps values read in transactions the storage itself owns (see
    :meth:`shard_counts`), so a caller's rolled-back option change is never kept."""

    def __init__(self) -> None:
        self._rotor = itertools.count()
        self._shards: dict[str, tuple[float, int]] = {}
        self._lock = threading.Lock()

    def clear(self) -> None:
        with self._lock:
            self._shards.clear()

    def next_rotor(self) -> int:
        return next(self._rotor)

    def shard_counts(self, logicals: set[str], read: Callable[[list[str]], dict[str, int]],
                     keep: bool) -> dict[str, int]:
        """Shard counts of ``logicals``: cached ones, the rest from ``read(missing)``
        (a queue without a ``queue_meta`` row has ``DEFAULT_SHARDS``); ``keep`` says whether the read values may be
        cached (they were read in a transaction the storage owns)."""
        now = time.monotonic()
        with self._lock:
            known = {q: v for q, (t, v) in self._shards.items() if q in logicals and now - t < SHARD_CACHE_TTL}
        missing = sorted(logicals - known.keys())
        if missing:
            found = read(missing)
            for q in missing:
                known[q] = int(found.get(q, DEFAULT_SHARDS))
            if keep:
                with self._lock:
                    for q in missing:
                        self._shards[q] = (now, known[q])
        return known


@dataclass
class StorageContext:
    """One install's declaration and the routing state its operations share in this process."""

    schema: StorageSchema
    lanes: LaneRouter = field(default_factory=LaneRouter)
    stripe_probe: Iterator[int] = field(default_factory=itertools.count)
    #: where the next enqueue call starts its round-robin over a striped queue's stripes
    stripe_rotor: Iterator[int] = field(default_factory=itertools.count)

    @property
    def config(self) -> QueueStorageConfig:
        return self.schema.config
