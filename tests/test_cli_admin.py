"""The operator commands: ``qstore status``, ``qstore job show|retry|cancel`` and
``qstore dlq list|retry|purge``. Each is run through ``qstore.cli.main``; what it changed is
checked with storage reads, and every refusal is one line on stderr with exit status 1."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr

import pytest
from jobtools import add, count, params, running
from sqlalchemy import text

from qstore import QueueStorage, UniqueOpts
from qstore.cli import main
from qstore.status import UNHANDLED_KEY
from qstore.types import JobState


@pytest.fixture
def cli(db_url, st):
    """``cli("job", "show", "7")`` → ``(exit status, stdout, stderr)`` of that command on the
    test's install."""

    def run(*argv: str, schema: str | None = None, url: str | None = None) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        where = ["--url", url or db_url, "--schema", schema or st.schema()]
        with redirect_stderr(err):
            code = main([*argv, *where], out=out)
        return code, out.getvalue(), err.getvalue()

    return run


def one_line(err: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("qstore: ")
    return lines[0]


def dead(engine, s: QueueStorage, **opts: object) -> int:
    c = running(engine, s, **opts)
    assert s.fail_to_dlq(engine, c.job.id, c.job.run_lease, "poison", "bad address")
    return c.job.id


def failed(engine, s: QueueStorage, **opts: object) -> int:
    c = running(engine, s, **opts)
    s.fail_terminal(engine, c.job.id, c.job.run_lease, "fatal")
    return c.job.id


def state(engine, s: QueueStorage, job_id: int) -> JobState | None:
    row = s.load_job(engine, job_id)
    return None if row is None else row.state


# -- status ---------------------------------------------------------------------------------


def test_status_prints_a_row_per_queue_and_the_rings_and_families(engine, st, cli):
    add(engine, st, queue="mail")
    add(engine, st, queue="mail")
    failed(engine, st, queue="mail")
    code, out, _ = cli("status")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith(f"qstore schema {st.schema()!r}: queue ring 16 slots")
    header = next(line for line in lines if line.startswith("QUEUE"))
    row = next(line for line in lines if line.startswith("mail "))
    cells = dict(zip(header.split(), row.split(), strict=True))
    assert (cells["AVAILABLE"], cells["RUNNING"], cells["TERMINAL"], cells["FAILED"], cells["PAUSED"]) == \
        ("2", "0", "1", "1", "no")
    assert any(line.startswith("queue ") for line in lines)
    assert any(line.startswith("queue_ready ") for line in lines)
    assert lines[-1].startswith("total ")


def test_status_lists_jobs_handed_back_for_lack_of_a_task_by_queue_and_kind(engine, st, cli):
    c = running(engine, st, queue="mail", kind="brand_new")
    mark = {"count": 3, "run_lease": c.job.run_lease, "at": "2026-12-05T03:44:31+00:00"}
    st.snooze(engine, c.job.id, c.job.run_lease, 600, {UNHANDLED_KEY: mark})  # as a worker without it does
    add(engine, st, queue="mail")
    _, out, _ = cli("status")
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("QUEUE") and "HANDED BACK" in line)
    row = lines[lines.index(header) + 1]
    assert row.split() == ["mail", "brand_new", "1", "3", "2026-12-05T03:44:31+00:00"]
    code, out, _ = cli("status", "--json")
    assert code == 0
    assert json.loads(out)["handed_back"] == [
        {"queue": "mail", "kind": "brand_new", "jobs": 1, "most": 3, "last_at": mark["at"]}]


def test_status_has_no_handed_back_table_when_no_job_was_handed_back(engine, st, cli):
    add(engine, st, queue="mail")
    code, out, _ = cli("status")
    assert (code, "HANDED BACK" in out) == (0, False)


def test_status_json_is_the_report_under_stable_keys(engine, st, cli):
    add(engine, st)
    code, out, _ = cli("status", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"schema", "exact", "counters_trusted", "shape", "queues", "rings", "health",
                           "handed_back"}
    assert [(q["queue"], q["available"]) for q in report["queues"]] == [("q", 1)]
    assert report["health"]["total"]["bytes"] > 0


