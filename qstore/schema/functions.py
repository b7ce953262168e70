"""Server-side functions and views of the head revision, declared as replaceable entities.

Each entity is plain data (schema, signature, definition) so the runtime needs no extra
dependency; :mod:`qstore.migrate` turns them into ``alembic_utils`` entities when that
package is installed, so ``alembic check`` diffs function and view bodies too.

The text of every body is the text of the revision that last changed it: the head
declaration *reads* the frozen templates of :mod:`qstore.migrations.frozen` instead of
keeping a second copy, so what ``metadata.create_all`` installs and what the migrations
install cannot drift apart. A new function body is a new revision (a new frozen module),
and the line below that names the body's revision moves to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Connection

from qstore.config import QueueStorageConfig
from qstore.migrations.frozen import r0001, r0004, r0006, r0007, r0008, r0009

__all__ = ["ServerFunction", "ServerView", "declare_functions", "declare_views", "execute_ddl"]

_CREATE_FUNCTION = "CREATE OR REPLACE FUNCTION "
_CREATE_VIEWS = ("CREATE OR REPLACE VIEW ", "CREATE VIEW ")
_VIEW_NAME = re.compile(r"\s+AS\s+")


@dataclass(frozen=True)
class ServerFunction:
    schema: str
    signature: str  # name(arg types) as pg_get_function_identity_arguments renders them
    definition: str  # RETURNS ... LANGUAGE ... AS $$ ... $$

    @property
    def name(self) -> str:
        return self.signature.split("(", 1)[0]

    def create_sql(self) -> str:
        return f"{_CREATE_FUNCTION}{self.schema}.{self.signature} {self.definition}"

    def drop_sql(self) -> str:
        return f"DROP FUNCTION IF EXISTS {self.schema}.{self.signature}"

    @classmethod
    def parse(cls, schema: str, statement: str) -> ServerFunction:
        """The entity of a frozen ``CREATE OR REPLACE FUNCTION <schema>.<signature> RETURNS …``."""
        head = f"{_CREATE_FUNCTION}{schema}."
        if not statement.startswith(head):
            raise ValueError(f"not a function of {schema}: {statement[:80]!r}")
        signature, definition = statement[len(head):].split(" RETURNS ", 1)
        return cls(schema, signature, "RETURNS " + definition)


@dataclass(frozen=True)
class ServerView:
    schema: str
    name: str
    definition: str  # the SELECT

    def create_sql(self) -> str:
        return f"CREATE OR REPLACE VIEW {self.schema}.{self.name} AS {self.definition}"

    def drop_sql(self) -> str:
        return f"DROP VIEW IF EXISTS {self.schema}.{self.name}"

    @classmethod
    def parse(cls, schema: str, statement: str) -> ServerView:
        """The entity of a frozen ``CREATE [OR REPLACE] VIEW <schema>.<name> AS …``."""
        for head in _CREATE_VIEWS:
            if statement.startswith(f"{head}{schema}."):
                name, definition = _VIEW_NAME.split(statement[len(head) + len(schema) + 1:], 1)
                return cls(schema, name, definition.strip())
        raise ValueError(f"not a view of {schema}: {statement[:80]!r}")


def declare_functions(cfg: QueueStorageConfig) -> tuple[ServerFunction, ...]:
    """The server functions of an install of ``cfg`` at the head revision, each with the
    body of the revision that last changed it."""
    s = cfg.schema
    backoff, _ensure_lane, reserve_lanes, _claim, _complete = r0001.function_statements(s)
    statements = (backoff,
                  r0008.ensure_lane(s),           # revision 0008
                  reserve_lanes,
                  r0009.claim_ready(cfg),         # revision 0009
                  r0004.complete_receipts(cfg),   # revision 0004
                  r0007.enqueue_jobs(cfg))        # revision 0007
    return tuple(ServerFunction.parse(s, x) for x in statements)


def declare_views(cfg: QueueStorageConfig) -> tuple[ServerView, ...]:
    """``terminal_jobs`` and the three ``<ring>_ring_state`` cursor views (revision 0006)."""
    s = cfg.schema
    statements = [r0006.terminal_jobs_view(s),
                  *(r0006.ring_state_view(cfg, ring) for ring in r0006.RINGS)]
    return tuple(ServerView.parse(s, x) for x in statements)


def execute_ddl(connection: Connection, statement: str) -> None:
    """Execute one DDL statement exactly as written: no bind-parameter parsing, so ``%`` and
    ``:name`` inside function bodies reach the server unchanged."""
    connection.exec_driver_sql(statement.replace("%", "%%"))
