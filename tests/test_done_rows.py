"""Done rows are narrow or wide, and a lookup by job id finds both through indexes.

A *narrow* done row (a claimed attempt's end) leaves the body columns NULL and shares the
lane key of its ready row; a *wide* one carries its body (``created_at`` set) and has no
ready row. ``done_entries`` indexes ``job_id`` for wide rows only
(``done_entries_wide_job_id_idx``, partial on ``created_at IS NOT NULL``), and
``select_done_of_job`` finds narrow rows through the ready rows' ``job_id`` index. Both
rest on one invariant, checked here after every operation of the API and after each other
way a done row is written, receipts on and off: a done row is wide exactly when no ready
row shares its lane key.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from jobtools import add, assert_closures_sound, claim, params, running
from operation_cases import CASES
from sqlalchemy import Engine, text, union_all
from sqlalchemy.dialects import postgresql

from qstore import QueueStorage, QueueStorageConfig, UniqueOpts
from qstore.config import DONE_BLOCK
from qstore.schema import storage_schema
from qstore.storage.planes import queue as queue_plane
from qstore.types import JobState

MODES = {"receipts": True, "leases": False}
_KEY = "d.ready_slot, d.ready_generation, d.queue, d.priority, d.enqueue_shard, d.lane_seq"


def done_rows(engine: Engine, s: QueueStorage) -> list[Any]:
    """Every done row: its job, whether it is wide, and the job of the ready row sharing its
    lane key (None when there is none)."""
    with engine.connect() as c:
        return c.execute(text(f"""
            SELECT d.job_id, d.created_at IS NOT NULL AS wide, r.job_id AS ready_job, d.state, d.lane_seq
            FROM "{s.schema()}".done_entries d
            LEFT JOIN "{s.schema()}".ready_entries r
              ON r.ready_slot = d.ready_slot AND r.ready_generation = d.ready_generation
             AND r.queue = d.queue AND r.priority = d.priority
             AND r.enqueue_shard = d.enqueue_shard AND r.lane_seq = d.lane_seq""")).all()


def found_by_job(engine: Engine, s: QueueStorage, job_id: int) -> list[tuple[Any, ...]]:
    """The lane keys of ``select_done_of_job``'s rows for ``job_id`` (unlocked)."""
    sch = storage_schema(s.config)
    with engine.connect() as c:
        rows = c.execute(queue_plane.select_done_of_job(sch, job_id, lock=False)).all()
    return sorted((r.ready_slot, r.ready_generation, r.queue, r.priority, r.enqueue_shard, r.lane_seq) for r in rows)


def scanned_by_job(engine: Engine, s: QueueStorage, job_id: int) -> list[tuple[Any, ...]]:
    """The lane keys of every done row of ``job_id``, by a plain filter on ``done_entries``."""
    with engine.connect() as c:
        return sorted(tuple(r) for r in c.execute(text(
            f'SELECT {_KEY} FROM "{s.schema()}".done_entries d WHERE d.job_id = :j'), {"j": job_id}))


def batch_members(engine: Engine, s: QueueStorage) -> list[Any]:
    """Every member of a batch done row: its job, its lane key, whether its row's block is
    its position's, and the job of the ready row sharing its lane key (None when none)."""
    with engine.connect() as c:
        return c.execute(text(f"""
            SELECT m.job_id, b.ready_slot, b.ready_generation, b.queue, b.priority, b.enqueue_shard,
                   m.lane_seq, b.lane_block = m.lane_seq / {DONE_BLOCK} AS in_block, r.job_id AS ready_job
            FROM "{s.schema()}".done_batches b
            CROSS JOIN LATERAL unnest(b.lane_seqs, b.job_ids) AS m(lane_seq, job_id)
            LEFT JOIN "{s.schema()}".ready_entries r
              ON r.ready_slot = b.ready_slot AND r.ready_generation = b.ready_generation
             AND r.queue = b.queue AND r.priority = b.priority
             AND r.enqueue_shard = b.enqueue_shard AND r.lane_seq = m.lane_seq""")).all()


