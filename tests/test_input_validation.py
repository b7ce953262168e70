"""Input validation, case by case: each bad input below raises a ``ValidationError`` naming
the bad field (before any statement runs, so nothing is written), and each weird-but-valid
input below works. ``tests/test_input_fuzz.py`` searches the same ground at random; these
are the cases it found, kept as named specifications."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from jobtools import running
from psycopg import sql
from sqlalchemy import Engine, make_url, text

from qstore import (
    DatabaseError,
    QueueStorage,
    ValidationError,
)
from qstore.config import MAX_CHANNEL_BYTES, channel_name
from qstore.storage.jobs import InsertOpts, InsertParams

NOTHING = dict.fromkeys(("ready_entries", "ready_tombstones", "deferred_jobs", "done_entries", "dlq_entries",
                         "leases", "lease_claims", "lease_claim_closures", "attempt_state"), 0)


def job(kind: str = "k", args: Any = None, **opts: Any) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams(kind, {"n": 1} if args is None else args, InsertOpts(**opts))


def refused(call: Callable[[], Any], field: str) -> ValidationError:
    """``call()`` raises a ValidationError whose field is ``field`` (or a part of it)."""
    with pytest.raises(ValidationError) as info:
        call()
    err = info.value
    assert err.field == field or err.field.startswith((f"{field}.", f"{field}[")), err
    return err


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def self_containing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


def test_validation_error_message_stays_short_for_huge_or_unprintable_values() -> None:
    assert len(str(ValidationError("queue", "q" * (1 << 20), "too long"))) < 1000
    assert "<int>" in str(ValidationError("n", 10**5000, "too long"))  # repr() of it raises
    assert len(str(ValidationError("args", deep_list(3000), "too deep"))) < 1000  # repr() of it recurses


# -- notification channels ----------------------------------------------------------------------


def test_channel_names_longer_than_postgresql_allows_are_cut_with_a_hash() -> None:
    long_a, long_b = channel_name("qstore", "shop", "a" * 200), channel_name("qstore", "shop", "a" * 199 + "b")
    assert channel_name("qstore", "shop", "mail") == "qstore:shop:mail"
    assert len(long_a.encode()) <= MAX_CHANNEL_BYTES and long_a.startswith("qstore:shop:aaa")
    assert long_a != long_b and long_a == channel_name("qstore", "shop", "a" * 200)
    emoji = channel_name("qstore", "shop", "\U0001f600" * 50)
    assert len(emoji.encode()) <= MAX_CHANNEL_BYTES  # cut on a character boundary: it encodes


@pytest.fixture
def listen(db_url: str) -> Iterator[Callable[[str], psycopg.Connection]]:
    conninfo = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    opened: list[psycopg.Connection] = []

    def on(channel: str) -> psycopg.Connection:
        conn = psycopg.connect(conninfo, autocommit=True)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        opened.append(conn)
        return conn

    yield on
    for conn in opened:
        conn.close()


def test_enqueue_into_a_200_character_queue_notifies_on_its_shortened_channel(
        engine: Engine, st: QueueStorage, listen: Callable[[str], psycopg.Connection]) -> None:
    queue = "\u00e4" * 200
    lis = listen(st.config.notify_channel(queue))
    assert st.enqueue_params_batch(engine, [job(queue=queue)]) == 1
    assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [st.config.notify_channel(queue)]
    assert st.claim_runtime_batch(engine, queue, 1)[0].job.queue == queue


def test_cancel_notifies_on_a_channel_that_fits_for_the_longest_prefix_and_schema(
        engine: Engine, make_storage: Callable[..., QueueStorage], listen: Callable[[str], psycopg.Connection]) -> None:
    s = make_storage(schema="s" * 48, notify_prefix="p" * 48)
    lis = listen(s.config.cancel_channel)
    c = running(engine, s)
    assert s.cancel_job(engine, c.job.id) is not None
    assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [s.config.cancel_channel]


# -- driver errors ---------------------------------------------------------------------------------


def test_driver_error_inside_copy_is_a_database_error(engine: Engine, st: QueueStorage) -> None:
    with engine.connect() as locker, engine.connect() as conn:
        locker.begin()
        locker.execute(text(f'LOCK TABLE "{st.schema()}".ready_entries IN ACCESS EXCLUSIVE MODE'))
        conn.begin()
        conn.execute(text("SET LOCAL lock_timeout = '200ms'"))
        with pytest.raises(DatabaseError) as info:
            st.enqueue_params_copy(conn, [job()])
        assert info.value.sqlstate == "55P03"  # lock_not_available, raised by psycopg's COPY itself
        conn.rollback()
        locker.rollback()
