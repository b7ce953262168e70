"""Bad input, fuzzed: every public entry point of :class:`QueueStorage` that takes user data
(and ``QueueStorageConfig``, ``MaintenanceSchedule`` / ``Maintainer`` construction, and a few
calls of ``AsyncQueueStorage``) either works or raises a ``QueueStorageError`` subclass whose
message names the bad value: never a raw ``TypeError`` / ``ValueError`` / driver error, and
never a ``DatabaseError`` for input that is plainly bad. A call that raises wrote nothing.

How an example is judged (:meth:`World.check`):

* Every argument is drawn from a *good* pool (valid, and often weird: quotes, backslashes,
  unicode, 1 MB strings, JSON nested 256 deep (the limit), unknown ids) or a *bad* pool (values the API
  must refuse). With a bad argument the call must raise ``ValidationError`` whose ``field``
  names one of the bad arguments; with none it must work, or fail with one of the call's
  domain errors (an unknown callback, a unique conflict, registering a callback for an
  attempt that is not running).
* Census: the row count and a digest of the row versions (``ctid``, ``xmin``: any insert,
  update or delete changes them) of every table of the install's schema, and the position
  of every sequence, read before and after the call. A call that raises leaves every table
  as it was, also when it ran on a caller's ``Connection`` that the caller commits after
  the error. A ``ValidationError`` moves no sequence either (validation runs before any
  I/O). Another error may advance ``job_id_seq``: ids are drawn before the unique check and
  ``nextval`` is not rolled back, which leaves a gap in job ids and nothing else.
* Weird-but-valid data round-trips: ``load_job`` returns what was enqueued, and stored
  progress, error text, error entries and callback results read back equal. JSON numbers
  compare by value: ``jsonb`` stores numbers as decimals, so an integral float such as
  ``1e300`` reads back as the int ``10**300``.

The examples of one test share the module's install (reset when the test starts), so state
accumulates across examples; every check is relative to the census taken just before the
call. ``HealthCheck.function_scoped_fixture`` is suppressed deliberately: the install and
the census connection are meant to be shared by all examples of a test.
``QSTORE_FUZZ_EXAMPLES=<factor>`` multiplies the example counts (a longer bug hunt);
``QSTORE_FUZZ_SHRINK=0`` reports a failing example without shrinking it (every step of a
shrink runs database calls).
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as hs
from hypothesis.control import currently_in_test_context
from sqlalchemy import Connection, Engine, TextClause, text
from sqlalchemy.ext.asyncio import create_async_engine

from qstore import (
    CallbackConfig,
    CallbackNotFoundError,
    ClaimedRuntimeJob,
    DatabaseError,
    InsertOpts,
    InsertParams,
    JobState,
    ListDlqFilter,
    QueueClaimerLease,
    QueueStorage,
    QueueStorageConfig,
    QueueStorageError,
    RetryFromDlqOpts,
    SchemaNotInstalledError,
    UniqueConflictError,
    UniqueOpts,
    ValidationError,
)
from qstore.aio import AsyncQueueStorage
from qstore.config import MAX_CHANNEL_BYTES
from qstore.errors import describe
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule
from qstore.storage.callbacks import RESULT_KEY
from qstore.storage.jobs import unique_states_mask

SCALE = float(os.environ.get("QSTORE_FUZZ_EXAMPLES", "1"))
SHRINK = os.environ.get("QSTORE_FUZZ_SHRINK", "1") != "0"


def fuzz(examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=max(1, int(examples * SCALE)), deadline=None, database=None,
        phases=[p for p in Phase if SHRINK or p is not Phase.shrink],
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                               HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


# -- value pools --------------------------------------------------------------------------------

class Big(str):
    """A long string that prints as its length (hypothesis prints failing examples)."""

    def __repr__(self) -> str:
        return f"<{len(self)} characters>"


MEGA = Big("ä'\"\\" * (1 << 18))  # 1 Mi characters: non-ASCII, quotes and backslashes
WEIRD = "'\"\\%_#:;$ \t\r\n\u00e4\u00df\u2028\u200b\ufeff\U0001f600"
chars = hs.one_of(hs.sampled_from(WEIRD), hs.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
text_ = hs.text(chars, max_size=24)
#: a string PostgreSQL cannot store: a NUL or an unpaired UTF-16 surrogate inside
spiked = hs.builds(lambda a, c, b: a + c + b, text_, hs.one_of(hs.characters(categories=("Cs",)), hs.just("\x00")), text_)
some_not_str = hs.one_of(hs.integers(), hs.floats(), hs.binary(max_size=4), hs.lists(hs.integers(), max_size=2))
not_str = hs.one_of(hs.none(), some_not_str)

NAME_EDGES = ["q", "q#3", "#", "a#b#7", "x" * 200, "\U0001f600" * 200, "'; DROP TABLE jobs; --", "\\'", 'a"b']
names = hs.one_of(hs.text(chars, min_size=1, max_size=24), hs.sampled_from(NAME_EDGES))
bad_names_but_none = hs.one_of(spiked, hs.one_of(hs.just(""), hs.just("y" * 201), hs.just(MEGA), some_not_str))
bad_names = hs.one_of(spiked, hs.one_of(hs.none(), bad_names_but_none))


def rarely(strategy: hs.SearchStrategy[Any], otherwise: hs.SearchStrategy[Any]) -> hs.SearchStrategy[Any]:
    """``strategy`` about one time in ten, else ``otherwise`` (keeps 1 MB values occasional)."""
    return hs.integers(0, 9).flatmap(lambda n: strategy if n == 0 else otherwise)


good_text = rarely(hs.just(MEGA), text_)
bad_text = hs.one_of(spiked, some_not_str)


def nest(depth: int) -> Any:
    """JSON ``depth`` containers deep (alternating objects and arrays)."""
    value: Any = "bottom"
    for i in range(depth):
        value = [value] if i % 2 else {"d": value}
    return value


def cycle() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


BIG_INTS = [2**63, -(2**63) - 1, 10**100, -(10**3999), 10**4000 - 1]
json_leaf = hs.one_of(hs.none(), hs.booleans(), hs.integers(), hs.sampled_from(BIG_INTS),
                      hs.floats(allow_nan=False, allow_infinity=False), text_)
#: valid JSON; nested at most 255 deep, so it stays valid one level down (inside metadata)
json_good = rarely(
    hs.one_of(hs.integers(1, 255).map(nest), hs.just({"blob": MEGA})),
    hs.recursive(json_leaf, lambda inner: hs.one_of(
        hs.lists(inner, max_size=4), hs.tuples(inner, inner), hs.dictionaries(text_, inner, max_size=4)),
        max_leaves=10),
)
bad_json_leaf = hs.one_of(
    spiked,
    hs.sampled_from([math.nan, math.inf, -math.inf, 10**4000, -(10**4001)]),
    hs.one_of(hs.sets(hs.integers(), max_size=2), hs.binary(max_size=3), hs.builds(object), hs.datetimes(),
              hs.decimals(allow_nan=False, allow_infinity=False), hs.uuids(),
              hs.builds(MappingProxyType, hs.dictionaries(text_, hs.integers(), max_size=2))),
    hs.one_of(hs.integers(257, 3000).map(nest), hs.builds(cycle)),
)
#: objects JSON cannot hold: a bad value, a key that is not a string, a key PostgreSQL cannot store
bad_json_objects = hs.one_of(
    bad_json_leaf.map(lambda v: {"k": v}),
    hs.one_of(hs.integers(), hs.none(), hs.tuples(hs.integers()), hs.floats()).map(lambda k: {k: 1}),
    spiked.map(lambda k: {k: 1}),
)
json_bad = hs.one_of(bad_json_leaf, bad_json_objects, hs.tuples(json_good, bad_json_leaf).map(list))

ids = hs.one_of(hs.integers(-(2**63), 2**63 - 1), hs.sampled_from([0, -1, 2**63 - 1, -(2**63)]))
bad_ids_but_none = hs.one_of(hs.integers(min_value=2**63), hs.integers(max_value=-(2**63) - 1), hs.floats(),
                             hs.text(max_size=4), hs.booleans(), hs.binary(max_size=2))
bad_ids = hs.one_of(hs.none(), bad_ids_but_none)


def aim(real: Any, others: hs.SearchStrategy[Any]) -> hs.SearchStrategy[Any]:
    """``real`` (an id or token that exists) three times in four, else one of ``others``."""
    return hs.integers(0, 3).flatmap(lambda n: others if n == 0 else hs.just(real))


TEN_YEARS = 10 * 365 * 86400
#: durations of worker outcomes and claims: 0 to 10 years (None means 0)
delays = hs.one_of(hs.none(), hs.integers(0, TEN_YEARS), hs.floats(0, TEN_YEARS),
                   hs.timedeltas(timedelta(0), timedelta(seconds=TEN_YEARS)))
wrong_duration_types = hs.one_of(hs.text(max_size=3), hs.booleans(), hs.decimals(allow_nan=False),
                                 hs.lists(hs.integers(), max_size=1))
bad_delays = hs.one_of(
    hs.floats(max_value=-1e-9), hs.integers(max_value=-1), hs.sampled_from([math.nan, math.inf, -math.inf, 10**30]),
    hs.floats(min_value=TEN_YEARS + 1), hs.timedeltas(max_value=timedelta(microseconds=-1)),
    hs.timedeltas(min_value=timedelta(seconds=TEN_YEARS, microseconds=1)), wrong_duration_types)
#: leases, timeouts and staleness: positive, at most one day
spans = hs.one_of(hs.integers(1, 86400), hs.floats(1e-6, 86400),
                  hs.timedeltas(timedelta(microseconds=1), timedelta(days=1)))
bad_spans = hs.one_of(
    hs.just(0), hs.just(0.0), hs.floats(max_value=0), hs.integers(max_value=0),
    hs.sampled_from([math.nan, math.inf, 10**20, 86400.5]), hs.integers(min_value=86401),
    hs.timedeltas(max_value=timedelta(0)), hs.timedeltas(min_value=timedelta(days=1, microseconds=1)),
    wrong_duration_types, hs.none())

MAX_BATCH = 2**31 - 1
batches = hs.one_of(hs.integers(1, 5), hs.just(MAX_BATCH))
bad_batches_but_none = hs.one_of(hs.integers(max_value=0), hs.integers(min_value=MAX_BATCH + 1),
                                 hs.sampled_from([1.0, "5", True]))
bad_batches = hs.one_of(hs.none(), bad_batches_but_none)
tokens = hs.one_of(hs.uuids(), hs.uuids().map(str))
bad_tokens_but_none = hs.one_of(hs.text(max_size=10), hs.integers(), hs.binary(max_size=16))
bad_tokens = hs.one_of(hs.none(), bad_tokens_but_none)

#: UTC offsets in minutes; PostgreSQL's own limit is under 16 hours, Python's under 24
offsets = hs.one_of(hs.sampled_from([16 * 60, -16 * 60, 23 * 60 + 59, -(23 * 60 + 59), 15 * 60 + 59]),
                    hs.integers(-1439, 1439)).map(lambda m: timezone(timedelta(minutes=m)))
aware = hs.builds(lambda d, tz: d.replace(tzinfo=tz),
                  hs.datetimes(datetime(1, 1, 2), datetime(9999, 12, 30)), offsets)
bad_aware = hs.one_of(
    hs.datetimes(),  # naive
    hs.sampled_from([datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))),
                     datetime(9999, 12, 31, 23, 59, tzinfo=timezone(timedelta(hours=-5)))]),
    hs.dates(), hs.text(max_size=10), hs.integers(), hs.floats())
priorities = hs.integers(1, 4)
bad_priorities_but_none = hs.one_of(hs.integers(max_value=0), hs.integers(min_value=5), hs.sampled_from(["1", 1.0, True]))
bad_priorities = hs.one_of(hs.none(), bad_priorities_but_none)


@dataclass(frozen=True)
class P:
    """One parameter: values the API must accept (``good``) and must refuse (``bad``)."""

    good: hs.SearchStrategy[Any]
    bad: hs.SearchStrategy[Any] | None = None


def args_of(data: hs.DataObject, params: dict[str, P]) -> tuple[dict[str, Any], frozenset[str]]:
    """Draw every parameter; none, one or two from their bad pool. Returns the values and the
    names of the bad ones."""
    breakable = [n for n, p in params.items() if p.bad is not None]
    mode = data.draw(hs.sampled_from(["one bad", "good", "two bad", "good", "one bad"]), label="mode")
    bad: set[str] = set()
    if breakable and mode == "one bad":
        bad = {data.draw(hs.sampled_from(breakable), label="bad")}
    elif breakable and mode == "two bad":
        bad = set(data.draw(hs.lists(hs.sampled_from(breakable), min_size=1, max_size=2, unique=True), label="bad"))
    values = {n: data.draw(p.bad if n in bad and p.bad is not None else p.good, label=n) for n, p in params.items()}
    return values, frozenset(bad)


# -- judging a call ---------------------------------------------------------------------------


def outcome(what: str) -> None:
    """Count ``what`` in the statistics (``pytest --hypothesis-show-statistics``)."""
    if currently_in_test_context():
        event(what)


def never(err: QueueStorageError) -> bool:
    return False


def names_one_of(err_field: str, bad: frozenset[str]) -> bool:
    return any(err_field == b or err_field.startswith((f"{b}.", f"{b}[")) for b in bad)


@dataclass
class Call:
    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    bad: frozenset[str] = frozenset()
    domain: Callable[[QueueStorageError], bool] = never

    def __repr__(self) -> str:
        shown = [describe(a) for a in self.args] + [f"{k}={describe(v)}" for k, v in self.kwargs.items()]
        return f"{self.method}(<target>, {', '.join(shown)}) bad={sorted(self.bad)}"


_TABLES = ("SELECT c.relname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace "
           "WHERE ns.nspname = :s AND c.relkind = 'r' ORDER BY c.relname")


@functools.lru_cache(maxsize=16)
def census_statement(schema: str, tables: tuple[str, ...]) -> TextClause:
    """One statement reading every table's row count and a digest of its row versions
    (``ctid``, ``xmin``: every insert, update or delete changes the set), and every
    sequence's position: one round trip, planned once per connection."""
    def quoted(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    parts = [f"SELECT CAST(:t{i} AS text) AS rel, count(*) AS n, md5(coalesce(string_agg("
             f"ctid::text || xmin::text, ',' ORDER BY ctid), '')) AS digest "
             f"FROM {quoted(schema)}.{quoted(t)}" for i, t in enumerate(tables)]
    parts.append("SELECT 'sequence ' || sequencename, coalesce(last_value, 0), NULL "
                 "FROM pg_sequences WHERE schemaname = :s")
    return text(" UNION ALL ".join(parts)).bindparams(
        s=schema, **{f"t{i}": t for i, t in enumerate(tables)})


JOB_ID_SEQ = "sequence job_id_seq"
LIVE_QUEUE = "live\x01fixture"  # fuzzed calls never name it, so pausing or moving queues spares it


@pytest.fixture(scope="module")
def census_conn(engine: Engine, installed: QueueStorageConfig) -> Iterator[Connection]:
    """An autocommit connection (it holds no snapshot or lock between censuses)."""
    with engine.connect() as conn:
        conn.execution_options(isolation_level="AUTOCOMMIT")
        yield conn


class World:
    """The install under test, the census, and the judge of every call."""

    def __init__(self, engine: Engine, storage: QueueStorage, census_conn: Connection) -> None:
        self.engine, self.storage, self.census_conn = engine, storage, census_conn
        self.before: dict[str, tuple[int, str | None]] = {}

    def __repr__(self) -> str:
        return f"World({self.storage.schema()})"

    def census(self) -> dict[str, tuple[int, str | None]]:
        schema = self.storage.schema()
        tables = tuple(self.census_conn.execute(text(_TABLES), {"s": schema}).scalars())
        rows = self.census_conn.execute(census_statement(schema, tables)).all()
        return {r.rel: (r.n, r.digest) for r in rows}

    def running(self, **opts: Any) -> ClaimedRuntimeJob:
        """A fresh running attempt (enqueued and claimed outside any judged call)."""
        self.storage.enqueue_params_batch(self.engine, [InsertParams("live", {"n": 1}, InsertOpts(queue=LIVE_QUEUE, **opts))])
        (claimed,) = self.storage.claim_runtime_batch(self.engine, LIVE_QUEUE, 1)
        return claimed

    def check(self, call: Call, target: str = "engine") -> Any:
        """Run ``call`` on an Engine, or on a Connection committed afterwards whatever
        happened, and judge it (see the module docstring). Returns the result or the error."""
        fn = getattr(self.storage, call.method)
        self.before = self.census()
        try:
            if target == "engine":
                result = fn(self.engine, *call.args, **call.kwargs)
            else:
                with self.engine.connect() as conn:
                    try:
                        result = fn(conn, *call.args, **call.kwargs)
                    finally:
                        conn.commit()  # a careless caller commits whatever the failed call left
        except QueueStorageError as err:
            outcome(f"{call.method}: {type(err).__name__}")
            self.judge(call, err)
            return err
        outcome(f"{call.method}: {type(result).__name__}")
        assert not call.bad, f"{call} accepted bad input and returned {describe(result)}"
        return result

    def judge(self, call: Call, err: QueueStorageError) -> None:
        assert not isinstance(err, DatabaseError), f"{call} reached the database with bad input: {err}"
        after = self.census()
        changed = {k for k in self.before.keys() | after.keys() if self.before.get(k) != after.get(k)}
        if isinstance(err, ValidationError) and call.bad:
            assert names_one_of(err.field, call.bad), f"{call}: {err} names none of {sorted(call.bad)}"
            assert str(err).startswith(f"invalid {err.field}=")
            assert not changed, f"{call} raised {err!r} but changed {sorted(changed)}"
        else:
            assert not call.bad, f"{call} raised {err!r} instead of a ValidationError naming the bad input"
            assert call.domain(err), f"{call} refused valid input: {err!r}"
            assert changed <= {JOB_ID_SEQ}, f"{call} raised {err!r} but changed {sorted(changed)}"
            if isinstance(err, ValidationError):
                assert not changed, f"{call} raised {err!r} but moved {sorted(changed)}"


@pytest.fixture
def world(engine: Engine, reset_storage: Callable[[], QueueStorage], census_conn: Connection) -> World:
    return World(engine, reset_storage(), census_conn)


targets = hs.sampled_from(["engine", "connection"])


def same_json(sent: Any, got: Any) -> bool:
    """``got`` is ``sent`` read back from ``jsonb`` (numbers compared by value)."""
    if sent is None or isinstance(sent, bool):
        return got is sent
    if isinstance(sent, float):
        return isinstance(got, int | float) and not isinstance(got, bool) and float(got) == sent
    if isinstance(sent, int):
        return type(got) is int and got == sent
    if isinstance(sent, str):
        return got == sent
    if isinstance(sent, list | tuple):
        return isinstance(got, list) and len(got) == len(sent) and all(map(same_json, sent, got))
    if isinstance(sent, dict):
        return isinstance(got, dict) and got.keys() == sent.keys() and all(same_json(v, got[k]) for k, v in sent.items())
    return False


def is_unique_conflict(err: QueueStorageError) -> bool:
    return isinstance(err, UniqueConflictError)


def is_unknown_callback(err: QueueStorageError) -> bool:
    return isinstance(err, CallbackNotFoundError)


def is_not_running(err: QueueStorageError) -> bool:
    return isinstance(err, ValidationError) and err.field == "job" and "not in running state" in err.reason


# -- enqueue ------------------------------------------------------------------------------------

unique_good = hs.builds(UniqueOpts, by_queue=hs.booleans(), by_args=hs.booleans(),
                        by_period=hs.one_of(hs.none(), hs.integers(-(2**63), 2**63 - 1)), states=hs.integers(0, 255))
unique_bad = hs.one_of(
    hs.sampled_from([{"by_args": True}, "unique", True]),
    hs.builds(UniqueOpts, states=hs.sampled_from([-1, 256, 2**70, "31", 3.0, True, None])),
    hs.builds(UniqueOpts, by_period=hs.sampled_from([2**63, -(2**63) - 1, "day", 1.5, True])),
    hs.builds(UniqueOpts, by_queue=hs.sampled_from(["yes", 1, None])),
    hs.builds(UniqueOpts, by_args=hs.sampled_from(["no", 0])),
)
JOB_FIELDS: dict[str, P] = {
    "kind": P(names, bad_names),
    "args": P(hs.one_of(json_good, hs.just(nest(256))), json_bad),  # 256 deep: the deepest allowed
    "queue": P(names, bad_names),
    "priority": P(priorities, bad_priorities),
    "max_attempts": P(hs.integers(1, 32767), hs.one_of(hs.integers(max_value=0), hs.integers(min_value=32768),
                                                       hs.sampled_from(["3", 2.0, False, None]))),
    "run_at": P(hs.one_of(hs.none(), aware), bad_aware),
    "metadata": P(hs.dictionaries(text_, json_good, max_size=3),
                  hs.one_of(bad_json_objects, hs.sampled_from([None, "m", ["m"], 5]))),
    "tags": P(hs.one_of(hs.lists(text_, max_size=4), hs.tuples(good_text, text_)),
              hs.one_of(hs.lists(hs.one_of(spiked, not_str), min_size=1, max_size=2), hs.sampled_from([None, "tag", 5]),
                        hs.lists(text_, max_size=2).map(lambda t: (x for x in t)))),
    "unique": P(hs.one_of(hs.none(), unique_good), unique_bad),
    "ordering_key": P(hs.one_of(hs.none(), hs.binary(max_size=8), hs.binary(max_size=8).map(bytearray)),
                      hs.one_of(hs.text(max_size=4), hs.integers(), hs.lists(hs.integers(), max_size=2))),
}


def build_job(values: dict[str, Any]) -> InsertParams:
    return InsertParams(values["kind"], values["args"], InsertOpts(**{
        k: v for k, v in values.items() if k not in ("kind", "args")}))


def check_round_trip(world: World, job: InsertParams, job_id: int) -> None:
    row = world.storage.load_job(world.engine, job_id)
    assert row is not None, job_id
    o = job.opts
    assert (row.kind, row.queue, row.priority, row.max_attempts) == (job.kind, o.queue, o.priority, o.max_attempts)
    assert same_json(job.args, row.args), (describe(job.args), describe(row.args))
    assert same_json(dict(o.metadata), row.metadata), (describe(o.metadata), describe(row.metadata))
    assert row.tags == list(o.tags)
    assert row.state == (JobState.SCHEDULED if o.run_at is not None else JobState.AVAILABLE)
    if o.run_at is not None:
        assert row.run_at == o.run_at
    assert (row.unique_key is not None) == (o.unique is not None)
    assert row.unique_states == (unique_states_mask(o.unique.states) if o.unique is not None else None)


@fuzz(100)
@given(data=hs.data())
def test_enqueue_params_either_round_trips_or_refuses_naming_the_bad_field(world: World, data: hs.DataObject) -> None:
    size = data.draw(hs.integers(1, 3), label="size")
    broken = data.draw(hs.integers(0, size - 1), label="job that may be broken")
    jobs: list[Any] = []
    bad: set[str] = set()
    for i in range(size):
        fields = JOB_FIELDS if i == broken else {n: P(p.good) for n, p in JOB_FIELDS.items()}
        values, bad_fields = args_of(data, fields)
        jobs.append(build_job(values))
        bad |= {f"jobs[{i}].{f}" for f in bad_fields}
    shape = data.draw(hs.sampled_from(["list", "list", "list", "junk element", "no opts", "not a sequence"]), label="shape")
    arg: Any = jobs
    if shape == "junk element":
        jobs[-1], bad = {"kind": "k"}, bad | {f"jobs[{size - 1}]"}
    elif shape == "no opts":
        jobs[-1], bad = InsertParams("k", {}, {"queue": "q"}), bad | {f"jobs[{size - 1}]"}  # type: ignore[arg-type]
    elif shape == "not a sequence":
        arg, bad = data.draw(hs.sampled_from([None, 5, InsertParams("k")]), label="jobs"), {"jobs"}
    method = data.draw(hs.sampled_from(["enqueue_params_batch", "enqueue_params_copy"]), label="method")
    keyed = any(isinstance(j, InsertParams) and isinstance(j.opts, InsertOpts) and j.opts.unique is not None for j in jobs)
    call = Call(method, (arg,), bad=frozenset(bad), domain=is_unique_conflict if keyed else never)
    result = world.check(call, data.draw(targets, label="target"))
    if isinstance(result, QueueStorageError):
        return
    assert result == len(jobs)
    first = world.before[JOB_ID_SEQ][0] + 1
    for offset, job in enumerate(jobs):
        check_round_trip(world, job, first + offset)


@fuzz(10)
@given(data=hs.data())
def test_enqueue_batch_either_writes_count_jobs_or_refuses(world: World, data: hs.DataObject) -> None:
    values, bad = args_of(data, {"queue": P(names, bad_names), "priority": P(priorities, bad_priorities),
                                 "count": P(hs.integers(1, 3), bad_batches)})
    result = world.check(Call("enqueue_batch", (values["queue"], values["priority"], values["count"]), bad=bad))
    if not isinstance(result, QueueStorageError):
        assert result == values["count"]


def test_a_batch_of_20000_tiny_jobs_is_written_whole(world: World) -> None:
    jobs = [InsertParams("tiny", {"i": i}, InsertOpts(queue="big")) for i in range(20_000)]
    assert world.storage.enqueue_params_batch(world.engine, jobs) == 20_000
    assert world.storage.queue_counts(world.engine, "big").available == 20_000
    last = world.storage.load_job(world.engine, 20_000)
    assert last is not None and last.args == {"i": 19_999}


@pytest.mark.parametrize("method", ["enqueue_params_batch", "enqueue_params_copy"])
def test_one_bad_row_after_20000_good_ones_writes_nothing(world: World, method: str) -> None:
    jobs = [InsertParams("tiny", {"i": i}, InsertOpts(queue="big")) for i in range(20_000)]
    jobs.append(InsertParams("tiny", {"x": math.nan}, InsertOpts(queue="big")))
    err = world.check(Call(method, (jobs,), bad=frozenset({"jobs[20000].args"})))
    assert isinstance(err, ValidationError) and err.field == "jobs[20000].args.x"


# -- claim and claimers -------------------------------------------------------------------------

CLAIM_PARAMS = {"queue": P(names, bad_names), "max_batch": P(batches, bad_batches),
                "deadline_duration": P(delays, bad_delays), "aging_interval": P(delays, bad_delays)}
CLAIM_SIGNATURES = {
    "claim_runtime_batch_with_aging": ("queue", "max_batch", "deadline_duration", "aging_interval"),
    "claim_runtime_batch": ("queue", "max_batch", "deadline_duration"),
    "claim_job_batch": ("queue", "max_batch", "deadline_duration"),
    "claim_batch": ("queue", "max_batch"),
}


@fuzz(30)
@given(data=hs.data())
def test_claims_either_work_or_refuse_naming_the_bad_argument(world: World, data: hs.DataObject) -> None:
    method = data.draw(hs.sampled_from(sorted(CLAIM_SIGNATURES)), label="method")
    queue = data.draw(names, label="queue with a job")
    world.storage.enqueue_params_batch(world.engine, [InsertParams("k", {}, InsertOpts(queue=queue))])
    params = {n: CLAIM_PARAMS[n] for n in CLAIM_SIGNATURES[method]}
    params["queue"] = P(hs.one_of(hs.just(queue), names), bad_names)
    values, bad = args_of(data, params)
    result = world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))
    if not isinstance(result, QueueStorageError):
        assert isinstance(result, list)


