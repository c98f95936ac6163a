"""Prompt sets: user prompt files (JSONL, CSV/TSV, text, parquet) and the shipped business sets
(``sets``, data in ``data/``), read by calibration, sensitivity, the reports and the
benchmarks."""
