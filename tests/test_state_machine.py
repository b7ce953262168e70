"""A hypothesis state machine drives random sequences of enqueue / claim / heartbeat / worker
outcome / stale write / rescue / promotion / admin calls against an in-memory model of each
job, and checks after every step that ``load_job`` agrees with the model and that no job is
lost or active twice (a census of every job's live representations: exactly as many as its
state calls for, never two, and none for a job nobody enqueued).

Each test runs the machine in short runs with fixed seeds until every rule has run (see
:func:`run_until_every_rule_ran`): the same examples on every test run, and never a pass
that exercised less."""

from __future__ import annotations

import functools
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from hypothesis import HealthCheck, seed, settings
from hypothesis import strategies as hst
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from jobtools import BACKLOG, CLOSED, relation
from sqlalchemy import text

from qstore import InsertOpts, InsertParams, QueueStorage
from qstore.types import JobState

# -- helpers ----------------------------------------------------------------------------------


def census(conn, schema: str) -> Counter:
    """Live representations per job: unclaimed, untombstoned ready positions (not covered by a
    claim range) + open receipts without a lease + leases + deferred rows + DLQ rows. Computed
    from plain reads of each table (a single SQL census over the partitioned tables costs
    ~25 ms of planning per call)."""

    def q(sql: str) -> list:
        return conn.execute(text(sql.format(s=schema))).all()

    tombs = {tuple(r) for r in q('SELECT ready_slot, queue, priority, enqueue_shard, lane_seq FROM "{s}".ready_tombstones')}
    ranges = q('SELECT queue, priority, enqueue_shard, first_seq, last_seq FROM "{s}".ready_claim_ranges')
    closed = {tuple(r) for r in q(f"SELECT claim_slot, job_id, run_lease FROM {relation(schema, CLOSED)}")}
    leases = q('SELECT job_id, run_lease FROM "{s}".leases')
    leased = {tuple(r) for r in leases}
    live: Counter = Counter()
    for job_id, slot, queue, prio, shard, seq in q(
            'SELECT job_id, ready_slot, queue, priority, enqueue_shard, lane_seq FROM "{s}".ready_entries'):
        claimed = any((rq, rp, rs) == (queue, prio, shard) and lo <= seq <= hi for rq, rp, rs, lo, hi in ranges)
        if (slot, queue, prio, shard, seq) not in tombs and not claimed:
            live[job_id] += 1
    for slot, job_id, lease in q('SELECT claim_slot, job_id, run_lease FROM "{s}".lease_claims'):
        if (slot, job_id, lease) not in closed and (job_id, lease) not in leased:
            live[job_id] += 1
    for (job_id, _) in leases:
        live[job_id] += 1
    for (job_id,) in q(f'SELECT job_id FROM {relation("{s}", BACKLOG)} UNION ALL SELECT job_id FROM "{{s}}".dlq_entries'):
        live[job_id] += 1
    return live


#: model state -> (state load_job reports, live representations the job must have)
EXPECTED = {
    "available": (JobState.AVAILABLE, 1),
    "running": (JobState.RUNNING, 1),
    "scheduled": (JobState.SCHEDULED, 1),
    "retryable": (JobState.RETRYABLE, 1),
    "completed": (JobState.COMPLETED, 0),
    "failed": (JobState.FAILED, 0),
    "cancelled": (JobState.CANCELLED, 0),
    "dlq": (JobState.FAILED, 1),
}
DEFERRED = ("scheduled", "retryable")
TERMINAL = ("completed", "failed", "cancelled")
#: What the maintenance runs pruned (checked after the run: the run must have exercised it).
PRUNED: Counter = Counter()
#: How often each rule ran (checked after the run: every rule must have run).
RAN: Counter = Counter()


def counted(f: Callable) -> Callable:
    """Count the rule's runs in :data:`RAN` under its name."""

    @functools.wraps(f)
    def run(*args, **kwargs):
        RAN[f.__name__] += 1
        return f(*args, **kwargs)

    return run


@dataclass
class ModelJob:
    max_attempts: int
    state: str = "available"
    attempt: int = 0
    run_lease: int = 0
    run_at: datetime | None = None  # deferred jobs: when they fall due