leases = hs.builds(QueueClaimerLease, hs.integers(0, 32766), hs.integers(0, 2**63 - 1))
bad_leases = hs.one_of(
    hs.sampled_from([None, (0, 0), "lease"]),
    hs.builds(QueueClaimerLease, hs.sampled_from([-1, 32767, 2**40, "0", True, 0.0]), hs.just(0)),
    hs.builds(QueueClaimerLease, hs.just(0), hs.sampled_from([-1, 2**63, "0", None])),
)
CLAIMER_PARAMS = {
    "queue": P(names, bad_names), "instance_id": P(tokens, bad_tokens),
    "max_claimers": P(hs.integers(-3, 6), hs.one_of(hs.integers(min_value=32768), hs.sampled_from(["2", 2.0, None, True]))),
    "lease": P(leases, bad_leases), "lease_ttl": P(spans, bad_spans), "idle_threshold": P(spans, bad_spans),
    "max_batch": P(batches, bad_batches), "deadline_duration": P(delays, bad_delays),
    "aging_interval": P(delays, bad_delays),
}
CLAIMER_SIGNATURES = {
    "acquire_queue_claimer": ("queue", "instance_id", "max_claimers", "lease_ttl", "idle_threshold"),
    "mark_queue_claimer_active": ("queue", "instance_id", "lease", "lease_ttl"),
    "claim_runtime_batch_with_aging_for_instance": (
        "queue", "max_batch", "deadline_duration", "aging_interval", "instance_id", "max_claimers", "lease_ttl",
        "idle_threshold"),
}


