"""Input validation, case by case: each bad input below raises a ``ValidationError`` naming
the bad field (before any statement runs, so nothing is written), and each weird-but-valid
input below works. ``tests/test_input_fuzz.py`` searches the same ground at random; these
are the cases it found, kept as named specifications."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from types import MappingProxyType
from typing import Any

import psycopg
import pytest
from jobtools import BACKLOG, census, running
from psycopg import sql
from sqlalchemy import Engine, make_url, text

from qstore import (
    DatabaseError,
    InsertOpts,
    InsertParams,
    JobState,
    ListDlqFilter,
    QueueClaimerLease,
    QueueStorage,
    RetryFromDlqOpts,
    UniqueOpts,
    ValidationError,
)
from qstore.config import MAX_CHANNEL_BYTES, channel_name
from qstore.runtime.maintainer import Maintainer, MaintenanceSchedule

NOTHING = dict.fromkeys(("ready_entries", "ready_tombstones", BACKLOG, "done_entries", "done_batches",
                         "dlq_entries",
                         "leases", "lease_claims", "lease_claim_closures", "lease_claim_closure_batches",
                         "attempt_state"), 0)


def job(kind: str = "k", args: Any = None, **opts: Any) -> InsertParams:
    opts.setdefault("queue", "q")
    return InsertParams(kind, {"n": 1} if args is None else args, InsertOpts(**opts))


def refused(call: Callable[[], Any], field: str) -> ValidationError:
    """``call()`` raises a ValidationError whose field is ``field`` (or a part of it)."""
    with pytest.raises(ValidationError) as info:
        call()
    err = info.value
    assert err.field == field or err.field.startswith((f"{field}.", f"{field}[")), err
    return err


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def self_containing() -> list[Any]:
    loop: list[Any] = []
    loop.append(loop)
    return loop


# -- job bodies -------------------------------------------------------------------------------

BAD_BODIES: dict[str, tuple[InsertParams, str]] = {
    "lone surrogate in kind": (job(kind="k\ud800"), "jobs[0].kind"),
    "lone surrogate in queue": (job(queue="q\udfff"), "jobs[0].queue"),
    "lone surrogate in an args string": (job(args={"a": "\ud800"}), "jobs[0].args.a"),
    "lone surrogate in a metadata key": (job(metadata={"\udbff": 1}), "jobs[0].metadata"),
    "lone surrogate in a tag": (job(tags=["ok", "\ud800"]), "jobs[0].tags[1]"),
    "args nested 3000 deep": (job(args=deep_list(3000)), "jobs[0].args"),
    "args containing themselves": (job(args=self_containing()), "jobs[0].args"),
    "args integer of 5000 digits": (job(args={"n": 10**5000}), "jobs[0].args.n"),
    "args mapping json cannot encode": (job(args={"m": MappingProxyType({"a": 1})}), "jobs[0].args.m"),
    "NUL in a string of an args list": (job(args={"l": ["ok", True, None, "a\x00"]}), "jobs[0].args.l[3]"),
    "NUL in an args key": (job(args={"ok": 1, "a\x00": 1}), "jobs[0].args"),
    "lone surrogate in a string of an args list": (job(args=["\udc00"]), "jobs[0].args[0]"),
    "args list integer of 5000 digits": (job(args=[1, -(10**5000)]), "jobs[0].args[1]"),
    "NaN among args": (job(args={"n": 1, "f": float("nan")}), "jobs[0].args.f"),
    "tags None": (job(tags=None), "jobs[0].tags"),
    "tags of a non-string": (job(tags=[5]), "jobs[0].tags[0]"),
    "unique options not UniqueOpts": (job(unique={"by_args": True}), "jobs[0].unique"),
    "unique state mask a string": (job(unique=UniqueOpts(states="31")), "jobs[0].unique.states"),  # type: ignore[arg-type]
    "unique state mask negative": (job(unique=UniqueOpts(states=-1)), "jobs[0].unique.states"),
    "unique state mask above 8 bits": (job(unique=UniqueOpts(states=256)), "jobs[0].unique.states"),
    "unique period a string": (job(unique=UniqueOpts(by_period="day")), "jobs[0].unique.by_period"),  # type: ignore[arg-type]
    "unique period beyond 64 bits": (job(unique=UniqueOpts(by_period=2**63)), "jobs[0].unique.by_period"),
    "unique by_queue not a bool": (job(unique=UniqueOpts(by_queue="yes")), "jobs[0].unique.by_queue"),  # type: ignore[arg-type]
    "opts not InsertOpts": (InsertParams("k", {}, {"queue": "q"}), "jobs[0].opts"),  # type: ignore[arg-type]
    "run_at before year 1 in UTC": (job(run_at=datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14)))), "jobs[0].run_at"),
    "run_at after year 9999 in UTC": (
        job(run_at=datetime(9999, 12, 31, 23, 59, tzinfo=timezone(timedelta(hours=-5)))), "jobs[0].run_at"),
}


@pytest.mark.parametrize("use_copy", [False, True], ids=["insert", "copy"])
@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_job_body_postgresql_or_json_cannot_hold_is_refused_before_writing(engine: Engine, st: QueueStorage,
                                                                          case: str, use_copy: bool) -> None:
    bad, field = BAD_BODIES[case]
    enqueue = st.enqueue_params_copy if use_copy else st.enqueue_params_batch
    refused(lambda: enqueue(engine, [bad]), field)
    assert census(engine, st) == NOTHING


def test_validation_error_message_stays_short_for_huge_or_unprintable_values() -> None:
    assert len(str(ValidationError("queue", "q" * (1 << 20), "too long"))) < 1000
    assert "<int>" in str(ValidationError("n", 10**5000, "too long"))  # repr() of it raises
    assert len(str(ValidationError("args", deep_list(3000), "too deep"))) < 1000  # repr() of it recurses


def test_tags_given_as_a_generator_are_refused_not_silently_dropped(engine: Engine, st: QueueStorage) -> None:
    refused(lambda: st.enqueue_params_batch(engine, [job(tags=(t for t in ["a", "b"]))]), "jobs[0].tags")
    assert census(engine, st) == NOTHING


@pytest.mark.parametrize("jobs", [None, 5, InsertParams("k")], ids=["None", "int", "one job"])
def test_jobs_that_are_not_a_sequence_are_refused(engine: Engine, st: QueueStorage, jobs: Any) -> None:
    refused(lambda: st.enqueue_params_batch(engine, jobs), "jobs")


def test_run_at_with_an_offset_postgresql_rejects_is_stored_as_the_same_instant(engine: Engine, st: QueueStorage) -> None:
    at = datetime(2030, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=20, minutes=32)))
    st.enqueue_params_batch(engine, [job(run_at=at)])
    (job_id,) = [i for i in range(1, 3) if st.load_job(engine, i) is not None]
    row = st.load_job(engine, job_id)
    assert row is not None and row.run_at == at and row.state == JobState.SCHEDULED


# -- durations, batch sizes, ids -----------------------------------------------------------------

Call = Callable[[QueueStorage, Engine], Any]
BAD_DURATIONS: dict[str, tuple[Call, str]] = {
    "claim deadline NaN": (lambda s, e: s.claim_runtime_batch(e, "q", 1, math.nan), "deadline_duration"),
    "claim aging NaN": (lambda s, e: s.claim_runtime_batch_with_aging(e, "q", 1, None, math.nan), "aging_interval"),
    "retry_after NaN": (lambda s, e: s.retry_after(e, 1, 1, math.nan), "retry_after"),
    "snooze NaN": (lambda s, e: s.snooze(e, 1, 1, math.nan), "snooze_for"),
    "callback timeout NaN": (lambda s, e: s.register_callback(e, 1, 1, math.nan), "timeout"),
    "callback timeout 1e20 s": (lambda s, e: s.register_callback(e, 1, 1, 10**20), "timeout"),
    "claimer lease NaN": (lambda s, e: s.acquire_queue_claimer(e, "q", uuid.uuid4(), 1, math.nan, 5), "lease_ttl"),
    "claimer lease 1e20 s": (lambda s, e: s.acquire_queue_claimer(e, "q", uuid.uuid4(), 1, 10**20, 5), "lease_ttl"),
    "staleness NaN": (lambda s, e: s.rescue_stale_heartbeats(e, math.nan), "staleness"),
    "aging interval NaN": (lambda s, e: s.age_waiting_priorities(e, math.nan, 5), "aging_interval"),
}


@pytest.mark.parametrize("case", list(BAD_DURATIONS))
def test_duration_that_is_nan_or_beyond_timedelta_is_refused(engine: Engine, st: QueueStorage, case: str) -> None:
    call, field = BAD_DURATIONS[case]
    refused(lambda: call(st, engine), field)


BAD_SIZES: dict[str, tuple[Call, str]] = {
    "claim max_batch 2**31": (lambda s, e: s.claim_runtime_batch(e, "q", 2**31), "max_batch"),
    "claim_batch max_batch 2**40": (lambda s, e: s.claim_batch(e, "q", 2**40), "max_batch"),
    "promote batch_size 2**31": (lambda s, e: s.promote_due(e, JobState.SCHEDULED, 2**31), "batch_size"),
    "promote batch_size a string": (lambda s, e: s.promote_due(e, JobState.SCHEDULED, "10"), "batch_size"),
    "promote state unknown": (lambda s, e: s.promote_due(e, "soon", 10), "state"),
    "aging limit 2**63": (lambda s, e: s.age_waiting_priorities(e, 5, 2**63), "limit"),
    "dlq filter limit 2**63": (lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(kind="k", limit=2**63)), "filter.limit"),
    "max_claimers a string": (lambda s, e: s.acquire_queue_claimer(e, "q", uuid.uuid4(), "2", 5, 5), "max_claimers"),
    "max_claimers beyond smallint slots": (
        lambda s, e: s.acquire_queue_claimer(e, "q", uuid.uuid4(), 40_000, 5, 5), "max_claimers"),
    "instance_id not a UUID": (lambda s, e: s.acquire_queue_claimer(e, "q", "abc", 1, 5, 5), "instance_id"),
    "claimer lease not a lease": (lambda s, e: s.mark_queue_claimer_active(e, "q", uuid.uuid4(), "x", 5), "lease"),
    "claimer slot beyond smallint": (
        lambda s, e: s.mark_queue_claimer_active(e, "q", uuid.uuid4(), QueueClaimerLease(2**40, 0), 5), "lease"),
    "claimer queue not a string": (
        lambda s, e: s.mark_queue_claimer_active(e, 5, uuid.uuid4(), QueueClaimerLease(0, 0), 5), "queue"),
}


@pytest.mark.parametrize("case", list(BAD_SIZES))
def test_size_or_slot_argument_postgresql_cannot_bind_is_refused(engine: Engine, st: QueueStorage, case: str) -> None:
    call, field = BAD_SIZES[case]
    refused(lambda: call(st, engine), field)


BAD_IDS: dict[str, tuple[Call, str]] = {
    "load_job beyond bigint": (lambda s, e: s.load_job(e, 2**63), "job_id"),
    "load_job a string": (lambda s, e: s.load_job(e, "1"), "job_id"),
    "retry_job beyond bigint": (lambda s, e: s.retry_job(e, -(2**63) - 1), "job_id"),
    "cancel_job a float": (lambda s, e: s.cancel_job(e, 1.0), "job_id"),
    "retry_jobs_by_ids not a list": (lambda s, e: s.retry_jobs_by_ids(e, None), "ids"),
    "cancel_jobs_by_ids a string id": (lambda s, e: s.cancel_jobs_by_ids(e, ["x"]), "ids[0]"),
    "set_priority beyond bigint": (lambda s, e: s.set_priority(e, 2**70, 1), "job_id"),
    "move_queue beyond bigint": (lambda s, e: s.move_queue(e, 2**70, "q"), "job_id"),
    "retry_after job id a string": (lambda s, e: s.retry_after(e, "abc", 1, 1), "job_id"),
    "fail_terminal run_lease beyond bigint": (lambda s, e: s.fail_terminal(e, 1, 2**70, "e"), "run_lease"),
    "heartbeat pair beyond bigint": (lambda s, e: s.heartbeat_batch(e, [(2**70, 1)]), "jobs[0].job_id"),
    "heartbeat item not a pair": (lambda s, e: s.heartbeat_batch(e, [(1,)]), "jobs[0]"),
    "heartbeat batch None": (lambda s, e: s.heartbeat_batch(e, None), "jobs"),
    "completion pair beyond bigint": (lambda s, e: s.complete_job_batch_by_id(e, [(2**70, 1)]), "completions[0].job_id"),
    "completions None": (lambda s, e: s.complete_job_batch_by_id(e, None), "completions"),
    "runtime completion of a non-job": (lambda s, e: s.complete_runtime_batch(e, [1]), "claimed[0]"),
    "claimed completion of a non-entry": (lambda s, e: s.complete_claimed_batch(e, [1]), "claimed[0]"),
    "register_callback beyond bigint": (lambda s, e: s.register_callback(e, 2**70, 1, 5), "job_id"),
    "cancel_callback a string": (lambda s, e: s.cancel_callback(e, "x", 1), "job_id"),
    "load_active_lease a string": (lambda s, e: s.load_active_lease_in_tx(e, "a", 1), "job_id"),
    "move_failed_to_dlq beyond bigint": (lambda s, e: s.move_failed_to_dlq(e, 2**70, "r"), "job_id"),
    "retry_from_dlq beyond bigint": (lambda s, e: s.retry_from_dlq(e, 2**70), "job_id"),
    "callback_job run_lease a string": (lambda s, e: s.callback_job(e, uuid.uuid4(), "x"), "run_lease"),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_id_that_is_not_a_64_bit_integer_is_refused(engine: Engine, st: QueueStorage, case: str) -> None:
    call, field = BAD_IDS[case]
    refused(lambda: call(st, engine), field)


def test_fractional_job_id_is_refused_not_truncated_to_a_live_job(engine: Engine, st: QueueStorage) -> None:
    c = running(engine, st)
    refused(lambda: st.fail_terminal(engine, c.job.id + 0.25, c.job.run_lease, "e"), "job_id")  # type: ignore[arg-type]
    row = st.load_job(engine, c.job.id)
    assert row is not None and row.state == JobState.RUNNING


BAD_TOKENS: dict[str, Call] = {
    "callback_job": lambda s, e: s.callback_job(e, "abc"),
    "complete_external": lambda s, e: s.complete_external(e, "abc"),
    "fail_external": lambda s, e: s.fail_external(e, "abc", "e"),
    "retry_external": lambda s, e: s.retry_external(e, 5),
    "heartbeat_callback": lambda s, e: s.heartbeat_callback(e, None, 5),
    "enter_callback_wait": lambda s, e: s.enter_callback_wait(e, 1, 1, "abc"),
    "check_callback_state": lambda s, e: s.check_callback_state(e, 1, "abc"),
}


@pytest.mark.parametrize("case", list(BAD_TOKENS))
def test_callback_id_that_is_not_a_uuid_is_refused(engine: Engine, st: QueueStorage, case: str) -> None:
    refused(lambda: BAD_TOKENS[case](st, engine), "callback_id")


def test_callback_id_given_as_a_uuid_string_resolves_the_callback(engine: Engine, st: QueueStorage) -> None:
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, c.job.run_lease, 60)
    assert st.complete_external(engine, str(token)).state == JobState.COMPLETED


def test_instance_id_given_as_a_uuid_string_acquires_a_claimer_slot(engine: Engine, st: QueueStorage) -> None:
    assert st.acquire_queue_claimer(engine, "q", str(uuid.uuid4()), 2, 5, 5) is not None


# -- JSON and text the worker or an outside system sends --------------------------------------------

BAD_WORKER_DATA: dict[str, tuple[Callable[[QueueStorage, Engine, int, int, uuid.UUID], Any], str]] = {
    "progress a set": (lambda s, e, j, r, t: s.fail_terminal(e, j, r, "e", progress={1}), "progress"),
    "progress NaN": (lambda s, e, j, r, t: s.flush_progress(e, j, r, math.nan), "progress"),
    "progress bytes": (lambda s, e, j, r, t: s.heartbeat_progress_batch(e, [(j, r, b"x")]), "jobs[0].progress"),
    "error with NUL": (lambda s, e, j, r, t: s.fail_retryable(e, j, r, "a\x00b"), "error"),
    "error a set": (lambda s, e, j, r, t: s.fail_terminal(e, j, r, {"e"}), "error"),
    "cancel reason with NUL": (lambda s, e, j, r, t: s.cancel_running(e, j, r, "\x00"), "reason"),
    "cancel reason a number": (lambda s, e, j, r, t: s.cancel_running(e, j, r, 5), "reason"),
    "dlq reason with NUL": (lambda s, e, j, r, t: s.fail_to_dlq(e, j, r, "\x00", "e"), "dlq_reason"),
    "callback payload an object": (lambda s, e, j, r, t: s.complete_external(e, t, object(), resume=True), "payload"),
    "callback payload NaN": (lambda s, e, j, r, t: s.complete_external(e, t, math.nan), "payload"),
    "error entry with NaN": (lambda s, e, j, r, t: s.fail_external_with_error_entry(e, t, {"x": math.nan}), "error_entry"),
    "external error with NUL": (lambda s, e, j, r, t: s.fail_external(e, t, "\x00"), "error"),
    "callback config not a config": (lambda s, e, j, r, t: s.register_callback_with_config(e, j, r, 5, "x"), "config"),
}


@pytest.mark.parametrize("case", list(BAD_WORKER_DATA))
def test_worker_data_postgresql_cannot_store_is_refused_and_the_attempt_stays(engine: Engine, st: QueueStorage,
                                                                            case: str) -> None:
    c = running(engine, st)
    token = st.register_callback(engine, c.job.id, c.job.run_lease, 60)
    call, field = BAD_WORKER_DATA[case]
    before = census(engine, st)
    refused(lambda: call(st, engine, c.job.id, c.job.run_lease, token), field)
    assert census(engine, st) == before
    row = st.load_job(engine, c.job.id)
    assert row is not None and row.state == JobState.RUNNING and row.callback_id == token


BAD_FILTERS: dict[str, tuple[Call, str]] = {
    "filter not a ListDlqFilter": (lambda s, e: s.bulk_retry_from_dlq(e, {"kind": "k"}), "filter"),
    "filter kind a number": (lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(kind=5)), "filter.kind"),
    "filter queue with NUL": (lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(queue="\x00")), "filter.queue"),
    "filter tag with NUL": (lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(tag="\x00")), "filter.tag"),
    "filter before_id a string": (lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(before_id="x")), "filter.before_id"),
    "filter before_dlq_at a string": (
        lambda s, e: s.bulk_retry_from_dlq(e, ListDlqFilter(before_dlq_at="x")), "filter.before_dlq_at"),
    "retry opts not RetryFromDlqOpts": (lambda s, e: s.retry_from_dlq(e, 1, "x"), "opts"),
    "retry opts queue empty": (lambda s, e: s.retry_from_dlq(e, 1, RetryFromDlqOpts(queue="")), "opts.queue"),
    "discard kind a number": (lambda s, e: s.discard_failed_by_kind(e, 5), "kind"),
    "list filter not a ListDlqFilter": (lambda s, e: s.list_dlq(e, {"kind": "k"}), "filter"),
    "list filter limit 0": (lambda s, e: s.list_dlq(e, ListDlqFilter(limit=0)), "filter.limit"),
    "purge kind a number": (lambda s, e: s.purge_dlq(e, 5), "kind"),
    "purge queue with NUL": (lambda s, e: s.purge_dlq(e, None, "\x00"), "queue"),
    "bulk move kind with NUL": (lambda s, e: s.bulk_move_failed_to_dlq(e, "\x00", None, "r"), "kind"),
    "bulk move queue a number": (lambda s, e: s.bulk_move_failed_to_dlq(e, None, 5, "r"), "queue"),
    "move reason a number": (lambda s, e: s.move_failed_to_dlq(e, 1, 5), "dlq_reason"),
    "queue option paused a string": (lambda s, e: s.set_queue_options(e, "q", paused="yes"), "paused"),
    "queue option dlq_enabled an int": (lambda s, e: s.set_queue_options(e, "q", dlq_enabled=1), "dlq_enabled"),
}


@pytest.mark.parametrize("case", list(BAD_FILTERS))
def test_filter_or_option_of_the_wrong_type_is_refused(engine: Engine, st: QueueStorage, case: str) -> None:
    call, field = BAD_FILTERS[case]
    refused(lambda: call(st, engine), field)


# -- construction --------------------------------------------------------------------------------


def test_storage_for_a_malformed_schema_name_is_refused_without_a_query(engine: Engine) -> None:
    refused(lambda: QueueStorage.from_existing_schema("a\x00b", engine), "schema")
    refused(lambda: QueueStorage.from_existing_schema('a"b'), "schema")
    refused(lambda: QueueStorage("qstore"), "config")  # type: ignore[arg-type]


BAD_SCHEDULES: dict[str, dict[str, Any]] = {
    "cadence too large for a float": {"queue_ring_every": 10**400},
    "staleness the rescue call refuses": {"heartbeat_staleness": 86400.5},
    "promote batch beyond integer": {"promote_batch_size": 2**31},
    "leader retry a thread cannot wait": {"leader_retry_every": 1e300},
}


@pytest.mark.parametrize("case", list(BAD_SCHEDULES))
def test_schedule_value_the_tasks_cannot_use_is_refused(case: str) -> None:
    (field, value), = BAD_SCHEDULES[case].items()
    refused(lambda: MaintenanceSchedule(**{field: value}), field)


@pytest.mark.parametrize(("field", "kwargs"), [
    ("keep_reports", {"keep_reports": "5"}), ("keep_reports", {"keep_reports": 2.5}),
    ("storage", {"storage": "storage"}), ("schedule", {"schedule": {"rescue_every": 1}}),
])
def test_maintainer_argument_of_the_wrong_type_is_refused(engine: Engine, st: QueueStorage, field: str,
                                                          kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"storage": st, "schedule": None, "keep_reports": 10, **kwargs}
    refused(lambda: Maintainer(args["storage"], engine, args["schedule"], keep_reports=args["keep_reports"]), field)


# -- notification channels ----------------------------------------------------------------------


def test_channel_names_longer_than_postgresql_allows_are_cut_with_a_hash() -> None:
    long_a, long_b = channel_name("qstore", "shop", "a" * 200), channel_name("qstore", "shop", "a" * 199 + "b")
    assert channel_name("qstore", "shop", "mail") == "qstore:shop:mail"
    assert len(long_a.encode()) <= MAX_CHANNEL_BYTES and long_a.startswith("qstore:shop:aaa")
    assert long_a != long_b and long_a == channel_name("qstore", "shop", "a" * 200)
    emoji = channel_name("qstore", "shop", "\U0001f600" * 50)
    assert len(emoji.encode()) <= MAX_CHANNEL_BYTES  # cut on a character boundary: it encodes


@pytest.fixture
def listen(db_url: str) -> Iterator[Callable[[str], psycopg.Connection]]:
    conninfo = make_url(db_url).set(drivername="postgresql").render_as_string(hide_password=False)
    opened: list[psycopg.Connection] = []

    def on(channel: str) -> psycopg.Connection:
        conn = psycopg.connect(conninfo, autocommit=True)
        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        opened.append(conn)
        return conn

    yield on
    for conn in opened:
        conn.close()


def test_enqueue_into_a_200_character_queue_notifies_on_its_shortened_channel(
        engine: Engine, st: QueueStorage, listen: Callable[[str], psycopg.Connection]) -> None:
    queue = "\u00e4" * 200
    lis = listen(st.config.notify_channel(queue))
    assert st.enqueue_params_batch(engine, [job(queue=queue)]) == 1
    assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [st.config.notify_channel(queue)]
    assert st.claim_runtime_batch(engine, queue, 1)[0].job.queue == queue


def test_cancel_notifies_on_a_channel_that_fits_for_the_longest_prefix_and_schema(
        engine: Engine, make_storage: Callable[..., QueueStorage], listen: Callable[[str], psycopg.Connection]) -> None:
    s = make_storage(schema="s" * 48, notify_prefix="p" * 48,
                     queue_slot_count=4, lease_slot_count=2, claim_slot_count=2)
    lis = listen(s.config.cancel_channel)
    c = running(engine, s)
    assert s.cancel_job(engine, c.job.id) is not None
    assert [n.channel for n in lis.notifies(timeout=5, stop_after=1)] == [s.config.cancel_channel]


# -- driver errors ---------------------------------------------------------------------------------


def test_driver_error_inside_copy_is_a_database_error(engine: Engine, st: QueueStorage) -> None:
    with engine.connect() as locker, engine.connect() as conn:
        locker.begin()
        locker.execute(text(f'LOCK TABLE "{st.schema()}".ready_entries IN ACCESS EXCLUSIVE MODE'))
        conn.begin()
        conn.execute(text("SET LOCAL lock_timeout = '200ms'"))
        with pytest.raises(DatabaseError) as info:
            st.enqueue_params_copy(conn, [job()])
        assert info.value.sqlstate == "55P03"  # lock_not_available, raised by psycopg's COPY itself
        conn.rollback()
        locker.rollback()
