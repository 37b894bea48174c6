"""`aerie generate`: the engine in-process, no Ray. Also the quickest way to try a head."""

from __future__ import annotations

from collections.abc import Iterator

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine, check_method
from aerie.target import load_target


def run_generate(
    target: str,
    prompts: list[str],
    method: str = "none",
    head: str | None = None,
    k: int | str = 0,
    tree: bool | None = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    max_slots: int = 8,
    chat: bool = False,
) -> Iterator[dict]:
    """Yield `{"prompt", "text", "token_ids", "acceptance_length"}` per prompt, in order.
    With `chat`, each prompt is sent as one user message through the target's chat template."""
    check_method(method, head, tree)
    loaded = load_target(target)
    tokenizer = loaded.tokenizer
    if chat:
        inputs = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
    else:
        inputs = prompts
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for p in inputs)
    config = EngineConfig(max_slots=max_slots, max_len=longest + max_tokens)
    engine = build_engine(loaded, config, method, head, k, tree=tree)
    params = [
        SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=None if seed is None else seed + index,
        )
        for index in range(len(prompts))
    ]
    for prompt, completion in zip(prompts, engine.generate(inputs, params), strict=True):
        yield {
            "prompt": prompt,
            "text": completion.text,
            "token_ids": completion.token_ids,
            "acceptance_length": completion.spec.acceptance_length,
        }
