"""The psycopg classic queue (``classic_psycopg.py``) extended with the rest of a job's life,
as a typical hand-written PostgreSQL queue does it: one mutable row per job.

The ``jobs`` table gains the columns such a queue keeps on the row: ``heartbeat_at``,
``progress`` (JSON, written by heartbeats), ``last_error`` and ``unique_key`` (a partial
unique index over it). Every statement is prepared on its connection and sent on an
autocommit connection, one transaction in one round trip:

* enqueue: ``INSERT … ON CONFLICT (unique_key) DO NOTHING``, with ``run_at`` (now, or a
  time in the future for a delayed job) and a ``pg_notify`` when the job is due at once;
* claim: ``UPDATE … RETURNING`` over the ids a ``… WHERE locked_at IS NULL AND run_at <=
  now() … FOR UPDATE SKIP LOCKED`` subquery picked (the claim also sets ``heartbeat_at``);
* complete: ``DELETE … RETURNING id``;
* retry: ``UPDATE`` the row back to unlocked with ``run_at = now() + 2^attempts s`` (with up
  to 25 % jitter, the backoff qstore uses) and the error;
* snooze: ``UPDATE`` the row back to unlocked, due in the given seconds, the attempt not
  counted;
* heartbeat: ``UPDATE`` of ``heartbeat_at`` and ``progress``.

Delayed, retried and snoozed jobs need no promotion: the claim's ``run_at <= now()`` takes
them once due, so a worker finds them on its next claim (woken by another job's
notification, or by its poll interval). Every claim, retry, snooze, heartbeat and completion
leaves one dead tuple.

:class:`MixWorkers` runs worker threads over it: each claims a batch, runs the handler of
each job in turn (the handler returns the job's outcome and may heartbeat), writes retries
and snoozes as they come and completes the batch's successes with one ``DELETE``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from classic_psycopg import ClassicPsycopg, _ids_literal
from psycopg import sql

__all__ = ["ClassicMix", "MixJob", "MixWorkers", "Outcome"]

DEFAULT_SCHEMA = "bench_classic_mix"


@dataclass(frozen=True)
class MixJob:
    """One claimed job of :class:`ClassicMix`."""

    id: int
    kind: str
    payload: Any
    attempts: int
    run_at: datetime


@dataclass(frozen=True)
class Outcome:
    """What a handler of :class:`MixWorkers` decided: ``complete``, ``retry`` (with
    ``error``) or ``snooze`` (``seconds``)."""

    action: str
    error: str = ""
    seconds: float = 0.0


COMPLETE = Outcome("complete")


class ClassicMix(ClassicPsycopg):
    """The classic queue with delays, retries with backoff, snoozes, unique keys and
    progress heartbeats, in schema ``schema`` (threads driver, one-statement claim)."""

    def __init__(self, conninfo: str, schema: str = DEFAULT_SCHEMA) -> None:
        super().__init__(conninfo, schema)
        t, c = self._table, sql.Literal(self.channel)
        self.sql_insert = sql.SQL(
            "WITH j AS (INSERT INTO {t} (queue, kind, priority, payload, run_at, unique_key) "
            "VALUES (%s, %s, %s, %s, coalesce(%s, now()), %s) "
            "ON CONFLICT (unique_key) WHERE unique_key IS NOT NULL DO NOTHING "
            "RETURNING id, run_at <= now() AS due) "
            "SELECT j.id, CASE WHEN j.due THEN pg_notify({c}, '') END FROM j"
        ).format(t=t, c=c).as_string(None)
        self.sql_claim = sql.SQL(
            "UPDATE {t} j SET locked_at = now(), heartbeat_at = now(), attempts = j.attempts + 1 "
            "FROM (SELECT id FROM {t} WHERE locked_at IS NULL AND queue = %s AND run_at <= now() "
            "ORDER BY priority, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED) c WHERE j.id = c.id "
            "RETURNING j.id, j.kind, j.payload, j.attempts, j.run_at"
        ).format(t=t).as_string(None)
        self.sql_complete_returning = sql.SQL(
            "DELETE FROM {t} WHERE id = ANY(%s::bigint[]) RETURNING id").format(t=t).as_string(None)
        self.sql_retry = sql.SQL(
            "UPDATE {t} SET locked_at = NULL, last_error = %s, "
            "run_at = now() + make_interval(secs => power(2, least(attempts, 17)) * (1 + random() * 0.25)) "
            "WHERE id = %s AND locked_at IS NOT NULL RETURNING run_at").format(t=t).as_string(None)
        self.sql_snooze = sql.SQL(
            "UPDATE {t} SET locked_at = NULL, attempts = attempts - 1, "
            "run_at = now() + make_interval(secs => %s) "
            "WHERE id = %s AND locked_at IS NOT NULL RETURNING run_at").format(t=t).as_string(None)
        self.sql_heartbeat = sql.SQL(
            "UPDATE {t} SET heartbeat_at = now(), progress = %s "
            "WHERE id = %s AND locked_at IS NOT NULL").format(t=t).as_string(None)

    def create(self) -> None:
        """Drop and create the schema and its table (a fresh queue)."""
        s = sql.Identifier(self.schema)
        with self.connect() as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            conn.execute(sql.SQL(
                "CREATE TABLE {t} ("
                " id bigserial PRIMARY KEY,"
                " queue text NOT NULL,"
                " kind text NOT NULL,"
                " priority smallint NOT NULL DEFAULT 2,"
                " payload jsonb NOT NULL DEFAULT '{{}}'::jsonb,"
                " run_at timestamptz NOT NULL DEFAULT now(),"
                " attempts integer NOT NULL DEFAULT 0,"
                " max_attempts integer NOT NULL DEFAULT 25,"
                " locked_at timestamptz,"
                " heartbeat_at timestamptz,"
                " progress jsonb,"
                " last_error text,"
                " unique_key text,"
                " created_at timestamptz NOT NULL DEFAULT now())").format(t=self._table))
            conn.execute(sql.SQL(
                "CREATE INDEX jobs_claim_idx ON {t} (queue, priority, run_at, id) "
                "WHERE locked_at IS NULL").format(t=self._table))
            conn.execute(sql.SQL(
                "CREATE UNIQUE INDEX jobs_unique_key ON {t} (unique_key) "
                "WHERE unique_key IS NOT NULL").format(t=self._table))

    # -- statements on one connection ---------------------------------------------------------
    def enqueue(self, conn: psycopg.Connection[Any], queue: str, kind: str, payload: Any,
                run_at: datetime | None = None, unique_key: str | None = None) -> int | None:
        """Insert one job (due at ``run_at``, at once when None); its id, or None when
        ``unique_key`` is held by a job still in the table."""
        row = conn.execute(self.sql_insert, (queue, kind, 2, json.dumps(payload, separators=(",", ":")),
                                             run_at, unique_key), prepare=True).fetchone()
        return None if row is None else int(row[0])

    def claim_jobs(self, conn: psycopg.Connection[Any], queue: str, n: int) -> list[MixJob]:
        rows = conn.execute(self.sql_claim, (queue, n), prepare=True).fetchall()
        return [MixJob(*r) for r in rows]

    def complete_returning(self, conn: psycopg.Connection[Any], ids: list[int]) -> list[int]:
        """Delete the rows of ``ids``; the ids deleted."""
        if not ids:
            return []
        return [int(r[0]) for r in conn.execute(self.sql_complete_returning, (_ids_literal(ids),),
                                                prepare=True).fetchall()]

    def retry(self, conn: psycopg.Connection[Any], job_id: int, error: str) -> datetime | None:
        """Back to waiting with backoff; the new ``run_at`` (None when the row is not locked)."""
        row = conn.execute(self.sql_retry, (error, job_id), prepare=True).fetchone()
        return None if row is None else row[0]

    def snooze(self, conn: psycopg.Connection[Any], job_id: int, seconds: float) -> datetime | None:
        """Back to waiting for ``seconds``, the attempt not counted; the new ``run_at``."""
        row = conn.execute(self.sql_snooze, (seconds, job_id), prepare=True).fetchone()
        return None if row is None else row[0]

    def heartbeat(self, conn: psycopg.Connection[Any], job_id: int, progress: Any) -> bool:
        cur = conn.execute(self.sql_heartbeat, (json.dumps(progress), job_id), prepare=True)
        return cur.rowcount > 0


Handler = Callable[[MixJob, Callable[[Any], bool]], Outcome]


class MixWorkers:
    """``workers`` threads, each on its own autocommit connection, looping: claim up to
    ``batch`` jobs of ``queue``; run ``handler(job, beat)`` for each in turn (``beat(progress)``
    heartbeats the job on the worker's connection); write a retry or snooze at once
    (``on_due(job, run_at)`` gets the new due time); delete the batch's completed jobs in one
    statement (``on_completed(ids)``). A full batch is followed by the next claim at once;
    otherwise the thread waits for a notification of the queue's channel (one waiting thread
    per notification) or ``poll_interval`` seconds. Errors are counted by call and message,
    and the loop goes on. Runs until :meth:`stop`."""

    def __init__(self, q: ClassicMix, queue: str, handler: Handler, *, workers: int, batch: int,
                 poll_interval: float, on_due: Callable[[MixJob, datetime], None],
                 on_completed: Callable[[list[int]], None]) -> None:
        self._q, self._queue, self._handler = q, queue, handler
        self._batch, self._poll = batch, poll_interval
        self._on_due, self._on_completed = on_due, on_completed
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._tokens = 0
        self._workers = workers
        self._lock = threading.Lock()
        self.completed = 0
        self.claim_calls = 0
        self.empty_claims = 0
        self.errors: dict[str, int] = {}
        self._listener = q.connect()
        self._listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q.channel)))
        self._conns = [q.connect() for _ in range(workers)]
        self._threads = [threading.Thread(target=self._listen, name="classic-mix-listen", daemon=True)]
        self._threads += [threading.Thread(target=self._work, args=(c,), name=f"classic-mix-{i}", daemon=True)
                          for i, c in enumerate(self._conns)]

    def start(self) -> MixWorkers:
        for t in self._threads:
            t.start()
        return self

    def _note(self, call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        with self._lock:
            self.errors[key] = self.errors.get(key, 0) + 1

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                for _ in self._listener.notifies(timeout=0.2):
                    with self._cond:
                        self._tokens = min(self._tokens + 1, self._workers)
                        self._cond.notify()
        finally:
            self._listener.close()

    def _wait(self) -> None:
        with self._cond:
            if self._cond.wait_for(lambda: self._tokens > 0 or self._stop.is_set(), self._poll) \
                    and self._tokens > 0:
                self._tokens -= 1

    def _work(self, conn: psycopg.Connection[Any]) -> None:
        q = self._q

        def beat(job_id: int) -> Callable[[Any], bool]:
            def send(progress: Any) -> bool:
                try:
                    return q.heartbeat(conn, job_id, progress)
                except Exception as exc:
                    self._note("heartbeat", exc)
                    return False
            return send

        try:
            while not self._stop.is_set():
                try:
                    got = q.claim_jobs(conn, self._queue, self._batch)
                except Exception as exc:
                    self._note("claim", exc)
                    got = []
                    time.sleep(0.05)
                with self._lock:
                    self.claim_calls += 1
                    self.empty_claims += not got
                done: list[int] = []
                for job in got:
                    outcome = self._handler(job, beat(job.id))
                    try:
                        if outcome.action == "complete":
                            done.append(job.id)
                        elif outcome.action == "retry":
                            due = q.retry(conn, job.id, outcome.error)
                            if due is not None:
                                self._on_due(job, due)
                        elif outcome.action == "snooze":
                            due = q.snooze(conn, job.id, outcome.seconds)
                            if due is not None:
                                self._on_due(job, due)
                        else:
                            raise ValueError(f"unknown outcome {outcome.action!r}")
                    except Exception as exc:
                        self._note(outcome.action, exc)
                if done:
                    try:
                        deleted = q.complete_returning(conn, done)
                    except Exception as exc:
                        self._note("complete", exc)
                        deleted = []
                    with self._lock:
                        self.completed += len(deleted)
                    self._on_completed(deleted)
                if len(got) >= self._batch:
                    continue
                self._wait()
        finally:
            conn.close()

    def stop(self) -> None:
        """Stop the threads (a batch in hand is finished first) and close their connections."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for t in self._threads:
            t.join(30)