def batch_found_by_job(engine: Engine, s: QueueStorage, job_id: int) -> list[tuple[Any, ...]]:
    """The lane keys of ``select_batch_done_of_job``'s rows for ``job_id``."""
    with engine.connect() as c:
        rows = c.execute(queue_plane.select_batch_done_of_job(storage_schema(s.config), job_id)).all()
    assert all(r.state == "completed" for r in rows), rows
    return sorted((r.ready_slot, r.ready_generation, r.queue, r.priority, r.enqueue_shard, r.lane_seq) for r in rows)


def assert_done_rows_sound(engine: Engine, s: QueueStorage, look_up: Collection[int] | None = None) -> list[Any]:
    """Each done row is wide exactly when no ready row shares its lane key (a narrow row's
    ready row is its own job's), and the lookup by job id finds exactly each job's rows.
    Each member of a batch done row has its own job's ready row at its lane key, lies in
    its row's block, and is found by the batch lookup by job id. ``look_up``: the jobs whose
    lookups are compared (default: every job; a test of a thousand jobs names a few).
    Returns the done rows."""
    rows = done_rows(engine, s)
    for r in rows:
        assert r.wide == (r.ready_job is None), r
        assert r.ready_job in (None, r.job_id), r
        assert r.wide == (r.lane_seq < 0), r
    for job_id in {r.job_id for r in rows} & set(look_up or {r.job_id for r in rows}):
        assert found_by_job(engine, s, job_id) == scanned_by_job(engine, s, job_id), job_id
    members = batch_members(engine, s)
    for m in members:
        assert m.ready_job == m.job_id and m.in_block, m
    for job_id in {m.job_id for m in members} & set(look_up or {m.job_id for m in members}):
        assert batch_found_by_job(engine, s, job_id) == sorted(
            (m.ready_slot, m.ready_generation, m.queue, m.priority, m.enqueue_shard, m.lane_seq)
            for m in members if m.job_id == job_id), job_id
    return rows


@pytest.fixture(params=list(MODES))
def mode_storage(request: pytest.FixtureRequest, make_storage: Any) -> QueueStorage:
    return make_storage(lease_claim_receipts=MODES[request.param])


# -- every operation of the API ------------------------------------------------------------

#: every operation that writes to its own install (``reset`` drops it); without receipts
#: the claim ring holds nothing to prune, so that case's setup does not apply
WRITERS = sorted(n for n, c in CASES.items() if c.writes and not c.other_schema and n != "reset")
NOT_WITHOUT_RECEIPTS = {"prune_oldest_claims"}
#: receipts on in the fast tier, off in the long tier as well
OPERATION_RUNS = [
    *(pytest.param(n, "receipts", id=f"{n}-receipts") for n in WRITERS),
    *(pytest.param(n, "leases", id=f"{n}-leases", marks=pytest.mark.slow)
      for n in WRITERS if n not in NOT_WITHOUT_RECEIPTS),
]


@pytest.mark.parametrize(("name", "mode"), OPERATION_RUNS)
def test_every_operation_leaves_sound_done_rows_and_closures(engine, make_storage, name, mode):
    """Done rows are wide exactly when they have no ready row, and no attempt has two
    closures (see ``tests/test_closures.py``), after each operation."""
    case = CASES[name]
    s = make_storage(**{"lease_claim_receipts": MODES[mode], **case.shape})
    given = case.setup(engine, s)
    case.call(s, engine, given)
    assert_done_rows_sound(engine, s)
    assert_closures_sound(engine, s)


# -- the other ways a done row is written --------------------------------------------------

LATER = timedelta(minutes=5)  # a wait inside the deferred wheel's span
FAR = timedelta(hours=2)  # a wait in the overflow


def _complete_fast(engine: Engine, s: QueueStorage) -> None:
    s.complete_runtime_batch(engine, [running(engine, s)])


def _complete_general_unique(engine: Engine, s: QueueStorage) -> None:
    s.complete_runtime_batch(engine, [running(engine, s, unique=UniqueOpts())])


def _complete_after_heartbeat(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s)
    s.heartbeat_batch(engine, [(job.job.id, job.job.run_lease)])
    s.complete_runtime_batch(engine, [job])


def _complete_and_claim(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s)
    add(engine, s)
    s.complete_and_claim(engine, [job], "q", 5)


def _retries_exhausted(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s, max_attempts=1)
    assert s.fail_retryable(engine, job.job.id, job.job.run_lease, "boom").state == JobState.FAILED


