"""The `aerie` command line. Each subcommand imports what it needs inside its body, so
`aerie generate` never loads Ray and `aerie --help` stays fast."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

# No rich markup: help texts hold literal brackets ("sagemaker://ENDPOINT[/VARIANT]", "[default: ...]").
app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__, rich_markup_mode=None)


@app.command("tiny-target")
def tiny_target(
    out: Annotated[Path, typer.Option(help="Output directory (a Hugging Face model dir).")],
    arch: Annotated[str, typer.Option(help="llama | qwen3.")] = "llama",
    minutes: Annotated[float, typer.Option(help="Training budget, as a fixed calibrated step count.")] = 5.0,
    seed: Annotated[int, typer.Option(help="Same seed and steps, same model bytes.")] = 0,
    steps: Annotated[int | None, typer.Option(help="Optimizer steps; overrides --minutes.")] = None,
    corpus: Annotated[list[Path] | None, typer.Option(
        help="A folder of Python source to train on instead of the standard library (repeatable).")] = None,
    hidden_size: Annotated[int, typer.Option(help="Model width (a multiple of 64).")] = 256,
    vocab_size: Annotated[int, typer.Option(help="Tokenizer vocabulary size.")] = 4096,
) -> None:
    """Build the tiny default target (tokenizer + small model trained on the stdlib source, or on
    --corpus folders); cached."""
    import os

    # Idle OpenMP threads sleep instead of spinning: on a shared 2-core box, spinning made each
    # step 5-15x slower (a spinning thread holds the core its partner needs). Set before torch loads.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from aerie.target.tiny import ARCHS, build_tiny_target

    if arch not in ARCHS:
        raise typer.BadParameter(f"must be one of {', '.join(ARCHS)}", param_hint="--arch")
    built = build_tiny_target(
        out, arch=arch, minutes=minutes, seed=seed, steps=steps, corpus=corpus, hidden_size=hidden_size,
        vocab_size=vocab_size,
    )
    typer.echo(json.dumps({"out": str(built), **json.loads((built / "build.json").read_text())["results"]}))


@app.command()
def generate(
    target: Annotated[str, typer.Option(help="Target model directory (local or s3://).")],
    prompt: Annotated[list[str] | None, typer.Option(help="A prompt; repeat for several.")] = None,
    prompts: Annotated[Path | None, typer.Option(
        help="A .jsonl file of records ({\"prompt\"} or {\"messages\"}, as ingest reads them), or one prompt per line."
    )] = None,
    method: Annotated[str, typer.Option(help="Proposer: none|ngram|eagle3|peagle|eagle.")] = "none",
    head: Annotated[str | None, typer.Option(help="Draft head directory.")] = None,
    k: Annotated[str, typer.Option(
        help="Draft tokens per step (0: the head's default), or 'auto': chosen every step.")] = "0",
    tree: Annotated[bool | None, typer.Option(
        "--tree/--chain", help="Draft a dynamic tree (EAGLE-2 style) or a chain. [default: tree for eagle]")] = None,
    lookup: Annotated[bool, typer.Option(
        "--lookup", help="Rows whose context repeats draft by prompt lookup, the others with the head.")] = False,
    max_tokens: Annotated[int, typer.Option(help="Most new tokens per prompt.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 means greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    seed: Annotated[int | None, typer.Option(help="Sampling seed (per prompt: seed + index).")] = None,
    max_slots: Annotated[int, typer.Option(help="Concurrent sequences in the engine.")] = 8,
    chat: Annotated[bool, typer.Option("--chat", help="Send each prompt as a user message (chat template).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per prompt and line.")] = False,
) -> None:
    """Generate with the speculative engine in-process (no Ray)."""
    from aerie.generate import read_prompt_file, run_generate

    texts: list = list(prompt or [])
    if prompts is not None:
        try:
            texts += read_prompt_file(prompts)
        except (OSError, ValueError) as e:
            raise typer.BadParameter(str(e), param_hint="--prompts") from None
    if not texts:
        raise typer.BadParameter("give --prompt TEXT or --prompts FILE")
    for result in run_generate(
        target=target,
        prompts=texts,
        method=method,
        head=head,
        k=k if k == "auto" else _int_option(k, "--k"),
        tree=tree,
        lookup=lookup,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        max_slots=max_slots,
        chat=chat,
    ):
        if as_json:
            typer.echo(json.dumps(result))
        else:
            typer.echo(f"--- {result['prompt']!r}\n{result['text']}")


def _int_option(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not an integer", param_hint=name) from None


@app.command()
def traffic(
    target: Annotated[str, typer.Option(help="Target model dir; its tokenizer keeps requests in range (optional).")],
    out: Annotated[str, typer.Option(help="Where to write the captured traffic (local or s3://).")],
    requests: Annotated[int, typer.Option(min=1, help="How many requests to synthesise.")] = 1000,
    format: Annotated[str, typer.Option(help="sagemaker | openai | sharegpt.")] = "sagemaker",
    seed: Annotated[int, typer.Option(help="Same seed, same files.")] = 0,
    max_tokens: Annotated[int, typer.Option(min=64, help="Longest request + reply, in tokens.")] = 1024,
    endpoint: Annotated[str, typer.Option(help="Endpoint name in the Data Capture layout.")] = "aerie-demo",
    variant: Annotated[str, typer.Option(help="Variant name in the Data Capture layout.")] = "AllTraffic",
    source: Annotated[list[Path] | None, typer.Option(
        help="A folder of Python source to draw requests from instead of the standard library (repeatable).")] = None,
    part: Annotated[str, typer.Option(
        help="all | train | eval: eval is one source file in five (by path hash), train the rest.")] = "all",
) -> None:
    """Synthesise captured requests (code completion, explain-this-function) from the stdlib source
    (or --source folders)."""
    from aerie.traffic import FORMATS, PARTS, generate_traffic

    if format not in FORMATS:
        raise typer.BadParameter(f"must be one of {', '.join(FORMATS)}", param_hint="--format")
    if part not in PARTS:
        raise typer.BadParameter(f"must be one of {', '.join(PARTS)}", param_hint="--part")
    summary = generate_traffic(
        target, out, requests=requests, fmt=format, seed=seed, max_tokens=max_tokens,
        endpoint=endpoint, variant=variant, sources=tuple(map(str, source)) if source else None, part=part,
    )
    typer.echo(json.dumps(summary))


@app.command()
def ingest(
    input: Annotated[list[str], typer.Option("--input", help=(
        "Captured traffic: folder, file, s3:// prefix or sagemaker://ENDPOINT[/VARIANT]; repeat to read several."
    ))],
    target: Annotated[str, typer.Option(help="Target model dir (tokenizer + chat template), local or s3://.")],
    out: Annotated[str, typer.Option(help="Output folder or s3:// prefix (manifest.json + its version folder).")],
    max_tokens: Annotated[int, typer.Option(help="Longest example kept, in tokens.")] = 2048,
    eval_fraction: Annotated[float, typer.Option(help="Share of records (by id hash) held out for eval.")] = 0.05,
    eval_min_records: Annotated[int, typer.Option(
        help="Eval holds at least this many records, up to a quarter of them."
    )] = 16,
    max_line_bytes: Annotated[int, typer.Option(help="Longer raw lines are quarantined.")] = 16 * 1024 * 1024,
    progress: Annotated[bool, typer.Option(help="Show Ray Data progress bars.")] = True,
    regenerate: Annotated[bool, typer.Option(
        "--regenerate", help="Replace every reply with the target's own (recommended: higher acceptance)."
    )] = False,
    regenerate_max_tokens: Annotated[int, typer.Option(help="Longest regenerated reply, in tokens.")] = 512,
    regenerate_temperature: Annotated[float, typer.Option(help="Regeneration temperature; 0 is greedy.")] = 0.0,
    regenerate_seed: Annotated[int, typer.Option(help="Per-record seeds are hashed from this and the id.")] = 0,
    regenerate_actors: Annotated[int, typer.Option(help="Engine actors in the regeneration pool.")] = 1,
    regenerate_num_gpus: Annotated[float, typer.Option(help="GPUs per regeneration actor (1 on GPUs).")] = 0.0,
    regenerate_max_failure_rate: Annotated[float, typer.Option(
        help="Share of rows the engine may fail on before the job fails."
    )] = 0.01,
    since: Annotated[str | None, typer.Option(
        help="sagemaker:// inputs: only hours from this ISO time or duration back (24h, 7d) on."
    )] = None,
) -> None:
    """Captured traffic -> tokenized Parquet with loss masks, quarantine and manifest (Ray Data);
    --regenerate rewrites the replies with the target itself."""
    from pydantic import ValidationError

    from pipelines.ingest import IngestConfig, format_validation_error, run_ingest

    try:
        cfg = IngestConfig(
            input=input[0] if len(input) == 1 else input, since=since, target=target, out=out,
            max_tokens=max_tokens, eval_fraction=eval_fraction, eval_min_records=eval_min_records,
            max_line_bytes=max_line_bytes, progress=progress,
            regenerate=regenerate, regenerate_max_tokens=regenerate_max_tokens,
            regenerate_temperature=regenerate_temperature, regenerate_seed=regenerate_seed,
            regenerate_actors=regenerate_actors, regenerate_num_gpus=regenerate_num_gpus,
            regenerate_max_failure_rate=regenerate_max_failure_rate,
        )
    except ValidationError as e:
        raise typer.BadParameter(format_validation_error(e)) from None
    try:
        manifest = run_ingest(cfg)
    except FileNotFoundError as e:
        typer.echo(f"error: not found: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(manifest["counts"]))


@app.command()
def train(
    data: Annotated[str | None, typer.Option(help="Ingest output (its manifest.json), local or s3://.")] = None,
    target: Annotated[str | None, typer.Option(help="Target model directory, local or s3://.")] = None,
    method: Annotated[str | None, typer.Option(help="eagle3 | peagle | eagle.")] = None,
    out: Annotated[str | None, typer.Option(help="Where the trained head is exported (local or s3://).")] = None,
    workers: Annotated[int | None, typer.Option(help="Ray Train workers (DDP). [default: 2]")] = None,
    epochs: Annotated[int | None, typer.Option(
        help="Passes over the training data. [default: the automatic budget, with early stopping]"
    )] = None,
    warm_start: Annotated[str | None, typer.Option(help="Start from this head directory.")] = None,
    config: Annotated[str | None, typer.Option(help="YAML config file; flags override it.")] = None,
    name: Annotated[str | None, typer.Option(help="Run name; rerunning with the same name resumes.")] = None,
    storage: Annotated[str | None, typer.Option(help="Run storage (checkpoints), local or s3://.")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many optimizer steps.")] = None,
    batch_size: Annotated[int | None, typer.Option(help="Sequences per worker and step.")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    use_gpu: Annotated[bool | None, typer.Option(help="One GPU per worker (NCCL).")] = None,
    seed: Annotated[int | None, typer.Option(help="Head init, data order and sampling seed.")] = None,
    progress: Annotated[bool | None, typer.Option(help="Progress bar in the driver.")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Any other config field: FIELD=VALUE (repeatable).")
    ] = None,
) -> None:
    """Fit a draft head across Ray Train workers (DDP): checkpoints, resume, export to --out."""
    from train_jobs.config import ConfigError, parse_sets
    from train_jobs.fit_heads import cli_run

    flags = dict(
        data=data, target=target, method=method, out=out, workers=workers, epochs=epochs, warm_start=warm_start,
        name=name, storage=storage, max_steps=max_steps, batch_size=batch_size, lr=lr, use_gpu=use_gpu,
        seed=seed, progress=progress,
    )
    try:
        overrides = {**parse_sets(set_), **{k: v for k, v in flags.items() if v is not None}}
    except ConfigError as e:
        raise typer.BadParameter(str(e), param_hint="--set") from None
    code = cli_run(config, overrides)
    if code:
        raise typer.Exit(code)


def _csv(value: str | None, name: str, allow_auto: bool = False) -> list | None:
    """'1,4,16' -> [1, 4, 16] ('auto' kept where allowed); None stays None."""
    if value is None:
        return None
    items = []
    for part in (p.strip() for p in value.split(",")):
        if allow_auto and part == "auto":
            items.append(part)
        elif part:
            items.append(_int_option(part, name))
    return items


def _pairs(values: list[str] | None, name: str) -> dict[str, str]:
    pairs = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise typer.BadParameter(f"{item!r}: expected METHOD=VALUE", param_hint=name)
        pairs[key] = value
    return pairs


def _config_file(path: str | None) -> dict:
    """The --config file's field: value mapping (empty without one)."""
    from aerie.config_io import read_mapping

    try:
        return read_mapping(path) if path is not None else {}
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--config") from None


