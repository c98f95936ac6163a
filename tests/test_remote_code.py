"""Every transformers call that can import code shipped with a model passes
``trust_remote_code`` explicitly: left out, transformers asks "run the custom code? [y/N]" on
stdin (and runs it on "y") for a model type it does not know."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("quantpipe", "calibration", "runtime", "reports", "bench", "tools")
# GenerationConfig imports no code, and would store the keyword as a generation setting
NO_CODE = {"GenerationConfig"}


def remote_code_calls(source: str) -> list[ast.Call]:
    """Calls that may import model code: ``X.from_pretrained(...)``, ``Auto*.from_config(...)``
    and transformers' ``pipeline(...)``."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute):
            receiver = ast.unparse(func.value)
            if receiver in NO_CODE:
                continue
            if func.attr == "from_pretrained" or (func.attr == "from_config"
                                                  and receiver.startswith("Auto")):
                calls.append(node)
        elif isinstance(func, ast.Name) and func.id == "pipeline":
            calls.append(node)
    return calls


def test_every_transformers_load_passes_trust_remote_code():
    missing, seen = [], 0
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for call in remote_code_calls(path.read_text(encoding="utf-8")):
                seen += 1
                if not any(k.arg == "trust_remote_code" for k in call.keywords):
                    missing.append(f"{path.relative_to(ROOT)}:{call.lineno}: "
                                   f"{ast.unparse(call.func)}")
    assert seen > 20  # the scan finds the calls at all
    assert not missing, "pass trust_remote_code explicitly:\n" + "\n".join(missing)


def test_the_scan_flags_a_call_without_it():
    calls = remote_code_calls("AutoTokenizer.from_pretrained(path)\n"
                              "AutoConfig.from_pretrained(path, trust_remote_code=False)\n"
                              "GenerationConfig.from_pretrained(path)\n")
    assert [ast.unparse(c) for c in calls] == [
        "AutoTokenizer.from_pretrained(path)",
        "AutoConfig.from_pretrained(path, trust_remote_code=False)"]