@fuzz(30)
@given(data=hs.data())
def test_bounded_claimers_either_work_or_refuse_naming_the_bad_argument(world: World, data: hs.DataObject) -> None:
    method = data.draw(hs.sampled_from(sorted(CLAIMER_SIGNATURES)), label="method")
    values, bad = args_of(data, {n: CLAIMER_PARAMS[n] for n in CLAIMER_SIGNATURES[method]})
    world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))


# -- completion, worker outcomes, heartbeats ---------------------------------------------------


@fuzz(25)
@given(data=hs.data())
def test_completions_either_work_or_refuse_malformed_items(world: World, data: hs.DataObject) -> None:
    live = world.running()
    method = data.draw(hs.sampled_from(["complete_runtime_batch", "complete_runtime_batch_slow_in_tx",
                                        "complete_job_batch_by_id", "complete_claimed_batch", "complete_batch"]))
    good_item = {
        "complete_runtime_batch": hs.just(live), "complete_runtime_batch_slow_in_tx": hs.just(live),
        "complete_job_batch_by_id": hs.one_of(hs.just((live.job.id, live.job.run_lease)), hs.tuples(ids, ids)),
        "complete_claimed_batch": hs.just(live.claim), "complete_batch": hs.just(live.claim),
    }[method]
    bad_item = hs.one_of(hs.sampled_from([None, 5, "x", (1,), (1, 2, 3)]), hs.tuples(bad_ids, ids), hs.tuples(ids, bad_ids))
    field_name = "completions" if method == "complete_job_batch_by_id" else "claimed"
    values, bad = args_of(data, {field_name: P(
        hs.lists(good_item, max_size=3),
        hs.one_of(hs.sampled_from([None, 5]), hs.tuples(hs.lists(good_item, max_size=2), bad_item).map(lambda t: [*t[0], t[1]])))})
    world.check(Call(method, (values[field_name],), bad=bad), data.draw(targets, label="target"))


