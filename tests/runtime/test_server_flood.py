"""A slow-header flood must not exhaust the server's file descriptors (issue #29, item 6).

`quantpipe serve` runs in a child process under a lowered open-file limit (soft = hard, so it
cannot raise it); FLOOD loopback connections, more than that limit, each send one header byte
per second and reconnect when closed. Throughout, /health must answer within 1 s, and the
server's log must stay small (no traceback per failed accept). Bounded: FLOOD_SECONDS of flood.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from quantpipe.runtime import http_guard
from quantpipe.runtime.server import build_app
from tests.runtime.test_server_failures import serve_app, tiny_engine
from tests.tiny_models import make_model, save_model

FD_LIMIT = 256  # the server's RLIMIT_NOFILE (soft and hard)
FLOOD = 300  # slow connections, more than FD_LIMIT
FLOOD_SECONDS = 6.0
HEADER_TIMEOUT = 2.0
REQUEST = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n"  # never ends


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _skip_without_fd_room(need: int) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < need:
        pytest.skip(f"the flood needs {need} open files; the hard limit is {hard}")


def _start(model_dir: Path, port: int, log: Path) -> subprocess.Popen:
    def lowered_limit() -> None:  # runs in the child before exec
        resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))

    cmd = [sys.executable, "-m", "quantpipe.cli", "serve", str(model_dir), "--port", str(port),
           "--header-timeout", str(HEADER_TIMEOUT), "--kv-cache-memory", "8MiB",
           "--max-num-seqs", "2", "--max-queue", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                preexec_fn=lowered_limit, start_new_session=True)


def _wait_listening(proc: subprocess.Popen, log: Path, url: str) -> None:
    """Until the server prints "serving ..."; then it must answer at once (issue #29, item 12)."""
    deadline = time.time() + 180
    while b"serving " not in log.read_bytes():
        assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
        assert time.time() < deadline, f"server did not start:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    assert httpx.get(f"{url}/health", timeout=2).status_code == 200


# The flood runs in its own process: in this one it would hold the GIL the health checks need.
FLOOD_SCRIPT = """
import resource, socket, sys, time
port, n, seconds, request = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft < n + 64:
    resource.setrlimit(resource.RLIMIT_NOFILE, (n + 64, hard))
request = request.encode()
socks, sent, reconnects = [None] * n, [0] * n, 0
def connect(i):
    try:
        socks[i], sent[i] = socket.create_connection(("127.0.0.1", port), timeout=0.5), 0
    except OSError:
        socks[i] = None  # the listen queue is full: try again next round
until = time.time() + seconds
while time.time() < until:
    t0 = time.time()
    for i in range(n):  # one more header byte on each connection, every second
        if socks[i] is None:
            connect(i)
            continue
        try:
            socks[i].send(request[sent[i] % len(request):][:1])
            sent[i] += 1
        except OSError:  # closed by the server: reconnect, as an attacker would
            socks[i].close()
            reconnects += 1
            connect(i)
    time.sleep(max(0.0, 1.0 - (time.time() - t0)))
print(reconnects)
"""


def _flood(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", FLOOD_SCRIPT, str(port), str(FLOOD),
                             str(FLOOD_SECONDS), REQUEST.decode()], stdout=subprocess.PIPE,
                            text=True)


def test_slow_header_flood_keeps_health_answering(tmp_path):
    _skip_without_fd_room(FLOOD + 64)
    model, tok = make_model("llama")
    model_dir = save_model(model, tok, tmp_path / "tiny")
    port, log = _free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = _start(model_dir, port, log)
    flood: subprocess.Popen | None = None
    slowest, failures, checks = 0.0, [], 0
    try:
        _wait_listening(proc, log, url)
        flood, t_start = _flood(port), time.time()
        while flood.poll() is None:
            t0 = time.perf_counter()
            try:
                r = httpx.get(f"{url}/health", timeout=1.0)
                if r.status_code != 200:
                    failures.append(f"{r.status_code} {r.text[:100]}")
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__} at {time.time() - t_start:.1f} s")
            slowest = max(slowest, time.perf_counter() - t0)
            checks += 1
            time.sleep(0.2)
        reconnects = int(flood.communicate()[0])
        assert proc.poll() is None, f"server exited:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGINT)  # a clean shutdown logs the counts not yet logged
        proc.wait(timeout=60)
    finally:
        for p in (flood, proc):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is proc else p.kill()
                p.wait()
    text = log.read_text(errors="replace")
    assert checks >= 15 and not failures, (failures[:5], checks, slowest, text[-2000:])
    assert slowest < 1.0, slowest
    assert reconnects >= FLOOD - FD_LIMIT  # the server did close slow connections
    assert "Traceback" not in text and len(text) < 20_000, text[-3000:]
    # one EMFILE stops asyncio accepting for a second: the cap must keep descriptors free
    assert "could not accept" not in text, text[-3000:]
    assert "to admit newer ones at the" in text, text[-3000:]


