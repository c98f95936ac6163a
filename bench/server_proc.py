"""Start `quantpipe serve` (or another OpenAI-compatible server) as a child process for a
benchmark, and stop it (bench/ only)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_server(serve_args: list[str], port: int, threads: int, log: Path,
                 timeout: float = 300.0) -> subprocess.Popen:
    """`quantpipe serve SERVE_ARGS --port PORT` in its own session; returns once /health is
    200. The server's output goes to ``log``; a server that exits or never becomes healthy
    raises with the end of that log."""
    cmd = [sys.executable, "-m", "quantpipe.cli", "serve", *serve_args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    return start_process(cmd, env, port, log, timeout)


def start_process(cmd: list[str], env: dict[str, str], port: int, log: Path,
                  timeout: float = 300.0) -> subprocess.Popen:
    """Any server command ``cmd`` listening on ``port``, started and awaited as above."""
    import httpx

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); see {log}:\n"
                               + log.read_text()[-2000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"server did not become healthy in {timeout:.0f} s; see {log}")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
