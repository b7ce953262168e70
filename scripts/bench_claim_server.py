"""Where a single-job claim's server time goes: qstore's ``claim_ready`` against the psycopg
classic queue's ``UPDATE … FOR UPDATE SKIP LOCKED`` claim, measured inside the server.

Pickup latency at a trickle is one claim per job, so a claim's own server time is its floor.
This script takes the client and the network out of it: for each system a procedure loops N
times over "enqueue one job, COMMIT, claim it, COMMIT" (the classic one deletes the job as its
completion, in a transaction of its own), timing only the claim statement and the claim's
COMMIT with ``clock_timestamp()``. Systems run in alternating rounds (the host's speed moves
between rounds); the table holds medians over the rounds:

* ``claim``: the claim statement's server time per job, µs;
* ``commit``: its ``COMMIT`` (the WAL flush; both systems write), µs;
* ``backend CPU``: the backend's user+system CPU per loop (enqueue, claim and commits), µs,
  read from ``/proc`` when the server runs on this host (empty otherwise);
* ``locks``: relation locks one claim transaction holds, and how many of them are
  fast-path locks (PostgreSQL keeps up to 16 per backend outside the shared lock table).

qstore runs twice: with the default eight lanes per priority and with one lane
(``enqueue_shards=1``), since a claim reads the enqueue and claim sequences of every lane of
its queue to find the lanes with work. ``--also-claim-of REVISION`` (e.g. ``0010``) runs both
once more with the ``claim_ready`` text that revision installed (from its frozen folder), in
the same alternating rounds, so a change of the claim is measured against the text it
replaces.

``python scripts/bench_claim_server.py --rounds 5 --jobs 1000``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import ensure_database, make_engine, process_cpu
from classic_psycopg import ClassicPsycopg, libpq_url

from qstore.config import QueueStorageConfig
from qstore.migrations import frozen
from qstore.migrations.frozen import r0010
from qstore.migrations.frozen.r0017 import READY_SLOT_SEEN
from qstore.storage import QueueStorage

DEFAULT_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/qstore_bench"
QUEUE = "bench"

_QSTORE_LOOP = """
CREATE PROCEDURE {s}.bench_claim_loop(n integer, INOUT claim_us float8 DEFAULT 0,
                                      INOUT commit_us float8 DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz; t1 timestamptz; c interval := '0'; k interval := '0'; got integer;
BEGIN
  FOR i IN 1..n LOOP
    PERFORM {s}.enqueue_job('bench_job', {q}, {q}, '{{"n": 1}}'::jsonb, 2::smallint, 25::smallint,
                            NULL, NULL, NULL, NULL, false, NULL, NULL);
    COMMIT;
    t0 := clock_timestamp();
    SELECT count(*) INTO got FROM {s}.claim_ready({q}, 32, 0, 0, {receipts});
    t1 := clock_timestamp();
    COMMIT;
    c := c + (t1 - t0);
    k := k + (clock_timestamp() - t1);
    IF got <> 1 THEN RAISE EXCEPTION 'claimed % jobs, expected 1', got; END IF;
  END LOOP;
  claim_us := extract(epoch FROM c) * 1e6 / n;
  commit_us := extract(epoch FROM k) * 1e6 / n;
END $$
"""

_CLASSIC_LOOP = """
CREATE PROCEDURE {s}.bench_claim_loop(n integer, INOUT claim_us float8 DEFAULT 0,
                                      INOUT commit_us float8 DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE t0 timestamptz; t1 timestamptz; c interval := '0'; k interval := '0'; got bigint;
BEGIN
  FOR i IN 1..n LOOP
    INSERT INTO {t} (queue, kind, priority, payload) VALUES ({q}, 'bench_job', 2, '{{"n": 1}}');
    COMMIT;
    t0 := clock_timestamp();
    UPDATE {t} j SET locked_at = now(), attempts = j.attempts + 1
      FROM (SELECT id FROM {t} WHERE locked_at IS NULL AND queue = {q} AND run_at <= now()
            ORDER BY priority, run_at, id LIMIT 32 FOR UPDATE SKIP LOCKED) c
      WHERE j.id = c.id RETURNING j.id INTO got;
    t1 := clock_timestamp();
    COMMIT;
    c := c + (t1 - t0);
    k := k + (clock_timestamp() - t1);
    DELETE FROM {t} WHERE id = got;
    COMMIT;
  END LOOP;
  claim_us := extract(epoch FROM c) * 1e6 / n;
  commit_us := extract(epoch FROM k) * 1e6 / n;
END $$
"""


class System:
    """One system under test: ``install`` makes it fresh with its loop procedure; ``locks``
    enqueues one job and returns the relation locks its claim transaction holds."""

    name: str
    schema: str

    def install(self, conn: psycopg.Connection[Any]) -> None:
        raise NotImplementedError

    def claim_sql(self) -> sql.Composed:
        raise NotImplementedError

    def enqueue_sql(self) -> sql.Composed:
        raise NotImplementedError

    def drop(self, conn: psycopg.Connection[Any]) -> None:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))


class Qstore(System):
    def __init__(self, url: str, schema: str, shards: int | None, claim_of: str | None = None) -> None:
        """``claim_of``: a revision whose frozen ``claim_ready`` text replaces the head's."""
        self.schema = schema
        self.shards = shards
        self.claim_of = claim_of
        self.name = f"qstore ({shards or 'default'} lane{'s' if shards != 1 else ''})"
        if claim_of is not None:
            self.name += f", {claim_of}"
        self.storage = QueueStorage(QueueStorageConfig(schema=schema))
        self.engine = make_engine(url, 2)
        self.receipts = self.storage.config.lease_claim_receipts

    def install(self, conn: psycopg.Connection[Any]) -> None:
        self.storage.reset(self.engine)
        self.storage.prepare_schema(self.engine)
        if self.shards is not None:
            self.storage.set_queue_options(self.engine, QUEUE, enqueue_shards=self.shards)
        if self.claim_of is not None:
            # (texts from revision 0017 on name the session setting of the slot last seen)
            conn.execute(r0010.render(f"r{self.claim_of}", "claim_ready", self.storage.config,
                                      ready_slot_seen=READY_SLOT_SEEN).encode())
        conn.execute(sql.SQL(_QSTORE_LOOP).format(
            s=sql.Identifier(self.schema), q=sql.Literal(QUEUE), receipts=sql.Literal(self.receipts)))

    def enqueue_sql(self) -> sql.Composed:
        return sql.SQL("SELECT {}.enqueue_job('bench_job', {q}, {q}, '{{}}'::jsonb, 2::smallint, 25::smallint, "
                       "NULL, NULL, NULL, NULL, false, NULL, NULL)").format(
            sql.Identifier(self.schema), q=sql.Literal(QUEUE))

    def claim_sql(self) -> sql.Composed:
        return sql.SQL("SELECT count(*) FROM {}.claim_ready({}, 32, 0, 0, {})").format(
            sql.Identifier(self.schema), sql.Literal(QUEUE), sql.Literal(self.receipts))

    def drop(self, conn: psycopg.Connection[Any]) -> None:
        self.storage.reset(self.engine)
        self.engine.dispose()


class Classic(System):
    name = "classic (psycopg)"

    def __init__(self, url: str, schema: str) -> None:
        self.schema = schema
        self.cpg = ClassicPsycopg(url, schema)

    def install(self, conn: psycopg.Connection[Any]) -> None:
        self.cpg.create()
        conn.execute(sql.SQL(_CLASSIC_LOOP).format(
            s=sql.Identifier(self.schema), t=sql.Identifier(self.schema, "jobs"), q=sql.Literal(QUEUE)))

    def enqueue_sql(self) -> sql.Composed:
        return sql.SQL("INSERT INTO {} (queue, kind) VALUES ({}, 'bench_job')").format(
            sql.Identifier(self.schema, "jobs"), sql.Literal(QUEUE))

    def claim_sql(self) -> sql.Composed:
        return sql.SQL(self.cpg.sql_claim.replace("%s", "{}")).format(sql.Literal(QUEUE), sql.Literal(32))


def backend_cpu(pid: int) -> float | None:
    """CPU seconds of server process ``pid`` so far (None when it is not on this host)."""
    try:
        return process_cpu(pid)
    except OSError:
        return None


def claim_locks(conn: psycopg.Connection[Any], system: System) -> tuple[int, int]:
    """(relation locks, of them fast-path) of one claim transaction of ``system`` (one job
    enqueued, claimed in a transaction that is rolled back, then claimed for good)."""
    conn.execute(system.enqueue_sql())
    with conn.transaction(force_rollback=True):
        conn.execute(system.claim_sql()).fetchall()
        row = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE l.fastpath) FROM pg_locks l "
            "JOIN pg_class c ON c.oid = l.relation "
            "WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND c.relnamespace = %s::regnamespace",
            (system.schema,)).fetchone()
    assert row is not None
    conn.execute(system.claim_sql()).fetchall()  # take the job for good: the loops expect an empty queue
    return int(row[0]), int(row[1])


