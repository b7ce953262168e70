"""One shape rule at every entry point, and one-line errors with the fix.

The recorded shape wins: leaving a shape option out reads it back; an explicit value that
conflicts with it is one error naming both values; a resize is refused as unsupported.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, pool

from qstore import QueueStorage, QueueStorageConfig
from qstore.cli import main as qstore_cli
from qstore.errors import ShapeMismatchError

REPO = Path(__file__).resolve().parents[1]


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        code = qstore_cli(list(argv), out=out)
    finally:
        sys.stderr = old
    return code, out.getvalue(), err.getvalue()


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text and "Background on this error" not in text, text
    return lines[0]


@pytest.fixture
def eight_slots(fresh_db_url):
    assert _cli("install", "--url", fresh_db_url, "--schema", "s1", "--queue-slot-count", "8")[0] == 0
    return fresh_db_url


# -- install() ------------------------------------------------------------------------------


def test_install_with_a_conflicting_config_names_both_values(eight_slots):
    engine = create_engine(eight_slots, poolclass=pool.NullPool)
    with pytest.raises(ShapeMismatchError) as info:
        QueueStorage(QueueStorageConfig(schema="s1", queue_slot_count=4)).install(engine)
    assert info.value.conflicts == {"queue_slot_count": (8, 4)}
    message = str(info.value)
    assert "queue_slot_count=4" in message and "queue_slot_count=8" in message
    assert "Resizing an install is not supported" in message
    assert QueueStorage.from_existing_schema("s1", engine).queue_slot_count() == 8


def test_install_with_the_recorded_shape_is_a_no_op(eight_slots):
    engine = create_engine(eight_slots, poolclass=pool.NullPool)
    assert QueueStorage(QueueStorageConfig(schema="s1", queue_slot_count=8)).prepare_schema(engine) is False


# -- the command line -------------------------------------------------------------------------


def test_cli_install_without_shape_options_reads_the_recorded_shape(eight_slots):
    code, out, _ = _cli("install", "--url", eight_slots, "--schema", "s1")
    assert code == 0 and "already at head" in out


def test_cli_install_with_a_conflicting_slot_count_is_one_line_naming_both_values(eight_slots):
    code, _, err = _cli("install", "--url", eight_slots, "--schema", "s1", "--queue-slot-count", "4")
    line = _one_line(err)
    assert code == 1
    assert "queue_slot_count=4" in line and "queue_slot_count=8" in line
    assert line.count("QueueStorageConfig(") == 0


def test_cli_maintain_with_a_conflicting_slot_count_is_refused(eight_slots):
    code, _, err = _cli("maintain", "--once", "--url", eight_slots, "--schema", "s1",
                        "--queue-slot-count", "99")
    line = _one_line(err)
    assert code == 1 and "queue_slot_count=99" in line and "queue_slot_count=8" in line


def test_cli_maintain_with_the_recorded_slot_count_runs(eight_slots):
    code, _, _ = _cli("maintain", "--once", "--url", eight_slots, "--schema", "s1",
                      "--queue-slot-count", "8")
    assert code == 0


def test_cli_maintain_of_a_missing_schema_says_what_the_database_holds(eight_slots):
    code, _, err = _cli("maintain", "--once", "--url", eight_slots, "--schema", "nope")
    line = _one_line(err)
    assert code == 1 and "'nope' is not installed" in line and "'s1' (" in line


# -- standalone alembic (the repository's alembic.ini) ----------------------------------------


def _alembic(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "QSTORE_DATABASE_URL"}
    return subprocess.run([sys.executable, "-m", "alembic", "-c", str(REPO / "alembic.ini"), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_standalone_alembic_with_a_conflicting_x_shape_is_one_failed_line(eight_slots):
    proc = _alembic("-x", f"url={eight_slots}", "-x", "schema=s1", "-x", "queue_slot_count=4",
                    "upgrade", "head")
    assert proc.returncode != 0
    failed = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1 and "Traceback" not in proc.stderr
    assert "queue_slot_count=4" in failed[0] and "queue_slot_count=8" in failed[0]


def test_standalone_alembic_without_a_url_is_one_failed_line_with_the_fix():
    proc = _alembic("upgrade", "head")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    (failed,) = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines() if ln.startswith("FAILED")]
    assert "-x url=" in failed and "QSTORE_DATABASE_URL" in failed


def test_standalone_alembic_against_a_refused_connection_is_one_failed_line():
    proc = _alembic("-x", "url=postgresql+psycopg://postgres@127.0.0.1:1/nothing", "upgrade", "head")
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    out = proc.stdout + proc.stderr
    (failed,) = [ln for ln in out.splitlines() if ln.startswith("FAILED")]
    assert "cannot connect to postgresql+psycopg://postgres@127.0.0.1:1/nothing" in failed
    assert "Background on this error" not in out


# -- one-line command-line errors ---------------------------------------------------------------


def test_cli_install_with_a_url_that_is_not_one_is_one_line_with_the_expected_form():
    code, _, err = _cli("install", "--url", "notaurl")
    line = _one_line(err)
    assert code == 1 and "'notaurl'" in line and "postgresql+psycopg://" in line


def test_cli_install_with_a_refused_connection_is_one_line_with_the_fix():
    code, _, err = _cli("install", "--url", "postgresql+psycopg://postgres@127.0.0.1:1/app")
    line = _one_line(err)
    assert code == 1 and "cannot connect to" in line and "check that the server is running" in line


def test_cli_install_without_any_url_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("QSTORE_DATABASE_URL", raising=False)
    code, _, err = _cli("install")
    line = _one_line(err)
    assert code == 1 and "--url" in line and "QSTORE_DATABASE_URL" in line


def test_python_m_qstore_install_notaurl_prints_one_line_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "qstore", "install", "--url", "notaurl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert _one_line(proc.stderr).startswith("qstore: invalid --url='notaurl'")


def test_cli_maintain_exits_1_with_one_line_when_its_schema_is_dropped(engine, db_url, make_storage):
    from installs import unique_schema
    from sqlalchemy import text

    st = make_storage(schema=unique_schema())
    proc = subprocess.Popen([sys.executable, "-m", "qstore", "maintain", "--url", db_url, "--schema", st.schema()],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "running until interrupted" in proc.stdout.readline()
        with engine.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{st.schema()}" CASCADE'))
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1, (out, err)
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"qstore: qstore schema '{st.schema()}' is not installed"), err
    assert len(lines) <= 3 and "Traceback" not in err, err  # at most a warning of the failing task first
