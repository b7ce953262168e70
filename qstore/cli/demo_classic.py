"""The classic PostgreSQL job queue the demo runs beside qstore: one mutable row per job.

One ``jobs`` table in a schema of its own (``id bigserial``, queue, kind, priority, payload
``jsonb``, run_at, attempts, locked_at, last_error, created_at) with the one partial index
that serves the claim, ``(queue, priority, run_at, id) WHERE locked_at IS NULL``. Every
statement is prepared on its connection (psycopg ``prepare=True``) and sent on an autocommit
connection, so each is one transaction in one round trip:

* enqueue: one ``INSERT … SELECT … FROM unnest(…) RETURNING id`` for a batch of jobs, due at
  once or after a delay, with a ``pg_notify`` on the queue's channel when any is due;
* claim: ``UPDATE jobs SET locked_at = now(), attempts = attempts + 1 WHERE id IN (SELECT id
  … WHERE locked_at IS NULL AND run_at <= now() ORDER BY priority, run_at, id LIMIT n FOR
  UPDATE SKIP LOCKED) RETURNING …``;
* complete, and fail for good: ``DELETE … WHERE id = ANY(…)``;
* retry: ``UPDATE`` the row back to unlocked, due after ``2^attempts`` seconds with up to
  25 % jitter (qstore's backoff), with the error;
* snooze: ``UPDATE`` the row back to unlocked, due in the given seconds, the attempt not
  counted.

Delayed, retried and snoozed jobs need no promotion: the claim's ``run_at <= now()`` takes
them once due. Every claim, retry, snooze and completion leaves a dead tuple behind, which
only ``VACUUM`` removes, and only once no open transaction can still see it.

:class:`ClassicWorkers` runs worker threads over it, each on its own connection: claim a
batch, run each job's handler in turn, write retries, snoozes and failures as they come and
delete the batch's completed jobs with one statement. A worker whose claim came back full
claims again at once; otherwise it waits for a notification (one waiting worker per
notification) or its poll interval.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.engine import make_url

__all__ = ["ClassicJob", "ClassicQueue", "ClassicWorkers", "Outcome", "libpq_url"]


def libpq_url(url: str) -> str:
    """The libpq connection URL of a SQLAlchemy ``postgresql+psycopg://`` URL (a socket
    directory given as ``?host=`` stays a query parameter, which libpq reads too)."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _ids(ids: Sequence[int]) -> str:
    # one text parameter cast to bigint[]: one prepared statement whatever the count
    return "{" + ",".join(map(str, ids)) + "}"


@dataclass(frozen=True)
class ClassicJob:
    """One claimed job: its id, its payload and the attempt it is on (1 for the first)."""

    id: int
    payload: Any
    attempts: int


@dataclass(frozen=True)
class Outcome:
    """What a handler decided: ``complete``, ``retry`` (with ``error``), ``snooze``
    (``seconds``) or ``fail`` (for good, with ``error``)."""

    action: str
    error: str = ""
    seconds: float = 0.0


COMPLETE = Outcome("complete")