def test_status_fast_reads_the_lane_heads(engine, st, cli):
    add(engine, st)
    code, out, _ = cli("status", "--json", "--fast")
    report = json.loads(out)
    assert (code, report["exact"], report["queues"][0]["completed"]) == (0, False, None)


def test_status_of_an_empty_install_says_there_are_no_queues(cli):
    code, out, _ = cli("status")
    assert (code, "no queues yet" in out) == (0, True)


# -- job show ---------------------------------------------------------------------------------


def test_job_show_prints_state_kind_queue_attempt_args_errors_and_times(engine, st, cli):
    c = running(engine, st, kind="send_email", args={"to": "a@example.com"}, queue="mail")
    st.fail_retryable(engine, c.job.id, c.job.run_lease, "smtp timeout")
    code, out, _ = cli("job", "show", str(c.job.id))
    assert code == 0
    fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in out.splitlines()[1:]
              if not line.startswith("    ") and line.strip() != "errors:"}
    assert out.splitlines()[0] == f"job {c.job.id}"
    assert (fields["state"], fields["kind"], fields["queue"], fields["attempt"]) == \
        ("retryable", "send_email", "mail", "1/25")
    assert fields["args"] == '{"to": "a@example.com"}'
    assert {"created", "run", "attempted"} <= fields.keys()
    assert "attempt 1 at " in out and ": smtp timeout" in out


def test_job_show_names_the_dlq_reason_of_a_dead_lettered_job(engine, st, cli):
    job_id = dead(engine, st)
    code, out, _ = cli("job", "show", str(job_id))
    assert code == 0
    assert "failed (dead-lettered " in out and ": poison)" in out


def test_job_show_json_has_the_job_row_fields_and_the_dlq_entry(engine, st, cli):
    job_id = dead(engine, st, kind="k")
    code, out, _ = cli("job", "show", str(job_id), "--json")
    job = json.loads(out)
    assert code == 0
    assert (job["id"], job["kind"], job["state"], job["attempt"], job["max_attempts"]) == \
        (job_id, "k", "failed", 1, 25)
    assert job["dlq"]["reason"] == "poison"
    assert job["errors"][-1]["error"] == "bad address"


@pytest.mark.parametrize("action", ["show", "retry", "cancel"])
def test_job_commands_refuse_an_unknown_job_id_in_one_line(cli, action):
    code, _, err = cli("job", action, "4242")
    assert code == 1
    assert "job 4242 not found" in one_line(err)


@pytest.mark.parametrize("bad", ["abc", "0", "-3", "1.5", "99999999999999999999"])
def test_job_commands_refuse_a_job_id_that_is_not_a_positive_integer_in_one_line(cli, bad):
    code, _, err = cli("job", "show", bad)
    assert code == 1
    assert f"invalid job id {bad!r}" in one_line(err)


# -- job retry / cancel ---------------------------------------------------------------------------


def test_job_retry_makes_a_failed_job_available_again(engine, st, cli):
    job_id = failed(engine, st)
    code, out, _ = cli("job", "retry", str(job_id))
    assert (code, out.strip()) == (0, f"job {job_id} retried: available in queue 'q' (attempt 0/25)")
    assert state(engine, st, job_id) is JobState.AVAILABLE


def test_job_retry_of_a_completed_job_says_it_is_not_retryable(engine, st, cli):
    c = running(engine, st)
    st.complete_runtime_batch(engine, [c])
    code, _, err = cli("job", "retry", str(c.job.id))
    assert code == 1
    assert f"job {c.job.id} is not in a retryable state: it is completed" in one_line(err)
    assert state(engine, st, c.job.id) is JobState.COMPLETED


def test_job_retry_of_a_job_waiting_for_its_backoff_says_it_already_waits(engine, st, cli):
    c = running(engine, st)
    st.fail_retryable(engine, c.job.id, c.job.run_lease, "transient")
    code, _, err = cli("job", "retry", str(c.job.id))
    assert code == 1
    assert f"job {c.job.id} is already waiting to run: it is retryable, due " in one_line(err)


def test_job_retry_of_a_dead_lettered_job_points_to_dlq_retry(engine, st, cli):
    job_id = dead(engine, st)
    code, _, err = cli("job", "retry", str(job_id))
    assert code == 1
    assert f"`qstore dlq retry {job_id}`" in one_line(err)
    assert count(engine, st, "dlq_entries") == 1


