"""Alembic carries the schema: Alembic's command line against brand-new databases.

Commands run in-process through Alembic's own command line (``alembic.config.CommandLine``,
so arguments are parsed exactly as the shell passes them); one test runs the real
``python -m alembic`` from another directory. A test whose starting point is a database some
commands left (``migrated("upgrade", "0002")``) gets a copy of a template database those
commands made once for the module (``CREATE DATABASE … TEMPLATE``: an exact copy of every
object and row).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shlex
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from alembic.config import CommandLine, Config
from conftest import FreshDatabases, sqlalchemy_url
from psycopg import sql
from pytest_postgresql.executors import NoopExecutor
from sqlalchemy import Engine, create_engine, inspect, pool, text

import qstore
from qstore import QueueStorage
from qstore.migrate import BRANCH_LABEL, REVISIONS, version_location

REPO = Path(__file__).resolve().parents[1]
INI = REPO / "alembic.ini"
HEAD = REVISIONS[-1]
RESERVE = ("SELECT {s}.reserve_lanes(ARRAY['q'], ARRAY['q'], ARRAY[2]::smallint[], "
           "ARRAY[0]::smallint[], ARRAY[1])")


def alembic(url: str, *args: str, ini: Path = INI,
            check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``alembic -c ini -x url=url *args`` through Alembic's command line, in-process,
    without ``QSTORE_DATABASE_URL``. The exit status is 0, or what the command exits with
    (a refusal prints ``FAILED: …`` and exits), or 1 with the traceback on stderr."""
    argv = ["-c", str(ini), "-x", f"url={url}", *args]
    out, err = io.StringIO(), io.StringIO()
    cli = CommandLine(prog="alembic")
    options = cli.parser.parse_args(argv)
    status = 0
    with pytest.MonkeyPatch.context() as env, contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        env.delenv("QSTORE_DATABASE_URL", raising=False)
        try:
            cli.run_cmd(Config(file_=str(ini), ini_section=options.name, cmd_opts=options,
                               stdout=out), options)
        except SystemExit as exit_:
            status = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:
            status = 1
            err.write(traceback.format_exc())
    proc = subprocess.CompletedProcess(["alembic", *argv], status, out.getvalue(), err.getvalue())
    if check and proc.returncode != 0:
        raise AssertionError(
            f"alembic {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def alembic_process(url: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the real ``python -m alembic`` command in ``cwd``; it must succeed."""
    env = {k: v for k, v in os.environ.items() if k != "QSTORE_DATABASE_URL"}
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(INI), "-x", f"url={url}", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=300,
    )
    assert proc.returncode == 0, f"alembic {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


class Templates:
    """Template databases, one per list of ``alembic`` command lines, each made on first use
    by running those commands against a brand-new database."""

    def __init__(self, server: NoopExecutor, fresh: FreshDatabases) -> None:
        self.server, self.fresh = server, fresh
        self.made: dict[tuple[str, ...], str] = {}

    def url(self, name: str) -> str:
        return sqlalchemy_url(self.server, name)

    def copy(self, commands: tuple[str, ...]) -> str:
        """The name of a new database equal to what ``commands`` left in an empty one."""
        if commands not in self.made:
            name = self.fresh.take()
            for command in commands:
                alembic(self.url(name), *shlex.split(command))
            self.made[commands] = name
        copy = f"qstore_copy_{uuid.uuid4().hex[:10]}"
        s = self.server
        with psycopg.connect(host=s.host, port=s.port, user=s.user, password=s.password,
                             dbname=s.maintenance_dbname, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(copy), sql.Identifier(self.made[commands])))
        return copy

    def close(self) -> None:
        for name in self.made.values():
            self.fresh.give_back(name)


@pytest.fixture(scope="module")
def templates(pg_server: NoopExecutor, fresh_databases: FreshDatabases) -> Iterator[Templates]:
    made = Templates(pg_server, fresh_databases)
    yield made
    made.close()


