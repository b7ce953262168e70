"""Each plane the only writer of its tables, checked: a static reading of every module of
the package (``tests/planecheck.py``) finds each statement that writes a table and fails
when it is built outside the module of the table's plane (:mod:`qstore.storage.planes`), or
when it names its table too indirectly to tell."""

from __future__ import annotations

import textwrap

import pytest
from planecheck import SCH, package_sources, violations, writes

from qstore.storage.planes import MODULES, Plane, ownership, writer


def test_every_statement_that_writes_a_table_is_built_in_the_tables_plane() -> None:
    found = violations(package_sources())
    assert not found, "writes built outside their plane:\n" + "\n".join(found)


def test_the_check_sees_the_writes_of_every_plane() -> None:
    built = {w.module for w in writes(package_sources()) if w.targets}
    assert set(MODULES.values()) <= built


def test_every_declared_table_has_one_plane() -> None:
    owners = ownership(SCH)
    assert set(owners) == set(SCH.metadata.tables)
    assert {owners[t.key] for t in (SCH.deferred, SCH.ready.children[0])} == {Plane.QUEUE}
    assert owners[SCH.attempt_state.key] is Plane.EXECUTION
    assert owners[SCH.live_counts.key] is Plane.CONTROL


def test_truncating_a_ring_slot_and_moving_a_cursor_are_the_ring_planes() -> None:
    assert writer(SCH, SCH.done.children[1], truncate=True) is Plane.RINGS
    assert writer(SCH, SCH.deltas.parent, truncate=True) is Plane.RINGS
    assert writer(SCH, SCH.done.children[1]) is Plane.QUEUE
    assert writer(SCH, SCH.live_counts, truncate=True) is Plane.CONTROL
    assert writer(SCH, SCH.queue_ring.generation) is Plane.RINGS
    assert writer(SCH, SCH.job_id_seq) is None


def test_heartbeat_rows_are_the_execution_planes_and_their_slots_the_ring_planes() -> None:
    assert writer(SCH, SCH.progress.children[0]) is Plane.EXECUTION
    assert writer(SCH, SCH.progress.parent, truncate=True) is Plane.RINGS
    assert writer(SCH, SCH.progress_seq) is None  # it only numbers the rows


def test_an_append_of_a_heartbeat_row_outside_the_execution_plane_is_found() -> None:
    found = _check(UPKEEP, """
        from sqlalchemy.dialects.postgresql import insert
        def beat(sch: StorageSchema):
            return insert(sch.progress.parent).values(job_id=1)
        """)
    assert any("attempt_progress" in f and "execution plane" in f for f in found), found


def _check(module: str, source: str) -> list[str]:
    return violations({module: textwrap.dedent(source)})


QUEUE, CONTROL, UPKEEP = MODULES[Plane.QUEUE], MODULES[Plane.CONTROL], "qstore.storage.upkeep.rescue"


@pytest.mark.parametrize(("module", "source", "expected"), [
    pytest.param(UPKEEP, """
        from sqlalchemy import delete
        def take(sch: StorageSchema):
            c, d = sch.claims.parent, sch.deferred
            return delete(d)
        """, "DELETE of deferred_jobs is the queue plane's write", id="outside-any-plane"),
    pytest.param(CONTROL, """
        from sqlalchemy import insert
        def statements(ctx: StorageContext):
            r, t, *_ = ctx.schema.queue_ring.children(3)
            return insert(t)
        """, "INSERT of ready_tombstones (slot children) is the queue plane's write", id="another-planes-table"),
    pytest.param(QUEUE, """
        def drop(sch: StorageSchema):
            d = sch.dlq
            return [x.delete() for x in (sch.claimer_state,)], d.delete()
        """, "DELETE of queue_claimer_state is the control plane's write", id="method-form-in-comprehension"),
    pytest.param(UPKEEP, """
        from sqlalchemy import text
        def wipe(conn, sch: StorageSchema):
            conn.execute(text(f"TRUNCATE {sch.deferred.name}"))
        """, "TRUNCATE of deferred_jobs is the queue plane's write", id="text"),
    pytest.param(QUEUE, """
        from sqlalchemy import text
        def _truncate(conn, tables):
            conn.execute(text(f"TRUNCATE {', '.join(t.name for t in tables)}"))
        def prune(conn, ring: Ring, k):
            _truncate(conn, [t for t, n in zip(ring.children(k), range(9)) if n])
        """, "TRUNCATE of ready_entries (slot children) is the rings plane's write", id="truncate-helper"),
    pytest.param(UPKEEP, """
        from sqlalchemy import func, select
        def turn(ring: Ring):
            return select(func.setval(regclass(ring.generation), 1))
        """, "setval of queue_ring_generation is the rings plane's write", id="setval"),
    pytest.param(UPKEEP, """
        def load(conn, sch: StorageSchema):
            target = f"{sch.config.schema}.{sch.dlq.name}"
            conn.connection.driver_connection.cursor().copy(f"COPY {target} (job_id) FROM STDIN")
        """, "COPY of dlq_entries is the queue plane's write", id="copy"),
    pytest.param(QUEUE, """
        from sqlalchemy import insert
        def build(sch: StorageSchema, which):
            return insert(which(sch))
        """, "cannot tell which table this INSERT writes", id="unresolved"),
])
def test_the_check_names_a_write_built_outside_its_plane(module: str, source: str, expected: str) -> None:
    found = _check(module, source)
    assert any(expected in line for line in found), found


def test_the_check_accepts_a_write_in_its_own_plane() -> None:
    assert _check(QUEUE, """
        from sqlalchemy import delete, insert
        def statements(sch: StorageSchema):
            df, q = sch.deferred, sch.dlq
            on = lambda t: t.c.job_id == 1
            return delete(df).where(on(df)), insert(q), sch.done.parent.delete()
        """) == []
