"""Frozen DDL of revision 0008: lanes are created with the schema owner's rights.

``ensure_lane`` creates a lane's two cursor sequences the first time a job is enqueued into
that lane. From this revision it runs ``SECURITY DEFINER`` (as the role that owns the
function, the migration role) with a fixed ``search_path``, so a runtime role that may not
create anything in the schema can still enqueue into a new queue or priority; the new
sequences belong to the owner, and the owner's default privileges
(``qstore install --grant``) give the runtime role their use. The body is revision 0001's,
unchanged. The downgrade restores revision 0001's statement (``SECURITY INVOKER``, no
settings). Never edited after landing (see :mod:`qstore.migrations.frozen.r0001`).
"""

from __future__ import annotations

from qstore.migrations.frozen import r0001
from qstore.migrations.frozen.r0001 import Shape

_HEADER = "RETURNS void LANGUAGE plpgsql VOLATILE AS $$"
_DEFINER = ("RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER "
            "SET search_path = pg_catalog, pg_temp AS $$")


def _invoker(s: str) -> str:
    """Revision 0001's ``ensure_lane`` statement."""
    return r0001.function_statements(s)[1]


def ensure_lane(s: str) -> str:
    """``ensure_lane`` as this revision installs it (also the head declaration's)."""
    statement = _invoker(s)
    assert statement.count(_HEADER) == 1, "revision 0001's ensure_lane header changed"
    return statement.replace(_HEADER, _DEFINER)


def upgrade(shape: Shape) -> list[str]:
    return [ensure_lane(shape.schema)]


def downgrade(shape: Shape) -> list[str]:
    return [_invoker(shape.schema)]
