"""``QueueStorage``: the storage API as one declarative list of operations.

Each line of :class:`Operations` names an operation (the seed's method names), the
function that implements it, the transaction it gets on each kind of target
(:class:`~qstore.storage.targets.Policy`, applied by :func:`qstore.storage.targets.run`)
and the checks its arguments go through before anything touches the database. Both faces
read this one list: :class:`QueueStorage` (``Engine`` / ``Connection`` / ``Session``) and
:class:`qstore.aio.AsyncQueueStorage` (``AsyncEngine`` / ``AsyncConnection`` /
``AsyncSession``), which runs the same calls on the async target's synchronous
counterpart, so an operation gets the same transaction on either face.

Policies in one sentence each: ``JOIN`` — its own transaction on an Engine, the caller's
otherwise; ``SNAPSHOT`` — a read-only REPEATABLE READ transaction of its own on an Engine
(one snapshot for every statement of a read: ``load_job``, the queue counts), the caller's
otherwise; ``ATOMIC`` — the same as ``JOIN``, but a SAVEPOINT inside a caller's
transaction, so an error leaves nothing half-written; ``STATEMENT`` — one autocommitted statement on an
Engine; ``UNITS`` — a transaction per unit of work on an Engine (each stripe of a claim;
the two parts of a completion; each slot of a counter rollup; a promotion's due probe
and its take); ``OWN`` — its own
transaction on an Engine, refused on a caller's ``Connection`` or ``Session`` before
anything is sent (``CallerTransactionRefusedError``), because its effect would outlive a
rollback (the ring rotations: a ring's cursor is a sequence); ``NO_TRANSACTION`` —
autocommit on an Engine, refused likewise (``VACUUM`` cannot run inside a transaction).
Inside a body, the lock-guarded upkeep step of prune and counter rollup is a unit of the
same table (:func:`qstore.storage.targets.guarded`: a SAVEPOINT with a 50 ms lock timeout,
``Blocked`` instead of an error), and bodies never begin, commit or roll back anything
themselves. What must commit together is one operation of this list
(``wait_for_callback``, ``complete_runtime_batch_with_followups``), so no caller of the
storage opens a transaction of its own around storage calls. A rollback of a caller's
transaction undoes every other operation; what it leaves behind is listed in
:mod:`qstore.storage.targets`. The seed's ``*_in_tx`` / ``*_tx``
names are the same operations (pass the caller's ``Connection`` or ``Session``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine

from qstore.config import QueueStorageConfig, validate_identifier
from qstore.errors import ValidationError, translate_errors
from qstore.schema import StorageSchema, storage_schema
from qstore.storage import (
    admin,
    callbacks,
    checks,
    claim,
    complete,
    dlq,
    lifecycle,
    outcomes,
    read,
)
from qstore.storage import enqueue as enqueuing
from qstore.storage.context import StorageContext
from qstore.storage.operations import Operation, SyncFace, op
from qstore.storage.targets import Policy, Target, run
from qstore.storage.upkeep import counters, keys, rescue, rings, wheel

if TYPE_CHECKING:
    from qstore.storage.listen import Listener

__all__ = ["Naming", "Operations", "QueueStorage"]

JOIN, SNAPSHOT, ATOMIC, STATEMENT, UNITS, OWN, NO_TRANSACTION = (
    Policy.JOIN, Policy.SNAPSHOT, Policy.ATOMIC, Policy.STATEMENT, Policy.UNITS, Policy.OWN,
    Policy.NO_TRANSACTION)
C = checks


class Operations:
    """The storage API: every operation, its policy and its argument checks."""

    # -- lifecycle ---------------------------------------------------------------------------
    prepare_schema = op(JOIN, lifecycle.prepare_schema)
    activate_backend = op(JOIN, lifecycle.activate_backend)
    install = op(JOIN, lifecycle.install)
    reset = op(JOIN, lifecycle.reset)

    # -- enqueue -----------------------------------------------------------------------------
    enqueue = op(STATEMENT, enqueuing.enqueue)
    enqueue_many = op(STATEMENT, enqueuing.enqueue_many, jobs=C.items)
    enqueue_params_batch = op(STATEMENT, enqueuing.enqueue_params_batch, jobs=C.items)
    enqueue_params_copy = op(ATOMIC, enqueuing.enqueue_params_copy, jobs=C.items)
    enqueue_batch = op(ATOMIC, enqueuing.enqueue_batch, queue=C.queue, priority=C.priority, count=C.batch)

    # -- claim ---------------------------------------------------------------------------------
    claim_runtime_batch_with_aging = op(UNITS, claim.claim_runtime_batch_with_aging, queue=C.queue,
                                        max_batch=C.batch, deadline_duration=C.duration,
                                        aging_interval=C.duration)
    claim_runtime_batch = op(UNITS, claim.claim_runtime_batch, queue=C.queue, max_batch=C.batch,
                             deadline_duration=C.duration)
    claim_job_batch = op(UNITS, claim.claim_job_batch, queue=C.queue, max_batch=C.batch,
                         deadline_duration=C.duration)
    claim_batch = op(JOIN, claim.claim_batch, queue=C.queue, max_batch=C.batch)
    acquire_queue_claimer = op(JOIN, claim.acquire_queue_claimer, queue=C.queue, instance_id=C.uuid_value,
                               max_claimers=C.max_claimers, lease_ttl=C.positive_duration,
                               idle_threshold=C.positive_duration)
    mark_queue_claimer_active = op(JOIN, claim.mark_queue_claimer_active, queue=C.queue,
                                   instance_id=C.uuid_value, lease=C.claimer_lease,
                                   lease_ttl=C.positive_duration)
    claim_runtime_batch_with_aging_for_instance = op(
        UNITS, claim.claim_runtime_batch_with_aging_for_instance, queue=C.queue, max_batch=C.batch,
        deadline_duration=C.duration, aging_interval=C.duration, instance_id=C.uuid_value,
        max_claimers=C.max_claimers, lease_ttl=C.positive_duration, idle_threshold=C.positive_duration)

    # -- complete ------------------------------------------------------------------------------
    complete_runtime_batch = op(UNITS, complete.complete_runtime_batch, claimed=C.claimed_jobs)
    complete_runtime_batch_with_followups = op(ATOMIC, complete.complete_runtime_batch_with_followups,
                                               completions=C.completions_with_followups)
    complete_runtime_batch_slow_in_tx = op(JOIN, complete.complete_runtime_batch_slow_in_tx,
                                           claimed=C.claimed_jobs)
    complete_job_batch_by_id = op(JOIN, complete.complete_job_batch_by_id, completions=C.id_tuples)
    complete_job_batch_by_id_in_tx = complete_job_batch_by_id.alias()
    complete_claimed_batch = op(JOIN, complete.complete_claimed_batch, claimed=C.claimed_entries)
    complete_batch = op(JOIN, complete.complete_batch, claimed=C.claimed_entries)
    complete_and_claim = op(UNITS, complete.complete_and_claim, completions=C.attempts, queue=C.queue,
                            max_batch=C.batch, deadline_duration=C.duration, aging_interval=C.duration)

    # -- reads -----------------------------------------------------------------------------------
    load_job = op(SNAPSHOT, read.load_job_snapshot, job_id=C.job_id)
    queue_counts = op(SNAPSHOT, read.queue_counts, queue=C.queue)
    queue_counts_fast = op(SNAPSHOT, read.queue_counts_fast, queue=C.queue)
    scheduled_count = op(SNAPSHOT, read.scheduled_count, queue=C.queue)

    # -- worker outcomes of a live attempt (stale -> None, nothing changed) -------------------
    retry_after = op(ATOMIC, outcomes.retry_after, job_id=C.job_id, run_lease=C.job_id,
                     retry_after=C.duration, progress=C.json_value)
    snooze = op(ATOMIC, outcomes.snooze, job_id=C.job_id, run_lease=C.job_id, snooze_for=C.duration,
                progress=C.json_value)
    cancel_running = op(ATOMIC, outcomes.cancel_running, job_id=C.job_id, run_lease=C.job_id,
                        reason=C.optional_text, progress=C.json_value)
    fail_terminal = op(ATOMIC, outcomes.fail_terminal, job_id=C.job_id, run_lease=C.job_id,
                       error=C.optional_text, progress=C.json_value)
    fail_to_dlq = op(ATOMIC, outcomes.fail_to_dlq, job_id=C.job_id, run_lease=C.job_id,
                     dlq_reason=C.optional_text, error=C.optional_text, progress=C.json_value)
    fail_retryable = op(ATOMIC, outcomes.fail_retryable, job_id=C.job_id, run_lease=C.job_id,
                        error=C.optional_text, progress=C.json_value)
    retry_after_in_tx = retry_after.alias()
    cancel_running_in_tx = cancel_running.alias()
    fail_terminal_in_tx = fail_terminal.alias()
    fail_to_dlq_in_tx = fail_to_dlq.alias()
    fail_retryable_in_tx = fail_retryable.alias()

    # -- heartbeats and progress --------------------------------------------------------------
    heartbeat_batch = op(JOIN, outcomes.heartbeat_batch, jobs=C.id_pairs)
    heartbeat_progress_batch = op(JOIN, outcomes.heartbeat_progress_batch, jobs=C.progress_triples)
    flush_progress = op(JOIN, outcomes.flush_progress, job_id=C.job_id, run_lease=C.job_id,
                        progress=C.json_value)

    # -- external callbacks --------------------------------------------------------------------
    register_callback = op(ATOMIC, callbacks.register_callback, job_id=C.job_id, run_lease=C.job_id,
                           timeout=C.positive_duration)
    register_callback_with_config = op(ATOMIC, callbacks.register_callback_with_config, job_id=C.job_id,
                                       run_lease=C.job_id, timeout=C.positive_duration,
                                       config=C.callback_config)
    cancel_callback = op(JOIN, callbacks.cancel_callback, job_id=C.job_id, run_lease=C.job_id)
    enter_callback_wait = op(JOIN, callbacks.enter_callback_wait, job_id=C.job_id, run_lease=C.job_id,
                             callback_id=C.uuid_value)
    enter_callback_wait_in_tx = enter_callback_wait.alias()
    wait_for_callback = op(ATOMIC, callbacks.wait_for_callback, job_id=C.job_id, run_lease=C.job_id,
                           timeout=C.positive_duration, config=C.callback_config, callback_id=C.optional_uuid)
    check_callback_state = op(JOIN, callbacks.check_callback_state, job_id=C.job_id, callback_id=C.uuid_value)
    callback_job = op(JOIN, callbacks.callback_job, callback_id=C.uuid_value, run_lease=C.optional_id)
    callback_job_in_tx = callback_job.alias()
    load_active_lease_in_tx = op(JOIN, callbacks.load_active_lease_in_tx, job_id=C.job_id, run_lease=C.job_id)
    complete_external = op(ATOMIC, callbacks.complete_external, callback_id=C.uuid_value,
                           payload=C.json_value, run_lease=C.optional_id)
    complete_external_in_tx = complete_external.alias()
    fail_external = op(ATOMIC, callbacks.fail_external, callback_id=C.uuid_value, error=C.text,
                       run_lease=C.optional_id)
    fail_external_with_error_entry = op(ATOMIC, callbacks.fail_external_with_error_entry,
                                        callback_id=C.uuid_value, error_entry=C.json_value,
                                        run_lease=C.optional_id)
    fail_external_with_error_entry_in_tx = fail_external_with_error_entry.alias()
    retry_external = op(ATOMIC, callbacks.retry_external, callback_id=C.uuid_value, run_lease=C.optional_id)
    retry_external_in_tx = retry_external.alias()
    heartbeat_callback = op(JOIN, callbacks.heartbeat_callback, callback_id=C.uuid_value,
                            timeout=C.positive_duration)

    # -- rescue and promotion --------------------------------------------------------------------
    rescue_stale_heartbeats = op(JOIN, rescue.rescue_stale_heartbeats, staleness=C.positive_duration)
    rescue_expired_deadlines = op(JOIN, rescue.rescue_expired_deadlines)
    rescue_expired_callbacks = op(JOIN, rescue.rescue_expired_callbacks)
    promote_due = op(UNITS, rescue.promote_due, state=C.promotable_state, batch_size=C.promotion_batch)
    promote_all_due = op(UNITS, rescue.promote_all_due, batch_size=C.promotion_batch)
    advance_overflow = op(ATOMIC, wheel.advance_overflow, batch_size=C.promotion_batch)
    prune_wheel = op(JOIN, wheel.prune_wheel, at=C.optional_datetime)

    # -- admin --------------------------------------------------------------------------------------
    retry_job = op(ATOMIC, admin.retry_job, job_id=C.job_id)
    retry_jobs_by_ids = op(ATOMIC, admin.retry_jobs_by_ids, ids=C.ids)
    cancel_job = op(ATOMIC, admin.cancel_job, job_id=C.job_id)
    cancel_jobs_by_ids = op(ATOMIC, admin.cancel_jobs_by_ids, ids=C.ids)
    set_priority = op(ATOMIC, admin.set_priority, job_id=C.job_id, priority=C.priority)
    set_priority_tx = set_priority.alias()
    move_queue = op(ATOMIC, admin.move_queue, job_id=C.job_id, queue=C.queue, priority=C.optional_priority)
    move_queue_tx = move_queue.alias()
    age_waiting_priorities = op(ATOMIC, admin.age_waiting_priorities, aging_interval=C.positive_duration,
                                limit=C.batch)
    set_queue_options = op(JOIN, admin.set_queue_options, queue=C.queue, paused=C.flag,
                           enqueue_shards=C.shards, dlq_enabled=C.flag)

    # -- DLQ ----------------------------------------------------------------------------------------
    move_failed_to_dlq = op(ATOMIC, dlq.move_failed_to_dlq, job_id=C.job_id, dlq_reason=C.text)
    bulk_move_failed_to_dlq = op(ATOMIC, dlq.bulk_move_failed_to_dlq, kind=C.optional_text,
                                 queue=C.optional_queue, dlq_reason=C.text)
    retry_from_dlq = op(ATOMIC, dlq.retry_from_dlq, job_id=C.job_id, opts=C.dlq_opts)
    bulk_retry_from_dlq = op(ATOMIC, dlq.bulk_retry_from_dlq, filter=C.dlq_filter)
    discard_failed_by_kind = op(ATOMIC, dlq.discard_failed_by_kind, kind=C.text)
    list_dlq = op(JOIN, dlq.list_dlq, filter=C.optional_dlq_filter)
    load_dlq_entry = op(JOIN, dlq.load_dlq_entry, job_id=C.job_id)
    purge_dlq = op(ATOMIC, dlq.purge_dlq, kind=C.optional_text, queue=C.optional_queue)

    # -- ring maintenance and counters --------------------------------------------------------------
    rotate = op(OWN, rings.rotate)
    prune_oldest = op(JOIN, rings.prune_oldest)
    rotate_leases = op(OWN, rings.rotate_leases)
    prune_oldest_leases = op(JOIN, rings.prune_oldest_leases)
    vacuum_leases = op(NO_TRANSACTION, rings.vacuum_leases)
    rotate_claims = op(OWN, rings.rotate_claims)
    prune_oldest_claims = op(JOIN, rings.prune_oldest_claims)
    claim_slot_bytes = op(JOIN, rings.claim_slot_bytes)
    rollup_terminal_count_deltas = op(UNITS, counters.rollup_terminal_count_deltas, max_slots=C.slot_count)
    rebuild_terminal_counters = op(JOIN, counters.rebuild_terminal_counters)
    terminal_counter_trusted = op(JOIN, counters.terminal_counter_trusted)
    purge_released_keys = op(JOIN, keys.purge_released_keys)


def operations() -> dict[str, Operation[Any, Any]]:
    """Every operation of the list, by name (aliases included)."""
    return {name: value for name, value in vars(Operations).items() if isinstance(value, Operation)}


class Naming:
    """What an install is called and how it is shaped (no I/O)."""

    _ctx: StorageContext

    @property
    def config(self) -> QueueStorageConfig:
        """The install's configuration."""
        return self._ctx.config

    @property
    def tables(self) -> StorageSchema:
        """The declared schema objects of this install (tables, rings, functions)."""
        return self._ctx.schema

    def schema(self) -> str:
        return self._ctx.config.schema

    def slot_count(self) -> int:
        """The queue ring's slot count (the seed's name for ``queue_slot_count``)."""
        return self._ctx.config.queue_slot_count

    def queue_slot_count(self) -> int:
        return self._ctx.config.queue_slot_count

    def lease_slot_count(self) -> int:
        return self._ctx.config.lease_slot_count

    def claim_slot_count(self) -> int:
        return self._ctx.config.claim_slot_count

    def queue_stripe_count(self) -> int:
        return self._ctx.config.queue_stripe_count

    def lease_claim_receipts(self) -> bool:
        return self._ctx.config.lease_claim_receipts

    def ready_child_relname(self, slot: int) -> str:
        return self._ctx.config.ready_child_relname(slot)

    def done_child_relname(self, slot: int) -> str:
        return self._ctx.config.done_child_relname(slot)

    def leases_child_relname(self, slot: int) -> str:
        return self._ctx.config.leases_child_relname(slot)

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
    def lease_claim_closure_batches_relname() -> str:
        """The fast completion's closures (one row per call, claim slot and block of job
        ids; see ``lease_claim_closures_relname`` for the others)."""
        return "lease_claim_closure_batches"

    @staticmethod
    def attempt_state_relname() -> str:
        return "attempt_state"


