"""The only place a qstore table, index, sequence, function or view is named.

:func:`build_metadata` declares the whole substrate of one install for a
:class:`~qstore.config.QueueStorageConfig`; :func:`storage_schema` returns the same
declaration as a typed bundle the storage operations build their statements from.
``metadata.create_all`` alone produces a working install (seed rows, functions and views are
attached as DDL events); Alembic revisions build from the same declaration.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Connection,
    MetaData,
    Sequence,
    Table,
    TableClause,
    event,
    func,
    insert,
    literal,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import REGCLASS

from qstore.config import QueueStorageConfig
from qstore.schema import control_plane, execution_plane, queue_plane
from qstore.schema.functions import (
    ServerFunction,
    ServerView,
    declare_functions,
    declare_views,
    execute_ddl,
)
from qstore.schema.rings import RingFamily, is_partition_child
from qstore.schema.types import job_state_enum

__all__ = [
    "Ring",
    "RingFamily",
    "StorageSchema",
    "build_metadata",
    "is_partition_child",
    "seed_rows",
    "storage_schema",
]

SEED_KEY = "qstore_seed"


@dataclass(frozen=True)
class Ring:
    """One ring: its cursor (a generation sequence read through the ``<ring>_ring_state``
    view; the current slot is ``generation % slot_count``) and the partitioned families
    whose slot children it rotates and reclaims together."""

    name: str
    generation: Sequence
    state: TableClause
    families: tuple[RingFamily, ...]

    @property
    def slot_count(self) -> int:
        return len(self.families[0].children)

    def children(self, slot: int) -> list[Table]:
        """The slot's child of every family (what one prune truncates)."""
        return [f.children[slot] for f in self.families]


@dataclass(frozen=True, eq=False)
class StorageSchema:
    """Every declared object of one install, by role."""

    config: QueueStorageConfig
    metadata: MetaData
    ready: RingFamily
    tombstones: RingFamily
    claim_ranges: RingFamily
    done: RingFamily
    deltas: RingFamily
    #: completed attempts of the completion fast path, one row per call, claim slot, lane and
    #: block that holds two or more of them
    done_batches: RingFamily
    leases: RingFamily
    claims: RingFamily
    closures: RingFamily
    #: closures of attempts completed on the fast path, one row per call, claim slot and
    #: block of job ids
    closure_batches: RingFamily
    deferred: Table
    wheel: RingFamily
    wheel_marks: RingFamily
    dlq: Table
    attempt_state: Table
    #: Append-only heartbeats and progress, in the ring that holds the live attempts (the
    #: claim ring with receipts, the lease ring without; ``progress_ring`` names it).
    progress: RingFamily
    progress_seq: Sequence
    queue_ring: Ring
    lease_ring: Ring
    claim_ring: Ring
    lanes: Table
    enqueue_heads: Table
    claim_heads: Table
    live_counts: Table
    rollups: Table
    rollup_ledger: Table
    counter_state: Table
    queue_meta: Table
    unique_claims: Table
    #: Append-only releases of unique claims (a key is free once its claim is released).
    unique_releases: Table
    unique_claim_seq: Sequence  # claim_id of job_unique_claims: a new one per write of a row
    claimer_leases: Table
    claimer_state: Table
    storage_config: Table
    backends: Table
    transition: Table
    job_id_seq: Sequence
    lane_rotor: Sequence  # one nextval per enqueue call: its key-less rows' lane
    wheel_entry_seq: Sequence  # entry ids of the deferred wheel
    functions: tuple[ServerFunction, ...]
    views: tuple[ServerView, ...]
    #: The tables each plane module of the declaration declared (ring children included),
    #: by plane: ``"queue"`` (:mod:`~qstore.schema.queue_plane`), ``"execution"``
    #: (:mod:`~qstore.schema.execution_plane`), ``"control"``
    #: (:mod:`~qstore.schema.control_plane`). Read by the storage's ownership map
    #: (:mod:`qstore.storage.planes`).
    declared_by: Mapping[str, tuple[Table, ...]]

    @property
    def rings(self) -> tuple[Ring, Ring, Ring]:
        """The queue, lease and claim rings, in that order."""
        return (self.queue_ring, self.lease_ring, self.claim_ring)


