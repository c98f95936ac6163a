"""bench/vs_vllm.py: settings, server commands, prompts, ratios and the verdict (no server run).

The comparison itself needs vLLM's CPU build in its own venv and minutes per server
(docs/serving.md); these tests cover the script's own logic.
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
vs = pytest.importorskip("vs_vllm")

PY = Path("/opt/vllm-venv/bin/python")


def _env(server) -> dict:
    return dict(server.env)


def test_settings_parse_and_refuse():
    assert vs.parse_setting("all-eager") == ("all", "eager", ())
    assert vs.parse_setting("auto-compiled-iomp") == ("auto", "compiled", ("iomp",))
    for bad in ("all", "eager-all", "x-eager", "all-eager-foo", "all-eager-iomp-iomp", ""):
        with pytest.raises(ValueError, match="BIND-MODE"):
            vs.parse_setting(bad)
    for s in vs.DEFAULT_VLLM_CONFIGS:
        vs.parse_setting(s)


def test_cpu_range():
    assert vs.cpu_range([0, 1]) == "0-1"
    assert vs.cpu_range([2, 3, 4, 5]) == "2-5"
    assert vs.cpu_range([0, 2, 5]) == "0,2,5"
    assert vs.cpu_range([3]) == "3"


def test_vllm_server_commands_and_environment():
    folder = Path("/m/gptq")
    s = vs.vllm_server(PY, folder, "all-eager-iomp", 16, 2, False, [0, 1], "/lib/libtc.so.4")
    assert s.side == "vllm" and s.setting == "all-eager-iomp"
    assert s.cmd[:3] == (str(PY), "-m", "vllm.entrypoints.openai.api_server")
    cmd = " ".join(s.cmd)
    for part in ("--model /m/gptq", "--dtype bfloat16", "--max-num-seqs 16",
                 "--generation-config vllm", "--no-enable-prefix-caching", "--enforce-eager",
                 "--disable-uvicorn-access-log"):
        assert part in cmd
    assert "--port" not in cmd  # appended at start
    env = _env(s)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["LD_PRELOAD"] == "/lib/libtc.so.4:/opt/vllm-venv/lib/libiomp5.so"

    s = vs.vllm_server(PY, folder, "auto-compiled", 4, 3, True, [0, 1], None)
    env, cmd = _env(s), " ".join(s.cmd)
    assert "--enforce-eager" not in cmd and "--enable-prefix-caching" in cmd
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env and "LD_PRELOAD" not in env  # vLLM's default
    assert "--max-num-seqs 4" in cmd

    env = _env(vs.vllm_server(PY, folder, "nobind-eager", 16, 2, False, [0, 1, 2], "/t.so"))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["OMP_NUM_THREADS"] == "3"
    assert env["LD_PRELOAD"] == "/t.so"


def test_quantpipe_server_command():
    s = vs.quantpipe_server(Path("/m/w4"), 2, 16, 2, False)
    assert s.side == "quantpipe" and s.setting == "t2" and _env(s)["OMP_NUM_THREADS"] == "2"
    cmd = " ".join(s.cmd)
    assert "quantpipe.cli serve /m/w4" in cmd and "--max-num-seqs 16" in cmd
    assert "--kv-cache-memory 2GiB" in cmd and "--no-prefix-caching" in cmd
    assert "--no-prefix-caching" not in vs.quantpipe_server(Path("/m"), 1, 16, 2, True).cmd
    kv = vs.quantpipe_server(Path("/m"), 2, 16, 2, True, kv_dtype="bf16")
    assert kv.setting == "t2-kvbf16" and kv.cmd[-2:] == ("--kv-dtype", "bf16")
    extra = vs.quantpipe_server(Path("/m"), 1, 16, 2, True, ("--kv-dtype", "bf16")).cmd
    assert extra[-2:] == ("--kv-dtype", "bf16")


def _m(tok_s: float, req_s: float = 1.0, ttft: float = 100.0, tpot: float = 10.0) -> dict:
    lat = {"p50": ttft, "p95": 2 * ttft, "p99": 3 * ttft}
    return {"output_throughput": tok_s, "request_throughput": req_s, "ttft_ms": lat,
            "tpot_ms": {"p50": tpot, "p95": 2 * tpot, "p99": 3 * tpot}}


def test_score_and_best_probe():
    assert vs.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert vs.geomean([5.0, 0.0]) == 0.0 and vs.geomean([]) == 0.0
    assert vs.score({"1": _m(10.0), "16": _m(90.0)}) == pytest.approx(30.0)
    probes = [{"setting": "a", "score": 3.0}, {"setting": "b", "score": 5.0},
              {"setting": "c", "score": 5.0}]
    assert vs.best_probe(probes)["setting"] == "b"  # first of a tie


def test_pair_ratios():
    qp = {"1": _m(100.0, 0.8, ttft=200.0, tpot=10.0), "16": _m(240.0, 1.9)}
    vl = {"1": _m(50.0, 0.4, ttft=800.0, tpot=20.0), "16": _m(0.0, 0.0)}
    r = vs.pair_ratios(qp, vl)
    assert r["1"]["output_tok_s"] == pytest.approx(2.0) and r["1"]["req_s"] == pytest.approx(2.0)
    assert r["1"]["ttft_p50"] == pytest.approx(0.25) and r["1"]["ttft_p99"] == pytest.approx(0.25)
    assert r["1"]["tpot_p95"] == pytest.approx(0.5)
    assert r["16"]["output_tok_s"] is None  # vLLM completed nothing: no ratio, no crash


def test_verdict_uses_vllms_faster_path():
    qp = {"1": _m(100.0, ttft=200.0), "16": _m(300.0, ttft=400.0)}
    slow = {"1": _m(30.0, ttft=700.0), "16": _m(70.0, ttft=900.0)}
    fast = {"1": _m(60.0, ttft=150.0), "16": _m(150.0, ttft=500.0)}
    v = vs.verdict(qp, {"w4 (all-eager)": slow, "fp (all-eager)": fast})
    assert v["vllm_fastest_path"] == "fp (all-eager)"
    assert v["levels"]["1"]["output_tok_s_ratio"] == pytest.approx(100 / 60)
    assert v["levels"]["1"]["throughput_met"] and not v["levels"]["1"]["ttft_p95_met"]
    assert v["levels"]["16"]["throughput_met"] and v["levels"]["16"]["ttft_p95_met"]
    assert not v["met"]
    assert vs.verdict(qp, {"w4 (x)": slow})["met"]


def test_parse_args(monkeypatch, tmp_path):
    base = ["--w4", "/a", "--gptq", "/b"]
    args = vs.parse_args(base)
    assert args.conc == (1, 4, 16) and args.pair_list == ["w4", "fp"]
    assert args.qp_thread_list == [1, 2] and args.output_len == 128
    for bad in (["--pairs", "w8"], ["--vllm-configs", "all-fast"], ["--qp-threads", ""],
                ["--qp-kv-dtypes", "fp8"],
                ["--concurrency", "1,x"], ["--concurrency", "0,4"]):
        with pytest.raises(SystemExit):
            vs.parse_args(base + bad)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = ["--vllm-python", str(venv / "bin" / "python")]
    with pytest.raises(SystemExit):  # an -iomp setting without libiomp5.so in that venv
        vs.parse_args(base + py + ["--vllm-configs", "all-eager-iomp"])
    assert vs.parse_args(base + py).vllm_config_list == [  # the default skips them
        c for c in vs.DEFAULT_VLLM_CONFIGS if not c.endswith("-iomp")]
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    assert vs.parse_args(base + py).vllm_config_list == list(vs.DEFAULT_VLLM_CONFIGS)
    vs.parse_args(base + py + ["--vllm-configs", "all-eager-iomp"])
    assert [vs.expected_sides(args, p) for p in ("w4", "fp")] == [("quantpipe", "vllm")] * 2
    vonly = vs.parse_args(base + ["--fp-sides", "vllm"])  # vLLM's bf16 path alone as a peer
    assert [vs.expected_sides(vonly, p) for p in ("w4", "fp")] == [("quantpipe", "vllm"),
                                                                   ("vllm",)]
    with pytest.raises(SystemExit):
        vs.parse_args(base + ["--fp-sides", "quantpipe"])
    monkeypatch.setenv("QUANTPIPE_VLLM_PYTHON", "/x/python")
    assert vs.default_vllm_python() == Path("/x/python")
    monkeypatch.delenv("QUANTPIPE_VLLM_PYTHON")
    assert vs.default_vllm_python() == vs.ROOT / ".venv-vllm" / "bin" / "python"


def test_chat_prompts_match_the_servers_chat_encoding(tmp_path):
    """The benchmark's token ids are what quantpipe serve's /v1/chat/completions would build
    from the same records (chat template + generation prompt, no extra special tokens)."""
    from quantpipe.prompts.sets import load_prompt_records
    from quantpipe.runtime.server import _encode_chat
    from tests.tiny_models import make_tokenizer

    tok = make_tokenizer()
    tok.save_pretrained(tmp_path)
    ids = vs.chat_prompt_ids(tmp_path, "business-eval")
    records = load_prompt_records("business-eval")
    assert len(ids) == len(records) == 80
    for rec, got in zip(records[:5], ids[:5]):
        assert list(got) == _encode_chat(tok, rec.chat())


def test_a_busy_port_is_refused_before_a_server_starts():
    """Otherwise /health would be answered by whatever already listens there."""
    import socket

    import server_proc

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is in use"):
            server_proc.start_process(["true"], {}, port, Path("/nonexistent/log"))
    server_proc.check_port_free(port)
