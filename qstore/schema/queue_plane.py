"""Queue plane: the queue ring (ready entries, tombstones, claim ranges, done entries,
terminal count deltas), the deferred backlog (the wheel and its overflow) and the DLQ."""

from __future__ import annotations

import enum
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Index,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    SmallInteger,
    Table,
    and_,
    column,
    func,
    select,
    text,
    true,
)
from sqlalchemy.dialects.postgresql import TIMESTAMP
from sqlalchemy.sql.schema import SchemaItem
from sqlalchemy.types import TypeEngine

from qstore.config import WHEEL_SLOTS, QueueStorageConfig
from qstore.schema.rings import RingFamily, ring_table
from qstore.schema.types import (
    BIGINT,
    BIGINTS,
    BYTES,
    INT,
    JSON,
    NOW,
    OPTIONAL_JSON,
    SMALLINT,
    SMALLINTS,
    TEXT,
    TS,
    TSS,
)

LANE = ("queue", "priority", "enqueue_shard")
# Primary keys lead with the lane position and end with the partition key: inside one slot
# child the key is the lane index, so no separate lane index is needed (fewer index writes
# on every append).
LANE_KEY = (*LANE, "lane_seq", "ready_slot")


def _ring(md: MetaData, cfg: QueueStorageConfig, name: str, *items: SchemaItem) -> RingFamily:
    return ring_table(md, name, "ready_slot", cfg.queue_slot_count, *items, schema=cfg.schema)


