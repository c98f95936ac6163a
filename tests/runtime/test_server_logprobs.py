"""OpenAI's ``logprobs`` (completions) and ``logprobs`` / ``top_logprobs`` (chat), streamed or
not, checked against a float64 log_softmax of the model's own logits; fields the server does
not implement answer 400 naming them; temperature is capped at 2 (issue #29, item 9)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from quantpipe.runtime.engine import EngineConfig, LLMEngine
from quantpipe.runtime.engine.detokenize import token_bytes
from quantpipe.runtime.server import build_app
from tests.runtime.test_server_failures import serve_app
from tests.tiny_models import make_model

# The engine computes in fp32 over a paged KV cache; the reference in float64 without one.
ATOL = 2e-4
PROMPT = "The customer reports that the invoice"
MESSAGES = [{"role": "user", "content": "Extract the fields name and date"}]
N = 6


@pytest.fixture(scope="module")
def server():
    model, tok = make_model("llama")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, max_num_seqs=2,
                                                max_num_batched_tokens=64, num_kv_blocks=200))
    with serve_app(build_app(engine, "tiny")) as url:
        yield url, model, tok


def _greedy_float64(model, prompt_ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """N greedy tokens and the float64 log_softmax that chose each: ([N], [N, vocab])."""
    ref = make_model("llama")[0].double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ids, rows = list(prompt_ids), []
    with torch.no_grad():
        for _ in range(N):
            logp = torch.log_softmax(ref(torch.tensor([ids])).logits[0, -1], dim=-1)  # fp64
            rows.append(logp)
            ids.append(int(logp.argmax()))
    return ids[len(prompt_ids):], torch.stack(rows)


def _texts(tok, ids: list[int]) -> list[str]:
    return [b.decode("utf-8", errors="backslashreplace") for b in token_bytes(tok, ids)]


def _close(got: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(got, dtype=torch.float64), want, atol=ATOL, rtol=0)


def _sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=30) as s:
        assert s.status_code == 200, s.read()
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _check_completion(lp: dict, tok, out_ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    texts = _texts(tok, out_ids)
    assert lp["tokens"] == texts
    assert _close(lp["token_logprobs"], ref[torch.arange(N), torch.tensor(out_ids)])
    for i, top in enumerate(lp["top_logprobs"]):
        values, ids = torch.topk(ref[i], k)
        # greedy: the sampled token is the most likely one, so no extra entry
        assert list(top) == _texts(tok, ids.tolist())
        assert _close(list(top.values()), values)
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(N)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completion_logprobs_match_float64(server, stream):
    url, model, tok = server
    out_ids, ref = _greedy_float64(model, tok.encode(PROMPT))
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "logprobs": 5}
    if stream:
        chunks = [c["choices"][0] for c in _sse(url, "/v1/completions", body)]
        lp = {key: sum((c["logprobs"][key] for c in chunks), []) for key in chunks[0]["logprobs"]}
        text = "".join(c["text"] for c in chunks)
    else:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp, text = choice["logprobs"], choice["text"]
    _check_completion(lp, tok, out_ids, ref, 5)
    assert "".join(lp["tokens"]) == text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_logprobs_match_float64(server, stream):
    url, model, tok = server
    prompt_ids = tok.encode(tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
    out_ids, ref = _greedy_float64(model, prompt_ids)
    body = {"messages": MESSAGES, "max_tokens": N, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 3}
    if stream:
        chunks = [c["choices"][0] for c in _sse(url, "/v1/chat/completions", body)]
        content = sum((c["logprobs"]["content"] for c in chunks), [])
        assert all(c["logprobs"]["refusal"] is None for c in chunks)
    else:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["refusal"] is None
        content = lp["content"]
    assert len(content) == N
    for i, (entry, tid) in enumerate(zip(content, out_ids)):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        raw = token_bytes(tok, [tid])[0]
        assert entry["bytes"] == list(raw) and entry["token"] == _texts(tok, [tid])[0]
        assert _close([entry["logprob"]], ref[i, tid:tid + 1])
        values, ids = torch.topk(ref[i], 3)
        assert [t["token"] for t in entry["top_logprobs"]] == _texts(tok, ids.tolist())
        assert [t["bytes"] for t in entry["top_logprobs"]] == [
            list(b) for b in token_bytes(tok, ids.tolist())]
        assert _close([t["logprob"] for t in entry["top_logprobs"]], values)


def test_sampled_logprobs_are_the_models_not_the_temperatures(server):
    """With temperature and top_k the reported distribution is still log_softmax(logits)."""
    url, model, tok = server
    r = httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": PROMPT, "max_tokens": 1, "temperature": 1.7, "top_k": 3, "seed": 7,
        "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    _, ref = _greedy_float64(model, tok.encode(PROMPT))
    values, ids = torch.topk(ref[0], 2)
    top = lp["top_logprobs"][0]
    assert _close([top[t] for t in _texts(tok, ids.tolist())], values)
    assert top[lp["tokens"][0]] == lp["token_logprobs"][0]  # the sampled token is always there


def test_no_logprobs_unless_asked(server):
    url, _, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2},
                   timeout=30)
    assert r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                   timeout=30)
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "echo", True), ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "end"), ("/v1/completions", "logit_bias", {"5": 100}),
    ("/v1/completions", "presence_penalty", 0.5), ("/v1/completions", "frequency_penalty", 1),
    ("/v1/chat/completions", "response_format", {"type": "json_object"}),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "auto"),
    ("/v1/chat/completions", "logit_bias", {"5": 100}),
])
def test_unsupported_fields_get_400_naming_them(server, path, field, value):
    url, _, _ = server
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = httpx.post(url + path, json={**base, "max_tokens": 1, field: value}, timeout=30)
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert msg.startswith(f"{field}: not supported by this server"), msg


@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"echo": False, "best_of": 1, "logit_bias": {}, "presence_penalty": 0}),
    ("/v1/chat/completions", {"tools": [], "response_format": {"type": "text"},
                              "frequency_penalty": 0.0, "tool_choice": "none"}),
])
def test_values_that_ask_for_nothing_are_accepted(server, path, extra):
    url, _, _ = server
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}
    r = httpx.post(url + path, json={**base, "max_tokens": 1, **extra}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": PROMPT, "temperature": 1e308}, "temperature"),
    ({"prompt": PROMPT, "temperature": 2.01}, "temperature"),
    ({"prompt": PROMPT, "logprobs": 6}, "logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
])
def test_out_of_range_gets_400(server, body, fragment):
    url, _, _ = server
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, json={**body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.post(url + path, timeout=30, json={
        **{k: v for k, v in body.items() if k in ("prompt", "messages")}, "max_tokens": 1,
        "temperature": 2.0}).status_code == 200


def test_token_bytes_of_partial_characters():
    """A byte-level token holding part of a UTF-8 character keeps its real bytes."""
    _, tok = make_model("llama")
    ids = tok.encode("请总结")
    raw = token_bytes(tok, ids)
    assert b"".join(raw) == "请总结".encode()
    assert token_bytes(tok, [tok.convert_tokens_to_ids("<|im_end|>")]) == [b"<|im_end|>"]
