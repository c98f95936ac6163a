"""Token ids -> text deltas for one request: incremental detokenization, EOS and stop strings.

The engine calls :meth:`Detokenizer.emit` once per sampled token; it returns the text that can
be sent now and why the request finished, if it did. Text that might still become a stop
string, or that ends in an incomplete UTF-8 character, is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quantpipe.runtime.engine.sampling import SamplingParams


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """Every end-of-sequence id the generation config, the model config or the tokenizer names."""
    ids: set[int] = set()
    gc = getattr(model, "generation_config", None)
    for src in (getattr(gc, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return ids


def finish_reason(tok: int, num_output: int, params: SamplingParams,
                  eos: set[int]) -> str | None:
    """"stop" at an EOS token (unless ignore_eos), "length" at max_tokens, else None."""
    if tok in eos and not params.ignore_eos:
        return "stop"
    if num_output >= params.max_tokens:
        return "length"
    return None


@dataclass
class Detokenizer:
    """Incremental detokenization state of one request (vLLM's prefix/read offsets)."""

    text: str = ""  # decoded text of the output tokens so far
    emitted: int = 0  # characters already returned
    prefix: int = 0  # output index where the decode window starts (a character boundary)
    read: int = 0  # output tokens already turned into text

    def advance(self, tokenizer, ids: list[int], final: bool) -> None:
        """Append the text of ``ids[self.read:]``, decoding only a short window.

        The window starts at ``prefix``, an earlier boundary, so tokenizers whose decode
        depends on the previous token (leading spaces) diff correctly; text is only taken
        once it does not end in an incomplete UTF-8 character (U+FFFD), unless ``final``.
        Each call costs O(window), not O(output): the full text is never decoded again.
        """
        before = tokenizer.decode(ids[self.prefix:self.read], skip_special_tokens=True)
        after = tokenizer.decode(ids[self.prefix:], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(ids)

    def emit(self, tokenizer, ids: list[int], params: SamplingParams,
             eos: set[int]) -> tuple[str, str | None]:
        """(text delta, finish reason or None) after ``ids[-1]`` was appended to the output."""
        reason = finish_reason(ids[-1], len(ids), params, eos)
        self.advance(tokenizer, ids, final=reason is not None)
        for s in params.stop:
            # Only search the new region (+ overlap) so an earlier emitted char cannot match.
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.text, reason = self.text[:at], "stop"
                break
        end = len(self.text) if reason is not None else self._sendable_end(params)
        end = max(end, self.emitted)
        new_text, self.emitted = self.text[self.emitted : end], end
        return new_text, reason

    def _sendable_end(self, params: SamplingParams) -> int:
        """End of the text that can be sent now: hold back a possible stop-string prefix and
        an incomplete UTF-8 character."""
        hold = max((len(s) - 1 for s in params.stop), default=0)
        end = len(self.text) - hold
        while end > self.emitted and self.text[end - 1] == "\ufffd":
            end -= 1
        return end
