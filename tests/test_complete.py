"""Completion: guarded by ``(job_id, run_lease)``; repeated and stale completions change
nothing and are absent from the result; every completion path; the caller's transaction."""

from __future__ import annotations

import pytest
from jobtools import CLOSED, count, relation_locks, requeue
from sqlalchemy import text
from sqlalchemy.orm import Session

from qstore import (
    InsertOpts,
    InsertParams,
    JobState,
    UniqueConflictError,
    UniqueOpts,
    ValidationError,
)


def job(args: object = None, **opts: object) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams("k", {} if args is None else args, InsertOpts(**opts))


def count_rows(engine, storage, table: str, where: str = "true", **params) -> int:
    with engine.connect() as c:
        return c.execute(text(f'SELECT count(*) FROM "{storage.schema()}".{table} WHERE {where}'),
                         params).scalar_one()


def claimed_jobs(engine, storage, n: int, **opts):
    storage.enqueue_params_batch(engine, [job({"i": i}, **opts) for i in range(n)])
    got = storage.claim_runtime_batch(engine, "q", n)
    assert len(got) == n
    return got




# -- complete_runtime_batch_with_followups ----------------------------------------------------

def test_completion_with_followups_enqueues_the_followups_of_the_attempts_it_completed(engine, storage):
    a, b = claimed_jobs(engine, storage, 2)
    storage.complete_runtime_batch(engine, [b])  # b is stale from here on
    done = storage.complete_runtime_batch_with_followups(
        engine, [(a, [job({"after": "a"}, queue="next"), job({"after": "a2"}, queue="next")]),
                 (b, [job({"after": "b"}, queue="next")])])
    assert done == [(a.job.id, 1)]
    assert storage.load_job(engine, a.job.id).state == JobState.COMPLETED
    assert count_rows(engine, storage, "ready_entries", "queue = 'next'") == 2
    assert count_rows(engine, storage, "ready_entries", "queue = 'next' AND args->>'after' = 'b'") == 0


def test_completion_whose_followup_cannot_be_written_writes_nothing(engine, storage):
    a, b = claimed_jobs(engine, storage, 2)
    key = UniqueOpts(by_args=True)
    storage.enqueue_params_batch(engine, [job({"taken": 1}, queue="next", unique=key)])
    with pytest.raises(UniqueConflictError):
        storage.complete_runtime_batch_with_followups(
            engine, [(a, [job({"fine": 1}, queue="next")]), (b, [job({"taken": 1}, queue="next", unique=key)])])
    assert storage.load_job(engine, a.job.id).state == JobState.RUNNING
    assert storage.load_job(engine, b.job.id).state == JobState.RUNNING
    assert count_rows(engine, storage, "ready_entries", "queue = 'next'") == 1


