"""Load on the Ray Serve endpoint: many concurrent streaming clients, baseline against speculative.

    python benchmarks/serve_load.py --target .aerie/targets/tiny-llama --head eagle3=DIR [--k auto] [--lookup]
        [--clients 32] [--seconds 15] [--single-seconds 5] [--repeats 4] [--max-tokens 64]
        [--out .aerie/bench/serve_load]
    python benchmarks/serve_load.py --winner RUN/bench/winner.json     # the speculative endpoint from a winner

Both endpoints (plain decoding, and the head with adaptive K) run side by side on a local Ray
instance (HTTP on 127.0.0.1 only, one prefix each), with Data Capture on. Windows: one streaming
client for `--single-seconds` per endpoint, then `--clients` closed-loop streaming clients for
`--seconds` per endpoint (a client that gets a 429 waits its Retry-After and goes on), the order of
the endpoints alternating over `--repeats` rounds (B S S B B S ...: each window beside one of the
other endpoint's); then Ray's Prometheus endpoint is read and the applications deleted. The
defaults, 4 rounds of 15 s, give each endpoint 60 s at `--clients`: this box's speed drifts by
tens of percent over a minute (a baseline's two 60 s windows once read 442 and 606 tok/s), so
the speculative / baseline ratio is the median of the rounds' own ratios, windows seconds apart;
the ratio of the pooled windows is printed beside it. Bounded in time (the windows; requests in
flight at the end are awaited at most `--drain-seconds`) and in count (`--max-requests` per
window). Prompts are held-out chat requests of the target's traffic
(`aerie.traffic.synthesize(part="eval")`), greedy.

Reports per endpoint and window: requests started / completed / 429 / 5xx / other failures,
output tok/s (completed tokens over the window until the last request ended), mean TTFT, the
aggregate-over-single-client ratio, and the speculative / baseline ratio at `--clients`; then runs
`aerie ingest` over what both endpoints captured and checks the counts add up (every captured
record read; parsed + quarantined + duplicates + too_long == read). Writes `<out>/serve_load.json`
and `<out>/serve_load.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

for name, value in {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                    "RAY_AUTH_MODE": "disabled", "AWS_EC2_METADATA_DISABLED": "true"}.items():
    os.environ.setdefault(name, value)

import httpx  # noqa: E402
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HOST = "127.0.0.1"


@dataclass
class Window:
    clients: int
    seconds: float
    started: int = 0
    completed: int = 0
    rate_limited: int = 0
    server_errors: int = 0
    failed: int = 0
    tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    duration: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.duration if self.duration else 0.0

    def summary(self) -> dict:
        row = {k: v for k, v in asdict(self).items() if k != "ttfts"}
        mean_ttft = sum(self.ttfts) / len(self.ttfts) if self.ttfts else None
        ended = self.completed + self.rate_limited + self.server_errors + self.failed
        return row | {"output_throughput": round(self.tokens_per_s, 1),
                      "mean_ttft_ms": None if mean_ttft is None else round(1000 * mean_ttft, 1),
                      "accounted": self.started == ended}


async def one_request(client: httpx.AsyncClient, body: dict, window: Window) -> float:
    """One streaming chat completion; returns how long to wait before the next (Retry-After)."""
    window.started += 1
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code == 429:
                window.rate_limited += 1
                return float(response.headers.get("Retry-After", "1"))
            if response.status_code >= 500:
                window.server_errors += 1
                return 0.0
            if response.status_code != 200:
                window.failed += 1
                return 0.0
            first, usage, done = None, None, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    break
                if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - sent
                usage = chunk.get("usage") or usage
    except httpx.HTTPError:
        window.failed += 1
        return 0.0
    if not done or usage is None:
        window.failed += 1
        return 0.0
    window.completed += 1
    window.tokens += usage["completion_tokens"]
    if first is not None:
        window.ttfts.append(first)
    return 0.0


async def run_window(url: str, model: str, prompts: list, clients: int, seconds: float, max_tokens: int,
                     max_requests: int, drain_seconds: float) -> Window:
    window = Window(clients, seconds)
    stop_at = time.monotonic() + seconds
    counter = iter(range(max_requests))
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async def client_loop(client: httpx.AsyncClient, offset: int) -> None:
        for index in counter:
            if time.monotonic() >= stop_at:
                return
            body = {"model": model, "messages": prompts[(offset + index) % len(prompts)], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            pause = await one_request(client, body, window)
            if pause:
                await asyncio.sleep(pause)

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0), limits=limits) as client:
        start = time.monotonic()
        tasks = [asyncio.create_task(client_loop(client, i * 7)) for i in range(clients)]
        _, late = await asyncio.wait(tasks, timeout=seconds + drain_seconds)
        for task in late:
            task.cancel()
        window.failed += len(late)
        window.duration = time.monotonic() - start
    return window


def scrape(port: int, application: str) -> dict:
    """The endpoint's counters and gauges on Ray's Prometheus endpoint (summed over replicas)."""
    text = httpx.get(f"http://{HOST}:{port}/metrics", timeout=10).text
    wanted = ("requests_total", "num_requests_running", "num_requests_waiting", "spec_decode_num_drafts_total",
              "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", "generation_tokens_total")
    out: dict = {}
    for line in text.splitlines():
        match = re.match(r"^ray_aerie_(\w+?)(?:{(.*)})? ([0-9.eE+-]+)$", line)
        if not match or match.group(1) not in wanted or f'application="{application}"' not in (match.group(2) or ""):
            continue
        name, tags = match.group(1), match.group(2) or ""
        if name == "requests_total":
            name += "{" + re.search(r'status="(\d+)"', tags).group(1) + "}"
        out[name] = out.get(name, 0.0) + float(match.group(3))
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def measure(configs: dict, args, prompts) -> list[dict]:
    """Both endpoints deployed side by side (one proxy, a prefix each), windows interleaved: the
    single-client windows, then the loaded ones, the order of the endpoints alternating by round, so
    a drift in the machine's load does not favour either."""
    import ray
    from ray import serve

    from serve_apps.openai_app import deploy

    urls, deployed = {}, {}
    for name, config in configs.items():
        started = time.monotonic()
        urls[name] = deploy(config)
        deployed[name] = round(time.monotonic() - started, 1)
    models = {name: config.resolved().served_model for name, config in configs.items()}
    for name in configs:  # warm up
        asyncio.run(run_window(urls[name], models[name], prompts, 2, 5.0, args.max_tokens, 50, args.drain_seconds))
    windows: dict = {name: {"single": [], "loaded": []} for name in configs}
    for number in range(args.repeats):
        order = list(configs) if number % 2 == 0 else list(configs)[::-1]
        for kind, clients, seconds in (("single", 1, args.single_seconds), ("loaded", args.clients, args.seconds)):
            for name in order:
                window = asyncio.run(run_window(urls[name], models[name], prompts, clients, seconds,
                                                args.max_tokens, args.max_requests, args.drain_seconds))
                windows[name][kind].append(window)
                print(f"{name} {kind}: {json.dumps(window.summary())}", flush=True)
    time.sleep(12)  # Ray exports metrics every few seconds
    port = ray.nodes()[0]["MetricsExportPort"]
    results = []
    for name, config in configs.items():
        stats = httpx.get(f"{urls[name]}/stats", timeout=10).json()
        single, loaded = (merged(windows[name][kind]) for kind in ("single", "loaded"))
        served = config.resolved()
        results.append({
            "endpoint": name, "method": served.method, "k": served.k, "lookup": served.lookup,
            "deploy_seconds": deployed[name],
            "single": single.summary(), "loaded": loaded.summary(),
            "aggregate_over_single": round(loaded.tokens_per_s / single.tokens_per_s, 2) if single.tokens else None,
            "windows": {kind: [w.summary() for w in ws] for kind, ws in windows[name].items()},
            "stats": {k: stats[k] for k in ("decode_steps", "decode_rows", "k_histogram", "spec_decode", "capture")},
            "prometheus": scrape(port, config.name),
        })
        serve.delete(config.name)  # graceful: the replica writes what it has captured
    return results


