"""Deploy configs written by `aerie serve --write-config` and `aerie serve --vllm-config`.

Both are Ray Serve config files (``serve deploy FILE`` on a running cluster, ``serve run FILE``
in the foreground), HTTP on the config's host (127.0.0.1 unless told otherwise):

- `serve_config`: this package's endpoint, ``import_path: serve_apps.openai_app:build_app`` with
  the `ServeConfig` as `args` (local paths made absolute: Serve imports the builder in another
  process and working directory).
- `vllm_config`: the GPU-cluster path, Ray Serve LLM's ``ray.serve.llm:build_openai_app`` with one
  `LLMConfig` whose ``engine_kwargs.speculative_config`` is vLLM's: the exported head as `model`,
  `method` (eagle3, or eagle for an EAGLE head; P-EAGLE is eagle3 with ``parallel_drafting:
  true``), ``num_speculative_tokens``, and for adaptive K (``k: auto``) the winner's K by
  concurrency as vLLM's ``num_speculative_tokens_per_batch_size`` schedule. vLLM drafts chains: a
  tree winner is written as a chain of its depth.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

from aerie import storage
from aerie.engine.build import NGRAM_K
from aerie.engine.ngram import NgramProposer
from aerie.serving.config import ServeConfig, ServedModel

SERVE_IMPORT_PATH = "serve_apps.openai_app:build_app"
VLLM_IMPORT_PATH = "ray.serve.llm:build_openai_app"
VLLM_METHODS = {"eagle3": "eagle3", "peagle": "eagle3", "eagle": "eagle"}
NGRAM_MAX_N: int = inspect.signature(NgramProposer).parameters["max_n"].default
MODEL_PATH_FIELDS = ("winner", "target", "head")


def absolute(uri: str) -> str:
    return uri if storage.is_s3(uri) else str(Path(uri).expanduser().resolve())


def _http(config: ServeConfig) -> dict[str, Any]:
    return {"proxy_location": "HeadOnly", "http_options": {"host": config.host, "port": config.port}}


def with_absolute_paths(config: ServeConfig) -> ServeConfig:
    """The config with its local paths absolute: replicas (and Serve's builder) run in other
    processes, possibly in another working directory."""
    update: dict[str, Any] = {name: absolute(getattr(config, name)) for name in MODEL_PATH_FIELDS
                              if getattr(config, name) is not None}
    if config.capture is not None:
        update["capture"] = config.capture.model_copy(update={"destination": absolute(config.capture.destination)})
    return config.model_copy(update=update)


def serve_config(config: ServeConfig) -> dict[str, Any]:
    """The Serve config of this endpoint."""
    args = with_absolute_paths(config).model_dump(mode="json", exclude_none=True,
                                                  exclude={"host", "port", "name", "route_prefix"})
    app = {"name": config.name, "route_prefix": config.route_prefix, "import_path": SERVE_IMPORT_PATH, "args": args}
    return {**_http(config), "applications": [app]}


def vllm_config(config: ServeConfig) -> dict[str, Any]:
    """The same model served by vLLM through Ray Serve LLM (needs GPUs and `ray[llm]`)."""
    model = config.resolved()
    engine_kwargs: dict[str, Any] = {"max_model_len": config.max_len}
    speculative = speculative_config(model)
    if speculative is not None:
        engine_kwargs["speculative_config"] = speculative
    if config.autoscaling is not None:
        deployment = {"autoscaling_config": config.autoscaling.model_dump()}
    else:
        deployment = {"num_replicas": config.num_replicas}
    llm = {
        "model_loading_config": {"model_id": model.served_model, "model_source": absolute(model.target)},
        "engine_kwargs": engine_kwargs,
        "deployment_config": deployment,
    }
    app = {"name": config.name, "route_prefix": config.route_prefix, "import_path": VLLM_IMPORT_PATH,
           "args": {"llm_configs": [llm]}}
    return {**_http(config), "applications": [app]}


def speculative_config(model: ServedModel) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for a served model (None: plain decoding). Prompt lookup first
    has no vLLM counterpart (a request drafts with one method): vLLM drafts with the head alone."""
    if model.method == "none":
        return None
    table = k_schedule(model.k_by_concurrency) if model.k == "auto" else None
    if model.method == "ngram":
        k = model.k if isinstance(model.k, int) and model.k else NGRAM_K
        spec: dict[str, Any] = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": NGRAM_MAX_N}
    else:
        k = model.k if isinstance(model.k, int) and model.k else head_speculative_tokens(model.head)
        spec = {"method": VLLM_METHODS[model.method], "model": absolute(model.head)}
        if model.method == "peagle":
            spec["parallel_drafting"] = True
    if table:
        k = max([k] + [entry[2] for entry in table])
        spec["num_speculative_tokens_per_batch_size"] = table
    spec["num_speculative_tokens"] = k
    return spec


def k_schedule(k_by_concurrency: dict[int, int]) -> list[list[int]] | None:
    """The winner's best K at each measured concurrency as vLLM's batch-size schedule: entries
    ``[low, high, K]`` (inclusive), the first from batch size 1, each measured concurrency covering
    the sizes above the previous one (a batch between two measured loads takes the larger load's K,
    the conservative side: K falls as load rises); vLLM keeps the last K beyond the table."""
    if not k_by_concurrency:
        return None
    entries, low = [], 1
    for concurrency in sorted(k_by_concurrency):
        entries.append([low, int(concurrency), int(k_by_concurrency[concurrency])])
        low = int(concurrency) + 1
    return entries


def head_speculative_tokens(head: str) -> int:
    """The draft length a head file was exported with (speculators' ``speculative_tokens``)."""
    config = json.loads(storage.read_text(storage.join(head, "config.json")))
    return int(config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def write_config(path: str, document: dict[str, Any], header: str) -> None:
    """YAML (a ``.json`` name: JSON), with `header` as a comment on top of the YAML."""
    if path.lower().endswith(".json"):
        storage.write_text(path, json.dumps(document, indent=2) + "\n")
        return
    import yaml

    comment = "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines())
    storage.write_text(path, comment + yaml.safe_dump(document, sort_keys=False))