def _retried_then_completed(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s)
    s.retry_after(engine, job.job.id, job.job.run_lease, 0)
    assert s.promote_due(engine, JobState.RETRYABLE, 10) == 1
    s.complete_runtime_batch(engine, [claim(engine, s)])


def _cancel(state: str) -> Any:
    def write(engine: Engine, s: QueueStorage) -> None:
        if state == "available":
            job_id = add(engine, s)
        elif state == "running":
            job_id = running(engine, s).job.id
        elif state == "waiting_external":
            job = running(engine, s)
            token = s.register_callback(engine, job.job.id, job.job.run_lease, 60)
            assert s.enter_callback_wait(engine, job.job.id, job.job.run_lease, token)
            job_id = job.job.id
        elif state == "retryable":
            job = running(engine, s)
            s.retry_after(engine, job.job.id, job.job.run_lease, 60)
            job_id = job.job.id
        else:  # scheduled, in the wheel or in the overflow
            wait = LATER if state == "scheduled" else FAR
            job_id = add(engine, s, run_at=datetime.now(timezone.utc) + wait)
        row = s.cancel_job(engine, job_id)
        assert row is not None and row.state == JobState.CANCELLED, (state, row)
    return write


def _discard(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s, kind="k")
    s.fail_terminal(engine, job.job.id, job.job.run_lease, "boom")
    wide = add(engine, s, kind="k", run_at=datetime.now(timezone.utc) + FAR)
    s.cancel_job(engine, wide)
    assert s.discard_failed_by_kind(engine, "k") == 1


def _dlq_round_trip(engine: Engine, s: QueueStorage) -> None:
    job = running(engine, s)
    s.fail_terminal(engine, job.job.id, job.job.run_lease, "boom")
    assert s.move_failed_to_dlq(engine, job.job.id, "poison") is not None
    assert s.retry_from_dlq(engine, job.job.id) is not None
    s.complete_runtime_batch(engine, [claim(engine, s)])


def _dlq_on_exhaustion(engine: Engine, s: QueueStorage) -> None:
    s.set_queue_options(engine, "q", dlq_enabled=True)
    job = running(engine, s, max_attempts=1)
    s.fail_retryable(engine, job.job.id, job.job.run_lease, "boom")
    _complete_fast(engine, s)


def _retry_job_of_cancelled(engine: Engine, s: QueueStorage) -> None:
    job_id = add(engine, s, run_at=datetime.now(timezone.utc) + FAR)
    s.cancel_job(engine, job_id)
    assert s.retry_job(engine, job_id) is not None
    s.complete_runtime_batch(engine, [claim(engine, s)])
    job = running(engine, s)
    s.fail_terminal(engine, job.job.id, job.job.run_lease, "boom")
    assert s.retry_job(engine, job.job.id) is not None
    s.cancel_job(engine, job.job.id)


def _rescued(how: str) -> Any:
    def write(engine: Engine, s: QueueStorage) -> None:
        attempts = "lease_claims" if s.lease_claim_receipts() else "leases"
        at = "claimed_at" if s.lease_claim_receipts() else "heartbeat_at"
        job = running(engine, s, max_attempts=1, deadline=None if how == "stale" else 1)
        with engine.begin() as c:
            if how == "stale":
                c.execute(text(f'UPDATE "{s.schema()}".{attempts} SET {at} = now() - interval \'1 hour\''))
            else:
                c.execute(text(f'UPDATE "{s.schema()}".{attempts} SET deadline_at = now() - interval \'1 hour\''))
        rescued = (s.rescue_stale_heartbeats(engine, 60) if how == "stale"
                   else s.rescue_expired_deadlines(engine))
        assert [r.id for r in rescued] == [job.job.id]
    return write


def _callback(outcome: str) -> Any:
    def write(engine: Engine, s: QueueStorage) -> None:
        job = running(engine, s, max_attempts=1)
        token = s.register_callback(engine, job.job.id, job.job.run_lease, 60)
        assert s.enter_callback_wait(engine, job.job.id, job.job.run_lease, token)
        if outcome == "completed":
            s.complete_external(engine, token, {"ok": 1})
        elif outcome == "failed":
            s.fail_external(engine, token, "no")
        else:
            with engine.begin() as c:
                c.execute(text(f'UPDATE "{s.schema()}".leases SET callback_timeout_at = now() - interval \'1 hour\''))
            assert len(s.rescue_expired_callbacks(engine)) == 1
    return write


