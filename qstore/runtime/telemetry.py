"""Metrics and traces of jobs through OpenTelemetry (the ``otel`` extra); nothing without it.

A :class:`Telemetry` is what the runtime reports to. The base class records nothing and
costs nothing; :class:`OpenTelemetry` records through the OpenTelemetry API, so its figures
go wherever the application's meter and tracer providers send them (or nowhere until the
application configures an SDK, as OpenTelemetry intends for libraries).
:func:`default_telemetry` picks :class:`OpenTelemetry` when ``opentelemetry-api`` is
importable and the no-op otherwise; ``App(storage, telemetry=...)`` overrides it.

What is recorded (instrument names; attributes ``queue`` and ``kind`` on each):

==============================  ===============================================================
``qstore.jobs.enqueued``        jobs deferred through a task of this process
``qstore.jobs.started``         attempts whose handler started
``qstore.jobs.completed``       attempts whose completion was written
``qstore.jobs.retried``         attempts that failed and were scheduled again (``retry_after``
                                too)
``qstore.jobs.failed``          attempts that failed for good (``dlq`` = true when they went to
                                the dead-letter queue)
``qstore.jobs.snoozed``         attempts given back by ``Snooze``
``qstore.jobs.cancelled``       attempts that ended in ``Cancel``
``qstore.job.pickup_latency``   seconds from the moment a job could run (its enqueue, or its
                                ``run_at`` when later) to its handler's start (histogram)
``qstore.job.run_time``         seconds a handler ran (histogram)
``qstore.queue.jobs``           jobs per queue and ``state`` (``available``, ``running``,
                                ``scheduled``), observed when a metric reader collects
                                (gauge; no ``kind``)
==============================  ===============================================================

Traces: deferring a job through a task opens a PRODUCER span ``qstore defer <kind>`` and
stores its W3C trace context in the job's metadata under :data:`TRACE_KEY`; each attempt
runs in a CONSUMER span ``qstore run <kind>`` linked to that producer span (a link, not a
parent: an attempt may run long after, and several attempts share one producer).
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from qstore.errors import MissingExtraError

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from qstore.storage import QueueStorage
    from qstore.types import JobRow

#: The job-metadata key holding the producer span's trace context (``traceparent``,
#: ``tracestate``), written by :meth:`Telemetry.deferring`.
TRACE_KEY = "qstore_trace"

#: The outcomes an attempt ends in, as :meth:`Telemetry.ended` takes them.
OUTCOMES = frozenset({"completed", "retried", "failed", "dlq", "snoozed", "cancelled", "waiting"})


@dataclass(frozen=True)
class QueueGauge:
    """One queue's jobs by state, as the ``qstore.queue.jobs`` gauge reports them."""

    available: int
    running: int
    scheduled: int | None = None  # None: not known to the reader (not reported)


class Attempt:
    """One attempt's record while its handler runs (see :meth:`Telemetry.attempt`)."""

    def failed(self, error: BaseException | str) -> None:
        """The handler raised (or returned a failing outcome): the span says so."""


class Telemetry:
    """Records nothing: every method returns at once. The base of :class:`OpenTelemetry`
    and the runtime's default when OpenTelemetry is not installed."""

    enabled = False

    @property
    def recording(self) -> bool:
        """Whether anything would be recorded now: the runtime skips a job's telemetry
        work (spans, metric points) while this is False."""
        return False

    @contextmanager
    def deferring(self, queue: str, kind: str, metadata: Mapping[str, Any], n: int = 1
                  ) -> Iterator[Mapping[str, Any]]:
        """Around the enqueue of ``n`` jobs of ``kind``: yields the metadata to enqueue them
        with (``metadata`` plus the trace context, when there is one to carry); counts them
        as enqueued when the block exits without an exception."""
        yield metadata

    @contextmanager
    def attempt(self, job: JobRow) -> Iterator[Attempt]:
        """Around one attempt's handler: counts it started, records its pickup latency and
        (at exit) its run time, and runs it in a consumer span linked to its producer."""
        yield Attempt()

    def ended(self, job: JobRow, outcome: str) -> None:
        """The attempt's outcome has been written (one of :data:`OUTCOMES`)."""

    def watch(self, read: Callable[[], Mapping[str, QueueGauge]]) -> Callable[[], None]:
        """Report ``read()`` (per queue) as the ``qstore.queue.jobs`` gauge whenever a
        metric reader collects, until the returned function is called. ``read`` runs on the
        collecting thread; when it raises, that collection reports no figures of it."""
        return _nothing


def _nothing() -> None:
    """What :meth:`Telemetry.watch` returns when nothing is watched."""


