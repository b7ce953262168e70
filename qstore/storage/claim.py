"""Claim: hand out ready positions as attempts, one server round trip per physical queue.

``<schema>.claim_ready`` (see :mod:`qstore.schema.functions`) picks lanes by effective
priority with ``FOR UPDATE SKIP LOCKED`` on the claim head, follows the committed chain of
claim ranges from the cursor hint, records the consumed span and writes receipts (or
leases). Nothing non-transactional moves past uncommitted work, so a claim that runs in a
caller's transaction and is rolled back leaves no trace and strands nothing.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, Boolean, Connection, Integer, Text, bindparam, column, select
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, TIMESTAMP
from sqlalchemy.types import TypeEngine

from qstore.errors import QueueStorageError, ValidationError
from qstore.model import ClaimedEntry, ClaimedRuntimeJob, JobRow, JobState, assemble
from qstore.schema import StorageSchema
from qstore.storage._tx import Target, owns_transaction, single_statement, transaction
from qstore.storage.jobs import is_stripe, validate_queue
from qstore.storage.statements import schema_func

__all__ = ["MAX_BATCH", "ClaimRouter", "claim_physical", "duration_ms", "stripes_for", "validate_batch"]

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
#: Batch sizes and limits are bound as PostgreSQL ``integer``.
MAX_BATCH = 2**31 - 1
MAX_DURATION_SECONDS = 10 * 365 * 86400


@functools.lru_cache(maxsize=64)
def _claim_stmt(sch: StorageSchema) -> Any:
    fn = schema_func(
        sch, "claim_ready",
        bindparam("queue", type_=Text()), bindparam("max_batch", type_=Integer()),
        bindparam("deadline_ms", type_=BigInteger()), bindparam("aging_ms", type_=BigInteger()),
        bindparam("receipts", type_=Boolean()),
    )
    return select(fn.table_valued(*(column(n, t) for n, t in _CLAIM_COLUMNS)))


def duration_ms(value: timedelta | float | int | None, field: str) -> int:
    """Milliseconds of a duration between 0 and 10 years (timedelta or seconds; None is 0)."""
    if value is None:
        return 0
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value  # compared before any conversion: a huge int never becomes a float
    else:
        raise ValidationError(field, value, "must be a timedelta or a number of seconds")
    if not 0 <= seconds <= MAX_DURATION_SECONDS:  # also rejects NaN
        raise ValidationError(field, value, "must be between 0 and 10 years")
    return int(seconds * 1000)


def validate_batch(max_batch: object, field: str = "max_batch") -> int:
    """A positive batch size or limit that fits PostgreSQL ``integer``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 0 < max_batch <= MAX_BATCH:
        raise ValidationError(field, max_batch, f"must be an integer between 1 and {MAX_BATCH}")
    return max_batch


def stripes_for(queue: str, stripe_count: int, start: int) -> list[str]:
    """Physical queues of a logical queue, starting at a rotating probe index."""
    if stripe_count <= 1 or is_stripe(queue):
        return [queue]
    k = start % stripe_count
    return [f"{queue}#{(k + i) % stripe_count}" for i in range(stripe_count)]


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


def claim_physical(conn: Connection, sch: StorageSchema, queue: str, max_batch: int,
                   deadline_ms: int, aging_ms: int) -> list[ClaimedRuntimeJob]:
    """One ``claim_ready`` call on ``conn``'s transaction."""
    receipts = sch.config.lease_claim_receipts
    rows = conn.execute(_claim_stmt(sch), {
        "queue": queue, "max_batch": max_batch, "deadline_ms": deadline_ms,
        "aging_ms": aging_ms, "receipts": receipts,
    }).all()
    return [_to_runtime(r, receipts) for r in rows]


class ClaimRouter:
    """Per-process stripe probe rotor."""

    def __init__(self) -> None:
        self._probe = itertools.count()

    def claim(self, target: Target, sch: StorageSchema, queue: str, max_batch: int,
              deadline: timedelta | float | None, aging: timedelta | float | None,
              *, one_transaction: bool = False) -> list[ClaimedRuntimeJob]:
        """Claim up to ``max_batch`` attempts across the queue's stripes.

        With an ``Engine`` each stripe is claimed in its own transaction, one autocommitted
        statement (the lock order every producer also follows); an error on a later stripe
        returns what was already claimed. With a caller's Connection/Session all stripes run
        in that transaction.
        """
        validate_queue(queue)
        validate_batch(max_batch)
        deadline_ms = duration_ms(deadline, "deadline_duration")
        aging_ms = duration_ms(aging, "aging_interval")
        stripes = stripes_for(queue, sch.config.queue_stripe_count, next(self._probe))
        out: list[ClaimedRuntimeJob] = []
        if one_transaction or not owns_transaction(target):
            with transaction(target) as conn:
                for q in stripes:
                    out += claim_physical(conn, sch, q, max_batch - len(out), deadline_ms, aging_ms)
                    if len(out) >= max_batch:
                        break
            return out
        for q in stripes:
            try:
                # one claim_ready call is one statement: on an Engine it commits on its own,
                # so the lane head is held for the call alone, not for extra round trips
                with single_statement(target) as conn:
                    out += claim_physical(conn, sch, q, max_batch - len(out), deadline_ms, aging_ms)
            except QueueStorageError:
                if not out:
                    raise
                break
            except Exception:
                if not out:
                    raise
                break
            if len(out) >= max_batch:
                break
        return out


def entries(jobs: Sequence[ClaimedRuntimeJob]) -> list[ClaimedEntry]:
    return [j.claim for j in jobs]