def claim_revision(value: str) -> str:
    """A revision whose frozen folder holds a ``claim_ready`` text (argparse type)."""
    folder = resources.files(frozen).joinpath(f"r{value}")
    if not value.isdigit() or not folder.joinpath("claim_ready.sql").is_file():
        raise argparse.ArgumentTypeError(f"revision {value!r} has no frozen claim_ready text")
    return value


def run(args: argparse.Namespace) -> int:
    ensure_database(args.url)
    conninfo = libpq_url(args.url)
    systems: list[System] = [
        Classic(args.url, "bench_claim_classic"),
        Qstore(args.url, "bench_claim_qstore", None),
        Qstore(args.url, "bench_claim_qstore1", 1),
    ]
    if args.also_claim_of:
        systems += [Qstore(args.url, "bench_claim_qstore_prev", None, args.also_claim_of),
                    Qstore(args.url, "bench_claim_qstore1_prev", 1, args.also_claim_of)]
    figures: dict[str, dict[str, list[float]]] = {s.name: {"claim": [], "commit": [], "cpu": []} for s in systems}
    locks: dict[str, tuple[int, int]] = {}
    with psycopg.connect(conninfo, autocommit=True) as conn:
        pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
        try:
            for s in systems:
                s.install(conn)
            for rnd in range(args.rounds):
                order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
                for s in order:
                    loop = sql.SQL("CALL {}.bench_claim_loop(%s)").format(sql.Identifier(s.schema))
                    conn.execute(loop, (50,))  # warm the plans
                    before = backend_cpu(pid)
                    claim_us, commit_us = conn.execute(loop, (args.jobs,)).fetchone()  # type: ignore[misc]
                    after = backend_cpu(pid)
                    f = figures[s.name]
                    f["claim"].append(claim_us)
                    f["commit"].append(commit_us)
                    if before is not None and after is not None:
                        f["cpu"].append((after - before) * 1e6 / args.jobs)
                    if rnd == 0:  # every lane the loop enqueued to exists now
                        locks[s.name] = claim_locks(conn, s)
                    print(f"... round {rnd + 1}: {s.name:30s} claim {claim_us:6.0f} µs, commit {commit_us:5.0f} µs",
                          flush=True)
        finally:
            for s in systems:
                s.drop(conn)
    print()
    print(f"{'system':30s} {'claim µs':>9s} {'commit µs':>10s} {'backend CPU µs/loop':>20s} {'locks (fast-path)':>18s}")
    base = statistics.median(figures[systems[0].name]["claim"])
    for s in systems:
        f = figures[s.name]
        claim = statistics.median(f["claim"])
        cpu = f"{statistics.median(f['cpu']):.0f}" if f["cpu"] else ""
        n, fast = locks[s.name]
        print(f"{s.name:30s} {claim:9.0f} {statistics.median(f['commit']):10.0f} {cpu:>20s} {f'{n} ({fast})':>18s}"
              f"   {claim / base:4.1f}x the classic claim")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", default=DEFAULT_URL)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--jobs", type=int, default=1000, help="claims per system and round")
    p.add_argument("--also-claim-of", metavar="REVISION", type=claim_revision,
                   help="also run qstore with the claim_ready text of this revision (one whose frozen "
                        "folder holds claim_ready.sql, e.g. 0010)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