class ClassicQueue:
    """The classic queue in schema ``schema`` of the database ``url`` names (a SQLAlchemy
    or libpq URL)."""

    def __init__(self, url: str, schema: str, queue: str = "demo") -> None:
        self.conninfo = libpq_url(url)
        self.schema = schema
        self.queue = queue
        self.channel = f"{schema}_jobs"
        t = sql.SQL("{}.jobs").format(sql.Identifier(schema))
        self._table = t
        c = sql.Literal(self.channel)
        self.sql_enqueue = sql.SQL(
            "WITH j AS (INSERT INTO {t} (queue, kind, payload, run_at) "
            "SELECT %s, %s, p, now() + make_interval(secs => d) "
            "FROM unnest(%s::jsonb[], %s::float8[]) WITH ORDINALITY AS u(p, d, o) ORDER BY o "
            "RETURNING id, run_at <= now() AS due) "
            "SELECT j.id, j.due, CASE WHEN j.due THEN pg_notify({c}, '') END FROM j"
        ).format(t=t, c=c).as_string(None)
        self.sql_claim = sql.SQL(
            "UPDATE {t} SET locked_at = now(), attempts = attempts + 1 "
            "WHERE id IN (SELECT id FROM {t} WHERE locked_at IS NULL AND queue = %s AND run_at <= now() "
            "ORDER BY priority, run_at, id LIMIT %s FOR UPDATE SKIP LOCKED) "
            "RETURNING id, payload, attempts"
        ).format(t=t).as_string(None)
        self.sql_delete = sql.SQL("DELETE FROM {t} WHERE id = ANY(%s::bigint[])").format(t=t).as_string(None)
        self.sql_retry = sql.SQL(
            "UPDATE {t} SET locked_at = NULL, last_error = %s, "
            "run_at = now() + make_interval(secs => power(2, least(attempts, 17)) * (1 + random() * 0.25)) "
            "WHERE id = %s").format(t=t).as_string(None)
        self.sql_snooze = sql.SQL(
            "UPDATE {t} SET locked_at = NULL, attempts = attempts - 1, "
            "run_at = now() + make_interval(secs => %s) WHERE id = %s").format(t=t).as_string(None)

    def connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection."""
        return psycopg.connect(self.conninfo, autocommit=True)

    def create(self) -> None:
        """Create the schema and its table and index when they do not exist yet."""
        with self.connect() as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema)))
            conn.execute(sql.SQL(
                "CREATE TABLE IF NOT EXISTS {t} ("
                " id bigserial PRIMARY KEY,"
                " queue text NOT NULL,"
                " kind text NOT NULL,"
                " priority smallint NOT NULL DEFAULT 2,"
                " payload jsonb NOT NULL DEFAULT '{{}}'::jsonb,"
                " run_at timestamptz NOT NULL DEFAULT now(),"
                " attempts integer NOT NULL DEFAULT 0,"
                " locked_at timestamptz,"
                " last_error text,"
                " created_at timestamptz NOT NULL DEFAULT now())").format(t=self._table))
            conn.execute(sql.SQL(
                "CREATE INDEX IF NOT EXISTS jobs_claim_idx ON {t} (queue, priority, run_at, id) "
                "WHERE locked_at IS NULL").format(t=self._table))

    def count(self) -> int | None:
        """Rows in the table, or None when the table does not exist."""
        with self.connect() as conn:
            exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                                  (self._table.as_string(None),)).fetchone()
            if not exists or not exists[0]:
                return None
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(self._table)).fetchone()
        return int(row[0]) if row else 0

    def vacuum(self, conn: psycopg.Connection[Any]) -> None:
        """``VACUUM`` the table on ``conn`` (autocommit), as autovacuum would."""
        conn.execute(sql.SQL("VACUUM {}").format(self._table))

    def enqueue(self, conn: psycopg.Connection[Any], kind: str, payloads: Sequence[Any],
                delays: Sequence[float]) -> list[tuple[int, bool]]:
        """Insert one job per payload (due after the matching delay in seconds, 0: at once)
        in one statement, with a wake-up when any is due at once (PostgreSQL folds the
        repeated notifications of one transaction into one); ``(id, due at once)`` per job."""
        rows = conn.execute(self.sql_enqueue,
                            (self.queue, kind, [json.dumps(p, separators=(",", ":")) for p in payloads],
                             list(delays)), prepare=True).fetchall()
        return [(int(r[0]), bool(r[1])) for r in rows]

    def claim(self, conn: psycopg.Connection[Any], n: int) -> list[ClassicJob]:
        """Lock up to ``n`` due jobs for this worker (one attempt each)."""
        rows = conn.execute(self.sql_claim, (self.queue, n), prepare=True).fetchall()
        return [ClassicJob(int(r[0]), r[1], int(r[2])) for r in rows]

    def delete(self, conn: psycopg.Connection[Any], ids: Sequence[int]) -> int:
        """Delete the rows of ``ids`` (completed or failed for good); how many went."""
        return conn.execute(self.sql_delete, (_ids(ids),), prepare=True).rowcount

    def retry(self, conn: psycopg.Connection[Any], job_id: int, error: str) -> None:
        """Back to waiting after the backoff of its attempts, with ``error``."""
        conn.execute(self.sql_retry, (error, job_id), prepare=True)

    def snooze(self, conn: psycopg.Connection[Any], job_id: int, seconds: float) -> None:
        """Back to waiting for ``seconds``; the attempt is not counted."""
        conn.execute(self.sql_snooze, (seconds, job_id), prepare=True)


Handler = Callable[[ClassicJob], Outcome]


class ClassicWorkers:
    """``workers`` threads over ``q`` (see the module docstring), each on its own autocommit
    connection, and one ``LISTEN`` thread; ``handler(job)`` decides each job's outcome.
    ``completed`` and ``failed`` count the deletes committed. Errors are counted by call
    and the loop goes on. Runs from :meth:`start` until :meth:`stop`."""

    def __init__(self, q: ClassicQueue, handler: Handler, *, workers: int = 16, batch: int = 10,
                 poll_interval: float = 1.0) -> None:
        self._q, self._handler = q, handler
        self._batch, self._poll, self._workers = batch, poll_interval, workers
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._tokens = 0
        self._lock = threading.Lock()
        self.completed = 0
        self.failed = 0
        self.retried = 0
        self.snoozed = 0
        self.errors: dict[str, int] = {}
        self._listener = q.connect()
        self._listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q.channel)))
        self._conns = [q.connect() for _ in range(workers)]
        self._threads = [threading.Thread(target=self._listen, name="demo-classic-listen", daemon=True)]
        self._threads += [threading.Thread(target=self._work, args=(c,), name=f"demo-classic-{i}", daemon=True)
                          for i, c in enumerate(self._conns)]

    @property
    def terminal(self) -> int:
        """Jobs deleted so far: completed plus failed for good."""
        return self.completed + self.failed

    def start(self) -> ClassicWorkers:
        for t in self._threads:
            t.start()
        return self

    def _note(self, call: str, exc: Exception) -> None:
        key = f"{call}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
        with self._lock:
            self.errors[key] = self.errors.get(key, 0) + 1

    def _listen(self) -> None:
        try:
            while not self._stop.is_set():
                for _ in self._listener.notifies(timeout=0.2):
                    with self._cond:
                        self._tokens = min(self._tokens + 1, self._workers)
                        self._cond.notify()
        except Exception as exc:  # the connection went away: the workers poll on
            self._note("listen", exc)
        finally:
            self._listener.close()

    def _wait(self) -> None:
        with self._cond:
            if self._cond.wait_for(lambda: self._tokens > 0 or self._stop.is_set(), self._poll) \
                    and self._tokens > 0:
                self._tokens -= 1

    def _work(self, conn: psycopg.Connection[Any]) -> None:
        q = self._q
        try:
            while not self._stop.is_set():
                try:
                    got = q.claim(conn, self._batch)
                except Exception as exc:
                    self._note("claim", exc)
                    self._stop.wait(0.05)
                    continue
                done: list[int] = []
                failed: list[int] = []
                for job in got:
                    outcome = self._handler(job)
                    try:
                        if outcome.action == "complete":
                            done.append(job.id)
                        elif outcome.action == "fail":
                            failed.append(job.id)
                        elif outcome.action == "retry":
                            q.retry(conn, job.id, outcome.error)
                            with self._lock:
                                self.retried += 1
                        elif outcome.action == "snooze":
                            q.snooze(conn, job.id, outcome.seconds)
                            with self._lock:
                                self.snoozed += 1
                        else:
                            raise ValueError(f"unknown outcome {outcome.action!r}")
                    except Exception as exc:
                        self._note(outcome.action, exc)
                if done or failed:
                    try:
                        q.delete(conn, done + failed)
                    except Exception as exc:
                        self._note("delete", exc)
                    else:
                        with self._lock:
                            self.completed += len(done)
                            self.failed += len(failed)
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
