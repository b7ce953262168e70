"""One case per operation of the storage API (``qstore.storage.operations()``, aliases
included): a committed state in which the operation really does something, the call
itself, and what its result must show.

The table is keyed by operation name and every name of the API must have an entry, so an
operation added later without a case fails the tests that walk the table
(``tests/test_rollback_safety.py``: a rollback of a caller's transaction leaves nothing
behind; ``tests/test_errors.py``: a schema that is not installed is named as such).

A case's ``setup(engine, storage)`` commits its state on an ``Engine`` and returns what the
call needs; ``call(storage, target, given)`` runs the operation on ``target``; ``check``
asserts the result shows the operation did its work (a check may also return a bool,
which must not be False). ``writes`` says whether the operation
changes the database (a reader is checked by its result alone).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from jobtools import add, claim, params, running
from sqlalchemy import Engine, text

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig, UniqueOpts
from qstore.types import CallbackConfig, JobState, ListDlqFilter, QueueClaimerLease

__all__ = ["CASES", "Case", "Check", "Given", "missing_case_names"]

Given = dict[str, Any]


@dataclass(frozen=True)
class Case:
    """How to make one operation do its work (see the module docstring)."""

    setup: Callable[[Engine, QueueStorage], Given]
    call: Callable[[QueueStorage, Any, Given], Any]
    check: Callable[[Any, Given], bool | None] = lambda result, given: None
    writes: bool = True
    #: needs an Engine: refused on a caller's transaction (CallerTransactionRefusedError)
    refused: bool = False
    #: the operation acts on another schema than the install's (``given["storage"]``)
    other_schema: bool = False
    #: what the call does on an Engine when its schema does not exist: "raises"
    #: (SchemaNotInstalledError), "installs" it, or "nothing"
    on_missing_schema: str = "raises"
    shape: dict[str, Any] = field(default_factory=dict)


def _schema(engine: Engine, s: QueueStorage, sql: str, **values: Any) -> None:
    with engine.begin() as c:
        c.execute(text(sql.replace("{s}", f'"{s.schema()}"')), values)


# -- committed states ----------------------------------------------------------------------


def nothing(engine: Engine, s: QueueStorage) -> Given:
    return {}


def other_install(engine: Engine, s: QueueStorage) -> Given:
    """A storage for a schema nobody installed yet (dropped by the test afterwards)."""
    return {"storage": QueueStorage(QueueStorageConfig(schema=f"t_{uuid.uuid4().hex[:8]}"))}


def available(engine: Engine, s: QueueStorage) -> Given:
    """One available job (the second of one committed enqueue: the process's shard cache
    stays empty) after a committed claim of an earlier job in the same lane, so a claim follows a committed
    claim range past its lane's cursor hint."""
    s.enqueue_params_batch(engine, [params(args={"n": 0}), params(args={"n": 1})])
    first = claim(engine, s)
    return {"claimed_before": first, "job_id": first.job.id + 1}


def available_cached(engine: Engine, s: QueueStorage) -> Given:
    """:func:`available`, and the queue's shard count in the process's cache (a COPY
    enqueue on an Engine keeps what it read)."""
    given = available(engine, s)
    s.enqueue_params_copy(engine, [params(args={"n": 2})])
    assert "q" in s._ctx.lanes._shards
    return given


def runnable(engine: Engine, s: QueueStorage) -> Given:
    """One running attempt (claimed, receipt only)."""
    c = running(engine, s)
    return {"claimed": c, "job_id": c.job.id, "run_lease": c.job.run_lease}


def leased(engine: Engine, s: QueueStorage) -> Given:
    """One running attempt with a callback token (so a lease)."""
    given = runnable(engine, s)
    given["token"] = s.register_callback(engine, given["job_id"], given["run_lease"], 600)
    return given


def waiting(engine: Engine, s: QueueStorage) -> Given:
    """One attempt waiting for its callback."""
    given = leased(engine, s)
    assert s.enter_callback_wait(engine, given["job_id"], given["run_lease"], given["token"])
    return given


def resolved(engine: Engine, s: QueueStorage) -> Given:
    """A waiting attempt whose callback resumed it with a result not yet handed over."""
    given = waiting(engine, s)
    s.complete_external(engine, given["token"], {"answer": 42}, resume=True)
    return given


def failed(engine: Engine, s: QueueStorage) -> Given:
    given = runnable(engine, s)
    assert s.fail_terminal(engine, given["job_id"], given["run_lease"], "boom") is not None
    return given


