"""Completion: close attempts successfully, guarded by ``(job_id, run_lease)``.

Fast path (``complete_runtime_batch`` for plain receipt-only attempts): one call of the
server function ``complete_receipts`` locks the receipts, appends closures (``ON CONFLICT DO
NOTHING`` — a rescue or cancel that closed first wins), narrow done rows from the claim-time
receipt and the claim-time kind (the worker sends ``(claim_slot, job_id, run_lease, kind)``)
and grouped count deltas.
Everything else (materialised leases, heartbeated receipts, unique-key transitions) takes
the general path of :mod:`qstore.storage.attempts`. Stale entries are absent from results.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Connection, Integer, Text, column, select

from qstore.errors import PartialCommitError
from qstore.model import ClaimedEntry, ClaimedRuntimeJob, JobState
from qstore.schema import StorageSchema
from qstore.storage._tx import Target, owns_transaction, single_statement, transaction
from qstore.storage.attempts import take_attempts
from qstore.storage.enqueue import LaneRouter
from qstore.storage.jobs import holds_key
from qstore.storage.statements import packed_array_param, schema_func
from qstore.storage.transitions import Decision, apply
from qstore.storage.writers import Body

__all__ = ["complete_pairs", "complete_runtime", "complete_runtime_on"]

# Completion never re-enqueues, so it needs no lane routing state of its own.
_NO_REENQUEUE = LaneRouter()

_ARRAYS: dict[str, type[Any]] = {"claim_slots": Integer, "job_ids": BigInteger, "run_leases": BigInteger,
                                 "kinds": Text}


@functools.lru_cache(maxsize=64)
def _fast_stmt(sch: StorageSchema) -> Any:
    """``SELECT * FROM <schema>.complete_receipts(:arrays…)`` (see schema/functions.py)."""
    fn = schema_func(sch, "complete_receipts", *(packed_array_param(n, t) for n, t in _ARRAYS.items()))
    return select(fn.table_valued(column("job_id", BigInteger()), column("run_lease", BigInteger())))


def _fast_candidate(job: ClaimedRuntimeJob) -> bool:
    if not job.claim.lease_claim_receipt:
        return False
    states = job.unique_states or job.job.unique_states
    # a unique key whose ownership changes on completion needs the general path's sync
    return job.job.unique_key is None or holds_key(states, JobState.RUNNING) == holds_key(states, JobState.COMPLETED)


def complete_pairs(conn: Connection, sch: StorageSchema, pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """General path: complete whichever of ``pairs`` are live (receipt or lease). Progress is
    dropped from the terminal payload; metadata, tags and errors stay as enqueued."""
    taken = take_attempts(conn, sch, pairs, "completed")
    done = Decision("terminal", JobState.COMPLETED, clear_progress=True)
    apply(conn, sch, _NO_REENQUEUE, [(Body.from_taken(t), done, t.old_state) for t in taken],
          ready_payloads={t.job_id: t.payload for t in taken})
    return [(t.job_id, t.run_lease) for t in taken]


def _complete_fast(conn: Connection, sch: StorageSchema, claimed: Sequence[ClaimedRuntimeJob]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
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
    rows = conn.execute(_fast_stmt(sch), {
        "claim_slots": [x.claim_slot for x in e], "job_ids": [x.job_id for x in e],
        "run_leases": [x.run_lease for x in e], "kinds": [j.job.kind for j in fast.values()],
    }).all()
    finished = set(map(tuple, rows))
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


def complete_runtime(conn: Connection, sch: StorageSchema, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    """Complete each claimed attempt at most once, in one transaction; returns the pairs
    that completed, in input order."""
    done, rest = _complete_fast(conn, sch, claimed)
    if not rest:
        return done
    return _in_input_order(done + complete_pairs(conn, sch, rest), claimed)


def complete_runtime_on(target: Target, sch: StorageSchema, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
    """:func:`complete_runtime` under the transaction contract of ``target``.

    Connection and Session targets run everything in the caller's transaction. With an
    ``Engine``: when every attempt can take the fast path, its one statement commits on its
    own (one round trip); any attempt it turns out not to finish (a receipt materialised by
    a heartbeat or callback since the claim) then takes the general path in a second
    transaction, and if that one fails the error is a
    :class:`~qstore.errors.PartialCommitError` whose ``committed`` lists the attempts the
    first transaction completed. When some attempts need the general path from the start,
    both parts run in one transaction. Each attempt completes at most once; only attempts
    that completed are returned.
    """
    if not owns_transaction(target) or not all(_fast_candidate(j) for j in claimed):
        with transaction(target) as conn:
            return complete_runtime(conn, sch, claimed)
    with single_statement(target) as conn:
        done, rest = _complete_fast(conn, sch, claimed)
    if not rest:
        return done
    try:
        with transaction(target) as conn:
            done += complete_pairs(conn, sch, rest)
    except Exception as err:
        raise PartialCommitError(err, _in_input_order(done, claimed), rest) from err
    return _in_input_order(done, claimed)
