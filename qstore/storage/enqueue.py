"""Enqueue: ``enqueue`` (one job, returns its id), ``enqueue_many`` / ``enqueue_params_batch``
(many jobs, one statement), ``enqueue_params_copy`` (COPY) and ``enqueue_batch`` (synthetic
benchmark jobs).

Everything is validated in Python first. Then every path except COPY is **one statement**:
the server function ``enqueue_jobs`` (``enqueue_job`` for a single job: the same steps
with scalar arguments and without the batch path's nested calls) allocates the ids, takes the unique keys, picks and
reserves the lanes (the reservation lock is held until the enqueue commits), writes ready
rows into the current queue slot and scheduled rows into the backlog, and queues the
NOTIFY wake-ups (delivered on commit). On an ``Engine`` that statement is autocommitted, so
a single-job enqueue is one round trip; in a caller's transaction it is one statement
there. A unique key another job owns makes the function write nothing and report the
owner, which raises :class:`UniqueConflictError` here while the caller's transaction stays
usable.

COPY cannot call a function, so ``enqueue_params_copy`` and ``enqueue_batch`` write the same
rows step by step in one transaction (:func:`write_jobs`), following the same lane rule.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import BigInteger, Boolean, Connection, Numeric, bindparam, cast, column, select
from sqlalchemy.dialects.postgresql import ARRAY, BYTEA

from qstore.errors import UniqueConflictError
from qstore.schema import StorageSchema
from qstore.storage.context import StorageContext
from qstore.storage.jobs import (
    InsertOpts,
    InsertParams,
    PreparedJob,
    holds_key,
    ordering_hash,
    prepare_job,
    prepare_jobs,
    stripe_of,
    validate_json,
)
from qstore.storage.lanes import assign_lanes
from qstore.storage.planes import control, queue
from qstore.storage.planes.queue import READY_COLUMNS, SNAPSHOT_COLUMNS
from qstore.storage.statements import HotStatement, packed_array_param, schema_func
from qstore.storage.targets import Runner

__all__ = ["DeferredJob", "KeptValues", "enqueue", "enqueue_batch", "enqueue_many", "enqueue_params_batch",
           "enqueue_params_copy", "send_jobs", "write_jobs"]

#: The arguments of ``enqueue_jobs`` (one array each, in its parameter order) and of
#: ``enqueue_job`` (one value each): the array's bind name, the value's, the element type.
_ARGUMENTS: tuple[tuple[str, str, Any], ...] = (
    ("kinds", "kind", READY_COLUMNS["kind"]), ("queues", "queue", READY_COLUMNS["queue"]),
    ("logicals", "logical", READY_COLUMNS["queue"]), ("args", "args", READY_COLUMNS["args"]),
    ("priorities", "priority", READY_COLUMNS["priority"]),
    ("max_attempts", "max_attempts", READY_COLUMNS["max_attempts"]),
    ("run_ats", "run_at", SNAPSHOT_COLUMNS["run_at"]),
    ("unique_keys", "unique_key", READY_COLUMNS["unique_key"]),
    ("unique_states", "unique_states", READY_COLUMNS["unique_states"]),
    ("payloads", "payload", READY_COLUMNS["payload"]), ("takes_key", "takes_key", Boolean()),
    ("order_hashes", "order_hash", Numeric()), ("channels", "channel", READY_COLUMNS["queue"]),
)

#: The bind keys of ``enqueue_job``, in its parameter order.
_VALUE_KEYS = tuple(name for _, name, _ in _ARGUMENTS)
_ARGS = _VALUE_KEYS.index("args")
_CHANNEL = _VALUE_KEYS.index("channel")
_QUEUE = _VALUE_KEYS.index("queue")


@functools.lru_cache(maxsize=64)
def _enqueue_stmt(sch: StorageSchema) -> HotStatement:
    """``SELECT * FROM <schema>.enqueue_jobs(<thirteen arrays>)``: one row, the new ids in
    batch order or the first conflicting key and its owner."""
    fn = schema_func(sch, "enqueue_jobs", *(packed_array_param(n, t) for n, _, t in _ARGUMENTS))
    return HotStatement(select(fn.table_valued(
        column("job_ids", ARRAY(BigInteger())), column("conflict_key", BYTEA()),
        column("conflict_owner", BigInteger()))))


@functools.lru_cache(maxsize=64)
def _enqueue_one_stmt(sch: StorageSchema) -> HotStatement:
    """``SELECT * FROM <schema>.enqueue_job(<thirteen scalars>)``: one row, the new id or the
    conflicting key and its owner. The same arguments as :func:`_enqueue_stmt`, one value
    each instead of a one-element array: nothing to pack per call, no array to index on the
    server."""
    fn = schema_func(sch, "enqueue_job", *(cast(bindparam(n, type_=t), t) for _, n, t in _ARGUMENTS))
    return HotStatement(select(fn.table_valued(
        column("job_id", BigInteger()), column("conflict_key", BYTEA()),
        column("conflict_owner", BigInteger()))))


def _refuse_duplicate_keys(rows: Sequence[PreparedJob]) -> None:
    seen: set[bytes] = set()
    for r in rows:
        if r.unique_key is not None and holds_key(r.unique_states, r.state):
            if r.unique_key in seen:
                raise UniqueConflictError("job_unique_claims", f"duplicate unique key {r.unique_key.hex()} in one batch")
            seen.add(r.unique_key)


def _parameters(sch: StorageSchema, rows: Sequence[PreparedJob]) -> dict[str, Any]:
    """The arrays of :func:`_enqueue_stmt` for ``rows``: each row's :func:`_one_values`,
    column by column, and the channels to wake once each."""
    values = [_one_values(sch, r) for r in rows]
    out = {array: [v[i] for v in values] for i, (array, name, _) in enumerate(_ARGUMENTS) if name != "channel"}
    out["channels"] = sorted({v[_CHANNEL] for v in values if v[_CHANNEL] is not None})
    return out


def _one_values(sch: StorageSchema, r: PreparedJob) -> tuple[Any, ...]:
    """The values of :func:`_enqueue_one_stmt` for one row, in the order of
    :data:`_VALUE_KEYS` (a scheduled row wakes nobody: no channel)."""
    key = r.unique_key
    return (
        r.kind, r.queue, r.logical, r.args, r.priority, r.max_attempts, r.run_at, key, r.unique_states,
        r.payload, key is not None and holds_key(r.unique_states, r.state),
        None if r.ordering_key is None else ordering_hash(r.ordering_key),
        None if r.run_at is not None else sch.config.notify_channel(r.logical),
    )


def _prepared(ctx: StorageContext, jobs: Sequence[InsertParams]) -> list[PreparedJob]:
    """``jobs`` validated (:func:`~qstore.storage.jobs.prepare_jobs`), each call's key-less
    rows starting the round-robin over a striped queue's stripes one stripe further."""
    return prepare_jobs(jobs, ctx.config.queue_stripe_count, start=next(ctx.stripe_rotor))


