"""Two roles: a migration role that owns the schema, and a runtime role that enqueues,
works and maintains (rotate and prune included) but can create, alter or drop nothing."""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from sqlalchemy import Engine, create_engine, pool, text
from sqlalchemy.engine import make_url

from qstore import InsertOpts, InsertParams, QueueStorage
from qstore.cli import main as qstore_cli
from qstore.runtime.maintainer import Maintainer
from qstore.schema.grants import runtime_grants, truncated_tables
from qstore.types import PruneOutcome

SCHEMA = "jobs"
SMALL = ["--queue-slot-count", "4", "--lease-slot-count", "2", "--claim-slot-count", "2"]


@dataclass
class Roles:
    owner_url: str
    runtime_url: str
    runtime: str


def _as(url: str, role: str) -> str:
    return make_url(url).set(username=role).render_as_string(hide_password=False)


@pytest.fixture
def roles(fresh_db_url: str) -> Iterator[Roles]:
    suffix = uuid.uuid4().hex[:8]
    owner, runtime = f"qstore_owner_{suffix}", f"qstore_runtime_{suffix}"
    admin = create_engine(fresh_db_url, poolclass=pool.NullPool)
    dbname = make_url(fresh_db_url).database
    with admin.begin() as conn:
        conn.execute(text(f'CREATE ROLE "{owner}" LOGIN'))
        conn.execute(text(f'CREATE ROLE "{runtime}" LOGIN'))
        conn.execute(text(f'GRANT CREATE ON DATABASE "{dbname}" TO "{owner}"'))
    try:
        yield Roles(_as(fresh_db_url, owner), _as(fresh_db_url, runtime), runtime)
    finally:
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{SCHEMA}" CASCADE'))
            conn.execute(text(f'DROP OWNED BY "{owner}", "{runtime}"'))
            conn.execute(text(f'DROP ROLE "{owner}"'))
            conn.execute(text(f'DROP ROLE "{runtime}"'))
        admin.dispose()


@pytest.fixture
def granted(roles: Roles) -> Iterator[Engine]:
    """The schema installed by the owner with ``--grant`` for the runtime role; an engine
    connected as the runtime role."""
    out = io.StringIO()
    assert qstore_cli(["install", "--url", roles.owner_url, "--schema", SCHEMA, *SMALL,
                       "--grant", roles.runtime], out=out) == 0, out.getvalue()
    assert f"to {roles.runtime!r}" in out.getvalue()
    engine = create_engine(roles.runtime_url)
    yield engine
    engine.dispose()


def test_the_runtime_role_enqueues_claims_completes_rotates_and_prunes(granted):
    storage = QueueStorage.from_existing_schema(SCHEMA, granted)
    storage.install(granted)  # at head: nothing to run, allowed without DDL rights
    opts = InsertOpts(queue="q")
    storage.enqueue_params_batch(granted, [InsertParams("k", {"i": i}, opts) for i in range(3)])
    claimed = storage.claim_runtime_batch(granted, "q", 3, timedelta(minutes=5))
    assert len(claimed) == 3
    assert len(storage.complete_runtime_batch(granted, claimed)) == 3
    assert storage.rotate(granted).kind == "rotated"
    assert storage.prune_oldest(granted) == PruneOutcome.pruned(0)  # TRUNCATE of ring slots
    assert storage.claim_slot_bytes(granted) > 0  # sizes of the claim ring's current children
    assert storage.rotate_claims(granted).kind == "rotated"
    assert storage.prune_oldest_claims(granted) == PruneOutcome.pruned(0)
    assert storage.rebuild_terminal_counters(granted) >= 0  # TRUNCATE of the live counts
    reports = Maintainer(storage, granted).run_all()
    assert [r.error for r in reports] == [None] * len(reports)
    assert storage.queue_counts(granted, "q").terminal == 3


@pytest.mark.parametrize("statement", [
    f"CREATE TABLE {SCHEMA}.evil (i int)",
    f"DROP TABLE {SCHEMA}.deferred_jobs",
    f"ALTER TABLE {SCHEMA}.ready_entries ADD COLUMN evil int",
    f"CREATE INDEX evil ON {SCHEMA}.queue_meta (queue)",
    f"DROP FUNCTION {SCHEMA}.backoff_duration(integer, integer)",
    "CREATE SCHEMA evil",
    f"TRUNCATE {SCHEMA}.deferred_jobs",
    f"UPDATE {SCHEMA}.storage_config SET queue_slot_count = 8",
    f"DELETE FROM {SCHEMA}.qstore_alembic_version",
])
def test_the_runtime_role_is_refused_ddl_and_writes_to_the_recorded_shape(granted, statement):
    with granted.connect() as conn, pytest.raises(Exception) as info:
        conn.execute(text(statement))
    assert getattr(getattr(info.value, "orig", None), "sqlstate", None) == "42501", info.value


def test_the_runtime_role_cannot_install_another_schema(roles, granted, capsys):
    code = qstore_cli(["install", "--url", roles.runtime_url, "--schema", "other"], out=io.StringIO())
    err = capsys.readouterr().err.strip()
    assert code == 1 and "42501" in err and "permission denied" in err and "\n" not in err


def test_print_grants_prints_what_grant_applies(roles):
    out = io.StringIO()
    assert qstore_cli(["install", "--url", roles.owner_url, "--schema", SCHEMA, *SMALL,
                       "--print-grants", roles.runtime], out=out) == 0
    printed = out.getvalue().splitlines()
    engine = create_engine(roles.owner_url, poolclass=pool.NullPool)
    with engine.connect() as conn:  # nothing was installed
        assert conn.execute(text("SELECT to_regnamespace(:s)"), {"s": SCHEMA}).scalar() is None
    engine.dispose()
    assert printed[0] == f'GRANT USAGE ON SCHEMA "{SCHEMA}" TO "{roles.runtime}";'
    assert all(line.endswith(";") for line in printed)


def test_truncate_is_granted_only_on_the_tables_upkeep_truncates():
    from qstore import QueueStorageConfig

    config = QueueStorageConfig(schema=SCHEMA, queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)
    names = truncated_tables(config)
    assert "ready_entries_3" in names and "lease_claims_1" in names and "queue_terminal_live_counts" in names
    assert "deferred_jobs" not in names and "storage_config" not in names
    revoke = next(s for s in runtime_grants(config, "rt") if s.startswith("REVOKE TRUNCATE"))
    assert '"deferred_jobs"' in revoke and '"ready_entries_0"' not in revoke


def test_grant_to_a_missing_role_is_one_line_naming_it(roles, capsys):
    code = qstore_cli(["install", "--url", roles.owner_url, "--schema", SCHEMA, "--grant", "nobody_here"],
                      out=io.StringIO())
    err = capsys.readouterr().err.strip()
    assert code == 1 and "'nobody_here'" in err and "no such role" in err and "\n" not in err

