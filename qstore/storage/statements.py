"""Helpers for building cacheable Core statements: typed array parameters, ``unnest``
row sources, calls to the install's server-side functions, and the receipt predicates
every reader of the claim ring shares."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Exists, FromClause, bindparam, column, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.sql.elements import BindParameter
from sqlalchemy.sql.functions import Function
from sqlalchemy.types import TypeEngine

from qstore.schema import StorageSchema

__all__ = ["array_param", "attempt_leased", "receipt_closed", "schema_func", "unnest_rows"]


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
