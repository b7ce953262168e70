"""Argument checks of the public operations, one function per kind of argument.

Every check has the shape ``check(value, field) -> normalised value`` and raises
:class:`~qstore.errors.ValidationError` naming ``field`` and the value; the operation list
(:mod:`qstore.storage`) names a check for each argument that needs one, and the checks run
before anything touches the database. Checks of job bodies (``InsertParams``) live with the
job model in :mod:`qstore.storage.jobs`, which these reuse.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta
from typing import Any

from qstore.errors import ValidationError
from qstore.storage.jobs import (
    InsertParams,
    validate_aware_datetime,
    validate_id,
    validate_json,
    validate_priority,
    validate_queue,
    validate_text,
    validate_uuid,
)
from qstore.types import (
    CallbackConfig,
    ClaimedEntry,
    ClaimedRuntimeJob,
    JobState,
    ListDlqFilter,
    QueueClaimerLease,
    RetryFromDlqOpts,
)

__all__ = [
    "MAX_BATCH",
    "MAX_CLAIMERS",
    "Check",
    "batch",
    "callback_config",
    "claimed_entries",
    "claimed_jobs",
    "claimer_lease",
    "completions_with_followups",
    "dlq_filter",
    "dlq_opts",
    "duration",
    "flag",
    "id_pairs",
    "ids",
    "job_id",
    "json_value",
    "max_claimers",
    "ms",
    "optional_dlq_filter",
    "optional_id",
    "optional_priority",
    "optional_queue",
    "optional_text",
    "optional_uuid",
    "positive_duration",
    "priority",
    "progress_triples",
    "promotable_state",
    "promotion_batch",
    "queue",
    "seconds",
    "shards",
    "slot_count",
    "text",
    "uuid_value",
]

#: ``check(value, field) -> normalised value``
Check = Callable[[Any, str], Any]

#: Batch sizes and limits are bound as PostgreSQL ``integer``.
MAX_BATCH = 2**31 - 1
MAX_DURATION_SECONDS = 10 * 365 * 86400
#: Claimer slots are ``smallint``: slot numbers run from 0 to ``max_claimers - 1``.
MAX_CLAIMERS = 32767
_ONE_DAY = timedelta(days=1)

queue = validate_queue
priority = validate_priority
job_id = validate_id
text = validate_text
uuid_value = validate_uuid
json_value = validate_json


def optional_text(value: object, field: str) -> str | None:
    return None if value is None else validate_text(value, field)


def optional_id(value: object, field: str) -> int | None:
    return None if value is None else validate_id(value, field)


def optional_priority(value: object, field: str) -> int | None:
    return None if value is None else validate_priority(value, field)


def optional_queue(value: object, field: str) -> str | None:
    return None if value is None else validate_queue(value, field)


def optional_uuid(value: object, field: str) -> uuid.UUID | None:
    return None if value is None else validate_uuid(value, field)


def optional_datetime(value: object, field: str) -> datetime | None:
    return None if value is None else validate_aware_datetime(value, field)


def flag(value: object, field: str) -> bool | None:
    """A bool, or None for "leave as it is"."""
    if value is not None and not isinstance(value, bool):
        raise ValidationError(field, value, "must be a bool or None")
    return value


def shards(value: object, field: str) -> int | None:
    """An enqueue shard count between 1 and 64, or None."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64):
        raise ValidationError(field, value, "must be an integer between 1 and 64")
    return value


def slot_count(value: object, field: str) -> int:
    """A non-negative number of ring slots (0 is allowed and means none)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BATCH:
        raise ValidationError(field, value, f"must be an integer from 0 to {MAX_BATCH}")
    return value


def duration(value: object, field: str) -> timedelta:
    """A duration between 0 and 10 years (timedelta or seconds; None is zero), as a
    ``timedelta`` of millisecond precision."""
    if value is None:
        return timedelta(0)
    if isinstance(value, timedelta):
        seconds: float = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        seconds = value  # compared before any conversion: a huge int never becomes a float
    else:
        raise ValidationError(field, value, "must be a timedelta or a number of seconds")
    if not 0 <= seconds <= MAX_DURATION_SECONDS:  # also rejects NaN
        raise ValidationError(field, value, "must be between 0 and 10 years")
    return timedelta(milliseconds=int(seconds * 1000))


def ms(value: timedelta | float | None) -> int:
    """Whole milliseconds of an already checked duration (see :func:`duration`)."""
    if value is None:
        return 0
    return int((value.total_seconds() if isinstance(value, timedelta) else value) * 1000)


def seconds(value: timedelta | float) -> timedelta:
    """An already checked positive duration (see :func:`positive_duration`) as a timedelta."""
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def batch(value: object, field: str) -> int:
    """A positive batch size or limit that fits PostgreSQL ``integer``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_BATCH:
        raise ValidationError(field, value, f"must be an integer between 1 and {MAX_BATCH}")
    return value


