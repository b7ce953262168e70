"""A caller's transaction that is rolled back leaves nothing behind: no row, no sequence
move that a later call could see (the claim cursor hint moves over committed claims only;
lane positions and job ids leave gaps), no setting, lock or LISTEN on the connection, no
notification, and no process cache holding a value only the rolled-back transaction could
see. Operations whose effect a rollback could not undo (the ring rotations, VACUUM)
refuse a caller's transaction before they send anything.

The last section runs every operation of the API (tests/operation_cases.py) that way."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
from jobtools import params
from operation_cases import CASES, missing_case_names
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from qstore import CallerTransactionRefusedError, QueueStorage, ValidationError
from qstore.aio import AsyncQueueStorage
from qstore.types import JobState

Scope = Callable[[Engine], AbstractContextManager[object]]


@contextmanager
def connection_rolled_back(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn, conn.begin() as tx:
        yield conn
        tx.rollback()


@contextmanager
def session_rolled_back(engine: Engine) -> Iterator[Session]:
    with Session(engine) as session:
        yield session
        session.rollback()


@contextmanager
def savepoint_rolled_back(engine: Engine) -> Iterator[Connection]:
    with engine.connect() as conn, conn.begin() as outer:
        sp = conn.begin_nested()
        yield conn
        sp.rollback()
        outer.commit()


SCOPES: dict[str, Scope] = {"connection": connection_rolled_back, "session": session_rolled_back,
                            "savepoint": savepoint_rolled_back}


def claimed_ids(jobs: list) -> list[int]:
    return sorted(j.job.id for j in jobs)


@pytest.fixture(params=["receipts", "leases", "striped"])
def shaped(request, make_storage) -> QueueStorage:
    if request.param == "leases":
        return make_storage(lease_claim_receipts=False)
    if request.param == "striped":
        return make_storage(queue_stripe_count=2)
    return make_storage()


@pytest.mark.parametrize("scope", SCOPES)
def test_two_claims_in_a_rolled_back_transaction_strand_no_job(engine, shaped, scope):
    shaped.enqueue_params_batch(engine, [params(args={"n": i}) for i in (1, 2, 3)])
    with SCOPES[scope](engine) as target:
        first = shaped.claim_runtime_batch(target, "q", 1)
        second = shaped.claim_runtime_batch(target, "q", 1)
        assert len(first) == len(second) == 1
    again = shaped.claim_runtime_batch(engine, "q", 10)
    assert len(again) == 3
    assert shaped.queue_counts(engine, "q").available == 0


def test_claims_rolled_back_twice_in_a_row_strand_no_job(engine, st):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(4)])
    for _ in range(2):
        with connection_rolled_back(engine) as conn:
            for _ in range(3):
                st.claim_runtime_batch(conn, "q", 1)
    assert len(st.claim_runtime_batch(engine, "q", 10)) == 4


def test_a_claim_after_a_rolled_back_savepoint_moves_the_hint_over_committed_claims_only(engine, st):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(4)])
    kept = st.claim_runtime_batch(engine, "q", 1)  # committed
    with engine.connect() as conn, conn.begin() as tx:
        sp = conn.begin_nested()
        st.claim_runtime_batch(conn, "q", 1)
        sp.rollback()
        inner = st.claim_runtime_batch(conn, "q", 1)
        st.claim_runtime_batch(conn, "q", 1)
        tx.rollback()
    rest = st.claim_runtime_batch(engine, "q", 10)
    assert len(kept) == 1 and len(inner) == 1
    assert claimed_ids(rest) == sorted({2, 3, 4})


def test_async_connection_rolled_back_after_two_claims_strands_no_job(db_url, engine, st):
    st.enqueue_params_batch(engine, [params(args={"n": i}) for i in (1, 2)])
    ast = AsyncQueueStorage(st)

    async def main() -> None:
        aengine = create_async_engine(db_url)
        try:
            async with aengine.connect() as conn:
                trans = await conn.begin()
                await ast.claim_runtime_batch(conn, "q", 1)
                await ast.claim_runtime_batch(conn, "q", 1)
                await trans.rollback()
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert len(st.claim_runtime_batch(engine, "q", 10)) == 2


@pytest.mark.parametrize("path", ["enqueue_params_copy", "enqueue_params_batch"])
def test_enqueue_shard_count_read_in_a_rolled_back_transaction_is_not_cached(engine, st, path):
    with connection_rolled_back(engine) as conn:
        st.set_queue_options(conn, "q", enqueue_shards=1)
        getattr(st, path)(conn, [params(args={"n": 0})])
    for i in range(1, 9):  # eight separate enqueues: the default eight lanes, not the rolled-back one
        getattr(st, path)(engine, [params(args={"n": i})])
    with engine.connect() as c:
        shards = c.execute(text(
            f'SELECT DISTINCT enqueue_shard FROM "{st.schema()}".ready_entries')).scalars().all()
    assert sorted(shards) == list(range(8))


def test_enqueue_rolled_back_twice_then_committed_leaves_every_job_claimable(engine, st):
    for _ in range(2):
        with connection_rolled_back(engine) as conn:
            st.enqueue_params_batch(conn, [params(args={"n": i}, queue="fresh") for i in range(3)])
    st.enqueue_params_batch(engine, [params(args={"n": i}, queue="fresh") for i in range(3)])
    assert len(st.claim_runtime_batch(engine, "fresh", 10)) == 3


def test_claimer_slot_taken_in_a_rolled_back_transaction_stays_free(engine, st):
    import uuid

    me, other = uuid.uuid4(), uuid.uuid4()
    with connection_rolled_back(engine) as conn:
        assert st.acquire_queue_claimer(conn, "q", me, 1, 60, 60) is not None
    assert st.acquire_queue_claimer(engine, "q", other, 1, 60, 60) is not None


def ring_states(engine, st: QueueStorage) -> dict[str, tuple[int, int]]:
    """Each ring's (current slot, generation), read on a connection of its own."""
    with engine.connect() as c:
        return {ring: tuple(c.execute(text(
            f'SELECT current_slot, generation FROM "{st.schema()}".{ring}_ring_state')).one())
            for ring in ("queue", "lease", "claim")}


