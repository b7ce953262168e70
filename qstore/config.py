"""`QueueStorageConfig`: validated construction input and the relation-name helpers.

Nothing here performs I/O. A config is immutable and hashable, so it can key caches
(compiled statements, metadata).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from qstore.errors import ValidationError

__all__ = [
    "CLAIMED_IN_XACT",
    "CLAIM_WAIT",
    "COUNTER_BUCKETS",
    "DEFAULT_SCHEMA",
    "DEFAULT_SHARDS",
    "DONE_BLOCK",
    "MAX_CHANNEL_BYTES",
    "MIN_CLAIM_SLOTS",
    "MIN_LEASE_SLOTS",
    "MIN_QUEUE_SLOTS",
    "WHEEL_BUCKET_SECONDS",
    "WHEEL_GUARD_SLOTS",
    "WHEEL_SLOTS",
    "QueueStorageConfig",
    "channel_name",
    "validate_identifier",
]

DEFAULT_SCHEMA = "qstore"
MIN_QUEUE_SLOTS = 4
MIN_LEASE_SLOTS = 2
MIN_CLAIM_SLOTS = 2
MAX_SLOTS = 256
MAX_STRIPES = 64
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
# Leave room for the longest derived name ("<schema>_alembic_version" style suffixes are not
# used, but child relnames are <parent>_<slot> inside the schema; the schema itself is <= 48).
_MAX_SCHEMA_LEN = 48
#: PostgreSQL channel names are identifiers: at most NAMEDATALEN - 1 = 63 bytes.
MAX_CHANNEL_BYTES = 63

# -- constants the server functions and the runtime share (the head's SQL texts are rendered
#    with them; a landed revision keeps the values it was rendered with) --------------------

#: Lanes per (queue, priority) for a queue without a ``queue_meta`` row.
DEFAULT_SHARDS = 8
#: How long a claim queues on a busy lane head when every lane with work is being claimed
#: (``claim_ready``'s ``lock_timeout``; below ``deadlock_timeout``, so a wait never turns
#: into a deadlock error).
CLAIM_WAIT = "200ms"
#: Transaction-local setting a claim sets once it has written a claim range: later claims in
#: the same transaction may see their own uncommitted ranges, so they leave the lane's
#: cursor hint alone.
CLAIMED_IN_XACT = "qstore.claimed_in_xact"
#: Session setting (suffixed ``.<schema>``) in which a claim keeps the queue-ring slot it
#: last found a ready row in, and looks there first at its next call: a backlog enqueued
#: before the ring last turned sits in an older slot than the current one. A hint only: a
#: miss falls back to a look at every slot.
READY_SLOT_SEEN = "qstore.ready_slot_seen"
#: Terminal-count deltas and live counts are keyed by (slot, lane, counter_bucket) with
#: ``counter_bucket = job_id % COUNTER_BUCKETS``. One bucket keeps the append-only ledger at
#: one row per lane per completion batch (instead of one per job); the column stays so a
#: deployment that wants to spread hot counter rows can raise it (with a counter rebuild).
COUNTER_BUCKETS = 1
#: A batch done row (``done_batches``) holds completed attempts of one lane whose positions
#: fall in one block of ``DONE_BLOCK`` positions (``lane_block = lane_seq / DONE_BLOCK``), so
#: a job's batch row is found from its ready row's position by one index probe. Fixed per
#: revision (rows are keyed by it).
DONE_BLOCK = 1024
#: A batch closure (``lease_claim_closure_batches``) holds attempts of one claim slot whose
#: job ids fall in one block of ``CLOSURE_BLOCK`` ids (``job_block = job_id /
#: CLOSURE_BLOCK``), so whether a receipt is closed is found from its job id by one index
#: probe, which reads every batch row of the block: small blocks keep that to a few rows
#: (a claim batch's ids are mostly consecutive, so a completion writes one or two rows per
#: claim batch it closes). Fixed per revision (rows are keyed by it).
CLOSURE_BLOCK = 64
#: The deferred wheel (``deferred_wheel``, ``deferred_wheel_marks``): a job waiting for
#: ``run_at`` is appended to bucket ``floor(epoch(run_at) / WHEEL_BUCKET_SECONDS)`` (the
#: current bucket when that is already past), stored in slot ``bucket % WHEEL_SLOTS``. A
#: wait whose bucket is ``WHEEL_SLOTS - WHEEL_GUARD_SLOTS`` or more buckets ahead of the
#: current one waits in ``deferred_jobs`` (the overflow) until it comes within that span, so
#: the ``WHEEL_GUARD_SLOTS`` slots behind the current bucket only ever hold past buckets and
#: can be truncated once every entry in them is resolved. Fixed per revision (the slot count
#: decides the partition children and the span is part of the server's routing).
WHEEL_BUCKET_SECONDS = 30
WHEEL_SLOTS = 32
WHEEL_GUARD_SLOTS = 4


def channel_name(*parts: str) -> str:
    """``parts`` joined with ``:``; when that exceeds ``MAX_CHANNEL_BYTES`` bytes of UTF-8,
    its longest fitting character prefix followed by ``#`` and 16 hex digits of its
    BLAKE2b hash (deterministic, so a listener computes the same name)."""
    name = ":".join(parts)
    raw = name.encode()
    if len(raw) <= MAX_CHANNEL_BYTES:
        return name
    digest = hashlib.blake2b(raw, digest_size=8).hexdigest()
    head = raw[: MAX_CHANNEL_BYTES - len(digest) - 1].decode(errors="ignore")
    return f"{head}#{digest}"


def validate_identifier(name: object, field_name: str = "schema") -> str:
    """Return ``name`` if it is a lower-case unquoted PostgreSQL identifier, else raise."""
    if not isinstance(name, str) or not _IDENT.fullmatch(name) or len(name) > _MAX_SCHEMA_LEN:
        raise ValidationError(
            field_name,
            name,
            f"must match ^[a-z_][a-z0-9_]*$ and be at most {_MAX_SCHEMA_LEN} characters",
        )
    if name.startswith("pg_"):
        raise ValidationError(field_name, name, "names starting with pg_ are reserved")
    return name


def _check_int(field_name: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(field_name, value, "must be an integer")
    if value < minimum:
        raise ValidationError(field_name, value, f"must be >= {minimum}")
    if value > maximum:
        raise ValidationError(field_name, value, f"must be <= {maximum}")
    return value


@dataclass(frozen=True)
class QueueStorageConfig:
    """Shape of one storage install.

    ``schema`` holds every qstore object of the install (tables, partitions, functions,
    sequences and the Alembic version table). The default schema is migration-owned and
    must keep the default slot counts and receipt mode, so every deploy of the default
    install agrees on its shape.
    """

    schema: str = DEFAULT_SCHEMA
    queue_slot_count: int = 16
    lease_slot_count: int = 8
    claim_slot_count: int = 8
    queue_stripe_count: int = 1
    lease_claim_receipts: bool = True
    notify_prefix: str = field(default="qstore")

    def __post_init__(self) -> None:
        validate_identifier(self.schema, "schema")
        _check_int("queue_slot_count", self.queue_slot_count, MIN_QUEUE_SLOTS, MAX_SLOTS)
        _check_int("lease_slot_count", self.lease_slot_count, MIN_LEASE_SLOTS, MAX_SLOTS)
        _check_int("claim_slot_count", self.claim_slot_count, MIN_CLAIM_SLOTS, MAX_SLOTS)
        _check_int("queue_stripe_count", self.queue_stripe_count, 1, MAX_STRIPES)
        if not isinstance(self.lease_claim_receipts, bool):
            raise ValidationError("lease_claim_receipts", self.lease_claim_receipts, "must be a bool")
        validate_identifier(self.notify_prefix, "notify_prefix")
        if self.schema == DEFAULT_SCHEMA and not self.uses_defaults():
            raise ValidationError(
                "schema",
                self.schema,
                "the default schema is migration-owned and must use the default slot counts, "
                "one stripe and receipts on; choose another schema for a custom shape",
            )

    def uses_defaults(self) -> bool:
        """True when every shape field has its default value."""
        return (
            self.queue_slot_count == 16
            and self.lease_slot_count == 8
            and self.claim_slot_count == 8
            and self.queue_stripe_count == 1
            and self.lease_claim_receipts is True
        )

    # -- relation names (no schema prefix, no range check: mirrors the seed) -------------
    def ready_child_relname(self, slot: int) -> str:
        return f"ready_entries_{slot}"

    def done_child_relname(self, slot: int) -> str:
        return f"done_entries_{slot}"

    def leases_child_relname(self, slot: int) -> str:
        return f"leases_{slot}"

    @property
    def version_table(self) -> str:
        """Name of the Alembic version table kept inside the storage schema."""
        return "qstore_alembic_version"

    def notify_channel(self, logical_queue: str) -> str:
        """LISTEN/NOTIFY channel that wakes claimers of ``logical_queue``:
        ``<prefix>:<schema>:<queue>``, shortened by :func:`channel_name` when too long."""
        return channel_name(self.notify_prefix, self.schema, logical_queue)

    @property
    def cancel_channel(self) -> str:
        return channel_name(self.notify_prefix, self.schema, "cancel")