OUTCOME_EXTRA = {
    "retry_after": {"retry_after": P(delays, bad_delays)},
    "snooze": {"snooze_for": P(delays, bad_delays)},
    "cancel_running": {"reason": P(hs.one_of(hs.none(), good_text), bad_text)},
    "fail_terminal": {"error": P(hs.one_of(hs.none(), good_text), bad_text)},
    "fail_to_dlq": {"dlq_reason": P(hs.one_of(hs.none(), good_text), bad_text),
                    "error": P(hs.one_of(hs.none(), good_text), bad_text)},
    "fail_retryable": {"error": P(hs.one_of(hs.none(), good_text), bad_text)},
}


@fuzz(50)
@given(data=hs.data())
def test_worker_outcomes_either_apply_or_refuse_and_keep_the_attempt(world: World, data: hs.DataObject) -> None:
    live = world.running(max_attempts=data.draw(hs.integers(1, 2), label="max_attempts"))
    method = data.draw(hs.sampled_from(sorted(OUTCOME_EXTRA)), label="method")
    params = {"job_id": P(aim(live.job.id, ids), bad_ids), "run_lease": P(aim(live.job.run_lease, ids), bad_ids),
              **OUTCOME_EXTRA[method], "progress": P(hs.one_of(hs.none(), json_good), json_bad)}
    values, bad = args_of(data, params)
    result = world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))
    if method in ("fail_terminal", "fail_retryable", "fail_to_dlq") and result is not None \
            and not isinstance(result, QueueStorageError) and values["error"] is not None:
        assert result.errors[-1]["error"] == values["error"]
        loaded = world.storage.load_job(world.engine, live.job.id)
        assert loaded is not None and loaded.errors is not None and loaded.errors[-1]["error"] == values["error"]


