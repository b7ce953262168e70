"""A job's body survives every transition: whatever path a job takes (claim, each kind of
completion, outcomes, callbacks, rescue, promotion, admin moves, the DLQ and back),
``load_job`` returns the kind, args, queue, max_attempts, creation time, unique key,
metadata and tags it was enqueued with — for jobs enqueued by INSERT and by COPY alike.

Paths that change the body on purpose (``set_priority``, ``move_queue``) keep everything
else, and stamp the original value into metadata next to the caller's keys."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import Engine

from qstore import InsertOpts, InsertParams, JobState, QueueStorage, UniqueOpts
from qstore.types import ClaimedRuntimeJob, RetryFromDlqOpts

Q = "body"
ARGS = {"n": 1, "text": 'q"uote \\ {x,y} ✓', "list": [1, None, 2.5, True]}
META = {"owner": "team-a", "nested": {"k": [1, 2]}}
TAGS = ["t1", "tag two"]


def claim(s: QueueStorage, e: Engine, **kw: Any) -> ClaimedRuntimeJob:
    (c,) = s.claim_runtime_batch(e, Q, 1, **kw)
    return c


def pair(c: ClaimedRuntimeJob) -> tuple[int, int]:
    return c.job.id, c.job.run_lease


def _callback_timeout(s: QueueStorage, e: Engine, _job: int) -> None:
    c = claim(s, e)
    token = s.register_callback(e, *pair(c), 0.001)
    assert s.enter_callback_wait(e, *pair(c), token)
    time.sleep(0.02)
    assert [r.id for r in s.rescue_expired_callbacks(e)] == [c.job.id]


def _callback_complete(s: QueueStorage, e: Engine, _job: int) -> None:
    c = claim(s, e)
    token = s.register_callback(e, *pair(c), 3600)
    assert s.complete_external(e, token, {"ok": True}).state is JobState.COMPLETED


def _deadline_rescue(s: QueueStorage, e: Engine, _job: int) -> None:
    claim(s, e, deadline_duration=0.001)
    time.sleep(0.02)
    assert len(s.rescue_expired_deadlines(e)) == 1


def _heartbeat_rescue(s: QueueStorage, e: Engine, _job: int) -> None:
    claim(s, e)
    time.sleep(0.02)
    assert len(s.rescue_stale_heartbeats(e, 0.01)) == 1


def _retry_then_promote(s: QueueStorage, e: Engine, _job: int) -> None:
    s.retry_after(e, *pair(claim(s, e)), 0.001)
    time.sleep(0.02)
    assert s.promote_due(e, JobState.RETRYABLE, 10) == 1


def _claim_batch_complete(s: QueueStorage, e: Engine, _job: int) -> None:
    entries = s.claim_batch(e, Q, 1)
    assert len(s.complete_claimed_batch(e, entries)) == 1


# path -> (what to do to a freshly enqueued job, the state it must end in)
PATHS: dict[str, tuple[Callable[[QueueStorage, Engine, int], Any], JobState]] = {
    "claimed": (lambda s, e, j: claim(s, e), JobState.RUNNING),
    "complete_runtime_batch": (lambda s, e, j: s.complete_runtime_batch(e, [claim(s, e)]), JobState.COMPLETED),
    "complete_job_batch_by_id": (lambda s, e, j: s.complete_job_batch_by_id(e, [pair(claim(s, e))]),
                                 JobState.COMPLETED),
    "complete_claimed_batch": (_claim_batch_complete, JobState.COMPLETED),
    "heartbeat_then_complete": (lambda s, e, j: (c := claim(s, e), s.heartbeat_batch(e, [pair(c)]),
                                                 s.complete_runtime_batch(e, [c])), JobState.COMPLETED),
    "callback_complete_external": (_callback_complete, JobState.COMPLETED),
    "callback_timeout_rescue": (_callback_timeout, JobState.RETRYABLE),
    "cancel_running": (lambda s, e, j: s.cancel_running(e, *pair(claim(s, e)), "stop"), JobState.CANCELLED),
    "fail_terminal": (lambda s, e, j: s.fail_terminal(e, *pair(claim(s, e)), "boom"), JobState.FAILED),
    "fail_retryable": (lambda s, e, j: s.fail_retryable(e, *pair(claim(s, e)), "boom"), JobState.RETRYABLE),
    "retry_after": (lambda s, e, j: s.retry_after(e, *pair(claim(s, e)), 3600), JobState.RETRYABLE),
    "retry_after_then_promote": (_retry_then_promote, JobState.AVAILABLE),
    "snooze": (lambda s, e, j: s.snooze(e, *pair(claim(s, e)), 3600), JobState.SCHEDULED),
    "fail_to_dlq": (lambda s, e, j: s.fail_to_dlq(e, *pair(claim(s, e)), "r", "boom"), JobState.FAILED),
    "fail_to_dlq_then_retry_from_dlq": (
        lambda s, e, j: (s.fail_to_dlq(e, *pair(claim(s, e)), "r", "boom"),
                         s.retry_from_dlq(e, j, RetryFromDlqOpts())), JobState.AVAILABLE),
    "deadline_rescue": (_deadline_rescue, JobState.RETRYABLE),
    "heartbeat_rescue": (_heartbeat_rescue, JobState.RETRYABLE),
    "cancel_available": (lambda s, e, j: s.cancel_job(e, j), JobState.CANCELLED),
    "fail_terminal_then_retry_job": (lambda s, e, j: (s.fail_terminal(e, *pair(claim(s, e)), "boom"),
                                                      s.retry_job(e, j)), JobState.AVAILABLE),
    "fail_terminal_then_move_to_dlq": (lambda s, e, j: (s.fail_terminal(e, *pair(claim(s, e)), "boom"),
                                                        s.move_failed_to_dlq(e, j, "r")), JobState.FAILED),
    "set_priority": (lambda s, e, j: s.set_priority(e, j, 1), JobState.AVAILABLE),
    "move_queue": (lambda s, e, j: s.move_queue(e, j, "elsewhere"), JobState.AVAILABLE),
}


def enqueue(s: QueueStorage, e: Engine, use_copy: bool, **opts: Any) -> int:
    params = InsertParams("body.kind", ARGS, InsertOpts(queue=Q, priority=3, max_attempts=7, metadata=META,
                                                       tags=TAGS, unique=UniqueOpts(), **opts))
    (s.enqueue_params_copy if use_copy else s.enqueue_params_batch)(e, [params])
    return 1  # the first id of the fresh install's own sequence


@pytest.mark.parametrize("use_copy", [False, True], ids=["insert", "copy"])
@pytest.mark.parametrize("path", list(PATHS))
def test_job_body_survives(engine: Engine, next_storage: Callable[[], QueueStorage], path: str,
                           use_copy: bool) -> None:
    storage = next_storage()
    job_id = enqueue(storage, engine, use_copy)
    before = storage.load_job(engine, job_id)
    assert before is not None and before.unique_key is not None
    action, state = PATHS[path]
    action(storage, engine, job_id)
    after = storage.load_job(engine, job_id)
    assert after is not None and after.state is state
    assert (after.kind, after.args, after.max_attempts, after.created_at, after.unique_key, after.tags) \
        == (before.kind, before.args, before.max_attempts, before.created_at, before.unique_key, before.tags)
    assert {k: after.metadata.get(k) for k in META} == META  # the caller's keys, untouched
    assert after.queue == ("elsewhere" if path == "move_queue" else Q)
    assert after.priority == (1 if path == "set_priority" else 3)


def test_scheduled_job_body_survives_cancel(engine: Engine, next_storage: Callable[[], QueueStorage]) -> None:
    storage = next_storage()
    job_id = enqueue(storage, engine, False, run_at=datetime.now(timezone.utc) + timedelta(hours=1))
    before = storage.load_job(engine, job_id)
    assert before is not None and before.state is JobState.SCHEDULED
    storage.cancel_job(engine, job_id)
    after = storage.load_job(engine, job_id)
    assert after is not None and after.state is JobState.CANCELLED
    assert (after.kind, after.args, after.metadata, after.tags, after.created_at, after.unique_key) \
        == (before.kind, before.args, before.metadata, before.tags, before.created_at, before.unique_key)
