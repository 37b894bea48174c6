"""`aerie generate`: the engine in-process, no Ray. Also the quickest way to try a head."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from aerie.engine import EngineConfig, SamplingParams
from aerie.engine.build import build_engine, check_method
from aerie.target import load_target

Prompt = str | list[dict[str, str]]  # raw text, or chat messages (rendered with the chat template)


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """Prompts from a file: ``.jsonl`` records parsed as ingest parses them (``{"prompt": ...}``,
    ``{"messages": [...]}`` and the other captured formats), so multi-line prompts fit; any other
    file holds one prompt per line. A chat record becomes its messages, a plain prompt its text.
    A line that does not parse raises ``ValueError`` naming the file and line."""
    from aerie.formats import RecordError, parse_line

    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    if not path.name.lower().endswith(".jsonl"):
        return [line for line in lines if line.strip()]
    prompts: list[Prompt] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = parse_line(line, str(path), number)
        except RecordError as e:
            raise ValueError(f"{path}, line {number}: {e}") from None
        if record.kind == "chat":
            prompts.append([m.to_dict() for m in record.messages])
        else:
            prompts.append(record.messages[-1].content)
    return prompts


def render_prompt(tokenizer, prompt: Prompt, chat: bool) -> str:
    """The text the engine gets: chat messages (or, with ``chat``, a text prompt as one user
    message) through the chat template with the generation prompt; otherwise the text as is."""
    if isinstance(prompt, str) and not chat:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def run_generate(
    target: str,
    prompts: list[Prompt],
    method: str = "none",
    head: str | None = None,
    k: int | str = 0,
    tree: bool | None = None,
    lookup: bool = False,
    max_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    max_slots: int = 8,
    chat: bool = False,
) -> Iterator[dict]:
    """Yield `{"prompt", "text", "token_ids", "acceptance_length"}` per prompt, in order.
    With `chat`, each text prompt is sent as one user message through the target's chat template;
    a prompt given as messages always is."""
    check_method(method, head, tree, lookup)
    loaded = load_target(target)
    tokenizer = loaded.tokenizer
    inputs = [render_prompt(tokenizer, p, chat) for p in prompts]
    longest = max(len(tokenizer.encode(p, add_special_tokens=False)) for p in inputs)
    config = EngineConfig(max_slots=max_slots, max_len=longest + max_tokens)
    engine = build_engine(loaded, config, method, head, k, tree=tree, lookup=lookup)
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