def _context(config: object) -> StorageContext:
    if config is not None and not isinstance(config, QueueStorageConfig):
        raise ValidationError("config", config, "expected QueueStorageConfig or None")
    return StorageContext(storage_schema(config or QueueStorageConfig()))


class QueueStorage(Operations, Naming, SyncFace):
    """Segmented queue storage for one schema: every operation of :class:`Operations` on an
    ``Engine``, ``Connection`` or ORM ``Session``."""

    def __init__(self, config: QueueStorageConfig | None = None) -> None:
        self._ctx = _context(config)

    def _bind_operation(self, operation: Operation[Any, Any]) -> Any:
        return operation.bind(self._ctx)

    @classmethod
    def new(cls, config: QueueStorageConfig) -> QueueStorage:
        return cls(config)

    @classmethod
    def from_existing_schema(cls, schema: str, engine: Target | None = None) -> QueueStorage:
        """Storage for an existing ``schema``. Without ``engine``: default shape, no I/O.
        With ``engine``: the shape recorded by the install is read back."""
        validate_identifier(schema, "schema")
        if engine is not None:
            return cls(translate_errors(run)(Policy.JOIN, engine, lambda conn: lifecycle.load_config(conn, schema)))
        return cls(QueueStorageConfig(schema=schema))

    @staticmethod
    @translate_errors
    def active_schema(engine: Target) -> str | None:
        """Schema most recently registered as the active queue-storage backend, or None."""
        return run(Policy.JOIN, engine, lifecycle.active_schema_in_tx)

    active_schema_in_tx = active_schema

    def listen(self, engine: Engine, queues: Iterable[str], cancel: bool = True) -> Listener:
        """A :class:`~qstore.storage.listen.Listener` woken by new ready work on ``queues`` (logical
        names) and, when ``cancel``, by operator cancels of running attempts; it holds a
        dedicated autocommit connection of ``engine`` (opened here) until it is closed.
        Not an operation: it opens a connection of its own and takes no target."""
        from qstore.storage.listen import Listener

        return Listener(engine, self._ctx.config, queues, cancel=cancel).open()

    def __repr__(self) -> str:
        return f"QueueStorage({self._ctx.config!r})"