@app.command()
def bench(
    target: Annotated[str | None, typer.Option(help="Target model directory (local or s3://).")] = None,
    head: Annotated[list[str] | None, typer.Option(
        help="A draft head to measure: METHOD=DIR, METHOD eagle3 | peagle | eagle (repeatable).")] = None,
    prompts: Annotated[str | None, typer.Option(
        help="An `aerie ingest` output (its eval split: your own traffic) or a .jsonl prompts file.")] = None,
    out: Annotated[str | None, typer.Option(help="Report folder (local or s3://).")] = None,
    concurrency: Annotated[str | None, typer.Option(help="Closed-loop client counts. [default: 1,2,4,8]")] = None,
    k: Annotated[str | None, typer.Option(
        help="Draft tokens per step for every head; 'auto' adds adaptive K. [default: 2,3,5]")] = None,
    k_per_method: Annotated[list[str] | None, typer.Option(
        help="K for one method instead of --k: METHOD=K,K (e.g. peagle=4,6; ngram=3) (repeatable).")] = None,
    requests: Annotated[int | None, typer.Option(help="Measured requests per cell. [default: 16]")] = None,
    warmup: Annotated[int | None, typer.Option(
        help="Unmeasured requests before them, per cell. [default: one per client]")] = None,
    repeats: Annotated[int | None, typer.Option(help="Rounds, variants interleaved. [default: 3]")] = None,
    max_tokens: Annotated[int | None, typer.Option(help="New tokens per request. [default: 64]")] = None,
    max_prompts: Annotated[int | None, typer.Option(help="Prompts used. [default: 64]")] = None,
    peers: Annotated[bool | None, typer.Option(
        "--peers", help="Also measure Hugging Face generate, greedy and with prompt lookup (concurrency 1).")] = None,
    ngram: Annotated[bool | None, typer.Option(help="Measure prompt lookup (no head). [default: on]")] = None,
    lookup_first: Annotated[bool | None, typer.Option(
        help="Also measure each head's chain after prompt lookup (eagle3+lookup). [default: on]")] = None,
    incumbent: Annotated[str | None, typer.Option(
        help="winner.json of the serving deployment: measured as variant 'incumbent'.")] = None,
    expected_concurrency: Annotated[int | None, typer.Option(
        help="Winner policy: the load to optimise for. [default: the highest --concurrency]")] = None,
    sla_p99_tpot_ms: Annotated[float | None, typer.Option(help="Winner policy: most p99 TPOT (ms).")] = None,
    sla_p99_ttft_ms: Annotated[float | None, typer.Option(help="Winner policy: most p99 TTFT (ms).")] = None,
    num_cpus: Annotated[float | None, typer.Option(help="CPUs reserved per engine actor. [default: 0.1]")] = None,
    num_gpus: Annotated[float | None, typer.Option(
        help="GPUs per engine actor (e.g. 0.1 for ten variants on one GPU). [default: 0]")] = None,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads per engine actor. [default: 1]")] = None,
    progress: Annotated[bool | None, typer.Option(help="Progress bars. [default: on]")] = None,
    config: Annotated[str | None, typer.Option(help="YAML file of BenchConfig fields; flags override it.")] = None,
) -> None:
    """Benchmark the baseline, prompt lookup and every head x K over concurrency as a Ray DAG, check
    every output is lossless, write the report (results.json/.parquet, report.md, plots) and
    winner.json. The default sweep (concurrency 1,2,4,8; K 2,3,5 for an EAGLE-3 and a P-EAGLE head,
    each also after prompt lookup; baseline and prompt lookup; 3 rounds of 16 requests x 64 tokens
    per cell: 168 cells) runs 14 engine actors. With --no-lookup-first, its 96 cells took 15-20
    minutes on the tiny target on 2 CPU cores (with --peers: 15 minutes on a quiet 2-core box, 21
    minutes on a shared one; under a minute of it starting the 8 engine actors)."""
    from pydantic import ValidationError

    from aerie.bench.config import BenchConfig
    from aerie.config_io import format_errors

    values = _config_file(config)
    flags = dict(
        target=target, heads=_pairs(head, "--head") or None, prompts=prompts, out=out,
        concurrency=_csv(concurrency, "--concurrency"), k=_csv(k, "--k", allow_auto=True),
        k_per_method={m: _csv(v, "--k-per-method", allow_auto=True) for m, v in _pairs(k_per_method,
                                                                                     "--k-per-method").items()} or None,
        requests=requests, warmup=warmup, repeats=repeats, max_tokens=max_tokens, max_prompts=max_prompts,
        peers=peers, ngram=ngram, lookup_first=lookup_first, incumbent=incumbent,
        expected_concurrency=expected_concurrency, sla_p99_tpot_ms=sla_p99_tpot_ms, sla_p99_ttft_ms=sla_p99_ttft_ms,
        num_cpus=num_cpus, num_gpus=num_gpus, threads=threads, progress=progress,
    )
    values |= {key: value for key, value in flags.items() if value is not None}
    try:
        cfg = BenchConfig(**values)
    except ValidationError as e:
        raise typer.BadParameter("\n" + format_errors(e)) from None
    from pipelines.benchmark import run_benchmark

    summary = run_benchmark(cfg)
    typer.echo(json.dumps({key: summary[key] for key in ("report", "winner_path", "disqualified", "wall_seconds")}
                          | {"winner": summary["winner"]["metrics"]["variant"]}))