def in_dlq(engine: Engine, s: QueueStorage) -> Given:
    given = runnable(engine, s)
    assert s.fail_to_dlq(engine, given["job_id"], given["run_lease"], "poison", "boom") is not None
    return given


def retryable_due(engine: Engine, s: QueueStorage) -> Given:
    given = runnable(engine, s)
    assert s.retry_after(engine, given["job_id"], given["run_lease"], 0) is not None
    return given


def overflow_within_span(engine: Engine, s: QueueStorage) -> Given:
    """A scheduled job waiting in the overflow whose time has come within the wheel's span
    (backdated rather than waited for)."""
    (job_id,) = s.enqueue_many(engine, [InsertParams("k", {}, InsertOpts(
        queue="q", run_at=datetime.now(timezone.utc) + timedelta(hours=2)))])
    _schema(engine, s, "UPDATE {s}.deferred_jobs SET run_at = clock_timestamp() + interval '1 minute'")
    return {"job_id": job_id}


def resolved_wheel_slot(engine: Engine, s: QueueStorage) -> Given:
    """A wheel entry that was promoted: its slot is all resolved."""
    given = retryable_due(engine, s)
    assert s.promote_due(engine, JobState.RETRYABLE, 10) == 1
    return given


def overdue(engine: Engine, s: QueueStorage) -> Given:
    """A running attempt whose deadline passed (backdated rather than waited for)."""
    c = running(engine, s, deadline=600)
    _schema(engine, s, "UPDATE {s}.lease_claims SET deadline_at = now() - interval '1 hour'")
    return {"job_id": c.job.id}


def silent(engine: Engine, s: QueueStorage) -> Given:
    """A running attempt silent for an hour."""
    c = running(engine, s)
    _schema(engine, s, "UPDATE {s}.lease_claims SET claimed_at = now() - interval '1 hour'")
    return {"job_id": c.job.id}


def callback_timed_out(engine: Engine, s: QueueStorage) -> Given:
    given = waiting(engine, s)
    _schema(engine, s, "UPDATE {s}.leases SET callback_timeout_at = now() - interval '1 hour'")
    return given


def old_waiting(engine: Engine, s: QueueStorage) -> Given:
    job_id = add(engine, s, priority=3)
    _schema(engine, s, "UPDATE {s}.ready_entries SET run_at = run_at - interval '1 hour'")
    return {"job_id": job_id}


def claimer(engine: Engine, s: QueueStorage) -> Given:
    instance = uuid.uuid4()
    lease = s.acquire_queue_claimer(engine, "q", instance, 1, 60, 60)
    assert lease is not None
    return {"instance": instance, "lease": lease}


def completed(engine: Engine, s: QueueStorage) -> Given:
    given = runnable(engine, s)
    assert s.complete_runtime_batch(engine, [given["claimed"]])
    return given


def prunable_queue_slot(engine: Engine, s: QueueStorage) -> Given:
    """Queue slot 0 sealed and finished: a prune truncates it."""
    given = completed(engine, s)
    assert s.rotate(engine).kind == "rotated"
    return given


def prunable_lease_slot(engine: Engine, s: QueueStorage) -> Given:
    """Lease slot 0 sealed, its lease gone: a prune truncates it."""
    given = waiting(engine, s)
    s.complete_external(engine, given["token"], {})
    assert s.rotate_leases(engine).kind == "rotated"
    return given


def prunable_claim_slot(engine: Engine, s: QueueStorage) -> Given:
    """Claim slot 0 sealed, every receipt in it closed: a prune truncates it."""
    given = completed(engine, s)
    assert s.rotate_claims(engine).kind == "rotated"
    return given


def rollable_deltas(engine: Engine, s: QueueStorage) -> Given:
    """Terminal-count deltas in a sealed queue slot no attempt refers to."""
    given = completed(engine, s)
    assert s.rotate(engine).kind == "rotated"
    return given


def released_key(engine: Engine, s: QueueStorage) -> Given:
    """A unique job cancelled: its key released (a claim row and a release row)."""
    s.enqueue_params_batch(engine, [params(args={"u": 1}, unique=UniqueOpts())])
    with engine.connect() as conn:
        job_id = conn.execute(text(f'SELECT max(job_id) FROM "{s.schema()}".job_unique_claims')).scalar_one()
    assert s.cancel_job(engine, job_id) is not None
    return {"job_id": job_id}