def _build(config: QueueStorageConfig) -> StorageSchema:
    s = config.schema
    md = MetaData(schema=s)
    state = job_state_enum(s)
    job_id_seq = Sequence("job_id_seq", schema=s, metadata=md, start=1)
    lane_rotor = Sequence("lane_rotor", schema=s, metadata=md, start=0, minvalue=0)

    declared: dict[str, tuple[Table, ...]] = {}

    def record(plane: str) -> None:
        """Every table declared since the last record is ``plane``'s."""
        seen = {t.key for ts in declared.values() for t in ts}
        declared[plane] = tuple(t for key, t in md.tables.items() if key not in seen)

    ready = queue_plane.declare_ready_entries(md, config)
    tombstones = queue_plane.declare_ready_tombstones(md, config)
    claim_ranges = queue_plane.declare_claim_ranges(md, config)
    done = queue_plane.declare_done_entries(md, config, state)
    deltas = queue_plane.declare_terminal_deltas(md, config)
    done_batches = queue_plane.declare_done_batches(md, config)
    deferred = queue_plane.declare_deferred_jobs(md, config, state)
    wheel_entry_seq, wheel, wheel_marks = queue_plane.declare_deferred_wheel(md, config, state)
    dlq = queue_plane.declare_dlq_entries(md, config, state)
    record("queue")
    leases = execution_plane.declare_leases(md, config, state)
    claims = execution_plane.declare_lease_claims(md, config)
    closures = execution_plane.declare_lease_claim_closures(md, config)
    closure_batches = execution_plane.declare_lease_claim_closure_batches(md, config)
    attempt_state = execution_plane.declare_attempt_state(md, config)
    progress, progress_seq = execution_plane.declare_attempt_progress(md, config)
    record("execution")
    cursors = {r: control_plane.declare_ring_cursor(md, config, r) for r in ("queue", "lease", "claim")}
    families: dict[str, tuple[RingFamily, ...]] = {
        "queue": (ready, tombstones, claim_ranges, done, deltas, done_batches), "lease": (leases,),
        "claim": (claims, closures, closure_batches)}
    families[execution_plane.progress_ring(config)] += (progress,)
    rings = {r: Ring(r, cursors[r][0], cursors[r][1], families[r]) for r in families}
    lanes, enqueue_heads, claim_heads = control_plane.declare_lanes(md, config)
    live_counts, rollups, rollup_ledger, counter_state = control_plane.declare_counters(md, config)
    queue_meta = control_plane.declare_queue_meta(md, config)
    unique_claim_seq, unique_claims, unique_releases = control_plane.declare_unique_claims(md, config)
    claimer_leases, claimer_state = control_plane.declare_claimers(md, config)
    storage_config, backends, transition = control_plane.declare_install_tables(md, config)
    record("control")

    functions = declare_functions(config)
    views = declare_views(config)
    sch = StorageSchema(
        config=config, metadata=md, ready=ready, tombstones=tombstones,
        claim_ranges=claim_ranges, done=done, deltas=deltas, done_batches=done_batches, leases=leases,
        claims=claims,
        closures=closures, closure_batches=closure_batches, deferred=deferred, wheel=wheel, wheel_marks=wheel_marks, dlq=dlq,
        attempt_state=attempt_state, progress=progress, progress_seq=progress_seq,
        queue_ring=rings["queue"], lease_ring=rings["lease"], claim_ring=rings["claim"],
        lanes=lanes, enqueue_heads=enqueue_heads, claim_heads=claim_heads,
        live_counts=live_counts, rollups=rollups, rollup_ledger=rollup_ledger,
        counter_state=counter_state, queue_meta=queue_meta,
        unique_claims=unique_claims, unique_releases=unique_releases, unique_claim_seq=unique_claim_seq,
        claimer_leases=claimer_leases,
        claimer_state=claimer_state, storage_config=storage_config, backends=backends,
        transition=transition, job_id_seq=job_id_seq, lane_rotor=lane_rotor,
        wheel_entry_seq=wheel_entry_seq, functions=functions, views=views,
        declared_by=declared,
    )
    md.info["qstore_schema"] = sch
    _attach_ddl_events(sch)
    return sch


