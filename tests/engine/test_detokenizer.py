"""Streaming text: the deltas add up to the full decode, multi-byte characters included."""

from __future__ import annotations

from transformers import AutoTokenizer

from aerie.engine.detokenizer import TextStream

TEXT = "def größe(x):\n    return 'naïve café ☕ 日本語 🚀' * x  # ünïcödé\n\tprint(x)\n"


def stream(tokenizer, ids, stop=()):
    text_stream, pieces = TextStream(tokenizer, stop), []
    for end in range(1, len(ids) + 1):
        new, stopped = text_stream.update(ids[:end], final=end == len(ids))
        pieces.append(new)
        if stopped:
            return "".join(pieces), True
    return "".join(pieces), False


def test_deltas_add_up_to_the_full_decode(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tokenizer.encode(TEXT * 3, add_special_tokens=False)
    text, stopped = stream(tokenizer, ids)
    assert text == tokenizer.decode(ids, skip_special_tokens=True) and not stopped
    assert "\ufffd" not in text


def test_stop_string_cuts_the_text_before_it(tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    text, stopped = stream(tokenizer, ids, stop=("café",))
    assert stopped and text == TEXT[: TEXT.index("café")]
