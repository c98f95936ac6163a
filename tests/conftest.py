import importlib.abc
import os
import sys

import pytest

# Any hub access in tests must fail at once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



class _InstalledNamesOnly(importlib.abc.MetaPathFinder):
    """The repository root is on sys.path under pytest, so its top-level folders would import
    as ``calibration`` / ``runtime`` / ``reports``; installed, they exist only as
    ``quantpipe.calibration`` etc. Refuse the bare names so tests catch a stray one (including
    ``importlib.resources.files("calibration")``-style strings) as the installed package would."""

    BARE = frozenset({"calibration", "runtime", "reports"})

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.BARE:
            raise ModuleNotFoundError(f"No module named {fullname!r} once installed: import "
                                      f"quantpipe.{fullname}", name=fullname)
        return None


sys.meta_path.insert(0, _InstalledNamesOnly())

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
