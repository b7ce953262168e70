"""Deploys on live data.

* Every revision upgrades to head keeping jobs in every state (written by the previous
  release at that revision, receipts on and off), and the upgraded jobs can then be worked
  to the end by this release.
* A worker of the previous release keeps working against the new head (a rolling deploy:
  the new release migrates while old workers still run).
* Downgrading to every revision and back loses no row.
* Concurrent ``alembic upgrade`` runs (two pods deploying at once) serialise: both succeed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, func, inspect, pool, select, text

from qstore import QueueStorage, QueueStorageConfig
from qstore.migrate import REVISIONS, current_revision, downgrade, upgrade
from qstore.types import JobState, RetryFromDlqOpts

#: one worker process runs the whole module: its module fixtures (a database, 38 installs
#: written by the previous release and upgraded) are built once, not once per process
pytestmark = pytest.mark.xdist_group("upgrades")

HERE = Path(__file__).resolve().parent
PREVIOUS_WHEEL = HERE / "data" / "previous_release" / "qstore-0.1.0-1b55e32.whl"
WORKER = HERE / "previous_release_worker.py"
#: the revisions the previous release shipped (it can write data at any of them)
PREVIOUS_REVISIONS = REVISIONS[:-1]
MODES = ("receipts", "leases")
#: the revision that moved heartbeats and progress from ``attempt_state`` into
#: ``attempt_progress``, and the revision below it (whatever it is)
PROGRESS_REVISION = "0012"
BEFORE_PROGRESS = REVISIONS[REVISIONS.index(PROGRESS_REVISION) - 1]
#: the revision that indexes job_id of wide done rows only, and the revision below it
WIDE_DONE_REVISION = "0014"
BEFORE_WIDE_DONE = REVISIONS[REVISIONS.index(WIDE_DONE_REVISION) - 1]
Q = "upgrade"
SMALL = {"queue_slot_count": 4, "lease_slot_count": 2, "claim_slot_count": 2}


def config(name: str, mode: str) -> QueueStorageConfig:
    return QueueStorageConfig(schema=name, lease_claim_receipts=mode == "receipts", **SMALL)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's package, unpacked for a subprocess's ``PYTHONPATH``."""
    target = tmp_path_factory.mktemp("previous_release")
    with zipfile.ZipFile(PREVIOUS_WHEEL) as wheel:
        wheel.extractall(target)
    return target