def build_machine(engine, fresh_storage: Callable[[], QueueStorage],
                  maintenance: bool = False) -> type[RuleBasedStateMachine]:
    class JobLifecycle(RuleBasedStateMachine):
        """Random enqueue / claim / heartbeat / outcome / rescue / promotion / admin sequences
        against an in-memory model of each job's state, attempt and run_lease. With
        ``maintenance``, rotate + prune of all three rings interleave with them: terminal
        history may then disappear (state "gone"), nothing else may."""

        def __init__(self) -> None:
            super().__init__()
            self.s = fresh_storage()  # every example starts from a fresh install
            self.jobs: dict[int, ModelJob] = {}

        # -- helpers --------------------------------------------------------------------
        def ids(self, *states: str) -> list[int]:
            return sorted(j for j, m in self.jobs.items() if m.state in states)

        def defer(self, job_id: int, row, state: str) -> None:
            m = self.jobs[job_id]
            assert row is not None and row.state == EXPECTED[state][0], row
            m.state, m.attempt, m.run_at = state, row.attempt, row.run_at

        def add_job(self, max_attempts: int) -> None:
            self.s.enqueue_params_batch(engine, [InsertParams("k", {"i": len(self.jobs)}, InsertOpts(
                queue="q", max_attempts=max_attempts))])
            with engine.connect() as c:
                job_id = c.execute(text(f'SELECT max(job_id) FROM "{self.s.schema()}".ready_entries')).scalar_one()
            assert job_id not in self.jobs
            self.jobs[job_id] = ModelJob(max_attempts)

        def claim_one(self) -> None:
            got = self.s.claim_runtime_batch(engine, "q", 1)
            if not self.ids("available"):
                assert got == []
                return
            # A claim's limit counts tombstoned positions too, so a
            # claim may come back empty while a job waits behind cancelled/moved positions;
            # each empty claim consumes at least one, so the job must come within len(jobs).
            for _ in range(len(self.jobs)):
                if got:
                    break
                got = self.s.claim_runtime_batch(engine, "q", 1)
            assert len(got) == 1, "an available job was not claimable"
            job = got[0].job
            m = self.jobs[job.id]
            assert m.state == "available"
            assert (job.attempt, job.run_lease) == (m.attempt + 1, m.run_lease + 1)
            m.state, m.attempt, m.run_lease = "running", job.attempt, job.run_lease

        def running_job(self, data) -> tuple[int, ModelJob]:
            job_id = data.draw(hst.sampled_from(self.ids("running")))
            return job_id, self.jobs[job_id]

        # -- rules ----------------------------------------------------------------------
        # Hypothesis leaves a random subset of the rules out of each example; jobs enqueued
        # and claimed up front give the other rules work where ``enqueue`` or ``claim`` is
        # left out.
        @initialize(max_attempts=hst.lists(hst.integers(1, 3), min_size=1, max_size=3),
                    claims=hst.integers(0, 3))
        def start_with_jobs(self, max_attempts: list[int], claims: int) -> None:
            for n in max_attempts:
                self.add_job(n)
            for _ in range(min(claims, len(max_attempts))):
                self.claim_one()

        @rule(max_attempts=hst.integers(1, 3))
        @counted
        def enqueue(self, max_attempts: int) -> None:
            self.add_job(max_attempts)

        @rule()
        @counted
        def claim(self) -> None:
            self.claim_one()

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def heartbeat(self, data) -> None:
            job_id = data.draw(hst.sampled_from(self.ids("running")))
            assert self.s.heartbeat_batch(engine, [(job_id, self.jobs[job_id].run_lease)]) == 1

        # One rule per worker outcome: hypothesis leaves a random subset of the rules out of
        # each example, so a single rule for all seven would leave most examples with none.
        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def complete(self, data) -> None:
            job_id, m = self.running_job(data)
            assert self.s.complete_job_batch_by_id(engine, [(job_id, m.run_lease)]) == [(job_id, m.run_lease)]
            m.state = "completed"

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def retry_after(self, data) -> None:
            job_id, m = self.running_job(data)
            self.defer(job_id, self.s.retry_after(engine, job_id, m.run_lease, 0), "retryable")

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def snooze(self, data) -> None:
            job_id, m = self.running_job(data)
            self.defer(job_id, self.s.snooze(engine, job_id, m.run_lease, 0), "scheduled")

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def fail_retryable(self, data) -> None:
            job_id, m = self.running_job(data)
            row = self.s.fail_retryable(engine, job_id, m.run_lease, "boom")
            if m.attempt >= m.max_attempts:
                assert row.state == JobState.FAILED
                m.state = "failed"
            else:
                self.defer(job_id, row, "retryable")

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def fail_terminal(self, data) -> None:
            job_id, m = self.running_job(data)
            assert self.s.fail_terminal(engine, job_id, m.run_lease, "fatal").state == JobState.FAILED
            m.state = "failed"

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def fail_to_dlq(self, data) -> None:
            job_id, m = self.running_job(data)
            assert self.s.fail_to_dlq(engine, job_id, m.run_lease, "r", "e").state == JobState.FAILED
            m.state = "dlq"

        @precondition(lambda self: self.ids("running"))
        @rule(data=hst.data())
        @counted
        def cancel_running(self, data) -> None:
            job_id, m = self.running_job(data)
            assert self.s.cancel_running(engine, job_id, m.run_lease, "r").state == JobState.CANCELLED
            m.state = "cancelled"

        @precondition(lambda self: any(m.run_lease for m in self.jobs.values()))
        @rule(data=hst.data())
        @counted
        def stale_write(self, data) -> None:
            """A worker holding an outdated (job_id, run_lease) is always rejected."""
            job_id = data.draw(hst.sampled_from([j for j, m in self.jobs.items() if m.run_lease]))
            m = self.jobs[job_id]
            lease = m.run_lease - 1 if m.state == "running" else m.run_lease
            assert self.s.fail_retryable(engine, job_id, lease, "late") is None
            assert self.s.complete_job_batch_by_id(engine, [(job_id, lease)]) == []
            assert self.s.heartbeat_batch(engine, [(job_id, lease)]) == 0

        @precondition(lambda self: self.ids("running"))  # else it would wipe out the next claim
        @rule()
        @counted
        def rescue_stale(self) -> None:
            time.sleep(0.005)
            rescued = {r.id: r for r in self.s.rescue_stale_heartbeats(engine, 0.001)}
            assert sorted(rescued) == self.ids("running")
            for job_id, row in rescued.items():
                m = self.jobs[job_id]
                if m.attempt >= m.max_attempts:
                    assert row.state == JobState.FAILED
                    m.state = "failed"
                else:
                    self.defer(job_id, row, "retryable")

        @rule(which=hst.sampled_from(DEFERRED))
        @counted
        def promote(self, which: str) -> None:
            with engine.connect() as c:
                before = c.execute(text("SELECT clock_timestamp()")).scalar_one()
            n = self.s.promote_due(engine, JobState(which), 1000)
            with engine.connect() as c:
                after = c.execute(text("SELECT clock_timestamp()")).scalar_one()
            moved = 0
            for job_id in self.ids(which):
                m = self.jobs[job_id]
                if m.run_at <= before:
                    promoted = True
                elif m.run_at > after:
                    promoted = False
                else:  # fell due while promote_due ran: either answer is right
                    promoted = self.s.load_job(engine, job_id).state == JobState.AVAILABLE
                if promoted:
                    m.state, m.run_at = "available", None
                    moved += 1
            assert n == moved

        @precondition(lambda self: self.jobs)
        @rule(data=hst.data())
        @counted
        def cancel_job(self, data) -> None:
            job_id = data.draw(hst.sampled_from(sorted(self.jobs)))
            m = self.jobs[job_id]
            row = self.s.cancel_job(engine, job_id)
            if m.state in ("available", "running", *DEFERRED):
                assert row is not None and row.state == JobState.CANCELLED
                m.state = "cancelled"
            else:
                assert row is None

        @precondition(lambda self: self.jobs)
        @rule(data=hst.data())
        @counted
        def retry_job(self, data) -> None:
            job_id = data.draw(hst.sampled_from(sorted(self.jobs)))
            m = self.jobs[job_id]
            row = self.s.retry_job(engine, job_id)
            if m.state in ("failed", "cancelled"):
                assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, m.run_lease)
                m.state, m.attempt = "available", 0
            else:
                assert row is None

        @precondition(lambda self: self.jobs)
        @rule(data=hst.data())
        @counted
        def retry_from_dlq(self, data) -> None:
            job_id = data.draw(hst.sampled_from(sorted(self.jobs)))
            m = self.jobs[job_id]
            row = self.s.retry_from_dlq(engine, job_id)
            if m.state == "dlq":
                assert (row.state, row.attempt, row.run_lease) == (JobState.AVAILABLE, 0, m.run_lease)
                m.state, m.attempt = "available", 0
            else:
                assert row is None

        @precondition(lambda self: maintenance)
        @rule()
        @counted
        def maintain(self) -> None:
            s = self.s
            for rotate in (s.rotate, s.rotate_leases, s.rotate_claims):
                rotate(engine)
            for ring, prune in (("queue", s.prune_oldest), ("lease", s.prune_oldest_leases),
                                ("claim", s.prune_oldest_claims)):
                PRUNED[ring] += prune(engine).kind == "pruned"
            for job_id in self.ids(*TERMINAL):
                if s.load_job(engine, job_id) is None:  # its history was pruned
                    self.jobs[job_id].state = "gone"
                    PRUNED["terminal jobs"] += 1

        # -- invariant ----------------------------------------------------------------------
        @invariant()
        def database_agrees_with_the_model(self) -> None:
            with engine.connect() as c:  # one snapshot-free read connection for the whole check
                live = census(c, self.s.schema())
                rows = {job_id: self.s.load_job(c, job_id) for job_id in self.jobs}
                c.rollback()
            assert set(live) <= set(self.jobs), "live rows of a job nobody enqueued"
            for job_id, m in self.jobs.items():
                row = rows[job_id]
                if m.state == "gone":
                    assert row is None and live.get(job_id, 0) == 0, (job_id, row)
                    continue
                assert row is not None, f"job {job_id} was lost"
                want_state, want_live = EXPECTED[m.state]
                assert (row.state, row.attempt, row.run_lease) == (want_state, m.attempt, m.run_lease), (
                    job_id, m, row)
                assert live.get(job_id, 0) == want_live, (
                    f"job {job_id} ({m.state}) has {live.get(job_id, 0)} live representations")

        @invariant()
        def exact_counts_agree_with_the_model(self) -> None:
            counts = self.s.queue_counts(engine, "q")
            want = (len(self.ids("available")), len(self.ids("running")),
                    len(self.ids(*TERMINAL, "gone")))  # rollups keep pruned history counted
            assert (counts.available, counts.running, counts.terminal) == want, (counts, want)

    return JobLifecycle