#: unique key bits by state (``UniqueOpts.states``)
BIT = {st: 1 << i for i, st in enumerate(
    ("scheduled", "available", "running", "completed", "retryable", "failed", "cancelled", "waiting_external"))}


def _promotion_conflict(engine: Engine, s: QueueStorage) -> None:
    """A retried unique job whose key another job took meanwhile fails at its promotion
    (its body is the deferred backlog's)."""
    not_while_retryable = UniqueOpts(states=BIT["available"] | BIT["running"] | BIT["completed"])
    job = running(engine, s, unique=not_while_retryable)
    s.retry_after(engine, job.job.id, job.job.run_lease, 0)
    add(engine, s, unique=not_while_retryable)  # takes the freed key
    s.promote_due(engine, JobState.RETRYABLE, 10)
    row = s.load_job(engine, job.job.id)
    assert row is not None and row.state == JobState.FAILED


def _rescue_conflict(engine: Engine, s: QueueStorage) -> None:
    """An exhausted attempt whose failed state's key another job's failure holds fails at
    its rescue all the same (the key's owner recorded)."""
    only_failed = UniqueOpts(states=BIT["failed"])
    owner = running(engine, s, unique=only_failed)
    s.fail_terminal(engine, owner.job.id, owner.job.run_lease, "first")
    loser = running(engine, s, unique=only_failed, max_attempts=1)
    attempts = "lease_claims" if s.lease_claim_receipts() else "leases"
    at = "claimed_at" if s.lease_claim_receipts() else "heartbeat_at"
    with engine.begin() as c:
        c.execute(text(f'UPDATE "{s.schema()}".{attempts} SET {at} = now() - interval \'1 hour\' '
                       "WHERE job_id = :j"), {"j": loser.job.id})
    assert [r.id for r in s.rescue_stale_heartbeats(engine, 60)] == [loser.job.id]


WRITES = {
    "unique_conflict_at_promotion": _promotion_conflict,
    "unique_conflict_at_rescue": _rescue_conflict,
    "complete_fast_path": _complete_fast,
    "complete_general_path_unique": _complete_general_unique,
    "complete_after_a_heartbeat": _complete_after_heartbeat,
    "complete_and_claim": _complete_and_claim,
    "retries_exhausted_to_failed": _retries_exhausted,
    "retried_then_completed": _retried_then_completed,
    **{f"cancel_{st}": _cancel(st) for st in ("available", "running", "waiting_external", "retryable",
                                               "scheduled", "scheduled_far")},
    "discard_failed_by_kind": _discard,
    "dlq_round_trip": _dlq_round_trip,
    "dlq_on_exhaustion": _dlq_on_exhaustion,
    "retry_job_of_cancelled_and_failed": _retry_job_of_cancelled,
    "rescue_stale_heartbeat": _rescued("stale"),
    "rescue_expired_deadline": _rescued("deadline"),
    **{f"callback_{o}": _callback(o) for o in ("completed", "failed", "timed_out")},
}


@pytest.mark.parametrize("way", sorted(WRITES))
def test_each_way_of_ending_a_job_writes_a_done_row_wide_exactly_without_a_ready_row(engine, mode_storage, way):
    WRITES[way](engine, mode_storage)
    assert_done_rows_sound(engine, mode_storage)


def test_a_claimed_attempts_completion_alone_writes_a_narrow_row(engine, mode_storage):
    """One attempt completed alone: a narrow row, on the fast path (receipts on: a batch row
    of one member would cost more) and on the general path (every attempt a lease)."""
    _complete_fast(engine, mode_storage)
    [row] = assert_done_rows_sound(engine, mode_storage)
    assert (row.wide, row.state, batch_members(engine, mode_storage)) == (False, "completed", [])


