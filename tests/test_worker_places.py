"""The thread worker's places (:class:`~qstore.runtime.core.Capacity`): a claim settles its
reservation in one critical section when it comes back (the places it did not fill go
back, the attempts it brought are held), and each attempt's place goes back exactly once
when it is let go: after a handler returned, after a handler raised, and after a stop gave
the attempt back. A place lost or freed twice shows as free places that never come back to
the total, or that exceed it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from test_claim_cycles import enqueue

from qstore import QueueStorage
from qstore.tasks import App, JobContext
from qstore.worker import Worker, WorkerSettings

SETTINGS = WorkerSettings(concurrency=4, prefetch=4, claim_batch=8, claim_ahead=0, claims_in_flight=1,
                          listen=False, poll_interval=0.02, maintain=False)


def places(w: Worker) -> tuple[int, int]:
    """``(free places, attempts held)`` of ``w``, read together."""
    with w.core.lock:
        return w._places.free, len(w.core.attempts)


def settles(w: Worker, free: int, held: int, timeout: float = 10.0) -> None:
    """Wait until ``w`` has ``free`` places free and holds ``held`` attempts (a claim in
    flight holds its reservation until it comes back); free places never exceed the total."""
    deadline = time.monotonic() + timeout
    while True:
        now = places(w)
        assert now[0] <= w._places.total, f"{now[0]} places free of {w._places.total}"
        if now == (free, held):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"(free, held) stayed {now}, expected {(free, held)}")
        time.sleep(0.002)


def blocking_app(st: QueueStorage, gate: threading.Event, fail: bool = False) -> App:
    app = App(st)

    @app.task(kind="job")
    def job(ctx: JobContext, n: int) -> None:
        gate.wait(10)
        if fail:
            raise ValueError("handler failed")

    return app


def run(w: Worker, body: Callable[[], Any]) -> None:
    w.start()
    try:
        body()
    finally:
        w.stop(5)


def test_a_claim_that_brings_fewer_jobs_than_it_reserved_gives_the_other_places_back(engine, st) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    enqueue(engine, st, 3)
    w = Worker(blocking_app(st, gate), engine, SETTINGS)
    total = w._places.total

    def body() -> None:
        settles(w, total - 3, 3)  # 8 reserved, 3 filled: 5 back, 3 held while their handlers run
        gate.set()
        settles(w, total, 0)

    run(w, body)
    assert w.stats.completed == 3


def test_the_places_of_attempts_whose_handlers_raised_come_back(engine, st) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    enqueue(engine, st, 12)
    w = Worker(blocking_app(st, gate, fail=True), engine, SETTINGS)
    total = w._places.total

    def body() -> None:
        settles(w, 0, total)  # every place holds an attempt: 4 running, 4 waiting
        gate.set()
        deadline = time.monotonic() + 10
        while w.stats.retried < 12 and time.monotonic() < deadline:
            time.sleep(0.005)
        settles(w, total, 0)

    run(w, body)
    assert w.stats.retried >= 12


def test_a_stop_gives_back_the_places_of_the_attempts_it_hands_back(engine, st) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    enqueue(engine, st, 12)
    w = Worker(blocking_app(st, gate), engine, SETTINGS)
    total = w._places.total
    w.start()
    try:
        settles(w, 0, total)
        w.stop(0.1)  # 4 waiting attempts given back at once, 4 running ones after 0.1 s
    finally:
        gate.set()  # the handlers return; their results are dropped
    settles(w, total, 0)
    assert w.stats.handed_back == total and w.stats.completed == 0