def start_previous(release: Path, *args: str) -> subprocess.Popen[str]:
    """Start the previous release's worker script (see :func:`finish_previous`)."""
    env = {**os.environ, "PYTHONPATH": str(release)}
    return subprocess.Popen([sys.executable, str(WORKER), *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish_previous(proc: subprocess.Popen[str]) -> Any:
    """What the script printed (JSON), once it exited 0."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def run_previous(release: Path, *args: str) -> Any:
    return finish_previous(start_previous(release, *args))


def migrate_to(engine: Engine, cfg: QueueStorageConfig, revision: str) -> None:
    with engine.begin() as conn:
        current = current_revision(conn, cfg)
        if current is not None and revision != "heads" and REVISIONS.index(revision) < REVISIONS.index(current):
            downgrade(conn, cfg, revision)
        else:
            upgrade(conn, cfg, revision)


@pytest.fixture(scope="module")
def module_engine(pg_server: Any) -> Iterator[tuple[str, Engine]]:
    """A database of this module's own (created here, dropped at the end)."""
    from conftest import _janitor, sqlalchemy_url  # the session's server helpers

    name = f"qstore_upgrades_{os.getpid()}"
    with _janitor(pg_server, name):
        url = sqlalchemy_url(pg_server, name)
        eng = create_engine(url, pool_size=5, max_overflow=5)
        yield url, eng
        eng.dispose()


@pytest.fixture(scope="module")
def upgraded(module_engine: tuple[str, Engine], previous_release: Path) -> dict[tuple[str, str], Any]:
    """Per (start revision, mode): a schema migrated to that revision, filled with jobs in
    every state by the previous release, then upgraded to head by this release."""
    url, engine = module_engine
    cases = {(rev, mode): config(f"up_{rev}_{mode}", mode) for rev in PREVIOUS_REVISIONS for mode in MODES}
    keys = list(cases)
    writers = []  # each half is written by a process of its own while the next half migrates
    for half in (keys[:len(keys) // 2], keys[len(keys) // 2:]):
        for rev, mode in half:
            migrate_to(engine, cases[rev, mode], rev)
        spec = [{"url": url, "schema": cases[rev, mode].schema, "general": rev < "0003"}
                for rev, mode in half]
        writers.append(start_previous(previous_release, "states", json.dumps(spec)))
    manifests = [m for proc in writers for m in finish_previous(proc)]
    for cfg in cases.values():
        migrate_to(engine, cfg, "heads")
    return {key: (cfg, manifest) for (key, cfg), manifest in zip(cases.items(), manifests, strict=True)}


CASES = [(rev, mode) for rev in PREVIOUS_REVISIONS for mode in MODES]


@pytest.mark.parametrize(("rev", "mode"), CASES)
def test_jobs_written_at_a_revision_keep_state_and_body_through_the_upgrade(upgraded, module_engine, rev, mode):
    _url, engine = module_engine
    cfg, manifest = upgraded[(rev, mode)]
    st = QueueStorage(cfg)
    with engine.connect() as conn:
        assert current_revision(conn, cfg) == REVISIONS[-1]
    expected = {"running": "running", "heartbeated": "running", "leased": "running",
                "waiting": "waiting_external", "retryable": "retryable", "completed": "completed",
                "completed_by_id": "completed", "failed": "failed", "cancelled": "cancelled",
                "dlq": "failed", "scheduled": "scheduled", "unique": "available",
                "available": "available"}
    assert {n: m["state"] for n, m in manifest.items()} == expected  # as the old release saw them
    for name, m in manifest.items():
        row = st.load_job(engine, m["id"])
        assert row is not None, name
        assert (row.state.value, row.args, row.metadata.get("name"), row.tags) == (
            expected[name], {"name": name}, name, ["t"]), name


@pytest.mark.parametrize(("rev", "mode"), CASES)
def test_jobs_upgraded_from_a_revision_can_be_worked_to_the_end(upgraded, module_engine, rev, mode):
    _url, engine = module_engine
    cfg, manifest = upgraded[(rev, mode)]
    st = QueueStorage(cfg)
    ids = {name: m["id"] for name, m in manifest.items()}
    live = [(m["id"], m["run_lease"]) for n, m in manifest.items() if n in ("running", "heartbeated", "leased")]
    assert sorted(st.complete_job_batch_by_id(engine, live)) == sorted(live)
    import uuid

    st.complete_external(engine, uuid.UUID(manifest["waiting"]["callback_id"]))
    assert st.retry_job(engine, ids["failed"]) is not None
    assert st.retry_from_dlq(engine, ids["dlq"], RetryFromDlqOpts()) is not None
    with engine.begin() as conn:  # make the deferred jobs due now
        conn.execute(text(f'UPDATE "{cfg.schema}".deferred_jobs SET run_at = clock_timestamp()'))
        conn.execute(text(f'UPDATE "{cfg.schema}".deferred_wheel SET run_at = clock_timestamp()'))
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    assert st.promote_due(engine, JobState.SCHEDULED, 10) == 1
    claimed = st.claim_runtime_batch(engine, Q, 100)
    assert sorted(j.job.args["name"] for j in claimed) == [
        "available", "dlq", "failed", "retryable", "scheduled", "unique"]
    assert len(st.complete_runtime_batch(engine, claimed)) == 6
    final = {n: st.load_job(engine, i).state for n, i in ids.items()}  # type: ignore[union-attr]
    assert set(final.values()) == {JobState.COMPLETED, JobState.CANCELLED}
    for _ in range(6):  # ring upkeep works on the upgraded install
        st.rotate(engine), st.prune_oldest(engine)
        st.rotate_claims(engine), st.prune_oldest_claims(engine)
        st.rotate_leases(engine), st.prune_oldest_leases(engine)
    st.rollup_terminal_count_deltas(engine, 4)
    counts = st.queue_counts(engine, Q)
    # 13 jobs end terminal; the failed and DLQ'd ones were taken out of history and re-run
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 13)


@pytest.mark.parametrize("mode", MODES)
def test_previous_release_worker_keeps_working_after_the_upgrade(module_engine, previous_release, mode):
    url, engine = module_engine
    cfg = config(f"rolling_{mode}", mode)
    migrate_to(engine, cfg, "0005")
    migrate_to(engine, cfg, "heads")  # the new release migrated; the old workers go on
    out = run_previous(previous_release, "work", url, cfg.schema)
    assert len(out["claimed"]) == 4
    assert len(out["fast"]) == 2 and len(out["by_id"]) == 1
    assert (out["beats"], out["retried"]) == (1, "retryable")
    st = QueueStorage(cfg)
    for job_id in out["claimed"][:3]:
        row = st.load_job(engine, job_id)
        assert row.state == JobState.COMPLETED and row.metadata == {"by": "old"}  # type: ignore[union-attr]
    counts = st.queue_counts(engine, "old_worker")
    assert (counts.available, counts.running, counts.terminal) == (0, 0, 3)


def _one_through_enqueue_jobs(engine: Engine, st: QueueStorage, job: Any) -> int:
    """Enqueue one job through the batch function ``enqueue_jobs``, which every revision
    these tests write at has. This release sends a single job to ``enqueue_job``
    (revision 0015), so its ``enqueue`` of one job needs the head; at an older revision a
    test writes as that revision's release did. A unique key another job owns raises
    ``UniqueConflictError`` naming the owner, as ``enqueue`` does."""
    from qstore import UniqueConflictError
    from qstore.storage import enqueue as enqueuing
    from qstore.storage.jobs import prepare_jobs

    rows = prepare_jobs([job], st.queue_stripe_count(), field="job")
    with engine.begin() as conn:
        ((ids, _key, owner),) = conn.execute(enqueuing._enqueue_stmt(st.tables).statement,
                                             enqueuing._parameters(st.tables, rows)).all()
    if ids is None:
        raise UniqueConflictError("job_unique_claims", f"owned by job {owner}")
    return int(ids[0])


def _ended_jobs(engine: Engine, st: QueueStorage) -> dict[str, int]:
    """A completed and a failed attempt and a cancelled running one (narrow done rows), and
    a cancelled scheduled job (a wide done row), ended by this release; their ids."""
    from datetime import datetime, timedelta, timezone

    from jobtools import params

    st.enqueue_params_batch(engine, [params(args={"n": i}, queue=Q) for i in range(3)])
    done, failed, cancelled = st.claim_runtime_batch(engine, Q, 3)
    st.complete_runtime_batch(engine, [done])
    st.fail_terminal(engine, failed.job.id, failed.job.run_lease, "boom")
    st.cancel_job(engine, cancelled.job.id)
    later = datetime.now(timezone.utc) + timedelta(hours=2)
    _one_through_enqueue_jobs(engine, st, params(args={"n": 9}, queue=Q, run_at=later))
    with engine.connect() as conn:
        scheduled = conn.execute(text(f'SELECT job_id FROM "{st.schema()}".deferred_jobs')).scalar_one()
    st.cancel_job(engine, scheduled)
    return {"completed": done.job.id, "failed": failed.job.id, "cancelled_running": cancelled.job.id,
            "cancelled_scheduled": scheduled}


def _ended_below(engine: Engine, cfg: QueueStorageConfig, revision: str) -> dict[str, int]:
    """:func:`_ended_jobs` on a new install of ``cfg`` at the head, then downgraded to
    ``revision``: the jobs' rows in the forms that revision writes (this release's code
    runs only against the head's schema)."""
    migrate_to(engine, cfg, "heads")
    ids = _ended_jobs(engine, QueueStorage(cfg))
    migrate_to(engine, cfg, revision)
    return ids


@pytest.mark.parametrize("mode", MODES)
def test_a_previous_release_finds_ended_jobs_by_id_without_the_full_done_index(module_engine, previous_release,
                                                                                mode):
    """Rolling deploy over the revision that indexes job_id of wide done rows only: the
    previous release looks done rows up on ``done_entries.job_id`` (now a scan of the ring's
    done rows for narrow ones) and still finds, moves and retries each."""
    url, engine = module_engine
    cfg = config(f"rolling_done_{mode}", mode)
    migrate_to(engine, cfg, "heads")
    ids = _ended_jobs(engine, QueueStorage(cfg))
    out = run_previous(previous_release, "history", url, cfg.schema, json.dumps(ids))
    assert out == {"load_completed": "completed", "load_failed": "failed", "load_cancelled_running": "cancelled",
                   "load_cancelled_scheduled": "cancelled", "dlq_failed": "failed",
                   "retry_cancelled_running": "available", "retry_cancelled_scheduled": "available"}


def test_jobs_ended_below_the_wide_done_index_revision_are_found_by_id_after_it(module_engine):
    """Done rows written before the upgrade (with the full index) are found by this
    release's lookup after it, and again after a downgrade and upgrade."""
    _url, engine = module_engine
    cfg = config("wide_done_upgrade", "receipts")
    ids = _ended_below(engine, cfg, BEFORE_WIDE_DONE)
    st = QueueStorage(cfg)
    migrate_to(engine, cfg, "heads")
    states = {name: st.load_job(engine, job_id).state for name, job_id in ids.items()}  # type: ignore[union-attr]
    assert states == {"completed": JobState.COMPLETED, "failed": JobState.FAILED,
                      "cancelled_running": JobState.CANCELLED, "cancelled_scheduled": JobState.CANCELLED}
    migrate_to(engine, cfg, BEFORE_WIDE_DONE)
    migrate_to(engine, cfg, "heads")
    assert st.move_failed_to_dlq(engine, ids["failed"], "poison") is not None
    assert st.retry_job(engine, ids["cancelled_scheduled"]).state is JobState.AVAILABLE  # type: ignore[union-attr]
    assert st.retry_job(engine, ids["cancelled_running"]).state is JobState.AVAILABLE  # type: ignore[union-attr]


#: the revision whose ``terminal_jobs`` finds a job's rows by index, and the one below it
TERMINAL_VIEW_REVISION = "0018"
BEFORE_TERMINAL_VIEW = REVISIONS[REVISIONS.index(TERMINAL_VIEW_REVISION) - 1]


def _terminal_view(engine: Engine, cfg: QueueStorageConfig) -> tuple[list[tuple[Any, ...]], str]:
    """Every row of ``terminal_jobs`` (ordered) and the view's definition."""
    with engine.connect() as conn:
        rows = conn.execute(text(f'SELECT * FROM "{cfg.schema}".terminal_jobs ORDER BY job_id, finalized_at')).all()
        definition = conn.execute(text("SELECT pg_get_viewdef(CAST(:v AS regclass))"),
                                  {"v": f'"{cfg.schema}".terminal_jobs'}).scalar_one()
    return [tuple(r) for r in rows], definition


@pytest.mark.parametrize("mode", MODES)
def test_the_terminal_view_revision_keeps_every_row_both_ways(module_engine, mode):
    """Upgrading to the revision that splits ``terminal_jobs`` into its two kinds of done
    rows, and downgrading below it, change the view's text and none of its rows (narrow and
    wide rows alike)."""
    _url, engine = module_engine
    cfg = config(f"terminal_view_{mode}", mode)
    _ended_below(engine, cfg, BEFORE_TERMINAL_VIEW)
    rows, before = _terminal_view(engine, cfg)
    assert len(rows) == 4 and "UNION ALL" not in before
    migrate_to(engine, cfg, TERMINAL_VIEW_REVISION)
    upgraded_rows, after = _terminal_view(engine, cfg)
    assert upgraded_rows == rows and "UNION ALL" in after
    migrate_to(engine, cfg, BEFORE_TERMINAL_VIEW)
    assert _terminal_view(engine, cfg) == (rows, before)


#: the revision that writes the fast path's completions as batch done rows, and the one below it
BATCH_DONE_REVISION = "0019"
BEFORE_BATCH_DONE = REVISIONS[REVISIONS.index(BATCH_DONE_REVISION) - 1]


def _retained(engine: Engine, cfg: QueueStorageConfig) -> tuple[int, int]:
    """(done rows, members of batch done rows; 0 where the table does not exist)."""
    with engine.connect() as conn:
        rows = conn.execute(text(f'SELECT count(*) FROM "{cfg.schema}".done_entries')).scalar_one()
        exists = conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"),
                              {"t": f'"{cfg.schema}".done_batches'}).scalar_one()
        members = conn.execute(text(
            f'SELECT coalesce(sum(cardinality(lane_seqs)), 0) FROM "{cfg.schema}".done_batches')).scalar_one() \
            if exists else 0
    return int(rows), int(members)


@pytest.mark.parametrize("mode", MODES)
def test_the_batch_done_revision_keeps_every_terminal_row_both_ways(module_engine, mode):
    """Jobs ended below the revision (narrow and wide done rows) and completed above it
    (batch members with receipts on, narrow rows without) read the same through
    ``terminal_jobs`` after the upgrade, after the downgrade (which moves every member back
    into a narrow done row) and after upgrading again; ``load_job`` and the exact counts
    agree above it."""
    _url, engine = module_engine
    cfg = config(f"batch_done_{mode}", mode)
    ended = _ended_below(engine, cfg, BEFORE_BATCH_DONE)
    st = QueueStorage(cfg)
    before, _ = _terminal_view(engine, cfg)
    migrate_to(engine, cfg, BATCH_DONE_REVISION)
    assert _terminal_view(engine, cfg)[0] == before
    from jobtools import params

    st.enqueue_params_batch(engine, [params(args={"n": i}, queue=Q) for i in range(5)])
    completed = st.claim_runtime_batch(engine, Q, 5)
    assert len(st.complete_runtime_batch(engine, completed)) == 5
    rows, _ = _terminal_view(engine, cfg)
    assert len(rows) == len(before) + 5
    retained = _retained(engine, cfg)
    assert retained == ((len(before), 5) if mode == "receipts" else (len(before) + 5, 0))
    migrate_to(engine, cfg, BEFORE_BATCH_DONE)
    assert _terminal_view(engine, cfg)[0] == rows
    assert _retained(engine, cfg) == (len(rows), 0)
    migrate_to(engine, cfg, BATCH_DONE_REVISION)
    assert _terminal_view(engine, cfg)[0] == rows
    migrate_to(engine, cfg, "heads")  # this release's reads need the head's schema
    assert st.queue_counts(engine, Q).terminal == len(rows)
    assert {st.load_job(engine, c.job.id).state for c in completed} == {JobState.COMPLETED}  # type: ignore[union-attr]
    assert st.load_job(engine, ended["completed"]).state is JobState.COMPLETED  # type: ignore[union-attr]


#: the revision that closes the fast path's completions with batch closures, and the one below it
BATCH_CLOSURE_REVISION = "0020"
BEFORE_BATCH_CLOSURE = REVISIONS[REVISIONS.index(BATCH_CLOSURE_REVISION) - 1]


def _closed(engine: Engine, cfg: QueueStorageConfig) -> tuple[list[tuple[Any, ...]], int]:
    """Every closed attempt (claim slot, job, run lease, outcome), ordered, from both
    forms, and how many of them are batch members (0 where the table does not exist)."""
    s = f'"{cfg.schema}"'
    with engine.connect() as conn:
        narrow = conn.execute(text(f"SELECT claim_slot, job_id, run_lease, outcome FROM {s}.lease_claim_closures")).all()
        exists = conn.execute(text("SELECT to_regclass(:t) IS NOT NULL"),
                              {"t": f"{s}.lease_claim_closure_batches"}).scalar_one()
        members = conn.execute(text(
            f"SELECT b.claim_slot, m.job_id, m.run_lease, 'completed' FROM {s}.lease_claim_closure_batches b "
            "CROSS JOIN LATERAL unnest(b.job_ids, b.run_leases) AS m(job_id, run_lease)")).all() if exists else []
    return sorted(tuple(r) for r in [*narrow, *members]), len(members)


@pytest.mark.parametrize("mode", MODES)
def test_the_batch_closure_revision_keeps_every_closure_both_ways(module_engine, mode):
    """Attempts closed by batch closures (receipts on) and narrow ones, beside attempts
    still open, keep their closures through a downgrade (which moves every member into a
    narrow closure) and an upgrade; counts, states and rescue agree after each."""
    from jobtools import params

    _url, engine = module_engine
    cfg = config(f"batch_closures_{mode}", mode)
    migrate_to(engine, cfg, "heads")
    st = QueueStorage(cfg)
    _ended_jobs(engine, st)
    st.enqueue_params_batch(engine, [params(args={"n": i}, queue=Q) for i in range(5)])
    claimed = st.claim_runtime_batch(engine, Q, 5)
    assert len(st.complete_runtime_batch(engine, claimed[:3])) == 3
    closed, members = _closed(engine, cfg)
    assert members == (3 if mode == "receipts" else 0)
    counts = st.queue_counts(engine, Q)
    assert (counts.running, counts.terminal) == (2, 7)
    states = {c.job.id: st.load_job(engine, c.job.id).state for c in claimed}  # type: ignore[union-attr]
    migrate_to(engine, cfg, BEFORE_BATCH_CLOSURE)
    assert _closed(engine, cfg) == (closed, 0)
    migrate_to(engine, cfg, BATCH_CLOSURE_REVISION)
    assert _closed(engine, cfg) == (closed, 0)
    assert st.queue_counts(engine, Q) == counts
    assert {c.job.id: st.load_job(engine, c.job.id).state for c in claimed} == states  # type: ignore[union-attr]
    assert st.rescue_expired_deadlines(engine) == []
    assert len(st.complete_runtime_batch(engine, claimed)) == 2
    assert st.queue_counts(engine, Q).terminal == 9


def test_terminal_history_reads_a_json_null_payload_as_the_ready_rows(engine, st):
    """An older release's general terminal path wrote JSON ``null`` payloads; reads take
    them for "no payload of its own" and show the job's metadata and tags."""
    from jobtools import params

    st.enqueue_params_batch(engine, [params(args={"n": 1}, metadata={"m": 1}, tags=["t"])])
    (c,) = st.claim_runtime_batch(engine, "q", 1)
    st.complete_job_batch_by_id(engine, [(c.job.id, c.job.run_lease)])
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE \"{st.schema()}\".done_entries SET payload = 'null'::jsonb"))
    row = st.load_job(engine, c.job.id)
    assert (row.metadata, row.tags) == ({"m": 1}, ["t"])  # type: ignore[union-attr]


