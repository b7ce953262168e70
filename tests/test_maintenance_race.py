"""Race: producers, workers and a maintenance loop that rotates and prunes all three rings
(and rolls up deltas) as fast as it can. At the end every job completed exactly once, none
is lost, and exact counts equal the number enqueued.

Producers keep the backlog short, so rings turn over while every party is busy. Every
:data:`STALL_EVERY` seconds the workers pause for :data:`STALL` seconds while producers and
maintenance go on, so the ring comes round to slots that still hold unclaimed jobs however
fast prunes are (a rotation into a busy slot is one of the cases the race must meet). The
race runs until maintenance has met each interesting case a few times (:func:`met`: a
rotation and a prune of each ring in use, and each refusing to act on live work), at most
:data:`MAX_SECONDS`."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine

from qstore import InsertOpts, InsertParams, QueueStorage

Q = "race"
MAX_SECONDS = 40.0  # a bound, not a target: a run stops once it has met every case
TIMES_EACH = 3
MAX_BACKLOG = 400  # enqueued but not yet claimed jobs at which producers wait
PRODUCERS = 2
WORKERS = 3
STALL_EVERY = 1.5  # seconds between the starts of two worker pauses
STALL = 0.3  # seconds each pause lasts


def met(receipts: bool) -> set[str]:
    """The maintenance outcomes the race must see :data:`TIMES_EACH` times."""
    ring = ("claims", "claim.open") if receipts else ("leases", "lease.active")
    return {"rotate:rotated", "rotate:skipped_busy", "prune:pruned",
            "prune:skipped_active:queue.pending_ready", f"rotate_{ring[0]}:rotated",
            f"prune_{ring[0]}:pruned", f"prune_{ring[0]}:skipped_active:{ring[1]}"}


@pytest.fixture
def engine(db_url: str) -> Any:
    """Per-test Engine (fresh compiled cache; see tests/test_rings.py::engine for why)."""
    eng = create_engine(db_url, pool_size=12, max_overflow=4)
    yield eng
    eng.dispose()


class Run:
    def __init__(self) -> None:
        self.stop_producing = threading.Event()
        self.stop_working = threading.Event()
        self.stop_maintaining = threading.Event()
        self.lock = threading.Lock()
        self.enqueued = 0
        self.completed: list[tuple[int, int]] = []
        self.claimed = 0
        self.outcomes: Counter[str] = Counter()
        self.errors: list[BaseException] = []

    def guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as err:
                with self.lock:
                    self.errors.append(err)
                self.stop_producing.set()
                self.stop_working.set()
                self.stop_maintaining.set()
        return run


@pytest.mark.parametrize("receipts", [True, False], ids=["receipts", "leases"])
def test_rotate_prune_race_loses_and_duplicates_nothing(
    make_storage: Callable[..., QueueStorage], engine: Engine, receipts: bool,
) -> None:
    st = make_storage(queue_slot_count=4, lease_slot_count=2, claim_slot_count=2,
                      lease_claim_receipts=receipts)
    run = Run()

    def producer() -> None:
        i = 0
        while not run.stop_producing.is_set():
            if run.enqueued - run.claimed > MAX_BACKLOG:
                time.sleep(0.002)
                continue
            batch = [InsertParams("race_job", {"i": i + k}, InsertOpts(queue=Q, priority=1 + k % 4))
                     for k in range(1 + i % 17)]
            n = st.enqueue_params_batch(engine, batch)
            i += n
            with run.lock:
                run.enqueued += n
            time.sleep(0.002)

    started = time.monotonic()

    def worker() -> None:
        while not run.stop_working.is_set():
            if not run.stop_producing.is_set() and (time.monotonic() - started) % STALL_EVERY < STALL:
                time.sleep(0.01)  # a slow-consumer spell (see the module docstring)
                continue
            claimed = st.claim_runtime_batch(engine, Q, 8)
            if not claimed:
                time.sleep(0.003)
                continue
            done = st.complete_runtime_batch(engine, claimed)
            with run.lock:
                run.claimed += len(claimed)
                run.completed.extend(done)

    def maintenance() -> None:
        ops = (("rotate", st.rotate), ("prune", st.prune_oldest),
               ("rotate_leases", st.rotate_leases), ("prune_leases", st.prune_oldest_leases),
               ("rotate_claims", st.rotate_claims), ("prune_claims", st.prune_oldest_claims))
        while not run.stop_maintaining.is_set():
            for name, op in ops:
                out = op(engine)
                key = f"{name}:{out.kind}" + (f":{out.reason.value}" if getattr(out, "reason", None) else "")
                with run.lock:
                    run.outcomes[key] += 1
            roll = st.rollup_terminal_count_deltas(engine, 2)
            with run.lock:
                run.outcomes["rollup:rolled"] += roll.rolled_slots
                run.outcomes["rollup:pinned"] += int(roll.skipped_mvcc_pinned)

    threads = [threading.Thread(target=run.guard(producer)) for _ in range(PRODUCERS)]
    threads += [threading.Thread(target=run.guard(worker)) for _ in range(WORKERS)]
    maint = threading.Thread(target=run.guard(maintenance))
    for t in [*threads, maint]:
        t.start()
    wanted = met(receipts)
    stop_at = time.monotonic() + MAX_SECONDS
    while time.monotonic() < stop_at and not run.errors:
        with run.lock:
            if all(run.outcomes[k] >= TIMES_EACH for k in wanted):
                break
        time.sleep(0.05)
    run.stop_producing.set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not run.errors:
        c = st.queue_counts(engine, Q)
        if c.available == 0 and c.running == 0:
            break
        time.sleep(0.1)
    run.stop_working.set()
    for t in threads:
        t.join(30)
    # a few more maintenance rounds on the quiet ring, then stop
    time.sleep(0.3)
    run.stop_maintaining.set()
    maint.join(30)

    assert not run.errors, run.errors
    assert run.enqueued > 0
    ids = Counter(job_id for job_id, _ in run.completed)
    duplicates = [j for j, n in ids.items() if n > 1]
    assert not duplicates, f"completed more than once: {duplicates[:10]}"
    assert len(set(run.completed)) == len(run.completed)
    assert set(ids) == set(range(1, run.enqueued + 1)), "lost or unknown jobs"
    assert run.claimed == run.enqueued  # nothing claimed twice, no stale completion
    counts = st.queue_counts(engine, Q)
    assert (counts.available, counts.running, counts.terminal) == (0, 0, run.enqueued), (counts, run.outcomes)
    # the race exercised real work on every ring in use, and maintenance met live work
    assert {k: run.outcomes[k] for k in wanted if run.outcomes[k] < TIMES_EACH} == {}, run.outcomes
    # counters agree with ground truth after a rebuild as well
    st.rebuild_terminal_counters(engine)
    assert st.queue_counts(engine, Q).terminal == run.enqueued
