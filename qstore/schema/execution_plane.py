"""Execution plane: the lease ring, the claim ring (receipts + closures) and the optional
per-attempt mutable state."""

from __future__ import annotations

from sqlalchemy import Column, Index, MetaData, PrimaryKeyConstraint, Sequence, Table, text
from sqlalchemy.types import TypeEngine

from qstore.config import QueueStorageConfig
from qstore.schema.rings import RingFamily, ring_table
from qstore.schema.types import BIGINT, BIGINTS, INT, JSON, NOW, SMALLINT, TEXT, TS, UUIDT, warm

LANE = ("queue", "priority", "enqueue_shard")


def declare_leases(md: MetaData, cfg: QueueStorageConfig, state_type: TypeEngine) -> RingFamily:
    """Materialised, mutable attempts (callbacks, receipts-off claims).

    ``priority`` is the lane priority (the join key back to the ready row);
    ``effective_priority`` is the aged priority the attempt was claimed at; the two are kept
    apart so that aging never moves an attempt off its lane.
    """
    return ring_table(
        md, "leases", "lease_slot", cfg.lease_slot_count,
        Column("lease_slot", INT, nullable=False),
        Column("lease_generation", BIGINT, nullable=False),
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("state", state_type, nullable=False, server_default=text("'running'")),
        Column("priority", SMALLINT, nullable=False),
        Column("effective_priority", SMALLINT, nullable=False),
        Column("attempt", SMALLINT, nullable=False, server_default=text("1")),
        Column("run_lease", BIGINT, nullable=False, server_default=text("1")),
        Column("max_attempts", SMALLINT, nullable=False),
        Column("lane_seq", BIGINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False, server_default=text("0")),
        Column("claim_slot", INT),
        Column("heartbeat_at", TS),
        Column("deadline_at", TS),
        Column("attempted_at", TS),
        Column("callback_id", UUIDT),
        Column("callback_timeout_at", TS),
        PrimaryKeyConstraint(*LANE, "lane_seq", "lease_slot", name="leases_pkey"),
        Index("leases_callback_idx", "callback_id"),
        Index("leases_attempt_idx", "job_id", "run_lease"),
        Index("leases_ready_ref_idx", "ready_slot", "ready_generation"),
        Index("leases_callback_timeout_idx", "state", "callback_timeout_at"),
        Index("leases_deadline_idx", "state", "deadline_at"),
        schema=cfg.schema,
        child_with=warm(50, 200),
    )


