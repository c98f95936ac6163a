"""`quantpipe serve` checks its options and the model folder before loading the model."""

from __future__ import annotations

import json
import socket

import pytest
from click.testing import CliRunner

import quantpipe.runtime.engine as engine_pkg
from quantpipe.cli import main
from tests.tiny_models import make_model, save_model


class _Loaded(Exception):
    pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model, tok = make_model("llama")
    return save_model(model, tok, tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(autouse=True)
def no_loading(monkeypatch):
    """Loading the model is where the cheap checks must have stopped a bad command."""
    def load(*_a, **_k):
        raise _Loaded("the model load started")

    monkeypatch.setattr(engine_pkg, "load_model_for_serving", load)


def _serve(folder, *opts: str):
    return CliRunner().invoke(main, ["serve", str(folder), "--port", "1", *opts])


@pytest.mark.parametrize("opts, fragment", [
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--max-num-seqs", "8", "--max-num-batched-tokens", "4"], "--max-num-batched-tokens"),
    (["--block-size", "0"], "--block-size"),
    (["--max-queue", "-1"], "--max-queue"),
    (["--max-request-bytes", "10"], "--max-request-bytes"),
    (["--max-request-bytes", "big"], "cannot read size"),
    (["--max-prompt-chars", "0"], "--max-prompt-chars"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--device", "tpu"], "--device"),
    (["--max-connections", "0"], "--max-connections"),
    (["--header-timeout", "0"], "--header-timeout"),
    (["--api-key", "two words"], "--api-key"),
    (["--allowed-host", "api.*.com"], "--allowed-host"),
])
def test_bad_options_fail_before_the_model_loads(model_dir, opts, fragment):
    res = _serve(model_dir, *opts)
    assert res.exit_code == 1, (res.output, res.exception)
    assert not isinstance(res.exception, _Loaded)
    err = res.output.strip().splitlines()[-1]
    assert err.startswith("Error: ") and fragment in err, res.output


def _folder(tmp_path, config: dict | str, files: dict[str, str] | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "config.json").write_text(text)
    for name, body in (files or {}).items():
        (tmp_path / name).write_text(body)
    return tmp_path


LLAMA = {"model_type": "llama"}
WEIGHTS = {"model.safetensors": "x", "tokenizer.json": "{}"}


@pytest.mark.parametrize("config, files, fragment", [
    ("{not json", WEIGHTS, "not valid JSON"),
    ({"hidden_size": 8}, WEIGHTS, "model_type"),
    ({**LLAMA, "quantization_config": {"quant_method": "gptq"}}, WEIGHTS, "quant_method"),
    ({**LLAMA, "quantization_config": {"quant_method": "quantpipe"}}, WEIGHTS, "quantpipe.json"),
    (LLAMA, {"pytorch_model.bin": "x", "tokenizer.json": "{}"}, "safetensors"),
    (LLAMA, {"model.safetensors": "x"}, "tokenizer"),
])
def test_bad_model_folder_fails_before_the_model_loads(tmp_path, config, files, fragment):
    res = _serve(_folder(tmp_path / "m", config, files), "--port", "8000")
    assert res.exit_code == 1 and not isinstance(res.exception, _Loaded), res.output
    assert fragment in res.output.strip().splitlines()[-1], res.output


def test_busy_port_fails_before_the_model_loads(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = _serve(model_dir, "--port", str(port))
    assert res.exit_code == 1 and not isinstance(res.exception, _Loaded), res.output
    assert "cannot listen" in res.output and "--port" in res.output


def test_good_options_reach_the_model_load(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _serve(model_dir, "--port", str(port), "--max-request-bytes", "64KiB",
                 "--max-prompt-chars", "5000", "--request-timeout", "5", "--header-timeout", "3",
                 "--max-connections", "50", "--allowed-host", "*.example.com")
    assert isinstance(res.exception, _Loaded), res.output
    # "serving ..." means the server listens: a run that stopped before must not print it
    assert "serving" not in res.output, res.output


def test_api_key_from_the_environment(model_dir, monkeypatch):
    import quantpipe.runtime.server as server_mod

    seen = {}
    monkeypatch.setattr(server_mod, "_warn_exposure", lambda spec: seen.setdefault("spec", spec))
    monkeypatch.setenv("QUANTPIPE_API_KEY", "s3cret-key")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = _serve(model_dir, "--port", str(port))
    assert isinstance(res.exception, _Loaded), res.output
    assert seen["spec"].api_key == "s3cret-key"
    assert "s3cret-key" not in repr(seen["spec"])  # never in logs or tracebacks


@pytest.mark.parametrize("host, api_key, warned", [
    ("127.0.0.1", None, None),
    ("0.0.0.0", None, "with no API key"),
    ("0.0.0.0", "k", "API key required"),
])
def test_binding_beyond_loopback_warns(model_dir, caplog, host, api_key, warned):
    from quantpipe.runtime.server import ServeSpec, _warn_exposure

    with caplog.at_level("WARNING", logger="quantpipe.runtime.server"):
        _warn_exposure(ServeSpec(model_dir, host=host, api_key=api_key))
    if warned is None:
        assert not caplog.records
    else:
        assert len(caplog.records) == 1 and warned in caplog.records[0].getMessage()