def test_upgrade_0005_repairs_terminal_rows_that_hid_their_metadata(module_engine, previous_release):
    url, engine = module_engine
    cfg = config("repair_0005", "receipts")
    migrate_to(engine, cfg, "0004")
    manifest = run_previous(previous_release, "states", json.dumps(
        [{"url": url, "schema": cfg.schema, "general": False}]))[0]
    with engine.begin() as conn:  # what the general terminal path wrote before the fix
        conn.execute(text(f"UPDATE \"{cfg.schema}\".done_entries SET payload = 'null'::jsonb "
                          "WHERE args IS NULL"))
    migrate_to(engine, cfg, "0005")
    with engine.connect() as conn:
        nulls = conn.execute(text(f"SELECT count(*) FROM \"{cfg.schema}\".done_entries "
                                  "WHERE payload = 'null'::jsonb")).scalar_one()
    assert nulls == 0
    migrate_to(engine, cfg, "heads")
    row = QueueStorage(cfg).load_job(engine, manifest["completed_by_id"]["id"])
    assert row.metadata == {"name": "completed_by_id"}  # type: ignore[union-attr]


# -- downgrade ----------------------------------------------------------------------------------

def table_rows(engine: Engine, schema: str) -> dict[str, int]:
    with engine.connect() as conn:
        names = inspect(conn).get_table_names(schema=schema)
        return {n: conn.execute(text(f'SELECT count(*) FROM "{schema}"."{n}"')).scalar_one()
                for n in names if not n[-1].isdigit() and n != "qstore_alembic_version"}


