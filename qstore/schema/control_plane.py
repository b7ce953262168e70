"""Control plane: ring cursors, lanes and heads, counters, queue metadata, unique claims,
bounded-claimer slots, the backend registry and the recorded install configuration."""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    Sequence,
    Table,
    TableClause,
    UniqueConstraint,
    column,
    table,
    text,
)
from sqlalchemy.sql.expression import ColumnClause

from qstore.config import QueueStorageConfig
from qstore.schema.types import (
    BIGINT,
    BYTES,
    INT,
    JSON,
    NOW,
    REGCLASS,
    SMALLINT,
    TEXT,
    TS,
    UUIDT,
    warm,
)


def declare_ring_cursor(md: MetaData, cfg: QueueStorageConfig, ring: str) -> tuple[Sequence, TableClause]:
    """The ring's cursor: a sequence holding its generation (the current slot is
    ``generation % slot_count``) and the ``<ring>_ring_state`` view that reads it.

    A rotation is a ``setval``: no row is updated, so rotating leaves no dead tuple behind,
    whatever the MVCC horizon is doing. The view (created with the functions, see
    :func:`qstore.schema.functions.declare_views`) is what every writer reads in the same
    statement as its insert.
    """
    seq = Sequence(f"{ring}_ring_generation", schema=cfg.schema, metadata=md, start=0,
                   minvalue=0, data_type=BigInteger)
    cols: list[ColumnClause[Any]] = [
        column("singleton", Boolean), column("current_slot", Integer),
        column("generation", BigInteger), column("slot_count", Integer)]
    if ring == "queue":
        cols.append(column("terminal_counter_trusted_at", DateTime(timezone=True)))
    return seq, table(f"{ring}_ring_state", *cols, schema=cfg.schema)


