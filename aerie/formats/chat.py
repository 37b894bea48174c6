"""Chat template + tokenization + loss mask for training examples.

For a conversation ``messages`` with a captured ``reply``:

1. ``P`` = the template rendered over ``messages`` with ``add_generation_prompt=True``: exactly
   what a server renders before generating.
2. ``F`` = the template rendered over ``messages + [assistant: reply]``.
3. ``F`` must start with ``P`` (else ``template_prefix_mismatch``). ``D = F[len(P):]`` is what the
   model generates: the reply and the end-of-turn token. It is cut after the first special token
   that follows the reply text (``<|im_end|>``, ``<|eot_id|>``, ``</s>`` ...); what the template
   adds after it (ChatML's trailing newline) is not generated, so it gets mask 0.
4. ``P``, the generated part and the tail are tokenized separately and concatenated, the way a
   server tokenizes the prompt and then appends generated tokens; the loss mask is 1 exactly on
   the generated part's tokens.

Records without a reply get ``P``'s tokens and an all-zero mask (to be regenerated later).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aerie.formats.record import Reason

__all__ = ["ChatEncoder", "Encoded", "STATUS_OK", "STATUS_TOO_LONG"]

STATUS_OK = "ok"
STATUS_TOO_LONG = "too_long"


@dataclass(slots=True)
class Encoded:
    """``status`` is ``ok``, ``too_long`` or a quarantine :class:`Reason` value."""

    status: str
    input_ids: list[int]
    loss_mask: list[int]
    prompt_tokens: int = 0
    detail: str = ""


class ChatEncoder:
    """Renders conversations with a tokenizer's chat template and builds token ids + loss masks.

    ``tokenizer`` is a Hugging Face fast tokenizer with a ``chat_template``. ``max_tokens``
    (optional) marks longer examples ``too_long``; texts that are certainly too long (more
    characters than ``max_tokens`` times the longest vocabulary entry) are not tokenized at all.
    """

    def __init__(self, tokenizer: Any, max_tokens: int | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(tok, "special", False):
                specials.add(str(tok))
        self.special_tokens = sorted((s for s in specials if s), key=len, reverse=True)
        vocab = tokenizer.get_vocab()
        self._longest_token = max((len(t) for t in vocab), default=1) or 1
        # Fast paths, same output as the public API (a test checks): the compiled template that
        # apply_chat_template renders with, and the Rust tokenizer's encode_batch_fast.
        self._template = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._template = _compile_jinja_template(tokenizer.chat_template)
            self._template_kwargs = dict(tokenizer.special_tokens_map)
        except Exception:  # noqa: BLE001 - fall back to apply_chat_template
            self._template = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._encode_fast = getattr(backend, "encode_batch_fast", None)

    # -------------------------------------------------------------------- rendering

    def _render(self, conversations: list[list[dict[str, str]]], gen: bool) -> list[str | Exception]:
        if not conversations:
            return []
        if self._template is not None:
            results: list[str | Exception] = []
            for conv in conversations:
                try:
                    results.append(
                        self._template.render(
                            messages=conv, tools=None, documents=None, add_generation_prompt=gen,
                            **self._template_kwargs,
                        )
                    )
                except Exception as e:  # noqa: BLE001 - any template failure is a quarantine reason
                    results.append(e)
            return results
        try:
            return list(self.tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=gen))
        except Exception:  # noqa: BLE001 - find the conversation(s) that fail, render the rest
            results = []
            for conv in conversations:
                try:
                    results.append(
                        self.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                    )
                except Exception as e:  # noqa: BLE001
                    results.append(e)
            return results

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template over one conversation (what training and serving both see)."""
        out = self._render([messages], add_generation_prompt)[0]
        if isinstance(out, Exception):
            raise out
        return out

    def _split_generated(self, d: str, reply: str) -> int:
        """Index in ``d`` just after the end-of-turn token that closes the reply."""
        core = reply.strip()
        start = d.find(core) if core else -1
        after = start + len(core) if start >= 0 else 0
        best = -1
        best_len = 0
        for sp in self.special_tokens:
            pos = d.find(sp, after)
            if pos >= 0 and (best < 0 or pos < best):
                best, best_len = pos, len(sp)
        return len(d) if best < 0 else best + best_len

    def _certainly_too_long(self, n_chars: int) -> bool:
        return self.max_tokens is not None and n_chars > 2 * self._longest_token * self.max_tokens

    # -------------------------------------------------------------------- encoding

    def encode_batch(
        self, items: Sequence[tuple[list[dict[str, str]], str | None]]
    ) -> list[Encoded]:
        """``items``: ``(messages, reply or None)`` pairs. Returns one :class:`Encoded` each."""
        n = len(items)
        results: list[Encoded | None] = [None] * n
        prompt_idx: list[int] = []
        for i, (messages, _reply) in enumerate(items):
            size = sum(len(m.get("content") or "") for m in messages) + len(_reply or "")
            if self._certainly_too_long(size):
                results[i] = Encoded(STATUS_TOO_LONG, [], [], detail=f"{size} chars")
            else:
                prompt_idx.append(i)
        prompts = self._render([items[i][0] for i in prompt_idx], gen=True)
        full_idx = [i for i in prompt_idx if items[i][1] is not None]
        fulls = self._render(
            [items[i][0] + [{"role": "assistant", "content": items[i][1]}] for i in full_idx], gen=False
        )
        full_of = dict(zip(full_idx, fulls, strict=True))

        p_texts: list[str] = []
        g_texts: list[str] = []
        t_texts: list[str] = []
        order: list[int] = []
        for i, p in zip(prompt_idx, prompts, strict=True):
            if isinstance(p, Exception):
                results[i] = Encoded(Reason.TEMPLATE_ERROR.value, [], [], detail=str(p)[:200])
                continue
            gen_text, tail = "", ""
            if i in full_of:
                f = full_of[i]
                if isinstance(f, Exception):
                    results[i] = Encoded(Reason.TEMPLATE_ERROR.value, [], [], detail=str(f)[:200])
                    continue
                if not f.startswith(p):
                    results[i] = Encoded(
                        Reason.TEMPLATE_PREFIX_MISMATCH.value, [], [], detail="prompt render is not a prefix"
                    )
                    continue
                d = f[len(p) :]
                cut = self._split_generated(d, items[i][1] or "")
                gen_text, tail = d[:cut], d[cut:]
            p_texts.append(p)
            g_texts.append(gen_text)
            t_texts.append(tail)
            order.append(i)

        p_ids = self._tokenize(p_texts)
        g_ids = self._tokenize(g_texts)
        t_ids = self._tokenize(t_texts)
        for k, i in enumerate(order):
            ids = p_ids[k] + g_ids[k] + t_ids[k]
            mask = [0] * len(p_ids[k]) + [1] * len(g_ids[k]) + [0] * len(t_ids[k])
            status = STATUS_OK
            if self.max_tokens is not None and len(ids) > self.max_tokens:
                status = STATUS_TOO_LONG
            results[i] = Encoded(status, ids, mask, prompt_tokens=len(p_ids[k]))
        return results  # type: ignore[return-value]

    def encode(self, messages: list[dict[str, str]], reply: str | None) -> Encoded:
        return self.encode_batch([(messages, reply)])[0]

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in texts]
        idx = [i for i, t in enumerate(texts) if t]
        if not idx:
            return out
        batch = [texts[i] for i in idx]
        if self._encode_fast is not None:
            enc = [e.ids for e in self._encode_fast(batch, add_special_tokens=False)]
        else:
            enc = self.tokenizer(
                batch, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False
            )["input_ids"]
        for i, ids in zip(idx, enc, strict=True):
            out[i] = ids
        return out
