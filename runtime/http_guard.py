"""Connection-level protection of ``quantpipe serve``: a flood of slow clients must neither
exhaust the process's file descriptors nor keep ``/health`` from answering (issue #29).

uvicorn's h11 protocol never times out request headers that arrive slowly (its keep-alive
timer is cancelled by any byte) and its ``limit_concurrency`` only answers 503 once a whole
request has arrived, so 1,000 clients sending a header byte per second hold 1,000 descriptors
for ever. Here:

* :class:`GuardedH11Protocol` closes a connection whose request headers have not all arrived
  ``header_timeout`` seconds after it opened, or after its previous response (Apache's
  ``mod_reqtimeout``, nginx's ``client_header_timeout``);
* at most ``max_connections`` connections are open: one more closes (``EVICT_DELAY`` later,
  once requests already sent have been read; at once beyond one more accept batch) the oldest
  connection still waiting for its headers (nginx reuses idle connections the same way), so a
  new client, such as a health check, always gets in; if every connection is busy with a
  request it gets 503;
* :func:`raise_fd_limit` raises the soft ``RLIMIT_NOFILE`` to the hard limit at start, and
  :func:`connection_cap` keeps ``max_connections`` below it, leaving room for the descriptors
  the process already holds and for connections accepted before the cap closes them;
* :func:`accept_error_handler` turns asyncio's traceback per failed ``accept()`` (EMFILE) into
  one warning line per ``LOG_EVERY`` seconds with a count.

Everything that is closed is counted and logged as one summary line per ``LOG_EVERY`` seconds:
a flood never floods the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOG_EVERY = 10.0  # seconds between two summary lines (closed connections, accept errors)
EVICT_DELAY = 0.05  # seconds from a connection over the cap to the eviction it causes
ACCEPT_BATCH = 32  # asyncio accepts up to this many connections per loop pass
LISTEN_QUEUE = 2048  # connections the kernel queues before accept() (uvicorn's default backlog)
FD_HEADROOM = 64  # descriptors kept free beyond those open at start (files, pipes, the log)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int  # open client connections at most
    header_timeout: float  # seconds for a request's headers to arrive; then the connection closes

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if not 0 < self.header_timeout <= 3600:
            raise ValueError(f"--header-timeout must be in (0, 3600] seconds, got "
                             f"{self.header_timeout}")


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (as Go's runtime does); (soft, hard)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. macOS refuses RLIM_INFINITY
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, hard, exc)
    unlimited = 2**31  # RLIM_INFINITY (-1 on Linux) as a number the cap arithmetic can use
    soft, hard = (unlimited if v == resource.RLIM_INFINITY else v for v in (soft, hard))
    return soft, hard


def open_fds() -> int:
    import psutil

    return psutil.Process().num_fds()


def connection_cap(requested: int, fd_limit: int, fds_open: int) -> int:
    """``requested``, lowered so that connections can never use up the descriptors.

    Reserved: those open now, ``FD_HEADROOM``, and three accept batches: one of connections
    over the cap waiting ``EVICT_DELAY`` for their eviction, one accepted before any of its
    connections reaches the protocol that closes those over the cap, and one closed whose
    descriptors asyncio releases a loop pass later.
    """
    reserve = FD_HEADROOM + 3 * ACCEPT_BATCH
    room = fd_limit - fds_open - reserve
    if room < 16:
        raise ValueError(f"the open-file limit ({fd_limit}) leaves room for {max(room, 0)} "
                         f"connections ({fds_open} descriptors open, {reserve} kept in reserve); "
                         "raise it (ulimit -n) and start again")
    if requested > room:
        log.warning("--max-connections %d lowered to %d to fit the open-file limit of %d "
                    "(raise it with ulimit -n)", requested, room, fd_limit)
    return min(requested, room)


def widen_listen_queue(listening: list) -> None:
    """Let the kernel queue ``LISTEN_QUEUE`` connections on sockets asyncio listens on.

    asyncio uses one ``backlog`` both for ``listen()`` and for the accepts per loop pass; the
    latter must stay small (``ACCEPT_BATCH``: descriptors are taken before the cap can close
    them), but a queue that small overflows when a flood of reconnecting clients meets a busy
    loop, and the kernel then drops new connections, a health check's too (its retry comes a
    second later). ``listen()`` again on a listening socket only resizes its queue.
    """
    for sock in listening:  # asyncio's TransportSocket wrappers: listen on a duplicate
        with socket.socket(fileno=os.dup(sock.fileno())) as dup:
            dup.listen(LISTEN_QUEUE)


class _Summary:
    """Counts of events, logged as one warning line at most every ``LOG_EVERY`` seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, describe) -> None:
        self.loop, self.describe = loop, describe
        self.counts: Counter[str] = Counter()
        self.total: Counter[str] = Counter()  # since start (tests, and the final picture)
        self.scheduled = False

    def note(self, what: str) -> None:
        self.counts[what] += 1
        self.total[what] += 1
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_later(LOG_EVERY, self.flush)

    def flush(self) -> None:
        self.scheduled = False
        if self.counts:
            log.warning("%s", self.describe(self.counts))
            self.counts = Counter()