def test_downgrade_to_every_revision_and_back_loses_no_row(module_engine):
    _url, engine = module_engine
    cfg = config("down_and_up", "receipts")
    migrate_to(engine, cfg, "heads")
    st = QueueStorage(cfg)
    from jobtools import params

    st.enqueue_params_batch(engine, [params(args={"n": i}, queue=Q) for i in range(8)])
    jobs = st.claim_runtime_batch(engine, Q, 6)
    st.complete_runtime_batch(engine, jobs[:3])
    st.fail_terminal(engine, jobs[3].job.id, jobs[3].job.run_lease, "boom")
    st.retry_after(engine, jobs[4].job.id, jobs[4].job.run_lease, 3600)
    st.heartbeat_batch(engine, [(jobs[5].job.id, jobs[5].job.run_lease)])
    for _ in range(2):
        st.rotate(engine)
    st.prune_oldest(engine)
    before_rows = table_rows(engine, cfg.schema)
    _, members = _retained(engine, cfg)  # the fast path's completions, as batch members
    assert members == 3
    closed_members = _closed(engine, cfg)[1]  # and their batch closures' members
    assert closed_members == 3
    before_states = {j.job.id: st.load_job(engine, j.job.id) for j in jobs}
    before_counts = st.queue_counts(engine, Q)
    with engine.connect() as conn:
        gen_before = conn.execute(select(st.tables.queue_ring.state.c.generation)).scalar_one()
    for rev in reversed(REVISIONS[:-1]):
        migrate_to(engine, cfg, rev)
        now = table_rows(engine, cfg.schema)
        for table, n in before_rows.items():
            if table in now and "rollup" not in table:  # the ledger folds into the rollups
                # below the progress revision the heartbeated attempt's latest report is
                # its attempt_state row again
                moved = 1 if table == "attempt_state" and rev < PROGRESS_REVISION else 0
                # below the batch done revision each batch member is a narrow done row
                moved += members if table == "done_entries" and rev < BATCH_DONE_REVISION else 0
                # below the batch closure revision each member is a narrow closure
                moved += closed_members if table == "lease_claim_closures" and rev < BATCH_CLOSURE_REVISION else 0
                assert now[table] == n + moved, (rev, table)
    migrate_to(engine, cfg, "heads")
    after_rows = table_rows(engine, cfg.schema)
    # the prune ledger was folded into the rollups on the way down: same sums, other rows;
    # the batch members came back up as the narrow done rows the downgrade made of them
    expected = {t: n for t, n in before_rows.items() if "rollup" not in t}
    expected["done_entries"] += members
    expected["done_batches"] = 0
    expected["lease_claim_closures"] += closed_members
    expected["lease_claim_closure_batches"] = 0
    assert {t: n for t, n in after_rows.items() if "rollup" not in t} == expected
    assert {j.job.id: st.load_job(engine, j.job.id) for j in jobs} == before_states
    assert st.queue_counts(engine, Q) == before_counts
    with engine.connect() as conn:
        assert conn.execute(select(st.tables.queue_ring.state.c.generation)).scalar_one() == gen_before
        assert conn.execute(select(func.count()).select_from(st.tables.rollup_ledger)).scalar_one() == 0
    assert len(st.complete_runtime_batch(engine, st.claim_runtime_batch(engine, Q, 10))) == 2


