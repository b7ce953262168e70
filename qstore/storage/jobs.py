"""Job preparation shared by every path that writes a job body: validation of
:class:`~qstore.types.InsertParams`, unique keys, payloads, stripe and shard routing."""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, SupportsIndex

from qstore.errors import ValidationError
from qstore.types import InsertOpts, InsertParams, JobState, UniqueOpts

__all__ = [
    "DEFAULT_UNIQUE_STATES",
    "MAX_QUEUE_LEN",
    "PreparedJob",
    "logical_queue",
    "ordering_hash",
    "prepare_job",
    "prepare_jobs",
    "shard_for_ordering_key",
    "stripe_of",
    "stripes_for",
    "unique_states_mask",
    "validate_aware_datetime",
    "validate_id",
    "validate_json",
    "validate_kind",
    "validate_priority",
    "validate_queue",
    "validate_text",
    "validate_uuid",
]

MAX_QUEUE_LEN = 200
MAX_KIND_LEN = 200
STRIPE_SEP = "#"
#: Ids (job ids, run leases) are PostgreSQL ``bigint``.
MIN_ID, MAX_ID = -(2**63), 2**63 - 1
#: JSON values nest at most this deep (deeper values cannot be encoded by ``json`` reliably).
MAX_JSON_DEPTH = 256
#: JSON integers have at most this many digits (Python refuses to print much longer ones).
MAX_JSON_INT_DIGITS = 4000
_JSON_INT_LIMIT = 10**MAX_JSON_INT_DIGITS
_SURROGATE = re.compile("[\ud800-\udfff]")
_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")  # what _check_chars refuses


def unique_states_mask(states: int) -> str:
    """8-character bit string, character i = '1' iff state bit i is set (enum order)."""
    return "".join("1" if states >> i & 1 else "0" for i in range(8))


DEFAULT_UNIQUE_STATES = unique_states_mask(UniqueOpts().states)


def holds_key(unique_states: str | None, state: JobState) -> bool:
    return bool(unique_states) and unique_states[state.bit] == "1"  # type: ignore[index]


def _check_chars(value: str, field_name: str, what: str = "") -> None:
    """PostgreSQL text and JSON strings hold neither NUL nor unpaired UTF-16 surrogates
    (which have no UTF-8 encoding)."""
    if "\x00" in value:
        raise ValidationError(field_name, value, f"{what}must not contain NUL characters")
    if _SURROGATE.search(value):
        raise ValidationError(field_name, value, f"{what}must not contain unpaired surrogate characters")


def validate_text(value: object, field_name: str) -> str:
    """A string storable in a PostgreSQL ``text`` column (no NUL, no lone surrogate)."""
    if not isinstance(value, str):
        raise ValidationError(field_name, value, "must be a string")
    _check_chars(value, field_name)
    return value


def validate_queue(queue: object, field_name: str = "queue") -> str:
    if not isinstance(queue, str) or not 1 <= len(queue) <= MAX_QUEUE_LEN:
        raise ValidationError(field_name, queue, f"must be a string of 1..{MAX_QUEUE_LEN} characters")
    _check_chars(queue, field_name)
    return queue


def validate_kind(kind: object, field_name: str = "kind") -> str:
    if not isinstance(kind, str) or not 1 <= len(kind) <= MAX_KIND_LEN:
        raise ValidationError(field_name, kind, f"must be a string of 1..{MAX_KIND_LEN} characters")
    _check_chars(kind, field_name)
    return kind


def validate_id(value: object, field_name: str) -> int:
    """A job id or run lease: an integer (not a bool) in the ``bigint`` range. Any such
    value is accepted; one that names no job simply finds nothing."""
    if isinstance(value, bool) or not isinstance(value, SupportsIndex):
        raise ValidationError(field_name, value, "must be an integer")
    number = operator.index(value)
    if not MIN_ID <= number <= MAX_ID:
        raise ValidationError(field_name, value, "must fit in a 64-bit signed integer")
    return number


def validate_uuid(value: object, field_name: str) -> uuid.UUID:
    """A callback token or instance id: a ``uuid.UUID`` or its string form."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise ValidationError(field_name, value, "must be a UUID")


def validate_aware_datetime(value: object, field_name: str) -> datetime:
    """``value`` (a timezone-aware datetime) as the same instant in UTC. PostgreSQL accepts
    UTC offsets of less than 16 hours only, and a value must read back as a Python datetime,
    so the instant must fall within years 1-9999 in UTC."""
    if not isinstance(value, datetime) or value.utcoffset() is None:
        raise ValidationError(field_name, value, "must be a timezone-aware datetime")
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:
        raise ValidationError(field_name, value, "must fall within years 1-9999 in UTC") from None


def validate_json(value: Any, field_name: str) -> Any:
    """``value`` if PostgreSQL ``jsonb`` can store it: dicts with string keys, lists and
    tuples, strings without NUL or lone surrogates, bools, None, finite floats and integers
    of at most ``MAX_JSON_INT_DIGITS`` digits, nested at most ``MAX_JSON_DEPTH`` deep."""
    _check_json(value, field_name)
    return value


def validate_priority(priority: object, field_name: str = "priority") -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 4:
        raise ValidationError(field_name, priority, "must be an integer between 1 and 4")
    return priority


def logical_queue(physical: str) -> str:
    """``q#3`` → ``q``; a name without a stripe suffix is its own logical queue."""
    base, sep, tail = physical.rpartition(STRIPE_SEP)
    return base if sep and tail.isdigit() and base else physical


