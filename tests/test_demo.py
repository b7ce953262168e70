"""``qstore demo``: the steady run puts qstore's worker beside a classic SKIP LOCKED queue
with the horizon pinned for its middle third and prints a live progress and a side-by-side
summary; ``--plot`` is checked before anything runs; a used database is refused; ``--jobs``
keeps the bulk mode (a preloaded backlog) and ``--show-tables`` the ring and table listing."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, text

from qstore import cli
from qstore.cli.demo import DEMO_QUEUE, classic_schema
from qstore.cli.demo_classic import ClassicQueue
from qstore.cli.demo_steady import Progress
from qstore.storage import QueueStorage
from qstore.types import InsertOpts, InsertParams

SHORT = "1.5"  # seconds of a steady run in the tests: the pin from 0.5 s to 1 s


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    status = cli.main(["demo", *argv], out=out)
    return status, out.getvalue()


@pytest.fixture(scope="module")
def piped_run(module_fresh_db_url: str) -> subprocess.CompletedProcess[str]:
    """One short steady run of ``python -m qstore demo``, its stdout a pipe (not a TTY)."""
    return subprocess.run([sys.executable, "-m", "qstore", "demo", "--url", module_fresh_db_url,
                           "--duration", SHORT], capture_output=True, text=True, timeout=120)


def summary_rows(stdout: str) -> dict[str, list[str]]:
    """The summary table's rows by label: ``{"jobs done ...": [qstore, classic]}``."""
    lines = stdout.split("\nsummary: ", 1)[1].splitlines()[1:]
    rows = {}
    for line in lines:
        parts = [p for p in line.strip().split("  ") if p.strip()]
        if len(parts) == 3:
            rows[parts[0].strip()] = [p.strip() for p in parts[1:]]
    return rows


def test_a_short_steady_run_summarises_both_systems_side_by_side(
        piped_run: subprocess.CompletedProcess[str]) -> None:
    assert piped_run.returncode == 0, piped_run.stderr
    header = piped_run.stdout.split("\nsummary: ", 1)[1].splitlines()[1]
    assert header.split() == ["qstore", "classic"]
    rows = summary_rows(piped_run.stdout)
    for label in ("jobs done (completed or failed)", "jobs/s before the pin", "jobs/s during the pin",
                  "jobs/s after the pin", "pickup p95 before the pin", "pickup p95 during the pin",
                  "pickup p95 after the pin", "dead tuples at the end of the pin",
                  "bytes before the pin", "bytes at the end"):
        assert label in rows, label
    done = [int(v.replace(",", "")) for v in rows["jobs done (completed or failed)"]]
    assert all(n > 0 for n in done), done


def test_the_steady_run_pins_and_releases_the_horizon(piped_run: subprocess.CompletedProcess[str]) -> None:
    out = piped_run.stdout
    assert "horizon pinned: a transaction holding xid" in out
    assert out.index("horizon pinned") < out.index("horizon released") < out.index("\nsummary: ")


def test_piped_progress_is_plain_lines_one_per_system_per_sample(
        piped_run: subprocess.CompletedProcess[str]) -> None:
    out = piped_run.stdout
    assert "\r" not in out and "\x1b" not in out
    progress = [line for line in out.splitlines() if " jobs/s  p95 " in line]
    assert [line.split()[2] for line in progress[:2]] == ["qstore", "classic"]
    assert len(progress) % 2 == 0 and len(progress) >= 2


def test_the_steady_run_worked_jobs_through_the_qstore_install(
        piped_run: subprocess.CompletedProcess[str], module_fresh_db_url: str) -> None:
    engine = create_engine(module_fresh_db_url)
    try:
        counts = QueueStorage().queue_counts(engine, DEMO_QUEUE)
    finally:
        engine.dispose()
    assert counts.terminal > 0


def test_progress_on_a_terminal_redraws_its_lines_in_place() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    progress = Progress(out)
    progress.show(["a1", "b1"])
    progress.show(["a2", "b2"])
    assert out.getvalue() == "\r\x1b[Ka1\n\r\x1b[Kb1\n\x1b[2A\r\x1b[Ka2\n\r\x1b[Kb2\n"


