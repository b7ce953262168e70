"""`QueueStorage`: the seed's method names as thin methods over the operation families.

Every operation takes a target first — an ``Engine`` (own transaction, committed), a
``Connection`` or an ORM ``Session`` (joins the caller's transaction, never commits) — see
:mod:`qstore.storage._tx`. The seed's ``*_in_tx`` / ``*_tx`` variants are the same methods
(aliases kept so a reader of the seed finds every name).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from datetime import timedelta

from sqlalchemy import Connection

from qstore.config import QueueStorageConfig
from qstore.errors import ValidationError, translate_errors
import uuid

from qstore.model import ClaimedEntry, ClaimedRuntimeJob, JobRow, QueueClaimerLease, QueueCounts
from qstore.schema import StorageSchema, storage_schema
from qstore.storage import claimers, complete, enqueue, lifecycle, read
from qstore.storage._tx import Target, owns_transaction, transaction
from qstore.storage.claim import ClaimRouter, validate_batch
from qstore.storage.jobs import (
    InsertOpts,
    InsertParams,
    prepare_jobs,
    validate_priority,
    validate_queue,
)

__all__ = ["QueueStorage"]


class QueueStorage:
    """Segmented queue storage for one schema (see STORAGE.md for the design)."""

    def __init__(self, config: QueueStorageConfig | None = None) -> None:
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
        """``prepare_schema`` then ``activate_backend``."""
        lifecycle.prepare_schema(engine, self._config)
        lifecycle.activate_backend(engine, self._schema)

    @translate_errors
    def reset(self, engine: Target, *, force: bool = False) -> None:
        """Drop this schema entirely. Refuses the default schema unless ``force=True``."""
        lifecycle.reset(engine, self._schema, force=force)

    # -- enqueue ----------------------------------------------------------------------
    def _enqueue(self, target: Target, jobs: Sequence[InsertParams], use_copy: bool) -> int:
        rows = prepare_jobs(list(jobs), self._config.queue_stripe_count)
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
        ttl = claimers.validate_duration(lease_ttl, "lease_ttl")
        idle = claimers.validate_duration(idle_threshold, "idle_threshold")
        with transaction(target) as conn:
            return claimers.acquire(conn, self._schema, queue, instance_id, max_claimers, ttl, idle)

    @translate_errors
    def mark_queue_claimer_active(self, target: Target, queue: str, instance_id: uuid.UUID,
                                  lease: QueueClaimerLease, lease_ttl: timedelta | float) -> bool:
        """Refresh the slot; False means it was lost (taken over by another instance)."""
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
        ttl = claimers.validate_duration(lease_ttl, "lease_ttl")
        idle = claimers.validate_duration(idle_threshold, "idle_threshold")
        with transaction(target) as conn:
            goal = claimers.adaptive_target(conn, self._schema, queue, max_claimers) if max_claimers > 0 else 0
            lease = claimers.acquire(conn, self._schema, queue, instance_id, goal, ttl, idle)
        if lease is None:
            return []
        jobs = self.claim_runtime_batch_with_aging(target, queue, max_batch, deadline_duration, aging_interval)
        if jobs:
            with transaction(target) as conn:
                if claimers.needs_refresh(conn, self._schema, queue, instance_id, lease, ttl, idle):
                    claimers.mark_active(conn, self._schema, queue, instance_id, lease, ttl)
        return jobs

    # -- complete -----------------------------------------------------------------------
    @translate_errors
    def complete_runtime_batch(self, target: Target, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
        """Complete each attempt at most once; returns the ``(job_id, run_lease)`` pairs that
        completed (stale, rescued or already-closed attempts are absent)."""
        if not claimed:
            return []
        with transaction(target) as conn:
            return complete.complete_runtime(conn, self._schema, list(claimed))

    @translate_errors
    def complete_runtime_batch_slow_in_tx(self, conn: Target, claimed: Sequence[ClaimedRuntimeJob]) -> list[tuple[int, int]]:
        """General completion path on the caller's transaction (receipts and leases)."""
        with transaction(conn) as c:
            return complete.complete_pairs(c, self._schema, [(j.job.id, j.job.run_lease) for j in claimed])

    @translate_errors
    def complete_job_batch_by_id(self, target: Target, completions: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Complete by ``(job_id, run_lease)``: materialised leases and receipt-only attempts."""
        for pair in completions:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, int) for x in pair)):
                raise ValidationError("completions", pair, "expected (job_id, run_lease) integer pairs")
        if not completions:
            return []
        with transaction(target) as conn:
            return complete.complete_pairs(conn, self._schema, list(completions))

    complete_job_batch_by_id_in_tx = complete_job_batch_by_id

    @translate_errors
    def complete_claimed_batch(self, target: Target, claimed: Sequence[ClaimedEntry]) -> list[tuple[int, int]]:
        """Complete claims identified by their entries (receipts and leases)."""
        if not claimed:
            return []
        with transaction(target) as conn:
            return complete.complete_pairs(conn, self._schema, [(c.job_id, c.run_lease) for c in claimed])

    def complete_batch(self, target: Target, claimed: Sequence[ClaimedEntry]) -> int:
        return len(self.complete_claimed_batch(target, claimed))

    # -- read ---------------------------------------------------------------------------
    @translate_errors
    def load_job(self, target: Target, job_id: int) -> JobRow | None:
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

    def __repr__(self) -> str:
        return f"QueueStorage({self._config!r})"



