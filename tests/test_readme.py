"""The README's examples run as they are written, in order, against a fresh database."""

from __future__ import annotations

import re

from docblocks import README, REPO, host_recipe, runnable_blocks


def test_the_readme_marks_its_examples_runnable():
    assert len(runnable_blocks()) >= 3
    assert {"alembic.ini [alembic]", "migrations/env.py", "myapp/models.py", "commands"} <= set(host_recipe())


def test_the_readme_examples_run_in_order_against_a_fresh_database(fresh_db_url, monkeypatch, capsys):
    monkeypatch.setenv("DATABASE_URL", fresh_db_url)
    namespace: dict[str, object] = {"__name__": "readme"}
    engines = []
    try:
        for number, code in enumerate(runnable_blocks(), 1):
            exec(compile(code, f"{README.name} runnable block {number}", "exec"), namespace)
            engines.append(namespace.get("engine"))
    finally:
        for engine in {id(e): e for e in engines if e is not None}.values():
            engine.dispose()  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    assert "send_email" in out


def test_the_readme_test_command_is_the_one_ci_runs():
    text = README.read_text()
    assert "pip install -e '.[test,embedded]' && pytest -q" in text
    assert re.search(r"The whole suite \(about [\d,]+ tests\) takes about \d+ minutes", text)


def test_the_readme_cites_no_internal_notes():
    text = README.read_text()
    for word in ("STORAGE.md", "seed", "issue "):
        assert word not in text, word


def test_the_worker_guides_fastapi_example_runs_against_a_fresh_database(fresh_db_url, monkeypatch):
    monkeypatch.setenv("DATABASE_URL", fresh_db_url)
    (code,) = runnable_blocks(REPO / "docs" / "worker.md")
    namespace: dict[str, object] = {"__name__": "worker_guide"}
    try:
        exec(compile(code, "docs/worker.md runnable block", "exec"), namespace)
    finally:
        namespace["engine"].dispose()  # type: ignore[attr-defined]
    assert namespace["receipts"] == ["receipt for order 7"]