ROTATIONS = ["rotate", "rotate_leases", "rotate_claims"]
RING = {"rotate": "queue", "rotate_leases": "lease", "rotate_claims": "claim"}


def write_every_ring(engine, st: QueueStorage) -> None:
    """A ready row, a claim receipt and a lease in every ring's current slot, so each ring
    has something to rotate away from."""
    st.enqueue_params_batch(engine, [params(args={"n": 1})])
    claimed = st.claim_runtime_batch(engine, "q", 1)
    st.register_callback(engine, claimed[0].job.id, claimed[0].job.run_lease, 60)


@contextmanager
def statements_sent(engine: Engine) -> Iterator[list[str]]:
    """Every statement any connection of ``engine`` sends while the block runs."""
    sent: list[str] = []

    def listen(conn, cursor, statement, parameters, context, executemany) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", listen)
    try:
        yield sent
    finally:
        event.remove(engine, "before_cursor_execute", listen)


@pytest.mark.parametrize("operation", ROTATIONS)
def test_rotation_inside_a_rolled_back_transaction_leaves_a_usable_ring(engine, st, operation):
    """A rotation moves its ring's cursor, a sequence, which no rollback undoes: on a caller's
    transaction it is refused before anything reaches the database, so the ring stays where
    the committed state has it and the caller's transaction stays usable."""
    write_every_ring(engine, st)
    before = ring_states(engine, st)
    assert before == {"queue": (0, 0), "lease": (0, 0), "claim": (0, 0)}
    with statements_sent(engine) as sent, connection_rolled_back(engine) as conn:
        with pytest.raises(CallerTransactionRefusedError, match=f"{operation}.*Engine") as refused:
            getattr(st, operation)(conn)
        assert isinstance(refused.value, ValidationError)
        assert refused.value.operation == operation
        assert sent == []
        assert ring_states(engine, st) == before
        st.enqueue_params_batch(conn, [params(args={"n": 2})])  # the transaction is usable
    assert ring_states(engine, st) == before
    assert getattr(st, operation)(engine).kind == "rotated"  # an Engine rotates
    st.enqueue_params_batch(engine, [params(args={"n": 3})])
    jobs = st.claim_runtime_batch(engine, "q", 10)
    assert len(st.complete_runtime_batch(engine, jobs)) == 1
    assert {st.load_job(engine, j.job.id).state for j in jobs} == {JobState.COMPLETED}