def test_plot_without_matplotlib_is_refused_in_one_line_before_anything_runs(
        fresh_db_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    status, text_out = run(["--url", fresh_db_url, "--plot", "run.png"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--plot needs matplotlib" in err
    assert text_out == ""
    engine = create_engine(fresh_db_url)
    try:
        with engine.connect() as conn:
            schemas = conn.execute(text("SELECT count(*) FROM pg_namespace WHERE nspname IN "
                                        "('qstore', 'qstore_classic')")).scalar_one()
    finally:
        engine.dispose()
    assert schemas == 0  # nothing was installed: the refusal came first


def test_a_schema_holding_a_qstore_install_with_jobs_is_refused(
        storage: QueueStorage, engine: Engine, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    storage.enqueue(engine, InsertParams("k", {}, InsertOpts(queue="elsewhere")))
    status, _ = run(["--url", db_url, "--schema", storage.schema()])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"schema {storage.schema()!r} already holds a qstore install with 1 job;" in err


def test_a_classic_schema_holding_jobs_is_refused(fresh_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    q = ClassicQueue(fresh_db_url, classic_schema("qstore"))
    q.create()
    with q.connect() as conn:
        q.enqueue(conn, "k", [{}], [0.0])
    status, _ = run(["--url", fresh_db_url])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'qstore_classic' already holds a classic jobs table with 1 row;" in err


@pytest.mark.parametrize(("argv", "named"), [
    (["--duration", "0"], "invalid --duration '0'"),
    (["--duration", "soon"], "invalid --duration 'soon'"),
    (["--rate", "-5"], "invalid --rate '-5'"),
    (["--rate", "nan"], "invalid --rate 'nan'"),
    (["--jobs", "100", "--rate", "50"], "--jobs runs the bulk mode"),
])
def test_a_bad_steady_option_is_refused_in_one_line(argv: list[str], named: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run(["--url", "postgresql+psycopg://nobody@127.0.0.1:1/none", *argv])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and named in err


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_the_steady_run_plots_a_png(fresh_db_url: str, tmp_path: Path) -> None:
    target = tmp_path / "demo.png"
    status, text_out = run(["--url", fresh_db_url, "--duration", SHORT, "--plot", str(target)])
    assert status == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {target}" in text_out


# -- the bulk mode (--jobs) --------------------------------------------------------------------


def test_bulk_mode_runs_every_job_to_a_terminal_state(fresh_db_url: str) -> None:
    status, _ = run(["--url", fresh_db_url, "--jobs", "200"])
    assert status == 0
    engine = create_engine(fresh_db_url)
    try:
        counts = QueueStorage().queue_counts(engine, DEMO_QUEUE)
    finally:
        engine.dispose()
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 200)


def test_bulk_mode_summary_says_it_measures_a_preloaded_backlog(fresh_db_url: str) -> None:
    status, text_out = run(["--url", fresh_db_url, "--jobs", "200"])
    assert status == 0
    assert "summary (a preloaded backlog of 200 jobs drained, not a steady load): 200 jobs terminal in" in text_out
    assert "pickup latency (all jobs deferred, then the worker started: the wait in the backlog)" in text_out
    # 200 jobs: 4 fail, 2 cancel, 6 snooze once, 20 raise once, so 194 complete
    assert "outcomes: completed 194  retried 20  failed 4  cancelled 2  snoozed 6" in text_out
    assert "queue counts: available 0  running 0  terminal 200" in text_out
    assert "\r" not in text_out
    assert "tables in schema" not in text_out  # the listing is behind --show-tables


def test_demo_show_tables_prints_the_rings_and_partition_names(fresh_db_url: str) -> None:
    status, text_out = run(["--url", fresh_db_url, "--show-tables", "--jobs", "0"])
    assert status == 0
    assert "queue ring: current_slot=0" in text_out
    assert "tables in schema 'qstore'" in text_out
    assert "ready_entries_0" in text_out and "lease_claims_0" in text_out
    assert "summary" not in text_out  # --jobs 0 runs no workload


@pytest.mark.parametrize("bad", ["-1", "many", "10000001"])
def test_demo_refuses_a_bad_job_count_in_one_line(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run(["--url", "postgresql+psycopg://nobody@127.0.0.1:1/none", "--jobs", bad])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"invalid --jobs {bad!r}" in err


def test_bulk_mode_gives_up_in_one_line_when_jobs_outlast_the_timeout(
        fresh_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run(["--url", fresh_db_url, "--jobs", "200", "--timeout", "0.05"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of 200 jobs terminal after 0.05 s" in err
