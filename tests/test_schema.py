"""The substrate declared in metadata, and what ``create_all`` makes of it in PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import CreateTable

from qstore import QueueStorageConfig, build_metadata
from qstore.schema import is_partition_child, storage_schema

SHAPE = {"schema": "shape_test", "queue_slot_count": 5, "lease_slot_count": 3, "claim_slot_count": 2}
QUEUE_RING = ("ready_entries", "ready_tombstones", "ready_claim_ranges", "done_entries",
              "queue_terminal_count_deltas")
CORE_FUNCTIONS = {"claim_ready", "reserve_lanes", "ensure_lane", "backoff_duration"}


def _ddl(table) -> str:
    return str(CreateTable(table).compile(dialect=postgresql.dialect()))


@pytest.fixture(scope="module")
def shaped():
    return build_metadata(QueueStorageConfig(**SHAPE))


def _tables(md) -> set[str]:
    return {t.name for t in md.tables.values()}


@pytest.mark.parametrize("parent", QUEUE_RING)
def test_queue_ring_family_has_one_child_per_queue_slot(shaped, parent):
    names = _tables(shaped)
    assert parent in names
    assert {n for n in names if n.rsplit("_", 1)[0] == parent and n.rsplit("_", 1)[1].isdigit()} \
        == {f"{parent}_{k}" for k in range(5)}


def test_lease_ring_has_one_child_per_lease_slot(shaped):
    names = _tables(shaped)
    assert {"leases", "leases_0", "leases_1", "leases_2"} <= names
    assert "leases_3" not in names


@pytest.mark.parametrize("parent", ["lease_claims", "lease_claim_closures", "lease_claim_closure_batches"])
def test_claim_ring_families_have_one_child_per_claim_slot(shaped, parent):
    names = _tables(shaped)
    assert {parent, f"{parent}_0", f"{parent}_1"} <= names
    assert f"{parent}_2" not in names


def test_unpartitioned_tables_are_declared(shaped):
    expected = {
        "deferred_jobs", "dlq_entries", "attempt_state", "queue_lanes", "queue_enqueue_heads",
        "queue_claim_heads", "queue_terminal_live_counts", "queue_terminal_rollups",
        "queue_terminal_rollup_ledger", "counter_state",
        "queue_meta", "job_unique_claims", "queue_claimer_leases", "queue_claimer_state",
        "storage_config", "runtime_storage_backends", "storage_transition_state",
    }
    assert expected <= _tables(shaped)


def test_every_table_lives_in_the_configured_schema(shaped):
    assert {t.schema for t in shaped.tables.values()} == {"shape_test"}


def test_children_are_marked_as_partitions_and_parents_are_not(shaped):
    tables = {t.name: t for t in shaped.tables.values()}
    assert is_partition_child(tables["ready_entries_4"])
    assert not is_partition_child(tables["ready_entries"])
    assert not is_partition_child(tables["deferred_jobs"])


def test_child_ddl_renders_partition_of_parent_for_its_slot(shaped):
    child = shaped.tables["shape_test.ready_entries_3"]
    ddl = _ddl(child)
    assert "CREATE TABLE shape_test.ready_entries_3 PARTITION OF shape_test.ready_entries" in ddl
    assert "FOR VALUES IN (3)" in ddl


def test_parent_ddl_is_list_partitioned_by_slot_column(shaped):
    assert "PARTITION BY LIST (ready_slot)" in _ddl(shaped.tables["shape_test.ready_entries"])
    assert "PARTITION BY LIST (lease_slot)" in _ddl(shaped.tables["shape_test.leases"])
    assert "PARTITION BY LIST (claim_slot)" in _ddl(shaped.tables["shape_test.lease_claims"])


def test_lease_children_carry_fillfactor_and_autovacuum_parameters(shaped):
    ddl = _ddl(shaped.tables["shape_test.leases_1"])
    assert "FOR VALUES IN (1)" in ddl
    assert "fillfactor = 50" in ddl
    assert "autovacuum_vacuum_scale_factor = 0" in ddl


def test_ring_cursors_are_generation_sequences_not_tables(shaped):
    assert {f"shape_test.{r}_ring_generation" for r in ("queue", "lease", "claim")} <= {
        f"{s.schema}.{s.name}" for s in shaped._sequences.values()}
    assert not {"queue_ring_state", "queue_ring_slots", "lease_ring_slots"} & _tables(shaped)


def test_storage_schema_bundle_exposes_ring_families_with_configured_counts():
    sch = storage_schema(QueueStorageConfig(**SHAPE))
    assert len(sch.ready.children) == 5
    assert sch.ready.child(2).name == "ready_entries_2"
    assert len(sch.leases.children) == 3
    assert len(sch.claims.children) == len(sch.closures.children) == 2
    assert [(r.name, r.slot_count) for r in sch.rings] == [("queue", 5), ("lease", 3), ("claim", 2)]
    # heartbeat and progress rows go with the ring that holds the attempts
    assert [f.name for f in sch.claim_ring.families] == ["lease_claims", "lease_claim_closures",
                                                         "lease_claim_closure_batches", "attempt_progress"]
    assert [f.name for f in sch.lease_ring.families] == ["leases"]
    assert len(sch.progress.children) == 2


def test_without_receipts_progress_rows_go_with_the_lease_ring():
    sch = storage_schema(QueueStorageConfig(**{**SHAPE, "lease_claim_receipts": False}))
    assert [f.name for f in sch.lease_ring.families] == ["leases", "attempt_progress"]
    assert [f.name for f in sch.claim_ring.families] == ["lease_claims", "lease_claim_closures",
                                                         "lease_claim_closure_batches"]
    assert len(sch.progress.children) == 3


def test_functions_and_view_are_declared_for_the_schema():
    sch = storage_schema(QueueStorageConfig(**SHAPE))
    assert {f.name for f in sch.functions} >= CORE_FUNCTIONS
    assert {v.name for v in sch.views} == {"terminal_jobs", "queue_ring_state", "lease_ring_state",
                                           "claim_ring_state"}
    assert all(f.schema == "shape_test" for f in sch.functions)


# -- against PostgreSQL -------------------------------------------------------------------


def _partitions(conn, schema: str, parent: str) -> dict[str, str]:
    rows = conn.execute(text("""
        SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) AS bound, c.relispartition
        FROM pg_inherits i
        JOIN pg_class c ON c.oid = i.inhrelid
        JOIN pg_class p ON p.oid = i.inhparent
        JOIN pg_namespace n ON n.oid = p.relnamespace
        WHERE n.nspname = :s AND p.relname = :p"""), {"s": schema, "p": parent}).all()
    assert all(r.relispartition for r in rows)
    return {r.relname: r.bound for r in rows}


def test_create_all_makes_real_partitions_with_slot_bounds(make_storage, engine):
    s = make_storage(queue_slot_count=5, lease_slot_count=3, claim_slot_count=2)
    with engine.connect() as conn:
        assert _partitions(conn, s.schema(), "ready_entries") == {
            f"ready_entries_{k}": f"FOR VALUES IN ({k})" for k in range(5)}
        assert _partitions(conn, s.schema(), "leases") == {
            f"leases_{k}": f"FOR VALUES IN ({k})" for k in range(3)}
        assert _partitions(conn, s.schema(), "lease_claim_closures") == {
            f"lease_claim_closures_{k}": f"FOR VALUES IN ({k})" for k in range(2)}


def test_create_all_makes_partitioned_parents(storage, engine):
    with engine.connect() as conn:
        kinds = dict(conn.execute(text("""
            SELECT c.relname, c.relkind FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE n.nspname = :s AND c.relname IN ('ready_entries', 'leases', 'lease_claims',
                                                   'deferred_jobs')"""),
            {"s": storage.schema()}).all())
    assert kinds == {"ready_entries": "p", "leases": "p", "lease_claims": "p", "deferred_jobs": "r"}


def test_create_all_applies_storage_parameters_to_lease_children(storage, engine):
    with engine.connect() as conn:
        opts = conn.execute(text(
            "SELECT c.reloptions FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :s AND c.relname = 'leases_0'"), {"s": storage.schema()}).scalar()
    assert "fillfactor=50" in opts


def test_create_all_creates_the_functions(storage, engine):
    with engine.connect() as conn:
        names = set(conn.execute(text(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = :s"), {"s": storage.schema()}).scalars())
    assert names == {f.name for f in storage.tables.functions}
    assert names >= CORE_FUNCTIONS


def test_create_all_creates_the_terminal_jobs_view(storage, engine):
    with engine.connect() as conn:
        count = conn.execute(text(f"SELECT count(*) FROM {storage.schema()}.terminal_jobs")).scalar()
    assert count == 0


def test_backoff_duration_is_callable_and_bounded(storage, engine):
    with engine.connect() as conn:
        secs = conn.execute(text(
            f"SELECT extract(epoch FROM {storage.schema()}.backoff_duration(3, 25))")).scalar()
    assert 8 <= secs <= 10


@pytest.mark.parametrize(("ring", "count_field"), [
    ("queue", "queue_slot_count"), ("lease", "lease_slot_count"), ("claim", "claim_slot_count")])
def test_ring_state_is_seeded_at_slot_zero_generation_zero(make_storage, engine, ring, count_field):
    s = make_storage(queue_slot_count=6, lease_slot_count=3, claim_slot_count=4)
    with engine.connect() as conn:
        state = conn.execute(text(
            f"SELECT current_slot, generation, slot_count FROM {s.schema()}.{ring}_ring_state"
        )).all()
    assert [tuple(r) for r in state] == [(0, 0, getattr(s.config, count_field))]


def test_fresh_install_records_its_config_and_marks_counters_trusted(make_storage, engine):
    s = make_storage(queue_slot_count=6)
    with engine.connect() as conn:
        row = conn.execute(text(
            f"SELECT schema_name, queue_slot_count, lease_slot_count, claim_slot_count, "
            f"queue_stripe_count, lease_claim_receipts FROM {s.schema()}.storage_config")).one()
        trusted = conn.execute(text(
            f"SELECT terminal_counter_trusted_at FROM {s.schema()}.counter_state")).scalar()
    assert tuple(row) == (s.schema(), 6, 8, 8, 1, True)
    assert trusted is not None


def test_reserve_lanes_creates_lane_sequences_and_returns_start_positions(storage, engine):
    sch = storage.schema()
    with engine.begin() as conn:
        first = conn.execute(text(
            f"SELECT {sch}.reserve_lanes(ARRAY['q'], ARRAY['q'], ARRAY[2]::smallint[], "
            "ARRAY[0]::smallint[], ARRAY[3])")).scalar()
        second = conn.execute(text(
            f"SELECT {sch}.reserve_lanes(ARRAY['q'], ARRAY['q'], ARRAY[2]::smallint[], "
            "ARRAY[0]::smallint[], ARRAY[1])")).scalar()
        seqs = conn.execute(text(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = :s AND c.relkind = 'S' AND c.relname LIKE 'queue\\_%\\_seq\\_%'"),
            {"s": sch}).scalar()
    assert (first, second) == ([1], [4])
    assert seqs == 2