@fuzz(35)
@given(data=hs.data())
def test_heartbeats_and_progress_either_store_or_refuse(world: World, data: hs.DataObject) -> None:
    live = world.running()
    pair = (live.job.id, live.job.run_lease)
    method = data.draw(hs.sampled_from(["heartbeat_batch", "heartbeat_progress_batch", "flush_progress"]), label="method")
    bad_shape = hs.sampled_from([None, 5, "ab", (1,), (1, 2, 3, 4)])
    if method == "heartbeat_batch":
        item, bad_item = hs.one_of(aim(pair, hs.tuples(ids, ids)), hs.just(list(pair))), hs.one_of(
            bad_shape, hs.tuples(bad_ids, ids), hs.tuples(ids, bad_ids))
    else:
        item = hs.tuples(aim(pair, hs.tuples(ids, ids)), json_good).map(lambda t: (*t[0], t[1]))
        bad_item = hs.one_of(bad_shape, hs.tuples(bad_ids, ids, json_good), hs.tuples(hs.just(pair[0]), hs.just(pair[1]), json_bad))
    if method == "flush_progress":
        params = {"job_id": P(aim(live.job.id, ids), bad_ids), "run_lease": P(aim(live.job.run_lease, ids), bad_ids),
                  "progress": P(json_good, json_bad)}
    else:
        params = {"jobs": P(hs.lists(item, max_size=3), hs.one_of(
            hs.sampled_from([None, 7, "jobs"]), hs.tuples(hs.lists(item, max_size=2), bad_item).map(lambda t: [*t[0], t[1]])))}
    values, bad = args_of(data, params)
    result = world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))
    if method == "flush_progress" and not bad and (values["job_id"], values["run_lease"]) == pair:
        loaded = world.storage.load_job(world.engine, live.job.id)
        assert loaded is not None and same_json(values["progress"], loaded.progress)
    if method == "heartbeat_batch" and not isinstance(result, QueueStorageError):
        assert result == (1 if any(tuple(p) == pair for p in values["jobs"]) else 0)


# -- external callbacks -------------------------------------------------------------------------

configs = hs.one_of(hs.none(), hs.just(CallbackConfig()), hs.just(CallbackConfig(filter="  ")))
bad_configs = hs.one_of(hs.sampled_from(["config", {"filter": "x"}]),
                        hs.builds(CallbackConfig, filter=hs.sampled_from(["true", "payload.ok"])),
                        hs.builds(CallbackConfig, on_complete=hs.just("x")))


