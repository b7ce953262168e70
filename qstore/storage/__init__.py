"""`QueueStorage`: the seed's method names as thin methods over the operation families.

Every operation takes a target first — an ``Engine`` (own transaction, committed), a
``Connection`` or an ORM ``Session`` (joins the caller's transaction, never commits) — see
:mod:`qstore.storage._tx`. The seed's ``*_in_tx`` / ``*_tx`` variants are the same methods
(aliases kept so a reader of the seed finds every name).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert

from qstore.config import QueueStorageConfig, validate_identifier
from qstore.errors import ValidationError, translate_errors
from qstore.model import (
    CallbackConfig,
    CallbackPollResult,
    ClaimedEntry,
    ClaimedRuntimeJob,
    JobRow,
    JobState,
    ListDlqFilter,
    QueueClaimerLease,
    QueueCounts,
    RetryFromDlqOpts,
)
from qstore.schema import StorageSchema, storage_schema
from qstore.storage import (
    admin,
    callbacks,
    claimers,
    complete,
    dlq,
    enqueue,
    lifecycle,
    outcomes,
    read,
    rescue,
)
from qstore.storage._tx import Target, owns_transaction, transaction
from qstore.storage.claim import MAX_BATCH, ClaimRouter, duration_ms, validate_batch
from qstore.storage.jobs import (
    InsertOpts,
    InsertParams,
    prepare_jobs,
    validate_aware_datetime,
    validate_id,
    validate_json,
    validate_priority,
    validate_queue,
    validate_text,
    validate_uuid,
)
from qstore.storage.maintenance import MaintenanceOps
from qstore.storage.transitions import Decision

__all__ = ["QueueStorage"]

log = logging.getLogger("qstore.storage")


def select_now() -> Any:
    return select(func.clock_timestamp())


# -- argument checks shared by the methods below (each raises ValidationError naming the value)
def _optional_text(value: object, field: str) -> str | None:
    return None if value is None else validate_text(value, field)


def _optional_id(value: object, field: str) -> int | None:
    return None if value is None else validate_id(value, field)


def _items(value: object, field: str) -> list[Any]:
    """A list of the items of a sequence argument (a str or a non-iterable is refused)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValidationError(field, value, "must be a sequence")
    return list(value)


def _id_pairs(value: object, field: str, *, lists: bool = True) -> list[tuple[int, int]]:
    """``(job_id, run_lease)`` pairs, each a tuple (or a list, when ``lists``) of two ids."""
    out = []
    for i, pair in enumerate(_items(value, field)):
        if not (isinstance(pair, tuple) or (lists and isinstance(pair, list))) or len(pair) != 2:
            raise ValidationError(f"{field}[{i}]", pair, "expected a (job_id, run_lease) pair")
        out.append((validate_id(pair[0], f"{field}[{i}].job_id"), validate_id(pair[1], f"{field}[{i}].run_lease")))
    return out


def _typed_items(value: object, cls: type, field: str) -> list[Any]:
    items = _items(value, field)
    for i, item in enumerate(items):
        if not isinstance(item, cls):
            raise ValidationError(f"{field}[{i}]", item, f"expected {cls.__name__}")
    return items


