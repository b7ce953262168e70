"""Telemetry: counters, histograms, the queue gauge and linked spans through OpenTelemetry,
read back with the SDK's in-memory readers; nothing recorded and nothing added to a job
without it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from qstore.errors import ValidationError
from qstore.runtime.telemetry import (
    TRACE_KEY,
    OpenTelemetry,
    QueueGauge,
    Telemetry,
    default_telemetry,
)
from qstore.tasks import App, JobContext


@dataclass
class Recorded:
    telemetry: OpenTelemetry
    metrics: InMemoryMetricReader
    spans: InMemorySpanExporter

    def points(self, name: str) -> dict[tuple[tuple[str, Any], ...], Any]:
        """The data points of instrument ``name`` by their sorted attributes."""
        data = self.metrics.get_metrics_data()
        out: dict[tuple[tuple[str, Any], ...], Any] = {}
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        for p in metric.data.data_points:
                            out[tuple(sorted(p.attributes.items()))] = p
        return out

    def value(self, name: str, **attributes: Any) -> Any:
        point = self.points(name).get(tuple(sorted(attributes.items())))
        return None if point is None else getattr(point, "value", None)


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    metrics = InMemoryMetricReader()
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    meter_provider = MeterProvider(metric_readers=[metrics])
    yield Recorded(OpenTelemetry(meter_provider=meter_provider, tracer_provider=tracer_provider), metrics, spans)
    meter_provider.shutdown()
    tracer_provider.shutdown()


@pytest.fixture
def app(st, recorded):  # type: ignore[no-untyped-def]
    return App(st, telemetry=recorded.telemetry)


def test_the_default_telemetry_is_opentelemetry_when_the_extra_is_installed():
    assert isinstance(default_telemetry(), OpenTelemetry)


def test_an_app_refuses_a_telemetry_that_is_not_one(st):  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="telemetry"):
        App(st, telemetry=object())  # type: ignore[arg-type]


def test_a_deferred_job_carries_its_producer_spans_trace_context(app, recorded, st, engine):  # type: ignore[no-untyped-def]
    @app.task(kind="send", queue="mail")
    def send(ctx: JobContext, to: str) -> None: ...

    send.defer(engine, to="a")
    [producer] = recorded.spans.get_finished_spans()
    assert producer.name == "qstore defer send" and producer.kind is SpanKind.PRODUCER
    job = st.claim_runtime_batch(engine, "mail", 1)[0].job
    carried = job.metadata[TRACE_KEY]
    assert f"{producer.context.trace_id:032x}-{producer.context.span_id:016x}" in carried["traceparent"]
    assert recorded.value("qstore.jobs.enqueued", queue="mail", kind="send") == 1


def test_defer_many_is_one_producer_span_counting_every_job(app, recorded, st, engine):  # type: ignore[no-untyped-def]
    @app.task(kind="send", queue="mail")
    def send(ctx: JobContext, to: str) -> None: ...

    send.configure(metadata={"tenant": 7}).defer_many(engine, [{"to": "a"}, {"to": "b"}, {"to": "c"}])
    [producer] = recorded.spans.get_finished_spans()
    assert producer.attributes["messaging.batch.message_count"] == 3
    jobs = [c.job for c in st.claim_runtime_batch(engine, "mail", 10)]
    assert len(jobs) == 3 and all(j.metadata["tenant"] == 7 and TRACE_KEY in j.metadata for j in jobs)
    assert recorded.value("qstore.jobs.enqueued", queue="mail", kind="send") == 3


def test_a_defer_that_raises_counts_nothing(app, recorded, engine):  # type: ignore[no-untyped-def]
    @app.task(kind="send", queue="mail")
    def send(ctx: JobContext, to: str) -> None: ...

    with pytest.raises(ValidationError):
        send.defer_many(engine, [{"to": "a"}, "not a mapping"])  # type: ignore[list-item]
    assert recorded.value("qstore.jobs.enqueued", queue="mail", kind="send") is None


def test_without_telemetry_a_job_gets_no_trace_context(st, engine):  # type: ignore[no-untyped-def]
    app = App(st, telemetry=Telemetry())

    @app.task(kind="send", queue="mail")
    def send(ctx: JobContext, to: str) -> None: ...

    send.configure(metadata={"tenant": 7}).defer(engine, to="a")
    assert st.claim_runtime_batch(engine, "mail", 1)[0].job.metadata == {"tenant": 7}


def test_an_attempt_is_a_consumer_span_linked_to_its_producer(app, recorded, st, engine):  # type: ignore[no-untyped-def]
    @app.task(kind="send", queue="mail")
    def send(ctx: JobContext, to: str) -> None: ...

    send.defer(engine, to="a")
    job = st.claim_runtime_batch(engine, "mail", 1)[0].job
    with recorded.telemetry.attempt(job) as attempt:
        attempt.failed(RuntimeError("boom"))
    producer, consumer = recorded.spans.get_finished_spans()
    assert consumer.name == "qstore run send" and consumer.kind is SpanKind.CONSUMER
    assert [link.context.span_id for link in consumer.links] == [producer.context.span_id]
    assert consumer.parent is None  # a link, not a parent
    assert consumer.status.status_code is StatusCode.ERROR and "boom" in (consumer.status.description or "")
    assert consumer.attributes["messaging.message.id"] == str(job.id)
    assert recorded.value("qstore.jobs.started", queue="mail", kind="send") == 1
    pickup = recorded.points("qstore.job.pickup_latency")[(("kind", "send"), ("queue", "mail"))]
    run_time = recorded.points("qstore.job.run_time")[(("kind", "send"), ("queue", "mail"))]
    assert pickup.count == 1 and run_time.count == 1 and pickup.sum >= 0


def test_outcomes_are_counted_by_name_and_dlq_is_a_failure_marked_as_such(recorded, st, engine):  # type: ignore[no-untyped-def]
    st.enqueue(engine, _params("send", "mail"))
    job = st.claim_runtime_batch(engine, "mail", 1)[0].job
    for outcome in ("completed", "completed", "retried", "failed", "dlq", "snoozed", "cancelled", "waiting"):
        recorded.telemetry.ended(job, outcome)
    assert recorded.value("qstore.jobs.completed", queue="mail", kind="send") == 2
    assert recorded.value("qstore.jobs.retried", queue="mail", kind="send") == 1
    assert recorded.value("qstore.jobs.failed", queue="mail", kind="send", dlq=False) == 1
    assert recorded.value("qstore.jobs.failed", queue="mail", kind="send", dlq=True) == 1
    assert recorded.value("qstore.jobs.snoozed", queue="mail", kind="send") == 1
    assert recorded.value("qstore.jobs.cancelled", queue="mail", kind="send") == 1
    assert recorded.value("qstore.jobs.waiting", queue="mail", kind="send") == 1


def test_the_queue_gauge_reports_what_the_reader_returns_and_survives_a_failing_read(recorded):  # type: ignore[no-untyped-def]
    def broken() -> dict[str, QueueGauge]:
        raise RuntimeError("database down")

    recorded.telemetry.watch(broken)
    recorded.telemetry.watch(lambda: {"mail": QueueGauge(available=3, running=2, scheduled=1)})
    assert recorded.value("qstore.queue.jobs", queue="mail", state="available") == 3
    assert recorded.value("qstore.queue.jobs", queue="mail", state="running") == 2
    assert recorded.value("qstore.queue.jobs", queue="mail", state="scheduled") == 1


def _params(kind: str, queue: str):  # type: ignore[no-untyped-def]
    from qstore import InsertOpts, InsertParams

    return InsertParams(kind, {}, InsertOpts(queue=queue))


# -- through the workers ---------------------------------------------------------------------------


def _outcome_app(st, recorded):  # type: ignore[no-untyped-def]
    from qstore.tasks import Fail, Snooze

    app = App(st, telemetry=recorded.telemetry)
    snoozed: set[int] = set()

    @app.task(kind="ok", queue="work")
    def ok(ctx: JobContext) -> None: ...

    @app.task(kind="boom", queue="work", max_attempts=1)
    def boom(ctx: JobContext) -> None:
        raise RuntimeError("boom")

    @app.task(kind="snooze", queue="work")
    def snooze(ctx: JobContext) -> Snooze | None:
        if ctx.job_id in snoozed:
            return None  # completed when it runs again
        snoozed.add(ctx.job_id)
        return Snooze(0)

    @app.task(kind="fail", queue="work")
    def fail(ctx: JobContext) -> None:
        raise Fail("no")

    return app, (ok, boom, snooze, fail)


def _wait_terminal(st, engine, ids, timeout=20.0):  # type: ignore[no-untyped-def]
    import time

    from qstore.types import JobState

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        states = [st.load_job(engine, i).state for i in ids]
        if all(s in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED) for s in states):
            return states
        time.sleep(0.1)
    raise AssertionError(f"not terminal: {states}")


def _assert_worker_telemetry(recorded: Recorded, st, engine, ids) -> None:  # type: ignore[no-untyped-def]
    _wait_terminal(st, engine, ids)
    import time

    for _ in range(50):  # the completion is counted once its batch committed
        if recorded.value("qstore.jobs.completed", queue="work", kind="ok") == 1 and \
                recorded.value("qstore.jobs.completed", queue="work", kind="snooze") == 1:
            break
        time.sleep(0.1)
    assert recorded.value("qstore.jobs.completed", queue="work", kind="ok") == 1
    assert recorded.value("qstore.jobs.failed", queue="work", kind="boom", dlq=False) == 1
    assert recorded.value("qstore.jobs.failed", queue="work", kind="fail", dlq=False) == 1
    assert recorded.value("qstore.jobs.snoozed", queue="work", kind="snooze") == 1
    assert recorded.value("qstore.jobs.completed", queue="work", kind="snooze") == 1
    assert recorded.value("qstore.jobs.started", queue="work", kind="snooze") == 2
    spans = recorded.spans.get_finished_spans()
    producers = {s.context.span_id: s for s in spans if s.kind is SpanKind.PRODUCER}
    consumers = [s for s in spans if s.kind is SpanKind.CONSUMER]
    assert len(consumers) == 5 and all(len(c.links) == 1 and c.links[0].context.span_id in producers
                                       for c in consumers)
    failed = {c.name for c in consumers if c.status.status_code is StatusCode.ERROR}
    assert failed == {"qstore run boom", "qstore run fail"}
    gauge = recorded.points("qstore.queue.jobs")
    assert {dict(k)["state"] for k in gauge} == {"available", "running", "scheduled"}


def test_a_thread_worker_records_starts_outcomes_and_linked_spans(st, engine, recorded):  # type: ignore[no-untyped-def]
    from qstore.worker import Worker, WorkerSettings

    app, tasks = _outcome_app(st, recorded)
    ids = [t.defer(engine) for t in tasks]
    w = Worker(app, engine, WorkerSettings(concurrency=2, poll_interval=0.1, maintain=True))
    w.start()
    try:
        _assert_worker_telemetry(recorded, st, engine, ids)
        assert recorded.points("qstore.queue.jobs")  # the worker's queues, while it runs
    finally:
        w.stop()


def test_an_async_worker_records_starts_outcomes_and_linked_spans(st, engine, db_url, recorded):  # type: ignore[no-untyped-def]
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from qstore.worker import AsyncWorker, WorkerSettings

    app, tasks = _outcome_app(st, recorded)
    ids = [t.defer(engine) for t in tasks]

    async def main() -> None:
        aengine = create_async_engine(db_url)
        try:
            async with AsyncWorker(app, aengine, WorkerSettings(concurrency=2, poll_interval=0.1, maintain=True)):
                await asyncio.to_thread(_assert_worker_telemetry, recorded, st, engine, ids)
        finally:
            await aengine.dispose()

    asyncio.run(main())


METRICS_APP = '''
import os
from qstore import QueueStorage, QueueStorageConfig
from qstore.tasks import App, JobContext

app = App(QueueStorage(QueueStorageConfig(schema=os.environ["QSTORE_TEST_SCHEMA"])))


@app.task(kind="ping", queue="metrics")
def ping(ctx: JobContext) -> None:
    pass
'''


COMPLETED_PING = re.compile(r'qstore_jobs_completed_total\{kind="ping",[^}]*queue="metrics"\} 1\.0')


@pytest.mark.slow
def test_the_worker_command_serves_prometheus_metrics(tmp_path, engine, db_url, make_storage):  # type: ignore[no-untyped-def]
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    from installs import unique_schema

    from qstore import InsertOpts, InsertParams

    st = make_storage(schema=unique_schema())
    (tmp_path / "metrics_app.py").write_text(METRICS_APP)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "QSTORE_TEST_SCHEMA": st.schema(),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "qstore", "worker", "metrics_app:app", "--url", db_url,
                             "--metrics-port", str(port), "--metrics-host", "127.0.0.1", "--poll-interval", "0.2"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        st.enqueue(engine, InsertParams("ping", {}, InsertOpts(queue="metrics")))
        text = ""
        for _ in range(100):
            time.sleep(0.2)
            assert proc.poll() is None, proc.communicate()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                continue
            if COMPLETED_PING.search(text):
                break
        assert COMPLETED_PING.search(text), text[-3000:]
        assert re.search(r'qstore_queue_jobs\{[^}]*queue="metrics",state="available"\}', text), text[-3000:]
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def test_the_worker_command_refuses_a_bad_metrics_port_in_one_line(tmp_path, db_url, st):  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    (tmp_path / "metrics_app.py").write_text(METRICS_APP)
    import os

    proc = subprocess.run([sys.executable, "-m", "qstore", "worker", "metrics_app:app", "--url", db_url,
                           "--metrics-port", "70000"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "QSTORE_TEST_SCHEMA": st.schema()}, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "--metrics-port=70000" in proc.stderr


# -- nothing to record ----------------------------------------------------------------------------


def test_over_the_apis_global_default_providers_nothing_records():
    from opentelemetry import metrics, trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) or \
            type(metrics.get_meter_provider()).__name__ != "_ProxyMeterProvider":
        pytest.skip("this process has set a global OpenTelemetry provider")
    assert OpenTelemetry().recording is False


def test_with_providers_given_telemetry_records(recorded):
    assert recorded.telemetry.recording is True