def merged(windows: list[Window]) -> Window:
    """The repeats of one window as one: counts and durations added."""
    out = Window(windows[0].clients, sum(w.seconds for w in windows))
    for w in windows:
        for name in ("started", "completed", "rate_limited", "server_errors", "failed", "tokens", "duration"):
            setattr(out, name, getattr(out, name) + getattr(w, name))
        out.ttfts += w.ttfts
    return out


def ingest_capture(capture_root: Path, target: str, out: Path) -> dict:
    from aerie import storage
    from aerie.data.ingest_config import IngestConfig
    from pipelines.ingest import run_ingest

    files = storage.list_files(str(capture_root), (".jsonl",))
    lines = sum(storage.read_text(f).count("\n") for f in files)
    counts = run_ingest(IngestConfig(input=str(capture_root), target=target, out=str(out), progress=False))["counts"]
    adds_up = counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    return {"capture_files": len(files), "captured_lines": lines, "counts": counts,
            "adds_up": adds_up and counts["read"] == lines}


def plot(results: list[dict], path: Path, clients: int) -> None:
    figure, axis = plt.subplots(figsize=(6, 4))
    names = [r["endpoint"] for r in results]
    width = 0.38
    xs = range(len(names))
    axis.bar([x - width / 2 for x in xs], [r["single"]["output_throughput"] for r in results], width, label="1 client")
    axis.bar([x + width / 2 for x in xs], [r["loaded"]["output_throughput"] for r in results], width,
             label=f"{clients} clients")
    axis.set_xticks(list(xs), names)
    axis.set_ylabel("output tok/s (streamed over HTTP)")
    axis.set_title("Ray Serve endpoint under load")
    axis.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2, frameon=False)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=".aerie/targets/tiny-llama")
    parser.add_argument("--head", help="METHOD=DIR of the speculative endpoint (or --winner)")
    parser.add_argument("--winner", help="winner.json of the speculative endpoint")
    parser.add_argument("--k", default="auto", help="K of the speculative endpoint with --head (int or auto)")
    parser.add_argument("--lookup", action="store_true", help="with --head: prompt lookup first, the head elsewhere")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--single-seconds", type=float, default=5.0)
    parser.add_argument("--drain-seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=4, help="rounds of windows, endpoints alternating")
    parser.add_argument("--max-requests", type=int, default=5000, help="per window")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-slots", type=int, default=32)
    parser.add_argument("--max-waiting", type=int, default=32)
    parser.add_argument("--num-cpus", type=float, default=1.0, help="CPUs per replica")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--out", default=".aerie/bench/serve_load")
    args = parser.parse_args()
    if (args.head is None) == (args.winner is None):
        parser.error("give --head METHOD=DIR or --winner FILE")

    import ray

    from aerie.serving.config import ServeConfig
    from aerie.target.model import load_target
    from aerie.traffic import synthesize

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    capture_root = out / "capture"
    tokenizer = load_target(args.target, device="cpu").tokenizer
    prompts = [ex.messages for ex in synthesize(args.prompts, seed=23, tokenizer=tokenizer, max_tokens=768,
                                                part="eval")]
    common = dict(port=free_port(), max_slots=args.max_slots, max_waiting=args.max_waiting, max_len=1024,
                  num_cpus=args.num_cpus)
    if args.winner:
        speculative = ServeConfig(winner=args.winner, name="speculative", **common)
        target = speculative.resolved().target
    else:
        method, head = args.head.split("=", 1)
        k = args.k if args.k == "auto" else int(args.k)
        target = args.target
        speculative = ServeConfig(target=target, method=method, head=head, k=k, lookup=args.lookup,
                                  name="speculative", **common)
    baseline = ServeConfig(target=target, name="baseline", **common)
    ray.init(address="local", include_dashboard=False, num_cpus=2, object_store_memory=512 * 1024**2,
             log_to_driver=False)
    configs = {name: config.model_copy(update={"capture": _capture(capture_root, name), "route_prefix": f"/{name}"})
               for name, config in (("baseline", baseline), ("speculative", speculative))}
    results = measure(configs, args, prompts)
    from ray import serve

    serve.shutdown()
    ingested = ingest_capture(capture_root, target, out / "ingested")
    ray.shutdown()
    base, spec = ([w["output_throughput"] for w in r["windows"]["loaded"]] for r in results)
    by_round = [round(s / max(b, 1e-9), 3) for s, b in zip(spec, base, strict=True)]
    pooled = results[1]["loaded"]["output_throughput"] / max(results[0]["loaded"]["output_throughput"], 1e-9)
    report = {"clients": args.clients, "seconds": args.seconds, "repeats": args.repeats, "max_tokens": args.max_tokens,
              "max_slots": args.max_slots, "endpoints": results,
              "speculative_over_baseline": round(statistics.median(by_round), 3),
              "speculative_over_baseline_by_round": by_round,
              "speculative_over_baseline_pooled": round(pooled, 3), "ingest": ingested}
    (out / "serve_load.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(results, out / "serve_load.png", args.clients)
    print(f"\n| endpoint | 1 client tok/s | {args.clients} clients tok/s | x single | completed | 429 | 5xx | other |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        single, loaded = r["single"], r["loaded"]
        method = r["method"] + ("+lookup" if r["lookup"] else "")
        print(f"| {r['endpoint']} ({method}, k={r['k']}) | {single['output_throughput']} | "
              f"{loaded['output_throughput']} | {r['aggregate_over_single']} | {loaded['completed']} | "
              f"{loaded['rate_limited']} | {loaded['server_errors']} | {loaded['failed']} |")
    print(f"\nspeculative / baseline at {args.clients} clients: {report['speculative_over_baseline']} (median of the "
          f"rounds {by_round}; pooled windows: {report['speculative_over_baseline_pooled']})")
    print(f"ingest of the captured traffic: {ingested['counts']} adds up: {ingested['adds_up']}")
    print(f"wrote {out / 'serve_load.json'} and {out / 'serve_load.png'}")


def _capture(root: Path, name: str):
    from aerie.serving.config import CaptureConfig

    return CaptureConfig(destination=str(root), endpoint=name, flush_seconds=2.0)


if __name__ == "__main__":
    main()
