"""Incremental text for streaming, and stop strings."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Decodes a request's output ids as they grow and reports only the new, complete text.

    Only a short window of recent tokens is decoded each step (as vLLM does): the text of
    ids[prefix:] minus the text of ids[prefix:read], so the cost does not grow with the output.
    Text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until the
    next token completes it. A stop string ends the text just before it, as OpenAI's API does;
    so that no part of a stop string is ever streamed, the last len(longest stop) - 1 characters
    are held back until the request ends.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...]) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._tokenizer = tokenizer
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0
        self._prefix = 0
        self._read = 0

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Return (new text, whether a stop string was hit)."""
        if self._tokenizer is None:
            return "", False
        decode = self._tokenizer.decode
        settled = decode(output_ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(output_ids[self._prefix :], skip_special_tokens=True)
        if window.endswith("\ufffd") and not final:
            return "", False
        text = self.text + window[len(settled) :]
        self._prefix, self._read = max(self._read - 4, 0), len(output_ids)
        search_from = max(0, len(self.text) - self._longest_stop)
        hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text = text[: min(hits)]
        self.text = text
        held_back = max(self._longest_stop - 1, 0)
        ready = len(text) if stopped or final else max(self._emitted, len(text) - held_back)
        new = text[self._emitted : ready]
        self._emitted = ready
        return new, stopped