def is_stripe(name: str) -> bool:
    return logical_queue(name) != name


def stripe_of(logical: str, stripes: int, index: int, unique_key: bytes | None) -> str:
    """Physical queue for a row: keyed rows co-locate by key hash, others round-robin."""
    if stripes <= 1 or is_stripe(logical):
        return logical
    pick = int.from_bytes(hashlib.blake2b(unique_key, digest_size=8).digest(), "little") if unique_key else index
    return f"{logical}{STRIPE_SEP}{pick % stripes}"


def stripes_for(queue: str, stripe_count: int, start: int = 0) -> list[str]:
    """The physical queues of logical ``queue``, starting at the rotating probe ``start``
    (a stripe name is its own only physical queue)."""
    if stripe_count <= 1 or is_stripe(queue):
        return [queue]
    k = start % stripe_count
    return [f"{queue}{STRIPE_SEP}{(k + i) % stripe_count}" for i in range(stripe_count)]


def ordering_hash(key: bytes) -> int:
    """Rolling unsigned 64-bit hash of an ordering key (FNV basis/prime, byte *added*),
    portable across languages: a row with this key goes to lane ``hash % shards``."""
    h = 14695981039346656037
    for b in key:
        h = (h * 1099511628211 + b) & 0xFFFFFFFFFFFFFFFF
    return h


def shard_for_ordering_key(key: bytes, shards: int) -> int:
    """The lane of a row with ordering key ``key`` among ``shards`` lanes."""
    return 0 if shards <= 1 else ordering_hash(key) % shards


