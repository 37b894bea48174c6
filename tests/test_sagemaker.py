"""`sagemaker://ENDPOINT[/VARIANT]` input: the endpoint's Data Capture files found through boto3 and
read by the ingest, against the moto server (SageMaker + S3); clear errors when there is nothing to read."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import boto3
import pyarrow.dataset as pads
import pytest
from pydantic import ValidationError

from aerie.data.ingest_config import IngestConfig
from aerie.data.ingest_output import split_uri
from aerie.sagemaker import capture_files, hour_of, parse_since, parse_uri
from aerie.traffic import generate_traffic

LIVE = "aerie-live"
ROLE = "arn:aws:iam::123456789012:role/aerie"
# (variant, requests, seed, first inferenceTime): each batch spans under 4 minutes, so one hour folder
BATCHES = [
    ("AllTraffic", 40, 1, datetime(2026, 4, 29, 0, 0, tzinfo=timezone.utc)),
    ("AllTraffic", 30, 2, datetime(2026, 4, 30, 10, 0, tzinfo=timezone.utc)),
    ("Canary", 20, 3, datetime(2026, 4, 30, 11, 0, tzinfo=timezone.utc)),
]


def _endpoint(client, name: str, capture: dict | None, variants=("AllTraffic", "Canary")) -> None:
    client.create_model(ModelName=f"{name}-model", ExecutionRoleArn=ROLE,
                        PrimaryContainer={"Image": "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm:1"})
    config = {
        "EndpointConfigName": f"{name}-config",
        "ProductionVariants": [
            {"VariantName": v, "ModelName": f"{name}-model", "InitialInstanceCount": 1,
             "InstanceType": "ml.g4dn.xlarge"} for v in variants
        ],
    }
    if capture is not None:
        config["DataCaptureConfig"] = capture
    client.create_endpoint_config(**config)
    client.create_endpoint(EndpointName=name, EndpointConfigName=f"{name}-config")


@pytest.fixture(scope="module")
def endpoints(s3_server, s3_bucket, tokenizer_dir) -> str:
    """Endpoints on the moto server: LIVE capturing to `<bucket>/datacapture` (files written there in the
    Data Capture layout by `aerie traffic`'s generator), one with capture off, one without a capture config."""
    destination = f"{s3_bucket}/datacapture"
    client = boto3.client("sagemaker", endpoint_url=s3_server)
    capture = {"EnableCapture": True, "InitialSamplingPercentage": 100, "DestinationS3Uri": destination,
               "CaptureOptions": [{"CaptureMode": "Input"}, {"CaptureMode": "Output"}]}
    _endpoint(client, LIVE, capture)
    _endpoint(client, "aerie-off", {**capture, "EnableCapture": False})
    _endpoint(client, "aerie-nocapture", None)
    for variant, requests, seed, start in BATCHES:
        generate_traffic(str(tokenizer_dir), destination, requests=requests, seed=seed, endpoint=LIVE,
                         variant=variant, start=start)
    return destination


def test_names_times_and_hours():
    assert parse_uri("sagemaker://my-endpoint").variant is None
    assert parse_uri("sagemaker://my-endpoint/Canary").variant == "Canary"
    for bad in ("sagemaker://", "sagemaker://a/b/c", "sagemaker://under_score", "s3://b/k"):
        with pytest.raises(ValueError):
            parse_uri(bad)
    now = datetime(2026, 5, 1, 12, 30, tzinfo=timezone.utc)
    assert parse_since("24h", now) == datetime(2026, 4, 30, 12, 30, tzinfo=timezone.utc)
    assert parse_since("1d12h", now) == datetime(2026, 4, 30, 0, 30, tzinfo=timezone.utc)
    assert parse_since("2026-04-30T10:30") == datetime(2026, 4, 30, 10, 30, tzinfo=timezone.utc)
    assert parse_since("2026-04-30T12:30+02:00") == datetime(2026, 4, 30, 10, 30, tzinfo=timezone.utc)
    with pytest.raises(ValueError, match="duration"):
        parse_since("yesterday")
    hour = datetime(2026, 4, 30, 10, tzinfo=timezone.utc)
    assert hour_of("s3://b/cap/ep/AllTraffic/2026/04/30/10/0a1b.jsonl") == hour
    assert hour_of("/data/cap/ep/AllTraffic/2026/04/30/10/0a1b.jsonl.gz") == hour
    assert hour_of("s3://b/cap/openai-00000.jsonl") is None
    assert hour_of("s3://b/cap/ep/v/2026/13/30/10/x.jsonl") is None  # no month 13


def test_config_validates_inputs_and_since():
    cfg = IngestConfig(input=["sagemaker://ep/v1", "s3://b/extra"], since="7d", target="t", out="o")
    assert cfg.inputs == ["sagemaker://ep/v1", "s3://b/extra"]
    assert IngestConfig(input="local/dir", target="t", out="o").inputs == ["local/dir"]
    cases = [({"input": "sagemaker://a/b/c"}, "input"), ({"input": ["x", "gs://y"]}, "input"),
             ({"input": []}, "input"), ({"input": "x", "since": "24h"}, "since"),
             ({"input": "sagemaker://e", "since": "soon"}, "since")]
    for values, field in cases:
        with pytest.raises(ValidationError) as e:
            IngestConfig(target="t", out="o", **values)
        assert e.value.errors()[0]["loc"] == (field,)


def test_capture_files_by_variant_and_window(endpoints):
    every = capture_files(f"sagemaker://{LIVE}")
    assert len(every) == 3 and all(f.startswith(f"{endpoints}/{LIVE}/") for f in every)
    assert [f.split("/")[5] for f in capture_files(f"sagemaker://{LIVE}/Canary")] == ["Canary"]
    # the hour that holds `since` counts whole: 10:30 keeps the 10:00 and 11:00 folders
    window = capture_files(f"sagemaker://{LIVE}", since=parse_since("2026-04-30T10:30Z"))
    assert sorted(hour_of(f).hour for f in window) == [10, 11]
    with pytest.raises(ValueError, match=f"sagemaker://{LIVE}: nothing captured since 2026-05-01T00:00Z"):
        capture_files(f"sagemaker://{LIVE}", since=parse_since("2026-05-01"))
    with pytest.raises(ValueError, match="no variant 'Blue'"):
        capture_files(f"sagemaker://{LIVE}/Blue")


def test_clear_errors_without_endpoint_or_capture(endpoints):
    with pytest.raises(ValueError, match="sagemaker://no-such-endpoint: there is no endpoint 'no-such-endpoint'"):
        capture_files("sagemaker://no-such-endpoint")
    with pytest.raises(ValueError, match=f"sagemaker://aerie-off: Data Capture is not enabled.*{endpoints}"):
        capture_files("sagemaker://aerie-off")
    with pytest.raises(ValueError, match="sagemaker://aerie-nocapture: Data Capture is not enabled"):
        capture_files("sagemaker://aerie-nocapture")


def test_ingest_reads_the_endpoint_window_from_the_cli(ray_local, endpoints, tokenizer_dir, tmp_path):
    from typer.testing import CliRunner

    from aerie.cli import app
    from pipelines.ingest import main

    runner = CliRunner()
    out = tmp_path / "window"
    result = runner.invoke(app, ["ingest", "--input", f"sagemaker://{LIVE}", "--since", "2026-04-30T10:59Z",
                                 "--target", str(tokenizer_dir), "--out", str(out), "--no-progress"])
    assert result.exit_code == 0, result.output
    counts = json.loads(result.output.strip().splitlines()[-1])
    assert counts["read"] == 30 + 20
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input_files"] == 2 and manifest["since"] == "2026-04-30T10:59:00Z"
    sources = pads.dataset(split_uri(str(out), "train"), format="parquet").to_table(columns=["source"])
    assert {hour_of(s).hour for s in sources.column("source").to_pylist()} == {10, 11}
    off = runner.invoke(app, ["ingest", "--input", "sagemaker://aerie-off", "--target", str(tokenizer_dir),
                              "--out", str(tmp_path / "off"), "--no-progress"])
    assert isinstance(off.exception, ValueError) and "Data Capture is not enabled" in str(off.exception)
    assert main(["--input", "sagemaker://no-such-endpoint", "--target", str(tokenizer_dir),
                 "--out", str(tmp_path / "off"), "--no-progress"]) == 1
    assert not (tmp_path / "off" / "manifest.json").exists()


def test_ingest_reads_an_endpoint_and_a_local_folder_together(ray_local, endpoints, tokenizer_dir, tmp_path):
    from pipelines.ingest import run_ingest

    local = tmp_path / "local"
    generate_traffic(str(tokenizer_dir), str(local), requests=15, seed=9, fmt="sharegpt")
    manifest = run_ingest(IngestConfig(input=[f"sagemaker://{LIVE}", str(local)], target=str(tokenizer_dir),
                                       out=str(tmp_path / "both"), progress=False))
    counts = manifest["counts"]
    assert manifest["input_files"] == 3 + 1
    assert counts["read"] == sum(requests for _, requests, _, _ in BATCHES) + 15
    assert counts["parsed"] + counts["quarantined"] + counts["duplicates"] + counts["too_long"] == counts["read"]
    assert counts["parsed"] == counts["written"]["train"] + counts["written"]["eval"]
