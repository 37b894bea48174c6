"""``sagemaker://ENDPOINT[/VARIANT]``: the Data Capture files of a live SageMaker endpoint.

The endpoint itself says where its captured traffic goes: ``describe_endpoint`` gives its
``DataCaptureConfig`` (``EnableCapture``, ``CaptureStatus``, and on AWS ``DestinationS3Uri``;
otherwise that of its endpoint config). SageMaker writes the files as
``<DestinationS3Uri>/<endpoint>/<variant>/yyyy/mm/dd/hh/<uuid>.jsonl``; :func:`capture_files`
lists them (every variant, or the one named), optionally only the hours from ``since`` on, and the
ingest reads them like any ``s3://`` input.

boto3 is configured like :mod:`aerie.storage`: ``AWS_ENDPOINT_URL_SAGEMAKER`` or
``AWS_ENDPOINT_URL`` (an S3/SageMaker-compatible server such as moto), ``AWS_REGION`` or
``AWS_DEFAULT_REGION``, then the SDK's default credential chain.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from aerie import storage

__all__ = [
    "SCHEME", "Endpoint", "is_sagemaker", "parse_uri", "parse_since", "hour_of", "capture_prefixes", "capture_files",
]

SCHEME = "sagemaker://"
CAPTURE_SUFFIXES = (".jsonl", ".jsonl.gz")
_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")  # SageMaker's rule for endpoint and variant names
_HOUR = re.compile(r"(?:^|/)(\d{4})/(\d{2})/(\d{2})/(\d{2})/[^/]+$")
_DURATION = re.compile(r"^(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


@dataclass(frozen=True)
class Endpoint:
    name: str
    variant: str | None = None  # None: every production variant

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.name}" + (f"/{self.variant}" if self.variant else "")


def is_sagemaker(uri: str) -> bool:
    return str(uri).startswith(SCHEME)


def parse_uri(uri: str) -> Endpoint:
    """``sagemaker://NAME`` or ``sagemaker://NAME/VARIANT`` -> :class:`Endpoint`; ValueError otherwise."""
    if not is_sagemaker(uri):
        raise ValueError(f"{uri!r} is not a {SCHEME}ENDPOINT[/VARIANT] URI")
    parts = uri[len(SCHEME) :].rstrip("/").split("/")
    if len(parts) > 2 or not all(_NAME.match(p) for p in parts):
        raise ValueError(
            f"{uri!r}: expected {SCHEME}ENDPOINT[/VARIANT], names of letters, digits and hyphens (at most 63)"
        )
    return Endpoint(parts[0], parts[1] if len(parts) == 2 else None)


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """A UTC datetime from an ISO time (``2026-04-29T10:00``, ``2026-04-29``, ``...Z``; no zone
    means UTC) or a duration back from ``now`` (``24h``, ``7d``, ``1d12h``, ``90m``, ``2w``)."""
    value = text.strip()
    match = _DURATION.match(value)
    if value and match:
        weeks, days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
        back = timedelta(weeks=weeks, days=days, hours=hours, minutes=minutes, seconds=seconds)
        return (now or datetime.now(timezone.utc)).astimezone(timezone.utc) - back
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"since {text!r}: expected an ISO time (2026-04-29T10:00Z) or a duration such as 24h, 7d, 90m"
        ) from None
    return when.replace(tzinfo=timezone.utc) if when.tzinfo is None else when.astimezone(timezone.utc)


def hour_of(source: str) -> datetime | None:
    """The UTC hour (minute 0) a Data Capture file belongs to, from its ``.../yyyy/mm/dd/hh/<name>``
    path or URI (what the ``source`` column of ingest rows holds); None without such folders."""
    match = _HOUR.search(str(source))
    if match is None:
        return None
    try:
        return datetime(*(int(g) for g in match.groups()), tzinfo=timezone.utc)
    except ValueError:
        return None


def _client() -> Any:
    import boto3

    endpoint = os.environ.get("AWS_ENDPOINT_URL_SAGEMAKER") or os.environ.get("AWS_ENDPOINT_URL") or None
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or None
    return boto3.client("sagemaker", endpoint_url=endpoint, region_name=region)


def _describe(client: Any, endpoint: Endpoint) -> dict[str, Any]:
    from botocore.exceptions import ClientError

    try:
        return client.describe_endpoint(EndpointName=endpoint.name)
    except ClientError as e:
        error = e.response.get("Error", {})
        if error.get("Code") == "ValidationException" and "Could not find" in error.get("Message", ""):
            region = client.meta.region_name
            raise ValueError(f"{endpoint.uri}: there is no endpoint {endpoint.name!r} in {region}") from None
        raise ValueError(f"{endpoint.uri}: describe_endpoint failed: {error.get('Message') or e}") from None


def capture_prefixes(endpoint: Endpoint, client: Any | None = None) -> list[str]:
    """``s3://`` prefixes (one per variant) where the endpoint's captured traffic lands. ValueError
    when the endpoint does not exist, its Data Capture is off, or the variant is not one of its own."""
    client = client or _client()
    described = _describe(client, endpoint)
    capture = described.get("DataCaptureConfig") or {}
    destination = capture.get("DestinationS3Uri")
    if not destination and capture:
        config = client.describe_endpoint_config(EndpointConfigName=described["EndpointConfigName"])
        destination = (config.get("DataCaptureConfig") or {}).get("DestinationS3Uri")
    if not capture.get("EnableCapture") or capture.get("CaptureStatus") == "Stopped":
        earlier = f"; read earlier captures from {destination.rstrip('/')}/{endpoint.name}/ directly" \
            if destination else ""
        raise ValueError(f"{endpoint.uri}: Data Capture is not enabled on this endpoint{earlier}")
    if not destination or not storage.is_s3(destination):
        raise ValueError(f"{endpoint.uri}: its Data Capture has no s3:// DestinationS3Uri ({destination!r})")
    variants = [v["VariantName"] for v in described.get("ProductionVariants") or []]
    if endpoint.variant is not None:
        if endpoint.variant not in variants:
            raise ValueError(f"{endpoint.uri}: no variant {endpoint.variant!r}; the endpoint has {variants}")
        variants = [endpoint.variant]
    return [storage.join(destination, endpoint.name, variant) for variant in variants]


def capture_files(uri: str, since: datetime | None = None, client: Any | None = None) -> list[str]:
    """Every captured file of ``uri`` (``sagemaker://ENDPOINT[/VARIANT]``) as ``s3://`` URIs,
    sorted; with ``since`` only those in hour folders from the hour containing ``since`` on (files
    outside the ``yyyy/mm/dd/hh`` layout then count as unknown time and are left out). ValueError,
    naming ``uri``, when there is nothing to read."""
    endpoint = parse_uri(uri)
    prefixes = capture_prefixes(endpoint, client)
    start = None if since is None else since.astimezone(timezone.utc).replace(minute=0, second=0, microsecond=0)
    files: list[str] = []
    for prefix in prefixes:
        try:
            found = storage.list_files(prefix, CAPTURE_SUFFIXES)
        except FileNotFoundError:
            continue
        if start is not None:
            found = [f for f in found if (hour := hour_of(f)) is not None and hour >= start]
        files.extend(found)
    if not files:
        window = "" if start is None else f" since {start:%Y-%m-%dT%H:00Z}"
        raise ValueError(f"{endpoint.uri}: nothing captured{window} under {', '.join(prefixes)}")
    return sorted(files)
