"""Claim: hand out ready positions as attempts, one server round trip per physical queue.

``<schema>.claim_ready`` picks lanes by effective priority with ``FOR UPDATE SKIP LOCKED``
on the claim head, follows the committed chain of claim ranges from the cursor hint,
records the consumed span and writes receipts (or leases). Nothing non-transactional moves
past uncommitted work, so a claim that runs in a caller's transaction and is rolled back
leaves no trace and strands nothing; a claim that meets a prune holding a ring child
returns what it could claim instead of raising.

On a striped queue each stripe is one statement: with an Engine each commits on its own
(one autocommitted statement per stripe, the lock order every producer also follows) and
an error on a later stripe returns what earlier ones claimed; in a caller's transaction all
stripes run there.
"""

from __future__ import annotations

import functools
import logging
import uuid
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Connection,
    Integer,
    Text,
    bindparam,
    column,
    select,
)
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, TIMESTAMP
from sqlalchemy.types import TypeEngine

from qstore.errors import failure_line
from qstore.schema import StorageSchema
from qstore.storage.checks import ms, seconds
from qstore.storage.context import StorageContext
from qstore.storage.jobs import stripes_for
from qstore.storage.planes import control
from qstore.storage.statements import HotStatement, schema_func
from qstore.storage.targets import Runner, Transactions
from qstore.types import (
    ClaimedEntry,
    ClaimedRuntimeJob,
    JobRow,
    JobState,
    QueueClaimerLease,
    assemble,
)

__all__ = [
    "ORIGINAL_PRIORITY_KEY",
    "acquire_queue_claimer",
    "claim_batch",
    "claim_job_batch",
    "claim_physical",
    "claim_runtime_batch",
    "claim_runtime_batch_with_aging",
    "claim_runtime_batch_with_aging_for_instance",
    "mark_queue_claimer_active",
]

log = logging.getLogger("qstore.storage")

TS = TIMESTAMP(timezone=True)
_CLAIM_COLUMNS: list[tuple[str, TypeEngine[Any]]] = [
    ("claim_slot", Integer()), ("lease_slot", Integer()), ("lease_generation", BigInteger()),
    ("ready_slot", Integer()), ("ready_generation", BigInteger()), ("queue", Text()),
    ("priority", Integer()), ("effective_priority", Integer()), ("enqueue_shard", Integer()),
    ("lane_seq", BigInteger()), ("job_id", BigInteger()), ("run_lease", BigInteger()),
    ("attempt", Integer()), ("max_attempts", Integer()), ("kind", Text()), ("args", JSONB()),
    ("run_at", TS), ("created_at", TS), ("claimed_at", TS), ("deadline_at", TS),
    ("unique_key", BYTEA()), ("unique_states", Text()), ("payload", JSONB()),
]
ORIGINAL_PRIORITY_KEY = "_qstore_original_priority"


@functools.lru_cache(maxsize=64)
def _claim_stmt(sch: StorageSchema) -> HotStatement:
    fn = schema_func(
        sch, "claim_ready",
        bindparam("queue", type_=Text()), bindparam("max_batch", type_=Integer()),
        bindparam("deadline_ms", type_=BigInteger()), bindparam("aging_ms", type_=BigInteger()),
        bindparam("receipts", type_=Boolean()),
    )
    return HotStatement(select(fn.table_valued(*(column(n, t) for n, t in _CLAIM_COLUMNS))))


