"""Shared, session-scoped test fixtures: one local Ray instance, one local S3 server (moto),
small tokenizers built on the spot (no downloads)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Every Ray process started from the tests inherits these (see shared/notes/RAY_ON_A_SMALL_BOX.md).
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["AWS_EC2_METADATA_DISABLED"] = "true"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def _training_text() -> list[str]:
    """A few hundred KB of Python standard-library source and prose: deterministic, no downloads."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in ("textwrap.py", "heapq.py", "bisect.py", "fnmatch.py", "shlex.py", "this.py"):
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    texts.append("Explain what this function does. Complete the following Python function.\n" * 20)
    return texts


def build_tokenizer(out_dir: Path, special: list[str], template: str, *, bos: str | None, eos: str, pad: str,
                    vocab_size: int = 1200) -> Path:
    """Train a small byte-level BPE and save it as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=template
    )
    fast.save_pretrained(str(out_dir))
    return out_dir


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A ChatML tokenizer (``<|im_start|>role\\ncontent<|im_end|>\\n``), like the tiny target's."""
    return build_tokenizer(
        tmp_path_factory.mktemp("tok-chatml"),
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        CHATML_TEMPLATE,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
    )


@pytest.fixture(scope="session")
def llama3_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer with Llama-3's special tokens and its chat template (BOS, header ids, eot)."""
    return build_tokenizer(
        tmp_path_factory.mktemp("tok-llama3"),
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3_TEMPLATE,
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
    )


@pytest.fixture(scope="session")
def ray_local():
    """One in-process Ray instance for the whole session (start ~5 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",
            include_dashboard=False,
            num_cpus=2,
            object_store_memory=512 * 1024**2,
            log_to_driver=False,
        )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    yield ray
    ray.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1; sets the AWS_* variables for the session. Yields the endpoint."""
    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.skip("moto_server not installed (pip install 'moto[server]')")
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)
    names = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session")
def s3_bucket(s3_server) -> str:
    """A fresh bucket on the local S3 server; yields ``s3://<bucket>``."""
    import boto3

    name = "aerie-test"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A real tiny-target build (tokenizer, chat template, 8-layer Llama) on a capped corpus and a
    handful of steps: seconds, not the demo's minutes."""
    from aerie.target.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny") / "llama", seed=1, steps=3, max_files=8)
