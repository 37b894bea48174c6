"""Ingest throughput: records/s for read + parse + chat template + tokenize + loss mask of
SageMaker Data Capture JSONL, on a warm local Ray instance.

    .venv/bin/python benchmarks/ingest.py [--records 50000] [--target DIR] [--input URI] [--cpus 2] [--repeats 3]

Without ``--input`` it writes ``--records`` synthetic Data Capture records (``aerie.traffic``) to a
temporary folder; without ``--target`` it trains a small ChatML byte-level BPE tokenizer on the
standard library. One untimed pass warms Ray's workers (imports, tokenizer), then ``--repeats``
timed passes run the same pipeline as ``pipelines/ingest.py`` up to the encoded, materialised data
set (no dedupe scan, no writes). Goal: >= 5,000 records/s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "AWS_EC2_METADATA_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(out: Path, vocab_size: int = 8192) -> Path:
    """A ChatML byte-level BPE trained on ~2 MB of standard-library source (a few seconds)."""
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts, size = [], 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > 2_000_000:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML
    ).save_pretrained(str(out))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=50_000, help="Synthetic records to write (without --input).")
    p.add_argument("--input", default=None, help="Existing Data Capture prefix (local or s3://).")
    p.add_argument("--target", default=None, help="Target model dir (tokenizer + chat template).")
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--keep", action="store_true", help="Keep the temporary data and tokenizer.")
    args = p.parse_args()

    import ray

    from aerie.traffic import generate_traffic
    from pipelines.ingest import data_context, encode, list_inputs, load_tokenizer, read_and_parse

    work = Path(tempfile.mkdtemp(prefix="aerie-bench-ingest-"))
    target = args.target or str(build_tokenizer(work / "tokenizer"))
    source = args.input
    if source is None:
        source = str(work / "capture")
        t = time.perf_counter()
        generate_traffic(target, source, requests=args.records, seed=0, records_per_file=2000)
        print(f"wrote {args.records} Data Capture records in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    files = list_inputs(source)
    tokenizer = load_tokenizer(target)

    t = time.perf_counter()
    ray.init(address="local", include_dashboard=False, num_cpus=args.cpus,
             object_store_memory=1024**3, log_to_driver=False)
    print(f"ray.init {time.perf_counter() - t:.1f} s", file=sys.stderr)

    def parse_only() -> tuple[int, float]:
        t0 = time.perf_counter()
        n = read_and_parse(files).materialize().count()
        return n, time.perf_counter() - t0

    def parse_and_encode() -> tuple[int, float]:
        t0 = time.perf_counter()
        out = encode(read_and_parse(files), tokenizer, max_tokens=args.max_tokens, batch_size=None)
        n = out.materialize().count()
        return n, time.perf_counter() - t0

    load_before = os.getloadavg()[0]
    with data_context(progress=False):
        n, warm = parse_and_encode()
        print(f"warm-up pass: {n} records in {warm:.2f} s", file=sys.stderr)
        parse_s, total_s = [], []
        for _ in range(args.repeats):
            records, a = parse_only()
            parse_s.append(a)
            encoded, b = parse_and_encode()
            total_s.append(b)
    med, med_parse = statistics.median(total_s), statistics.median(parse_s)
    print(f"records: {records} ({encoded} encoded)  files: {len(files)}  cpus: {args.cpus}  runs: {args.repeats}")
    print(f"parse only:       {records / med_parse:,.0f} records/s  (median {med_parse:.2f} s)")
    print(f"parse + tokenize: {records / med:,.0f} records/s  (median {med:.2f} s, best {min(total_s):.2f} s)")
    print(f"machine load average (1 min) before/after: {load_before:.1f} / {os.getloadavg()[0]:.1f}"
          f" on {os.cpu_count()} cores (other processes' load lowers the figure)")
    ray.shutdown()
    if args.keep:
        print(f"kept {work}", file=sys.stderr)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
