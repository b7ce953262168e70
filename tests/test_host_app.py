"""A host application carries qstore through its own Alembic, exactly as the README says.

Each test makes a throwaway host project (``alembic init``, then the README's ``[alembic]``
section, ``env.py`` and ``myapp/models.py``) and runs the README's commands in-process
through Alembic's own command line (``alembic.config.CommandLine``), so a command is parsed
exactly as the shell would pass it.
"""

from __future__ import annotations

import io
import logging
import re
import shlex
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import alembic.config
import pytest
from alembic.config import CommandLine, Config
from docblocks import host_recipe
from sqlalchemy import Engine, create_engine, func, inspect, pool, select, text
from sqlalchemy.orm import Session

from qstore import InsertOpts, InsertParams, QueueStorage, QueueStorageConfig, ValidationError
from qstore.cli import main as qstore_cli
from qstore.migrate import REVISIONS, VersionRecord, install_state, version_location
from qstore.runtime.maintainer import Maintainer

HEAD = REVISIONS[-1]
RECIPE = host_recipe()
COMMANDS = [line.split("#")[0].strip() for line in RECIPE["commands"].splitlines() if line.strip()]

LINES_MODEL = textwrap.dedent("""
    from sqlalchemy import ForeignKey
    lines = Table("order_lines", metadata,
                  Column("id", Integer, primary_key=True),
                  Column("order_id", ForeignKey("orders.id"), nullable=False))
""")


class Host:
    """The host project: its directory, database and a way to run ``alembic …`` lines."""

    def __init__(self, root: Path, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.root, self.url, self.capsys = root, url, capsys

    def alembic(self, line: str) -> str:
        """Run one ``alembic …`` command line; returns what it printed. A refusal raises
        ``SystemExit`` after printing ``FAILED: …`` (as the real command does)."""
        argv = shlex.split(line)
        assert argv[0] == "alembic", line
        printed = io.StringIO()

        class PrintingHere(Config):  # Config's default stdout is bound when alembic is imported
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **{**kwargs, "stdout": printed})

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(alembic.config, "Config", PrintingHere)
            CommandLine(prog="alembic").main(argv=argv[1:])
        return printed.getvalue() + self.capsys.readouterr().out

    def refused(self, line: str) -> str:
        """Run ``line`` expecting Alembic's one-line refusal; returns it."""
        with pytest.raises(SystemExit):
            self.alembic(line)
        printed = self.capsys.readouterr()
        assert "Traceback" not in printed.out + printed.err
        failed = [ln for ln in (printed.out + printed.err).splitlines() if ln.startswith("FAILED: ")]
        assert len(failed) == 1, printed
        return failed[0]

    def engine(self) -> Engine:
        return create_engine(self.url, poolclass=pool.NullPool)

    def versions(self) -> set[str]:
        with self.engine().connect() as conn:
            return set(conn.execute(text("SELECT version_num FROM public.alembic_version")).scalars())

    def revision_files(self) -> list[Path]:
        return sorted((self.root / "migrations" / "versions").glob("*.py"))


def _alembic_section(ini: str, section: str) -> str:
    """``ini`` with its ``[alembic]`` section replaced by ``section``."""
    start = ini.index("[alembic]")
    nxt = re.search(r"^\[", ini[start + 1:], re.MULTILINE)
    end = start + 1 + nxt.start() if nxt else len(ini)
    return ini[:start] + section.strip() + "\n\n" + ini[end:]