def attempt_state_rows(engine: Engine, schema: str) -> dict[int, tuple[Any, Any, Any]]:
    """job id → ``(heartbeat_at, progress, callback_result)`` of every ``attempt_state`` row."""
    with engine.connect() as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(text(
            f'SELECT job_id, heartbeat_at, progress, callback_result FROM "{schema}".attempt_state'))}


def write_attempt_state(engine: Engine, schema: str, job_id: int, progress: Any) -> None:
    """A heartbeat with progress as a release before the progress revision writes it."""
    with engine.begin() as conn:
        conn.execute(text(
            f'INSERT INTO "{schema}".attempt_state (job_id, run_lease, heartbeat_at, progress) '
            "VALUES (:j, 1, clock_timestamp(), CAST(:p AS jsonb)) ON CONFLICT (job_id, run_lease) DO UPDATE "
            "SET heartbeat_at = excluded.heartbeat_at, progress = excluded.progress, updated_at = clock_timestamp()"),
            {"j": job_id, "p": None if progress is None else json.dumps(progress)})


@pytest.mark.parametrize("mode", MODES)
def test_the_progress_revision_moves_live_heartbeats_and_progress_and_its_downgrade_moves_the_latest_back(
        module_engine, mode):
    _url, engine = module_engine
    cfg = config(f"progress_{mode}", mode)
    migrate_to(engine, cfg, "heads")  # this release's code runs against the head's schema only
    st = QueueStorage(cfg)
    from jobtools import params

    st.enqueue_params_batch(engine, [params(args={"n": i}, queue=Q) for i in range(4)])
    reporting, beating, resumed, quiet = (j.job.id for j in st.claim_runtime_batch(engine, Q, 4))
    st.register_callback(engine, resumed, 1, 3600)
    migrate_to(engine, cfg, BEFORE_PROGRESS)
    write_attempt_state(engine, cfg.schema, reporting, {"pct": 10})
    write_attempt_state(engine, cfg.schema, beating, None)
    write_attempt_state(engine, cfg.schema, resumed, {"pct": 20})
    with engine.begin() as conn:  # a resumed callback's result, as that release stores it
        conn.execute(text(f'UPDATE "{cfg.schema}".attempt_state SET callback_result = \'{{"answer": 1}}\' '
                          f"WHERE job_id = {resumed}"))
    before = attempt_state_rows(engine, cfg.schema)

    migrate_to(engine, cfg, "heads")
    # moved: rows left with nothing are gone, the callback's keeps its result only
    assert attempt_state_rows(engine, cfg.schema) == {resumed: (None, None, {"answer": 1})}
    for job_id, (beat, progress, _) in before.items():
        row = st.load_job(engine, job_id)
        assert (row.heartbeat_at, row.progress) == (beat, progress), job_id  # type: ignore[union-attr]
    with engine.connect() as conn:
        moved = conn.execute(text(f'SELECT job_id FROM "{cfg.schema}".attempt_progress')).scalars().all()
    assert sorted(moved) == sorted(before)  # one row per attempt that had something to move

    st.heartbeat_progress_batch(engine, [(reporting, 1, {"pct": 11}), (quiet, 1, {"pct": 1})])
    assert st.complete_job_batch_by_id(engine, [(beating, 1)]) == [(beating, 1)]
    latest = {j: st.load_job(engine, j) for j in (reporting, resumed, quiet)}

    migrate_to(engine, cfg, BEFORE_PROGRESS)
    back = attempt_state_rows(engine, cfg.schema)
    assert sorted(back) == sorted([reporting, resumed, quiet])  # the ended attempt's rows stay behind
    for job_id, row in latest.items():
        assert back[job_id][:2] == (row.heartbeat_at, row.progress), job_id  # type: ignore[union-attr]
    assert back[resumed][2] == {"answer": 1}

    migrate_to(engine, cfg, "heads")
    assert {j: st.load_job(engine, j) for j in latest} == latest
    live = [(reporting, 1), (resumed, 1), (quiet, 1)]
    assert sorted(st.complete_job_batch_by_id(engine, live)) == sorted(live)
    assert attempt_state_rows(engine, cfg.schema) == {}


