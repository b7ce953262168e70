"""Where each table is written.

Each plane module is the only Python writer of its tables: it builds and runs every
``INSERT``, ``UPDATE``, ``DELETE``, ``TRUNCATE`` and ``setval`` that changes them (the
hot-path server functions ``enqueue_jobs``, ``claim_ready`` and ``complete_receipts`` write
them too, inside the database):

* :mod:`~qstore.storage.planes.queue` — the queue ring (ready entries, tombstones, claim
  ranges, done entries, terminal count deltas), the deferred backlog (the wheel and its marks,
  their truncation included, and the overflow) and the DLQ, plus
  NOTIFY: the tables :mod:`qstore.schema.queue_plane` declares;
* :mod:`~qstore.storage.planes.execution` — leases, claim receipts and closures, attempt
  state (:mod:`qstore.schema.execution_plane`): taking a live attempt out of running,
  heartbeats, callback tokens;
* :mod:`~qstore.storage.planes.control` — lanes and heads, unique keys, queue options,
  claimer slots, the terminal counters, the backend registry
  (:mod:`qstore.schema.control_plane`);
* :mod:`~qstore.storage.planes.rings` — what rotation and pruning do to the rings as a
  whole: the ring cursors (``setval`` of each ring's generation sequence), slot emptiness,
  exclusive locks and ``TRUNCATE`` of the ring families' tables.

:func:`ownership` is that map for one install, taken from the declaration
(:attr:`~qstore.schema.StorageSchema.declared_by`), and :func:`writer` answers for one
table or sequence and one kind of write. ``tests/test_plane_writers.py`` reads every module
of the package and fails when a statement writing a table is built anywhere but in the
module of the table's plane.

Operation families (:mod:`qstore.storage.enqueue`, :mod:`~qstore.storage.claim`, …) read
what they need and write only through these modules.
"""

from __future__ import annotations

import enum

from sqlalchemy import Sequence, Table

from qstore.schema import StorageSchema
from qstore.schema.rings import PARTITION_OF

__all__ = ["MODULES", "Plane", "ownership", "writer"]


class Plane(str, enum.Enum):
    """A writer of tables: one module of this package each."""

    QUEUE = "queue"
    EXECUTION = "execution"
    CONTROL = "control"
    RINGS = "rings"

    def __str__(self) -> str:
        return self.value


#: The module of each plane.
MODULES: dict[Plane, str] = {plane: f"{__name__}.{plane.value}" for plane in Plane}


def ownership(sch: StorageSchema) -> dict[str, Plane]:
    """Every table of ``sch`` (ring children included), by key (``schema.name``), and the
    plane whose module writes its rows: the plane whose schema module declared it."""
    return {t.key: Plane(plane) for plane, tables in sch.declared_by.items() for t in tables}


def _ring_tables(sch: StorageSchema) -> set[str]:
    return {t.key for ring in sch.rings for f in ring.families for t in (f.parent, *f.children)}


def writer(sch: StorageSchema, target: Table | Sequence, *, truncate: bool = False) -> Plane | None:
    """The plane that may write ``target``: a ``TRUNCATE`` (``truncate``) of a ring family's
    parent or slot child and a move (``setval``) of a ring's cursor are the ring plane's;
    any other write of a table is the plane's that declared it. None for an object of no
    plane (a sequence that only hands out numbers)."""
    if isinstance(target, Sequence):
        cursors = {ring.generation.name for ring in sch.rings}
        return Plane.RINGS if target.schema == sch.config.schema and target.name in cursors else None
    parent = target.info.get(PARTITION_OF, target)
    if truncate and parent.key in _ring_tables(sch):
        return Plane.RINGS
    return ownership(sch).get(parent.key)