@pytest.mark.parametrize("operation", ROTATIONS)
def test_rotation_is_refused_on_a_session_before_it_touches_the_database(engine, st, operation):
    write_every_ring(engine, st)
    with statements_sent(engine) as sent, Session(engine) as session:
        with pytest.raises(CallerTransactionRefusedError, match="pass an Engine"):
            getattr(st, operation)(session)
        assert sent == []
        assert not session.in_transaction()  # not even a connection was checked out
    assert ring_states(engine, st)[RING[operation]] == (0, 0)


@pytest.mark.parametrize("operation", ROTATIONS)
def test_rotation_is_refused_on_async_targets(db_url, engine, st, operation):
    write_every_ring(engine, st)
    ast = AsyncQueueStorage(st)

    async def main() -> None:
        aengine = create_async_engine(db_url)
        try:
            async with aengine.connect() as conn:
                trans = await conn.begin()
                with pytest.raises(CallerTransactionRefusedError):
                    await getattr(ast, operation)(conn)
                await trans.rollback()
            async with AsyncSession(aengine) as session:
                with pytest.raises(CallerTransactionRefusedError):
                    await getattr(ast, operation)(session)
            assert (await getattr(ast, operation)(aengine)).kind == "rotated"
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert ring_states(engine, st)[RING[operation]] == (1, 1)


# -- every operation, rolled back ---------------------------------------------------------------
#
# What a rollback may leave behind, and why each is harmless (see docs/design.md, "What a
# rollback leaves behind"):

#: Sequences that only hand out numbers: a rolled-back transaction keeps the numbers it
#: took. ``job_id_seq``: a gap in job ids, nothing refers to it. ``lane_rotor``: the next
#: enqueue starts on another lane. A lane's enqueue sequence (``queue_enqueue_seq_*``): a
#: position with no row, which claims skip as spent (the lane's reservation lock is held to
#: commit, so a later committed row proves the gap ended). ``attempt_progress_seq``: a gap
#: between the numbers of an attempt's progress rows, which only order them.
ALLOCATING = re.compile(r"^(job_id_seq|lane_rotor|attempt_progress_seq|deferred_wheel_entry_seq|queue_enqueue_seq_[0-9a-f]{32})$")
#: A lane's claim-cursor hint may move forward, but only over positions committed claim
#: ranges cover or that hold no row: where the next claim on committed state would move it
#: (checked by :func:`assert_hints_passed_only_spent_positions`).
HINT = re.compile(r"^queue_claim_seq_[0-9a-f]{32}$")
#: Process state besides the shard cache: the COPY path's lane rotor and the claim's stripe
#: probe are counters that pick a round-robin start (``itertools.count``), never compared.


def schema_exists(conn: Connection, schema: str) -> bool:
    return conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}).scalar() == 1