def promotion_batch(value: object, field: str) -> int:
    """An integer of at most ``MAX_BATCH`` (0 or less promotes nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value > MAX_BATCH:
        raise ValidationError(field, value, f"must be an integer of at most {MAX_BATCH}")
    return value


def promotable_state(value: object, field: str) -> JobState:
    """A :class:`JobState` (or its name); only scheduled and retryable jobs are promoted."""
    try:
        return JobState(value)
    except (ValueError, TypeError):
        raise ValidationError(field, value, "must be a JobState") from None


def positive_duration(value: object, field: str) -> timedelta:
    """A strictly positive duration of at most one day (timedelta or seconds)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        # range-checked as a number first: NaN and huge values never reach timedelta()
        if not 0 < value <= _ONE_DAY.total_seconds():
            raise ValidationError(field, value, "must be a positive duration of at most one day")
        value = timedelta(seconds=value)
    if not isinstance(value, timedelta) or value <= timedelta(0) or value > _ONE_DAY:
        raise ValidationError(field, value, "must be a positive duration of at most one day")
    return value


def max_claimers(value: object, field: str) -> int:
    """An integer of at most ``MAX_CLAIMERS`` (0 or less means: claim nothing)."""
    if isinstance(value, bool) or not isinstance(value, int) or value > MAX_CLAIMERS:
        raise ValidationError(field, value, f"must be an integer of at most {MAX_CLAIMERS}")
    return value


def claimer_lease(lease: object, field: str) -> QueueClaimerLease:
    """A lease as ``acquire_queue_claimer`` returns it (slot and epoch in column ranges)."""
    if not isinstance(lease, QueueClaimerLease):
        raise ValidationError(field, lease, "expected a QueueClaimerLease")
    slot, epoch = lease.claimer_slot, lease.lease_epoch
    if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < MAX_CLAIMERS:
        raise ValidationError(f"{field}.claimer_slot", slot, f"must be an integer between 0 and {MAX_CLAIMERS - 1}")
    if isinstance(epoch, bool) or not isinstance(epoch, int) or not 0 <= epoch < 2**63:
        raise ValidationError(f"{field}.lease_epoch", epoch, "must be a non-negative 64-bit integer")
    return lease


def items(value: object, field: str) -> list[Any]:
    """The items of a sequence argument, as a list (a str or a non-iterable is refused)."""
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise ValidationError(field, value, "must be a sequence")
    return list(value)


def _typed_items(value: object, cls: type, field: str) -> list[Any]:
    out = items(value, field)
    for i, item in enumerate(out):
        if not isinstance(item, cls):
            raise ValidationError(f"{field}[{i}]", item, f"expected {cls.__name__}")
    return out


def claimed_jobs(value: object, field: str) -> list[ClaimedRuntimeJob]:
    return _typed_items(value, ClaimedRuntimeJob, field)


def attempts(value: object, field: str) -> list[ClaimedRuntimeJob | tuple[int, int]]:
    """Finished attempts: each a ``ClaimedRuntimeJob`` as the claim returned it, or a
    ``(job_id, run_lease)`` pair (a tuple of two ids)."""
    out: list[ClaimedRuntimeJob | tuple[int, int]] = []
    for i, item in enumerate(items(value, field)):
        if isinstance(item, ClaimedRuntimeJob):
            out.append(item)
        elif isinstance(item, tuple) and len(item) == 2:
            out.append((validate_id(item[0], f"{field}[{i}].job_id"),
                        validate_id(item[1], f"{field}[{i}].run_lease")))
        else:
            raise ValidationError(f"{field}[{i}]", item, "expected a ClaimedRuntimeJob or a (job_id, run_lease) pair")
    return out