def every_ring_written(engine: Engine, s: QueueStorage) -> Given:
    """Something in the current slot of every ring, so each has a reason to rotate."""
    return leased(engine, s)


# -- the table ---------------------------------------------------------------------------------

#: A pinned horizon makes the rollup stand down; no test holds a snapshot for an hour.
NOT_PINNED = timedelta(hours=1)


Check = Callable[[Any, Given], "bool | None"]


def _row(state: JobState | None = None) -> Check:
    def check(result: Any, given: Given) -> None:
        assert result is not None, result
        if state is not None:
            assert result.state == state, result

    return check


def _equals(expected: Any) -> Check:
    def check(result: Any, given: Given) -> None:
        assert result == expected, result

    return check


def _length(n: int) -> Check:
    def check(result: Any, given: Given) -> None:
        assert len(result) == n, result

    return check


def _kind(kind: str) -> Check:
    def check(result: Any, given: Given) -> None:
        assert result.kind == kind, result

    return check


def _pair(given: Given) -> tuple[int, int]:
    return (given["job_id"], given["run_lease"])


_ENQUEUE = [params(args={"n": 10}), params(args={"n": 11})]
_RUNNING = JobState.RUNNING

CASES: dict[str, Case] = {
    # lifecycle
    "prepare_schema": Case(other_install, lambda s, t, g: g["storage"].prepare_schema(t), _equals(True),
                           other_schema=True, on_missing_schema="installs"),
    "activate_backend": Case(nothing, lambda s, t, g: s.activate_backend(t)),
    "install": Case(other_install, lambda s, t, g: g["storage"].install(t), other_schema=True,
                    on_missing_schema="installs"),
    "reset": Case(nothing, lambda s, t, g: s.reset(t), on_missing_schema="nothing"),
    # enqueue
    "enqueue": Case(available, lambda s, t, g: s.enqueue(t, _ENQUEUE[0]), lambda r, g: r > g["job_id"]),
    "enqueue_many": Case(available, lambda s, t, g: s.enqueue_many(t, _ENQUEUE), _length(2)),
    "enqueue_params_batch": Case(available, lambda s, t, g: s.enqueue_params_batch(t, _ENQUEUE), _equals(2)),
    "enqueue_params_copy": Case(available, lambda s, t, g: s.enqueue_params_copy(t, _ENQUEUE), _equals(2)),
    "enqueue_batch": Case(available, lambda s, t, g: s.enqueue_batch(t, "q", 2, 3), _equals(3)),
    # claim
    "claim_runtime_batch_with_aging": Case(
        available, lambda s, t, g: s.claim_runtime_batch_with_aging(t, "q", 5, 60, 1), _length(1)),
    "claim_runtime_batch": Case(available, lambda s, t, g: s.claim_runtime_batch(t, "q", 5, 60), _length(1)),
    "claim_job_batch": Case(available, lambda s, t, g: s.claim_job_batch(t, "q", 5), _length(1)),
    "claim_batch": Case(available, lambda s, t, g: s.claim_batch(t, "q", 5), _length(1)),
    "acquire_queue_claimer": Case(nothing, lambda s, t, g: s.acquire_queue_claimer(t, "q", uuid.uuid4(), 1, 60, 60),
                                  lambda r, g: isinstance(r, QueueClaimerLease)),
    "mark_queue_claimer_active": Case(
        claimer, lambda s, t, g: s.mark_queue_claimer_active(t, "q", g["instance"], g["lease"], 600), _equals(True)),
    "claim_runtime_batch_with_aging_for_instance": Case(
        available, lambda s, t, g: s.claim_runtime_batch_with_aging_for_instance(
            t, "q", 5, 60, 1, uuid.uuid4(), 1, 60, 60), _length(1)),
    # complete
    "complete_runtime_batch": Case(runnable, lambda s, t, g: s.complete_runtime_batch(t, [g["claimed"]]), _length(1)),
    "complete_runtime_batch_with_followups": Case(
        runnable, lambda s, t, g: s.complete_runtime_batch_with_followups(t, [(g["claimed"], _ENQUEUE)]), _length(1)),
    "complete_runtime_batch_slow_in_tx": Case(
        runnable, lambda s, t, g: s.complete_runtime_batch_slow_in_tx(t, [g["claimed"]]), _length(1)),
    "complete_job_batch_by_id": Case(runnable, lambda s, t, g: s.complete_job_batch_by_id(t, [_pair(g)]), _length(1)),
    "complete_job_batch_by_id_in_tx": Case(
        runnable, lambda s, t, g: s.complete_job_batch_by_id_in_tx(t, [_pair(g)]), _length(1)),
    "complete_claimed_batch": Case(
        runnable, lambda s, t, g: s.complete_claimed_batch(t, [g["claimed"].claim]), _length(1)),
    "complete_batch": Case(runnable, lambda s, t, g: s.complete_batch(t, [g["claimed"].claim]), _equals(1)),
    "complete_and_claim": Case(
        available, lambda s, t, g: s.complete_and_claim(t, [g["claimed_before"]], "q", 5),
        lambda r, g: r.completed == [(g["claimed_before"].job.id, 1)] and [c.job.id for c in r.claimed] == [g["job_id"]]),
    # reads
    "load_job": Case(runnable, lambda s, t, g: s.load_job(t, g["job_id"]), _row(_RUNNING), writes=False),
    "queue_counts": Case(available, lambda s, t, g: s.queue_counts(t, "q"),
                         lambda r, g: (r.available, r.running) == (1, 1), writes=False),
    "queue_counts_fast": Case(available, lambda s, t, g: s.queue_counts_fast(t, "q"),
                              lambda r, g: r.available >= 1, writes=False),
    "scheduled_count": Case(retryable_due, lambda s, t, g: s.scheduled_count(t, "q"),
                            lambda r, g: r == 1, writes=False),
    # worker outcomes
    "retry_after": Case(runnable, lambda s, t, g: s.retry_after(t, *_pair(g), 60), _row(JobState.RETRYABLE)),
    "snooze": Case(runnable, lambda s, t, g: s.snooze(t, *_pair(g), 60), _row(JobState.SCHEDULED)),
    "cancel_running": Case(runnable, lambda s, t, g: s.cancel_running(t, *_pair(g), "stop"),
                           _row(JobState.CANCELLED)),
    "fail_terminal": Case(runnable, lambda s, t, g: s.fail_terminal(t, *_pair(g), "boom"), _row(JobState.FAILED)),
    "fail_to_dlq": Case(runnable, lambda s, t, g: s.fail_to_dlq(t, *_pair(g), "poison", "boom"),
                        _row(JobState.FAILED)),
    "fail_retryable": Case(runnable, lambda s, t, g: s.fail_retryable(t, *_pair(g), "boom"),
                           _row(JobState.RETRYABLE)),
    "retry_after_in_tx": Case(runnable, lambda s, t, g: s.retry_after_in_tx(t, *_pair(g), 60),
                              _row(JobState.RETRYABLE)),
    "cancel_running_in_tx": Case(runnable, lambda s, t, g: s.cancel_running_in_tx(t, *_pair(g), "stop"),
                                 _row(JobState.CANCELLED)),
    "fail_terminal_in_tx": Case(runnable, lambda s, t, g: s.fail_terminal_in_tx(t, *_pair(g), "boom"),
                                _row(JobState.FAILED)),
    "fail_to_dlq_in_tx": Case(runnable, lambda s, t, g: s.fail_to_dlq_in_tx(t, *_pair(g), "poison", "boom"),
                              _row(JobState.FAILED)),
    "fail_retryable_in_tx": Case(runnable, lambda s, t, g: s.fail_retryable_in_tx(t, *_pair(g), "boom"),
                                 _row(JobState.RETRYABLE)),
    # heartbeats and progress
    "heartbeat_batch": Case(runnable, lambda s, t, g: s.heartbeat_batch(t, [_pair(g)]), _equals(1)),
    "heartbeat_progress_batch": Case(
        runnable, lambda s, t, g: s.heartbeat_progress_batch(t, [(*_pair(g), {"done": 1})]), _equals(1)),
    "flush_progress": Case(runnable, lambda s, t, g: s.flush_progress(t, *_pair(g), {"done": 1})),
    # external callbacks
    "register_callback": Case(runnable, lambda s, t, g: s.register_callback(t, *_pair(g), 60),
                              lambda r, g: isinstance(r, uuid.UUID)),
    "register_callback_with_config": Case(
        runnable, lambda s, t, g: s.register_callback_with_config(t, *_pair(g), 60, CallbackConfig()),
        lambda r, g: isinstance(r, uuid.UUID)),
    "cancel_callback": Case(leased, lambda s, t, g: s.cancel_callback(t, *_pair(g)), _equals(True)),
    "enter_callback_wait": Case(leased, lambda s, t, g: s.enter_callback_wait(t, *_pair(g), g["token"]),
                                _equals(True)),
    "enter_callback_wait_in_tx": Case(
        leased, lambda s, t, g: s.enter_callback_wait_in_tx(t, *_pair(g), g["token"]), _equals(True)),
    "wait_for_callback": Case(runnable, lambda s, t, g: s.wait_for_callback(t, *_pair(g), 60),
                              lambda r, g: isinstance(r, uuid.UUID)),
    "check_callback_state": Case(resolved, lambda s, t, g: s.check_callback_state(t, g["job_id"], g["token"]),
                                 lambda r, g: (r.kind, r.payload) == ("resolved", {"answer": 42})),
    "callback_job": Case(waiting, lambda s, t, g: s.callback_job(t, g["token"], None, True),
                         _row(JobState.WAITING_EXTERNAL), writes=False),
    "callback_job_in_tx": Case(waiting, lambda s, t, g: s.callback_job_in_tx(t, g["token"], g["run_lease"], True),
                               _row(JobState.WAITING_EXTERNAL), writes=False),
    "load_active_lease_in_tx": Case(leased, lambda s, t, g: s.load_active_lease_in_tx(t, *_pair(g)),
                                    _row(_RUNNING), writes=False),
    "complete_external": Case(waiting, lambda s, t, g: s.complete_external(t, g["token"], {"ok": 1}),
                              _row(JobState.COMPLETED)),
    "complete_external_in_tx": Case(
        waiting, lambda s, t, g: s.complete_external_in_tx(t, g["token"], {"ok": 1}, None, True), _row(_RUNNING)),
    "fail_external": Case(waiting, lambda s, t, g: s.fail_external(t, g["token"], "no"), _row(JobState.FAILED)),
    "fail_external_with_error_entry": Case(
        waiting, lambda s, t, g: s.fail_external_with_error_entry(t, g["token"], {"why": "no"}),
        _row(JobState.FAILED)),
    "fail_external_with_error_entry_in_tx": Case(
        waiting, lambda s, t, g: s.fail_external_with_error_entry_in_tx(t, g["token"], "no", g["run_lease"]),
        _row(JobState.FAILED)),
    "retry_external": Case(waiting, lambda s, t, g: s.retry_external(t, g["token"]), _row(JobState.AVAILABLE)),
    "retry_external_in_tx": Case(waiting, lambda s, t, g: s.retry_external_in_tx(t, g["token"], g["run_lease"]),
                                 _row(JobState.AVAILABLE)),
    "heartbeat_callback": Case(waiting, lambda s, t, g: s.heartbeat_callback(t, g["token"], 3600),
                               _row(JobState.WAITING_EXTERNAL)),
    # rescue and promotion
    "rescue_stale_heartbeats": Case(silent, lambda s, t, g: s.rescue_stale_heartbeats(t, 60), _length(1)),
    "rescue_expired_deadlines": Case(overdue, lambda s, t, g: s.rescue_expired_deadlines(t), _length(1)),
    "rescue_expired_callbacks": Case(callback_timed_out, lambda s, t, g: s.rescue_expired_callbacks(t), _length(1)),
    "promote_due": Case(retryable_due, lambda s, t, g: s.promote_due(t, JobState.RETRYABLE, 10), _equals(1)),
    "promote_all_due": Case(retryable_due, lambda s, t, g: s.promote_all_due(t, 10),
                            _equals({JobState.SCHEDULED: 0, JobState.RETRYABLE: 1})),
    "advance_overflow": Case(overflow_within_span, lambda s, t, g: s.advance_overflow(t, 10), _equals(1)),
    "prune_wheel": Case(resolved_wheel_slot, lambda s, t, g: s.prune_wheel(
        t, datetime.now(timezone.utc) + timedelta(minutes=1)), lambda r, g: len(r.pruned) == 1),
    # admin
    "retry_job": Case(failed, lambda s, t, g: s.retry_job(t, g["job_id"]), _row(JobState.AVAILABLE)),
    "retry_jobs_by_ids": Case(failed, lambda s, t, g: s.retry_jobs_by_ids(t, [g["job_id"]]), _length(1)),
    "cancel_job": Case(available, lambda s, t, g: s.cancel_job(t, g["job_id"]), _row(JobState.CANCELLED)),
    "cancel_jobs_by_ids": Case(runnable, lambda s, t, g: s.cancel_jobs_by_ids(t, [g["job_id"]]), _length(1)),
    "set_priority": Case(available, lambda s, t, g: s.set_priority(t, g["job_id"], 4), _equals(True)),
    "set_priority_tx": Case(available, lambda s, t, g: s.set_priority_tx(t, g["job_id"], 4), _equals(True)),
    "move_queue": Case(available, lambda s, t, g: s.move_queue(t, g["job_id"], "elsewhere"), _equals(True)),
    "move_queue_tx": Case(available, lambda s, t, g: s.move_queue_tx(t, g["job_id"], "elsewhere", 1), _equals(True)),
    "age_waiting_priorities": Case(old_waiting, lambda s, t, g: s.age_waiting_priorities(t, 60, 10),
                                   lambda r, g: r == [g["job_id"]]),
    "set_queue_options": Case(available_cached, lambda s, t, g: s.set_queue_options(
        t, "q", paused=True, enqueue_shards=2, dlq_enabled=True)),
    # DLQ
    "move_failed_to_dlq": Case(failed, lambda s, t, g: s.move_failed_to_dlq(t, g["job_id"], "poison"),
                               _row(JobState.FAILED)),
    "bulk_move_failed_to_dlq": Case(failed, lambda s, t, g: s.bulk_move_failed_to_dlq(t, None, "q", "poison"),
                                    _equals(1)),
    "retry_from_dlq": Case(in_dlq, lambda s, t, g: s.retry_from_dlq(t, g["job_id"]), _row(JobState.AVAILABLE)),
    "bulk_retry_from_dlq": Case(in_dlq, lambda s, t, g: s.bulk_retry_from_dlq(t, ListDlqFilter(queue="q")),
                                _equals(1)),
    "discard_failed_by_kind": Case(failed, lambda s, t, g: s.discard_failed_by_kind(t, "k"), _equals(1)),
    "list_dlq": Case(in_dlq, lambda s, t, g: s.list_dlq(t), _length(1), writes=False),
    "load_dlq_entry": Case(in_dlq, lambda s, t, g: s.load_dlq_entry(t, g["job_id"]),
                           lambda r, g: r.dlq_reason == "poison", writes=False),
    "purge_dlq": Case(in_dlq, lambda s, t, g: s.purge_dlq(t), _equals(1)),
    # ring maintenance and counters
    "rotate": Case(every_ring_written, lambda s, t, g: s.rotate(t), _kind("rotated"), refused=True),
    "prune_oldest": Case(prunable_queue_slot, lambda s, t, g: s.prune_oldest(t), _kind("pruned")),
    "rotate_leases": Case(every_ring_written, lambda s, t, g: s.rotate_leases(t), _kind("rotated"), refused=True),
    "prune_oldest_leases": Case(prunable_lease_slot, lambda s, t, g: s.prune_oldest_leases(t), _kind("pruned")),
    "vacuum_leases": Case(every_ring_written, lambda s, t, g: s.vacuum_leases(t), refused=True),
    "rotate_claims": Case(every_ring_written, lambda s, t, g: s.rotate_claims(t), _kind("rotated"), refused=True),
    "prune_oldest_claims": Case(prunable_claim_slot, lambda s, t, g: s.prune_oldest_claims(t), _kind("pruned")),
    "claim_slot_bytes": Case(runnable, lambda s, t, g: s.claim_slot_bytes(t), lambda r, g: r > 0, writes=False),
    "rollup_terminal_count_deltas": Case(
        rollable_deltas, lambda s, t, g: s.rollup_terminal_count_deltas(t, 4, pinned_after=NOT_PINNED),
        lambda r, g: (r.rolled_slots, r.skipped_mvcc_pinned) == (1, False)),
    "rebuild_terminal_counters": Case(completed, lambda s, t, g: s.rebuild_terminal_counters(t), _equals(1)),
    "purge_released_keys": Case(released_key, lambda s, t, g: s.purge_released_keys(t, pinned_after=NOT_PINNED),
                                _equals(1)),
    "terminal_counter_trusted": Case(nothing, lambda s, t, g: s.terminal_counter_trusted(t), _equals(True),
                                     writes=False),
}


def missing_case_names() -> list[str]:
    """Operations of the API without a case in :data:`CASES`."""
    from qstore.storage import operations

    return sorted(set(operations()) - CASES.keys())

