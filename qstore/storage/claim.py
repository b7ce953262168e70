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
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import TableValuedAlias

from qstore.errors import failure_line
from qstore.schema import StorageSchema
from qstore.storage.checks import ms, seconds
from qstore.storage.columns import CLAIMED, claimed
from qstore.storage.context import StorageContext
from qstore.storage.jobs import stripes_for
from qstore.storage.planes import control
from qstore.storage.statements import HotStatement, schema_func
from qstore.storage.targets import Runner, Transactions
from qstore.types import ClaimedEntry, ClaimedRuntimeJob, JobRow, QueueClaimerLease

__all__ = [
    "acquire_queue_claimer",
    "claim_batch",
    "claim_job_batch",
    "claim_physical",
    "claim_runtime_batch",
    "claim_runtime_batch_with_aging",
    "claim_runtime_batch_with_aging_for_instance",
    "claim_statement",
    "claim_stripes",
    "mark_queue_claimer_active",
]

log = logging.getLogger("qstore.storage")


def claim_statement(sch: StorageSchema, max_batch: ColumnElement[Any] | None = None,
                    ordinality: str | None = None) -> TableValuedAlias:
    """``<schema>.claim_ready(:queue, :max_batch, :deadline_ms, :aging_ms, :receipts)`` as a
    row source with the :data:`~qstore.storage.columns.CLAIMED` columns; ``max_batch``
    replaces the ``:max_batch`` parameter by an expression; ``ordinality`` names a column
    numbering the rows (``WITH ORDINALITY``)."""
    fn = schema_func(
        sch, "claim_ready",
        bindparam("queue", type_=Text()),
        bindparam("max_batch", type_=Integer()) if max_batch is None else max_batch,
        bindparam("deadline_ms", type_=BigInteger()), bindparam("aging_ms", type_=BigInteger()),
        bindparam("receipts", type_=Boolean()),
    )
    return fn.table_valued(*(column(c.name, c.type) for c in CLAIMED), with_ordinality=ordinality)


@functools.lru_cache(maxsize=64)
def _claim_stmt(sch: StorageSchema) -> HotStatement:
    return HotStatement(select(claim_statement(sch)))


def claim_physical(run: Runner, sch: StorageSchema, queue: str, max_batch: int,
                   deadline_ms: int, aging_ms: int) -> list[ClaimedRuntimeJob]:
    """One ``claim_ready`` call on one physical queue, through ``run``."""
    receipts = sch.config.lease_claim_receipts
    rows = run.rows(_claim_stmt(sch), {
        "queue": queue, "max_batch": max_batch, "deadline_ms": deadline_ms,
        "aging_ms": aging_ms, "receipts": receipts,
    })
    return [claimed(r, receipts) for r in rows]


def _claim(ctx: StorageContext, tx: Transactions, queue: str, max_batch: int, deadline_ms: int,
           aging_ms: int) -> list[ClaimedRuntimeJob]:
    stripes = stripes_for(queue, ctx.config.queue_stripe_count, next(ctx.stripe_probe))
    return claim_stripes(ctx, tx, stripes, max_batch, deadline_ms, aging_ms, [])


def claim_stripes(ctx: StorageContext, tx: Transactions, stripes: list[str], max_batch: int,
                  deadline_ms: int, aging_ms: int, out: list[ClaimedRuntimeJob]) -> list[ClaimedRuntimeJob]:
    """Claim stripe after stripe of ``stripes`` (one statement each, autocommitted with an
    Engine) until ``out``, the attempts claimed so far, holds ``max_batch``; returns ``out``.
    With an Engine, an error on a stripe after something was claimed is logged and what
    was claimed is returned (it is committed); otherwise it is raised."""
    sch = ctx.schema
    for q in stripes:
        if len(out) >= max_batch:
            break
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