def claimed_entries(value: object, field: str) -> list[ClaimedEntry]:
    return _typed_items(value, ClaimedEntry, field)


def completions_with_followups(value: object, field: str) -> list[tuple[ClaimedRuntimeJob, list[InsertParams]]]:
    """``(claimed attempt, follow-up jobs)`` pairs (tuples or lists); each follow-up an
    ``InsertParams`` (its values are checked when it is written)."""
    out = []
    for i, item in enumerate(items(value, field)):
        if not isinstance(item, tuple | list) or len(item) != 2 or not isinstance(item[0], ClaimedRuntimeJob):
            raise ValidationError(f"{field}[{i}]", item, "expected a (ClaimedRuntimeJob, follow-up jobs) pair")
        out.append((item[0], _typed_items(item[1], InsertParams, f"{field}[{i}].followups")))
    return out


def ids(value: object, field: str) -> list[int]:
    return [validate_id(i, f"{field}[{n}]") for n, i in enumerate(items(value, field))]


def _pairs(value: object, field: str, lists: bool) -> list[tuple[int, int]]:
    out = []
    for i, pair in enumerate(items(value, field)):
        if not (isinstance(pair, tuple) or (lists and isinstance(pair, list))) or len(pair) != 2:
            raise ValidationError(f"{field}[{i}]", pair, "expected a (job_id, run_lease) pair")
        out.append((validate_id(pair[0], f"{field}[{i}].job_id"),
                    validate_id(pair[1], f"{field}[{i}].run_lease")))
    return out


def id_pairs(value: object, field: str) -> list[tuple[int, int]]:
    """``(job_id, run_lease)`` pairs, each a tuple or a list of two ids."""
    return _pairs(value, field, lists=True)


def id_tuples(value: object, field: str) -> list[tuple[int, int]]:
    """``(job_id, run_lease)`` pairs, each a tuple of two ids."""
    return _pairs(value, field, lists=False)


def progress_triples(value: object, field: str) -> list[tuple[int, int, Any]]:
    """``(job_id, run_lease, progress)`` triples (tuples or lists)."""
    out = []
    for i, item in enumerate(items(value, field)):
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise ValidationError(f"{field}[{i}]", item, "expected a (job_id, run_lease, progress) triple")
        out.append((validate_id(item[0], f"{field}[{i}].job_id"), validate_id(item[1], f"{field}[{i}].run_lease"),
                    validate_json(item[2], f"{field}[{i}].progress")))
    return out


def callback_config(value: object, field: str) -> CallbackConfig | None:
    if value is not None and not isinstance(value, CallbackConfig):
        raise ValidationError(field, value, "expected CallbackConfig or None")
    return value


def dlq_opts(value: object, field: str) -> RetryFromDlqOpts:
    """Retry options, checked field by field (None: the defaults)."""
    if value is None:
        return RetryFromDlqOpts()
    if not isinstance(value, RetryFromDlqOpts):
        raise ValidationError(field, value, "expected RetryFromDlqOpts or None")
    optional_queue(value.queue, f"{field}.queue")
    optional_priority(value.priority, f"{field}.priority")
    if value.run_at is not None:
        validate_aware_datetime(value.run_at, f"{field}.run_at")
    return value


def dlq_filter(value: object, field: str) -> ListDlqFilter:
    """A DLQ filter, checked field by field."""
    if not isinstance(value, ListDlqFilter):
        raise ValidationError(field, value, "expected ListDlqFilter")
    optional_text(value.kind, f"{field}.kind")
    optional_queue(value.queue, f"{field}.queue")
    optional_text(value.tag, f"{field}.tag")
    optional_id(value.before_id, f"{field}.before_id")
    if value.before_dlq_at is not None:
        validate_aware_datetime(value.before_dlq_at, f"{field}.before_dlq_at")
    if value.limit is not None:
        batch(value.limit, f"{field}.limit")
    return value


def instance(value: object, field: str) -> uuid.UUID:
    return validate_uuid(value, field)


def optional_dlq_filter(value: object, field: str) -> ListDlqFilter:
    """A DLQ filter checked field by field, or None for "no criterion"."""
    return ListDlqFilter() if value is None else dlq_filter(value, field)