def test_job_cancel_cancels_an_available_job(engine, st, cli):
    job_id = add(engine, st)
    code, out, _ = cli("job", "cancel", str(job_id))
    assert (code, out.strip()) == (0, f"job {job_id} cancelled (was available)")
    assert state(engine, st, job_id) is JobState.CANCELLED
    assert st.queue_counts(engine, "q").available == 0


def test_job_cancel_of_a_finished_job_says_it_is_not_cancellable(engine, st, cli):
    job_id = failed(engine, st)
    code, _, err = cli("job", "cancel", str(job_id))
    assert code == 1
    assert f"job {job_id} is not in a cancellable state: it is failed" in one_line(err)
    assert state(engine, st, job_id) is JobState.FAILED


# -- dlq list ---------------------------------------------------------------------------------------


def test_dlq_list_prints_the_newest_entries_first(engine, st, cli):
    older, newer = dead(engine, st, kind="a"), dead(engine, st, kind="b")
    code, out, _ = cli("dlq", "list")
    lines = out.splitlines()
    assert code == 0
    assert lines[0].split()[:3] == ["JOB", "KIND", "QUEUE"]
    assert [line.split()[0] for line in lines[1:]] == [str(newer), str(older)]
    assert "poison" in lines[1] and "bad address" in lines[1]


def test_dlq_list_filters_by_kind_and_queue(engine, st, cli):
    dead(engine, st, kind="a", queue="x")
    wanted = dead(engine, st, kind="a", queue="y")
    dead(engine, st, kind="b", queue="y")
    code, out, _ = cli("dlq", "list", "--kind", "a", "--queue", "y", "--json")
    assert (code, [j["id"] for j in json.loads(out)]) == (0, [wanted])


def test_dlq_list_says_when_the_limit_hides_entries(engine, st, cli):
    ids = [dead(engine, st) for _ in range(3)]
    code, out, _ = cli("dlq", "list", "--limit", "2")
    lines = out.splitlines()
    assert code == 0
    assert [line.split()[0] for line in lines[1:3]] == [str(ids[2]), str(ids[1])]
    assert lines[3] == "(the newest 2 shown; --limit N shows more)"


def test_dlq_list_of_an_empty_dlq_says_so(cli):
    code, out, _ = cli("dlq", "list", "--kind", "a")
    assert (code, out.strip()) == (0, "the dead-letter queue holds no jobs of kind 'a'")


def test_dlq_list_refuses_a_bad_limit_in_one_line(cli):
    code, _, err = cli("dlq", "list", "--limit", "none")
    assert code == 1
    assert "invalid --limit 'none'" in one_line(err)


# -- dlq retry --------------------------------------------------------------------------------------


def test_dlq_retry_of_one_job_makes_it_available(engine, st, cli):
    job_id = dead(engine, st)
    code, out, _ = cli("dlq", "retry", str(job_id))
    assert (code, out.strip()) == (0, f"job {job_id} retried from the dead-letter queue: available in queue 'q'")
    assert state(engine, st, job_id) is JobState.AVAILABLE
    assert count(engine, st, "dlq_entries") == 0


def test_dlq_retry_of_a_job_not_in_the_dlq_is_refused_in_one_line(engine, st, cli):
    job_id = failed(engine, st)
    code, _, err = cli("dlq", "retry", str(job_id))
    assert code == 1
    assert f"job {job_id} is not in the dead-letter queue" in one_line(err)


def test_dlq_retry_all_of_a_kind_retries_only_that_kind(engine, st, cli):
    a1, a2, b = dead(engine, st, kind="a"), dead(engine, st, kind="a"), dead(engine, st, kind="b")
    code, out, _ = cli("dlq", "retry", "--all", "--kind", "a")
    assert (code, out.strip()) == (0, "retried 2 jobs of kind 'a' from the dead-letter queue")
    assert [state(engine, st, j) for j in (a1, a2, b)] == [JobState.AVAILABLE, JobState.AVAILABLE,
                                                           JobState.FAILED]


