"""What every job's config shares: a YAML mapping read from a file (local or s3://), and pydantic
validation errors as one line per problem, named by field."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from aerie import storage


def read_mapping(path: str) -> dict[str, Any]:
    """The YAML (or JSON) mapping of field: value in `path`; ValueError when the file is missing or
    holds anything else."""
    import yaml

    try:
        text = storage.read_text(path)
    except FileNotFoundError:
        raise ValueError(f"config: file not found: {path}") from None
    values = yaml.safe_load(text) or {}
    if not isinstance(values, dict):
        raise ValueError(f"config: {path} must hold a mapping of field: value, not {type(values).__name__}")
    return values


def format_errors(error: ValidationError) -> str:
    """One line per problem, named by field: ``concurrency: every concurrency must be >= 1``."""
    lines = []
    for item in error.errors():
        name = ".".join(str(p) for p in item["loc"]) or "config"
        message = str(item["msg"]).removeprefix("Value error, ")
        lines.append(message if name == "config" else f"{name}: {message}")
    return "\n".join(lines)
