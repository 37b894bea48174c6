"""Deploy configs checked against the installed Ray before they are written: the Serve config
schema (`ray.serve.schema.ServeDeploySchema`) and, for the vLLM path, Ray Serve LLM's `LLMConfig`
(pydantic, ``extra="forbid"``: a wrong field name is an error here, not on the GPU cluster)."""

from __future__ import annotations

from typing import Any

from ray.serve.schema import ServeDeploySchema


def llm_config_class() -> type:
    """`ray.serve.llm.LLMConfig`. Importing `ray.serve.llm` needs vLLM (its OpenAI protocol models);
    without it, the class that `ray.serve.llm.LLMConfig` subclasses unchanged is imported instead."""
    try:
        from ray.serve.llm import LLMConfig
    except ImportError:
        from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
    return LLMConfig


def check_serve_config(document: dict[str, Any]) -> None:
    ServeDeploySchema.model_validate(document)


def check_vllm_config(document: dict[str, Any]) -> None:
    check_serve_config(document)
    config_class = llm_config_class()
    for app in document["applications"]:
        for llm in app["args"]["llm_configs"]:
            config_class.model_validate(llm)