@app.command()
def serve(
    winner: Annotated[str | None, typer.Option(help="A benchmark's winner.json: target, method, head, K.")] = None,
    target: Annotated[str | None, typer.Option(help="Target model dir (local or s3://), without --winner.")] = None,
    method: Annotated[str | None, typer.Option(help="none | ngram | eagle3 | peagle | eagle. [default: none]")] = None,
    head: Annotated[str | None, typer.Option(help="Draft head directory for eagle3 / peagle / eagle.")] = None,
    k: Annotated[str | None, typer.Option(help="Draft tokens per step (0: the head's), or 'auto' (adaptive).")] = None,
    tree: Annotated[bool | None, typer.Option("--tree/--chain", help="Draft a tree or a chain.")] = None,
    lookup: Annotated[bool | None, typer.Option(
        "--lookup", help="Rows whose context repeats draft by prompt lookup, the others with the head.")] = None,
    host: Annotated[str | None, typer.Option(help="HTTP host. [default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option(help="HTTP port. [default: 8000]")] = None,
    api_key: Annotated[str | None, typer.Option(
        envvar="AERIE_API_KEY", help="Require `Authorization: Bearer KEY` (or set AERIE_API_KEY).")] = None,
    capture: Annotated[str | None, typer.Option(
        help="Capture the traffic (SageMaker Data Capture layout) under this folder or s3:// prefix.")] = None,
    write_config: Annotated[str | None, typer.Option(
        help="Write a Serve config for `serve deploy` / `serve run` to this file and exit.")] = None,
    vllm_config: Annotated[str | None, typer.Option(
        help="Write a Ray Serve LLM (vLLM) config with the head as speculative_config to this file and exit.")] = None,
    config: Annotated[str | None, typer.Option(help="YAML file of ServeConfig fields; flags override it.")] = None,
    name: Annotated[str | None, typer.Option(help="Serve application name. [default: aerie]")] = None,
    model_name: Annotated[str | None, typer.Option(help="Model id for clients. [default: the target's name]")] = None,
    max_slots: Annotated[int | None, typer.Option(help="Sequences batched per replica. [default: 8]")] = None,
    max_len: Annotated[int | None, typer.Option(help="Prompt + completion tokens. [default: 2048]")] = None,
    max_waiting: Annotated[int | None, typer.Option(help="Queued per replica before 429. [default: 32]")] = None,
    num_replicas: Annotated[int | None, typer.Option(help="Replicas. [default: 1]")] = None,
    num_cpus: Annotated[float | None, typer.Option(help="CPUs per replica. [default: 1]")] = None,
    num_gpus: Annotated[float | None, typer.Option(help="GPUs per replica. [default: 0]")] = None,
) -> None:
    """The OpenAI-compatible endpoint on Ray Serve (continuous batching, streaming, metrics, data
    capture); blocks until Ctrl-C. With --write-config / --vllm-config: write deploy configs instead."""
    from pydantic import ValidationError

    from aerie.config_io import format_errors
    from aerie.serving.config import ServeConfig

    values = _config_file(config)
    flags = dict(
        winner=winner, target=target, method=method, head=head, tree=tree, lookup=lookup, host=host, port=port,
        api_key=api_key,
        name=name, model_name=model_name, max_slots=max_slots, max_len=max_len, max_waiting=max_waiting,
        num_replicas=num_replicas, num_cpus=num_cpus, num_gpus=num_gpus,
        k=None if k is None else k if k == "auto" else _int_option(k, "--k"),
    )
    values |= {key: value for key, value in flags.items() if value is not None}
    if capture is not None:
        values["capture"] = {**(values.get("capture") or {}), "destination": capture}
    try:
        cfg = ServeConfig(**values)
    except ValidationError as e:
        raise typer.BadParameter("\n" + format_errors(e)) from None
    if write_config is None and vllm_config is None:
        from serve_apps.openai_app import run

        run(cfg, announce=typer.echo)
        return
    from aerie.serving.deploy_configs import serve_config
    from aerie.serving.deploy_configs import vllm_config as llm_config
    from aerie.serving.deploy_configs import write_config as write
    from serve_apps.config_check import check_serve_config, check_vllm_config

    written = {}
    if write_config is not None:
        document = serve_config(cfg)
        check_serve_config(document)
        write(write_config, document, "Ray Serve config written by `aerie serve --write-config`.\n"
              "serve deploy THIS_FILE (a running cluster: `ray start --head` first) or serve run THIS_FILE.")
        written["serve_config"] = write_config
    if vllm_config is not None:
        document = llm_config(cfg)
        check_vllm_config(document)
        write(vllm_config, document, "Ray Serve LLM (vLLM) config written by `aerie serve --vllm-config`.\n"
              "On a GPU cluster with `pip install 'ray[llm]'`: serve run THIS_FILE")
        written["vllm_config"] = vllm_config
    typer.echo(json.dumps(written))


@app.command()
def optimize(
    config: Annotated[str | None, typer.Option(help="YAML OptimizeConfig (local or s3://); flags override it.")] = None,
    continue_from: Annotated[str | None, typer.Option(
        help="The serving run's folder: this run is its next cycle (continuous optimization).")] = None,
    name: Annotated[str | None, typer.Option(help="Run name; rerunning it skips the complete stages.")] = None,
    input: Annotated[str | None, typer.Option(
        "--input", help="Captured traffic: folder, s3:// prefix or sagemaker://ENDPOINT[/VARIANT].")] = None,
    target: Annotated[str | None, typer.Option(help="Target model directory (local or s3://).")] = None,
    storage: Annotated[str | None, typer.Option(help="Where runs live (local or s3://).")] = None,
) -> None:
    """Captured traffic -> ingest (regenerated replies) -> heads -> benchmark -> the winner on Ray
    Serve, as one job; `ray job submit -- python -m pipelines.optimize` runs the same."""
    from pipelines.optimize import cli_run

    code = cli_run(config, continue_from, name=name, input=input, target=target, storage=storage)
    if code:
        raise typer.Exit(code)


def main() -> None:
    """The console script: bad input ends with a one-line error and exit status 2, no traceback."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    try:
        app()
    except (ValueError, FileNotFoundError) as error:
        typer.echo(f"aerie: error: {error}", err=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