@fuzz(50)
@given(data=hs.data())
def test_callback_calls_either_work_or_refuse_naming_the_bad_argument(world: World, data: hs.DataObject) -> None:
    live = world.running()
    job_id, run_lease = live.job.id, live.job.run_lease
    token = world.storage.register_callback(world.engine, job_id, run_lease, 60)
    if data.draw(hs.booleans(), label="waiting"):
        assert world.storage.enter_callback_wait(world.engine, job_id, run_lease, token)
    job = P(aim(job_id, ids), bad_ids)
    lease = P(aim(run_lease, ids), bad_ids)
    opt_lease = P(hs.one_of(hs.none(), aim(run_lease, ids)), bad_ids_but_none)
    cb = P(aim(token, hs.one_of(hs.just(str(token)), tokens)), bad_tokens)
    timeout = P(spans, bad_spans)
    signatures: dict[str, tuple[dict[str, P], Callable[[QueueStorageError], bool]]] = {
        "register_callback": ({"job_id": job, "run_lease": lease, "timeout": timeout}, is_not_running),
        "register_callback_with_config": (
            {"job_id": job, "run_lease": lease, "timeout": timeout, "config": P(configs, bad_configs)}, is_not_running),
        "cancel_callback": ({"job_id": job, "run_lease": lease}, never),
        "enter_callback_wait": ({"job_id": job, "run_lease": lease, "callback_id": cb}, never),
        "wait_for_callback": ({"job_id": job, "run_lease": lease, "timeout": timeout, "config": P(configs, bad_configs),
                               "callback_id": P(hs.one_of(hs.none(), aim(token, tokens)), bad_tokens_but_none)},
                              never),
        "check_callback_state": ({"job_id": job, "callback_id": cb}, never),
        "callback_job": ({"callback_id": cb, "run_lease": opt_lease}, never),
        "load_active_lease_in_tx": ({"job_id": job, "run_lease": lease}, never),
        "complete_external": ({"callback_id": cb, "payload": P(hs.one_of(hs.none(), json_good), json_bad),
                               "run_lease": opt_lease, "resume": P(hs.booleans())}, is_unknown_callback),
        "fail_external": ({"callback_id": cb, "error": P(good_text, bad_text), "run_lease": opt_lease},
                          is_unknown_callback),
        "fail_external_with_error_entry": ({"callback_id": cb, "error_entry": P(json_good, json_bad),
                                            "run_lease": opt_lease}, is_unknown_callback),
        "retry_external": ({"callback_id": cb, "run_lease": opt_lease}, is_unknown_callback),
        "heartbeat_callback": ({"callback_id": cb, "timeout": timeout}, is_unknown_callback),
    }
    method = data.draw(hs.sampled_from(sorted(signatures)), label="method")
    params, domain = signatures[method]
    values, bad = args_of(data, params)
    if "config" in bad:
        bad |= {"callback_config"}  # a CEL expression is named by its CallbackConfig field
    result = world.check(Call(method, tuple(values.values()), bad=bad, domain=domain), data.draw(targets, label="target"))
    if isinstance(result, QueueStorageError) or bad:
        return
    if method == "complete_external" and values["resume"]:
        assert same_json(values["payload"], result.metadata[RESULT_KEY])  # read back by the call
    if method in ("fail_external", "fail_external_with_error_entry"):
        loaded = world.storage.load_job(world.engine, job_id)
        assert loaded is not None and loaded.errors is not None
        stored = loaded.errors[-1]
        entry = values.get("error_entry", {"error": values.get("error")})
        if isinstance(entry, dict):
            assert all(same_json(v, stored[k]) for k, v in entry.items())
        else:
            assert same_json(entry, stored["error"])


# -- rescue, promotion, operator actions, queue settings ---------------------------------------

job_states = hs.one_of(hs.sampled_from(list(JobState)), hs.sampled_from([s.value for s in JobState]))
ADMIN: dict[str, dict[str, P]] = {
    "retry_job": {"job_id": P(ids, bad_ids)},
    "cancel_job": {"job_id": P(ids, bad_ids)},
    "retry_jobs_by_ids": {"ids": P(hs.lists(ids, max_size=3), hs.one_of(
        hs.sampled_from([None, 5, "12"]), hs.tuples(hs.lists(ids, max_size=2), bad_ids).map(lambda t: [*t[0], t[1]])))},
    "cancel_jobs_by_ids": {"ids": P(hs.lists(ids, max_size=3), hs.one_of(
        hs.sampled_from([None, 5, "12"]), hs.lists(bad_ids, min_size=1, max_size=2)))},
    "set_priority": {"job_id": P(ids, bad_ids), "priority": P(priorities, bad_priorities)},
    "move_queue": {"job_id": P(ids, bad_ids), "queue": P(names, bad_names),
                   "priority": P(hs.one_of(hs.none(), priorities), bad_priorities_but_none)},
    "age_waiting_priorities": {"aging_interval": P(spans, bad_spans), "limit": P(batches, bad_batches)},
    "promote_due": {"state": P(job_states, hs.sampled_from(["foo", 5, None, [], "SCHEDULED"])),
                    "batch_size": P(hs.integers(-3, 10), hs.sampled_from([MAX_BATCH + 1, 2**70, "10", 1.5, True, None]))},
    "rescue_stale_heartbeats": {"staleness": P(spans, bad_spans)},
    "rescue_expired_deadlines": {},
    "rescue_expired_callbacks": {},
    "rollup_terminal_count_deltas": {"max_slots": P(hs.integers(0, 2**31 - 1), hs.sampled_from([-1, 2**31, "1", 1.5, None]))},
}
flags = P(hs.one_of(hs.none(), hs.booleans()), hs.sampled_from([0, 1, "yes", "false", 1.0]))


@fuzz(50)
@given(data=hs.data())
def test_operator_actions_either_work_or_refuse_naming_the_bad_argument(world: World, data: hs.DataObject) -> None:
    live = world.running()
    method = data.draw(hs.sampled_from(sorted(ADMIN)), label="method")
    params = dict(ADMIN[method])
    for name in ("job_id", "ids"):  # aim at a real job now and then
        if name in params:
            real = live.job.id if name == "job_id" else [live.job.id]
            params[name] = P(aim(real, params[name].good), params[name].bad)
    values, bad = args_of(data, params)
    world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))


@fuzz(20)
@given(data=hs.data())
def test_queue_options_either_apply_or_refuse(world: World, data: hs.DataObject) -> None:
    values, bad = args_of(data, {
        "queue": P(names, bad_names), "paused": flags, "dlq_enabled": flags,
        "enqueue_shards": P(hs.one_of(hs.none(), hs.integers(1, 64)), hs.sampled_from([0, 65, True, "2", 2.0]))})
    queue = values.pop("queue")
    world.check(Call("set_queue_options", (queue,), values, bad=bad), data.draw(targets, label="target"))


# -- dead-letter queue --------------------------------------------------------------------------

FILTER_CRITERIA: dict[str, hs.SearchStrategy[Any]] = {
    "kind": hs.one_of(hs.just("live"), good_text), "queue": hs.one_of(hs.just(LIVE_QUEUE), names),
    "tag": hs.one_of(hs.just("t"), good_text), "before_id": ids, "before_dlq_at": aware}


def dlq_filter(required: str) -> hs.SearchStrategy[ListDlqFilter]:
    """A filter with criterion ``required`` set (``bulk_retry_from_dlq`` needs one)."""
    return hs.builds(ListDlqFilter, limit=hs.one_of(hs.none(), hs.integers(1, 5)), **{
        n: s if n == required else hs.one_of(hs.none(), s) for n, s in FILTER_CRITERIA.items()})


good_filters = hs.sampled_from(sorted(FILTER_CRITERIA)).flatmap(dlq_filter)
#: filters no DLQ call takes (``list_dlq`` also takes None and a filter without criteria)
malformed_filters = hs.one_of(
    hs.sampled_from(["kind", {"kind": "k"}]),
    hs.builds(ListDlqFilter, kind=bad_text),
    hs.builds(ListDlqFilter, kind=hs.just("live"), queue=bad_names_but_none),
    hs.builds(ListDlqFilter, tag=bad_text),
    hs.builds(ListDlqFilter, before_id=bad_ids_but_none),
    hs.builds(ListDlqFilter, before_dlq_at=bad_aware),
    hs.builds(ListDlqFilter, kind=hs.just("live"), limit=bad_batches_but_none),
)
bad_filters = hs.one_of(hs.sampled_from([None, ListDlqFilter(), ListDlqFilter(limit=3)]), malformed_filters)
listing_filters = hs.one_of(hs.none(), hs.builds(ListDlqFilter, limit=hs.one_of(hs.none(), hs.integers(1, 5))),
                            good_filters)
good_opts = hs.one_of(hs.none(), hs.builds(RetryFromDlqOpts, run_at=hs.one_of(hs.none(), aware),
                                           priority=hs.one_of(hs.none(), priorities), queue=hs.one_of(hs.none(), names)))