def send_jobs(run: Runner, ctx: StorageContext, rows: Sequence[PreparedJob]) -> list[int]:
    """Write validated ``rows`` with one statement through ``run`` (``enqueue_job`` for one
    row, ``enqueue_jobs`` for more); returns the
    new ids in batch order. A unique key owned by another job (or named twice in ``rows``)
    raises :class:`UniqueConflictError` and writes nothing (the statement itself succeeds,
    so a caller's transaction stays usable)."""
    if not rows:
        return []
    sch = ctx.schema
    if len(rows) == 1:
        ((job_id, key, owner),) = run.rows_in_order(_enqueue_one_stmt(sch), _VALUE_KEYS, _one_values(sch, rows[0]))
        ids = None if job_id is None else [job_id]
    else:
        _refuse_duplicate_keys(rows)
        ((ids, key, owner),) = run.rows(_enqueue_stmt(sch), _parameters(sch, rows))
    if ids is None:
        raise _conflict(key, owner)
    for row, job_id in zip(rows, ids, strict=True):
        row.job_id = job_id
    return list(ids)


def _conflict(key: bytes | None, owner: int | None) -> UniqueConflictError:
    what = f"unique key {key.hex()}" if key is not None else "a unique key"
    by = f"job {owner}" if owner is not None else "another job"
    return UniqueConflictError("job_unique_claims", f"{what} is owned by {by}")


def write_jobs(conn: Connection, ctx: StorageContext, rows: Sequence[PreparedJob], *, use_copy: bool) -> int:
    """Write new, validated jobs step by step on ``conn``'s transaction (the COPY path: ids,
    keys, lanes, ready rows over COPY or INSERT, scheduled rows, NOTIFY). Returns rows
    written; a unique conflict raises (the transaction must not commit)."""
    if not rows:
        return 0
    sch = ctx.schema
    queue.allocate_ids(conn, sch, rows)
    control.acquire_keys(conn, sch, [(r.unique_key, r.job_id) for r in rows
                                     if r.unique_key is not None and holds_key(r.unique_states, r.state)])
    ready = [r for r in rows if r.run_at is None]
    deferred = [r for r in rows if r.run_at is not None]
    assign_lanes(conn, ctx, ready)
    if ready:
        (queue.copy_ready if use_copy else queue.insert_ready)(conn, sch, ready)
    if deferred:
        queue.insert_deferred(conn, sch, deferred)
    queue.notify_queues(conn, sch, {r.logical for r in ready})
    return len(rows)


class KeptValues:
    """Where :func:`enqueue` keeps the ``enqueue_job`` values of the last job a task's
    deferral sent (one per :class:`~qstore.runtime.tasks.Deferral`; see
    :class:`DeferredJob`)."""

    __slots__ = ("kept",)

    def __init__(self) -> None:
        #: (install, kind, options, values) of a job written with these options
        self.kept: tuple[StorageContext, str, InsertOpts, tuple[Any, ...]] | None = None