class ConnectionGuard:
    """What the connections of one server share: the limits, who waits for headers, counts."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        # connections waiting for request headers, oldest first (dicts keep insertion order)
        self.waiting: dict[GuardedH11Protocol, asyncio.TimerHandle] = {}
        self.summary: _Summary | None = None

    def note(self, what: str) -> None:
        if self.summary is None:
            self.summary = _Summary(asyncio.get_running_loop(), self._describe)
        self.summary.note(what)

    def _describe(self, counts: Counter[str]) -> str:
        lim = self.limits
        parts = {"header_timeout": f"{counts['header_timeout']} whose request headers did not "
                                   f"arrive within {lim.header_timeout:g} s (--header-timeout)",
                 "evicted": f"{counts['evicted']} waiting for headers, to admit newer ones at "
                            f"the {lim.max_connections}-connection cap (--max-connections)",
                 "refused": f"{counts['refused']} new ones with 503: every connection busy"}
        said = [text for key, text in parts.items() if counts[key]]
        return f"closed client connections in the last {LOG_EVERY:g} s: " + "; ".join(said)

    def flush(self) -> None:
        """Log the counts not yet logged (at shutdown)."""
        if self.summary is not None:
            self.summary.flush()

    def protocol_class(self) -> type[GuardedH11Protocol]:
        """The uvicorn ``http`` protocol class of a server guarded by this object."""
        return type("GuardedH11", (GuardedH11Protocol,), {"guard": self})


_REFUSED = json.dumps({"error": {
    "message": "server at its connection limit (--max-connections) with every connection busy; "
               "retry shortly", "type": "server_error", "param": None, "code": 503}}).encode()


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a connection cap (module docstring).

    A connection *waits for headers* while both sides of h11's request cycle are IDLE: from
    when it opens, and again after each response, until the next request's headers are in.
    """

    guard: ConnectionGuard  # set by ConnectionGuard.protocol_class

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guard.limits.max_connections:
            if not self.guard.waiting:
                self._refuse()
                return
            if len(self.connections) > self.guard.limits.max_connections + ACCEPT_BATCH:
                # The hard ceiling: descriptors beyond it are not reserved (connection_cap), and
                # asyncio stops accepting for a whole second after one EMFILE.
                self._enforce_cap()
            else:
                # Evict a moment later, not now: a flood's connections are accepted in bursts
                # before the loop reads any of them, so the oldest one waiting may be a client
                # whose request already sits in its socket buffer (a health check accepted just
                # before the burst); EVICT_DELAY lets its headers be read first.
                self.loop.call_later(EVICT_DELAY, self._enforce_cap)
        self._track()

    def _enforce_cap(self) -> None:
        if len(self.connections) > self.guard.limits.max_connections:
            oldest = next(iter(self.guard.waiting), None)
            if oldest is not None:
                oldest._close_waiting("evicted")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._untrack()
        super().connection_lost(exc)

    def _track(self) -> None:
        """Start or stop this connection's header deadline from h11's state."""
        between_requests = (self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                            and not self.transport.is_closing())
        waiting = self in self.guard.waiting
        if between_requests and not waiting:
            self.guard.waiting[self] = self.loop.call_later(
                self.guard.limits.header_timeout, self._close_waiting, "header_timeout")
        elif waiting and not between_requests:
            self._untrack()

    def _untrack(self) -> None:
        timer = self.guard.waiting.pop(self, None)
        if timer is not None:
            timer.cancel()

    def _close_waiting(self, why: str) -> None:
        self._untrack()
        self.guard.note(why)
        self.transport.close()

    def _refuse(self) -> None:
        self.guard.note("refused")
        head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                b"connection: close\r\nretry-after: 1\r\ncontent-length: "
                + str(len(_REFUSED)).encode() + b"\r\n\r\n")
        self.transport.write(head + _REFUSED)
        self.transport.close()


def accept_error_handler(loop: asyncio.AbstractEventLoop):
    """An asyncio exception handler that summarises failed ``accept()`` calls (EMFILE, ...).

    asyncio logs each one with its traceback and retries a second later; under a connection
    flood that is a traceback a second at best. Anything else goes to asyncio's own handler.
    """
    summary = _Summary(loop, lambda c: (
        f"could not accept {c['accept']} connections in the last {LOG_EVERY:g} s "
        f"({last['error']}); raise the open-file limit (ulimit -n) or lower --max-connections"))
    last: dict[str, Any] = {}

    def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == "socket.accept() out of system resource":
            last["error"] = context.get("exception")
            summary.note("accept")
            return
        loop.default_exception_handler(context)

    handle.flush = summary.flush  # type: ignore[attr-defined]  # log what is counted (shutdown)
    return handle

