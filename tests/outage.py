"""A database outage on demand, without touching the shared server: a TCP proxy.

:class:`OutageProxy` listens on ``127.0.0.1:<a free port>`` and forwards every connection to
the test server (``127.0.0.1:5432`` by default). Point an engine at :attr:`OutageProxy.port`
(:meth:`OutageProxy.url`) and the code under test sees the server through it:

* :meth:`OutageProxy.cut` closes every open connection (the client reads end-of-file, as
  when the server goes away) and stops listening, so new connections are refused;
* :meth:`OutageProxy.restore` listens again on the same port.

Threads: one accepts, two per connection copy bytes each way. ``cut`` shuts the sockets down,
which wakes the threads blocked on them.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from types import TracebackType

from sqlalchemy import make_url

__all__ = ["OutageProxy"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class OutageProxy:
    """Forwards ``127.0.0.1:port`` to ``target_host:target_port`` until :meth:`cut`."""

    def __init__(self, target_host: str = "127.0.0.1", target_port: int = 5432) -> None:
        self.target = (target_host, target_port)
        self.port = _free_port()
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.accepted = 0  # connections forwarded so far

    # -- control -------------------------------------------------------------------------------
    def url(self, database_url: str) -> str:
        """``database_url`` with its host and port replaced by the proxy's."""
        return make_url(database_url).set(host="127.0.0.1", port=self.port).render_as_string(
            hide_password=False)

    @property
    def up(self) -> bool:
        return self._listener is not None

    def restore(self) -> None:
        """Accept connections (again), on the same port."""
        with self._lock:
            if self._listener is not None:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(64)
            self._listener = listener
        self._spawn(self._accept, listener)

    start = restore

    def cut(self) -> None:
        """Close every forwarded connection and refuse new ones until :meth:`restore`."""
        with self._lock:
            listener, self._listener = self._listener, None
            sockets, self._sockets = self._sockets, set()
        if listener is not None:
            _close(listener)
        for s in sockets:
            _close(s)
        self._join()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> OutageProxy:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """Cut for the duration of the block."""
        self.cut()
        try:
            yield
        finally:
            self.restore()

    # -- threads -------------------------------------------------------------------------------
    def _spawn(self, target: object, *args: object) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="outage-proxy")  # type: ignore[arg-type]
        t.start()
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)

    def _join(self) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            if t is not threading.current_thread():
                t.join(5)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # cut: the listening socket was closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                if self._listener is not listener:  # cut while this one was being accepted
                    keep = False
                else:
                    keep = True
                    self._sockets.update((client, upstream))
                    self.accepted += 1
            if not keep:
                _close(client)
                _close(upstream)
                continue
            self._spawn(self._pump, client, upstream)
            self._spawn(self._pump, upstream, client)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)
            _close(src)
            _close(dst)
