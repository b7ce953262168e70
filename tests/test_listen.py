"""The LISTEN helper (``storage.listen``): woken by enqueues of its queues and by operator
cancels, quiet otherwise, interruptible, and back by itself after its connection is lost."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from outage import OutageProxy
from sqlalchemy import create_engine, text

from qstore import InsertOpts, InsertParams, Wakeup
from qstore.errors import ValidationError


def job(queue: str = "mail", **opts: object) -> InsertParams:
    return InsertParams("k", {}, InsertOpts(queue=queue, **opts))  # type: ignore[arg-type]


@pytest.fixture
def listen(engine, st):  # type: ignore[no-untyped-def]
    opened = []

    def make(queues=("mail",), **kw):  # type: ignore[no-untyped-def]
        listener = st.listen(engine, list(queues), **kw)
        opened.append(listener)
        return listener

    yield make
    for listener in opened:
        listener.close()


def test_an_enqueue_wakes_the_listener_of_its_queue(engine, st, listen):  # type: ignore[no-untyped-def]
    listener = listen(["mail", "sms"])
    st.enqueue(engine, job("mail"))
    assert listener.wait(5) == Wakeup(queues=frozenset({"mail"}))


def test_enqueues_of_other_queues_and_scheduled_jobs_do_not_wake_it(engine, st, listen):  # type: ignore[no-untyped-def]
    listener = listen(["mail"])
    st.enqueue(engine, job("other"))
    st.enqueue(engine, job("mail", run_at=datetime.now(timezone.utc) + timedelta(hours=1)))
    assert not listener.wait(0.3)


def test_an_enqueue_rolled_back_does_not_wake_it(engine, st, listen):  # type: ignore[no-untyped-def]
    listener = listen(["mail"])
    with engine.connect() as conn:
        conn.begin()
        st.enqueue(conn, job("mail"))
        conn.rollback()
    assert not listener.wait(0.3)


def test_a_wait_with_nothing_to_report_returns_empty_after_its_timeout(listen):  # type: ignore[no-untyped-def]
    listener = listen()
    started = time.monotonic()
    assert listener.wait(0.2) == Wakeup()
    assert 0.15 <= time.monotonic() - started < 2


def test_an_operator_cancel_of_a_running_attempt_is_reported(engine, st, listen):  # type: ignore[no-untyped-def]
    st.enqueue(engine, job("mail"))
    claimed = st.claim_runtime_batch(engine, "mail", 1)[0]
    listener = listen(["other"])
    st.cancel_job(engine, claimed.job.id)
    assert listener.wait(5).cancels == ((claimed.job.id, claimed.job.run_lease),)


def test_without_cancel_the_listener_ignores_operator_cancels(engine, st, listen):  # type: ignore[no-untyped-def]
    st.enqueue(engine, job("mail"))
    claimed = st.claim_runtime_batch(engine, "mail", 1)[0]
    listener = listen(["other"], cancel=False)
    st.cancel_job(engine, claimed.job.id)
    assert not listener.wait(0.3)


def test_a_queue_named_cancel_is_woken_by_its_enqueues_and_still_gets_operator_cancels(engine, st, listen):  # type: ignore[no-untyped-def]
    # the queue's channel and the cancel channel have the same name
    assert st.config.notify_channel("cancel") == st.config.cancel_channel
    listener = listen(["cancel"])
    st.enqueue(engine, job("cancel"))
    assert listener.wait(5) == Wakeup(queues=frozenset({"cancel"}))
    claimed = st.claim_runtime_batch(engine, "cancel", 1)[0]
    st.cancel_job(engine, claimed.job.id)
    assert listener.wait(5) == Wakeup(cancels=((claimed.job.id, claimed.job.run_lease),))


def test_interrupt_ends_a_wait_from_another_thread(listen):  # type: ignore[no-untyped-def]
    listener = listen()
    threading.Timer(0.1, listener.interrupt).start()
    started = time.monotonic()
    assert not listener.wait(10)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("queue", ['Mail "VIP"; DROP TABLE x', "q:with:colons", "é" * 40 + "x" * 60],
                         ids=["quotes", "colons", "long"])
def test_any_queue_name_is_listened_to_under_its_quoted_channel(engine, st, listen, queue):  # type: ignore[no-untyped-def]
    listener = listen([queue])
    st.enqueue(engine, job(queue))
    assert listener.wait(5).queues == {queue}


def test_a_lost_connection_is_replaced_and_reported_as_missed(engine, st, listen):  # type: ignore[no-untyped-def]
    listener = listen(["mail"])
    pid = listener._conn.info.backend_pid
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    assert listener.wait(5).missed  # notifications sent meanwhile may be lost: poll now
    assert listener.connected and listener._conn.info.backend_pid != pid
    st.enqueue(engine, job("mail"))
    assert listener.wait(5).queues == {"mail"}  # listening again on the new connection


def test_an_outage_is_one_warning_and_one_line_when_the_listener_is_back(db_url, st, caplog):  # type: ignore[no-untyped-def]
    with OutageProxy() as proxy:
        eng = create_engine(proxy.url(db_url), pool_size=2)
        try:
            with eng.connect(), eng.connect():  # the pool keeps a connection the outage kills
                pass                              # (the listener takes the other one)
            with st.listen(eng, ["mail"]) as listener:
                caplog.set_level(logging.INFO)
                proxy.cut()
                deadline = time.monotonic() + 2
                while time.monotonic() < deadline:  # reconnect tries while the server is away
                    assert listener.wait(0.2).missed or not listener.connected
                proxy.restore()
                deadline = time.monotonic() + 10
                while not listener.connected and time.monotonic() < deadline:
                    listener.wait(0.2)
                assert listener.connected
        finally:
            eng.dispose()
    records = [r for r in caplog.records if r.name.startswith(("qstore", "sqlalchemy"))]
    shown = "\n".join(f"{r.levelname} {r.name}: {r.getMessage()}" for r in records)
    # the pooled connection it got back first was dead: closed, not reset into the pool
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], shown
    assert [r.levelname for r in records] == ["WARNING", "INFO"], shown
    assert "LISTEN connection" in records[0].getMessage() and "back after" in records[1].getMessage(), shown


def test_the_listener_holds_no_transaction_open(engine, listen):  # type: ignore[no-untyped-def]
    listener = listen()
    pid = listener._conn.info.backend_pid
    with engine.connect() as conn:
        state, xmin = conn.execute(text("SELECT state, backend_xmin FROM pg_stat_activity WHERE pid = :p"),
                                   {"p": pid}).one()
    assert state == "idle" and xmin is None


@pytest.mark.parametrize("queues", ["mail", [""], [None]])
def test_bad_queue_lists_are_refused(engine, st, queues):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="queues"):
        st.listen(engine, queues)


def test_a_closed_listener_refuses_to_wait(listen):  # type: ignore[no-untyped-def]
    listener = listen()
    listener.close()
    listener.close()  # idempotent
    with pytest.raises(ValidationError, match="closed"):
        listener.wait(0.1)
