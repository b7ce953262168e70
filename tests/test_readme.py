"""The README's examples run as they are written, in order, against a fresh database."""

from __future__ import annotations

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


def test_the_readme_test_commands_are_the_ones_ci_runs():
    """The README's "Run the tests" block names the install and both tiers; ``.ci/run``
    installs the same extras and runs each pytest command verbatim, fast tier first."""
    text = README.read_text()
    block = text.split("## Run the tests", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["pip install -e '.[test,embedded]'", "pytest -q", "pytest -q -m slow"]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert "python -m pip install --quiet -e '.[test,embedded]'" in ci
    assert [line for line in ci if line.startswith("pytest")] == commands[1:]


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
