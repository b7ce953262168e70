"""Server-side functions and views of the head revision, declared as replaceable entities.

Each entity is plain data (schema, signature, definition) parsed from the head's SQL texts
(:mod:`qstore.sql`, one whole file per function or view), so the runtime needs no extra
dependency; :mod:`qstore.migrate` turns them into ``alembic_utils`` entities when that
package is installed, so ``alembic check`` diffs function and view bodies too. The last
revision installs exactly these texts (``tests/test_sql_texts.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sqlalchemy import Connection

from qstore.config import QueueStorageConfig
from qstore.sql import function_texts, view_texts

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
    """The server functions of an install of ``cfg`` at the head revision."""
    return tuple(ServerFunction.parse(cfg.schema, text) for text in function_texts(cfg))


def declare_views(cfg: QueueStorageConfig) -> tuple[ServerView, ...]:
    """``terminal_jobs`` and the three ``<ring>_ring_state`` cursor views."""
    return tuple(ServerView.parse(cfg.schema, text) for text in view_texts(cfg))


def execute_ddl(connection: Connection, statement: str) -> None:
    """Execute one DDL statement exactly as written: no bind-parameter parsing, so ``%`` and
    ``:name`` inside function bodies reach the server unchanged."""
    connection.exec_driver_sql(statement.replace("%", "%%"))
