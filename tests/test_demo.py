"""``qstore demo``: the workload runs every job to a terminal state through a worker and a
maintainer, prints a progress line and a summary, plots on request, and keeps the ring and
table listing behind ``--show-tables``."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from qstore import cli
from qstore.cli.demo import DEMO_QUEUE
from qstore.storage import QueueStorage


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    status = cli.main(["demo", *argv], out=out)
    return status, out.getvalue()


def test_demo_runs_every_job_to_a_terminal_state(fresh_db_url: str) -> None:
    status, _ = run(["--url", fresh_db_url, "--jobs", "200"])
    assert status == 0
    engine = create_engine(fresh_db_url)
    try:
        counts = QueueStorage().queue_counts(engine, DEMO_QUEUE)
    finally:
        engine.dispose()
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 200)


def test_demo_summary_names_throughput_latency_outcomes_upkeep_and_health(
        fresh_db_url: str) -> None:
    status, text = run(["--url", fresh_db_url, "--jobs", "200"])
    assert status == 0
    assert "200/200 terminal" in text  # the progress line's last update
    assert "summary: 200 jobs terminal in" in text and "jobs/s" in text
    assert "pickup latency (enqueue returned -> first handler start" in text
    assert " p50 " in text and " p95 " in text and " p99 " in text
    # 200 jobs: 4 fail, 2 cancel, 6 snooze once, 20 raise once, so 194 complete
    assert "outcomes: completed 194  retried 20  failed 4  cancelled 2  snoozed 6" in text
    assert "queue counts: available 0  running 0  terminal 200" in text
    assert "maintainer: " in text and " rotations, " in text and " prunes" in text
    assert "dead tuples " in text and "bytes " in text
    assert "tables in schema" not in text  # the listing is behind --show-tables


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib not installed")
def test_demo_plot_writes_a_png(fresh_db_url: str, tmp_path: Path) -> None:
    target = tmp_path / "demo.png"
    status, text = run(["--url", fresh_db_url, "--jobs", "40", "--plot", str(target)])
    assert status == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {target}" in text


def test_demo_plot_without_matplotlib_says_so_in_one_line(
        fresh_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    target = tmp_path / "demo.png"
    status, text = run(["--url", fresh_db_url, "--jobs", "10", "--plot", str(target)])
    assert status == 0
    assert not target.exists()
    lines = [line for line in text.splitlines() if "matplotlib is not installed" in line]
    assert lines == [f"--plot {target}: matplotlib is not installed (pip install 'qstore[dev]'); "
                     "no plot written"]


def test_demo_show_tables_prints_the_rings_and_partition_names(fresh_db_url: str) -> None:
    status, text = run(["--url", fresh_db_url, "--show-tables", "--jobs", "0"])
    assert status == 0
    assert "queue ring: current_slot=0" in text
    assert "tables in schema 'qstore'" in text
    assert "ready_entries_0" in text and "lease_claims_0" in text
    assert "summary:" not in text  # --jobs 0 runs no workload


@pytest.mark.parametrize("bad", ["-1", "many", "10000001"])
def test_demo_refuses_a_bad_job_count_in_one_line(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run(["--url", "postgresql+psycopg://nobody@127.0.0.1:1/none", "--jobs", bad])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"invalid --jobs {bad!r}" in err


def test_demo_gives_up_in_one_line_when_jobs_outlast_the_timeout(
        fresh_db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _ = run(["--url", fresh_db_url, "--jobs", "200", "--timeout", "0.05"])
    assert status == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of 200 jobs terminal after 0.05 s" in err
