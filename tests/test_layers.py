"""The package layers hold: the import-linter contracts in pyproject.toml are all kept."""

from pathlib import Path

from importlinter import cli

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_kept(monkeypatch):
    monkeypatch.chdir(ROOT)  # the contracts are read from the repository's pyproject.toml
    # 0 = every contract kept; the tool prints each broken import chain
    assert cli.lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0
