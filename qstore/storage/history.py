"""Terminal history rows (``done_entries``) as mutable-by-replacement facts: select with the
hydrated body, delete with a -1 count delta. Used by admin retry, DLQ moves and discard."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, and_, func, literal_column, select, tuple_

from qstore.schema import StorageSchema
from qstore.storage.attempts import write_deltas
from qstore.storage.writers import Body

__all__ = ["delete_done", "done_bodies", "select_done"]

_HYDRATED = ("args", "max_attempts", "run_at", "created_at", "unique_key", "unique_states", "payload")


@functools.lru_cache(maxsize=64)
def _base(sch: StorageSchema) -> Any:
    d, r = sch.done.parent, sch.ready.parent
    join = and_(r.c.ready_slot == d.c.ready_slot, r.c.ready_generation == d.c.ready_generation,
                r.c.queue == d.c.queue, r.c.priority == d.c.priority,
                r.c.enqueue_shard == d.c.enqueue_shard, r.c.lane_seq == d.c.lane_seq)
    cols = [d.c.ready_slot, d.c.ready_generation, d.c.job_id, d.c.kind, d.c.queue, d.c.state,
            d.c.priority, d.c.attempt, d.c.run_lease, d.c.lane_seq, d.c.enqueue_shard,
            d.c.attempted_at, d.c.finalized_at]
    # a JSON null payload (what an older release's general terminal path wrote) is absent
    hyd = [func.coalesce(*((func.nullif(d.c[c], literal_column("'null'::jsonb")),
                            func.nullif(r.c[c], literal_column("'null'::jsonb")))
                           if c == "payload" else (d.c[c], r.c[c]))).label(c)
           for c in _HYDRATED]
    return select(*cols, *hyd).select_from(d.outerjoin(r, join))


def select_done(sch: StorageSchema, *where: Any, newest_per_job: bool = False, limit: Any = None) -> Any:
    """Hydrated done rows matching ``where``, locked ``FOR UPDATE OF done SKIP LOCKED``."""
    d = sch.done.parent
    stmt = _base(sch).where(*where)
    if newest_per_job:
        stmt = stmt.order_by(d.c.finalized_at.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    return stmt.with_for_update(of=d, skip_locked=True)


def done_bodies(rows: Sequence[Any]) -> list[Body]:
    out = []
    for row in rows:
        b = Body.from_snapshot(row)
        out.append(b)
    return out


def delete_done(conn: Connection, sch: StorageSchema, rows: Sequence[Any]) -> None:
    """Delete the given done rows by primary key and append matching -1 deltas."""
    if not rows:
        return
    d = sch.done.parent
    keys = [(r.ready_slot, r.queue, r.priority, r.enqueue_shard, r.lane_seq) for r in rows]
    conn.execute(d.delete().where(
        tuple_(d.c.ready_slot, d.c.queue, d.c.priority, d.c.enqueue_shard, d.c.lane_seq).in_(keys)))
    write_deltas(conn, sch, [(r.ready_slot, r.ready_generation, r.queue, r.priority, r.enqueue_shard, r.job_id)
                             for r in rows], -1)