def test_dlq_retry_all_without_a_filter_retries_every_job(engine, st, cli):
    jobs = [dead(engine, st, kind=k, queue=q) for k, q in (("a", "x"), ("b", "y"))]
    code, out, _ = cli("dlq", "retry", "--all")
    assert (code, out.strip()) == (0, "retried 2 jobs from the dead-letter queue")
    assert {state(engine, st, j) for j in jobs} == {JobState.AVAILABLE}


@pytest.mark.parametrize(("argv", "says"), [
    ((), "either a job id or --all"),
    (("7", "--all"), "either a job id or --all"),
    (("7", "--kind", "a"), "--kind and --queue go with --all"),
])
def test_dlq_retry_refuses_an_ambiguous_selection_in_one_line(engine, st, cli, argv, says):
    dead(engine, st)
    code, _, err = cli("dlq", "retry", *argv)
    assert code == 1
    assert says in one_line(err)
    assert count(engine, st, "dlq_entries") == 1


# -- dlq purge --------------------------------------------------------------------------------------


def test_dlq_purge_without_yes_deletes_nothing(engine, st, cli):
    dead(engine, st)
    code, _, err = cli("dlq", "purge")
    assert code == 1
    assert "add --yes" in one_line(err)
    assert count(engine, st, "dlq_entries") == 1


def test_dlq_purge_deletes_the_matching_jobs_for_good(engine, st, cli):
    gone, kept = dead(engine, st, kind="a"), dead(engine, st, kind="b")
    terminal = st.queue_counts(engine, "q").terminal
    code, out, _ = cli("dlq", "purge", "--kind", "a", "--yes")
    assert (code, out.strip()) == (0, "purged 1 job of kind 'a' from the dead-letter queue")
    assert st.load_job(engine, gone) is None
    assert state(engine, st, kept) is JobState.FAILED
    assert st.queue_counts(engine, "q").terminal == terminal
    assert cli("job", "show", str(gone))[0] == 1


def test_dlq_purge_releases_the_unique_keys_of_the_purged_jobs(engine, st, cli):
    unique = UniqueOpts(states=0b0011_1111)  # the default states plus failed
    dead(engine, st, args={"u": 1}, unique=unique)
    assert cli("dlq", "purge", "--yes")[0] == 0
    assert st.enqueue_params_batch(engine, [params(args={"u": 1}, unique=unique)]) == 1


# -- every refusal is one line ------------------------------------------------------------------------

COMMANDS = [("status",), ("job", "show", "1"), ("job", "retry", "1"), ("job", "cancel", "1"),
            ("dlq", "list"), ("dlq", "retry", "1"), ("dlq", "purge", "--yes")]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_schema_that_is_not_installed_is_one_line(cli, argv):
    code, _, err = cli(*argv, schema="not_installed_here")
    assert code == 1
    assert "qstore schema 'not_installed_here' is not installed" in one_line(err)


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_bad_url_is_one_line(cli, argv):
    code, _, err = cli(*argv, url="notaurl")
    assert code == 1
    assert "invalid --url='notaurl'" in one_line(err)


def test_an_unreachable_server_is_one_line(cli):
    code, _, err = cli("status", url="postgresql+psycopg://postgres@127.0.0.1:1/app")
    assert code == 1
    assert "cannot connect" in one_line(err)


def test_a_missing_url_is_one_line(st, monkeypatch):
    monkeypatch.delenv("QSTORE_DATABASE_URL", raising=False)
    err = io.StringIO()
    with redirect_stderr(err):
        code = main(["dlq", "list", "--schema", st.schema()], out=io.StringIO())
    assert code == 1
    assert "dlq list needs a database" in one_line(err.getvalue())


def test_a_refused_database_statement_is_one_line(engine, st, cli):
    """A database error while the command runs (here: the DLQ table is gone) is one line."""
    with engine.begin() as conn:
        conn.execute(text(f'ALTER TABLE "{st.schema()}".dlq_entries RENAME TO dlq_entries_moved'))
    try:
        code, _, err = cli("dlq", "list")
    finally:
        with engine.begin() as conn:
            conn.execute(text(f'ALTER TABLE "{st.schema()}".dlq_entries_moved RENAME TO dlq_entries'))
    assert code == 1
    assert err.count("\n") == 1, err
    assert f'relation "{st.schema()}.dlq_entries" does not exist' in one_line(err)