def test_accept_errors_are_summarised(caplog):
    """asyncio's traceback per failed accept() -> one line per LOG_EVERY seconds, counted."""
    async def flood() -> None:
        loop = asyncio.get_running_loop()
        handle = http_guard.accept_error_handler(loop)
        err = OSError(24, "Too many open files")
        for _ in range(1000):
            handle(loop, {"message": "socket.accept() out of system resource",
                          "exception": err})
        handle.flush()  # what the timer does LOG_EVERY seconds later (or shutdown)

    with caplog.at_level(logging.WARNING, logger="quantpipe.runtime.http_guard"):
        asyncio.run(flood())
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    msg = caplog.records[0].getMessage()
    assert "could not accept 1000 connections" in msg and "ulimit -n" in msg
    assert caplog.records[0].exc_info is None


@pytest.mark.parametrize("limit, open_now, requested, expected", [
    (65536, 40, 1000, 1000), (512, 40, 1000, 512 - 40 - http_guard.FD_HEADROOM
                                               - 3 * http_guard.ACCEPT_BATCH)])
def test_connection_cap_fits_the_fd_limit(limit, open_now, requested, expected):
    assert http_guard.connection_cap(requested, limit, open_now) == expected


def test_fd_limit_too_low_is_an_error_naming_ulimit():
    with pytest.raises(ValueError, match="ulimit -n"):
        http_guard.connection_cap(1000, 160, 40)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5)


def _closed_after(s: socket.socket) -> float:
    """Seconds until the server closes ``s`` (reading and dropping what it sends)."""
    t0 = time.perf_counter()
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:  # closed while our bytes were in flight: a reset, not a FIN
        pass
    return time.perf_counter() - t0


def test_header_deadline_and_connection_cap_in_process(caplog):
    guard = http_guard.ConnectionGuard(http_guard.ConnectionLimits(max_connections=3,
                                                                   header_timeout=0.5))
    with serve_app(build_app(tiny_engine(), "tiny"), http=guard.protocol_class()) as url:
        # headers that never end: closed after the header timeout
        with _connect(url) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            assert 0.3 < _closed_after(s) < 3
        # a keep-alive connection answered once, then trickling its next headers: closed too
        with _connect(url) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200")
            t0 = time.perf_counter()
            for byte in b"GET /health":
                try:
                    s.sendall(bytes([byte]))
                except OSError:
                    break
                time.sleep(0.2)
            assert time.perf_counter() - t0 < 3 and _closed_after(s) < 3
        assert guard.summary.total == {"header_timeout": 2}
        # three idle connections fill the cap: a fourth gets in, the oldest idle one goes
        # (EVICT_DELAY later: the fourth, kept alive, then waits for headers itself)
        idle = [_connect(url) for _ in range(3)]
        time.sleep(0.1)
        with httpx.Client(timeout=2) as client:
            assert client.get(f"{url}/health").status_code == 200
            assert _closed_after(idle[0]) < 0.3  # evicted, well before its 0.5 s deadline
            assert guard.summary.total["evicted"] >= 1
        for s in idle:
            s.close()
    with caplog.at_level(logging.WARNING, logger="quantpipe.runtime.http_guard"):
        guard.summary.flush()  # what its timer does LOG_EVERY seconds after the first close
    assert len(caplog.records) == 1, caplog.text
    msg = caplog.records[0].getMessage()
    assert "2 whose request headers did not arrive within 0.5 s" in msg, msg
    assert "at the 3-connection cap" in msg, msg


def test_soft_fd_limit_is_raised_to_the_hard_one():
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit is only {hard}")
    code = ("import json, resource\n"
            "from quantpipe.runtime.http_guard import raise_fd_limit\n"
            "r = resource.RLIMIT_NOFILE\n"
            "resource.setrlimit(r, (256, resource.getrlimit(r)[1]))\n"
            "print(json.dumps([raise_fd_limit(), resource.getrlimit(r)]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    (soft, hard_seen), now = json.loads(out)
    assert soft == hard_seen == hard and now == [hard, hard], out