def fast_counts(storage: QueueStorage, engine: Engine, queues: Sequence[str]
                ) -> Callable[[], dict[str, QueueGauge]]:
    """A gauge reader for :meth:`Telemetry.watch`: ``available`` and ``running`` of each of
    ``queues`` from ``QueueStorage.queue_counts_fast`` (head-table arithmetic; ``available``
    is its upper bound) and ``scheduled`` from ``QueueStorage.scheduled_count`` (the
    deferred backlog): two statements per queue per collection."""
    def read() -> dict[str, QueueGauge]:
        out = {}
        for queue in queues:
            c = storage.queue_counts_fast(engine, queue)
            out[queue] = QueueGauge(available=c.available, running=c.running,
                                    scheduled=storage.scheduled_count(engine, queue))
        return out

    return read


def otel_installed() -> bool:
    """Whether ``opentelemetry-api`` can be imported (the ``otel`` extra)."""
    return importlib.util.find_spec("opentelemetry") is not None and \
        importlib.util.find_spec("opentelemetry.metrics") is not None


def default_telemetry() -> Telemetry:
    """:class:`OpenTelemetry` over the global providers when the ``otel`` extra is
    installed; the no-op :class:`Telemetry` otherwise."""
    return OpenTelemetry() if otel_installed() else Telemetry()


def _start_time(job: JobRow) -> datetime:
    """When ``job`` could first run: its enqueue, or its ``run_at`` when later."""
    return max(job.created_at, job.run_at)


class _OtelAttempt(Attempt):
    def __init__(self, span: Any) -> None:
        self.span = span

    def failed(self, error: BaseException | str) -> None:
        from opentelemetry.trace import Status, StatusCode

        if isinstance(error, BaseException):
            self.span.record_exception(error)
            self.span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        else:
            self.span.set_status(Status(StatusCode.ERROR, error))


#: How often (seconds) :attr:`OpenTelemetry.recording` looks again whether a global provider
#: was set while it found none.
RECHECK = 1.0


