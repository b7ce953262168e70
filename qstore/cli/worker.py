"""``python -m qstore worker MODULE:APP``: run the worker of an application's tasks.

``MODULE:APP`` names the :class:`~qstore.tasks.App` object by import path (``APP`` may be
dotted: ``myapp.jobs:registry.app``); the current directory is importable, as it is for
``python -m``. The app's storage decides the schema; a ``--schema`` other than the default
must name the same one. The worker runs until SIGINT / SIGTERM, then shuts down gracefully (a second
signal hurries it). Every refusal is one line on stderr (exit status 1), among them a schema
that is not installed, or that disappears while the worker runs (it then stops by itself).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO

from sqlalchemy import create_engine

from qstore.cli.common import CommandFailed, _engine, _url
from qstore.config import DEFAULT_SCHEMA
from qstore.errors import MissingExtraError, QueueStorageError

__all__ = ["cmd_worker", "load_app", "register"]


def _failed(message: str) -> QueueStorageError:
    return CommandFailed(message)


def load_app(path: str) -> Any:
    """The object ``MODULE:ATTR`` names (the current directory importable first)."""
    from qstore.runtime.tasks import App

    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise _failed(f"invalid app {path!r}: expected MODULE:APP, e.g. myapp.tasks:app")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise _failed(f"cannot import module {module_name!r} of app {path!r}: {err}") from None
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise _failed(f"module {module_name!r} has no attribute {attr!r} (app {path!r})") from None
    if not isinstance(obj, App):
        raise _failed(f"{path!r} is a {type(obj).__name__}, not a qstore.tasks.App")
    return obj


def _serve_metrics(host: str, port: int) -> Callable[[], None]:
    """Start the Prometheus endpoint (see :func:`qstore.runtime.telemetry.serve_prometheus`);
    a missing extra or a port that cannot be bound is one line."""
    from qstore.runtime.telemetry import serve_prometheus

    if not 0 < port < 65536:
        raise _failed(f"invalid --metrics-port={port!r}: expected a TCP port, 1..65535")
    try:
        return serve_prometheus(port, host)
    except MissingExtraError as err:
        raise _failed(str(err)) from None
    except OSError as err:
        raise _failed(f"cannot serve metrics on {host}:{port}: {err.strerror or err}") from None


def worker_settings(args: argparse.Namespace) -> Any:
    """The ``WorkerSettings`` of the parsed ``qstore worker`` options (an option left out keeps
    the settings' default); a bad value raises the settings' ``ValidationError``. The
    command makes an engine for the worker alone, so the worker uses that engine's pool
    (``own_pool=False``) rather than a copy of it."""
    from qstore.runtime.worker import WorkerSettings

    chosen = {name: value for name, value in (("claims_in_flight", args.claims_in_flight),
                                                ("claim_ahead", args.claim_ahead),
                                                ("claim_batch", args.claim_batch)) if value is not None}
    return WorkerSettings(queues=args.queue or None, concurrency=args.concurrency,
                          prefetch=args.prefetch, **chosen,
                          poll_interval=args.poll_interval, heartbeat_interval=args.heartbeat_interval,
                          shutdown_timeout=args.shutdown_timeout, maintain=not args.no_maintain,
                          own_pool=False)


def worker_engine(url: Any, app: Any, settings: Any) -> Any:
    """The engine the command makes for its worker alone: its pool keeps a connection for
    each handler writing an outcome and four more (``concurrency + 4``), and at least as
    many as the worker's own threads use at once (claim cycles of every queue, locks,
    batcher, keeper, outcome writers), with 8 more allowed beyond that."""
    from qstore.runtime.core import worker_inputs
    from qstore.runtime.worker import connection_needs

    needs = connection_needs(app, settings, worker_inputs(app, settings)[1])
    return create_engine(url, pool_size=max(settings.concurrency + 4, needs.most), max_overflow=8)


def cmd_worker(args: argparse.Namespace, out: TextIO) -> int:
    from qstore.runtime.worker import Worker  # the runtime only when a worker runs

    app = load_app(args.app)
    # the shared --schema option defaults to the default schema: a value other than that one
    # must name the app's schema (its storage decides)
    if args.schema not in (DEFAULT_SCHEMA, app.storage.schema()):
        raise _failed(f"--schema {args.schema!r} differs from the schema of app {args.app!r} "
                      f"({app.storage.schema()!r}); leave --schema out")
    settings = worker_settings(args)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    checked = _engine(_url(args, "worker"))  # a bad URL or an unreachable server is one line
    checked.dispose()
    stop_metrics = _serve_metrics(args.metrics_host, args.metrics_port) if args.metrics_port is not None else None
    engine = worker_engine(checked.url, app, settings)
    try:
        worker = Worker(app, engine, settings)
        stats = worker.run()
    finally:
        engine.dispose()
        if stop_metrics is not None:
            stop_metrics()
    print(f"qstore worker stopped: {stats.claimed} claimed, {stats.completed} completed, "
          f"{stats.retried} retried, {stats.failed} failed, {stats.handed_back} handed back",
          file=out, flush=True)
    return 0


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``worker`` subcommand to ``subparsers`` (``common``: the shared options)."""
    p = subparsers.add_parser("worker", parents=[common],
                              help="run the tasks of an application (MODULE:APP) until interrupted")
    p.add_argument("app", metavar="MODULE:APP", help="import path of the qstore.tasks.App object")
    p.add_argument("--queue", action="append", metavar="Q",
                   help="queue to work (repeatable; default: the queues of the app's tasks)")
    p.add_argument("--concurrency", type=int, default=16, help="handlers running at once (default 16)")
    p.add_argument("--claim-batch", type=int, default=None,
                   help="most jobs one claim takes (never more than free places; default: WorkerSettings' "
                        "default, 64)")
    p.add_argument("--prefetch", type=int, default=None,
                   help="claimed jobs that may wait for a free handler (default: --concurrency)")
    p.add_argument("--claims-in-flight", type=int, default=None, metavar="N",
                   help="claims of one queue in flight at once (default: WorkerSettings' default, 2)")
    p.add_argument("--claim-ahead", type=int, default=None, metavar="N",
                   help="most jobs a claim may take beyond concurrency + prefetch while handlers are fast "
                        "(default: --claim-batch, 0 with --prefetch 0; 0 turns it off)")
    p.add_argument("--poll-interval", type=float, default=1.0,
                   help="seconds an idle queue waits before claiming without a notification (default 1)")
    p.add_argument("--heartbeat-interval", type=float, default=30.0,
                   help="seconds between heartbeats of long-running jobs (default 30)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running handlers get to finish on shutdown (default 30)")
    p.add_argument("--no-maintain", action="store_true",
                   help="do not run the maintainer in this process")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (needs the otel extra)")
    p.add_argument("--metrics-host", default="0.0.0.0", metavar="HOST",
                   help="address the metrics endpoint listens on (default 0.0.0.0)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="log level when the app configured no logging (default INFO)")
    p.set_defaults(func=cmd_worker)