bad_opts = hs.one_of(
    hs.sampled_from(["opts", {"queue": "q"}]),
    hs.builds(RetryFromDlqOpts, run_at=bad_aware),
    hs.builds(RetryFromDlqOpts, priority=bad_priorities_but_none),
    hs.builds(RetryFromDlqOpts, queue=bad_names_but_none),
)


@fuzz(40)
@given(data=hs.data())
def test_dlq_calls_either_work_or_refuse_naming_the_bad_argument(world: World, data: hs.DataObject) -> None:
    failed = world.running(tags=["t"])
    world.storage.fail_terminal(world.engine, failed.job.id, failed.job.run_lease, "boom")
    dead = world.running(tags=["t"])
    world.storage.fail_to_dlq(world.engine, dead.job.id, dead.job.run_lease, "dead", "boom")
    job = P(hs.sampled_from([failed.job.id, dead.job.id]).flatmap(lambda real: aim(real, ids)), bad_ids)
    signatures = {
        "move_failed_to_dlq": {"job_id": job, "dlq_reason": P(good_text, bad_text)},
        "bulk_move_failed_to_dlq": {"kind": P(hs.one_of(hs.none(), hs.just("live"), good_text), bad_text),
                                    "queue": P(hs.one_of(hs.none(), hs.just(LIVE_QUEUE), names), bad_names_but_none),
                                    "dlq_reason": P(good_text, bad_text)},
        "retry_from_dlq": {"job_id": job, "opts": P(good_opts, bad_opts)},
        "bulk_retry_from_dlq": {"filter": P(good_filters, bad_filters)},
        "discard_failed_by_kind": {"kind": P(hs.one_of(hs.just("live"), good_text), bad_text)},
        "list_dlq": {"filter": P(listing_filters, malformed_filters)},
        "load_dlq_entry": {"job_id": job},
        "purge_dlq": {"kind": P(hs.one_of(hs.none(), hs.just("live"), good_text), bad_text),
                      "queue": P(hs.one_of(hs.none(), hs.just(LIVE_QUEUE), names), bad_names_but_none)},
    }
    method = data.draw(hs.sampled_from(sorted(signatures)), label="method")
    values, bad = args_of(data, signatures[method])
    world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))


# -- reads and targets ----------------------------------------------------------------------------


@fuzz(20)
@given(data=hs.data())
def test_reads_either_answer_or_refuse(world: World, data: hs.DataObject) -> None:
    method = data.draw(hs.sampled_from(["load_job", "queue_counts", "queue_counts_fast"]), label="method")
    params = {"job_id": P(ids, bad_ids)} if method == "load_job" else {"queue": P(names, bad_names)}
    values, bad = args_of(data, params)
    world.check(Call(method, tuple(values.values()), bad=bad), data.draw(targets, label="target"))


#: every target-taking method with valid arguments (the target alone is wrong)
TARGET_CALLS: list[tuple[str, tuple[Any, ...]]] = [
    ("enqueue_params_batch", ([InsertParams("k")],)), ("enqueue_params_copy", ([InsertParams("k")],)),
    ("enqueue_batch", ("q", 1, 1)), ("claim_runtime_batch", ("q", 1)), ("claim_batch", ("q", 1)),
    ("acquire_queue_claimer", ("q", uuid.uuid4(), 1, 5, 5)),
    ("mark_queue_claimer_active", ("q", uuid.uuid4(), QueueClaimerLease(0, 0), 5)),
    ("claim_runtime_batch_with_aging_for_instance", ("q", 1, None, None, uuid.uuid4(), 1, 5, 5)),
    ("complete_job_batch_by_id", ([(1, 1)],)), ("load_job", (1,)), ("queue_counts", ("q",)),
    ("queue_counts_fast", ("q",)), ("retry_after", (1, 1, 0)), ("snooze", (1, 1, 0)),
    ("cancel_running", (1, 1, "r")), ("fail_terminal", (1, 1, "e")), ("fail_to_dlq", (1, 1, "r", "e")),
    ("fail_retryable", (1, 1, "e")), ("heartbeat_batch", ([(1, 1)],)), ("heartbeat_progress_batch", ([(1, 1, None)],)),
    ("flush_progress", (1, 1, None)), ("register_callback", (1, 1, 5)), ("cancel_callback", (1, 1)),
    ("enter_callback_wait", (1, 1, uuid.uuid4())), ("wait_for_callback", (1, 1, 5)),
    ("check_callback_state", (1, uuid.uuid4())),
    ("callback_job", (uuid.uuid4(),)), ("load_active_lease_in_tx", (1, 1)), ("complete_external", (uuid.uuid4(),)),
    ("fail_external", (uuid.uuid4(), "e")), ("retry_external", (uuid.uuid4(),)),
    ("heartbeat_callback", (uuid.uuid4(), 5)), ("rescue_stale_heartbeats", (5,)), ("rescue_expired_deadlines", ()),
    ("rescue_expired_callbacks", ()), ("promote_due", ("scheduled", 5)), ("retry_job", (1,)),
    ("retry_jobs_by_ids", ([1],)), ("cancel_job", (1,)), ("cancel_jobs_by_ids", ([1],)), ("set_priority", (1, 1)),
    ("move_queue", (1, "q")), ("age_waiting_priorities", (5, 5)), ("set_queue_options", ("q",)),
    ("move_failed_to_dlq", (1, "r")), ("bulk_move_failed_to_dlq", (None, None, "r")), ("retry_from_dlq", (1,)),
    ("bulk_retry_from_dlq", (ListDlqFilter(kind="k"),)), ("discard_failed_by_kind", ("k",)), ("list_dlq", ()),
    ("load_dlq_entry", (1,)), ("purge_dlq", ("k",)), ("rotate", ()),
    ("prune_oldest", ()), ("rotate_leases", ()), ("prune_oldest_leases", ()), ("rotate_claims", ()),
    ("prune_oldest_claims", ()), ("claim_slot_bytes", ()), ("vacuum_leases", ()), ("rollup_terminal_count_deltas", (1,)),
    ("rebuild_terminal_counters", ()), ("terminal_counter_trusted", ()), ("prepare_schema", ()),
    ("activate_backend", ()), ("install", ()), ("reset", ()), ("active_schema", ()),
]


@fuzz(40)
@given(data=hs.data())
def test_a_wrong_target_is_refused_naming_the_target(world: World, data: hs.DataObject) -> None:
    method, args = data.draw(hs.sampled_from(TARGET_CALLS), label="call")
    junk = data.draw(hs.sampled_from([None, "postgresql://localhost/db", 5, object(), world.storage]), label="target")
    before = world.census()
    with pytest.raises(ValidationError) as err:
        getattr(world.storage, method)(junk, *args)
    assert err.value.field == "target", err.value
    assert world.census() == before


def test_an_async_engine_is_not_a_sync_target(world: World, db_url: str) -> None:
    async_engine = create_async_engine(db_url)
    try:
        before = world.census()
        with pytest.raises(ValidationError) as info:
            world.storage.enqueue_params_batch(async_engine, [InsertParams("k")])  # type: ignore[arg-type]
        assert info.value.field == "target"
        assert world.census() == before
    finally:
        asyncio.run(async_engine.dispose())


# -- construction: config, storage, schedule, maintainer -------------------------------------------

identifiers = hs.from_regex(r"[a-z_][a-z0-9_]{0,47}", fullmatch=True).filter(
    lambda s: not s.startswith("pg_") and s != "qstore")
