"""Claiming ahead (``claim_ahead``): a worker whose handlers are fast has its next claim in
flight while they run the last one's jobs, taking places beyond ``concurrency + prefetch``
for the attempts they will have let go by then; a worker whose handlers are slow claims
nothing ahead. The settings' defaults, :class:`Capacity`'s estimate, and both workers
against the database."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import create_async_engine
from test_claim_cycles import (
    ClaimWatch,
    Held,
    async_app,
    enqueue,
    ran_until_completed,
    sync_app,
)

from qstore.errors import ValidationError
from qstore.runtime.core import Capacity
from qstore.types import CompletedAndClaimed
from qstore.worker import AsyncWorker, Worker, WorkerSettings

# -- settings -------------------------------------------------------------------------------------


def test_claim_ahead_defaults_to_one_claim_and_to_nothing_without_prefetch() -> None:
    assert WorkerSettings().claim_ahead == WorkerSettings().claim_batch == 64
    assert WorkerSettings(claim_batch=8).claim_ahead == 8
    assert WorkerSettings(prefetch=0).claim_ahead == 0  # claim only for free handlers: nothing ahead
    assert WorkerSettings(prefetch=0, claim_ahead=4).claim_ahead == 4
    assert WorkerSettings(claim_ahead=0).claim_ahead == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValidationError, match="claim_ahead"):
            WorkerSettings(claim_ahead=bad)  # type: ignore[arg-type]


# -- the estimate -------------------------------------------------------------------------------


def _cli_settings(*options: str) -> WorkerSettings:
    from qstore.cli import build_parser
    from qstore.cli.worker import worker_settings

    return worker_settings(build_parser().parse_args(["worker", "some.module:app", *options]))


def test_the_worker_command_passes_claim_ahead_and_cycles_and_otherwise_keeps_the_defaults() -> None:
    chosen = _cli_settings("--claim-ahead", "0", "--claims-in-flight", "1")
    assert (chosen.claim_ahead, chosen.claims_in_flight) == (0, 1)
    default = _cli_settings("--claim-batch", "20")
    assert (default.claim_ahead, default.claims_in_flight) == (20, WorkerSettings().claims_in_flight)


def test_the_worker_command_refuses_a_negative_claim_ahead_naming_it() -> None:
    with pytest.raises(ValidationError, match="claim_ahead"):
        _cli_settings("--claim-ahead", "-1")


def test_places_ahead_are_twice_what_the_handlers_let_go_per_round_trip() -> None:
    places = Capacity(32, 1, ahead=32)
    places.reset(0, 0.0)
    assert places.take(32, None, 0.0)[0] == 32 and places.available == 0
    places.release(32, idle=True, let_go=True)  # the handlers let go of 32 in 2 ms
    assert places.landed(0.001, 0.002) is True  # 16,000/s smoothed to 8,000/s; 1 ms round trips
    assert places.ahead_now == 16 and places.available == 48
    assert places.take(32, None, 0.002)[0] == 32 and places.take(32, None, 0.002)[0] == 16
    # slow handlers: one let go per 100 ms, round trips of 5 ms: nothing ahead
    slow = Capacity(32, 1, ahead=32)
    slow.reset(0, 0.0)
    for i in range(1, 6):
        slow.release(1, idle=False, let_go=True)
        slow.landed(0.005, i * 0.1)
    assert slow.ahead_now == 0 and slow.available == slow.free


def test_unfilled_reservations_do_not_count_as_handler_work_and_ahead_off_stays_off() -> None:
    places = Capacity(8, 1, ahead=8)
    places.reset(0, 0.0)
    places.release(100, idle=True)  # a claim's unfilled places: not attempts let go
    places.landed(0.001, 0.001)
    assert places.ahead_now == 0
    off = Capacity(8, 1, ahead=0)
    off.reset(0, 0.0)
    off.release(100, idle=True, let_go=True)
    assert off.landed(0.001, 0.001) is False and off.ahead_now == 0


# -- the workers --------------------------------------------------------------------------------


class LandWatch(ClaimWatch):
    """A :class:`ClaimWatch` that also records, when a claim comes back, the most attempts
    the worker then held (those it held before plus those the claim brought)."""

    def __init__(self, worker: Any, delay: float) -> None:
        super().__init__(worker.storage, delay)
        self._worker = worker
        self.most_held = 0

    def _landed(self, result: Any) -> None:
        jobs = result.claimed if isinstance(result, CompletedAndClaimed) else result
        core = self._worker.core
        with core.lock:
            self.most_held = max(self.most_held, len(core.attempts) + len(jobs))


def ahead_settings(**given: Any) -> WorkerSettings:
    given.setdefault("concurrency", 4)
    given.setdefault("claim_batch", 8)
    return WorkerSettings(listen=False, poll_interval=0.05, maintain=False, **given)


def drained(settings: WorkerSettings, engine: Any, st: Any, *, jobs: int, pause: float,
            delay: float) -> int:
    """Drain ``jobs`` with a thread worker whose handlers take ``pause`` seconds and whose
    claims ``delay`` seconds more; the most attempts it held as a claim came back."""
    held = Held()
    enqueue(engine, st, jobs)
    w = Worker(sync_app(st, held, pause=pause), engine, settings)
    watch = LandWatch(w, delay)
    w.storage = watch  # type: ignore[assignment]
    held.worker = w
    stats = ran_until_completed(w, jobs)
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs
    assert (stats.claimed, stats.completed, stats.in_flight) == (jobs, jobs, 0)
    assert held.most_running <= settings.concurrency and held.most_held <= watch.most_held
    return watch.most_held


def test_fast_handlers_have_the_next_claim_in_flight_while_they_run(engine, st) -> None:  # type: ignore[no-untyped-def]
    # 4 handlers of 2 ms let go of 2,000 attempts/s; claims take 3 ms or more: the worker
    # claims ahead, so a claim lands while the last one's jobs still run or wait
    most = drained(ahead_settings(), engine, st, jobs=240, pause=0.002, delay=0.003)
    assert 4 + 4 < most <= 4 + 4 + 8


def test_without_claim_ahead_a_worker_holds_at_most_its_places(engine, st) -> None:  # type: ignore[no-untyped-def]
    most = drained(ahead_settings(claim_ahead=0), engine, st, jobs=240, pause=0.002, delay=0.003)
    assert 0 < most <= 4 + 4


def test_slow_handlers_claim_nothing_ahead(engine, st) -> None:  # type: ignore[no-untyped-def]
    # 4 handlers of 400 ms let go of 10 attempts/s: claiming one ahead (twice the rate times
    # the round trip) would take a claim round trip of 50 ms, which even a loaded host's
    # claims stay well under
    most = drained(ahead_settings(), engine, st, jobs=16, pause=0.4, delay=0.0)
    assert 0 < most <= 4 + 4


def test_the_async_worker_claims_ahead_for_fast_handlers(db_url, engine, st) -> None:  # type: ignore[no-untyped-def]
    jobs = 240
    held = Held()
    enqueue(engine, st, jobs)

    async def main() -> Any:
        aengine = create_async_engine(db_url)
        try:
            w = AsyncWorker(async_app(st, held, pause=0.002), aengine, ahead_settings(), sync_engine=engine)
            watch = LandWatch(w, 0.003)
            w.storage = watch  # type: ignore[assignment]
            held.worker = w
            await w.start()
            deadline = time.monotonic() + 20
            while w.stats.completed < jobs and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return await w.stop(5), watch.most_held
        finally:
            await aengine.dispose()

    stats, most = asyncio.run(main())
    assert (stats.claimed, stats.completed, stats.in_flight) == (jobs, jobs, 0)
    assert set(held.runs.values()) == {1} and len(held.runs) == jobs
    assert 4 + 4 < most <= 4 + 4 + 8


def test_a_worker_restarted_after_a_stop_starts_without_an_estimate(engine, st) -> None:  # type: ignore[no-untyped-def]
    held = Held()
    w = Worker(sync_app(st, held), engine, ahead_settings())
    held.worker = w
    w._places.landed(0.01, 1.0)
    w._places.rate, w._places.ahead_now = 1e6, 8
    w.start()
    try:
        assert w._places.ahead_now == 0 and w._places.rate == 0.0
    finally:
        w.stop(5)
