"""Incremental text for streaming, and stop strings."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Decodes a request's output ids as they grow and reports only the new, complete text.

    Text ending in U+FFFD (an incomplete UTF-8 sequence split across tokens) is held back until the
    next token completes it. A stop string ends the text just before it, as OpenAI's API does.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: tuple[str, ...]) -> None:
        if stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._tokenizer = tokenizer
        self._stop = stop
        self._longest_stop = max((len(s) for s in stop), default=0)
        self.text = ""

    def update(self, output_ids: list[int], final: bool) -> tuple[str, bool]:
        """Return (new text, whether a stop string was hit)."""
        if self._tokenizer is None:
            return "", False
        text = self._tokenizer.decode(output_ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return "", False
        search_from = max(0, len(self.text) - self._longest_stop)
        hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text = text[: min(hits)]
        new = text[len(self.text) :]
        self.text = text
        return new, stopped
