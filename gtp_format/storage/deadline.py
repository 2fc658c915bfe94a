"""A whole request's deadline for the storage package's own small HTTP clients (the bounded listing reader
and the credential services).

A socket's timeout bounds each receive, not a request: an endpoint that sent its status line and headers a
byte per receive, each within the timeout, held the command for as long as it liked (``http.client`` reads up
to 100 header lines of 64 KiB each before any body). A :class:`Deadline` shuts down the connections its
request opened once its time is up, from a timer thread; the receive blocked on them then fails, and the
caller, seeing :attr:`Deadline.passed`, reports the lateness in its own words. ``shutdown`` rather than
``close``: the descriptor stays the reading thread's to close, so it can never be reused under it.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from typing import Any


class Deadline:
    """``with Deadline(seconds) as d``: every connection :func:`watched_opener`'s handlers open for a request that
    carries ``d`` (``request.deadline = d``) is shut down ``seconds`` after the ``with`` began."""

    def __init__(self, seconds: float) -> None:
        self.passed = False
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._timer = threading.Timer(max(seconds, 0.0), self._fire)
        self._timer.daemon = True

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def watch(self, sock: socket.socket) -> None:
        """Shut ``sock`` down when the deadline passes (at once where it has)."""
        with self._lock:
            if not self.passed:
                self._socks.append(sock)
                return
        _shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.passed = True
            socks, self._socks = self._socks, []
        for sock in socks:
            _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown, under a TLS one too: the reading thread's SSL object stays intact
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by its reader


class _Watched:
    """A handler mixin: the connection of a request that carries a :class:`Deadline` is watched by it."""

    def do_open(self, http_class: Any, req: Any, **kwargs: Any) -> Any:
        deadline = getattr(req, "deadline", None)
        if deadline is None:
            return super().do_open(http_class, req, **kwargs)  # type: ignore[misc]

        def connection(host: str, **kw: Any) -> Any:
            conn = http_class(host, **kw)
            connect = conn.connect

            def watched() -> None:
                connect()
                deadline.watch(conn.sock)

            conn.connect = watched
            return conn

        return super().do_open(connection, req, **kwargs)  # type: ignore[misc]


class _HTTPHandler(_Watched, urllib.request.HTTPHandler):
    pass


class _HTTPSHandler(_Watched, urllib.request.HTTPSHandler):
    pass


def watched_opener(*handlers: urllib.request.BaseHandler) -> urllib.request.OpenerDirector:
    """``urllib.request.build_opener(*handlers)`` whose HTTP and HTTPS connections honour a request's
    ``deadline`` (:class:`Deadline`)."""
    return urllib.request.build_opener(_HTTPHandler, _HTTPSHandler, *handlers)
