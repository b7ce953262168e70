"""Completion: close attempts successfully, guarded by ``(job_id, run_lease)``.

Fast path (``complete_runtime_batch`` for plain receipt-only attempts): one call of the
server function ``complete_receipts`` locks the receipts and then, in its next statement
(which sees every closure committed before the locks: a rescue or cancel that closed first
wins), closes those still open with batch closures per block of job ids, writes batch done
rows per lane (narrow ones from the claim-time receipt and kind for a lone attempt), and
grouped count deltas. Everything else (leases, receipts
materialised by a callback, unique-key transitions) takes the general path: take → decide →
write. Stale attempts are absent from results.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Integer,
    Text,
    bindparam,
    case,
    column,
    func,
    literal_column,
    select,
    true,
)

from qstore.errors import PartialCommitError
from qstore.schema import StorageSchema
from qstore.storage import destinations
from qstore.storage.bodies import Body
from qstore.storage.checks import ms
from qstore.storage.claim import claim_physical, claim_statement, claim_stripes
from qstore.storage.columns import CLAIMED, claimed
from qstore.storage.context import StorageContext
from qstore.storage.decide import Decision, Destination
from qstore.storage.enqueue import enqueue_many
from qstore.storage.jobs import InsertParams, holds_key, stripes_for
from qstore.storage.planes.execution import Closure, take_attempts
from qstore.storage.statements import HotStatement, packed_array_param, schema_func
from qstore.storage.targets import Runner, Transactions
from qstore.types import ClaimedEntry, ClaimedRuntimeJob, CompletedAndClaimed, JobState

__all__ = [
    "complete_and_claim",
    "complete_batch",
    "complete_claimed_batch",
    "complete_job_batch_by_id",
    "complete_pairs",
    "complete_runtime_batch",
    "complete_runtime_batch_slow_in_tx",
    "complete_runtime_batch_with_followups",
]

_ARRAYS: dict[str, type[Any]] = {"claim_slots": Integer, "job_ids": BigInteger, "run_leases": BigInteger,
                                 "kinds": Text}
_COMPLETED = Decision(Destination.TERMINAL, JobState.COMPLETED, clear_progress=True)


@functools.lru_cache(maxsize=64)
def _fast_stmt(sch: StorageSchema) -> HotStatement:
    """``SELECT * FROM <schema>.complete_receipts(:claim_slots, :job_ids, :run_leases, :kinds)``."""
    fn = schema_func(sch, "complete_receipts", *(packed_array_param(n, t) for n, t in _ARRAYS.items()))
    return HotStatement(select(fn.table_valued(column("job_id", BigInteger()), column("run_lease", BigInteger()))))


def _fast_candidate(job: ClaimedRuntimeJob) -> bool:
    if not job.claim.lease_claim_receipt:
        return False
    states = job.unique_states or job.job.unique_states
    # a unique key whose ownership changes on completion needs the general path's sync
    return job.job.unique_key is None or holds_key(states, JobState.RUNNING) == holds_key(states, JobState.COMPLETED)


def complete_pairs(conn: Connection, ctx: StorageContext, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """General path: complete whichever of ``pairs`` are live (receipt or lease). Progress is
    dropped from the terminal payload; metadata, tags and errors stay as enqueued."""
    taken = take_attempts(conn, ctx.schema, pairs, Closure.COMPLETED)
    destinations.apply(conn, ctx, [(Body.from_taken(t), _COMPLETED, t.old_state) for t in taken],
                       ready_payloads={t.job_id: t.payload for t in taken})
    return [(t.job_id, t.run_lease) for t in taken]


def _complete_fast(run: Runner, sch: StorageSchema,
                   claimed: Sequence[ClaimedRuntimeJob]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One ``complete_receipts`` call for the fast candidates among ``claimed``. Returns the
    pairs it completed, in input order, and the pairs left for the general path
    (non-candidates, and candidates whose receipt was materialised or already closed)."""
    # one entry per attempt: the same attempt twice in one call completes once
    fast: dict[tuple[int, int], ClaimedRuntimeJob] = {}
    rest: dict[tuple[int, int], None] = {}
    for j in claimed:
        pair = (j.job.id, j.job.run_lease)
        if _fast_candidate(j):
            fast.setdefault(pair, j)
        else:
            rest[pair] = None
    if not fast:
        return [], list(rest)
    e: list[ClaimedEntry] = [j.claim for j in fast.values()]
    rows = run.rows(_fast_stmt(sch), {
        "claim_slots": [x.claim_slot for x in e], "job_ids": [x.job_id for x in e],
        "run_leases": [x.run_lease for x in e], "kinds": [j.job.kind for j in fast.values()],
    })
    finished = {(r[0], r[1]) for r in rows}
    if len(finished) == len(fast):
        done = list(fast)
    else:
        done = [pr for pr in fast if pr in finished]
        rest.update((pr, None) for pr in fast if pr not in finished)
    # a pair both fast (one copy) and not (another copy with other attributes) is done once
    return done, [pr for pr in rest if pr not in finished]


