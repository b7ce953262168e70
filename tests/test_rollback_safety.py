"""Everything a call moves inside a caller's transaction survives that transaction rolling
back: sequences (the claim cursor hint, lane positions, job ids) and process caches (the
enqueue-shard cache) never hold a value only the rolled-back transaction could see.

Sequences do not roll back, so a claim moves its lane's cursor hint only over committed
claims; caches are filled only from reads the storage itself committed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import pytest
from jobtools import params
from sqlalchemy import Connection, Engine, event, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from qstore import CallerTransactionRefusedError, QueueStorage, ValidationError
from qstore.aio import AsyncQueueStorage
from qstore.model import JobState

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