def declare_ready_entries(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Immutable runnable bodies: never updated, never deleted row by row."""
    return _ring(
        md, cfg, "ready_entries",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("kind", TEXT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("args", JSON, nullable=False, server_default=text("'{}'::jsonb")),
        Column("priority", SMALLINT, nullable=False),
        Column("attempt", SMALLINT, nullable=False, server_default=text("0")),
        Column("run_lease", BIGINT, nullable=False, server_default=text("0")),
        Column("max_attempts", SMALLINT, nullable=False, server_default=text("25")),
        Column("lane_seq", BIGINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False, server_default=text("0")),
        Column("run_at", TS, nullable=False, server_default=NOW),
        Column("attempted_at", TS),
        Column("created_at", TS, nullable=False, server_default=NOW),
        Column("unique_key", BYTES),
        Column("unique_states", TEXT),
        Column("payload", OPTIONAL_JSON),
        PrimaryKeyConstraint(*LANE_KEY, name="ready_entries_pkey"),
        Index("ready_entries_job_id_idx", "job_id"),
    )


def declare_ready_tombstones(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Append-only "this unclaimed lane position is void" markers."""
    return _ring(
        md, cfg, "ready_tombstones",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("lane_seq", BIGINT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("tombstoned_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint(*LANE_KEY, "ready_generation", name="ready_tombstones_pkey"),
        Index("ready_tombstones_job_id_idx", "job_id"),
    )


def declare_claim_ranges(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Append-only claim evidence: lane positions ``first_seq..last_seq`` were handed out.

    A claim records the whole span it consumed (claimed rows, tombstoned rows and aborted
    gaps). The claim cursor is only a hint; the committed chain of ranges from the hint is
    the truth, so a claim never has to move a non-transactional cursor before it commits.
    """
    return _ring(
        md, cfg, "ready_claim_ranges",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("first_seq", BIGINT, nullable=False),
        Column("last_seq", BIGINT, nullable=False),
        Column("claimed_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint(*LANE, "first_seq", "ready_slot", name="ready_claim_ranges_pkey"),
        CheckConstraint("last_seq >= first_seq", name="ready_claim_ranges_span"),
    )


#: The predicate of a *wide* done row: one that carries its whole body (``created_at`` is
#: always set in a body) because it has no ready row to hydrate from. A *narrow* row leaves
#: every body column NULL and shares the lane key of its ready row, which lives and is
#: pruned in the same queue slot.
WIDE_DONE_ROW = "created_at IS NOT NULL"


def wide_done_row(done: Any) -> Any:
    """:data:`WIDE_DONE_ROW` as a Core condition on ``done`` (``done_entries``, a child or
    an alias of it)."""
    return done.c.created_at.isnot(None)


def declare_done_entries(md: MetaData, cfg: QueueStorageConfig, state_type: TypeEngine) -> RingFamily:
    """Terminal facts. Narrow rows (claimed attempts) leave the body columns NULL and
    hydrate from their ready row; wide rows carry the body themselves.

    Only wide rows have a ``job_id`` index entry (``done_entries_wide_job_id_idx``, partial
    on :data:`WIDE_DONE_ROW`): a narrow row is found by job id through its ready row's
    ``job_id`` index and the shared lane key, so the completion of a claimed attempt, the
    common case, writes no ``job_id`` index entry of its own."""
    return _ring(
        md, cfg, "done_entries",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("kind", TEXT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("state", state_type, nullable=False, server_default=text("'completed'")),
        Column("priority", SMALLINT, nullable=False),
        Column("attempt", SMALLINT, nullable=False),
        Column("run_lease", BIGINT, nullable=False),
        Column("lane_seq", BIGINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False, server_default=text("0")),
        Column("attempted_at", TS),
        Column("finalized_at", TS, nullable=False, server_default=NOW),
        Column("args", JSON),
        Column("max_attempts", SMALLINT),
        Column("run_at", TS),
        Column("created_at", TS),
        Column("unique_key", BYTES),
        Column("unique_states", TEXT),
        Column("payload", OPTIONAL_JSON),
        PrimaryKeyConstraint(*LANE_KEY, name="done_entries_pkey"),
        Index("done_entries_wide_job_id_idx", "job_id", postgresql_where=text(WIDE_DONE_ROW)),
        Index("done_entries_failed_idx", "queue", postgresql_where=text("state = 'failed'")),
    )


def declare_done_batches(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Terminal facts of completed attempts, written by the completion fast path: one row per
    completion call, claim slot, lane and block of lane positions (``lane_block = lane_seq /
    DONE_BLOCK``) that holds two or more completed attempts (a lone one gets a narrow
    ``done_entries`` row), its members' positions, job ids, run leases, attempts and start
    times as arrays in position order. Every member is ``completed``; the rest of a member's fields
    are its ready row's (same lane position, same ring slot). Never updated or deleted row
    by row; no primary key (a member's exactly-once is its closure's). A job's row is found
    from its ready row through ``done_batches_lane_idx``."""
    return _ring(
        md, cfg, "done_batches",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("lane_block", BIGINT, nullable=False),
        Column("lane_seqs", BIGINTS, nullable=False),
        Column("job_ids", BIGINTS, nullable=False),
        Column("run_leases", BIGINTS, nullable=False),
        Column("attempts", SMALLINTS, nullable=False),
        Column("attempted_ats", TSS, nullable=False),
        Column("finalized_at", TS, nullable=False, server_default=NOW),
        Index("done_batches_lane_idx", *LANE, "lane_block", "ready_slot"),
    )


def done_members(batches: Any, name: str = "members") -> Any:
    """One row per member of the batch done rows of ``batches`` (``done_batches``, a child
    or an alias of it), as a subquery named ``name``: the row's lane, slot and generation,
    the member's ``lane_seq``, ``job_id``, ``run_lease``, ``attempt`` and ``attempted_at``,
    and the row's ``finalized_at``. Every member is a completed attempt."""
    b = batches
    u = func.unnest(b.c.lane_seqs, b.c.job_ids, b.c.run_leases, b.c.attempts, b.c.attempted_ats).table_valued(
        column("lane_seq", BigInteger()), column("job_id", BigInteger()), column("run_lease", BigInteger()),
        column("attempt", SmallInteger()), column("attempted_at", TIMESTAMP(timezone=True)),
    ).render_derived(name=f"{name}_u", with_types=False)
    return select(
        b.c.ready_slot, b.c.ready_generation, b.c.queue, b.c.priority, b.c.enqueue_shard, b.c.lane_block,
        u.c.lane_seq, u.c.job_id, u.c.run_lease, u.c.attempt, u.c.attempted_at, b.c.finalized_at,
    ).select_from(b.join(u, true())).subquery(name)


def batch_member_total(batches: Any) -> Any:
    """How many members the batch done rows of ``batches`` hold, as an aggregate (one per
    array element; NULL over no rows): every count of terminal jobs counts them so."""
    return func.sum(func.cardinality(batches.c.lane_seqs))


def at_lane_position(a: Any, b: Any) -> Any:
    """``a`` and ``b`` (ready rows, done rows, batch members, …) name the same lane position
    in the same queue slot: slot, lane and ``lane_seq`` equal."""
    return and_(a.c.ready_slot == b.c.ready_slot, a.c.queue == b.c.queue, a.c.priority == b.c.priority,
                a.c.enqueue_shard == b.c.enqueue_shard, a.c.lane_seq == b.c.lane_seq)


def declare_terminal_deltas(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Append-only signed terminal-count ledger (no PK: rows are only ever inserted)."""
    return _ring(
        md, cfg, "queue_terminal_count_deltas",
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("counter_bucket", SMALLINT, nullable=False),
        Column("terminal_delta", BIGINT, nullable=False),
        Column("recorded_at", TS, nullable=False, server_default=NOW),
        CheckConstraint("terminal_delta <> 0", name="queue_terminal_count_deltas_nonzero"),
        Index("queue_terminal_count_deltas_queue_idx", "queue", "priority"),
    )


def _job_snapshot_columns(state_type: TypeEngine, state_default: str, *, dlq: bool) -> list[Column]:
    return [
        Column("job_id", BIGINT, primary_key=True, autoincrement=False),
        Column("kind", TEXT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("args", JSON, nullable=False, server_default=text("'{}'::jsonb")),
        Column("state", state_type, nullable=False, server_default=text(f"'{state_default}'")),
        Column("priority", SMALLINT, nullable=False),
        Column("attempt", SMALLINT, nullable=False, server_default=text("1" if dlq else "0")),
        Column("run_lease", BIGINT, nullable=False, server_default=text("1" if dlq else "0")),
        Column("max_attempts", SMALLINT, nullable=False, server_default=text("25")),
        Column("run_at", TS, nullable=False, server_default=NOW),
        Column("attempted_at", TS),
        Column("finalized_at", TS),
        Column("created_at", TS, nullable=False, server_default=NOW),
        Column("unique_key", BYTES),
        Column("unique_states", TEXT),
        Column("payload", OPTIONAL_JSON),
    ]


def declare_deferred_jobs(md: MetaData, cfg: QueueStorageConfig, state_type: TypeEngine) -> Table:
    """The overflow of the deferred backlog (scheduled, retryable): waits due beyond the
    wheel's span, and what a worker of an earlier release writes. Upkeep moves a row into
    the wheel once it comes within the span (a delete); promotion serves rows found due here
    as well."""
    return Table(
        "deferred_jobs", md,
        *_job_snapshot_columns(state_type, "scheduled", dlq=False),
        CheckConstraint("state IN ('scheduled', 'retryable')", name="deferred_jobs_state"),
        Index("deferred_jobs_due_idx", "state", "run_at", "queue", "priority", "job_id"),
        Index("deferred_jobs_unique_key_idx", "unique_key"),
        schema=cfg.schema,
    )


def declare_dlq_entries(md: MetaData, cfg: QueueStorageConfig, state_type: TypeEngine) -> Table:
    """Operator hold table for dead-lettered jobs."""
    return Table(
        "dlq_entries", md,
        *_job_snapshot_columns(state_type, "failed", dlq=True),
        Column("dlq_reason", TEXT, nullable=False),
        Column("dlq_at", TS, nullable=False, server_default=NOW),
        Column("original_run_lease", BIGINT, nullable=False),
        Index("dlq_entries_queue_idx", "queue", "dlq_at"),
        Index("dlq_entries_kind_idx", "kind"),
        schema=cfg.schema,
    )


class WheelResolution(str, enum.Enum):
    """How a wheel entry's wait ended (``deferred_wheel_marks.resolution``)."""

    PROMOTED = "promoted"
    CANCELLED = "cancelled"
    MOVED = "moved"


def declare_deferred_wheel(md: MetaData, cfg: QueueStorageConfig,
                           state_type: TypeEngine) -> tuple[Sequence, RingFamily, RingFamily]:
    """The deferred wheel: append-only entries of waiting jobs, LIST-partitioned by
    ``wheel_slot`` (``bucket % WHEEL_SLOTS``), and the append-only marks that resolve them
    (promoted, cancelled, moved), partitioned the same way and unique per entry. An entry
    is live while it has no mark; a slot whose entries are all marked is reclaimed by
    ``TRUNCATE`` of both children."""
    seq = Sequence("deferred_wheel_entry_seq", schema=cfg.schema, metadata=md, start=1)
    snapshot = [c for c in _job_snapshot_columns(state_type, "scheduled", dlq=False)]
    for c in snapshot:
        c.primary_key = False
    wheel = ring_table(
        md, "deferred_wheel", "wheel_slot", WHEEL_SLOTS,
        Column("wheel_slot", SMALLINT, nullable=False),
        Column("bucket", BIGINT, nullable=False),
        Column("entry_id", BIGINT, nullable=False,
               server_default=text(f"nextval('{cfg.schema}.deferred_wheel_entry_seq'::regclass)")),
        *snapshot,
        PrimaryKeyConstraint("entry_id", "wheel_slot", name="deferred_wheel_pkey"),
        CheckConstraint("state IN ('scheduled', 'retryable')", name="deferred_wheel_state"),
        Index("deferred_wheel_due_idx", "state", "run_at", "priority", "job_id"),
        Index("deferred_wheel_job_id_idx", "job_id"),
        schema=cfg.schema,
    )
    marks = ring_table(
        md, "deferred_wheel_marks", "wheel_slot", WHEEL_SLOTS,
        Column("wheel_slot", SMALLINT, nullable=False),
        Column("entry_id", BIGINT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("resolution", TEXT, nullable=False),
        Column("marked_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("entry_id", "wheel_slot", name="deferred_wheel_marks_pkey"),
        CheckConstraint("resolution IN (" + ", ".join(f"'{r.value}'" for r in WheelResolution) + ")",
                        name="deferred_wheel_marks_resolution"),
        schema=cfg.schema,
    )
    return seq, wheel, marks