def declare_lease_claims(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Append-only claim receipts: one row per attempt ``(job_id, run_lease)``.

    The only B-tree is the primary key: receipts are written once per
    claimed job on the hot path and every secondary B-tree costs an index insert and its
    WAL per job. The queue-prune gate (open receipts of a ready slot) uses a BRIN on
    ``ready_slot`` instead (receipts are appended in roughly ready-slot order), and stale
    rescue never used the old ``(materialized_at, claimed_at, job_id)`` index: it filters on
    the heartbeat-or-claim time, which that index could not serve.
    """
    lookups = [Index("lease_claims_ready_slot_idx", "ready_slot", postgresql_using="brin",
                     postgresql_with={"pages_per_range": 16})]
    return ring_table(
        md, "lease_claims", "claim_slot", cfg.claim_slot_count,
        Column("claim_slot", INT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("run_lease", BIGINT, nullable=False),
        Column("ready_slot", INT, nullable=False),
        Column("ready_generation", BIGINT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("effective_priority", SMALLINT, nullable=False),
        Column("attempt", SMALLINT, nullable=False),
        Column("max_attempts", SMALLINT, nullable=False),
        Column("lane_seq", BIGINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("claimed_at", TS, nullable=False, server_default=NOW),
        Column("materialized_at", TS),
        Column("deadline_at", TS),
        # attempt first: the key doubles as the (job_id, run_lease) lookup index
        PrimaryKeyConstraint("job_id", "run_lease", "claim_slot", name="lease_claims_pkey"),
        Index("lease_claims_deadline_idx", "deadline_at", postgresql_using="brin",
              postgresql_with={"pages_per_range": 16}),
        *lookups,
        schema=cfg.schema,
        child_with={"fillfactor": 50},
    )


def declare_lease_claim_closures(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Append-only receipt closures; the PK makes finalisation at-most-once."""
    return ring_table(
        md, "lease_claim_closures", "claim_slot", cfg.claim_slot_count,
        Column("claim_slot", INT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("run_lease", BIGINT, nullable=False),
        Column("outcome", TEXT, nullable=False),
        Column("closed_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("job_id", "run_lease", "claim_slot",
                             name="lease_claim_closures_pkey"),
        schema=cfg.schema,
    )


def declare_lease_claim_closure_batches(md: MetaData, cfg: QueueStorageConfig) -> RingFamily:
    """Closures of completed attempts, written by the completion fast path: one row per
    completion call, claim slot and block of job ids (``job_block = job_id /
    CLOSURE_BLOCK``), its members' job ids and run leases as arrays in job-id order. A
    member is closed exactly like a receipt with a row in ``lease_claim_closures``; an
    attempt has at most one closure of either form, because every closer locks the receipt
    first and checks both forms in a later statement. Never updated or deleted row by row;
    no primary key. Found from a receipt through ``lease_claim_closure_batches_block_idx``."""
    return ring_table(
        md, "lease_claim_closure_batches", "claim_slot", cfg.claim_slot_count,
        Column("claim_slot", INT, nullable=False),
        Column("job_block", BIGINT, nullable=False),
        Column("job_ids", BIGINTS, nullable=False),
        Column("run_leases", BIGINTS, nullable=False),
        Column("closed_at", TS, nullable=False, server_default=NOW),
        Index("lease_claim_closure_batches_block_idx", "job_block", "claim_slot"),
        schema=cfg.schema,
    )


def progress_ring(cfg: QueueStorageConfig) -> str:
    """The ring whose slots hold the attempts' progress rows: the claim ring when the
    install claims with receipts (an attempt's receipt stays open in its claim slot until
    the attempt ends), the lease ring otherwise (its lease stays in its lease slot)."""
    return "claim" if cfg.lease_claim_receipts else "lease"


def declare_attempt_progress(md: MetaData, cfg: QueueStorageConfig) -> tuple[RingFamily, Sequence]:
    """Append-only heartbeats and progress: one row per heartbeat or progress report.

    A row lives in the slot that holds its attempt (``ring_slot``: the receipt's claim slot,
    or the lease's lease slot on a receipts-off install, see :func:`progress_ring`), so the
    ring's prune gate (open receipts, live leases) keeps it while the attempt lives and
    ``TRUNCATE`` reclaims it with the slot. Each row carries the attempt's whole state
    (``heartbeat_at`` and ``progress``, carried over from the attempt's previous row when a
    report sets only one of them); ``seq`` (from ``attempt_progress_seq``) orders an
    attempt's rows, and readers take the row with the greatest ``seq`` (the primary key
    serves that lookup)."""
    seq = Sequence("attempt_progress_seq", schema=cfg.schema, metadata=md, start=1)
    slots = cfg.claim_slot_count if cfg.lease_claim_receipts else cfg.lease_slot_count
    family = ring_table(
        md, "attempt_progress", "ring_slot", slots,
        Column("ring_slot", INT, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("run_lease", BIGINT, nullable=False),
        Column("seq", BIGINT, nullable=False),
        Column("written_at", TS, nullable=False, server_default=NOW),
        Column("heartbeat_at", TS),
        Column("progress", JSON),
        PrimaryKeyConstraint("job_id", "run_lease", "seq", "ring_slot", name="attempt_progress_pkey"),
        schema=cfg.schema,
    )
    return family, seq


def declare_attempt_state(md: MetaData, cfg: QueueStorageConfig) -> Table:
    """Optional mutable state of a live attempt: its callback data. Heartbeats and progress
    go to ``attempt_progress``; ``heartbeat_at`` and ``progress`` here are written only by a
    previous release's processes during a rolling deploy (readers take them into account)."""
    return Table(
        "attempt_state", md,
        Column("job_id", BIGINT, nullable=False),
        Column("run_lease", BIGINT, nullable=False),
        Column("heartbeat_at", TS),
        Column("progress", JSON),
        Column("callback_filter", TEXT),
        Column("callback_on_complete", TEXT),
        Column("callback_on_fail", TEXT),
        Column("callback_transform", TEXT),
        Column("callback_result", JSON),
        Column("updated_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("job_id", "run_lease", name="attempt_state_pkey"),
        schema=cfg.schema,
        postgresql_with=warm(80),
    )
