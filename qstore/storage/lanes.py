"""Lane routing of ready rows: which shard of its ``(queue, priority)`` a row goes to, and
its position in that lane.

This is the COPY path's copy of the rule the server function ``enqueue_jobs`` applies to
every other enqueue: rows with an ordering key are pinned to ``shard_for_ordering_key``;
the key-less ready rows of one batch share one pick of a rotor (one reservation per batch
and lane; consecutive batches go round-robin over the lanes). The server's rotor is a
sequence of the install; COPY batches use this process's rotor. Lanes are reserved in sorted order — the lock order every producer follows — and
positions within a lane follow batch order (FIFO per lane).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from sqlalchemy import Connection

from qstore.storage.context import StorageContext
from qstore.storage.jobs import PreparedJob, shard_for_ordering_key
from qstore.storage.planes import control
from qstore.storage.targets import reads_committed_state

__all__ = ["assign_lanes"]


def assign_lanes(conn: Connection, ctx: StorageContext, rows: Sequence[PreparedJob]) -> None:
    """Set each row's ``shard`` and ``lane_seq``, reserving the positions on ``conn``'s
    transaction (held until it ends)."""
    if not rows:
        return
    sch = ctx.schema
    shard_counts = ctx.lanes.shard_counts(
        {r.logical for r in rows}, lambda missing: control.read_shards(conn, sch, missing),
        keep=reads_committed_state(conn))
    rotor: int | None = None
    lanes: dict[tuple[str, int, int], list[PreparedJob]] = defaultdict(list)
    for row in rows:
        shards = shard_counts.get(row.logical, 1)
        if shards <= 1:
            row.shard = 0
        elif row.ordering_key is not None:
            row.shard = shard_for_ordering_key(row.ordering_key, shards)
        else:
            if rotor is None:
                rotor = ctx.lanes.next_rotor()
            row.shard = rotor % shards
        lanes[(row.queue, row.priority, row.shard)].append(row)
    order = sorted(lanes)
    starts = control.reserve_lanes(conn, sch, [(q, lanes[(q, p, s)][0].logical, p, s, len(lanes[(q, p, s)]))
                                               for q, p, s in order])
    for key, start in zip(order, starts, strict=True):
        for offset, row in enumerate(lanes[key]):
            row.lane_seq = start + offset