def _check_json(value: Any, path: str, depth: int = 0) -> None:
    if isinstance(value, str):
        _check_chars(value, path)
    elif isinstance(value, dict | list | tuple):
        if depth >= MAX_JSON_DEPTH:
            raise ValidationError(path, type(value).__name__,
                                  f"JSON nests deeper than {MAX_JSON_DEPTH} levels (or contains itself)")
        # a member that is plainly valid (None, a bool, an int in range, a clean string) is
        # passed without a call or its path; anything else gets the full check below
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValidationError(path, k, "object keys must be strings")
                if _BAD_CHARS.search(k) is not None:
                    _check_chars(k, path, "object keys ")
                t = type(v)
                if (v is None or t is bool or (t is int and -_JSON_INT_LIMIT < v < _JSON_INT_LIMIT)
                        or (t is str and _BAD_CHARS.search(v) is None)):
                    continue
                _check_json(v, f"{path}.{k}", depth + 1)
        else:
            for i, v in enumerate(value):
                t = type(v)
                if (v is None or t is bool or (t is int and -_JSON_INT_LIMIT < v < _JSON_INT_LIMIT)
                        or (t is str and _BAD_CHARS.search(v) is None)):
                    continue
                _check_json(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(path, value, "must be a finite number (JSON has no NaN/Infinity)")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -_JSON_INT_LIMIT < value < _JSON_INT_LIMIT:
            raise ValidationError(path, f"<{value.bit_length()}-bit integer>",
                                  f"JSON integers are limited to {MAX_JSON_INT_DIGITS} digits")
    elif value is None or isinstance(value, bool):
        return
    else:
        raise ValidationError(path, value, f"{type(value).__name__} is not JSON-serialisable")


def canonical_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def unique_key_for(kind: str, queue: str, args: Any, opts: UniqueOpts) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(kind.encode())
    if opts.by_queue:
        h.update(b"\x00" + queue.encode())
    if opts.by_args:
        h.update(b"\x00" + canonical_json(args).encode())
    if opts.by_period is not None:
        h.update(b"\x00" + struct.pack("<q", opts.by_period))
    return h.digest()


def build_payload(metadata: Mapping[str, Any] | None, tags: Sequence[str] | None,
                  errors: Sequence[Any] | None = None, progress: Any = None) -> dict[str, Any] | None:
    """Runtime payload: empty members omitted, an empty payload is SQL NULL."""
    out: dict[str, Any] = {}
    if metadata:
        out["metadata"] = dict(metadata)
    if tags:
        out["tags"] = list(tags)
    if errors:
        out["errors"] = list(errors)
    if progress is not None:
        out["progress"] = progress
    return out or None


@dataclass
class PreparedJob:
    """One validated row ready to be written (ready or deferred)."""

    kind: str
    args: Any
    queue: str  # physical
    logical: str
    priority: int
    max_attempts: int
    run_at: datetime | None
    payload: dict[str, Any] | None
    unique_key: bytes | None
    unique_states: str | None
    ordering_key: bytes | None
    job_id: int = 0
    shard: int = 0
    lane_seq: int = 0

    @property
    def state(self) -> JobState:
        return JobState.SCHEDULED if self.run_at is not None else JobState.AVAILABLE


def _check_unique(opts: object, field_name: str) -> UniqueOpts:
    if not isinstance(opts, UniqueOpts):
        raise ValidationError(field_name, opts, "expected UniqueOpts or None")
    for name in ("by_queue", "by_args"):
        if not isinstance(getattr(opts, name), bool):
            raise ValidationError(f"{field_name}.{name}", getattr(opts, name), "must be a bool")
    period = opts.by_period
    if period is not None and (isinstance(period, bool) or not isinstance(period, int)
                               or not MIN_ID <= period <= MAX_ID):
        raise ValidationError(f"{field_name}.by_period", period, "must be None or a 64-bit integer")
    states = opts.states
    if isinstance(states, bool) or not isinstance(states, int) or not 0 <= states <= 0xFF:
        raise ValidationError(f"{field_name}.states", states,
                              "must be a bit mask of job states (an integer between 0 and 255)")
    return opts


def _check_tags(tags: object, field_name: str) -> list[str]:
    if isinstance(tags, str) or not isinstance(tags, Sequence):
        raise ValidationError(field_name, tags, "must be a list of strings")
    for j, tag in enumerate(tags):
        if not isinstance(tag, str):
            raise ValidationError(f"{field_name}[{j}]", tag, "must be a string")
        _check_chars(tag, f"{field_name}[{j}]")
    return list(tags)


def prepare_jobs(jobs: Sequence[InsertParams], stripes: int, field: str = "jobs", start: int = 0) -> list[PreparedJob]:
    """Validate every row before anything is written; raise ``ValidationError`` naming the
    first bad value (``<field>[<index>].<name>``; with ``field="job"`` a single job's values
    are named ``job.<name>``). On a striped install the key-less rows go round-robin over
    the stripes from stripe ``start``."""
    if field == "job":
        return [prepare_job(job, stripes, field, start + i) for i, job in enumerate(jobs)]
    return [prepare_job(job, stripes, f"{field}[{i}]", start + i) for i, job in enumerate(jobs)]


def prepare_job(job: InsertParams, stripes: int, at: str = "job", index: int = 0) -> PreparedJob:
    """One row of :func:`prepare_jobs`: ``job`` validated, values named ``<at>.<name>``; a
    key-less row of a striped queue goes to stripe ``index % stripes``. Checks run in a
    fixed order (kind, queue, priority, max_attempts, run_at, args, metadata, tags,
    ordering_key, unique), so a job with several bad values is refused naming the first of
    them."""
    if not isinstance(job, InsertParams):
        raise ValidationError(at, job, "expected InsertParams")
    opts = job.opts
    if not isinstance(opts, InsertOpts):
        raise ValidationError(f"{at}.opts", opts, "expected InsertOpts")
    kind, queue, args = job.kind, opts.queue, job.args
    validate_kind(kind, f"{at}.kind")
    validate_queue(queue, f"{at}.queue")
    validate_priority(opts.priority, f"{at}.priority")
    ma = opts.max_attempts
    if isinstance(ma, bool) or not isinstance(ma, int) or not 1 <= ma <= 32767:
        raise ValidationError(f"{at}.max_attempts", ma, "must be an integer between 1 and 32767")
    run_at = None if opts.run_at is None else validate_aware_datetime(opts.run_at, f"{at}.run_at")
    _check_json(args, f"{at}.args")
    metadata, tags = opts.metadata, opts.tags
    if type(metadata) is dict and not metadata and type(tags) is tuple and not tags:
        payload = None  # the defaults: nothing to check, no payload
    else:
        if not isinstance(metadata, Mapping):
            raise ValidationError(f"{at}.metadata", metadata, "must be a JSON object")
        _check_json(dict(metadata), f"{at}.metadata")
        payload = build_payload(metadata, _check_tags(tags, f"{at}.tags"))
    ordering_key = opts.ordering_key
    if ordering_key is not None and not isinstance(ordering_key, bytes | bytearray):
        raise ValidationError(f"{at}.ordering_key", ordering_key, "must be bytes")
    key = states = None
    if opts.unique is not None:
        unique = _check_unique(opts.unique, f"{at}.unique")
        key = unique_key_for(kind, queue, args, unique)
        states = unique_states_mask(unique.states)
    physical = queue if stripes <= 1 else stripe_of(queue, stripes, index, key)
    return PreparedJob(
        kind, args, physical, physical if STRIPE_SEP not in physical else logical_queue(physical),
        opts.priority, ma, run_at, payload, key, states,
        bytes(ordering_key) if ordering_key is not None else None,
    )
