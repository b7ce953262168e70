"""Completion: close attempts successfully, guarded by ``(job_id, run_lease)``.

Fast path (``complete_runtime_batch`` for plain receipt-only attempts): one statement locks
the receipts, appends closures (``ON CONFLICT DO NOTHING`` — a rescue or cancel that closed
first wins), appends narrow done rows from the claim-time snapshot and grouped count deltas.
Everything else (materialised leases, heartbeated receipts, unique-key transitions) takes
the general path of :mod:`qstore.storage.attempts`. Stale entries are absent from results.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    SmallInteger,
    Text,
    and_,
    func,
    literal,
    select,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.model import ClaimedEntry, ClaimedRuntimeJob, JobState
from qstore.schema import StorageSchema
from qstore.storage import unique
from qstore.storage.attempts import BUCKETS, take_attempts, write_done_rows
from qstore.storage.jobs import holds_key
from qstore.storage.statements import unnest_rows

__all__ = ["complete_pairs", "complete_runtime"]

_FAST_INPUT: dict[str, Any] = {
    "claim_slot": Integer(), "job_id": BigInteger(), "run_lease": BigInteger(),
    "ready_slot": Integer(), "ready_generation": BigInteger(), "queue": Text(),
    "priority": SmallInteger(), "enqueue_shard": SmallInteger(), "lane_seq": BigInteger(),
    "kind": Text(), "attempt": SmallInteger(), "attempted_at": TIMESTAMP(timezone=True),
}


@functools.lru_cache(maxsize=64)
def _fast_stmt(sch: StorageSchema) -> Any:
    c, cl, d, dl = sch.claims.parent, sch.closures.parent, sch.done.parent, sch.deltas.parent
    i = unnest_rows("i", **_FAST_INPUT)
    key = lambda t: and_(t.c.claim_slot == i.c.claim_slot, t.c.job_id == i.c.job_id,  # noqa: E731
                         t.c.run_lease == i.c.run_lease)
    locked = (
        select(c.c.claim_slot, c.c.job_id, c.c.run_lease)
        .select_from(c.join(i, key(c)))
        .where(c.c.materialized_at.is_(None))
        .order_by(c.c.job_id, c.c.run_lease)
        .with_for_update(of=c)
        .cte("locked")
    )
    closed = (
        pg_insert(cl).from_select(
            ["claim_slot", "job_id", "run_lease", "outcome"],
            select(locked.c.claim_slot, locked.c.job_id, locked.c.run_lease, literal("completed")),
        )
        .on_conflict_do_nothing()
        .returning(cl.c.claim_slot, cl.c.job_id, cl.c.run_lease)
        .cte("closed")
    )
    now = func.clock_timestamp()
    done = (
        pg_insert(d).from_select(
            ["ready_slot", "ready_generation", "job_id", "kind", "queue", "state", "priority",
             "attempt", "run_lease", "lane_seq", "enqueue_shard", "attempted_at", "finalized_at"],
            select(i.c.ready_slot, i.c.ready_generation, i.c.job_id, i.c.kind, i.c.queue,
                   literal("completed").cast(d.c.state.type), i.c.priority, i.c.attempt,
                   i.c.run_lease, i.c.lane_seq, i.c.enqueue_shard, i.c.attempted_at, now)
            .select_from(i.join(closed, key(closed))),
        )
        .returning(d.c.ready_slot, d.c.ready_generation, d.c.queue, d.c.priority,
                   d.c.enqueue_shard, d.c.job_id)
        .cte("done")
    )
    bucket = (done.c.job_id % BUCKETS).cast(SmallInteger)
    group = (done.c.ready_slot, done.c.ready_generation, done.c.queue, done.c.priority,
             done.c.enqueue_shard, bucket)
    deltas = pg_insert(dl).from_select(
        ["ready_slot", "ready_generation", "queue", "priority", "enqueue_shard",
         "counter_bucket", "terminal_delta"],
        select(*group, func.count()).group_by(*group).order_by(*group),
    ).cte("deltas")
    return select(closed.c.job_id, closed.c.run_lease).add_cte(deltas)


def _fast_candidate(job: ClaimedRuntimeJob) -> bool:
    if not job.claim.lease_claim_receipt:
        return False
    states = job.unique_states or job.job.unique_states
    # a unique key whose ownership changes on completion needs the general path's sync
    return job.job.unique_key is None or holds_key(states, JobState.RUNNING) == holds_key(states, JobState.COMPLETED)


def complete_pairs(conn: Connection, sch: StorageSchema, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """General path: complete whichever of ``pairs`` are live (receipt or lease)."""
    taken = take_attempts(conn, sch, pairs, "completed")
    if not taken:
        return []
    # progress is dropped from the terminal payload; metadata/tags/errors stay as enqueued
    write_done_rows(conn, sch, taken, JobState.COMPLETED, payloads=[t.payload for t in taken])
    unique.sync(conn, sch, [
        unique.Transition(t.job_id, t.unique_key, t.unique_states, t.old_state, JobState.COMPLETED)
        for t in taken
    ])
    return [(t.job_id, t.run_lease) for t in taken]


def complete_runtime(conn: Connection, sch: StorageSchema, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    """Complete each claimed attempt at most once; returns the pairs that completed."""
    fast = [j for j in claimed if _fast_candidate(j)]
    done: list[tuple[int, int]] = []
    if fast:
        e: list[ClaimedEntry] = [j.claim for j in fast]
        rows = conn.execute(_fast_stmt(sch), {
            "claim_slot": [x.claim_slot for x in e], "job_id": [x.job_id for x in e],
            "run_lease": [x.run_lease for x in e], "ready_slot": [x.ready_slot for x in e],
            "ready_generation": [x.ready_generation for x in e], "queue": [x.queue for x in e],
            "priority": [x.priority for x in e], "enqueue_shard": [x.enqueue_shard for x in e],
            "lane_seq": [x.lane_seq for x in e], "kind": [j.job.kind for j in fast],
            "attempt": [j.job.attempt for j in fast],
            "attempted_at": [j.job.attempted_at for j in fast],
        }).all()
        done = [(r.job_id, r.run_lease) for r in rows]
    finished = set(done)
    rest = [(j.job.id, j.job.run_lease) for j in claimed if (j.job.id, j.job.run_lease) not in finished]
    if rest:
        done += complete_pairs(conn, sch, rest)
    order = {(j.job.id, j.job.run_lease): n for n, j in enumerate(claimed)}
    return sorted(done, key=lambda pr: order.get(pr, 0))