@pytest.fixture
def host(tmp_path: Path, fresh_db_url: str, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> Iterator[Host]:
    root = tmp_path / "app"
    root.mkdir()
    monkeypatch.chdir(root)
    monkeypatch.setenv("DATABASE_URL", fresh_db_url)
    monkeypatch.setattr(sys, "path", list(sys.path))  # prepend_sys_path adds "." for the test only
    # a finder cached for "." would keep finding an earlier test's project
    monkeypatch.setattr(sys, "path_importer_cache", {})
    logger = logging.getLogger()
    handlers, level = list(logger.handlers), logger.level
    made = Host(root, fresh_db_url, capsys)
    made.alembic("alembic init migrations")
    ini = root / "alembic.ini"
    ini.write_text(_alembic_section(ini.read_text(), RECIPE["alembic.ini [alembic]"]))
    (root / "migrations" / "env.py").write_text(RECIPE["migrations/env.py"])
    (root / "myapp").mkdir()
    (root / "myapp" / "__init__.py").write_text("")
    (root / "myapp" / "models.py").write_text(RECIPE["myapp/models.py"])
    capsys.readouterr()
    try:
        yield made
    finally:
        for name in [m for m in sys.modules if m == "myapp" or m.startswith("myapp.")]:
            del sys.modules[name]
        logger.handlers[:] = handlers
        logger.setLevel(level)


def _revision_id(path: Path) -> str:
    """The ``revision`` a generated revision file declares."""
    found = re.search(r"^revision(?:: str)? = '(\w+)'", path.read_text(), re.MULTILINE)
    assert found, path
    return found[1]


def _qstore_package_files() -> list[str]:
    return sorted(p.name for p in Path(version_location()).iterdir())


def _run_recipe(host: Host) -> None:
    """The README's commands up to (not including) the downgrade."""
    for line in COMMANDS:
        if "downgrade" not in line:
            host.alembic(line)


# -- the recipe as written --------------------------------------------------------------------


def test_the_recipe_installs_qstore_and_the_hosts_table_at_both_heads(host):
    shipped = _qstore_package_files()
    _run_recipe(host)
    (revision,) = host.revision_files()
    assert "create_orders" in revision.name
    assert _qstore_package_files() == shipped  # nothing written into qstore's package
    mine = _revision_id(revision)
    assert host.versions() == {mine, HEAD}
    with host.engine().connect() as conn:
        insp = inspect(conn)
        assert insp.has_table("orders", schema="public")
        assert insp.has_table("ready_entries", schema="qstore")


def test_autogenerate_continues_the_hosts_branch_never_qstores(host):
    _run_recipe(host)
    (root,) = host.revision_files()
    (host.root / "myapp" / "models.py").write_text(RECIPE["myapp/models.py"] + LINES_MODEL)
    del sys.modules["myapp.models"]
    host.alembic('alembic revision --autogenerate -m "order lines"')
    second = next(p for p in host.revision_files() if p != root)
    first_id = _revision_id(root)
    assert re.search(rf"^down_revision.* = '{first_id}'", second.read_text(), re.MULTILINE)
    heads = host.alembic("alembic heads")
    assert f"{HEAD} (qstore) (head)" in heads and len(heads.strip().splitlines()) == 2


def test_check_reports_no_drift_and_sees_a_change_of_the_hosts_own(host):
    _run_recipe(host)
    assert "No new upgrade operations detected" in host.alembic("alembic check")
    (host.root / "myapp" / "models.py").write_text(RECIPE["myapp/models.py"] + LINES_MODEL)
    del sys.modules["myapp.models"]
    assert "order_lines" in host.refused("alembic check")


@pytest.mark.slow
def test_check_ignores_a_second_storage_schema_installed_on_its_own(host):
    _run_recipe(host)
    assert qstore_cli(["install", "--url", host.url, "--schema", "jobs"], out=io.StringIO()) == 0
    assert "No new upgrade operations detected" in host.alembic("alembic check")


@pytest.mark.slow
def test_downgrade_as_written_steps_the_hosts_branch_back_and_keeps_qstores(host):
    _run_recipe(host)
    (revision,) = host.revision_files()
    mine = _revision_id(revision)
    (line,) = [c for c in COMMANDS if "downgrade" in c]
    host.alembic(line.replace("<your-head>", mine))
    assert host.versions() == {HEAD}
    with host.engine().connect() as conn:
        assert not inspect(conn).has_table("orders", schema="public")


def test_a_bare_relative_downgrade_is_refused_naming_the_command_to_run(host):
    _run_recipe(host)
    (revision,) = host.revision_files()
    mine = _revision_id(revision)
    err = host.refused("alembic downgrade -1")
    assert f"alembic downgrade {mine}@-1" in err and "alembic downgrade qstore@-1" in err
    assert len(host.versions()) == 2


def test_upgrade_head_singular_is_alembics_multiple_heads_error(host):
    _run_recipe(host)
    assert "heads" in host.refused("alembic upgrade head")


def test_upgrade_head_singular_works_until_the_host_has_a_revision_of_its_own(host):
    host.alembic("alembic upgrade head")  # qstore's branch is the whole history: one head
    assert host.versions() == {HEAD}
    host.alembic('alembic revision -m "first"')  # the host's branch: a second head
    assert "Multiple head revisions" in host.refused("alembic upgrade head")
    host.alembic("alembic upgrade heads")
    assert host.versions() == {HEAD, _revision_id(host.revision_files()[0])}


def test_a_host_with_revisions_of_its_own_needs_heads_from_the_first_upgrade(host):
    host.alembic('alembic revision -m "before qstore"')  # an existing project's history
    assert "Multiple head revisions" in host.refused("alembic upgrade head")
    host.alembic("alembic upgrade qstore@head")  # one branch's head names one head
    assert host.versions() == {HEAD}


def test_a_revision_on_qstores_head_is_refused(host):
    _run_recipe(host)
    before, shipped = host.revision_files(), _qstore_package_files()
    err = host.refused('alembic revision -m "oops" --head qstore@head')
    assert "qstore's branch" in err
    assert (host.revision_files(), _qstore_package_files()) == (before, shipped)


def test_a_plain_revision_before_any_of_the_hosts_own_starts_the_hosts_branch(host):
    host.alembic("alembic upgrade heads")  # only qstore's branch so far: its head is the only one
    shipped = _qstore_package_files()
    host.alembic('alembic revision -m "first"')
    (revision,) = host.revision_files()
    assert re.search(r"^down_revision.* = None", revision.read_text(), re.MULTILINE)
    assert _qstore_package_files() == shipped


# -- the host's application code and qstore's entry points on that install ------------------


def test_enqueue_in_an_orm_session_commits_and_rolls_back_with_the_hosts_rows(host):
    _run_recipe(host)
    from myapp.models import orders  # the host's own table, created by its revision

    engine = host.engine()
    storage = QueueStorage.from_existing_schema("qstore", engine)
    job = InsertParams("ship", {"n": 1}, InsertOpts(queue="ship"))
    with Session(engine) as session:
        session.execute(orders.insert().values(item="lamp"))
        storage.enqueue(session, job)
        session.rollback()
    assert storage.queue_counts(engine, "ship").available == 0
    with Session(engine) as session:
        session.execute(orders.insert().values(item="desk"))
        storage.enqueue(session, job)
        session.commit()
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(orders)).scalar() == 1
    assert storage.queue_counts(engine, "ship").available == 1