def database_state(conn: Connection, schema: str) -> dict[str, object] | None:
    """Every row of every table of ``schema`` (as sorted JSON text, so timestamps compare
    exactly), every sequence's position and every table's heap size in bytes, read on
    ``conn``; None without the schema. Sizes show a ``TRUNCATE`` that emptied dead space
    (no row changes); a rolled-back write leaves them grown, which :func:`assert_as_before`
    allows (the slot counts as written until it is pruned)."""
    if not schema_exists(conn, schema):
        return None
    tables = conn.execute(text(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = :s AND c.relkind = 'r' ORDER BY 1"), {"s": schema}).scalars().all()
    rows: dict[str, list[str]] = {t: [] for t in tables}
    union = " UNION ALL ".join(
        f"SELECT '{t}', to_jsonb(x)::text FROM \"{schema}\".\"{t}\" x" for t in tables)
    for table, row in conn.execute(text(union)):
        rows[table].append(row)
    sequences = dict(conn.execute(text(
        "SELECT sequencename, last_value FROM pg_sequences WHERE schemaname = :s"), {"s": schema}).all())
    sizes = dict(conn.execute(text(
        "SELECT c.relname, pg_relation_size(c.oid) FROM pg_class c JOIN pg_namespace n "
        "ON n.oid = c.relnamespace WHERE n.nspname = :s AND c.relkind = 'r'"), {"s": schema}).all())
    return {"rows": {t: sorted(r) for t, r in rows.items()}, "sequences": sequences, "sizes": sizes}


def shard_cache(st: QueueStorage) -> dict[str, tuple[float, int]]:
    return dict(st._ctx.lanes._shards)


def session_state(conn: Connection) -> dict[str, object]:
    """What a transaction may not leave on its connection: settings, advisory locks and
    LISTEN registrations. (``plpgsql.*`` settings appear once the session first loads
    PL/pgSQL, whatever the transaction does.)"""
    settings = conn.execute(text(
        "SELECT name, setting FROM pg_settings WHERE name NOT LIKE 'qstore.%' "
        "AND name NOT LIKE 'plpgsql.%' ORDER BY 1")).all()
    claimed = conn.execute(text("SELECT current_setting('qstore.claimed_in_xact', true)")).scalar()
    locks = conn.execute(text(
        "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'advisory'")).scalar()
    channels = conn.execute(text("SELECT count(*) FROM pg_listening_channels()")).scalar()
    return {"settings": settings, "claimed_in_xact": claimed or None, "advisory locks": locks,
            "channels": channels}


def assert_hints_passed_only_spent_positions(engine: Engine, schema: str, before: dict[str, int | None],
                                            after: dict[str, int | None]) -> None:
    with engine.connect() as c:
        for name, now in after.items():
            was = before.get(name) or 0
            if now == before.get(name):
                continue
            assert now is not None and now > was, f"{name} moved back: {was} -> {now}"
            lane = c.execute(text(
                f'SELECT queue, priority, enqueue_shard FROM "{schema}".queue_claim_heads '
                "WHERE claim_seq = CAST(:seq AS regclass)"), {"seq": f'"{schema}".{name}'}).one()
            pending = c.execute(text(
                f"""SELECT array_agg(p) FROM generate_series(:was + 1, :now) p
                    WHERE EXISTS (SELECT 1 FROM "{schema}".ready_entries r
                                  WHERE (r.queue, r.priority, r.enqueue_shard) = (:q, :pr, :sh)
                                    AND r.lane_seq = p)
                      AND NOT EXISTS (SELECT 1 FROM "{schema}".ready_claim_ranges cr
                                      WHERE (cr.queue, cr.priority, cr.enqueue_shard) = (:q, :pr, :sh)
                                        AND p BETWEEN cr.first_seq AND cr.last_seq)"""),
                {"was": was, "now": now, "q": lane.queue, "pr": lane.priority, "sh": lane.enqueue_shard}).scalar()
            assert pending is None, f"{name} moved past unclaimed positions {pending} of lane {tuple(lane)}"


def assert_as_before(engine: Engine, schema: str, before: dict[str, object] | None,
                     after: dict[str, object] | None) -> None:
    """``after`` is ``before`` but for the sequences listed at the top of this section
    (heap sizes are not compared: see :func:`database_state`)."""
    if before is None or after is None:
        assert before == after, "the schema came or went"
        return
    changed = [t for t, rows in after["rows"].items() if before["rows"].get(t) != rows]
    assert changed == [] and after["rows"].keys() == before["rows"].keys(), \
        f"tables changed by a rolled-back transaction: {changed}"
    was, now = before["sequences"], after["sequences"]
    assert was.keys() == now.keys(), "sequences came or went"
    assert_hints_passed_only_spent_positions(
        engine, schema, {n: v for n, v in was.items() if HINT.match(n)},
        {n: v for n, v in now.items() if HINT.match(n)})
    moved = {n: (was[n], v) for n, v in now.items()
             if v != was[n] and not ALLOCATING.match(n) and not HINT.match(n)}
    assert moved == {}, f"sequences moved by a rolled-back transaction: {moved}"


@contextmanager
def listening(engine: Engine, st: QueueStorage) -> Iterator[Callable[[], list[str]]]:
    """A LISTEN connection on the install's wake-up and cancel channels; the callable
    returns the notifications that arrived so far."""
    raw = engine.raw_connection()
    try:
        driver = raw.driver_connection
        raw.commit()
        driver.autocommit = True
        channels = [st.config.notify_channel(q) for q in ("q", "elsewhere")] + [st.config.cancel_channel]
        for ch in channels:
            driver.execute(f'LISTEN "{ch}"')

        def arrived() -> list[str]:
            driver.execute("SELECT 1")  # let pending notifications in
            return [n.channel for n in driver.notifies(timeout=0.05, stop_after=10)]

        yield arrived
        driver.execute("UNLISTEN *")
        driver.autocommit = False
    finally:
        raw.invalidate()
        raw.close()


def test_every_operation_has_a_case():
    assert missing_case_names() == [], "give each new operation a case in tests/operation_cases.py"


def in_rolled_back_caller_transaction(kind: str, engine: Engine, work: Callable[[object, Connection], None]) -> None:
    """``work(target, connection)`` in a caller's transaction of ``kind`` (a Connection or
    an ORM Session), then rolled back; a Connection must be left as it was found (settings,
    advisory locks, LISTEN registrations)."""
    if kind == "session":
        with Session(engine) as session:
            work(session, session.connection())
            session.rollback()
        return
    with engine.connect() as conn:
        found = session_state(conn)
        conn.rollback()
        with conn.begin() as tx:
            work(conn, conn)
            tx.rollback()
        left = session_state(conn)
        assert left == found, (set(found["settings"]) ^ set(left["settings"]),
                               {k: (v, left[k]) for k, v in found.items() if k != "settings" and v != left[k]})
        conn.rollback()


@pytest.mark.parametrize("kind", ["connection", "session"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_rolled_back_caller_transaction_leaves_nothing_behind(engine, make_storage, name, kind):
    """Each operation, in a caller's transaction rolled back (twice in a row), leaves every
    table, every sequence but those that hand out numbers, the connection's session state
    and the storage's process caches as they were; and it did its work before the
    rollback, so the comparison is not vacuous."""
    case = CASES[name]
    st = make_storage(**case.shape)
    given = case.setup(engine, st)
    subject = given["storage"] if case.other_schema else st
    schema = subject.schema()
    try:
        with engine.connect() as c:
            before = database_state(c, schema)
        cache = shard_cache(st)
        with listening(engine, st) as notified:
            for _ in range(2):
                def work(target: object, conn: Connection) -> None:
                    if case.refused:
                        with pytest.raises(CallerTransactionRefusedError, match=name):
                            case.call(st, target, given)
                        return
                    result = case.call(st, target, given)
                    assert case.check(result, given) is not False, result
                    inside = database_state(conn, schema)
                    if case.writes:
                        assert inside != before, f"{name} changed nothing inside the transaction"
                    else:
                        assert inside == before, f"{name} is a read but wrote"

                in_rolled_back_caller_transaction(kind, engine, work)
                with engine.connect() as c:
                    assert_as_before(engine, schema, before, database_state(c, schema))
                now = shard_cache(st)
                assert all(cache.get(q) == v for q, v in now.items()), (cache, now)
            assert notified() == []
    finally:
        if case.other_schema:
            with engine.begin() as c:
                c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))


def test_a_hint_moved_past_an_unclaimed_position_is_reported(engine, st):
    """The comparison above allows a claim-cursor hint to move over spent positions only."""
    st.enqueue_params_batch(engine, [params(args={"n": 0}), params(args={"n": 1})])
    with engine.connect() as c:
        before = database_state(c, st.schema())
        [seq] = c.execute(text(f'SELECT claim_seq::text FROM "{st.schema()}".queue_claim_heads')).scalars()
    with engine.begin() as c:  # the first row is claimed; the hint jumps over the second too
        st.claim_runtime_batch(c, "q", 1)
        c.execute(text("SELECT setval(CAST(:s AS regclass), 2)"), {"s": seq})
    with engine.connect() as c:
        after = database_state(c, st.schema())
    after["rows"] = before["rows"]  # only the sequences are compared
    with pytest.raises(AssertionError, match=r"past unclaimed positions \[2\]"):
        assert_as_before(engine, st.schema(), before, after)