def _optional_flag(value: object, field: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValidationError(field, value, "must be a bool or None")
    return value


def _dlq_filter(flt: object) -> ListDlqFilter:
    """The filter, checked field by field."""
    if not isinstance(flt, ListDlqFilter):
        raise ValidationError("filter", flt, "expected ListDlqFilter")
    _optional_text(flt.kind, "filter.kind")
    if flt.queue is not None:
        validate_queue(flt.queue, "filter.queue")
    _optional_text(flt.tag, "filter.tag")
    _optional_id(flt.before_id, "filter.before_id")
    if flt.before_dlq_at is not None:
        validate_aware_datetime(flt.before_dlq_at, "filter.before_dlq_at")
    if flt.limit is not None:
        validate_batch(flt.limit, "filter.limit")
    return flt


class QueueStorage(MaintenanceOps):
    """Segmented queue storage for one schema (see STORAGE.md for the design)."""

    def __init__(self, config: QueueStorageConfig | None = None) -> None:
        if config is not None and not isinstance(config, QueueStorageConfig):
            raise ValidationError("config", config, "expected QueueStorageConfig or None")
        self._config = config or QueueStorageConfig()
        self._schema: StorageSchema = storage_schema(self._config)
        self._lanes = enqueue.LaneRouter()
        self._claims = ClaimRouter()

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def new(cls, config: QueueStorageConfig) -> QueueStorage:
        return cls(config)

    @classmethod
    def from_existing_schema(cls, schema: str, engine: Target | None = None) -> QueueStorage:
        """Storage for an existing ``schema``. Without ``engine``: default shape, no I/O
        (as the seed). With ``engine``: the shape recorded by the install is read back."""
        validate_identifier(schema, "schema")
        if engine is not None:
            return cls(translate_errors(lifecycle.load_config)(engine, schema))
        return cls(QueueStorageConfig(schema=schema))

    # -- naming -----------------------------------------------------------------------
    @property
    def config(self) -> QueueStorageConfig:
        return self._config

    @property
    def tables(self) -> StorageSchema:
        """The declared schema objects of this install (tables, rings, functions)."""
        return self._schema

    def schema(self) -> str:
        return self._config.schema

    def slot_count(self) -> int:
        return self._config.queue_slot_count

    def queue_slot_count(self) -> int:
        return self._config.queue_slot_count

    def lease_slot_count(self) -> int:
        return self._config.lease_slot_count

    def claim_slot_count(self) -> int:
        return self._config.claim_slot_count

    def queue_stripe_count(self) -> int:
        return self._config.queue_stripe_count

    def lease_claim_receipts(self) -> bool:
        return self._config.lease_claim_receipts

    def ready_child_relname(self, slot: int) -> str:
        return self._config.ready_child_relname(slot)

    def done_child_relname(self, slot: int) -> str:
        return self._config.done_child_relname(slot)

    def leases_child_relname(self, slot: int) -> str:
        return self._config.leases_child_relname(slot)

    @staticmethod
    def leases_relname() -> str:
        return "leases"

    @staticmethod
    def lease_claims_relname() -> str:
        return "lease_claims"

    @staticmethod
    def lease_claim_closures_relname() -> str:
        return "lease_claim_closures"

    @staticmethod
    def attempt_state_relname() -> str:
        return "attempt_state"

    # -- lifecycle --------------------------------------------------------------------
    @staticmethod
    @translate_errors
    def active_schema(engine: Target) -> str | None:
        """Schema most recently registered as the active queue-storage backend, or None."""
        return lifecycle.active_schema(engine)

    @staticmethod
    @translate_errors
    def active_schema_in_tx(conn: Connection) -> str | None:
        return lifecycle.active_schema_in_tx(conn)

    @translate_errors
    def prepare_schema(self, engine: Target) -> bool:
        """Idempotently install/upgrade this schema via Alembic (per-schema advisory lock).
        Returns True when this call ran a migration."""
        return lifecycle.prepare_schema(engine, self._config)

    @translate_errors
    def activate_backend(self, engine: Target) -> None:
        lifecycle.activate_backend(engine, self._schema)

    @translate_errors
    def install(self, engine: Target) -> None:
        """``prepare_schema`` then ``activate_backend``, in one transaction."""
        with transaction(engine) as conn:
            lifecycle.prepare_schema(conn, self._config)
            lifecycle.activate_backend(conn, self._schema)

    @translate_errors
    def reset(self, engine: Target, *, force: bool = False) -> None:
        """Drop this schema entirely. Refuses the default schema unless ``force=True``."""
        lifecycle.reset(engine, self._schema, force=force)

    # -- enqueue ----------------------------------------------------------------------
    def _enqueue(self, target: Target, jobs: Sequence[InsertParams], use_copy: bool) -> int:
        rows = prepare_jobs(_items(jobs, "jobs"), self._config.queue_stripe_count)
        if not rows:
            return 0
        with transaction(target) as conn:
            keyed = any(r.unique_key is not None for r in rows)
            # In a caller's transaction a unique conflict must leave nothing of the batch.
            guard = conn.begin_nested() if keyed and not owns_transaction(target) else nullcontext()
            with guard:
                return enqueue.write_jobs(conn, self._schema, self._lanes, rows, use_copy=use_copy)

    @translate_errors
    def enqueue_params_batch(self, target: Target, jobs: Sequence[InsertParams]) -> int:
        """Write ``jobs`` in one transaction (multi-row INSERT). All rows are validated before
        anything is written; a unique conflict writes nothing. Returns rows written."""
        return self._enqueue(target, jobs, use_copy=False)

    @translate_errors
    def enqueue_params_copy(self, target: Target, jobs: Sequence[InsertParams]) -> int:
        """Same semantics as :meth:`enqueue_params_batch`, streaming ready rows with COPY."""
        return self._enqueue(target, jobs, use_copy=True)

    @translate_errors
    def enqueue_batch(self, target: Target, queue: str, priority: int, count: int) -> int:
        """Benchmark helper: ``count`` available ``bench_job`` jobs with args ``{"seq": i}``,
        round-robin over the stripes. Returns rows written."""
        validate_queue(queue)
        validate_priority(priority)
        validate_batch(count, "count")
        opts = InsertOpts(queue=queue, priority=priority)
        return self._enqueue(target, [InsertParams("bench_job", {"seq": i}, opts) for i in range(count)],
                             use_copy=True)

    # -- claim --------------------------------------------------------------------------
    @translate_errors
    def claim_runtime_batch_with_aging(
        self, target: Target, queue: str, max_batch: int, deadline_duration: timedelta | float | None,
        aging_interval: timedelta | float | None,
    ) -> list[ClaimedRuntimeJob]:
        """Claim up to ``max_batch`` attempts of ``queue`` (all stripes), lanes picked by
        effective (aged) priority. Each returned job is running with ``run_lease`` and
        ``attempt`` incremented; ``deadline_at`` is set when ``deadline_duration`` > 0."""
        return self._claims.claim(target, self._schema, queue, max_batch, deadline_duration, aging_interval)

    def claim_runtime_batch(self, target: Target, queue: str, max_batch: int,
                            deadline_duration: timedelta | float | None = None) -> list[ClaimedRuntimeJob]:
        return self.claim_runtime_batch_with_aging(target, queue, max_batch, deadline_duration, None)

    def claim_job_batch(self, target: Target, queue: str, max_batch: int,
                        deadline_duration: timedelta | float | None = None) -> list[JobRow]:
        return [j.job for j in self.claim_runtime_batch(target, queue, max_batch, deadline_duration)]

    @translate_errors
    def claim_batch(self, target: Target, queue: str, max_batch: int) -> list[ClaimedEntry]:
        """Benchmark path: claim across all stripes in one transaction, no deadline/aging."""
        jobs = self._claims.claim(target, self._schema, queue, max_batch, None, None, one_transaction=True)
        return [j.claim for j in jobs]

    # -- bounded claimers ----------------------------------------------------------------
    @translate_errors
    def acquire_queue_claimer(self, target: Target, queue: str, instance_id: uuid.UUID, max_claimers: int,
                              lease_ttl: timedelta | float, idle_threshold: timedelta | float) -> QueueClaimerLease | None:
        """This instance's claimer slot for ``queue`` (kept, taken over or inserted), or None
        when ``max_claimers`` <= 0 or every slot is busy."""
        validate_queue(queue)
        instance_id = validate_uuid(instance_id, "instance_id")
        claimers.validate_max_claimers(max_claimers)
        ttl = claimers.validate_duration(lease_ttl, "lease_ttl")
        idle = claimers.validate_duration(idle_threshold, "idle_threshold")
        with transaction(target) as conn:
            return claimers.acquire(conn, self._schema, queue, instance_id, max_claimers, ttl, idle)

    @translate_errors
    def mark_queue_claimer_active(self, target: Target, queue: str, instance_id: uuid.UUID,
                                  lease: QueueClaimerLease, lease_ttl: timedelta | float) -> bool:
        """Refresh the slot; False means it was lost (taken over by another instance)."""
        validate_queue(queue)
        instance_id = validate_uuid(instance_id, "instance_id")
        claimers.validate_lease(lease)
        ttl = claimers.validate_duration(lease_ttl, "lease_ttl")
        with transaction(target) as conn:
            return claimers.mark_active(conn, self._schema, queue, instance_id, lease, ttl)

    @translate_errors
    def claim_runtime_batch_with_aging_for_instance(
        self, target: Target, queue: str, max_batch: int, deadline_duration: timedelta | float | None,
        aging_interval: timedelta | float | None, instance_id: uuid.UUID, max_claimers: int,
        lease_ttl: timedelta | float, idle_threshold: timedelta | float,
    ) -> list[ClaimedRuntimeJob]:
        """Claim only while holding one of the queue's (adaptive, ≤ ``max_claimers``) claimer
        slots; returns [] when no slot is free."""
        validate_queue(queue)
        validate_batch(max_batch)
        duration_ms(deadline_duration, "deadline_duration")
        duration_ms(aging_interval, "aging_interval")
        instance_id = validate_uuid(instance_id, "instance_id")
        claimers.validate_max_claimers(max_claimers)
        ttl = claimers.validate_duration(lease_ttl, "lease_ttl")
        idle = claimers.validate_duration(idle_threshold, "idle_threshold")
        with transaction(target) as conn:
            goal = claimers.adaptive_target(conn, self._schema, queue, max_claimers) if max_claimers > 0 else 0
            lease = claimers.acquire(conn, self._schema, queue, instance_id, goal, ttl, idle)
        if lease is None:
            return []
        jobs = self.claim_runtime_batch_with_aging(target, queue, max_batch, deadline_duration, aging_interval)
        if jobs:
            try:
                with transaction(target) as conn:
                    if claimers.needs_refresh(conn, self._schema, queue, instance_id, lease, ttl, idle):
                        claimers.mark_active(conn, self._schema, queue, instance_id, lease, ttl)
            except Exception:
                # the claims are committed: losing them to a failed refresh would leave live
                # attempts nobody works on; an unrefreshed slot only expires sooner
                if owns_transaction(target):
                    log.warning("qstore: claimer slot refresh failed after a claim", exc_info=True)
                else:
                    raise
        return jobs

    # -- complete -----------------------------------------------------------------------
    @translate_errors
    def complete_runtime_batch(self, target: Target, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
        """Complete each attempt at most once; returns the ``(job_id, run_lease)`` pairs that
        completed (stale, rescued or already-closed attempts are absent)."""
        claimed = _typed_items(claimed, ClaimedRuntimeJob, "claimed")
        if not claimed:
            return []
        return complete.complete_runtime_on(target, self._schema, claimed)

    @translate_errors
    def complete_runtime_batch_slow_in_tx(self, conn: Target, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
        """General completion path on the caller's transaction (receipts and leases)."""
        claimed = _typed_items(claimed, ClaimedRuntimeJob, "claimed")
        with transaction(conn) as c:
            return complete.complete_pairs(c, self._schema, [(j.job.id, j.job.run_lease) for j in claimed])

    @translate_errors
    def complete_job_batch_by_id(self, target: Target, completions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Complete by ``(job_id, run_lease)``: materialised leases and receipt-only attempts."""
        pairs = _id_pairs(completions, "completions", lists=False)
        if not pairs:
            return []
        with transaction(target) as conn:
            return complete.complete_pairs(conn, self._schema, pairs)

    complete_job_batch_by_id_in_tx = complete_job_batch_by_id

    @translate_errors
    def complete_claimed_batch(self, target: Target, claimed: Sequence[ClaimedEntry]) -> list[tuple[int, int]]:
        """Complete claims identified by their entries (receipts and leases)."""
        claimed = _typed_items(claimed, ClaimedEntry, "claimed")
        if not claimed:
            return []
        with transaction(target) as conn:
            return complete.complete_pairs(conn, self._schema, [(c.job_id, c.run_lease) for c in claimed])

    def complete_batch(self, target: Target, claimed: Sequence[ClaimedEntry]) -> int:
        return len(self.complete_claimed_batch(target, claimed))

    # -- read ---------------------------------------------------------------------------
    @translate_errors
    def load_job(self, target: Target, job_id: int) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        with transaction(target) as conn:
            return read.load_job(conn, self._schema, job_id)

    @translate_errors
    def queue_counts(self, target: Target, queue: str) -> QueueCounts:
        validate_queue(queue)
        with transaction(target) as conn:
            return read.queue_counts(conn, self._schema, queue)

    @translate_errors
    def queue_counts_fast(self, target: Target, queue: str) -> QueueCounts:
        validate_queue(queue)
        with transaction(target) as conn:
            return read.queue_counts_fast(conn, self._schema, queue)

    # -- internal: atomic unit inside a caller's transaction ---------------------------------
    @contextmanager
    def _atomic(self, target: Target) -> Iterator[Connection]:
        """Own transaction for an Engine; a SAVEPOINT inside a caller's transaction, so an
        operation that raises (e.g. a unique conflict) leaves nothing half-written."""
        with transaction(target) as conn:
            if owns_transaction(target):
                yield conn
            else:
                with conn.begin_nested():
                    yield conn

    def _outcome(self, target: Target, name: str, job_id: int, run_lease: int, **kw: Any) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        for field in ("reason", "error"):
            _optional_text(kw.get(field), "dlq_reason" if field == "reason" and name == "fail_to_dlq" else field)
        validate_json(kw.get("progress"), "progress")
        with self._atomic(target) as conn:
            return outcomes.outcome(conn, self._schema, self._lanes, name, job_id, run_lease, **kw)

    # -- worker outcomes of a live attempt (stale -> None, nothing changed) ----------------
    @translate_errors
    def retry_after(self, target: Target, job_id: int, run_lease: int, retry_after: timedelta | float,
                    progress: Any = None) -> JobRow | None:
        """Live attempt -> retryable, due ``retry_after`` from now (attempt kept)."""
        delay = timedelta(milliseconds=duration_ms(retry_after, "retry_after"))
        return self._outcome(target, "retry_after", job_id, run_lease, delay=delay, progress=progress)

    @translate_errors
    def snooze(self, target: Target, job_id: int, run_lease: int, snooze_for: timedelta | float,
               progress: Any = None) -> JobRow | None:
        """Live attempt -> scheduled ``snooze_for`` from now; the attempt is given back."""
        delay = timedelta(milliseconds=duration_ms(snooze_for, "snooze_for"))
        return self._outcome(target, "snooze", job_id, run_lease, delay=delay, progress=progress)

    @translate_errors
    def cancel_running(self, target: Target, job_id: int, run_lease: int, reason: str,
                       progress: Any = None) -> JobRow | None:
        return self._outcome(target, "cancel_running", job_id, run_lease, reason=reason, progress=progress)

    @translate_errors
    def fail_terminal(self, target: Target, job_id: int, run_lease: int, error: str,
                      progress: Any = None) -> JobRow | None:
        return self._outcome(target, "fail_terminal", job_id, run_lease, error=error, progress=progress)

    @translate_errors
    def fail_to_dlq(self, target: Target, job_id: int, run_lease: int, dlq_reason: str, error: str,
                    progress: Any = None) -> JobRow | None:
        return self._outcome(target, "fail_to_dlq", job_id, run_lease, reason=dlq_reason, error=error,
                             progress=progress)

    @translate_errors
    def fail_retryable(self, target: Target, job_id: int, run_lease: int, error: str,
                       progress: Any = None) -> JobRow | None:
        """Retryable with backoff; when attempts are exhausted -> failed, or the DLQ when
        the queue's DLQ policy (``queue_meta.dlq_enabled``) is on."""
        return self._outcome(target, "fail_retryable", job_id, run_lease, error=error, progress=progress)

    retry_after_in_tx = retry_after
    cancel_running_in_tx = cancel_running
    fail_terminal_in_tx = fail_terminal
    fail_to_dlq_in_tx = fail_to_dlq
    fail_retryable_in_tx = fail_retryable

    # -- heartbeat and progress -------------------------------------------------------
    @translate_errors
    def heartbeat_batch(self, target: Target, jobs: Sequence[tuple[int, int]]) -> int:
        """Record heartbeats of live attempts; returns how many were live."""
        pairs = _id_pairs(jobs, "jobs")
        with transaction(target) as conn:
            return outcomes.heartbeat(conn, self._schema, [(j, r, None) for j, r in pairs],
                                      with_heartbeat=True, with_progress=False)

    @translate_errors
    def heartbeat_progress_batch(self, target: Target, jobs: Sequence[tuple[int, int, Any]]) -> int:
        items = []
        for i, item in enumerate(_items(jobs, "jobs")):
            if not isinstance(item, tuple | list) or len(item) != 3:
                raise ValidationError(f"jobs[{i}]", item, "expected a (job_id, run_lease, progress) triple")
            items.append((validate_id(item[0], f"jobs[{i}].job_id"), validate_id(item[1], f"jobs[{i}].run_lease"),
                          validate_json(item[2], f"jobs[{i}].progress")))
        with transaction(target) as conn:
            return outcomes.heartbeat(conn, self._schema, items, with_heartbeat=True, with_progress=True)

    @translate_errors
    def flush_progress(self, target: Target, job_id: int, run_lease: int, progress: Any) -> None:
        """Store progress for the live attempt (running or waiting); silent no-op if stale."""
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        validate_json(progress, "progress")
        with transaction(target) as conn:
            outcomes.heartbeat(conn, self._schema, [(job_id, run_lease, progress)], with_heartbeat=False,
                               with_progress=True, lease_states=callbacks.LIVE)

    # -- external callbacks -----------------------------------------------------------
    @translate_errors
    def register_callback(self, target: Target, job_id: int, run_lease: int, timeout: timedelta | float) -> uuid.UUID:
        return self.register_callback_with_config(target, job_id, run_lease, timeout, CallbackConfig())

    @translate_errors
    def register_callback_with_config(self, target: Target, job_id: int, run_lease: int,
                                      timeout: timedelta | float, config: CallbackConfig) -> uuid.UUID:
        """Materialise the attempt's lease and give it a fresh random token with a timeout.
        Raises ``ValidationError`` when the attempt is not running (stale) or when the
        config carries CEL expressions (unsupported)."""
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        t = claimers.validate_duration(timeout, "timeout")
        if config is not None and not isinstance(config, CallbackConfig):
            raise ValidationError("config", config, "expected CallbackConfig or None")
        with self._atomic(target) as conn:
            return callbacks.register(conn, self._schema, job_id, run_lease, t, config)

    @translate_errors
    def cancel_callback(self, target: Target, job_id: int, run_lease: int) -> bool:
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        with transaction(target) as conn:
            return callbacks.cancel_callback(conn, self._schema, job_id, run_lease)

    @translate_errors
    def enter_callback_wait(self, target: Target, job_id: int, run_lease: int, callback_id: uuid.UUID) -> bool:
        """running -> waiting_external when the token matches (heartbeat/deadline cleared)."""
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        callback_id = validate_uuid(callback_id, "callback_id")
        with transaction(target) as conn:
            return callbacks.enter_wait(conn, self._schema, job_id, run_lease, callback_id)

    enter_callback_wait_in_tx = enter_callback_wait

    @translate_errors
    def check_callback_state(self, target: Target, job_id: int, callback_id: uuid.UUID) -> CallbackPollResult:
        job_id = validate_id(job_id, "job_id")
        callback_id = validate_uuid(callback_id, "callback_id")
        with transaction(target) as conn:
            def state() -> JobState | None:
                row = read.load_job(conn, self._schema, job_id)
                return row.state if row is not None else None
            return callbacks.check_callback_state(conn, self._schema, job_id, callback_id, state)

    @translate_errors
    def callback_job(self, target: Target, callback_id: uuid.UUID, run_lease: int | None = None,
                     for_update: bool = False) -> JobRow | None:
        callback_id = validate_uuid(callback_id, "callback_id")
        run_lease = _optional_id(run_lease, "run_lease")
        with transaction(target) as conn:
            return callbacks.callback_job(conn, self._schema, callback_id, run_lease, for_update)

    callback_job_in_tx = callback_job

    @translate_errors
    def load_active_lease_in_tx(self, target: Target, job_id: int, run_lease: int) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        run_lease = validate_id(run_lease, "run_lease")
        with transaction(target) as conn:
            return callbacks.load_active_lease(conn, self._schema, job_id, run_lease)

    @translate_errors
    def complete_external(self, target: Target, callback_id: uuid.UUID, payload: Any = None,
                          run_lease: int | None = None, resume: bool = False) -> JobRow:
        """Resolve the callback: ``resume`` hands ``payload`` back to the same attempt
        (running again); otherwise the job completes. ``CallbackNotFoundError`` if no live
        attempt holds the token."""
        callback_id = validate_uuid(callback_id, "callback_id")
        run_lease = _optional_id(run_lease, "run_lease")
        validate_json(payload, "payload")
        with self._atomic(target) as conn:
            if resume:
                return callbacks.resume(conn, self._schema, callback_id, payload, run_lease)
            return callbacks.resolve(conn, self._schema, self._lanes, callback_id, run_lease,
                                     Decision("terminal", JobState.COMPLETED, clear_progress=True), "completed")

    complete_external_in_tx = complete_external

    @translate_errors
    def fail_external(self, target: Target, callback_id: uuid.UUID, error: str, run_lease: int | None = None) -> JobRow:
        validate_text(error, "error")
        return self.fail_external_with_error_entry(target, callback_id, {"error": error}, run_lease)

    @translate_errors
    def fail_external_with_error_entry(self, target: Target, callback_id: uuid.UUID, error_entry: Any,
                                       run_lease: int | None = None) -> JobRow:
        callback_id = validate_uuid(callback_id, "callback_id")
        run_lease = _optional_id(run_lease, "run_lease")
        validate_json(error_entry, "error_entry")
        entry = dict(error_entry) if isinstance(error_entry, dict) else {"error": error_entry}
        with self._atomic(target) as conn:
            at = conn.execute(select_now()).scalar_one()
            live = callbacks.callback_job(conn, self._schema, callback_id, run_lease)
            entry.setdefault("attempt", live.attempt if live else 0)
            entry.setdefault("at", at.isoformat())
            entry.setdefault("terminal", True)
            return callbacks.resolve(conn, self._schema, self._lanes, callback_id, run_lease,
                                     Decision("terminal", JobState.FAILED, error_obj=entry), "failed")

    fail_external_with_error_entry_in_tx = fail_external_with_error_entry

    @translate_errors
    def retry_external(self, target: Target, callback_id: uuid.UUID, run_lease: int | None = None) -> JobRow:
        """waiting_external only: re-enqueue with attempt 0 (progress kept)."""
        callback_id = validate_uuid(callback_id, "callback_id")
        run_lease = _optional_id(run_lease, "run_lease")
        with self._atomic(target) as conn:
            return callbacks.resolve(conn, self._schema, self._lanes, callback_id, run_lease,
                                     Decision("ready", attempt=0), "retried", ("waiting_external",))

    retry_external_in_tx = retry_external

    @translate_errors
    def heartbeat_callback(self, target: Target, callback_id: uuid.UUID, timeout: timedelta | float) -> JobRow:
        callback_id = validate_uuid(callback_id, "callback_id")
        t = claimers.validate_duration(timeout, "timeout")
        with transaction(target) as conn:
            job_id = callbacks.heartbeat_callback(conn, self._schema, callback_id, t)
            row = read.load_job(conn, self._schema, job_id)
            assert row is not None
            return row

    # -- rescue and promotion ----------------------------------------------------------
    @translate_errors
    def rescue_stale_heartbeats(self, target: Target, staleness: timedelta | float) -> list[JobRow]:
        st = claimers.validate_duration(staleness, "staleness")
        with transaction(target) as conn:
            return rescue.rescue(conn, self._schema, self._lanes, "heartbeat", st)

    @translate_errors
    def rescue_expired_deadlines(self, target: Target) -> list[JobRow]:
        with transaction(target) as conn:
            return rescue.rescue(conn, self._schema, self._lanes, "deadline")

    @translate_errors
    def rescue_expired_callbacks(self, target: Target) -> list[JobRow]:
        with transaction(target) as conn:
            return rescue.rescue(conn, self._schema, self._lanes, "callback")

    @translate_errors
    def promote_due(self, target: Target, state: JobState | str, batch_size: int) -> int:
        """Move up to ``batch_size`` due scheduled/retryable jobs into the ready ring (a
        ``batch_size`` of 0 or less, or another state, moves nothing)."""
        try:
            st = JobState(state)
        except (ValueError, TypeError):
            raise ValidationError("state", state, "must be a JobState") from None
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size > MAX_BATCH:
            raise ValidationError("batch_size", batch_size, f"must be an integer of at most {MAX_BATCH}")
        with self._atomic(target) as conn:
            return rescue.promote_due(conn, self._schema, self._lanes, st, batch_size)

    # -- admin --------------------------------------------------------------------------
    @translate_errors
    def retry_job(self, target: Target, job_id: int) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        with self._atomic(target) as conn:
            return admin.retry_job(conn, self._schema, self._lanes, job_id)

    @translate_errors
    def retry_jobs_by_ids(self, target: Target, ids: Sequence[int]) -> list[JobRow]:
        """``retry_job`` for each id in one transaction (all-or-nothing on error)."""
        ids = [validate_id(i, f"ids[{n}]") for n, i in enumerate(_items(ids, "ids"))]
        with self._atomic(target) as conn:
            return [r for i in ids if (r := admin.retry_job(conn, self._schema, self._lanes, i)) is not None]

    @translate_errors
    def cancel_job(self, target: Target, job_id: int) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        with self._atomic(target) as conn:
            return admin.cancel_job(conn, self._schema, self._lanes, job_id)

    @translate_errors
    def cancel_jobs_by_ids(self, target: Target, ids: Sequence[int]) -> list[JobRow]:
        ids = [validate_id(i, f"ids[{n}]") for n, i in enumerate(_items(ids, "ids"))]
        with self._atomic(target) as conn:
            return [r for i in ids if (r := admin.cancel_job(conn, self._schema, self._lanes, i)) is not None]

    @translate_errors
    def set_priority(self, target: Target, job_id: int, priority: int) -> bool:
        job_id = validate_id(job_id, "job_id")
        validate_priority(priority)
        with self._atomic(target) as conn:
            return admin.move_job(conn, self._schema, self._lanes, job_id, None, priority)

    set_priority_tx = set_priority

    @translate_errors
    def move_queue(self, target: Target, job_id: int, queue: str, priority: int | None = None) -> bool:
        job_id = validate_id(job_id, "job_id")
        validate_queue(queue)
        if priority is not None:
            validate_priority(priority)
        with self._atomic(target) as conn:
            return admin.move_job(conn, self._schema, self._lanes, job_id, queue, priority)

    move_queue_tx = move_queue

    @translate_errors
    def age_waiting_priorities(self, target: Target, aging_interval: timedelta | float, limit: int) -> list[int]:
        interval = claimers.validate_duration(aging_interval, "aging_interval")
        validate_batch(limit, "limit")
        with self._atomic(target) as conn:
            return admin.age_waiting(conn, self._schema, self._lanes, interval, limit)

    # -- queue settings -------------------------------------------------------------------
    @translate_errors
    def set_queue_options(self, target: Target, queue: str, *, paused: bool | None = None,
                          enqueue_shards: int | None = None, dlq_enabled: bool | None = None) -> None:
        """Upsert the logical queue's ``queue_meta`` row (pause gate, shards, DLQ policy)."""
        validate_queue(queue)
        _optional_flag(paused, "paused")
        _optional_flag(dlq_enabled, "dlq_enabled")
        if enqueue_shards is not None and (isinstance(enqueue_shards, bool) or not isinstance(enqueue_shards, int)
                                           or not 1 <= enqueue_shards <= 64):
            raise ValidationError("enqueue_shards", enqueue_shards, "must be an integer between 1 and 64")
        values: dict[str, Any] = {}
        if paused is not None:
            values.update(paused=paused, paused_at=func.clock_timestamp() if paused else None)
        if enqueue_shards is not None:
            values["enqueue_shards"] = enqueue_shards
        if dlq_enabled is not None:
            values["dlq_enabled"] = dlq_enabled
        m = self._schema.queue_meta
        with transaction(target) as conn:
            stmt = pg_insert(m).values(queue=queue, **values)
            conn.execute(stmt.on_conflict_do_update(index_elements=[m.c.queue], set_=values) if values
                         else stmt.on_conflict_do_nothing())
        self._lanes.clear()

    # -- DLQ ------------------------------------------------------------------------------
    @translate_errors
    def move_failed_to_dlq(self, target: Target, job_id: int, dlq_reason: str) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        validate_text(dlq_reason, "dlq_reason")
        with self._atomic(target) as conn:
            return dlq.move_failed(conn, self._schema, job_id, dlq_reason)

    @translate_errors
    def bulk_move_failed_to_dlq(self, target: Target, kind: str | None, queue: str | None, dlq_reason: str) -> int:
        _optional_text(kind, "kind")
        if queue is not None:
            validate_queue(queue)
        validate_text(dlq_reason, "dlq_reason")
        with self._atomic(target) as conn:
            return dlq.bulk_move_failed(conn, self._schema, kind, queue, dlq_reason)

    @translate_errors
    def retry_from_dlq(self, target: Target, job_id: int, opts: RetryFromDlqOpts | None = None) -> JobRow | None:
        job_id = validate_id(job_id, "job_id")
        if opts is not None and not isinstance(opts, RetryFromDlqOpts):
            raise ValidationError("opts", opts, "expected RetryFromDlqOpts or None")
        if opts is not None:
            if opts.queue is not None:
                validate_queue(opts.queue, "opts.queue")
            if opts.priority is not None:
                validate_priority(opts.priority, "opts.priority")
            if opts.run_at is not None:
                validate_aware_datetime(opts.run_at, "opts.run_at")
        with self._atomic(target) as conn:
            return dlq.retry_from_dlq(conn, self._schema, self._lanes, job_id, opts or RetryFromDlqOpts())

    @translate_errors
    def bulk_retry_from_dlq(self, target: Target, filter: ListDlqFilter) -> int:
        _dlq_filter(filter)
        with self._atomic(target) as conn:
            return dlq.bulk_retry(conn, self._schema, self._lanes, filter)

    @translate_errors
    def discard_failed_by_kind(self, target: Target, kind: str) -> int:
        validate_text(kind, "kind")
        with self._atomic(target) as conn:
            return dlq.discard_failed_by_kind(conn, self._schema, kind)

    def __repr__(self) -> str:
        return f"QueueStorage({self._config!r})"



