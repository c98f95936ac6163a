"""``EngineLoop``: an ``LLMEngine`` stepped in a background thread, for the server.

Other threads submit and abort through a thread-safe command queue and receive outputs through
the callback they registered; asyncio code iterates :meth:`EngineLoop.generate`, an async
generator of one request's outputs. Every submitted request gets exactly one finished output,
also when the loop dies: ``error`` is then set (the server answers /health with 503) and every
pending and later request is finished with ``finish_reason == "error"``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable

from quantpipe.runtime.engine.engine import LLMEngine, RequestOutput, failed_output
from quantpipe.runtime.engine.sampling import SamplingParams

log = logging.getLogger(__name__)

# Forward passes failing back to back mean the device or model is broken, not one request:
# the loop then stops and reports itself dead (/health 503) instead of failing every request.
MAX_CONSECUTIVE_STEP_FAILURES = 8

Callback = Callable[[RequestOutput], None]


class EngineLoop:
    """Steps an ``LLMEngine`` in a daemon thread; submit/abort/generate are thread-safe."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cmds: queue.Queue = queue.Queue()
        self._callbacks: dict[str, Callback] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()  # orders submit() against the loop's death
        self._thread = threading.Thread(target=self._run, name="quantpipe-engine", daemon=True)
        self.stats: dict[str, float] = engine.stats()
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(("wake",))
        self._thread.join(timeout=10)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               callback: Callback) -> None:
        with self._lock:
            if self.error is None:
                self._cmds.put(("add", request_id, prompt_ids, params, callback))
                return
        _deliver(callback, failed_output(request_id, f"engine stopped: {self.error}",
                                         len(prompt_ids)))

    def abort(self, request_id: str) -> None:
        """Drop the request wherever it is; its KV blocks go back to the pool."""
        self._cmds.put(("abort", request_id))

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of one request as the engine thread produces them; the last one has
        ``finished`` set. A consumer that stops before it (cancelled, or closing the generator)
        aborts the request, which frees its KV blocks."""
        aloop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self.submit(request_id, prompt_ids, params,
                    lambda out: aloop.call_soon_threadsafe(outputs.put_nowait, out))
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, rid, ids, params, cb = cmd
            try:
                self.engine.add_request(ids, params, rid)
            except Exception as exc:  # validated up front by the server; fail it, never crash
                log.exception("adding request %s failed", rid)
                _deliver(cb, failed_output(rid, f"request rejected by the engine: {exc}",
                                           len(ids)))
                return
            self._callbacks[rid] = cb
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])
            self._callbacks.pop(cmd[1], None)
        elif cmd[0] == "wake":
            pass
        else:
            raise AssertionError(f"unknown engine command {cmd[0]!r}")

    def _step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step() if self.engine.has_work() else []
        for out in outs:
            cb = self._callbacks.get(out.request_id)
            if out.finished:
                self._callbacks.pop(out.request_id, None)
            if cb is not None:
                _deliver(cb, out)
        if self.engine.consecutive_step_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self.engine.consecutive_step_failures} forward passes failed "
                               "in a row; restart the server (see its log for the cause)")
        self.stats = {**self.engine.stats(), "step_seconds": time.perf_counter() - t0}

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_work()
                try:
                    cmd = self._cmds.get(timeout=0.1) if block else self._cmds.get_nowait()
                    self._apply(cmd)
                    while True:
                        self._apply(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                self._step()
        except BaseException as exc:  # surface engine crashes through /health, never hang
            log.exception("engine loop crashed")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self.error = exc
            pending = []
            while True:
                try:
                    pending.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
        message = f"engine stopped: {type(exc).__name__}: {exc}"
        for cmd in pending:
            if cmd[0] == "add":
                _deliver(cmd[4], failed_output(cmd[1], message, len(cmd[2])))
        for rid, cb in list(self._callbacks.items()):
            _deliver(cb, failed_output(rid, message))
        self._callbacks.clear()


def _deliver(callback: Callback, out: RequestOutput) -> None:
    """Hand one output to its request; a broken callback must not stop the engine."""
    try:
        callback(out)
    except Exception:
        log.exception("delivering an output of request %s failed", out.request_id)
