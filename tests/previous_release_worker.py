"""Runs with the *previous release* of qstore on ``sys.path`` (see
``tests/data/previous_release``), in a subprocess of the upgrade tests. It uses only that
release's public API.

``states SPEC``: for each ``{"url", "schema", "general"}`` of the JSON list ``SPEC``, write
one job in every state and print the JSON list of manifests
``{name: {"id", "run_lease", "state", "callback_id"}}``. ``general`` completes through the
general path only (revisions before 0003 lack the fast completion function that release
calls).

``work URL SCHEMA``: act as a worker of that release against whatever revision the schema is
at now: enqueue, claim, complete (fast path and by id), heartbeat, retry, fail; print what
each call returned.

``history URL SCHEMA IDS``: look ended jobs up by id as that release does (``IDS`` a JSON
object ``{"completed", "failed", "cancelled_running", "cancelled_scheduled"}`` of job ids):
``load_job`` of each, then ``move_failed_to_dlq`` of the failed one and ``retry_job`` of
the two cancelled ones; print the states each call showed.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime, timedelta, timezone

from sqlalchemy import create_engine, text

from qstore import QueueStorage
from qstore.storage.jobs import InsertOpts, InsertParams, UniqueOpts

Q = "upgrade"


def job(st: QueueStorage, engine, name: str, **opts: object) -> int:  # type: ignore[no-untyped-def]
    st.enqueue_params_batch(engine, [InsertParams(
        "k", {"name": name}, InsertOpts(queue=Q, metadata={"name": name}, tags=["t"], **opts))])
    with engine.connect() as c:
        # the id just handed out: the job may be a ready row, an overflow row or (from
        # revision 0011 on) a wheel entry
        return int(c.execute(text(f'SELECT last_value FROM "{st.schema()}".job_id_seq')).scalar_one())


def claimed(st: QueueStorage, engine, name: str, **opts: object):  # type: ignore[no-untyped-def]
    job(st, engine, name, **opts)
    (c,) = st.claim_runtime_batch(engine, Q, 1)
    assert c.job.args == {"name": name}, c.job.args
    return c


def states(url: str, schema: str, general: bool) -> dict[str, dict[str, object]]:
    engine = create_engine(url)
    st = QueueStorage.from_existing_schema(schema, engine)
    out: dict[str, dict[str, object]] = {}

    def note(name: str, job_id: int, run_lease: int, callback_id: object = None) -> None:
        row = st.load_job(engine, job_id)
        out[name] = {"id": job_id, "run_lease": run_lease, "state": row.state.value if row else None,
                     "callback_id": str(callback_id) if callback_id else None}

    # claims take the lowest lane position first, so each claimed job is created right before
    # its claim and the unclaimed ones come last
    c = claimed(st, engine, "running")
    note("running", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "heartbeated")
    st.heartbeat_batch(engine, [(c.job.id, c.job.run_lease)])
    note("heartbeated", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "leased")
    st.register_callback(engine, c.job.id, c.job.run_lease, 3600)
    note("leased", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "waiting")
    token = st.register_callback(engine, c.job.id, c.job.run_lease, 3600)
    assert st.enter_callback_wait(engine, c.job.id, c.job.run_lease, token)
    note("waiting", c.job.id, c.job.run_lease, token)
    c = claimed(st, engine, "retryable")
    st.retry_after(engine, c.job.id, c.job.run_lease, 3600)
    note("retryable", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "completed")
    if general:
        st.complete_job_batch_by_id(engine, [(c.job.id, c.job.run_lease)])
    else:
        st.complete_runtime_batch(engine, [c])
    note("completed", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "completed_by_id")
    st.complete_job_batch_by_id(engine, [(c.job.id, c.job.run_lease)])
    note("completed_by_id", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "failed")
    st.fail_terminal(engine, c.job.id, c.job.run_lease, "boom")
    note("failed", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "cancelled")
    st.cancel_running(engine, c.job.id, c.job.run_lease, "stop")
    note("cancelled", c.job.id, c.job.run_lease)
    c = claimed(st, engine, "dlq")
    st.fail_to_dlq(engine, c.job.id, c.job.run_lease, "bad", "boom")
    note("dlq", c.job.id, c.job.run_lease)
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    note("scheduled", job(st, engine, "scheduled", run_at=later), 0)
    note("unique", job(st, engine, "unique", unique=UniqueOpts()), 0)
    note("available", job(st, engine, "available"), 0)
    engine.dispose()
    return out


def work(url: str, schema: str) -> dict[str, object]:
    engine = create_engine(url)
    st = QueueStorage.from_existing_schema(schema, engine)
    q = "old_worker"
    st.enqueue_params_batch(engine, [InsertParams("k", {"n": i}, InsertOpts(queue=q, metadata={"by": "old"}))
                                     for i in range(4)])
    jobs = st.claim_runtime_batch(engine, q, 4)
    fast = st.complete_runtime_batch(engine, jobs[:2])
    by_id = st.complete_job_batch_by_id(engine, [(j.job.id, j.job.run_lease) for j in jobs[2:3]])
    beats = st.heartbeat_batch(engine, [(jobs[3].job.id, jobs[3].job.run_lease)])
    retried = st.retry_after(engine, jobs[3].job.id, jobs[3].job.run_lease, 3600)
    out = {"claimed": [j.job.id for j in jobs], "fast": fast, "by_id": by_id, "beats": beats,
           "retried": retried.state.value if retried else None,
           "counts": list(st.queue_counts(engine, q).__dict__.values())}
    engine.dispose()
    return out


def history(url: str, schema: str, ids: dict[str, int]) -> dict[str, object]:
    engine = create_engine(url)
    st = QueueStorage.from_existing_schema(schema, engine)

    def state(row: object) -> object:
        return row.state.value if row is not None else None  # type: ignore[attr-defined]

    out: dict[str, object] = {f"load_{name}": state(st.load_job(engine, job_id)) for name, job_id in ids.items()}
    out["dlq_failed"] = state(st.move_failed_to_dlq(engine, ids["failed"], "old"))
    out["retry_cancelled_running"] = state(st.retry_job(engine, ids["cancelled_running"]))
    out["retry_cancelled_scheduled"] = state(st.retry_job(engine, ids["cancelled_scheduled"]))
    engine.dispose()
    return out


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "states":
        print(json.dumps([states(x["url"], x["schema"], x["general"]) for x in json.loads(rest[0])]))
    elif command == "work":
        print(json.dumps(work(rest[0], rest[1])))
    elif command == "history":
        print(json.dumps(history(rest[0], rest[1], json.loads(rest[2]))))
    else:
        raise SystemExit(f"unknown command {command}")