def _in_input_order(done: list[tuple[int, int]], claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    order = {(j.job.id, j.job.run_lease): n for n, j in enumerate(claimed)}
    return sorted(done, key=lambda pr: order.get(pr, 0))


def complete_runtime_batch(ctx: StorageContext, tx: Transactions,
                           claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    """Complete each claimed attempt at most once; returns the ``(job_id, run_lease)`` pairs
    that completed, in input order (stale, rescued or already-closed attempts are absent).

    In a caller's transaction everything runs there. With an ``Engine``: when every attempt
    can take the fast path, its one statement commits on its own (one round trip); any
    attempt it turns out not to finish (a receipt materialised since the claim: by a
    callback, or by a heartbeat of a worker older than revision 0013) then takes the
    general path in a second transaction, and if that one
    fails the error is a :class:`~qstore.errors.PartialCommitError` whose ``committed`` lists
    the attempts the first transaction completed. When some attempts need the general path
    from the start, both parts run in one transaction.
    """
    if not claimed:
        return []
    if not tx.owned or not all(_fast_candidate(j) for j in claimed):
        with tx.unit() as conn:
            done, rest = _complete_fast(Runner.on(conn), ctx.schema, claimed)
            if not rest:
                return done
            return _in_input_order(done + complete_pairs(conn, ctx, rest), claimed)
    with tx.hot() as run:
        done, rest = _complete_fast(run, ctx.schema, claimed)
    if not rest:
        return done
    try:
        with tx.unit() as conn:
            done += complete_pairs(conn, ctx, rest)
    except Exception as err:
        raise PartialCommitError(err, _in_input_order(done, claimed), rest) from err
    return _in_input_order(done, claimed)


@functools.lru_cache(maxsize=64)
def _fast_and_claim_stmt(sch: StorageSchema) -> HotStatement:
    """One statement: ``complete_receipts`` over the fast attempts, then ``claim_ready``.

    ``d`` aggregates the completion into one row (the pairs it completed); the claim is a
    ``LATERAL`` call whose ``p_max`` is computed from ``d`` (``CASE WHEN d.n >= 0 THEN
    :max_batch END``, always ``:max_batch``), so the claim cannot start before the
    completion has returned all its rows: ``d`` is the outer side of the join and the claim
    needs its value. The ``LEFT JOIN`` keeps ``d``'s row when nothing is claimed. The
    completed pairs come back in the first row only (NULL in the others), so a batch's
    arrays are sent and decoded once, not once per claimed job.

    The constants are written into the text, not bound: the server's plan cache keeps a
    prepared statement on a custom plan (planned again at every execution) while the
    generic plan's estimate is above a custom one's, and comparisons with parameters cost
    more in a generic estimate than comparisons with constants folded in a custom one.
    With only the functions' arguments bound, both estimates are equal and the generic plan
    serves every call after the first few."""
    fn = schema_func(sch, "complete_receipts", *(packed_array_param(n, t) for n, t in _ARRAYS.items()))
    done = fn.table_valued(column("job_id", BigInteger()), column("run_lease", BigInteger())).alias("done")
    d = select(func.array_agg(done.c.job_id).label("done_job_ids"),
               func.array_agg(done.c.run_lease).label("done_run_leases"),
               func.count().label("n")).select_from(done).subquery("d")
    zero, one = literal_column("0", Integer()), literal_column("1", Integer())
    after_done = case((d.c.n >= zero, bindparam("max_batch", type_=Integer())))
    claim = claim_statement(sch, after_done, ordinality="ordinality").lateral("c")
    first = func.coalesce(claim.c.ordinality, one) == one
    return HotStatement(select(case((first, d.c.done_job_ids)), case((first, d.c.done_run_leases)),
                               *(claim.c[c.name] for c in CLAIMED))
                        .select_from(d.outerjoin(claim, true())))


_CLAIM_JOB_ID = 2 + [c.name for c in CLAIMED].index("job_id")  # where a claimed row's job id sits


def _fast_and_claim(run: Runner, sch: StorageSchema, fast: dict[tuple[int, int], ClaimedRuntimeJob], queue: str,
                    max_batch: int, deadline_ms: int, aging_ms: int
                    ) -> tuple[list[tuple[int, int]], list[tuple[int, int]], list[ClaimedRuntimeJob]]:
    """The statement of :func:`_fast_and_claim_stmt` through ``run``: the fast attempts it
    completed (in ``fast``'s order), those it left to the general path, and what it claimed
    from the physical ``queue``."""
    e = [j.claim for j in fast.values()]
    receipts = sch.config.lease_claim_receipts
    rows = run.rows(_fast_and_claim_stmt(sch), {
        "claim_slots": [x.claim_slot for x in e], "job_ids": [x.job_id for x in e],
        "run_leases": [x.run_lease for x in e], "kinds": [j.job.kind for j in fast.values()],
        "queue": queue, "max_batch": max_batch, "deadline_ms": deadline_ms, "aging_ms": aging_ms,
        "receipts": receipts,
    })
    ids, leases = rows[0][0], rows[0][1]
    finished = set(zip(ids, leases, strict=True)) if ids else set()
    done = [pr for pr in fast if pr in finished]
    left = [pr for pr in fast if pr not in finished]
    jobs = [claimed(r[2:], receipts) for r in rows if r[_CLAIM_JOB_ID] is not None]
    return done, left, jobs


def complete_and_claim(ctx: StorageContext, tx: Transactions,
                       completions: Sequence[ClaimedRuntimeJob | tuple[int, int]], queue: str, max_batch: int,
                       deadline_duration: timedelta | float | None = None,
                       aging_interval: timedelta | float | None = None) -> CompletedAndClaimed:
    """Complete the finished attempts ``completions`` and claim up to ``max_batch`` attempts
    of ``queue``: a worker's whole cycle, in one round trip when it can be.

    Guarantees, as ``complete_job_batch_by_id`` followed by ``claim_runtime_batch_with_aging``
    (``deadline_duration``, ``aging_interval``): each attempt completes at most once and only
    while it is live (a stale ``(job_id, run_lease)`` is absent from ``completed`` and changes
    nothing); each claimed attempt is handed to this call alone; ``completed`` lists exactly
    the pairs this call completed, in input order. An item is a ``ClaimedRuntimeJob`` (as the
    claim returned it) or a ``(job_id, run_lease)`` pair.

    **One statement** when every attempt is a plain receipt-only ``ClaimedRuntimeJob`` (the
    completion fast path of ``complete_runtime_batch``): ``SELECT … FROM (SELECT
    array_agg(…) FROM complete_receipts(…)) d LEFT JOIN LATERAL claim_ready(…)``. The claim
    takes its ``p_max`` from ``d``, so it runs after the completion returned. Both are
    ``VOLATILE`` PL/pgSQL functions: each statement inside them takes a fresh snapshot and
    sees what the transaction wrote before it, so the claim's statements see the
    completion's closures and done rows exactly as a second statement of the same
    transaction would (a claim never reads them: it reads lanes, ready rows and claim
    ranges, and it locks only lane heads, which no completion locks). With an ``Engine``
    that statement is autocommitted: one round trip, and the completion and the claim commit
    together or not at all; the receipts it completed stay locked while the claim waits for
    a busy lane (at most the claim's own 200 ms ``lock_timeout``). In a caller's transaction
    it is one statement there, and a rollback undoes both parts.

    The general path cannot join that statement: completing a materialised lease, a
    receipts-off install's lease, a unique-key transition or a bare ``(job_id, run_lease)``
    pair (no claim slot, no kind) takes several statements and decisions made in Python
    (``take_attempts``, ``destinations``), and no server function of the schema does it.
    When the batch holds such attempts from the start, the whole call is one transaction
    (the fast completion, the general one, then the claim; one round trip per statement).
    A fast attempt the statement did not finish (its receipt was materialised since the
    claim: by a callback, or by a heartbeat of a worker older than revision 0013) is
    completed by the general path afterwards: in the
    caller's transaction, or with an ``Engine`` in a second transaction; if that one fails
    the error is a :class:`~qstore.errors.PartialCommitError` whose ``committed`` lists the
    completed pairs followed by the claimed ``ClaimedRuntimeJob``s (committed: work on them)
    and whose ``pending`` lists the attempts not completed.

    A striped queue claims its first stripe (of a rotating start) in the same statement and
    further stripes one autocommitted statement each while fewer than ``max_batch`` were
    claimed, as ``claim_runtime_batch`` does (an error on a later stripe returns what was
    claimed, with an ``Engine``)."""
    sch = ctx.schema
    deadline_ms, aging_ms = ms(deadline_duration), ms(aging_interval)
    stripes = stripes_for(queue, sch.config.queue_stripe_count, next(ctx.stripe_probe))
    fast: dict[tuple[int, int], ClaimedRuntimeJob] = {}
    rest: dict[tuple[int, int], None] = {}
    order: dict[tuple[int, int], int] = {}  # each attempt's first place in the input
    for item in completions:
        if isinstance(item, ClaimedRuntimeJob):
            pair = (item.job.id, item.job.run_lease)
            if _fast_candidate(item):
                fast.setdefault(pair, item)
            else:
                rest[pair] = None
        else:
            pair = item
            rest[pair] = None
        order.setdefault(pair, len(order))
    general = [pr for pr in rest if pr not in fast]  # an attempt given twice completes once
    if general:
        with tx.unit() as conn:
            run = Runner.on(conn)
            done, left = _complete_fast(run, sch, list(fast.values())) if fast else ([], [])
            done += complete_pairs(conn, ctx, left + general)
            jobs = claim_physical(run, sch, stripes[0], max_batch, deadline_ms, aging_ms)
    elif not fast:
        done, left, jobs = [], [], []
        with tx.hot() as run:
            jobs = claim_physical(run, sch, stripes[0], max_batch, deadline_ms, aging_ms)
    else:
        with tx.hot() as run:
            done, left, jobs = _fast_and_claim(run, sch, fast, stripes[0], max_batch, deadline_ms, aging_ms)
        if left:
            try:
                with tx.unit() as conn:
                    done += complete_pairs(conn, ctx, left)
            except Exception as err:
                if not tx.owned:
                    raise
                done.sort(key=order.__getitem__)
                raise PartialCommitError(err, [*done, *jobs], left) from err
    done.sort(key=order.__getitem__)
    if len(jobs) < max_batch and len(stripes) > 1:
        jobs = claim_stripes(ctx, tx, stripes[1:], max_batch, deadline_ms, aging_ms, jobs)
    return CompletedAndClaimed(done, jobs)


def complete_runtime_batch_with_followups(
        ctx: StorageContext, conn: Connection,
        completions: Sequence[tuple[ClaimedRuntimeJob, Sequence[InsertParams]]]) -> list[tuple[int, int]]:
    """Complete each ``(claimed attempt, follow-up jobs)`` of ``completions`` at most once and
    enqueue the follow-ups of the attempts that completed, all on ``conn``'s transaction: an
    attempt's completion and its follow-ups commit together or not at all, and a follow-up
    that cannot be written (a unique conflict, a bad value) raises and leaves nothing of the
    call written. Returns the ``(job_id, run_lease)`` pairs that completed, in input order
    (stale attempts are absent, and their follow-ups are not written)."""
    done = complete_runtime_batch(ctx, Transactions(conn), [claimed for claimed, _ in completions])
    finished = set(done)
    jobs = [job for claimed, followups in completions
            if (claimed.job.id, claimed.job.run_lease) in finished for job in followups]
    if jobs:
        enqueue_many(ctx, Runner.on(conn), jobs)
    return done


def complete_runtime_batch_slow_in_tx(ctx: StorageContext, conn: Connection,
                                      claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    """The general completion path (receipts and leases), on the caller's transaction."""
    return complete_pairs(conn, ctx, [(j.job.id, j.job.run_lease) for j in claimed])


def complete_job_batch_by_id(ctx: StorageContext, conn: Connection,
                             completions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Complete by ``(job_id, run_lease)``: materialised leases and receipt-only attempts
    alike; returns the pairs that completed."""
    return complete_pairs(conn, ctx, completions) if completions else []


def complete_claimed_batch(ctx: StorageContext, conn: Connection,
                           claimed: Sequence[ClaimedEntry]) -> list[tuple[int, int]]:
    """Complete claims identified by their entries (receipts and leases)."""
    return complete_pairs(conn, ctx, [(c.job_id, c.run_lease) for c in claimed]) if claimed else []


def complete_batch(ctx: StorageContext, conn: Connection, claimed: Sequence[ClaimedEntry]) -> int:
    """``complete_claimed_batch``, returning how many completed."""
    return len(complete_claimed_batch(ctx, conn, claimed))
