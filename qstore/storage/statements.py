"""Helpers for building cacheable Core statements: typed array parameters, ``unnest``
row sources and calls to the install's server-side functions."""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, column, func
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.functions import Function
from sqlalchemy.types import TypeEngine

from qstore.schema import StorageSchema

__all__ = ["array_param", "schema_func", "unnest_rows"]


def array_param(name: str, item_type: TypeEngine[Any]) -> BindParameter[Any]:
    return bindparam(name, type_=ARRAY(item_type))


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
