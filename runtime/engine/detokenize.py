"""Token ids -> text deltas for one request: incremental detokenization, EOS and stop strings.

The engine calls :meth:`Detokenizer.emit` once per sampled token; it returns the text that can
be sent now and why the request finished, if it did. Text that might still become a stop
string, or that ends in an incomplete UTF-8 character, is held back until it cannot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

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


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (a printable character per byte) back to the bytes."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def token_bytes(tokenizer, ids: list[int]) -> list[bytes]:
    """The bytes each token stands for on its own (OpenAI's logprobs ``bytes``).

    Decoding one token alone gives U+FFFD for a token that holds part of a UTF-8 character,
    so the bytes come from the vocabulary: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM)
    maps each character of a token back to a byte; SentencePiece writes a space as U+2581 and
    a byte as ``<0xNN>``; added (special) tokens are their own text.
    """
    pieces = tokenizer.convert_ids_to_tokens(ids)
    added = getattr(tokenizer, "added_tokens_decoder", {})
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    table = _byte_level_decoder()
    out = []
    for tid, piece in zip(ids, pieces):
        piece = piece or ""
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if tid in added:
            out.append(piece.encode())
        elif byte_level and all(ch in table for ch in piece):
            out.append(bytes(table[ch] for ch in piece))
        elif fallback:
            out.append(bytes([int(fallback.group(1), 16)]))
        else:
            out.append(piece.replace("\u2581", " ").encode())
    return out