def _to_runtime(row: Any, receipts: bool) -> ClaimedRuntimeJob:
    # positional unpacking (the order of _CLAIM_COLUMNS): named access on a Row costs a key
    # lookup per column, and this runs once per claimed job
    (claim_slot, lease_slot, lease_generation, ready_slot, ready_generation, queue, priority,
     effective_priority, enqueue_shard, lane_seq, job_id, run_lease, attempt, max_attempts,
     kind, args, run_at, created_at, claimed_at, deadline_at, unique_key, unique_states,
     payload) = row
    if payload:
        metadata = dict(payload.get("metadata") or {})
        errors = payload.get("errors") or None
        tags = list(payload.get("tags") or [])
        progress = payload.get("progress")
    else:
        metadata, errors, tags, progress = {}, None, [], None
    if effective_priority != priority:
        metadata.setdefault(ORIGINAL_PRIORITY_KEY, priority)
    # assemble(): one __dict__ fill per object instead of a frozen __init__ (see model.py);
    # every field is named here; tests/test_claim.py checks these match the dataclasses
    entry = assemble(ClaimedEntry, {
        "queue": queue, "priority": priority, "lane_seq": lane_seq, "ready_slot": ready_slot,
        "ready_generation": ready_generation, "lease_slot": lease_slot,
        "lease_generation": lease_generation, "claim_slot": claim_slot,
        "lease_claim_receipt": receipts, "enqueue_shard": enqueue_shard, "job_id": job_id,
        "run_lease": run_lease,
    })
    job = assemble(JobRow, {
        "id": job_id, "kind": kind, "queue": queue, "args": args, "state": JobState.RUNNING,
        "priority": effective_priority, "attempt": attempt, "run_lease": run_lease,
        "max_attempts": max_attempts, "run_at": run_at, "created_at": created_at,
        "heartbeat_at": claimed_at, "deadline_at": deadline_at, "attempted_at": claimed_at,
        "finalized_at": None, "errors": errors, "metadata": metadata, "tags": tags,
        "unique_key": unique_key, "unique_states": unique_states, "callback_id": None,
        "callback_timeout_at": None, "callback_filter": None, "callback_on_complete": None,
        "callback_on_fail": None, "callback_transform": None, "progress": progress,
    })
    return assemble(ClaimedRuntimeJob, {"claim": entry, "job": job, "unique_states": unique_states})


def claim_physical(run: Runner, sch: StorageSchema, queue: str, max_batch: int,
                   deadline_ms: int, aging_ms: int) -> list[ClaimedRuntimeJob]:
    """One ``claim_ready`` call on one physical queue, through ``run``."""
    receipts = sch.config.lease_claim_receipts
    rows = run.rows(_claim_stmt(sch), {
        "queue": queue, "max_batch": max_batch, "deadline_ms": deadline_ms,
        "aging_ms": aging_ms, "receipts": receipts,
    })
    return [_to_runtime(r, receipts) for r in rows]


def _claim(ctx: StorageContext, tx: Transactions, queue: str, max_batch: int, deadline_ms: int,
           aging_ms: int) -> list[ClaimedRuntimeJob]:
    sch = ctx.schema
    out: list[ClaimedRuntimeJob] = []
    for q in stripes_for(queue, sch.config.queue_stripe_count, next(ctx.stripe_probe)):
        try:
            with tx.hot() as run:
                out += claim_physical(run, sch, q, max_batch - len(out), deadline_ms, aging_ms)
        except Exception as err:
            # with an Engine earlier stripes are committed: return them rather than fail
            if not out or not tx.owned:
                raise
            log.warning("qstore: claim of stripe %s failed after earlier stripes claimed: %s", q,
                        failure_line(err))
            log.debug("qstore: claim of stripe %s failed here:", q, exc_info=True)
            break
        if len(out) >= max_batch:
            break
    return out


def claim_runtime_batch_with_aging(ctx: StorageContext, tx: Transactions, queue: str, max_batch: int,
                                   deadline_duration: timedelta | float | None,
                                   aging_interval: timedelta | float | None) -> list[ClaimedRuntimeJob]:
    """Claim up to ``max_batch`` attempts of ``queue`` (all stripes), lanes picked by
    effective (aged) priority. Each returned job is running with ``run_lease`` and
    ``attempt`` incremented; ``deadline_at`` is set when ``deadline_duration`` > 0. A claim
    that meets maintenance returns what it could claim, possibly nothing."""
    return _claim(ctx, tx, queue, max_batch, ms(deadline_duration), ms(aging_interval))


def claim_runtime_batch(ctx: StorageContext, tx: Transactions, queue: str, max_batch: int,
                        deadline_duration: timedelta | float | None = None) -> list[ClaimedRuntimeJob]:
    """``claim_runtime_batch_with_aging`` without aging."""
    return _claim(ctx, tx, queue, max_batch, ms(deadline_duration), 0)


