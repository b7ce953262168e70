"""Job preparation shared by every path that writes a job body: insert options, validation,
unique keys, stripe and shard routing, and JobRow hydration helpers."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from qstore.errors import ValidationError
from qstore.model import JobState

__all__ = [
    "DEFAULT_UNIQUE_STATES",
    "MAX_QUEUE_LEN",
    "InsertOpts",
    "InsertParams",
    "PreparedJob",
    "UniqueOpts",
    "logical_queue",
    "prepare_jobs",
    "shard_for_ordering_key",
    "stripe_of",
    "unique_states_mask",
    "validate_priority",
    "validate_queue",
]

MAX_QUEUE_LEN = 200
MAX_KIND_LEN = 200
STRIPE_SEP = "#"


@dataclass(frozen=True)
class UniqueOpts:
    """Uniqueness: which parts form the key and in which states a job holds it."""

    by_queue: bool = False
    by_args: bool = True
    by_period: int | None = None
    states: int = 0b0001_1111  # scheduled, available, running, completed, retryable


@dataclass(frozen=True)
class InsertOpts:
    queue: str = "default"
    priority: int = 2
    max_attempts: int = 25
    run_at: datetime | None = None
    deadline_duration: Any = None  # accepted for seed parity; deadlines are per claim call
    metadata: Mapping[str, Any] = field(default_factory=dict)
    tags: Sequence[str] = ()
    unique: UniqueOpts | None = None
    ordering_key: bytes | None = None


@dataclass(frozen=True)
class InsertParams:
    kind: str
    args: Any = field(default_factory=dict)
    opts: InsertOpts = field(default_factory=InsertOpts)


def unique_states_mask(states: int) -> str:
    """8-character bit string, character i = '1' iff state bit i is set (enum order)."""
    return "".join("1" if states >> i & 1 else "0" for i in range(8))


DEFAULT_UNIQUE_STATES = unique_states_mask(UniqueOpts().states)


def holds_key(unique_states: str | None, state: JobState) -> bool:
    return bool(unique_states) and unique_states[state.bit] == "1"  # type: ignore[index]


def validate_queue(queue: object, field_name: str = "queue") -> str:
    if not isinstance(queue, str) or not 1 <= len(queue) <= MAX_QUEUE_LEN:
        raise ValidationError(field_name, queue, f"must be a string of 1..{MAX_QUEUE_LEN} characters")
    if "\x00" in queue:
        raise ValidationError(field_name, queue, "must not contain NUL characters")
    return queue


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


def shard_for_ordering_key(key: bytes, shards: int) -> int:
    """Rolling 64-bit hash (FNV basis/prime, byte *added*), portable across languages."""
    if shards <= 1:
        return 0
    h = 14695981039346656037
    for b in key:
        h = (h * 1099511628211 + b) & 0xFFFFFFFFFFFFFFFF
    return h % shards


def _check_json(value: Any, path: str) -> None:
    if isinstance(value, str):
        if "\x00" in value:
            raise ValidationError(path, value, "must not contain NUL characters")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValidationError(path, k, "object keys must be strings")
            if "\x00" in k:
                raise ValidationError(path, k, "object keys must not contain NUL characters")
            _check_json(v, f"{path}.{k}")
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValidationError(path, value, "must be a finite number (JSON has no NaN/Infinity)")
    elif value is None or isinstance(value, bool | int):
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


def prepare_jobs(jobs: Sequence[InsertParams], stripes: int) -> list[PreparedJob]:
    """Validate every row before anything is written; raise ``ValidationError`` naming the
    first bad value (with its batch index)."""
    out: list[PreparedJob] = []
    for i, job in enumerate(jobs):
        if not isinstance(job, InsertParams):
            raise ValidationError(f"jobs[{i}]", job, "expected InsertParams")
        opts = job.opts
        if not isinstance(job.kind, str) or not 1 <= len(job.kind) <= MAX_KIND_LEN or "\x00" in job.kind:
            raise ValidationError(f"jobs[{i}].kind", job.kind, f"must be a string of 1..{MAX_KIND_LEN} characters without NUL")
        validate_queue(opts.queue, f"jobs[{i}].queue")
        validate_priority(opts.priority, f"jobs[{i}].priority")
        ma = opts.max_attempts
        if isinstance(ma, bool) or not isinstance(ma, int) or not 1 <= ma <= 32767:
            raise ValidationError(f"jobs[{i}].max_attempts", ma, "must be an integer between 1 and 32767")
        if opts.run_at is not None and (not isinstance(opts.run_at, datetime) or opts.run_at.tzinfo is None
                                        or opts.run_at.utcoffset() is None):
            raise ValidationError(f"jobs[{i}].run_at", opts.run_at, "must be a timezone-aware datetime")
        _check_json(job.args, f"jobs[{i}].args")
        if not isinstance(opts.metadata, Mapping):
            raise ValidationError(f"jobs[{i}].metadata", opts.metadata, "must be a JSON object")
        _check_json(dict(opts.metadata), f"jobs[{i}].metadata")
        if isinstance(opts.tags, str) or not all(isinstance(t, str) and "\x00" not in t for t in opts.tags):
            raise ValidationError(f"jobs[{i}].tags", opts.tags, "must be a list of strings")
        if opts.ordering_key is not None and not isinstance(opts.ordering_key, bytes | bytearray):
            raise ValidationError(f"jobs[{i}].ordering_key", opts.ordering_key, "must be bytes")
        key = states = None
        if opts.unique is not None:
            key = unique_key_for(job.kind, opts.queue, job.args, opts.unique)
            states = unique_states_mask(opts.unique.states)
        physical = stripe_of(opts.queue, stripes, i, key)
        out.append(PreparedJob(
            kind=job.kind, args=job.args, queue=physical, logical=logical_queue(physical),
            priority=opts.priority, max_attempts=ma, run_at=opts.run_at,
            payload=build_payload(opts.metadata, opts.tags), unique_key=key,
            unique_states=states,
            ordering_key=bytes(opts.ordering_key) if opts.ordering_key is not None else None,
        ))
    return out