def test_install_recognises_the_hosts_version_row(host):
    _run_recipe(host)
    engine = host.engine()
    with engine.connect() as conn:
        state = install_state(conn, "qstore")
    assert state.version is not None and state.version.host
    assert (state.version.revision, state.version.table) == (HEAD, "public.alembic_version")
    QueueStorage().install(engine)  # at head: nothing to do, no error
    assert QueueStorage.active_schema(engine) == "qstore"


def test_the_cli_and_the_maintainer_work_on_the_hosts_install(host):
    _run_recipe(host)
    out = io.StringIO()
    assert qstore_cli(["install", "--url", host.url], out=out) == 0
    assert "already at head" in out.getvalue()
    assert qstore_cli(["maintain", "--once", "--url", host.url], out=io.StringIO()) == 0
    engine = create_engine(host.url)
    try:
        reports = Maintainer(QueueStorage.from_existing_schema("qstore", engine), engine).run_all()
    finally:
        engine.dispose()
    assert [r.error for r in reports] == [None] * len(reports)


def test_install_behind_head_says_the_hosts_alembic_upgrades_it(host):
    host.alembic(f"alembic upgrade qstore@{REVISIONS[-2]}")
    with pytest.raises(ValidationError) as info:
        QueueStorage().install(host.engine())
    message = str(info.value)
    assert f"at revision {REVISIONS[-2]}" in message and "public.alembic_version" in message
    assert "alembic upgrade heads" in message


# -- a second storage schema, and the shape ---------------------------------------------------


def test_a_second_schema_through_the_hosts_alembic_is_refused_with_the_alternative(host):
    _run_recipe(host)
    err = host.refused("alembic -x schema=jobs upgrade heads")
    assert "one Alembic history carries one storage schema" in err
    assert "qstore install --url … --schema jobs" in err
    with host.engine().connect() as conn:
        assert not inspect(conn).has_schema("jobs")


@pytest.mark.slow
def test_the_alternative_for_a_second_schema_keeps_its_own_version_row(host):
    _run_recipe(host)
    before = host.versions()
    assert qstore_cli(["install", "--url", host.url, "--schema", "jobs",
                       "--queue-slot-count", "4"], out=io.StringIO()) == 0
    with host.engine().connect() as conn:
        jobs, default = install_state(conn, "jobs"), install_state(conn, "qstore")
    assert jobs.version == VersionRecord(HEAD, "jobs.qstore_alembic_version", host=False)
    assert default.version == VersionRecord(HEAD, "public.alembic_version", host=True)
    host.alembic("alembic upgrade heads")  # the host's runs leave it alone
    assert host.versions() == before


def test_the_first_upgrade_may_choose_the_schema_and_shape(host):
    host.alembic("alembic -x schema=jobs -x queue_slot_count=4 upgrade heads")
    engine = host.engine()
    assert QueueStorage.from_existing_schema("jobs", engine).queue_slot_count() == 4
    host.alembic("alembic -x schema=jobs upgrade heads")  # the recorded shape is read back


def test_a_conflicting_x_shape_in_the_host_is_one_error_naming_both_values(host):
    host.alembic("alembic -x schema=jobs -x queue_slot_count=8 upgrade heads")
    err = host.refused("alembic -x schema=jobs -x queue_slot_count=4 upgrade heads")
    assert "queue_slot_count=4" in err and "queue_slot_count=8" in err
    assert "Resizing an install is not supported" in err


def test_qstore_install_refuses_a_schema_the_host_carries_at_another_shape(host):
    host.alembic("alembic -x schema=jobs -x queue_slot_count=8 upgrade heads")
    assert qstore_cli(["install", "--url", host.url, "--schema", "jobs",
                       "--queue-slot-count", "4"], out=io.StringIO()) == 1
    assert QueueStorage.from_existing_schema("jobs", host.engine()).queue_slot_count() == 8


def test_a_schema_with_its_own_version_table_is_refused_by_the_hosts_alembic(host):
    QueueStorage(QueueStorageConfig(schema="jobs")).install(host.engine())
    err = host.refused("alembic -x schema=jobs upgrade heads")
    assert "jobs.qstore_alembic_version" in err and "qstore install --schema jobs" in err
