"""Loss masks: the masked span decodes to exactly the reply and its end-of-turn token."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from aerie.formats import ChatEncoder

CONVERSATIONS = [
    ([{"role": "user", "content": "Complete:\ndef add(a, b):"}], "    return a + b\n"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}], "4"),
    (
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "user", "content": "explain `heapq.heappush`"}],
        "`heappush` pushes an item onto the heap, keeping the heap invariant.",
    ),
    ([{"role": "user", "content": "unicode?"}], "  héllo → wörld ✓  "),
    ([{"role": "user", "content": "code"}], "\n\n    x = [i for i in range(3)]\n"),
]


@pytest.fixture(scope="module")
def chatml(tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def llama3(llama3_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(llama3_tokenizer_dir))


def _masked(tok, enc):
    return tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m])


@pytest.mark.parametrize("messages,reply", CONVERSATIONS)
def test_chatml_mask_is_reply_plus_im_end(chatml, messages, reply):
    enc = ChatEncoder(chatml).encode(messages, reply)
    assert enc.status == "ok"
    assert len(enc.input_ids) == len(enc.loss_mask)
    assert _masked(chatml, enc) == reply + "<|im_end|>"
    # the unmasked part is exactly the prompt a server renders, then the template's trailing newline
    prompt = chatml.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chatml.decode(enc.input_ids[: enc.prompt_tokens]) == prompt
    assert enc.loss_mask[: enc.prompt_tokens] == [0] * enc.prompt_tokens
    assert chatml.decode(enc.input_ids) == prompt + reply + "<|im_end|>\n"
    assert enc.loss_mask[-1] == 0  # the "\n" after <|im_end|> is not generated


@pytest.mark.parametrize("messages,reply", CONVERSATIONS)
def test_llama3_mask_is_trimmed_reply_plus_eot(llama3, messages, reply):
    enc = ChatEncoder(llama3).encode(messages, reply)
    assert enc.status == "ok"
    # Llama-3's template trims every message
    assert _masked(llama3, enc) == reply.strip() + "<|eot_id|>"
    assert enc.input_ids[0] == llama3.convert_tokens_to_ids("<|begin_of_text|>")
    assert enc.input_ids.count(enc.input_ids[0]) == 1  # the BOS comes from the template, only once
    assert enc.loss_mask[-1] == 1 and enc.input_ids[-1] == llama3.convert_tokens_to_ids("<|eot_id|>")


def test_mask_is_contiguous_and_batch_equals_single(chatml):
    encoder = ChatEncoder(chatml)
    batch = encoder.encode_batch(CONVERSATIONS)
    for (messages, reply), enc in zip(CONVERSATIONS, batch, strict=True):
        single = encoder.encode(messages, reply)
        assert (enc.input_ids, enc.loss_mask) == (single.input_ids, single.loss_mask)
        ones = [i for i, m in enumerate(enc.loss_mask) if m]
        assert ones == list(range(ones[0], ones[-1] + 1))


def test_fast_render_matches_apply_chat_template(chatml, llama3):
    for tok in (chatml, llama3):
        encoder = ChatEncoder(tok)
        for messages, reply in CONVERSATIONS:
            for gen in (True, False):
                conv = messages if gen else messages + [{"role": "assistant", "content": reply}]
                expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                assert encoder.render(conv, add_generation_prompt=gen) == expected


def test_no_reply_means_prompt_only_and_zero_mask(chatml):
    enc = ChatEncoder(chatml).encode([{"role": "user", "content": "hi"}], None)
    assert enc.status == "ok" and sum(enc.loss_mask) == 0
    assert chatml.decode(enc.input_ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_too_long_with_and_without_tokenizing(chatml):
    encoder = ChatEncoder(chatml, max_tokens=32)
    short, long_, absurd = encoder.encode_batch([
        ([{"role": "user", "content": "hi"}], "ok"),
        ([{"role": "user", "content": "word " * 40}], "ok"),
        ([{"role": "user", "content": "x" * 1_000_000}], "ok"),
    ])
    assert short.status == "ok"
    assert long_.status == "too_long" and len(long_.input_ids) > 32
    assert absurd.status == "too_long" and absurd.input_ids == []  # never tokenized


def test_template_failures_are_reasons_not_crashes(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}"
    )
    encoder = ChatEncoder(tok)
    bad, fine = encoder.encode_batch([
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "r"),
        ([{"role": "user", "content": "u"}], "r"),
    ])
    assert bad.status == "template_error" and "no system" in bad.detail
    assert fine.status == "ok"  # one failing conversation does not fail its batch
    # a generation prompt that the full render does not start with
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert ChatEncoder(tok).encode([{"role": "user", "content": "u"}], "r").status == "template_prefix_mismatch"


def test_tokenizer_without_template_is_refused(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tok.chat_template = None
    with pytest.raises(ValueError):
        ChatEncoder(tok)