def claim_job_batch(ctx: StorageContext, tx: Transactions, queue: str, max_batch: int,
                    deadline_duration: timedelta | float | None = None) -> list[JobRow]:
    """``claim_runtime_batch``, returning the claimed jobs' rows only."""
    return [j.job for j in _claim(ctx, tx, queue, max_batch, ms(deadline_duration), 0)]


def claim_batch(ctx: StorageContext, conn: Connection, queue: str, max_batch: int) -> list[ClaimedEntry]:
    """Benchmark path: claim across all stripes in one transaction, no deadline or aging;
    returns the claims' entries only. Runtime code uses ``claim_runtime_batch``."""
    out: list[ClaimedRuntimeJob] = []
    run = Runner.on(conn)
    for q in stripes_for(queue, ctx.config.queue_stripe_count, next(ctx.stripe_probe)):
        out += claim_physical(run, ctx.schema, q, max_batch - len(out), 0, 0)
        if len(out) >= max_batch:
            break
    return [j.claim for j in out]


# -- bounded claimers -----------------------------------------------------------------------------
def acquire_queue_claimer(ctx: StorageContext, conn: Connection, queue: str, instance_id: uuid.UUID,
                          max_claimers: int, lease_ttl: timedelta | float,
                          idle_threshold: timedelta | float) -> QueueClaimerLease | None:
    """This instance's claimer slot for ``queue`` (kept, taken over or inserted), or None
    when ``max_claimers`` <= 0 or every slot is busy."""
    return control.claimer_acquire(conn, ctx.schema, queue, instance_id, max_claimers, seconds(lease_ttl),
                                   seconds(idle_threshold))


def mark_queue_claimer_active(ctx: StorageContext, conn: Connection, queue: str, instance_id: uuid.UUID,
                              lease: QueueClaimerLease, lease_ttl: timedelta | float) -> bool:
    """Refresh the slot; False means it was lost (taken over by another instance)."""
    return control.claimer_mark_active(conn, ctx.schema, queue, instance_id, lease, seconds(lease_ttl))


def claim_runtime_batch_with_aging_for_instance(
        ctx: StorageContext, tx: Transactions, queue: str, max_batch: int,
        deadline_duration: timedelta | float | None, aging_interval: timedelta | float | None,
        instance_id: uuid.UUID, max_claimers: int, lease_ttl: timedelta | float,
        idle_threshold: timedelta | float) -> list[ClaimedRuntimeJob]:
    """Claim only while holding one of the queue's (adaptive, <= ``max_claimers``) claimer
    slots; returns [] when no slot is free. With an Engine: the slot, the claim (per stripe)
    and the slot's refresh are separate transactions, and a failed refresh is logged, never
    raised over committed claims."""
    sch = ctx.schema
    ttl, idle = seconds(lease_ttl), seconds(idle_threshold)
    physical = stripes_for(queue, sch.config.queue_stripe_count)
    with tx.unit() as conn:
        goal = control.claimer_target(conn, sch, queue, physical, max_claimers) if max_claimers > 0 else 0
        lease = control.claimer_acquire(conn, sch, queue, instance_id, goal, ttl, idle)
    if lease is None:
        return []
    jobs = _claim(ctx, tx, queue, max_batch, ms(deadline_duration), ms(aging_interval))
    if jobs:
        try:
            with tx.unit() as conn:
                if control.claimer_needs_refresh(conn, sch, queue, instance_id, lease, ttl, idle):
                    control.claimer_mark_active(conn, sch, queue, instance_id, lease, ttl)
        except Exception as err:
            # the claims are committed: losing them to a failed refresh would leave live
            # attempts nobody works on; an unrefreshed slot only expires sooner
            if not tx.owned:
                raise
            log.warning("qstore: claimer slot refresh failed after a claim: %s", failure_line(err))
            log.debug("qstore: claimer slot refresh failed here:", exc_info=True)
    return jobs
