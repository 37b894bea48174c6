"""The `aerie` command line. Each subcommand imports what it needs inside its body, so
`aerie generate` never loads Ray and `aerie --help` stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)


@app.command()
def generate(
    target: Annotated[str, typer.Option(help="Target model directory (local or s3://).")],
    prompt: Annotated[list[str] | None, typer.Option(help="A prompt; repeat for several.")] = None,
    prompts: Annotated[Path | None, typer.Option(help="A file with one prompt per line.")] = None,
    method: Annotated[str, typer.Option(help="Proposer: none|eagle3|peagle|eagle.")] = "none",
    head: Annotated[str | None, typer.Option(help="Draft head directory.")] = None,
    k: Annotated[int, typer.Option(help="Draft tokens per step.")] = 0,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (per prompt: seed + index).")] = None,
    max_slots: Annotated[int, typer.Option(help="Concurrent sequences in the engine.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt and line.")] = False,
) -> None:
    """Generate with the speculative engine in-process (no Ray)."""
    from aerie.generate import run_generate

    texts = list(prompt or [])
    if prompts is not None:
        texts += [line for line in prompts.read_text().splitlines() if line.strip()]
    if not texts:
        raise typer.BadParameter("give --prompt TEXT or --prompts FILE")
    for result in run_generate(
        target=target,
        prompts=texts,
        method=method,
        head=head,
        k=k,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        max_slots=max_slots,
    ):
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(f"--- {result['prompt']!r}\n{result['text']}")


if __name__ == "__main__":
    app()
