"""Packed array parameters (qstore.storage.statements): a list bound as one array literal
must reach PostgreSQL exactly as psycopg's element-by-element list adaptation sends it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import BigInteger, Engine, Integer, SmallInteger, Text, func, select
from sqlalchemy.dialects.postgresql import BYTEA, JSONB, TIMESTAMP
from sqlalchemy.exc import StatementError
from sqlalchemy.types import TypeEngine

from qstore.storage.statements import array_param, packed_array_param

AWKWARD_TEXT = ['say "hi"', "back\\slash", "a,b", "{braces}", "NULL", "null", " spaced ", "",
                "ünïcødé ✓", "tab\tnew\nline", "\\x00", None]
CASES: list[tuple[str, TypeEngine[Any], list[Any]]] = [
    ("bigint", BigInteger(), [0, -1, 2**63 - 1, -(2**63), None]),
    ("integer", Integer(), [1, None, -2147483648]),
    ("smallint", SmallInteger(), [1, 4, None, -32768]),
    ("text", Text(), AWKWARD_TEXT),
    ("jsonb", JSONB(), [{"a": 'q"uote', "b": [1, 2.5, None, True]}, "NULL", None, [],
                        {"back\\slash": "{x,y}"}, "ünïcødé ✓", 3]),
    ("jsonb none_as_null", JSONB(none_as_null=True), [None, {"k": "v"}, None]),
    ("timestamptz", TIMESTAMP(timezone=True), [
        datetime(2030, 1, 2, 3, 4, 5, 123456, tzinfo=timezone(timedelta(hours=5, minutes=30))),
        datetime(1999, 12, 31, 23, 59, 59, tzinfo=timezone.utc), None]),
    ("bytea", BYTEA(), [bytes(range(256)), b"", b'"\\', None]),
]


def round_trip(engine: Engine, param: Any, values: list[Any]) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(select(param), {"a": values}).scalar_one())


@pytest.mark.parametrize(("label", "item", "values"), CASES, ids=[c[0] for c in CASES])
def test_packed_array_reads_back_what_list_adaptation_sends(engine: Engine, label: str,
                                                             item: TypeEngine[Any], values: list[Any]) -> None:
    packed = round_trip(engine, packed_array_param("a", item), values)
    adapted = round_trip(engine, array_param("a", item), values)
    assert packed == adapted
    if not isinstance(item, JSONB):  # json null and SQL NULL both read back as None
        assert packed == values


def test_jsonb_none_is_json_null_unless_the_type_says_none_as_null(engine: Engine) -> None:
    for item, expected in ((JSONB(), "null"), (JSONB(none_as_null=True), None)):
        arr = packed_array_param("a", item)
        with engine.connect() as conn:
            got = conn.execute(select(func.jsonb_typeof(func.unnest(arr))), {"a": [None]}).scalar_one()
        assert got == expected


@pytest.mark.parametrize(("item", "bad"), [
    (BigInteger(), 1.5), (BigInteger(), "1"), (Text(), 3), (TIMESTAMP(timezone=True), "2030-01-01"),
    (BYTEA(), "00ff"),
])
def test_packed_array_refuses_values_of_the_wrong_type(engine: Engine, item: TypeEngine[Any], bad: Any) -> None:
    with pytest.raises(StatementError) as err, engine.connect() as conn:
        conn.execute(select(packed_array_param("a", item)), {"a": [bad]})
    assert isinstance(err.value.orig, TypeError)