#: Examples per hypothesis run. Runs repeat, each with the next fixed seed, until every rule
#: has run (at most MAX_RUNS): the examples are the same on every test run however the
#: machine's source is edited, and a change that starves a rule costs time, not coverage.
#: ``QSTORE_STATE_MACHINE_EXAMPLES`` sets the examples per run (a longer bug hunt; with
#: ``QSTORE_HYPOTHESIS_PROFILE=hunt`` the seeds are random).
EXAMPLES = int(os.environ.get("QSTORE_STATE_MACHINE_EXAMPLES", "10"))
MAX_RUNS = 4


def run_until_every_rule_ran(machine: type[RuleBasedStateMachine], rules: set[str], steps: int,
                             done: Callable[[], bool] = lambda: True) -> None:
    """Run ``machine`` until each of ``rules`` ran and ``done()`` holds; fail if that takes
    more than :data:`MAX_RUNS` runs (the test would otherwise pass having tested less)."""
    RAN.clear()
    PRUNED.clear()
    fixed_seeds = settings().derandomize
    for run in range(MAX_RUNS):
        if run and set(RAN) >= rules and done():
            return
        run_state_machine_as_test(seed(run)(machine) if fixed_seeds else machine, settings=settings(
            max_examples=EXAMPLES, stateful_step_count=steps, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert set(RAN) >= rules and done(), (f"after {MAX_RUNS} runs of {EXAMPLES} examples",
                                          rules - set(RAN), RAN, PRUNED)


#: Every rule but ``maintain`` (which runs only with ring maintenance).
LIFECYCLE_RULES = {
    "enqueue", "claim", "heartbeat", "complete", "retry_after", "snooze", "fail_retryable",
    "fail_terminal", "fail_to_dlq", "cancel_running", "stale_write", "rescue_stale", "promote",
    "cancel_job", "retry_job", "retry_from_dlq"}


def test_random_job_lifecycles_keep_database_and_model_in_agreement(engine, next_storage):
    run_until_every_rule_ran(build_machine(engine, next_storage), LIFECYCLE_RULES, steps=25)


def test_random_lifecycles_with_ring_maintenance_lose_no_live_job(engine, next_small_storage):
    run_until_every_rule_ran(
        build_machine(engine, next_small_storage, maintenance=True), {*LIFECYCLE_RULES, "maintain"},
        steps=30, done=lambda: bool(PRUNED["queue"] and PRUNED["claim"] and PRUNED["terminal jobs"]))