@pytest.fixture
def migrated(templates: Templates, fresh_databases: FreshDatabases) -> Iterator[Callable[..., str]]:
    """``migrated("upgrade 0002", …)`` → URL of a brand-new database holding exactly what
    those ``alembic`` command lines (``-x url`` implied) leave in an empty one; dropped after
    the test."""
    copies: list[str] = []

    def at(*commands: str) -> str:
        copies.append(templates.copy(commands))
        return templates.url(copies[-1])

    yield at
    for name in copies:
        fresh_databases.give_back(name)


@contextmanager
def engine_on(url: str) -> Iterator[Engine]:
    """A pool-less engine on ``url``, disposed on exit (also when the block fails)."""
    eng = create_engine(url, poolclass=pool.NullPool)
    try:
        yield eng
    finally:
        eng.dispose()


def _execute(url: str, *statements: str) -> None:
    """Run ``statements`` in one committed transaction."""
    with engine_on(url) as eng, eng.begin() as conn:
        for statement in statements:
            conn.execute(text(statement))


def _version(url: str, schema: str) -> str | None:
    with engine_on(url) as eng, eng.connect() as conn:
        v = conn.execute(text(f"SELECT version_num FROM {schema}.qstore_alembic_version")).scalar()
    return v


def _objects(url: str, schema: str) -> dict[str, set[str]]:
    """Every relation (by kind), function and type left in ``schema``."""
    with engine_on(url) as eng, eng.connect() as conn:
        rels = conn.execute(text(
            "SELECT c.relkind, c.relname FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = :s"),
            {"s": schema}).all()
        procs = set(conn.execute(text(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = :s"), {"s": schema}).scalars())
        types = set(conn.execute(text(
            "SELECT t.typname FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace "
            "WHERE n.nspname = :s"), {"s": schema}).scalars())
    out: dict[str, set[str]] = {"functions": procs, "types": types}
    for kind, name in rels:
        out.setdefault(kind, set()).add(name)
    return out


# -- upgrade ------------------------------------------------------------------------------


def test_upgrade_head_on_empty_database_creates_default_schema_at_head(fresh_db_url, tmp_path):
    alembic_process(fresh_db_url, "upgrade", "head", cwd=tmp_path)  # the real command, elsewhere
    with engine_on(fresh_db_url) as eng:
        insp = inspect(eng)
        assert "qstore" in insp.get_schema_names()
        assert insp.has_table("qstore_alembic_version", schema="qstore")
        assert insp.has_table("ready_entries", schema="qstore")
    assert _version(fresh_db_url, "qstore") == HEAD


def test_upgrade_head_installs_default_shape_with_sixteen_queue_slots(migrated):
    url = migrated("upgrade head")
    with engine_on(url) as eng:
        assert QueueStorage.from_existing_schema("qstore", eng).config == QueueStorage().config


@pytest.mark.slow
def test_upgrade_with_x_schema_and_slot_count_creates_and_records_that_shape(migrated):
    url = migrated("-x schema=custom -x queue_slot_count=5 upgrade head")
    objs = _objects(url, "custom")
    assert {f"ready_entries_{k}" for k in range(5)} <= objs["r"]
    assert "ready_entries_5" not in objs["r"]
    with engine_on(url) as eng:
        with eng.connect() as conn:
            recorded = conn.execute(text(
                "SELECT schema_name, queue_slot_count FROM custom.storage_config")).one()
        assert tuple(recorded) == ("custom", 5)
        s = QueueStorage.from_existing_schema("custom", eng)
    assert (s.schema(), s.queue_slot_count(), s.lease_slot_count()) == ("custom", 5, 8)


def test_upgrade_of_custom_schema_does_not_create_the_default_schema(migrated):
    url = migrated("-x schema=custom -x queue_slot_count=5 upgrade head")
    with engine_on(url) as eng:
        assert "qstore" not in inspect(eng).get_schema_names()


def test_two_storage_schemas_coexist_each_with_its_own_version_table(fresh_db_url):
    alembic(fresh_db_url, "-x", "schema=alpha", "upgrade", "head")
    alembic(fresh_db_url, "-x", "schema=beta", "-x", "queue_slot_count=4", "upgrade", "head")
    assert _version(fresh_db_url, "alpha") == HEAD
    assert _version(fresh_db_url, "beta") == HEAD
    alembic(fresh_db_url, "-x", "schema=alpha", "downgrade", "base")
    assert "ready_entries" not in _objects(fresh_db_url, "alpha").get("p", set())
    assert "ready_entries" in _objects(fresh_db_url, "beta")["p"]
    assert _version(fresh_db_url, "beta") == HEAD


@pytest.mark.slow
def test_upgrade_keeps_rows_written_at_the_previous_revision(migrated):
    url = migrated("upgrade 0001")
    assert _version(url, "qstore") == "0001"
    with engine_on(url) as eng:
        with eng.begin() as conn:
            assert "dlq_enabled" not in {c["name"] for c in inspect(conn).get_columns(
                "queue_meta", schema="qstore")}
            conn.execute(text("INSERT INTO qstore.queue_meta (queue, paused) VALUES ('mail', true)"))
            conn.execute(text(
                "INSERT INTO qstore.deferred_jobs (job_id, kind, queue, priority, state) "
                "VALUES (42, 'send', 'mail', 2, 'scheduled')"))
            conn.execute(text(RESERVE.format(s="qstore")))
        alembic(url, "upgrade", "head")
        with eng.connect() as conn:
            meta = conn.execute(text(
                "SELECT queue, paused, dlq_enabled FROM qstore.queue_meta")).all()
            deferred = conn.execute(text(  # due: revision 0011 moved it into the wheel
                "SELECT job_id, kind, queue FROM qstore.deferred_jobs "
                "UNION ALL SELECT job_id, kind, queue FROM qstore.deferred_wheel")).all()
            heads = conn.execute(text("SELECT queue, priority FROM qstore.queue_claim_heads")).all()
            next_pos = conn.execute(text(RESERVE.format(s="qstore"))).scalar()
    assert [tuple(r) for r in meta] == [("mail", True, False)]
    assert [tuple(r) for r in deferred] == [(42, "send", "mail")]
    assert [tuple(r) for r in heads] == [("q", 2)]
    assert next_pos == [2]
    assert _version(url, "qstore") == HEAD


def _complete_signatures(url: str) -> set[str]:
    with engine_on(url) as eng, eng.connect() as conn:
        rows = conn.execute(text(
            "SELECT pg_get_function_identity_arguments(p.oid) FROM pg_proc p "
            "JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'qstore' AND p.proname = 'complete_receipts'")).scalars().all()
    return set(rows)


OLD_COMPLETE = "p_claim_slots integer[], p_job_ids bigint[], p_run_leases bigint[]"
NEW_COMPLETE = OLD_COMPLETE + ", p_kinds text[]"


@pytest.mark.slow
def test_revision_0002_installs_the_frozen_function_bodies(migrated):
    url = migrated("upgrade 0002")
    assert _complete_signatures(url) == {OLD_COMPLETE}


def test_upgrade_0003_replaces_the_completion_function(migrated):
    url = migrated("upgrade 0002")
    alembic(url, "upgrade", "0003")
    assert _complete_signatures(url) == {NEW_COMPLETE}


def test_downgrade_to_0002_restores_the_frozen_completion_function(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", "0002")
    assert _version(url, "qstore") == "0002"
    assert _complete_signatures(url) == {OLD_COMPLETE}


def _lease_claim_indexes(url: str) -> dict[str, str]:
    """Index name -> access method on the ``lease_claims`` parent and on its child 0."""
    with engine_on(url) as eng, eng.connect() as conn:
        rows = conn.execute(text(
            "SELECT c.relname, i.relname, am.amname FROM pg_index x "
            "JOIN pg_class c ON c.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid "
            "JOIN pg_am am ON am.oid = i.relam JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'qstore' AND c.relname IN ('lease_claims', 'lease_claims_0')"
        )).all()
    return {f"{table}.{index}": am for table, index, am in rows}


def _claim_body(url: str) -> str:
    with engine_on(url) as eng, eng.connect() as conn:
        body = conn.execute(text("SELECT pg_get_functiondef('qstore.claim_ready'::regproc)")).scalar_one()
    return str(body)


@pytest.mark.slow
def test_upgrade_0004_claims_through_named_ring_children(migrated):
    url = migrated("upgrade 0003")
    assert "qstore.ready_entries_0 r" not in _claim_body(url)
    alembic(url, "upgrade", "0004")
    body = _claim_body(url)
    assert "qstore.ready_entries_0 r" in body and "qstore.ready_entries_15 r" in body


def test_upgrade_0004_leaves_receipts_one_btree_and_a_ready_slot_brin(migrated):
    url = migrated("upgrade 0003")
    before = _lease_claim_indexes(url)
    assert before["lease_claims.lease_claims_stale_idx"] == "btree"
    assert before["lease_claims.lease_claims_ready_ref_idx"] == "btree"
    alembic(url, "upgrade", "0004")
    after = _lease_claim_indexes(url)
    parent = {k: v for k, v in after.items() if k.startswith("lease_claims.")}
    child = sorted(v for k, v in after.items() if k.startswith("lease_claims_0."))
    assert parent == {"lease_claims.lease_claims_pkey": "btree",
                      "lease_claims.lease_claims_deadline_idx": "brin",
                      "lease_claims.lease_claims_ready_slot_idx": "brin"}
    assert child == ["brin", "brin", "btree"]  # PostgreSQL carries the parent's set over


def test_downgrade_to_0003_restores_the_receipt_btrees(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", "0003")
    assert _version(url, "qstore") == "0003"
    idx = _lease_claim_indexes(url)
    assert "lease_claims.lease_claims_ready_slot_idx" not in idx
    assert idx["lease_claims.lease_claims_stale_idx"] == "btree"
    assert idx["lease_claims.lease_claims_ready_ref_idx"] == "btree"
    assert "qstore.ready_entries_0 r" not in _claim_body(url)  # the frozen 0003 body


#: the revision that indexes job_id of wide done rows only, and the revision below it
WIDE_DONE = "0014"
BEFORE_WIDE_DONE = REVISIONS[REVISIONS.index(WIDE_DONE) - 1]


def _done_job_id_indexes(url: str) -> dict[str, str]:
    """``table.index`` -> definition of the indexes on ``job_id`` of ``done_entries`` and of
    its child 0."""
    with engine_on(url) as eng, eng.connect() as conn:
        rows = conn.execute(text(
            "SELECT c.relname, i.relname, pg_get_indexdef(i.oid) FROM pg_index x "
            "JOIN pg_class c ON c.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'qstore' AND c.relname IN ('done_entries', 'done_entries_0') "
            "AND pg_get_indexdef(i.oid) LIKE '%(job_id)%'")).all()
    return {f"{table}.{index}": definition for table, index, definition in rows}


def test_upgrade_0014_indexes_job_id_of_wide_done_rows_only(migrated):
    url = migrated(f"upgrade {BEFORE_WIDE_DONE}")
    before = _done_job_id_indexes(url)
    assert set(before) == {"done_entries.done_entries_job_id_idx", "done_entries_0.done_entries_0_job_id_idx"}
    assert not any("WHERE" in d for d in before.values())
    alembic(url, "upgrade", WIDE_DONE)
    after = _done_job_id_indexes(url)
    assert set(after) == {"done_entries.done_entries_wide_job_id_idx", "done_entries_0.done_entries_0_job_id_idx"}
    assert all(d.endswith("WHERE (created_at IS NOT NULL)") for d in after.values()), after


def test_downgrade_below_0014_restores_the_full_job_id_index_of_done_rows(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", BEFORE_WIDE_DONE)
    assert _version(url, "qstore") == BEFORE_WIDE_DONE
    idx = _done_job_id_indexes(url)
    assert set(idx) == {"done_entries.done_entries_job_id_idx", "done_entries_0.done_entries_0_job_id_idx"}
    assert not any("WHERE" in d for d in idx.values())


#: the revision that adds the single-job enqueue function, and the revision below it
SINGLE_ENQUEUE = "0015"
BEFORE_SINGLE_ENQUEUE = REVISIONS[REVISIONS.index(SINGLE_ENQUEUE) - 1]


def _functions(url: str) -> set[str]:
    with engine_on(url) as eng, eng.connect() as conn:
        return set(conn.execute(text(
            "SELECT p.proname FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'qstore'")).scalars())


def test_upgrade_0015_adds_the_single_job_enqueue_beside_the_batch_one(migrated):
    url = migrated(f"upgrade {BEFORE_SINGLE_ENQUEUE}")
    assert "enqueue_job" not in _functions(url)
    alembic(url, "upgrade", SINGLE_ENQUEUE)
    assert {"enqueue_job", "enqueue_jobs", "reserve_lanes"} <= _functions(url)


def test_downgrade_below_0015_drops_the_single_job_enqueue_only(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", BEFORE_SINGLE_ENQUEUE)
    assert _version(url, "qstore") == BEFORE_SINGLE_ENQUEUE
    functions = _functions(url)
    assert "enqueue_job" not in functions and {"enqueue_jobs", "reserve_lanes"} <= functions


#: the revision whose claim leaves a lane once it has taken all the lane had
LANE_EXIT = "0016"


def _claim_ready_text(url: str) -> str:
    with engine_on(url) as eng, eng.connect() as conn:
        return str(conn.execute(text(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace "
            "WHERE n.nspname = 'qstore' AND p.proname = 'claim_ready'")).scalar_one())


def test_upgrade_0016_makes_the_claim_leave_a_lane_it_has_emptied(migrated):
    url = migrated(f"upgrade {SINGLE_ENQUEUE}")
    assert "v_enq_last" not in _claim_ready_text(url)
    alembic(url, "upgrade", LANE_EXIT)
    assert "EXIT WHEN v_rows = v_limit AND v_pos + v_limit > v_enq_last" in _claim_ready_text(url)


def test_downgrade_below_0016_restores_the_previous_claim(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", SINGLE_ENQUEUE)
    assert _version(url, "qstore") == SINGLE_ENQUEUE
    assert "v_enq_last" not in _claim_ready_text(url)


#: the revision whose claim looks first in the slot where it last found a lane's rows
SLOT_SEEN = "0017"


def test_upgrade_0017_makes_the_claim_look_first_where_it_last_found_rows(migrated):
    url = migrated(f"upgrade {LANE_EXIT}")
    assert "ready_slot_seen" not in _claim_ready_text(url)
    alembic(url, "upgrade", SLOT_SEEN)
    assert "current_setting('qstore.ready_slot_seen.qstore', true)" in _claim_ready_text(url)


def test_downgrade_below_0017_restores_the_claim_of_0016(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", LANE_EXIT)
    assert _version(url, "qstore") == LANE_EXIT
    text_0016 = _claim_ready_text(url)
    assert "ready_slot_seen" not in text_0016
    assert "EXIT WHEN v_rows = v_limit AND v_pos + v_limit > v_enq_last" in text_0016


# -- check --------------------------------------------------------------------------------


def test_alembic_check_reports_no_drift_after_upgrade(migrated):
    url = migrated("upgrade head")
    proc = alembic(url, "check", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "No new upgrade operations detected" in proc.stdout + proc.stderr


def test_alembic_check_reports_no_drift_for_a_custom_shape(migrated):
    url = migrated("-x schema=custom -x queue_slot_count=5 -x claim_slot_count=3 upgrade head")
    proc = alembic(url, "-x", "schema=custom", "check", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_alembic_check_fails_when_a_function_body_drifts(migrated):
    url = migrated("upgrade head")
    _execute(url,
             "CREATE OR REPLACE FUNCTION qstore.backoff_duration(attempt integer, "
             "max_attempts integer) RETURNS interval LANGUAGE sql VOLATILE AS "
             "$$ SELECT interval '1 second' $$")
    proc = alembic(url, "check", check=False)
    assert proc.returncode != 0
    assert "backoff_duration" in proc.stdout + proc.stderr


def test_alembic_check_fails_when_an_index_is_dropped(migrated):
    url = migrated("upgrade head")
    _execute(url, "DROP INDEX qstore.deferred_jobs_due_idx")
    proc = alembic(url, "check", check=False)
    assert proc.returncode != 0
    assert "deferred_jobs_due_idx" in proc.stdout + proc.stderr


def test_alembic_check_fails_when_a_partitioned_parent_index_is_dropped(migrated):
    url = migrated("upgrade head")
    _execute(url, "DROP INDEX qstore.ready_entries_job_id_idx")
    proc = alembic(url, "check", check=False)
    assert proc.returncode != 0


def test_create_all_install_has_no_drift_against_the_migrations(make_storage, db_url):
    s = make_storage(queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)
    proc = alembic(db_url, "-x", f"schema={s.schema()}", "check", check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- downgrade ----------------------------------------------------------------------------


def test_downgrade_base_removes_every_object_but_the_version_table(migrated):
    url = migrated("upgrade head")
    _execute(url, RESERVE.format(s="qstore"))  # creates two runtime lane sequences
    seqs = _objects(url, "qstore")["S"]
    assert len({s for s in seqs if s.startswith(("queue_enqueue_seq_", "queue_claim_seq_"))}) == 2
    alembic(url, "downgrade", "base")
    left = _objects(url, "qstore")
    assert left.pop("r") == {"qstore_alembic_version"}
    assert left.pop("i") == {"qstore_alembic_version_pkc"}
    assert left.pop("functions") == set()
    assert left.pop("types") == {"qstore_alembic_version", "_qstore_alembic_version"}
    assert left == {}  # no sequences, views, partitioned tables or indexes
    assert _version(url, "qstore") is None


@pytest.mark.slow
def test_downgrade_then_upgrade_reinstalls_cleanly(migrated):
    url = migrated("upgrade head")
    alembic(url, "downgrade", "base")
    alembic(url, "upgrade", "head")
    assert _version(url, "qstore") == HEAD
    assert alembic(url, "check", check=False).returncode == 0


# -- packaging and branch label -----------------------------------------------------------


def test_heads_lists_the_qstore_branch_label(fresh_db_url):
    out = alembic(fresh_db_url, "heads").stdout
    assert f"{HEAD} ({BRANCH_LABEL})" in out


def test_revision_files_ship_under_the_package_version_location():
    loc = Path(version_location())
    assert loc.is_dir()
    assert Path(qstore.__file__).parent in loc.parents
    assert {p.name for p in loc.glob("qstore_*.py")} >= {
        "qstore_0001_substrate.py", "qstore_0002_queue_dlq_policy.py",
        "qstore_0003_claim_wait_and_kind_snapshot.py", "qstore_0004_lean_claim_path.py",
        "qstore_0005_terminal_payload_null.py"}


def test_pyproject_package_data_covers_the_revision_files():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["qstore"]
    pkg = Path(qstore.__file__).parent
    covered = {Path(p).resolve() for pat in patterns for p in glob.glob(str(pkg / pat))}
    revisions = {p.resolve() for p in Path(version_location()).glob("*.py")}
    assert revisions and revisions <= covered
    assert (pkg / "migrations" / "env.py").resolve() in covered


# -- a host application's own Alembic environment -----------------------------------------

def test_host_app_upgrade_heads_creates_host_table_and_qstore_schema(fresh_db_url, host_app):
    alembic(fresh_db_url, "upgrade", "heads", ini=host_app)
    with engine_on(fresh_db_url) as eng:
        insp = inspect(eng)
        assert insp.has_table("host_orders", schema="public")
        assert insp.has_table("ready_entries", schema="qstore")
        with eng.connect() as conn:
            versions = set(conn.execute(text("SELECT version_num FROM public.alembic_version")).scalars())
    assert versions == {"h0001", HEAD}


def test_host_app_heads_lists_both_branches(fresh_db_url, host_app):
    out = alembic(fresh_db_url, "heads", ini=host_app).stdout
    assert "h0001 (host)" in out
    assert f"{HEAD} ({BRANCH_LABEL})" in out


def test_host_app_qstore_revisions_take_shape_from_x_arguments(fresh_db_url, host_app):
    alembic(fresh_db_url, "-x", "schema=jobs", "-x", "queue_slot_count=5",
            "upgrade", "heads", ini=host_app)
    with engine_on(fresh_db_url) as eng:
        s = QueueStorage.from_existing_schema("jobs", eng)
    assert (s.schema(), s.queue_slot_count()) == ("jobs", 5)


def test_host_app_check_does_not_see_the_qstore_schema_as_drift(fresh_db_url, host_app):
    alembic(fresh_db_url, "upgrade", "heads", ini=host_app)
    proc = alembic(fresh_db_url, "check", ini=host_app, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_host_app_can_upgrade_only_the_qstore_branch(fresh_db_url, host_app):
    alembic(fresh_db_url, "upgrade", f"{BRANCH_LABEL}@head", ini=host_app)
    with engine_on(fresh_db_url) as eng:
        insp = inspect(eng)
        assert insp.has_table("ready_entries", schema="qstore")
        assert not insp.has_table("host_orders", schema="public")


# -- the head declaration and the migrations install the same thing ------------------------

CATALOG = {
    "relations": """
        SELECT c.relname, c.relkind, coalesce(array_to_string(c.reloptions, ','), ''),
               coalesce(pg_get_expr(c.relpartbound, c.oid), ''),
               coalesce(pg_get_partkeydef(c.oid), '')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :s AND c.relname <> 'qstore_alembic_version'
          AND c.relname NOT LIKE 'qstore_alembic_version%'""",
    "columns": """
        SELECT c.relname, a.attname, replace(format_type(a.atttypid, a.atttypmod), :s, 'S'),
               a.attnotnull, replace(coalesce(pg_get_expr(d.adbin, d.adrelid), ''), :s, 'S')
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE n.nspname = :s AND a.attnum > 0 AND NOT a.attisdropped
          AND c.relname NOT LIKE 'qstore_alembic_version%'""",
    "indexes": """
        SELECT replace(pg_get_indexdef(i.indexrelid), :s, 'S')
        FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :s AND c.relname <> 'qstore_alembic_version'""",
    "constraints": """
        SELECT c.relname, k.conname, replace(pg_get_constraintdef(k.oid), :s, 'S')
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname = :s AND c.relname <> 'qstore_alembic_version'""",
    "functions": """
        SELECT p.proname, pg_get_function_identity_arguments(p.oid),
               replace(p.prosrc, :s, 'S'), array_to_string(p.proconfig, ',')
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = :s""",
    "views": """
        SELECT viewname, replace(definition, :s, 'S') FROM pg_views WHERE schemaname = :s""",
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, increment_by, last_value
        FROM pg_sequences WHERE schemaname = :s""",
    "types": """
        SELECT t.typname, array_to_string(array(SELECT e.enumlabel FROM pg_enum e
                                                WHERE e.enumtypid = t.oid ORDER BY e.enumsortorder), ',')
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
        WHERE n.nspname = :s AND t.typtype = 'e'""",
}


def catalog(url: str, schema: str) -> dict[str, set[tuple[object, ...]]]:
    """Every object of ``schema`` as the server describes it (schema names normalised)."""
    with engine_on(url) as eng, eng.connect() as conn:
        return {name: {tuple(r) for r in conn.execute(text(q), {"s": schema})}
                for name, q in CATALOG.items()}


@pytest.mark.parametrize("shape", [{}, {"queue_slot_count": 5, "claim_slot_count": 3,
                                        "queue_stripe_count": 2, "lease_claim_receipts": False}])
def test_create_all_and_the_migrations_install_identical_catalogs(fresh_db_url, shape):
    from qstore import QueueStorageConfig
    from qstore.storage import lifecycle

    a, b = QueueStorageConfig(schema="via_alembic", **shape), QueueStorageConfig(schema="via_create_all", **shape)
    x_args = [arg for k, v in shape.items() for arg in ("-x", f"{k}={v}")]
    alembic(fresh_db_url, "-x", "schema=via_alembic", *x_args, "upgrade", "head")
    with engine_on(fresh_db_url) as eng, eng.begin() as conn:
        lifecycle.create_all(conn, b)
    with engine_on(fresh_db_url) as eng:
        assert QueueStorage.from_existing_schema("via_alembic", eng).config == a
    left, right = catalog(fresh_db_url, "via_alembic"), catalog(fresh_db_url, "via_create_all")
    for part in CATALOG:
        assert left[part] == right[part], part