class OpenTelemetry(Telemetry):
    """Records through the OpenTelemetry API (see the module docstring for what).

    ``meter_provider`` / ``tracer_provider`` default to the global ones, looked up once
    here. Raises :class:`~qstore.errors.MissingExtraError` without the ``otel`` extra.
    """

    enabled = True

    def __init__(self, meter_provider: Any = None, tracer_provider: Any = None) -> None:
        if not otel_installed():
            raise MissingExtraError("OpenTelemetry metrics and traces", "otel", "opentelemetry-api")
        from opentelemetry import metrics, trace

        # The API's global providers before an SDK sets its own (proxies that record
        # nothing): while both are still these, nothing records (see ``recording``).
        self._idle = (None if meter_provider is not None else metrics.get_meter_provider(),
                      None if tracer_provider is not None else trace.get_tracer_provider())
        if not isinstance(self._idle[1], trace.ProxyTracerProvider) or \
                type(self._idle[0]).__name__ != "_ProxyMeterProvider":
            self._idle = (None, None)  # a provider is set (or given): it records
        self._recheck_at = 0.0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter("qstore")
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("qstore")
        self._enqueued = meter.create_counter("qstore.jobs.enqueued", unit="{job}",
                                              description="jobs deferred through a task of this process")
        self._started = meter.create_counter("qstore.jobs.started", unit="{attempt}",
                                             description="attempts whose handler started")
        self._outcomes = {
            name: meter.create_counter(f"qstore.jobs.{name}", unit="{attempt}", description=text)
            for name, text in (("completed", "attempts whose completion was written"),
                               ("retried", "attempts that failed and were scheduled again"),
                               ("failed", "attempts that failed for good"),
                               ("snoozed", "attempts given back by Snooze"),
                               ("cancelled", "attempts that ended in Cancel"),
                               ("waiting", "attempts parked on an external callback"))
        }
        self._pickup = meter.create_histogram("qstore.job.pickup_latency", unit="s",
                                              description="from when a job could run to its handler's start")
        self._run_time = meter.create_histogram("qstore.job.run_time", unit="s",
                                                description="how long a handler ran")
        self._readers: list[Callable[[], Mapping[str, QueueGauge]]] = []
        meter.create_observable_gauge("qstore.queue.jobs", callbacks=[self._observe], unit="{job}",
                                      description="jobs per queue and state")

    @property
    def recording(self) -> bool:
        """False while both providers are the OpenTelemetry API's global defaults and no
        SDK has set its own (they would record nothing); True once one is set, or when a
        provider was given. Looked up at most once every ``RECHECK`` seconds (the API's
        lookup reads the environment): a provider set later records from then on."""
        idle_meter, idle_tracer = self._idle
        if idle_meter is None or idle_tracer is None:
            return True
        now = time.monotonic()
        if now < self._recheck_at:
            return False
        from opentelemetry import metrics, trace

        if metrics.get_meter_provider() is not idle_meter or trace.get_tracer_provider() is not idle_tracer:
            self._idle = (None, None)
            return True
        self._recheck_at = now + RECHECK
        return False

    @contextmanager
    def deferring(self, queue: str, kind: str, metadata: Mapping[str, Any], n: int = 1
                  ) -> Iterator[Mapping[str, Any]]:
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        attributes: dict[str, Any] = {"messaging.system": "qstore", "messaging.destination.name": queue,
                                      "messaging.operation.type": "send", "qstore.kind": kind}
        if n != 1:
            attributes["messaging.batch.message_count"] = n
        with self._tracer.start_as_current_span(f"qstore defer {kind}", kind=SpanKind.PRODUCER,
                                                attributes=attributes):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            yield {**metadata, TRACE_KEY: carrier} if carrier else metadata
        self._enqueued.add(n, {"queue": queue, "kind": kind})

    @contextmanager
    def attempt(self, job: JobRow) -> Iterator[Attempt]:
        from opentelemetry import propagate, trace
        from opentelemetry.trace import Link, SpanKind

        labels = {"queue": job.queue, "kind": job.kind}
        self._started.add(1, labels)
        waited = (datetime.now(timezone.utc) - _start_time(job)).total_seconds()
        self._pickup.record(max(0.0, waited), labels)
        links = []
        carried = job.metadata.get(TRACE_KEY) if isinstance(job.metadata, Mapping) else None
        if isinstance(carried, Mapping):
            producer = trace.get_current_span(propagate.extract(carried)).get_span_context()
            if producer.is_valid:
                links.append(Link(producer))
        attributes: dict[str, Any] = {
                      "messaging.system": "qstore", "messaging.destination.name": job.queue,
                      "messaging.operation.type": "process", "messaging.message.id": str(job.id),
                      "qstore.kind": job.kind, "qstore.attempt": job.attempt}
        began = time.monotonic()
        try:
            with self._tracer.start_as_current_span(f"qstore run {job.kind}", kind=SpanKind.CONSUMER,
                                                    links=links, attributes=attributes,
                                                    record_exception=False, set_status_on_exception=False
                                                    ) as span:
                yield _OtelAttempt(span)
        finally:
            self._run_time.record(time.monotonic() - began, labels)

    def ended(self, job: JobRow, outcome: str) -> None:
        labels = {"queue": job.queue, "kind": job.kind}
        if outcome == "dlq":
            self._outcomes["failed"].add(1, {**labels, "dlq": True})
        elif outcome == "failed":
            self._outcomes["failed"].add(1, {**labels, "dlq": False})
        elif outcome in self._outcomes:
            self._outcomes[outcome].add(1, labels)

    def watch(self, read: Callable[[], Mapping[str, QueueGauge]]) -> Callable[[], None]:
        self._readers.append(read)

        def unwatch() -> None:
            with contextlib.suppress(ValueError):
                self._readers.remove(read)

        return unwatch

    def _observe(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        out = []
        for read in list(self._readers):
            try:
                figures = read()
            except Exception:  # a collection without queue figures rather than a broken export
                continue
            for queue, g in figures.items():
                out += [Observation(g.available, {"queue": queue, "state": "available"}),
                        Observation(g.running, {"queue": queue, "state": "running"})]
                if g.scheduled is not None:
                    out.append(Observation(g.scheduled, {"queue": queue, "state": "scheduled"}))
        return out


def serve_prometheus(port: int, host: str = "0.0.0.0") -> Callable[[], None]:
    """Serve the metrics of the global meter provider as Prometheus text at
    ``http://host:port/metrics`` (OpenTelemetry's Prometheus exporter on
    ``prometheus_client``'s HTTP server, in a daemon thread). Installs an SDK
    ``MeterProvider`` holding the Prometheus reader as the global provider, so every
    :class:`OpenTelemetry` made over the global providers reports there (OpenTelemetry
    keeps the first global provider set: an application that set its own keeps it, and
    this server then shows only what reaches the default registry). Returns a function that
    stops the server. Raises :class:`~qstore.errors.MissingExtraError` without the ``otel``
    extra and ``OSError`` when the port cannot be bound."""
    try:
        from opentelemetry import metrics
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import start_http_server
    except ImportError:
        raise MissingExtraError("Prometheus metrics (--metrics-port)", "otel", "opentelemetry-exporter-prometheus") from None
    server, thread = start_http_server(port, addr=host)
    metrics.set_meter_provider(MeterProvider(metric_readers=[PrometheusMetricReader()]))

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
