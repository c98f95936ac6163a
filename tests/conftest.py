import os

import pytest

# Any hub access in tests must fail at once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.tiny_models import make_model, save_model  # noqa: E402


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    """A saved tiny random model folder (fp32 safetensors + tokenizer), per family."""
    model, tok = make_model(request.param)
    return save_model(model, tok, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    model, tok = make_model("llama")
    return save_model(model, tok, tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_fp16_dir(tmp_path_factory):
    """The real default model exported once per test session (slow: ~25 s)."""
    from quantpipe.stages.fp16_export import Fp16ExportSpec, export_fp16

    out = tmp_path_factory.mktemp("smollm2") / "fp16"
    export_fp16(Fp16ExportSpec("smollm2-135m", out))
    return out
