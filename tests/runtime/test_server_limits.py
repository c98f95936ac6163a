"""Request size and time limits keep one client from blocking the others (issue #13)."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

import quantpipe.runtime.server as server_mod
from quantpipe.runtime.server import RequestLimits, ServeSpec, build_app
from tests.runtime.test_server_failures import serve_app, tiny_engine, wait_idle

LIMITS = RequestLimits(max_request_bytes=8192, max_prompt_chars=2000, request_timeout=1.0)


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with serve_app(build_app(engine, "tiny", max_queue=2, limits=LIMITS)) as url:
        yield url, engine


def _raw(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)), timeout=10)
    s.sendall(head + body)
    return s


def _head(path: str, length: int | None, chunked: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1])


def _health_fast(url: str) -> float:
    t0 = time.perf_counter()
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    return time.perf_counter() - t0


def test_declared_oversize_body_is_refused_before_it_is_read(server):
    """The issue's 20 MB prompt: refused from its Content-Length alone, at once."""
    url, _ = server
    t0 = time.perf_counter()
    with _raw(url, _head("/v1/completions", 20 * 2**20)) as s:  # headers only, no body
        assert _status(s) == 413
    assert time.perf_counter() - t0 < 2.0
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "' + b"a" * 9000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert "--max-request-bytes" in r.json()["error"]["message"]


def test_chunked_oversize_body_is_counted_as_it_arrives(server):
    url, engine = server
    with _raw(url, _head("/v1/completions", None, chunked=True)) as s:
        piece = b'{"prompt": "' + b"a" * 1000
        for _ in range(12):  # 12 KB > 8 KiB, never finished: the count alone must refuse it
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        assert _status(s) == 413
    wait_idle(url, engine)


def test_stalled_body_gets_408_and_the_server_stays_responsive(server):
    url, engine = server
    t0 = time.perf_counter()
    with _raw(url, _head("/v1/completions", 100), b'{"prompt":') as s:  # 10 of 100 bytes
        slowest = max(_health_fast(url) for _ in range(5))
        assert slowest < 0.5, f"/health took {slowest:.2f} s while a body was stalled"
        assert _status(s) == 408
        waited = time.perf_counter() - t0
    assert LIMITS.request_timeout * 0.9 <= waited < LIMITS.request_timeout + 3
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                   timeout=30)
    assert r.status_code == 200
    wait_idle(url, engine)


def test_long_prompt_is_refused_before_tokenizing(server, monkeypatch):
    url, _ = server
    seen: list[int] = []
    real = server_mod._encode_prompt
    monkeypatch.setattr(server_mod, "_encode_prompt",
                        lambda tok, text: seen.append(len(text)) or real(tok, text))
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a" * 2001}, timeout=30)
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "a" * 1000}, {"role": "user", "content": "b" * 1000}]},
        timeout=30)
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
    assert seen == []
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "a" * 1500, "max_tokens": 1},
                      timeout=30).status_code in (200, 400)  # 400 only if over the token limit
    assert seen == [1500]


def test_tokenizing_runs_off_the_event_loop(server, monkeypatch):
    url, engine = server
    threads: list[str] = []
    real = server_mod._encode_prompt

    def slow(tok, text):
        threads.append(threading.current_thread().name)
        time.sleep(1.5)  # a long tokenization
        return real(tok, text)

    monkeypatch.setattr(server_mod, "_encode_prompt", slow)
    res: dict[str, httpx.Response] = {}
    th = threading.Thread(target=lambda: res.setdefault("r", httpx.post(
        f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=30)))
    th.start()
    time.sleep(0.3)
    assert _health_fast(url) < 0.5
    th.join()
    assert res["r"].status_code == 200
    assert threads and threads[0].startswith("quantpipe-tokenize")
    wait_idle(url, engine)


def test_limits_are_checked_with_the_option_names(tmp_path):
    with pytest.raises(ValueError, match="--max-request-bytes"):
        RequestLimits(max_request_bytes=10)
    with pytest.raises(ValueError, match="--max-prompt-chars"):
        RequestLimits(max_prompt_chars=0)
    with pytest.raises(ValueError, match="--request-timeout"):
        RequestLimits(request_timeout=0)
    with pytest.raises(ValueError, match="config.json"):
        ServeSpec(tmp_path)
