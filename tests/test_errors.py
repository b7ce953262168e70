"""What an operation raises when the database is not what it needs: a schema that is not
installed is named as such (``SchemaNotInstalledError``), never as a driver error carrying
SQL; every other database failure is one line naming the operation, what failed and the
SQLSTATE, with the driver's exception kept as ``__cause__``."""

from __future__ import annotations

import uuid
from dataclasses import replace

import psycopg
import pytest
from operation_cases import CASES
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from qstore import QueueStorage, QueueStorageConfig, SchemaNotInstalledError


def _schema_exists(engine, schema: str) -> bool:
    with engine.connect() as c:
        return bool(c.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname = :s"), {"s": schema}).scalar())


@pytest.mark.parametrize("name", sorted(CASES))
def test_an_operation_on_a_schema_that_is_not_installed_says_so(engine, make_storage, name):
    """Each operation, on an Engine, for a schema the database does not hold (with the
    arguments that make it do its work on an installed one): ``SchemaNotInstalledError``
    naming the schema, in one line, the driver's error as its cause. The lifecycle calls
    that create or drop a schema do that instead."""
    case = CASES[name]
    st = make_storage(**case.shape)
    given = case.setup(engine, st)
    schema = f"t_missing_{uuid.uuid4().hex[:8]}"
    missing = QueueStorage(replace(st.config, schema=schema))
    if case.other_schema:
        given = {**given, "storage": QueueStorage(QueueStorageConfig(schema=schema))}
    assert not _schema_exists(engine, schema)
    try:
        if case.on_missing_schema == "raises":
            with pytest.raises(SchemaNotInstalledError) as info:
                case.call(missing, engine, given)
            err = info.value
            assert err.schema == schema
            assert "\n" not in str(err) and "SELECT" not in str(err) and "sqlalche.me" not in str(err), str(err)
            if name != "activate_backend":  # looks the table up itself, before any statement fails
                assert isinstance(err.__cause__, sa_exc.DBAPIError | psycopg.Error), repr(err.__cause__)
        elif case.on_missing_schema == "installs":
            case.call(missing, engine, given)
            assert _schema_exists(engine, schema)
        else:
            case.call(missing, engine, given)
            assert not _schema_exists(engine, schema)
    finally:
        with engine.begin() as c:
            c.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