def test_one_fast_completion_writes_a_batch_row_per_lane_holding_two_or_more_and_narrow_rows_else(engine, st):
    """Three jobs of a one-lane queue and two jobs in lanes of their own completed in one
    call: one batch row holding the three in position order, and two narrow rows."""
    lone = [running(engine, st) for _ in range(2)]  # one enqueue call each: a lane each
    st.set_queue_options(engine, "q2", enqueue_shards=1)
    st.enqueue_params_batch(engine, [params(queue="q2") for _ in range(3)])
    batch = st.claim_runtime_batch(engine, "q2", 3)
    assert len(st.complete_runtime_batch(engine, [*lone, *batch])) == 5
    with engine.connect() as c:
        [row] = c.execute(text(f'SELECT queue, lane_seqs, job_ids FROM "{st.schema()}".done_batches')).all()
    assert (row.queue, list(row.job_ids)) == ("q2", [j.job.id for j in batch])
    assert list(row.lane_seqs) == sorted(row.lane_seqs)
    narrow = assert_done_rows_sound(engine, st)
    assert sorted(r.job_id for r in narrow) == sorted(j.job.id for j in lone)
    assert all(not r.wide and r.state == "completed" for r in narrow)


def test_members_of_one_lane_in_two_blocks_of_positions_make_two_batch_rows(engine, st):
    n = DONE_BLOCK + 5  # positions 1 .. DONE_BLOCK + 5 of one lane
    st.set_queue_options(engine, "q2", enqueue_shards=1)
    st.enqueue_params_batch(engine, [params(queue="q2") for _ in range(n)])
    jobs = st.claim_runtime_batch(engine, "q2", n)
    assert len(st.complete_runtime_batch(engine, jobs)) == n
    with engine.connect() as c:
        rows = c.execute(text(f'SELECT lane_block, cardinality(lane_seqs) AS n FROM "{st.schema()}".done_batches '
                              "ORDER BY lane_block")).all()
    assert [(r.lane_block, r.n) for r in rows] == [(0, DONE_BLOCK - 1), (1, 6)]
    # every member's place is checked; the lookups by job id for the ends of both blocks
    edges = [jobs[i].job.id for i in (0, 1, DONE_BLOCK - 3, DONE_BLOCK - 2, DONE_BLOCK - 1, n - 1)]
    assert_done_rows_sound(engine, st, look_up=edges)
    assert st.queue_counts(engine, "q2").terminal == n


@pytest.mark.parametrize("state", ["scheduled", "scheduled_far", "retryable"])
def test_cancelling_a_waiting_job_writes_a_wide_row(engine, mode_storage, state):
    _cancel(state)(engine, mode_storage)
    wide = [r for r in assert_done_rows_sound(engine, mode_storage) if r.state == "cancelled"]
    assert [r.wide for r in wide] == [True]


def test_a_job_with_a_narrow_and_a_wide_row_is_found_with_both_and_the_newest_wins(engine, st):
    """Two done rows of one job, one of each kind (a wide copy of its failed narrow row,
    finalized later and cancelled): the lookup finds both, ``retry_job`` takes the newer."""
    job = running(engine, st)
    st.fail_terminal(engine, job.job.id, job.job.run_lease, "boom")
    with engine.begin() as c:
        c.execute(text(f"""
            INSERT INTO "{st.schema()}".done_entries
              (ready_slot, ready_generation, job_id, kind, queue, state, priority, attempt, run_lease,
               lane_seq, enqueue_shard, attempted_at, finalized_at, args, max_attempts, run_at,
               created_at, unique_key, unique_states, payload)
            SELECT ready_slot, ready_generation, job_id, kind, queue, 'cancelled', priority, attempt,
                   run_lease, -job_id, 0, attempted_at, finalized_at + interval '1 second', args,
                   max_attempts, run_at, created_at, unique_key, unique_states, payload
            FROM "{st.schema()}".terminal_jobs WHERE job_id = :j"""), {"j": job.job.id})
    rows = assert_done_rows_sound(engine, st)
    assert sorted(r.wide for r in rows if r.job_id == job.job.id) == [False, True]
    loaded = st.load_job(engine, job.job.id)
    assert loaded is not None and loaded.state == JobState.CANCELLED
    st.retry_job(engine, job.job.id)
    [left] = done_rows(engine, st)
    assert (left.wide, left.state) == (False, "failed")


# -- the lookup's plan ---------------------------------------------------------------------


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


SLOTS = 4


