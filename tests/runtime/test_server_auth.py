"""`serve --api-key` / QUANTPIPE_API_KEY and `--allowed-host` (issue #29): every endpoint but
/health needs the key (401 with OpenAI's body otherwise); other Host headers get 400."""

from __future__ import annotations

import hmac

import httpx
import pytest

import quantpipe.runtime.server as server_mod
from quantpipe.runtime.server import build_app
from tests.runtime.test_server_failures import serve_app, tiny_engine

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    engine = tiny_engine()
    with serve_app(build_app(engine, "tiny", api_key=KEY)) as url:
        yield url


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere"),
])
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"},
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": f"Bearer {KEY}x"}], ids=str)
def test_every_endpoint_but_health_needs_the_key(server, method, path, headers):
    r = httpx.request(method, server + path, headers=headers,
                      json={"prompt": "Hi", "max_tokens": 1} if method == "POST" else None)
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
    assert KEY not in r.text


def test_the_key_opens_every_endpoint_and_health_needs_none(server):
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{server}/metrics", headers=AUTH).status_code == 200
    r = httpx.post(f"{server}/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{server}/v1/models", headers={"authorization": f"bearer {KEY}"}
                     ).status_code == 200  # the scheme is case-insensitive (RFC 7235)


def test_the_key_is_compared_in_constant_time(server, monkeypatch):
    calls, real = [], hmac.compare_digest
    monkeypatch.setattr(server_mod.hmac, "compare_digest",
                        lambda a, b: calls.append((a, b)) or real(a, b))
    assert httpx.get(f"{server}/v1/models", headers=AUTH).status_code == 200
    assert calls == [(KEY.encode(), KEY.encode())]


def test_allowed_hosts():
    engine = tiny_engine()
    app = build_app(engine, "tiny", allowed_hosts=("api.example.com", "127.0.0.1"))
    with serve_app(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200  # Host: 127.0.0.1:PORT
        r = httpx.get(f"{url}/v1/models", headers={"Host": "evil.example.net"})
        assert r.status_code == 400 and "host" in r.text.lower()
        assert httpx.get(f"{url}/v1/models", headers={"Host": "api.example.com"}
                         ).status_code == 200
    with pytest.raises(ValueError, match="--allowed-host"):
        build_app(engine, "tiny", allowed_hosts=("*example.com",))
