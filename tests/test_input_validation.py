"""Input validation, case by case: each bad input below raises a ``ValidationError`` naming
the bad field (before any statement runs, so nothing is written), and each weird-but-valid
input below works. ``tests/test_input_fuzz.py`` searches the same ground at random; these
are the cases it found, kept as named specifications."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from qstore import (
    DatabaseError,
    QueueStorage,
    ValidationError,
)
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