def history(engine: Engine, s: QueueStorage, completed: int = 1500, failed: int = 20, cancelled: int = 50) -> None:
    """Terminal history of every kind in every queue slot, analysed: completed attempts
    (half through the fast path: batch members; half through the general path: narrow
    rows), failed attempts (narrow rows) and cancelled scheduled jobs (wide rows), the ring
    turned after each slot's share (but the last)."""
    later = datetime.now(timezone.utc) + FAR
    for k in range(s.config.queue_slot_count):
        s.enqueue_params_batch(engine, [params(args={"n": i}) for i in range(completed + failed)])
        jobs = s.claim_runtime_batch(engine, "q", completed + failed)
        s.complete_runtime_batch(engine, jobs[:completed // 2])
        s.complete_job_batch_by_id(engine, [(j.job.id, j.job.run_lease) for j in jobs[completed // 2:completed]])
        for j in jobs[completed:]:
            s.fail_terminal(engine, j.job.id, j.job.run_lease, "boom")
        s.enqueue_params_batch(engine, [params(args={"c": i}, run_at=later) for i in range(cancelled)])
        with engine.connect() as c:
            waiting = c.execute(text(f'SELECT job_id FROM "{s.schema()}".deferred_jobs')).scalars().all()
        s.cancel_jobs_by_ids(engine, waiting)
        if k + 1 < s.config.queue_slot_count:
            assert s.rotate(engine).kind == "rotated"
    with engine.connect() as c:
        c.execution_options(isolation_level="AUTOCOMMIT").execute(text(
            f'ANALYZE "{s.schema()}".done_entries, "{s.schema()}".ready_entries, "{s.schema()}".done_batches'))


def scans(engine: Engine, statement: Any) -> list[tuple[str, str, str, bool]]:
    """``(relation, node type, index, probe)`` of each scan in the plan of ``statement``;
    ``probe`` is False for a scan without an index condition (a sequential scan, or an
    index read whole). Planned with whole reads priced out (sequential scans, and hash,
    merge and materialised joins, which read a side whole), so a scan without an index
    condition means no index can serve it, not that a table of a test's size is cheaper
    to read whole."""
    sql = str(statement.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
    with engine.connect() as c:
        for setting in ("enable_seqscan", "enable_hashjoin", "enable_mergejoin", "enable_material"):
            c.execute(text(f"SET LOCAL {setting} = off"))
        [plan] = c.execute(text(f"EXPLAIN (FORMAT JSON) {sql}")).scalar_one()
    return [(n["Relation Name"], n["Node Type"], n.get("Index Name", ""), "Index Cond" in n or "Recheck Cond" in n)
            for n in _plan_nodes(plan["Plan"]) if "Relation Name" in n]


def _probed(used: list[tuple[str, str, str, bool]], table: str) -> set[str]:
    """The children of ``table`` read through an index condition."""
    return {rel for rel, _, _, probe in used if rel.startswith(f"{table}_") and probe}


def _job_id_probes(used: list[tuple[str, str, str, bool]], table: str) -> set[str]:
    return {rel for rel, _, index, probe in used if rel.startswith(f"{table}_") and index.endswith("_job_id_idx")
            and probe}


@pytest.fixture(scope="module")
def with_history(engine: Engine, small_installed: QueueStorageConfig,
                 install_pool: Any) -> QueueStorage:
    """The module's small-ring install (4 queue slots) with :func:`history`; the plan tests
    only read it."""
    install_pool.reset(small_installed)
    s = QueueStorage(small_installed)
    history(engine, s)
    return s


def test_the_lookup_of_a_jobs_done_rows_probes_indexes_only(engine, with_history):
    """Narrow rows through the ready rows' job_id index and the done rows' primary key,
    wide rows through the partial job_id index, in every slot: no ring child is scanned."""
    s = with_history
    used = scans(engine, queue_plane.select_done_of_job(storage_schema(s.config), 1, lock=False))
    assert [u for u in used if not u[3]] == []
    assert _job_id_probes(used, "ready_entries") == {f"ready_entries_{k}" for k in range(SLOTS)}, used
    assert _job_id_probes(used, "done_entries") == {f"done_entries_{k}" for k in range(SLOTS)}, used


def test_the_locking_lookup_of_a_jobs_failed_rows_reads_indexes_only(engine, with_history):
    """``retry_job`` and ``move_failed_to_dlq``'s lookup (failed rows, newest first, locked):
    both branches probe their job_id index; done rows are probed by primary key, or, while
    the ring holds few failed rows, read from the failed rows' own partial index whole
    (the planner's choice). No ring child is read sequentially."""
    s = with_history
    sch = storage_schema(s.config)
    stmt = queue_plane.select_done_of_job(sch, 1, sch.done.parent.c.state == JobState.FAILED,
                                          newest_per_job=True, limit=1)
    used = scans(engine, stmt)
    failed_index = {f"done_entries_{k}_queue_idx" for k in range(SLOTS)}  # done_entries_failed_idx's children
    assert [u for u in used if not u[3] and u[2] not in failed_index] == []
    assert _job_id_probes(used, "ready_entries") == {f"ready_entries_{k}" for k in range(SLOTS)}, used
    assert _job_id_probes(used, "done_entries") == {f"done_entries_{k}" for k in range(SLOTS)}, used


def test_a_lookup_of_terminal_jobs_by_job_id_probes_indexes_only(engine, with_history):
    """The ``terminal_jobs`` view filtered on ``job_id``: narrow rows through the ready
    rows' job_id index, wide rows through the partial one, in every slot; no ring child is
    scanned (a scan of every done row retained, before revision 0018)."""
    s = with_history
    used = scans(engine, text(f'SELECT * FROM "{s.schema()}".terminal_jobs WHERE job_id = 1'))
    assert [u for u in used if not u[3]] == []
    assert _job_id_probes(used, "ready_entries") == {f"ready_entries_{k}" for k in range(SLOTS)}, used
    assert _job_id_probes(used, "done_entries") == {f"done_entries_{k}" for k in range(SLOTS)}, used
    assert _probed(used, "done_batches") == {f"done_batches_{k}" for k in range(SLOTS)}, used


def test_the_lookup_of_a_jobs_batch_members_probes_indexes_only(engine, with_history):
    """The ready rows' job_id index, then each slot's batch rows by lane and block."""
    s = with_history
    used = scans(engine, queue_plane.select_batch_done_of_job(storage_schema(s.config), 1))
    assert [u for u in used if not u[3]] == []
    assert _job_id_probes(used, "ready_entries") == {f"ready_entries_{k}" for k in range(SLOTS)}, used
    assert _probed(used, "done_batches") == {f"done_batches_{k}" for k in range(SLOTS)}, used


def unanalysed_ring(engine: Engine, s: QueueStorage, jobs: int = 40_000) -> None:
    """Slot 0 of a fresh install filled straight with ``jobs`` ready rows in one lane, the
    first half of them completed as narrow done rows, the second half as batch members (32
    to a batch row), and no statistics gathered: the planner sees only the tables' sizes."""
    q = f'"{s.schema()}"'
    half = jobs // 2
    with engine.begin() as c:
        c.execute(text(f"INSERT INTO {q}.ready_entries (ready_slot, ready_generation, job_id, kind, queue, "
                       f"priority, lane_seq) SELECT 0, 0, g, 'k', 'q', 2, g FROM generate_series(1, {jobs}) g"))
        c.execute(text(f"INSERT INTO {q}.done_entries (ready_slot, ready_generation, job_id, kind, queue, state, "
                       f"priority, attempt, run_lease, lane_seq) SELECT 0, 0, g, 'k', 'q', 'completed', 2, 1, 1, g "
                       f"FROM generate_series(1, {half}) g"))
        c.execute(text(f"INSERT INTO {q}.done_batches (ready_slot, ready_generation, queue, priority, enqueue_shard, "
                       f"lane_block, lane_seqs, job_ids, run_leases, attempts, attempted_ats) "
                       f"SELECT 0, 0, 'q', 2, 0, min(g) / {DONE_BLOCK}, array_agg(g ORDER BY g), "
                       f"array_agg(g ORDER BY g), array_agg(1::bigint), array_agg(1::smallint), array_agg(now()) "
                       f"FROM generate_series({half + 1}, {jobs}) g GROUP BY g / 32"))


def test_a_jobs_done_rows_are_probed_by_key_in_a_ring_without_statistics(engine, st):
    """The read-only lookup of a job's done rows and batch members (``load_job``'s) probes
    them by key at the planner's own settings, even where no statistics were ever gathered
    (autovacuum off, a child just refilled): every read of the slot's ``done_entries`` and
    ``done_batches`` has an index condition. Written as joins, the lookups were planned
    here as hash joins that read every done row and every batch row of the slot."""
    unanalysed_ring(engine, st)
    sch = storage_schema(st.config)
    for job_id in (10, 30_000):  # a narrow done row, a batch member
        stmt = union_all(queue_plane.select_done_of_job(sch, job_id, lock=False),
                         queue_plane.select_batch_done_of_job(sch, job_id))
        sql = str(stmt.compile(dialect=postgresql.dialect(), compile_kwargs={"literal_binds": True}))
        with engine.connect() as c:
            [plan] = c.execute(text(f"EXPLAIN (FORMAT JSON) {sql}")).scalar_one()
        reads = [(n["Relation Name"], n["Node Type"], "Index Cond" in n or "Recheck Cond" in n)
                 for n in _plan_nodes(plan["Plan"]) if n.get("Relation Name") in ("done_entries_0", "done_batches_0")]
        assert {rel for rel, _, _ in reads} == {"done_entries_0", "done_batches_0"}, (job_id, reads)
        assert [r for r in reads if not r[2]] == [], (job_id, reads)
        row = st.load_job(engine, job_id)
        assert row is not None and (row.id, row.state, row.run_lease) == (job_id, JobState.COMPLETED, 1)


def test_done_rows_index_job_id_only_where_created_at_is_set(engine, st):
    with engine.connect() as c:
        defs = c.execute(text(
            "SELECT i.relname, pg_get_indexdef(i.oid) FROM pg_index x "
            "JOIN pg_class t ON t.oid = x.indrelid JOIN pg_class i ON i.oid = x.indexrelid "
            "JOIN pg_namespace n ON n.oid = t.relnamespace "
            "WHERE n.nspname = :s AND t.relname IN ('done_entries', 'done_entries_0') "
            "AND pg_get_indexdef(i.oid) LIKE '%(job_id)%'"), {"s": st.schema()}).all()
    assert sorted(name for name, _ in defs) == ["done_entries_0_job_id_idx", "done_entries_wide_job_id_idx"]
    assert all(d.endswith("WHERE (created_at IS NOT NULL)") for _, d in defs), defs


def test_a_previous_release_lookup_on_done_job_id_still_finds_every_row(engine, st):
    """What a worker of the release before this index change runs (``done_entries`` filtered
    on ``job_id``, the ``terminal_jobs`` view by job id) returns the same rows without the
    full index: a slower scan, not a wrong one."""
    _complete_fast(engine, st)
    _cancel("scheduled_far")(engine, st)
    _retries_exhausted(engine, st)
    sch = storage_schema(st.config)
    d = sch.done.parent
    with engine.connect() as c:
        for job_id in {r.job_id for r in done_rows(engine, st)}:
            old = c.execute(queue_plane.select_done(sch, d.c.job_id == job_id)).all()
            new = c.execute(queue_plane.select_done_of_job(sch, job_id)).all()
            assert sorted(map(tuple, old)) == sorted(map(tuple, new))
            view = c.execute(text(f'SELECT job_id, state, finalized_at FROM "{st.schema()}".terminal_jobs '
                                  "WHERE job_id = :j"), {"j": job_id}).all()
            assert sorted(map(tuple, view)) == sorted((r.job_id, r.state, r.finalized_at) for r in new)


def test_load_job_shows_a_jobs_newest_done_row_through_the_lookup(engine, st):
    job = running(engine, st, args={"a": [1, 2]}, tags=["t"])
    st.complete_runtime_batch(engine, [job])
    row = st.load_job(engine, job.job.id)
    assert row is not None and (row.state, row.args, row.tags) == (JobState.COMPLETED, {"a": [1, 2]}, ["t"])
    far = add(engine, st, run_at=datetime.now(timezone.utc) + FAR, metadata={"m": 1})
    st.cancel_job(engine, far)
    row = st.load_job(engine, far)
    assert row is not None and (row.state, row.metadata) == (JobState.CANCELLED, {"m": 1})
    assert json.dumps(row.args) == json.dumps({"n": 1})
