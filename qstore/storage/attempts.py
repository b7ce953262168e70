"""Taking a live attempt out of running: the one mechanism every way of ending an attempt
(complete, retry, snooze, cancel, fail, DLQ, rescue) goes through.

Order of locks: claim rows (``FOR UPDATE``, sorted) → leases → closures → queue ring. A
materialised lease is found and deleted by ``(job_id, run_lease)``; every lease deletion
closes the attempt's receipt in the same transaction, and a receipt is closed without a
lease only when no lease exists for the attempt (trap T2). The closure primary key makes
finishing an attempt at-most-once; anything stale is simply not returned.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    SmallInteger,
    Text,
    and_,
    bindparam,
    delete,
    insert,
    select,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.model import JobState
from qstore.schema import StorageSchema
from qstore.schema.types import COUNTER_BUCKETS
from qstore.storage.statements import unnest_rows

__all__ = ["COUNTER_BUCKETS", "Taken", "take_attempts", "write_deltas"]

PAIR = {"job_id": BigInteger(), "run_lease": BigInteger()}


@dataclass(frozen=True)
class Taken:
    """A just-finished attempt with its hydrated body."""

    job_id: int
    run_lease: int
    attempt: int
    max_attempts: int
    queue: str
    priority: int  # lane priority
    effective_priority: int
    enqueue_shard: int
    lane_seq: int
    ready_slot: int
    ready_generation: int
    kind: str
    args: Any
    payload: dict[str, Any] | None
    run_at: datetime
    created_at: datetime
    attempted_at: datetime | None
    heartbeat_at: datetime | None
    deadline_at: datetime | None
    unique_key: bytes | None
    unique_states: str | None
    progress: Any
    old_state: JobState

    @property
    def metadata(self) -> dict[str, Any]:
        return dict((self.payload or {}).get("metadata") or {})

    @property
    def tags(self) -> list[str]:
        return list((self.payload or {}).get("tags") or [])

    @property
    def errors(self) -> list[Any]:
        return list((self.payload or {}).get("errors") or [])


@functools.lru_cache(maxsize=64)
def _statements(sch: StorageSchema) -> dict[str, Any]:
    c, le, cl = sch.claims.parent, sch.leases.parent, sch.closures.parent
    r, st = sch.ready.parent, sch.attempt_state
    p = unnest_rows("p", **PAIR)
    on_pair = lambda t: and_(t.c.job_id == p.c.job_id, t.c.run_lease == p.c.run_lease)  # noqa: E731
    no_lease = ~select(le.c.job_id).where(le.c.job_id == c.c.job_id, le.c.run_lease == c.c.run_lease).exists()
    k = unnest_rows("k", ready_slot=Integer(), queue=Text(), priority=SmallInteger(),
                    enqueue_shard=SmallInteger(), lane_seq=BigInteger())
    return {
        "lock_claims": select(c).select_from(c.join(p, on_pair(c)))
        .order_by(c.c.job_id, c.c.run_lease).with_for_update(of=c),
        "delete_leases": delete(le).where(on_pair(le), le.c.state.in_(bindparam("states", expanding=True)))
        .returning(*le.c),
        "close": pg_insert(cl).from_select(
            ["claim_slot", "job_id", "run_lease", "outcome"],
            select(c.c.claim_slot, c.c.job_id, c.c.run_lease, bindparam("outcome", type_=Text()))
            .select_from(c.join(p, on_pair(c))).where(no_lease),
        ).on_conflict_do_nothing().returning(cl.c.job_id, cl.c.run_lease),
        "bodies": select(r).select_from(r.join(k, and_(
            r.c.ready_slot == k.c.ready_slot, r.c.queue == k.c.queue, r.c.priority == k.c.priority,
            r.c.enqueue_shard == k.c.enqueue_shard, r.c.lane_seq == k.c.lane_seq))),
        "drop_state": delete(st).where(on_pair(st)).returning(st.c.job_id, st.c.run_lease, st.c.progress, st.c.heartbeat_at),
    }


def take_attempts(
    conn: Connection, sch: StorageSchema, pairs: Sequence[tuple[int, int]], outcome: str,
    lease_states: Sequence[str] = ("running",),
) -> list[Taken]:
    """End the live attempts among ``pairs`` (others are stale and skipped); returns the
    hydrated attempts in input order. Runs on ``conn``'s transaction."""
    pairs = list(dict.fromkeys((int(j), int(r)) for j, r in pairs))
    if not pairs:
        return []
    s = _statements(sch)
    arg = {"job_id": [j for j, _ in pairs], "run_lease": [r for _, r in pairs]}
    claims = {(row.job_id, row.run_lease): row for row in conn.execute(s["lock_claims"], arg)}
    leases = {(row.job_id, row.run_lease): row
              for row in conn.execute(s["delete_leases"], {**arg, "states": list(lease_states)})}
    closed: set[tuple[int, int]] = set()
    if claims:
        closed = {tuple(row) for row in conn.execute(s["close"], {**arg, "outcome": outcome})}
    taken_keys = [pr for pr in pairs if pr in leases or pr in closed]
    if not taken_keys:
        return []
    refs = {pr: (leases.get(pr) or claims[pr]) for pr in taken_keys}
    bodies = {
        (b.ready_slot, b.queue, b.priority, b.enqueue_shard, b.lane_seq): b
        for b in conn.execute(s["bodies"], {
            "ready_slot": [x.ready_slot for x in refs.values()],
            "queue": [x.queue for x in refs.values()],
            "priority": [x.priority for x in refs.values()],
            "enqueue_shard": [x.enqueue_shard for x in refs.values()],
            "lane_seq": [x.lane_seq for x in refs.values()],
        })
    }
    state = {(row.job_id, row.run_lease): row for row in conn.execute(s["drop_state"], {
        "job_id": [j for j, _ in taken_keys], "run_lease": [r for _, r in taken_keys]})}
    out = []
    for pr in taken_keys:
        ref = refs[pr]
        body = bodies.get((ref.ready_slot, ref.queue, ref.priority, ref.enqueue_shard, ref.lane_seq))
        if body is None:  # cannot happen while the ready row is retained (prune gate G1/G3)
            raise RuntimeError(f"ready body of job {pr[0]} is missing")
        lease = leases.get(pr)
        st = state.get(pr)
        out.append(Taken(
            job_id=pr[0], run_lease=pr[1], attempt=ref.attempt, max_attempts=ref.max_attempts,
            queue=ref.queue, priority=ref.priority, effective_priority=ref.effective_priority,
            enqueue_shard=ref.enqueue_shard, lane_seq=ref.lane_seq, ready_slot=ref.ready_slot,
            ready_generation=ref.ready_generation, kind=body.kind, args=body.args,
            payload=body.payload, run_at=body.run_at, created_at=body.created_at,
            attempted_at=lease.attempted_at if lease is not None else ref.claimed_at,
            heartbeat_at=(st.heartbeat_at if st is not None else None)
            or (lease.heartbeat_at if lease is not None else None),
            deadline_at=ref.deadline_at, unique_key=body.unique_key,
            unique_states=body.unique_states,
            progress=st.progress if st is not None else None,
            old_state=JobState(lease.state) if lease is not None else JobState.RUNNING,
        ))
    return out


def write_deltas(conn: Connection, sch: StorageSchema, rows: Sequence[tuple[int, int, str, int, int, int]], sign: int) -> None:
    """Append grouped terminal-count deltas for ``(ready_slot, gen, queue, priority, shard,
    job_id)`` rows, in key order (no counter row is ever updated on this path)."""
    if not rows:
        return
    grouped = Counter((s, g, q, p, sh, j % COUNTER_BUCKETS) for s, g, q, p, sh, j in rows)
    conn.execute(insert(sch.deltas.parent), [
        {"ready_slot": s, "ready_generation": g, "queue": q, "priority": p, "enqueue_shard": sh,
         "counter_bucket": b, "terminal_delta": sign * n}
        for (s, g, q, p, sh, b), n in sorted(grouped.items())
    ])