def declare_lanes(md: MetaData, cfg: QueueStorageConfig) -> tuple[Table, Table, Table]:
    """Lane registry plus the enqueue/claim head tables.

    Lane cursors are PostgreSQL sequences (no MVCC heap update per enqueue or claim); the head
    rows name them and the claim head row is the ``FOR UPDATE SKIP LOCKED`` target of claim.
    """
    lanes = Table(
        "queue_lanes", md,
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("created_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("queue", "priority", name="queue_lanes_pkey"),
        schema=cfg.schema,
    )
    enqueue_heads = Table(
        "queue_enqueue_heads", md,
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("enqueue_seq", REGCLASS, nullable=False),
        PrimaryKeyConstraint("queue", "priority", "enqueue_shard", name="queue_enqueue_heads_pkey"),
        schema=cfg.schema, postgresql_with=warm(50),
    )
    claim_heads = Table(
        "queue_claim_heads", md,
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("logical_queue", TEXT, nullable=False),
        Column("enqueue_seq", REGCLASS, nullable=False),
        Column("claim_seq", REGCLASS, nullable=False),
        PrimaryKeyConstraint("queue", "priority", "enqueue_shard", name="queue_claim_heads_pkey"),
        Index("queue_claim_heads_logical_idx", "logical_queue"),
        schema=cfg.schema, postgresql_with=warm(50),
    )
    return lanes, enqueue_heads, claim_heads


def declare_counters(md: MetaData, cfg: QueueStorageConfig) -> tuple[Table, Table, Table, Table]:
    """Terminal counters: live counts per retained slot (folded from the delta ledger),
    permanent rollups of pruned slots, the append-only ledger prunes write their folds to
    (folded into the rollups when no snapshot pins the horizon) and the trust marker."""
    live = Table(
        "queue_terminal_live_counts", md,
        Column("ready_slot", INT, nullable=False),
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("enqueue_shard", SMALLINT, nullable=False),
        Column("counter_bucket", SMALLINT, nullable=False),
        Column("live_terminal_count", BIGINT, nullable=False, server_default=text("0")),
        PrimaryKeyConstraint("ready_slot", "queue", "priority", "enqueue_shard", "counter_bucket",
                             name="queue_terminal_live_counts_pkey"),
        Index("queue_terminal_live_counts_queue_idx", "queue", "priority"),
        schema=cfg.schema, postgresql_with={"fillfactor": 50},
    )
    rollups = Table(
        "queue_terminal_rollups", md,
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("pruned_completed_count", BIGINT, nullable=False, server_default=text("0")),
        PrimaryKeyConstraint("queue", "priority", name="queue_terminal_rollups_pkey"),
        schema=cfg.schema,
    )
    ledger = Table(
        "queue_terminal_rollup_ledger", md,
        Column("queue", TEXT, nullable=False),
        Column("priority", SMALLINT, nullable=False),
        Column("pruned_count", BIGINT, nullable=False),
        Column("recorded_at", TS, nullable=False, server_default=NOW),
        CheckConstraint("pruned_count <> 0", name="queue_terminal_rollup_ledger_nonzero"),
        Index("queue_terminal_rollup_ledger_queue_idx", "queue", "priority"),
        schema=cfg.schema,
    )
    state = Table(
        "counter_state", md,
        Column("singleton", Boolean, nullable=False, server_default=text("true")),
        Column("terminal_counter_trusted_at", TS),
        PrimaryKeyConstraint("singleton", name="counter_state_pkey"),
        CheckConstraint("singleton", name="counter_state_singleton"),
        schema=cfg.schema,
    )
    return live, rollups, ledger, state


def declare_queue_meta(md: MetaData, cfg: QueueStorageConfig) -> Table:
    """Per logical queue: pause gate, enqueue shard count and DLQ policy."""
    cols: list[Column[Any]] = [
        Column("queue", TEXT, nullable=False),
        Column("paused", Boolean, nullable=False, server_default=text("false")),
        Column("paused_at", TS),
        Column("paused_by", TEXT),
        Column("enqueue_shards", SMALLINT, nullable=False, server_default=text("8")),
        Column("dlq_enabled", Boolean, nullable=False, server_default=text("false")),
    ]
    return Table(
        "queue_meta", md, *cols,
        PrimaryKeyConstraint("queue", name="queue_meta_pkey"),
        CheckConstraint("enqueue_shards BETWEEN 1 AND 64", name="queue_meta_enqueue_shards"),
        schema=cfg.schema,
    )


#: The trigger that gives an updated ``job_unique_claims`` row a new ``claim_id``.
UNIQUE_CLAIM_TRIGGER = "job_unique_claims_renew"


def declare_unique_claims(md: MetaData, cfg: QueueStorageConfig) -> tuple[Sequence, Table, Table]:
    """Unique-key ownership: ``job_unique_claims`` (one row per key: the job that took it and
    the claim's number, ``claim_id``) and the append-only ``job_unique_releases`` (one row
    per released claim, by ``claim_id``).

    A key is owned by its claim row's job unless a release row names the row's
    ``claim_id``; a released key is taken over in place (``ON CONFLICT … DO UPDATE``), and
    every update of a claim row gives it a new ``claim_id`` (a ``BEFORE UPDATE`` trigger,
    ``unique_claim_renew``), so a release never outlives the claim it released. Releasing
    deletes nothing: the maintainer deletes released claims and their release rows while
    the MVCC horizon is not pinned."""
    seq = Sequence("job_unique_claim_seq", schema=cfg.schema, metadata=md, start=1)
    claims = Table(
        "job_unique_claims", md,
        Column("unique_key", BYTES, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("claim_id", BIGINT, nullable=False,
               server_default=text(f"nextval('{cfg.schema}.job_unique_claim_seq'::regclass)")),
        UniqueConstraint("unique_key", name="job_unique_claims_unique_key_key"),
        Index("job_unique_claims_job_idx", "job_id"),
        schema=cfg.schema,
    )
    releases = Table(
        "job_unique_releases", md,
        Column("claim_id", BIGINT, nullable=False, autoincrement=False),
        Column("unique_key", BYTES, nullable=False),
        Column("job_id", BIGINT, nullable=False),
        Column("released_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("claim_id", name="job_unique_releases_pkey"),
        schema=cfg.schema,
    )
    return seq, claims, releases


def unique_claim_trigger(cfg: QueueStorageConfig) -> str:
    """``CREATE TRIGGER`` of :data:`UNIQUE_CLAIM_TRIGGER` (after the function exists)."""
    s = cfg.schema
    return (f"CREATE TRIGGER {UNIQUE_CLAIM_TRIGGER} BEFORE UPDATE ON {s}.job_unique_claims "
            f"FOR EACH ROW EXECUTE FUNCTION {s}.unique_claim_renew()")


def declare_claimers(md: MetaData, cfg: QueueStorageConfig) -> tuple[Table, Table]:
    leases = Table(
        "queue_claimer_leases", md,
        Column("queue", TEXT, nullable=False),
        Column("claimer_slot", SMALLINT, nullable=False),
        Column("owner_instance_id", UUIDT, nullable=False),
        Column("lease_epoch", BIGINT, nullable=False, server_default=text("0")),
        Column("leased_at", TS, nullable=False, server_default=NOW),
        Column("last_claimed_at", TS, nullable=False, server_default=NOW),
        Column("expires_at", TS, nullable=False),
        PrimaryKeyConstraint("queue", "claimer_slot", name="queue_claimer_leases_pkey"),
        Index("queue_claimer_leases_owner_idx", "queue", "owner_instance_id"),
        schema=cfg.schema, postgresql_with=warm(50),
    )
    state = Table(
        "queue_claimer_state", md,
        Column("queue", TEXT, nullable=False),
        Column("target_claimers", SMALLINT, nullable=False),
        Column("updated_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("queue", name="queue_claimer_state_pkey"),
        schema=cfg.schema, postgresql_with=warm(50),
    )
    return leases, state


def declare_install_tables(md: MetaData, cfg: QueueStorageConfig) -> tuple[Table, Table, Table]:
    """Recorded configuration, backend registry row and the transition singleton."""
    storage_config = Table(
        "storage_config", md,
        Column("singleton", Boolean, nullable=False, server_default=text("true")),
        Column("schema_name", TEXT, nullable=False),
        Column("queue_slot_count", INT, nullable=False),
        Column("lease_slot_count", INT, nullable=False),
        Column("claim_slot_count", INT, nullable=False),
        Column("queue_stripe_count", INT, nullable=False),
        Column("lease_claim_receipts", Boolean, nullable=False),
        Column("installed_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("singleton", name="storage_config_pkey"),
        CheckConstraint("singleton", name="storage_config_singleton"),
        schema=cfg.schema,
    )
    backends = Table(
        "runtime_storage_backends", md,
        Column("backend", TEXT, nullable=False),
        Column("schema_name", TEXT, nullable=False),
        Column("updated_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("backend", name="runtime_storage_backends_pkey"),
        schema=cfg.schema,
    )
    transition = Table(
        "storage_transition_state", md,
        Column("singleton", Boolean, nullable=False, server_default=text("true")),
        Column("current_engine", TEXT, nullable=False, server_default=text("'queue_storage'")),
        Column("prepared_engine", TEXT),
        Column("state", TEXT, nullable=False, server_default=text("'prepared'")),
        Column("transition_epoch", BIGINT, nullable=False, server_default=text("0")),
        Column("details", JSON, nullable=False, server_default=text("'{}'::jsonb")),
        Column("updated_at", TS, nullable=False, server_default=NOW),
        PrimaryKeyConstraint("singleton", name="storage_transition_state_pkey"),
        CheckConstraint("singleton", name="storage_transition_state_singleton"),
        CheckConstraint("state IN ('canonical', 'prepared', 'mixed_transition', 'active')",
                        name="storage_transition_state_state"),
        schema=cfg.schema,
    )
    return storage_config, backends, transition