@dataclass(frozen=True)
class DeferredJob(InsertParams):
    """An :class:`InsertParams` a task's deferral enqueues, many of which share one kind and
    one :class:`InsertOpts` object. Written like any other (the same checks, the same
    statement), except that :func:`enqueue` takes the values that depend on the kind and
    the options alone from the previous job of the same kind and options on the same
    install, kept in :attr:`kept`, and checks only the args (a striped queue's stripe is
    still picked per job).

    The values are reused only while they cannot have changed: options without a unique
    key (which depends on the args), with no metadata (a mapping that could be changed in
    place; checked at every job), tags in a tuple and an ordering key in ``bytes``. Every
    other value of the options cannot change and was checked when the previous job was
    written, so a job refused now is refused for its args, naming the field the full
    checks of :func:`~qstore.storage.jobs.prepare_job` name."""

    kept: KeptValues | None = field(default=None, compare=False, repr=False)


def _reusable(opts: InsertOpts) -> bool:
    """Whether jobs with ``opts`` have the same values but their args (see
    :class:`DeferredJob`); ``opts`` passed :func:`prepare_job`."""
    key = opts.ordering_key
    return (type(opts) is InsertOpts and opts.unique is None and type(opts.metadata) is dict
            and not opts.metadata and type(opts.tags) is tuple and (key is None or type(key) is bytes))


def _deferred_values(ctx: StorageContext, job: DeferredJob, slot: KeptValues) -> Sequence[Any]:
    kept, opts = slot.kept, job.opts
    if kept is not None and kept[0] is ctx and kept[1] is job.kind and kept[2] is opts and not opts.metadata:
        values = list(kept[3])
        values[_ARGS] = validate_json(job.args, "job.args")  # as prepare_job names it
        stripes = ctx.config.queue_stripe_count
        if stripes > 1:  # key-less: the next stripe of the round-robin
            values[_QUEUE] = stripe_of(opts.queue, stripes, next(ctx.stripe_rotor), None)
        return values
    fresh = _fresh_values(ctx, job)
    if _reusable(opts):
        slot.kept = (ctx, job.kind, opts, fresh)
    return fresh


def _fresh_values(ctx: StorageContext, job: InsertParams) -> tuple[Any, ...]:
    """The ``enqueue_job`` values of ``job`` after every check of
    :func:`~qstore.storage.jobs.prepare_job` (a key-less job of a striped queue on the next
    stripe of the round-robin)."""
    sch = ctx.schema
    return _one_values(sch, prepare_job(job, sch.config.queue_stripe_count, "job", next(ctx.stripe_rotor)))


def enqueue(ctx: StorageContext, run: Runner, job: InsertParams) -> int:
    """Write one job and return its id: one statement (on an ``Engine``, one autocommitted
    round trip). A unique conflict raises and writes nothing."""
    if type(job) is DeferredJob and job.kept is not None:
        values = _deferred_values(ctx, job, job.kept)
    else:
        values = _fresh_values(ctx, job)
    ((job_id, key, owner),) = run.rows_in_order(_enqueue_one_stmt(ctx.schema), _VALUE_KEYS, values)
    if job_id is None:
        raise _conflict(key, owner)
    return job_id


def enqueue_many(ctx: StorageContext, run: Runner, jobs: Sequence[InsertParams]) -> list[int]:
    """Write ``jobs`` in one statement and return their ids, in batch order. Every job is
    validated before anything is written; a unique conflict writes nothing."""
    return send_jobs(run, ctx, _prepared(ctx, jobs))


def enqueue_params_batch(ctx: StorageContext, run: Runner, jobs: Sequence[InsertParams]) -> int:
    """``enqueue_many`` returning the number of rows written."""
    return len(send_jobs(run, ctx, _prepared(ctx, jobs)))


def enqueue_params_copy(ctx: StorageContext, conn: Connection, jobs: Sequence[InsertParams]) -> int:
    """Same semantics as ``enqueue_params_batch``, streaming the ready rows with COPY (in one
    transaction of its own, or a savepoint of the caller's). Returns rows written."""
    return write_jobs(conn, ctx, _prepared(ctx, jobs), use_copy=True)


def enqueue_batch(ctx: StorageContext, conn: Connection, queue: str, priority: int, count: int) -> int:
    """Benchmark helper: ``count`` available ``bench_job`` jobs with args ``{"seq": i}``,
    round-robin over the stripes (COPY). Returns rows written."""
    opts = InsertOpts(queue=queue, priority=priority)
    jobs: list[Any] = [InsertParams("bench_job", {"seq": i}, opts) for i in range(count)]
    return write_jobs(conn, ctx, _prepared(ctx, jobs), use_copy=True)