# -- concurrent upgrades ------------------------------------------------------------------------

def alembic_cli(url: str, *args: str, ini: Path | None = None, cwd: Path | None = None) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "QSTORE_DATABASE_URL"}
    return subprocess.Popen(
        [sys.executable, "-m", "alembic", "-c", str(ini or HERE.parent / "alembic.ini"),
         "-x", f"url={url}", *args], env=env, cwd=cwd, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_two_concurrent_standalone_upgrades_of_an_empty_database_both_succeed(fresh_db_url):
    runs = [alembic_cli(fresh_db_url, "upgrade", "head") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    eng = create_engine(fresh_db_url, poolclass=pool.NullPool)
    try:
        with eng.connect() as conn:
            versions = conn.execute(text("SELECT version_num FROM qstore.qstore_alembic_version")).scalars().all()
        assert versions == [REVISIONS[-1]]
        assert QueueStorage.from_existing_schema("qstore", eng).config == QueueStorageConfig()
    finally:
        eng.dispose()


def test_two_concurrent_host_application_upgrades_both_succeed(fresh_db_url, host_app):
    runs = [alembic_cli(fresh_db_url, "upgrade", "heads", ini=host_app, cwd=host_app.parent)
            for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outs
    eng = create_engine(fresh_db_url, poolclass=pool.NullPool)
    try:
        with eng.connect() as conn:
            versions = set(conn.execute(text("SELECT version_num FROM public.alembic_version")).scalars())
        assert versions == {"h0001", REVISIONS[-1]}
    finally:
        eng.dispose()


# -- the deferred wheel (revision 0011) ----------------------------------------------------------

def _waits(engine: Engine, schema: str) -> dict[str, set[int]]:
    """Job ids of the overflow rows and, when the wheel exists, its unmarked entries."""
    with engine.connect() as conn:
        out = {"overflow": set(conn.execute(text(f'SELECT job_id FROM "{schema}".deferred_jobs')).scalars())}
        if inspect(conn).has_table("deferred_wheel", schema=schema):
            out["wheel"] = set(conn.execute(text(
                f'SELECT job_id FROM "{schema}".deferred_wheel w WHERE NOT EXISTS (SELECT 1 FROM '
                f'"{schema}".deferred_wheel_marks m WHERE m.entry_id = w.entry_id AND m.wheel_slot = w.wheel_slot)'
            )).scalars())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_upgrade_to_the_wheel_moves_near_waits_in_and_downgrade_moves_them_back(module_engine, previous_release,
                                                                               mode):
    url, engine = module_engine
    cfg = config(f"wheel_{mode}", mode)
    migrate_to(engine, cfg, "0010")
    manifest = run_previous(previous_release, "states", json.dumps(
        [{"url": url, "schema": cfg.schema, "general": False}]))[0]
    with engine.begin() as conn:  # waits due within the span, as revision 0010 stored them
        conn.execute(text(f"""INSERT INTO "{cfg.schema}".deferred_jobs (job_id, kind, queue, args, state, priority,
            attempt, run_lease, run_at, finalized_at) VALUES
            (9001, 'k', '{Q}', '{{"name": "near"}}', 'scheduled', 2, 0, 0, clock_timestamp() + interval '5 minutes',
             NULL),
            (9002, 'k', '{Q}', '{{"name": "near_retry"}}', 'retryable', 2, 1, 1, clock_timestamp() - interval '1 second',
             clock_timestamp())"""))
    far = {manifest["scheduled"]["id"], manifest["retryable"]["id"]}  # an hour away: beyond the span
    migrate_to(engine, cfg, "heads")
    st = QueueStorage(cfg)
    assert _waits(engine, cfg.schema) == {"overflow": far, "wheel": {9001, 9002}}
    for name, m in manifest.items():
        row = st.load_job(engine, m["id"])
        assert row is not None and row.state.value == m["state"], name
    # at head: one wait ends, one begins
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1  # 9002
    (c,) = st.claim_runtime_batch(engine, Q, 1)
    assert st.retry_after(engine, c.job.id, c.job.run_lease, 60) is not None
    before = {j: st.load_job(engine, j) for j in (*far, 9001, c.job.id)}
    assert _waits(engine, cfg.schema) == {"overflow": far, "wheel": {9001, c.job.id}}
    migrate_to(engine, cfg, "0010")
    assert _waits(engine, cfg.schema) == {"overflow": {*far, 9001, c.job.id}}
    with engine.connect() as conn:
        assert not inspect(conn).has_table("deferred_wheel_marks", schema=cfg.schema)
    migrate_to(engine, cfg, "heads")
    assert {j: st.load_job(engine, j) for j in before} == before


def test_a_previous_release_workers_retry_is_promoted_by_this_release(module_engine, previous_release):
    """Rolling deploy: a worker of the previous release writes its retry into
    ``deferred_jobs`` itself; this release's promotion serves it from the overflow."""
    url, engine = module_engine
    cfg = config("rolling_wheel", "receipts")
    migrate_to(engine, cfg, "heads")
    out = run_previous(previous_release, "work", url, cfg.schema)
    assert out["retried"] == "retryable"
    st = QueueStorage(cfg)
    waits = _waits(engine, cfg.schema)
    (retried,) = waits["overflow"]  # the old release's own insert (due in an hour)
    assert st.load_job(engine, retried).state is JobState.RETRYABLE  # type: ignore[union-attr]
    with engine.begin() as conn:  # its time came
        conn.execute(text(f'UPDATE "{cfg.schema}".deferred_jobs SET run_at = clock_timestamp() + interval \'1 minute\''))
    assert st.advance_overflow(engine, 10) == 1
    assert _waits(engine, cfg.schema) == {"overflow": set(), "wheel": {retried}}
    with engine.begin() as conn:
        conn.execute(text(f'UPDATE "{cfg.schema}".deferred_wheel SET run_at = clock_timestamp()'))
    assert st.promote_due(engine, JobState.RETRYABLE, 10) == 1
    assert st.load_job(engine, retried).state is JobState.AVAILABLE  # type: ignore[union-attr]


# -- unique-key releases as appended rows (revision 0013) --------------------------------------

KEYS_REVISION = "0013"
BEFORE_KEYS = REVISIONS[REVISIONS.index(KEYS_REVISION) - 1]


def _unique(key: str, **opts: Any) -> Any:
    from qstore import InsertOpts, InsertParams, UniqueOpts

    return InsertParams("k", {"key": key}, InsertOpts(queue=Q, unique=UniqueOpts(), **opts))


def _claims(engine: Engine, schema: str) -> dict[int, bytes]:
    """job id → key of every ``job_unique_claims`` row."""
    with engine.connect() as conn:
        return {r[0]: bytes(r[1]) for r in conn.execute(text(
            f'SELECT job_id, unique_key FROM "{schema}".job_unique_claims'))}


def _conflicts_with(st: QueueStorage, engine: Engine, key: str) -> int | None:
    """The owner an enqueue of ``key`` reports (None: the enqueue took the key)."""
    from qstore import UniqueConflictError

    try:
        _one_through_enqueue_jobs(engine, st, _unique(key))
    except UniqueConflictError as err:
        return int(str(err).rsplit("job ", 1)[1])
    return None


@pytest.mark.parametrize("mode", MODES)
def test_the_key_release_revision_keeps_live_keys_and_its_downgrade_deletes_released_ones(module_engine, mode):
    _url, engine = module_engine
    cfg = config(f"keys_{mode}", mode)
    migrate_to(engine, cfg, BEFORE_KEYS)
    st = QueueStorage(cfg)
    # at the revision before: a running, a completed (the default mask keeps its key), a
    # scheduled and an available unique job, and one whose key that revision released (deleted)
    running = _one_through_enqueue_jobs(engine, st, _unique("running"))
    assert [c.job.id for c in st.claim_runtime_batch(engine, Q, 1)] == [running]
    done = _one_through_enqueue_jobs(engine, st, _unique("done"))
    (c,) = st.claim_runtime_batch(engine, Q, 1)
    assert c.job.id == done and st.complete_runtime_batch(engine, [c]) == [(done, 1)]
    scheduled = _one_through_enqueue_jobs(engine, st, _unique("scheduled", run_at=datetime.now(timezone.utc)
                                                                     + timedelta(hours=1)))
    available, gone = st.enqueue_many(engine, [_unique("available"), _unique("gone")])
    with engine.begin() as conn:
        conn.execute(text(f'DELETE FROM "{cfg.schema}".job_unique_claims WHERE job_id = {gone}'))
    before = _claims(engine, cfg.schema)

    migrate_to(engine, cfg, "heads")
    assert _claims(engine, cfg.schema) == before  # every live key stays, owned by its job
    owners = {"running": running, "done": done, "scheduled": scheduled, "available": available}
    assert {k: _conflicts_with(st, engine, k) for k in owners} == owners
    assert _conflicts_with(st, engine, "gone") is None  # free: taken by a new job
    # at head: two keys released by cancels (appended release rows)
    assert st.cancel_job(engine, available).state == JobState.CANCELLED  # type: ignore[union-attr]
    assert st.cancel_job(engine, scheduled).state == JobState.CANCELLED  # type: ignore[union-attr]
    with engine.connect() as conn:
        assert conn.execute(text(f'SELECT count(*) FROM "{cfg.schema}".job_unique_releases')).scalar_one() == 2
    live = {j: k for j, k in _claims(engine, cfg.schema).items() if j not in (available, scheduled)}

    migrate_to(engine, cfg, BEFORE_KEYS)
    assert _claims(engine, cfg.schema) == live  # the released claims were deleted
    with engine.connect() as conn:
        assert not inspect(conn).has_table("job_unique_releases", schema=cfg.schema)
    assert _conflicts_with(st, engine, "running") == running  # that revision's enqueue_jobs
    assert _conflicts_with(st, engine, "available") is None  # free there too

    migrate_to(engine, cfg, "heads")
    assert _conflicts_with(st, engine, "done") == done
    assert _conflicts_with(st, engine, "scheduled") is None