bad_identifiers = hs.one_of(
    hs.sampled_from(["", "Upper", "a-b", 'a"b', "a'b", "a\\b", "ä", "pg_x", "1abc", "a" * 49, "a\x00b", MEGA]),
    spiked, not_str)
CONFIG_FIELDS = {
    "schema": P(identifiers, bad_identifiers),
    "queue_slot_count": P(hs.integers(4, 256), hs.one_of(hs.integers(max_value=3), hs.integers(min_value=257),
                                                         hs.sampled_from([8.0, "8", True, None]))),
    "lease_slot_count": P(hs.integers(2, 256), hs.one_of(hs.integers(max_value=1), hs.sampled_from([2**70, 4.0]))),
    "claim_slot_count": P(hs.integers(2, 256), hs.one_of(hs.integers(max_value=1), hs.sampled_from([257, "2"]))),
    "queue_stripe_count": P(hs.integers(1, 64), hs.one_of(hs.integers(max_value=0), hs.sampled_from([65, 2.0, False]))),
    "lease_claim_receipts": P(hs.booleans(), hs.sampled_from([0, 1, "yes", None])),
    "notify_prefix": P(identifiers, bad_identifiers),
}


@fuzz(60)
@given(data=hs.data())
def test_configs_either_build_or_refuse_and_their_channels_fit_postgresql(data: hs.DataObject) -> None:
    values, bad = args_of(data, CONFIG_FIELDS)
    try:
        config = QueueStorageConfig(**values)
    except ValidationError as err:
        assert bad and names_one_of(err.field, bad), (bad, err)
        return
    assert not bad, f"QueueStorageConfig accepted {sorted(bad)}: {values}"
    assert {n: getattr(config, n) for n in values} == values
    for queue in (data.draw(names, label="queue"), "x" * 200, "\U0001f600" * 200):
        channel = config.notify_channel(queue)
        assert len(channel.encode()) <= MAX_CHANNEL_BYTES and channel == config.notify_channel(queue)
    assert len(config.cancel_channel.encode()) <= MAX_CHANNEL_BYTES


@fuzz(25)
@given(data=hs.data())
def test_storage_construction_refuses_what_is_not_a_config_or_schema_name(world: World, data: hs.DataObject) -> None:
    how = data.draw(hs.sampled_from(["QueueStorage", "from_existing_schema", "from_existing_schema with engine"]))
    if how == "QueueStorage":
        with pytest.raises(ValidationError) as err:
            QueueStorage(data.draw(hs.one_of(hs.sampled_from(["qstore", {"schema": "x"}, 5]), identifiers)))
        assert err.value.field == "config"
        return
    values, bad = args_of(data, {"schema": P(identifiers, bad_identifiers)})
    engine = world.engine if how.endswith("engine") else None
    try:
        storage = QueueStorage.from_existing_schema(values["schema"], engine)
    except ValidationError as err:
        assert bad and err.field == "schema", err
        return
    except SchemaNotInstalledError as err:
        assert not bad and engine is not None and err.schema == values["schema"]
        return
    assert not bad and storage.schema() == values["schema"]


SCHEDULE_FIELDS = {
    "queue_ring_every": P(hs.floats(1e-3, 1e6), hs.sampled_from([0, -1.0, math.nan, math.inf, 10**400, "1", True, None])),
    "promote_batch_size": P(hs.integers(1, MAX_BATCH), hs.sampled_from([0, MAX_BATCH + 1, 2**70, 10.0, "10"])),
    "heartbeat_staleness": P(hs.floats(1e-3, 86400), hs.sampled_from([86400.5, 1e9, 10**30, -5, math.nan])),
    "rollup_max_slots": P(hs.integers(1, 2**70), hs.sampled_from([0, 1.5, "4", True])),
    "prune_backoff_limit": P(hs.integers(0, 2**70), hs.sampled_from([-1, 2.5, None, math.inf])),
    "leader_retry_every": P(hs.floats(1e-3, 86400), hs.sampled_from([0.0, 1e300, 86401, 10**400, math.nan])),
}


@fuzz(40)
@given(data=hs.data())
def test_schedules_and_maintainers_either_build_or_refuse(world: World, data: hs.DataObject) -> None:
    values, bad = args_of(data, SCHEDULE_FIELDS)
    try:
        schedule = MaintenanceSchedule(**values)
    except ValidationError as err:
        assert bad and names_one_of(err.field, bad), (bad, err)
        return
    assert not bad, f"MaintenanceSchedule accepted {sorted(bad)}: {values}"
    m_values, m_bad = args_of(data, {
        "storage": P(hs.just(world.storage), hs.sampled_from([None, "storage", world.storage.config])),
        "schedule": P(hs.one_of(hs.none(), hs.just(schedule)), hs.sampled_from(["fast", {"rescue_every": 1}])),
        "keep_reports": P(hs.integers(1, 2**70), hs.sampled_from([0, -1, "5", 2.5, None, True])),
        "engine": P(hs.just(world.engine), hs.sampled_from([None, "postgresql://", world.census_conn])),
    })
    try:
        maintainer = Maintainer(m_values["storage"], m_values["engine"], m_values["schedule"],
                                keep_reports=m_values["keep_reports"])
    except ValidationError as err:
        assert m_bad and names_one_of(err.field, m_bad), (m_bad, err)
        return
    assert not m_bad, f"Maintainer accepted {sorted(m_bad)}"
    assert maintainer.schedule == (schedule if m_values["schedule"] is not None else MaintenanceSchedule())


# -- async ---------------------------------------------------------------------------------------


@fuzz(12)
@given(data=hs.data())
def test_async_calls_either_work_or_refuse_like_the_sync_ones(world: World, db_url: str, data: hs.DataObject) -> None:
    method = data.draw(hs.sampled_from(["enqueue_params_batch", "load_job", "retry_after", "complete_external"]))
    live = world.running()
    params = {
        # no unique options: a unique conflict with an earlier example is not what this test is about
        "enqueue_params_batch": {"jobs": P(hs.fixed_dictionaries({n: p.good for n, p in JOB_FIELDS.items() if n != "unique"})
                                           .map(lambda v: [build_job(v)]),
                                           hs.fixed_dictionaries({"kind": bad_names, "args": json_bad})
                                           .map(lambda v: [InsertParams(v["kind"], v["args"])]))},
        "load_job": {"job_id": P(ids, bad_ids)},
        "retry_after": {"job_id": P(hs.just(live.job.id), bad_ids), "run_lease": P(hs.just(live.job.run_lease), bad_ids),
                        "retry_after": P(delays, bad_delays), "progress": P(json_good, json_bad)},
        "complete_external": {"callback_id": P(tokens, bad_tokens), "payload": P(json_good, json_bad)},
    }[method]
    values, bad = args_of(data, params)
    storage = AsyncQueueStorage(world.storage)

    async def call() -> Any:
        engine = create_async_engine(db_url)
        try:
            return await getattr(storage, method)(engine, *values.values())
        finally:
            await engine.dispose()

    world.before = world.census()
    c = Call(method, tuple(values.values()), bad=bad,
             domain=is_unknown_callback if method == "complete_external" else never)
    try:
        result = asyncio.run(call())
    except QueueStorageError as err:
        outcome(f"async {method}: {type(err).__name__}")
        world.judge(c, err)
        return
    outcome(f"async {method}: {type(result).__name__}")
    assert not bad, f"{c} accepted bad input and returned {describe(result)}"
    if method == "enqueue_params_batch":
        check_round_trip(world, values["jobs"][0], world.before[JOB_ID_SEQ][0] + 1)
