"""Helpers for building cacheable Core statements: typed array parameters, ``unnest``
row sources, calls to the install's server-side functions, and the receipt predicates
every reader of the claim ring shares."""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Exists,
    FromClause,
    Integer,
    LargeBinary,
    Numeric,
    String,
    Text,
    and_,
    any_,
    bindparam,
    cast,
    column,
    func,
    select,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlalchemy.sql.functions import Function
from sqlalchemy.types import TypeDecorator, TypeEngine

from qstore.config import CLOSURE_BLOCK
from qstore.schema import StorageSchema

__all__ = [
    "AttemptProgress",
    "HotStatement",
    "array_param",
    "attempt_leased",
    "attempt_progress",
    "closed_in_batch",
    "live_deferred",
    "packed_array_param",
    "receipt_open",
    "schema_func",
    "unnest_rows",
    "wheel_entry_live",
]


def array_param(name: str, item_type: TypeEngine[Any]) -> BindParameter[Any]:
    return bindparam(name, type_=ARRAY(item_type))


def _quoted(value: str) -> str:
    """An array element literal for ``value``: double-quoted, ``\\`` and ``"`` escaped (so
    commas, braces, spaces and the word NULL stay data)."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _int_element(value: Any) -> str:
    # operator.index refuses floats, strings and anything else that is not an integer
    return "NULL" if value is None else str(operator.index(value))


def _bool_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if not isinstance(value, bool):
        raise TypeError(f"expected bool, got {type(value).__name__}")
    return "t" if value else "f"


def _text_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return _quoted(value)


def _timestamp_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if not isinstance(value, datetime):
        raise TypeError(f"expected datetime, got {type(value).__name__}")
    return _quoted(value.isoformat())


def _bytes_element(value: Any) -> str:
    if value is None:
        return "NULL"
    if not isinstance(value, bytes | bytearray | memoryview):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    return _quoted("\\x" + bytes(value).hex())


def _json_element(none_as_null: bool) -> Callable[[Any], str]:
    # json.dumps as psycopg's Jsonb dumper does; None is SQL NULL or JSON null as the
    # column type says (SQLAlchemy's ``none_as_null``)
    def element(value: Any) -> str:
        if value is None and none_as_null:
            return "NULL"
        return _quoted(json.dumps(value))
    return element


def _element_literal(item: TypeEngine[Any]) -> Callable[[Any], str]:
    if isinstance(item, JSON):
        return _json_element(bool(item.none_as_null))
    # Integer before Numeric (an Integer is a Numeric); a Numeric element is an integer too
    # (arbitrary size, e.g. a 64-bit unsigned hash)
    for kind, element in ((Integer, _int_element), (Numeric, _int_element), (Boolean, _bool_element),
                          (String, _text_element), (DateTime, _timestamp_element),
                          (LargeBinary, _bytes_element)):
        if isinstance(item, kind):
            return element
    raise TypeError(f"no packed array literal for {item!r}")


class _PackedArray(TypeDecorator[Sequence[Any]]):
    """A Python sequence bound as one PostgreSQL array literal (``{1,"a",NULL}``) in a text
    parameter, for the statement to cast to the array type.

    psycopg adapts a list element by element in Python; joining the literal here costs a
    fraction of that, which matters on the hot paths (completion sends four arrays per call,
    an enqueue thirteen arrays of batch length). Elements: ints (integer and numeric types),
    bools, strs
    (text), datetimes (timestamps), bytes (bytea), JSON-serialisable values (json/jsonb),
    ``None`` as SQL NULL (JSON null for a json type without ``none_as_null``).
    """

    impl = Text
    cache_ok = True

    def __init__(self, item: TypeEngine[Any]) -> None:
        super().__init__()
        self.item = item
        self._element = _element_literal(item)
        self._ints = self._element is _int_element

    def pack(self, value: Sequence[Any] | None) -> str | None:
        """The array literal of ``value`` (the whole bind processing: the text it becomes
        needs no further processing by the driver dialect)."""
        if value is None:
            return None
        if len(value) == 1:  # a single job: skip the map and join
            return "{" + self._element(value[0]) + "}"
        if self._ints and all(type(v) is int for v in value):  # ids and leases: nothing to check
            return "{" + ",".join(map(str, value)) + "}"
        return "{" + ",".join(map(self._element, value)) + "}"

    def process_bind_param(self, value: Sequence[Any] | None, dialect: Dialect) -> str | None:
        return self.pack(value)


def packed_array_param(name: str, item: TypeEngine[Any] | type[TypeEngine[Any]]) -> ColumnElement[Any]:
    """``CAST(:name AS <item>[])`` bound through :class:`_PackedArray`: same SQL meaning as
    :func:`array_param`, cheaper to bind."""
    item_type = item() if isinstance(item, type) else item
    return cast(bindparam(name, type_=_PackedArray(item_type)), ARRAY(item_type))


def unnest_rows(alias: str, **columns: TypeEngine[Any]) -> Any:
    """``unnest(:a, :b, …) AS alias(a, b, …)``: one packed array per column, row-aligned.

    The statement text is identical for any batch size, so SQLAlchemy's compiled cache
    and PostgreSQL's plan cache both serve every call.
    """
    fn = func.unnest(*(packed_array_param(name, t) for name, t in columns.items()))
    return fn.table_valued(*(column(name, t) for name, t in columns.items())).render_derived(
        name=alias, with_types=False
    )


def schema_func(sch: StorageSchema, name: str, *args: Any) -> Function[Any]:
    """Call ``<schema>.<name>(args)``; the schema is a validated identifier."""
    return getattr(getattr(func, sch.config.schema), name)(*args)


def receipt_open(sch: StorageSchema, claims: FromClause, slot: int | None = None) -> ColumnElement[bool]:
    """No closure of either form names the receipt row of ``claims`` (same claim slot, job
    and run lease): neither a row of ``lease_claim_closures`` nor a member of a row of
    ``lease_claim_closure_batches`` (found by the receipt's block of job ids). The one
    definition of an open receipt. ``claims`` is ``lease_claims`` or an alias of it, or with
    ``slot`` its child of that claim slot, whose closures are then read from the children of
    the same slot only."""
    closures = sch.closures.parent if slot is None else sch.closures.children[slot]
    batches = sch.closure_batches.parent if slot is None else sch.closure_batches.children[slot]
    cl, c = closures.c, claims.c
    narrow = select(cl.job_id).where(cl.claim_slot == c.claim_slot, cl.job_id == c.job_id,
                                     cl.run_lease == c.run_lease).exists()
    return and_(~narrow, ~closed_in_batch(batches, c.claim_slot, c.job_id, c.run_lease))


def closed_in_batch(batches: FromClause, claim_slot: Any, job_id: Any, run_lease: Any) -> Exists:
    """``EXISTS`` a row of ``batches`` (``lease_claim_closure_batches``) with the attempt
    ``(job_id, run_lease)`` of claim slot ``claim_slot`` among its members: one probe of the
    block index; ``= ANY`` picks the row and the member's own run lease is then compared (a
    job id alone does not name an attempt)."""
    b = batches.c
    m = func.unnest(b.job_ids, b.run_leases).table_valued(
        column("job_id", BigInteger()), column("run_lease", BigInteger())).render_derived(name="m", with_types=False)
    # correlated past the batch row to the receipt's own query (two levels up)
    member = (select(m.c.job_id).select_from(m).where(m.c.job_id == job_id, m.c.run_lease == run_lease)
              .correlate_except(m).exists())
    return select(b.job_block).where(
        b.claim_slot == claim_slot, b.job_block == job_id // CLOSURE_BLOCK, job_id == any_(b.job_ids), member,
    ).exists()


def attempt_leased(leases: FromClause, claims: FromClause) -> Exists:
    """``EXISTS`` a materialised lease for the attempt of ``claims`` (by ``(job_id,
    run_lease)``, in any lease slot); a receipt-only attempt has none, and is ended on its
    receipt alone."""
    le, c = leases.c, claims.c
    return select(le.job_id).where(le.job_id == c.job_id, le.run_lease == c.run_lease).exists()


class AttemptProgress:
    """What readers know of a live attempt's heartbeats and progress: the latest
    ``attempt_progress`` row of the attempt (a ``LATERAL`` subquery, ``row``) merged with
    its ``attempt_state`` row (``state``, joined by the caller).

    * ``heartbeat_at``: the later of the two (``greatest`` skips NULLs);
    * ``progress``: ``attempt_state``'s when it holds one, else the latest row's. Only a
      process of the previous release writes progress to ``attempt_state`` (a rolling
      deploy; the upgrade moved what was there into ``attempt_progress``), and it writes
      there for the attempts it runs itself, so what it holds is the newer report.
    """

    def __init__(self, row: Any, state: FromClause) -> None:
        self.row = row
        self.heartbeat_at = func.greatest(row.c.heartbeat_at, state.c.heartbeat_at)
        self.progress = func.coalesce(state.c.progress, row.c.progress)


def attempt_progress(sch: StorageSchema, name: str, job_id: Any, run_lease: Any, slot: Any = None) -> Any:
    """``LATERAL`` subquery ``name``: the latest ``attempt_progress`` row (greatest ``seq``)
    of the attempt ``(job_id, run_lease)``, its ``heartbeat_at`` and ``progress``; ``slot``,
    when given, is the ring slot that holds the attempt (only that child is probed)."""
    p = sch.progress.parent
    cond = [p.c.job_id == job_id, p.c.run_lease == run_lease]
    if slot is not None:
        cond.append(p.c.ring_slot == slot)
    return (select(p.c.heartbeat_at, p.c.progress).where(*cond).order_by(p.c.seq.desc()).limit(1)
            .lateral(name))


_NAMED = re.compile(r"%\(([^)]+)\)s")


class HotStatement:
    """A Core statement of a hot path, compiled once per dialect and sent straight to the
    driver cursor by a :class:`~qstore.storage.targets.Runner`.

    SQLAlchemy's compiled cache already avoids recompiling, but every ``Connection.execute``
    still generates the statement's cache key, builds an execution context and a result
    object: more client CPU than the round trip's own cost for a claim that finds nothing.
    Here the SQL text and the bind processors are taken from SQLAlchemy's compilation once;
    a call only applies the processors to its values. The text is turned from the
    dialect's named placeholders (``%(name)s``) into positional ones (``%s``) once, so the
    driver gets a tuple and has no names to match per call. Only named, non-expanding
    parameters are supported (what the hot statements use).

    A ``prepared`` statement is one without parameters: its values are rendered into the
    text, and the runner asks the driver to prepare it on its first run on a connection
    (unless the connection's ``prepare_threshold`` is None: no server-side statements).
    The server then plans it once per connection: a prepared statement without parameters
    runs its one generic plan from the first execution on, where an unprepared one is
    planned again at every run (a cost that grows with the partitions it reads).
    """

    __slots__ = ("_compiled", "_ordered", "prepared", "statement")

    def __init__(self, statement: Any, *, prepared: bool = False) -> None:
        self.statement = statement
        self.prepared = prepared
        self._compiled: dict[int, tuple[str, tuple[tuple[str, Any, Any], ...]]] = {}
        self._ordered: dict[int, tuple[tuple[str, ...], str, tuple[tuple[int, Any], ...]]] = {}

    def compiled(self, dialect: Dialect) -> tuple[str, tuple[tuple[str, Any, Any], ...]]:
        """``(sql, binds)`` for ``dialect``: ``sql`` with positional placeholders, ``binds``
        one ``(key, processor, default value)`` per placeholder, in placeholder order."""
        got = self._compiled.get(id(dialect))
        if got is None:
            got = self._compile(dialect)
            self._compiled[id(dialect)] = got
        return got

    def _compile(self, dialect: Dialect) -> tuple[str, tuple[tuple[str, Any, Any], ...]]:
        if self.prepared:
            text = str(self.statement.compile(dialect=dialect, compile_kwargs={"literal_binds": True}))
            if _NAMED.search(text):  # pragma: no cover - a mistake in a prepared statement
                raise TypeError("a prepared hot statement takes no parameter")
            return text, ()
        c = self.statement.compile(dialect=dialect)
        processors = c._bind_processors
        by_name: dict[str, tuple[str, Any, Any]] = {}
        for bind, name in c.bind_names.items():
            if bind.expanding:  # pragma: no cover - a mistake in a hot statement
                raise TypeError(f"hot statements take no expanding parameter ({bind.key})")
            processor = processors.get(name)
            if isinstance(bind.type, _PackedArray):
                processor = bind.type.pack  # the same text, without SQLAlchemy's wrapping
            by_name[name] = (bind.key, processor, bind.value)
        if dialect.paramstyle != "pyformat":  # pragma: no cover - qstore's dialects are psycopg's
            raise TypeError(f"hot statements need the pyformat paramstyle, not {dialect.paramstyle}")
        order: list[tuple[str, Any, Any]] = []

        def positional(match: re.Match[str]) -> str:
            order.append(by_name[match.group(1)])
            return "%s"

        return _NAMED.sub(positional, c.string), tuple(order)

    def parameters(self, dialect: Dialect, values: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
        """The SQL text and the driver parameters for ``values`` (keyed by bind key)."""
        sql, binds = self.compiled(dialect)
        out = []
        for key, processor, default in binds:
            value = values.get(key, default)
            out.append(value if processor is None else processor(value))
        return sql, tuple(out)

    def in_order(self, dialect: Dialect, keys: tuple[str, ...], values: Sequence[Any]) -> tuple[str, list[Any]]:
        """:meth:`parameters` for ``values`` given one per bind key, in the order of ``keys``:
        the statement's keys in placeholder order, each once (checked at the first call per
        dialect; ``keys`` must be the same tuple object at every call). Only the values
        whose type has a bind processor are processed: no dictionary, no lookup per value."""
        got = self._ordered.get(id(dialect))
        if got is None or got[0] is not keys:
            sql, binds = self.compiled(dialect)
            if tuple(key for key, _, _ in binds) != keys:  # pragma: no cover - a mistake in a caller
                raise TypeError(f"the statement's parameters are {[k for k, _, _ in binds]}, not {list(keys)}")
            got = self._ordered[id(dialect)] = (
                keys, sql, tuple((i, processor) for i, (_, processor, _) in enumerate(binds) if processor is not None))
        _, sql, processed = got
        params = list(values)
        for i, processor in processed:
            params[i] = processor(params[i])
        return sql, params


def wheel_entry_live(wheel: FromClause, marks: FromClause) -> Any:
    """``NOT EXISTS`` a mark of the wheel entry of ``wheel``: the one definition of a live
    (unresolved) entry of the deferred wheel."""
    return ~select(marks.c.entry_id).where(marks.c.entry_id == wheel.c.entry_id,
                                           marks.c.wheel_slot == wheel.c.wheel_slot).exists()


def live_deferred(sch: StorageSchema, name: str = "deferred_live") -> Any:
    """Every job waiting for its time, as one relation with the overflow's columns: the
    overflow rows (``deferred_jobs``) and the live entries of the wheel."""
    df, w = sch.deferred, sch.wheel.parent
    cols = [c.name for c in df.columns]
    return (select(*(df.c[c] for c in cols))
            .union_all(select(*(w.c[c] for c in cols)).where(wheel_entry_live(w, sch.wheel_marks.parent)))
            .subquery(name))