def _attach_ddl_events(sch: StorageSchema) -> None:
    """create_all: seed rows after the tables, functions, the unique-claim trigger and views
    after everything; drop_all: views, the trigger, functions and runtime lane sequences
    first."""

    def after_create(target: MetaData, connection: Connection, **_: Any) -> None:
        seed_rows(connection, sch)
        for fn in sch.functions:
            execute_ddl(connection, fn.create_sql())
        execute_ddl(connection, control_plane.unique_claim_trigger(sch.config))
        for view in sch.views:
            execute_ddl(connection, view.create_sql())

    def before_drop(target: MetaData, connection: Connection, **_: Any) -> None:
        drop_runtime_objects(connection, sch)

    event.listen(sch.metadata, "after_create", after_create)
    event.listen(sch.metadata, "before_drop", before_drop)


def seed_rows(connection: Connection, sch: StorageSchema) -> None:
    """Put every ring at slot 0, generation 0, record the install's configuration, mark the
    counters trusted (``done_entries`` is empty by construction) and insert the transition
    singleton: the rows a fresh install starts with."""
    cfg = sch.config
    for ring in sch.rings:
        connection.execute(select(func.setval(literal(_regclass(ring.generation), REGCLASS()), 0, True)))
    connection.execute(insert(sch.counter_state).values(
        terminal_counter_trusted_at=text("clock_timestamp()")))
    connection.execute(
        insert(sch.storage_config).values(
            schema_name=cfg.schema,
            queue_slot_count=cfg.queue_slot_count,
            lease_slot_count=cfg.lease_slot_count,
            claim_slot_count=cfg.claim_slot_count,
            queue_stripe_count=cfg.queue_stripe_count,
            lease_claim_receipts=cfg.lease_claim_receipts,
        )
    )
    connection.execute(insert(sch.transition).values())


def _regclass(seq: Sequence) -> str:
    return f"{seq.schema}.{seq.name}"


def drop_runtime_objects(connection: Connection, sch: StorageSchema) -> None:
    """Drop what is not a table: views, the unique-claim trigger, functions and the per-lane
    sequences created at runtime by ``ensure_lane`` (named ``queue_{enqueue,claim}_seq_<md5>``)."""
    for view in sch.views:
        connection.execute(text(view.drop_sql()))
    prep = connection.dialect.identifier_preparer
    connection.execute(text(f"DROP TRIGGER IF EXISTS {control_plane.UNIQUE_CLAIM_TRIGGER} "
                            f"ON {prep.quote_schema(sch.config.schema)}.job_unique_claims"))
    for fn in sch.functions:
        connection.execute(text(fn.drop_sql()))
    lane_seqs = connection.execute(
        text(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :schema AND c.relkind = 'S' "
            "AND (c.relname LIKE 'queue\\_enqueue\\_seq\\_%' OR c.relname LIKE 'queue\\_claim\\_seq\\_%')"
        ),
        {"schema": sch.config.schema},
    ).scalars()
    for name in list(lane_seqs):
        connection.execute(
            text(f"DROP SEQUENCE IF EXISTS {prep.quote_schema(sch.config.schema)}.{prep.quote(name)}")
        )


@functools.lru_cache(maxsize=64)
def storage_schema(config: QueueStorageConfig) -> StorageSchema:
    """The (cached) declaration of ``config``'s install at the head revision."""
    return _build(config)


def build_metadata(config: QueueStorageConfig) -> MetaData:
    """A fresh ``MetaData`` declaring every object of ``config``'s install.

    Parent tables, their derived slot children (``PARTITION OF … FOR VALUES IN (k)``),
    unpartitioned tables, the ``job_state`` enum and ``job_id_seq`` are metadata objects;
    functions and views are listed in ``metadata.info['qstore_schema']`` and created by
    ``create_all`` through DDL events. The declaration is the shape of the head revision;
    past revisions live, frozen, in :mod:`qstore.migrations.frozen`.
    """
    return _build(config).metadata