def test_completion_with_followups_joins_a_callers_transaction(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    with engine.connect() as conn:
        assert storage.complete_runtime_batch_with_followups(conn, [(a, [job(queue="next")])]) == [(a.job.id, 1)]
        conn.rollback()
    assert storage.load_job(engine, a.job.id).state == JobState.RUNNING
    assert count_rows(engine, storage, "ready_entries", "queue = 'next'") == 0


@pytest.mark.parametrize("bad", [[a] for a in ("x", (1, 2), ("claimed", []))] + [None])
def test_completion_with_followups_refuses_anything_but_attempt_and_followup_pairs(engine, storage, bad):
    with pytest.raises(ValidationError, match="completions"):
        storage.complete_runtime_batch_with_followups(engine, bad)


# -- complete_runtime_batch -------------------------------------------------------------------

def test_complete_runtime_batch_returns_completed_pairs_in_input_order(engine, storage):
    a, b, c = claimed_jobs(engine, storage, 3)
    assert storage.complete_runtime_batch(engine, [c, a, b]) \
        == [(c.job.id, 1), (a.job.id, 1), (b.job.id, 1)]
    assert storage.queue_counts(engine, "q").terminal == 3
    assert all(storage.load_job(engine, x.job.id).state is JobState.COMPLETED for x in (a, b, c))


def test_repeated_completion_returns_nothing_and_changes_nothing(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    assert storage.complete_runtime_batch(engine, [a]) == [(a.job.id, 1)]
    done_before = count_rows(engine, storage, "terminal_jobs")
    closures_before = count(engine, storage, CLOSED)

    assert storage.complete_runtime_batch(engine, [a]) == []
    assert storage.complete_job_batch_by_id(engine, [(a.job.id, 1)]) == []
    assert storage.complete_claimed_batch(engine, [a.claim]) == []

    assert count_rows(engine, storage, "terminal_jobs") == done_before == 1
    assert count(engine, storage, CLOSED) == closures_before == 1
    assert storage.queue_counts(engine, "q").terminal == 1


def test_duplicate_entries_in_one_call_complete_once(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    assert storage.complete_runtime_batch(engine, [a, a]) == [(a.job.id, 1)]
    assert count_rows(engine, storage, "terminal_jobs") == 1


def test_completion_with_wrong_run_lease_is_rejected_and_attempt_stays_running(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    for wrong in (0, 2, 99):
        assert storage.complete_job_batch_by_id(engine, [(a.job.id, wrong)]) == []

    assert count_rows(engine, storage, "terminal_jobs") == 0
    assert storage.queue_counts(engine, "q").running == 1
    loaded = storage.load_job(engine, a.job.id)
    assert (loaded.state, loaded.run_lease) == (JobState.RUNNING, 1)
    assert storage.complete_job_batch_by_id(engine, [(a.job.id, 1)]) == [(a.job.id, 1)]


def test_stale_completion_after_second_claim_changes_nothing(engine, storage):
    (first,) = claimed_jobs(engine, storage, 1)
    requeue(engine, storage, first)
    (second,) = storage.claim_runtime_batch(engine, "q", 1)
    assert (second.job.id, second.job.run_lease) == (first.job.id, 2)

    assert storage.complete_runtime_batch(engine, [first]) == []
    assert storage.complete_job_batch_by_id(engine, [(first.job.id, 1)]) == []
    assert count_rows(engine, storage, "terminal_jobs") == 0
    assert storage.load_job(engine, first.job.id).run_lease == 2

    assert storage.complete_runtime_batch(engine, [second]) == [(first.job.id, 2)]
    loaded = storage.load_job(engine, first.job.id)
    assert (loaded.state, loaded.run_lease, loaded.attempt) == (JobState.COMPLETED, 2, 2)


def test_mixed_batch_completes_only_the_live_attempts(engine, storage):
    a, b = claimed_jobs(engine, storage, 2)
    storage.complete_runtime_batch(engine, [a])
    assert storage.complete_runtime_batch(engine, [a, b]) == [(b.job.id, 1)]
    assert count_rows(engine, storage, "terminal_jobs") == 2


def test_completion_keeps_payload_on_the_terminal_view(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1, metadata={"m": 1}, tags=["t"])
    storage.complete_runtime_batch(engine, [a])
    loaded = storage.load_job(engine, a.job.id)
    assert (loaded.metadata, loaded.tags, loaded.args, loaded.attempt) == ({"m": 1}, ["t"], {"i": 0}, 1)
    assert loaded.finalized_at is not None and loaded.attempted_at == a.job.attempted_at


TERMINAL_PATHS = {
    "complete_runtime_batch": lambda e, s, c: s.complete_runtime_batch(e, [c]),
    "complete_job_batch_by_id": lambda e, s, c: s.complete_job_batch_by_id(e, [(c.job.id, c.job.run_lease)]),
    "complete_after_heartbeat": lambda e, s, c: (s.heartbeat_batch(e, [(c.job.id, c.job.run_lease)]),
                                                 s.complete_runtime_batch(e, [c])),
    "complete_materialised": lambda e, s, c: (s.register_callback(e, c.job.id, c.job.run_lease, 3600),
                                              s.complete_job_batch_by_id(e, [(c.job.id, c.job.run_lease)])),
    "cancel_running": lambda e, s, c: s.cancel_running(e, c.job.id, c.job.run_lease, "stop"),
}


@pytest.mark.parametrize("path", list(TERMINAL_PATHS))
def test_terminal_history_keeps_metadata_and_tags_on_every_path(engine, storage, path):
    """A narrow done row whose payload equals the ready row's must hydrate it (SQL NULL),
    not shadow it (a stored JSON null would read back as "no metadata")."""
    (a,) = claimed_jobs(engine, storage, 1, metadata={"m": 1}, tags=["t"])
    TERMINAL_PATHS[path](engine, storage, a)
    loaded = storage.load_job(engine, a.job.id)
    assert loaded.state in (JobState.COMPLETED, JobState.CANCELLED)
    assert (loaded.metadata.get("m"), loaded.tags) == (1, ["t"])
    assert count_rows(engine, storage, "done_entries", "payload = 'null'::jsonb") == 0


def test_unique_job_completes_through_the_general_path(engine, storage):
    opts = UniqueOpts(states=0b0000_0111)  # released once completed
    storage.enqueue_params_batch(engine, [job({"u": 1}, unique=opts)])
    (a,) = storage.claim_runtime_batch(engine, "q", 1)
    assert storage.complete_runtime_batch(engine, [a]) == [(a.job.id, 1)]
    # released: one appended release row, the claim row stays until the maintainer's purge
    assert count_rows(engine, storage, "job_unique_releases") == 1
    assert storage.complete_runtime_batch(engine, [a]) == []


def test_complete_empty_batch_is_a_no_op(engine, storage):
    assert storage.complete_runtime_batch(engine, []) == []
    assert storage.complete_job_batch_by_id(engine, []) == []
    assert storage.complete_claimed_batch(engine, []) == []
    assert storage.complete_batch(engine, []) == 0


# -- other completion paths -------------------------------------------------------------------

def test_complete_job_batch_by_id_completes_receipt_only_attempts(engine, storage):
    a, b = claimed_jobs(engine, storage, 2)
    assert count_rows(engine, storage, "leases") == 0  # receipt-only
    assert storage.complete_job_batch_by_id(engine, [(b.job.id, 1), (a.job.id, 1)]) \
        == [(b.job.id, 1), (a.job.id, 1)]
    assert storage.queue_counts(engine, "q").running == 0
    assert storage.queue_counts(engine, "q").terminal == 2


def test_complete_job_batch_by_id_rejects_malformed_pairs(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    for bad in ([a.job.id], [(a.job.id,)], [(a.job.id, "1")], [[a.job.id, 1]]):
        with pytest.raises(ValidationError):
            storage.complete_job_batch_by_id(engine, bad)
    assert storage.queue_counts(engine, "q").running == 1


def test_complete_claimed_batch_completes_claimed_entries(engine, storage):
    a, b = claimed_jobs(engine, storage, 2)
    assert storage.complete_claimed_batch(engine, [a.claim, b.claim]) == [(a.job.id, 1), (b.job.id, 1)]
    assert storage.queue_counts(engine, "q").terminal == 2


def test_complete_batch_counts_completed_entries_of_claim_batch(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(3)])
    entries = storage.claim_batch(engine, "q", 3)
    assert storage.complete_batch(engine, entries) == 3
    assert storage.complete_batch(engine, entries) == 0
    assert storage.queue_counts(engine, "q").terminal == 3


def test_materialised_leases_are_completed_and_removed(engine, make_storage):
    storage = make_storage(lease_claim_receipts=False)
    a, b, c = claimed_jobs(engine, storage, 3)
    assert storage.complete_runtime_batch(engine, [a]) == [(a.job.id, 1)]
    assert storage.complete_job_batch_by_id(engine, [(b.job.id, 1)]) == [(b.job.id, 1)]
    assert storage.complete_claimed_batch(engine, [c.claim]) == [(c.job.id, 1)]

    assert count_rows(engine, storage, "leases") == 0
    assert storage.complete_runtime_batch(engine, [a, b, c]) == []
    assert storage.queue_counts(engine, "q") == type(storage.queue_counts(engine, "q"))(0, 0, 3)


# -- the caller's transaction -----------------------------------------------------------------

def test_completion_rolled_back_with_callers_transaction_leaves_attempt_running(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    with engine.connect() as conn:
        conn.begin()
        assert storage.complete_runtime_batch(conn, [a]) == [(a.job.id, 1)]
        conn.rollback()

    counts = storage.queue_counts(engine, "q")
    assert (counts.running, counts.terminal) == (1, 0)
    assert storage.load_job(engine, a.job.id).state is JobState.RUNNING
    assert storage.complete_runtime_batch(engine, [a]) == [(a.job.id, 1)]
    assert storage.queue_counts(engine, "q").terminal == 1


def test_slow_completion_joins_the_sessions_transaction(engine, storage):
    (a,) = claimed_jobs(engine, storage, 1)
    with Session(engine) as session:
        assert storage.complete_runtime_batch_slow_in_tx(session, [a]) == [(a.job.id, 1)]
        # Not visible outside until the session commits; rollback undoes it.
        assert storage.queue_counts(engine, "q").running == 1
        session.rollback()
    assert storage.queue_counts(engine, "q").running == 1

    with Session(engine) as session:
        assert storage.complete_runtime_batch_slow_in_tx(session, [a]) == [(a.job.id, 1)]
        session.commit()
    counts = storage.queue_counts(engine, "q")
    assert (counts.running, counts.terminal) == (0, 1)


def test_slow_completion_on_a_connection_sees_the_callers_earlier_work(engine, storage):
    storage.enqueue_params_batch(engine, [job()])
    with engine.connect() as conn:
        conn.begin()
        (a,) = storage.claim_runtime_batch(conn, "q", 1)  # claimed in the same transaction
        assert storage.complete_runtime_batch_slow_in_tx(conn, [a]) == [(a.job.id, 1)]
        conn.commit()
    assert storage.queue_counts(engine, "q").terminal == 1


def test_engine_completion_finishes_fast_and_heartbeated_attempts_in_one_call(engine, storage):
    plain, beating = claimed_jobs(engine, storage, 2)
    assert storage.heartbeat_progress_batch(engine, [(beating.job.id, beating.job.run_lease, {"p": 1})]) == 1
    done = storage.complete_runtime_batch(engine, [beating, plain])
    # the fast statement takes the plain receipt, the general path the heartbeated one;
    # the result keeps the input order
    assert done == [(beating.job.id, 1), (plain.job.id, 1)]
    assert storage.load_job(engine, plain.job.id).state is JobState.COMPLETED
    assert storage.load_job(engine, beating.job.id).state is JobState.COMPLETED
    assert storage.complete_runtime_batch(engine, [beating, plain]) == []


def test_a_fast_completion_shows_the_jobs_kind_in_terminal_history(engine, storage):
    storage.enqueue_params_batch(engine, [InsertParams("mailer.send", {}, InsertOpts(queue="q"))])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    assert storage.complete_runtime_batch(engine, [c]) == [(c.job.id, 1)]
    assert count_rows(engine, storage, "terminal_jobs", "kind = 'mailer.send'") == 1


@pytest.mark.parametrize("kind", ['say "hi"', "back\\slash", "a,b", "{braces}", "NULL", " spaced ",
                                  "ünïcødé ✓"])
def test_fast_completion_keeps_any_kind_text_intact(engine, storage, kind):
    # kinds travel to complete_receipts inside one text[] literal; quoting must be exact
    storage.enqueue_params_batch(engine, [InsertParams(kind, {}, InsertOpts(queue="q")),
                                          InsertParams("plain", {}, InsertOpts(queue="q"))])
    got = storage.claim_runtime_batch(engine, "q", 2)
    assert storage.complete_runtime_batch(engine, got) == [(c.job.id, 1) for c in got]
    assert [storage.load_job(engine, c.job.id).kind for c in got] == [kind, "plain"]


def test_one_completion_call_finishes_receipts_from_two_claim_slots(engine, make_storage):
    storage = make_storage(claim_slot_count=2)
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    first = storage.claim_runtime_batch(engine, "q", 2)
    assert storage.rotate_claims(engine).kind == "rotated"
    second = storage.claim_runtime_batch(engine, "q", 2)
    assert {c.claim.claim_slot for c in first} != {c.claim.claim_slot for c in second}
    both = [second[0], first[0], second[1], first[1]]
    done = storage.complete_runtime_batch(engine, both)
    assert done == [(c.job.id, c.job.run_lease) for c in both]  # input order kept
    assert storage.complete_runtime_batch(engine, both) == []
    assert storage.queue_counts(engine, "q").running == 0


def test_completion_with_a_wrong_claim_slot_falls_back_and_completes_once(engine, storage):
    # the attempt is (job_id, run_lease); the claim slot is only where the fast path looks
    storage.enqueue_params_batch(engine, [job()])
    (c,) = storage.claim_runtime_batch(engine, "q", 1)
    bogus = c.__class__(c.claim.__class__(**{**c.claim.__dict__, "claim_slot": 99}), c.job,
                        c.unique_states)
    assert storage.complete_runtime_batch(engine, [bogus]) == [(c.job.id, c.job.run_lease)]
    assert storage.complete_runtime_batch(engine, [c]) == []
    assert storage.load_job(engine, c.job.id).state is JobState.COMPLETED


def test_a_fast_completion_locks_one_claim_child_not_every_child(engine, storage):
    storage.enqueue_params_batch(engine, [job({"i": i}) for i in range(4)])
    claimed = storage.claim_runtime_batch(engine, "q", 4)
    with engine.connect() as conn, conn.begin():
        base = relation_locks(conn)
        assert len(storage.complete_runtime_batch(conn, claimed)) == 4
        taken = relation_locks(conn) - base
    assert taken <= 20, taken
