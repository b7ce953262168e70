"""Helpers for building cacheable Core statements: typed array parameters, ``unnest``
row sources, calls to the install's server-side functions, and the receipt predicates
every reader of the claim ring shares."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    Exists,
    FromClause,
    Integer,
    Text,
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

from qstore.schema import StorageSchema

__all__ = ["array_param", "attempt_leased", "packed_array_param", "receipt_closed", "schema_func",
           "unnest_rows"]


def array_param(name: str, item_type: TypeEngine[Any]) -> BindParameter[Any]:
    return bindparam(name, type_=ARRAY(item_type))


def _text_element(value: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


_ELEMENT_LITERALS: dict[type[TypeEngine[Any]], Callable[[Any], str]] = {
    BigInteger: lambda v: str(int(v)),  # int() refuses anything that is not a number
    Integer: lambda v: str(int(v)),
    Text: _text_element,
}


class _PackedArray(TypeDecorator[Sequence[Any]]):
    """A Python sequence bound as one PostgreSQL array literal (``{1,2,3}``) in a text
    parameter, for the statement to cast to the array type.

    psycopg adapts a list element by element in Python; joining the literal here costs a
    fraction of that, which matters on the per-call hot paths (completion sends four
    32-element arrays per call). Elements must be ints (bigint/integer arrays) or strs
    (text arrays, quoted and escaped); ``None`` elements are not supported.
    """

    impl = Text
    cache_ok = True

    def __init__(self, item_type: type[TypeEngine[Any]]) -> None:
        super().__init__()
        self.item_type = item_type
        self._element = _ELEMENT_LITERALS[item_type]

    def process_bind_param(self, value: Sequence[Any] | None, dialect: Dialect) -> str | None:
        if value is None:
            return None
        return "{" + ",".join(map(self._element, value)) + "}"


def packed_array_param(name: str, item_type: type[TypeEngine[Any]]) -> ColumnElement[Any]:
    """``CAST(:name AS <item>[])`` bound through :class:`_PackedArray`: same SQL meaning as
    :func:`array_param`, cheaper to bind for int and text arrays."""
    return cast(bindparam(name, type_=_PackedArray(item_type)), ARRAY(item_type()))


def unnest_rows(alias: str, **columns: TypeEngine[Any]) -> Any:
    """``unnest(:a, :b, …) AS alias(a, b, …)``: one bound array per column, row-aligned.

    The statement text is identical for any batch size, so SQLAlchemy's compiled cache
    and PostgreSQL's plan cache both serve every call.
    """
    fn = func.unnest(*(array_param(name, t) for name, t in columns.items()))
    return fn.table_valued(*(column(name, t) for name, t in columns.items())).render_derived(
        name=alias, with_types=False
    )


def schema_func(sch: StorageSchema, name: str, *args: Any) -> Function[Any]:
    """Call ``<schema>.<name>(args)``; the schema is a validated identifier."""
    return getattr(getattr(func, sch.config.schema), name)(*args)


def receipt_closed(closures: FromClause, claims: FromClause) -> Exists:
    """``EXISTS`` a closure of the receipt row of ``claims`` (same claim slot, job and run
    lease): the one definition of a closed receipt. An open receipt is ``~receipt_closed``."""
    cl, c = closures.c, claims.c
    return select(cl.job_id).where(cl.claim_slot == c.claim_slot, cl.job_id == c.job_id,
                                   cl.run_lease == c.run_lease).exists()


def attempt_leased(leases: FromClause, claims: FromClause) -> Exists:
    """``EXISTS`` a materialised lease for the attempt of ``claims`` (by ``(job_id,
    run_lease)``, in any lease slot); a receipt-only attempt has none (trap T2)."""
    le, c = leases.c, claims.c
    return select(le.job_id).where(le.job_id == c.job_id, le.run_lease == c.run_lease).exists()
