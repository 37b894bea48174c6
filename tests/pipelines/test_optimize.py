"""`aerie optimize` end to end on the session's local Ray: captured traffic -> ingest (replies
regenerated) -> an EAGLE-3 head (Ray Train) -> the benchmark DAG -> the winner live on Ray Serve.
The first run is stopped at the benchmark (a planted failure); the rerun picks up after the last
complete stage. Then traffic sent to the live endpoint is captured, and a second run in continuous
mode ingests it with the earlier data, warm-starts the head, benchmarks the new head against the
serving one, and records its promote/keep decision with the numbers."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from aerie.traffic import generate_traffic
from pipelines import optimize
from pipelines.optimize_config import ContinuousConfig, OptimizeConfig, load_optimize_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tiny_target_dir: Path, tmp_path: Path) -> OptimizeConfig:
    capture = tmp_path / "capture"
    generate_traffic(str(tiny_target_dir), str(capture), requests=48, max_tokens=160, seed=3)
    return OptimizeConfig(
        name="e2e",
        input=str(capture),
        target=str(tiny_target_dir),
        storage=str(tmp_path / "runs"),
        methods=["eagle3"],
        ingest={"max_tokens": 160, "regenerate_max_tokens": 16, "eval_min_records": 8, "progress": False},
        train={"max_steps": 6, "workers": 1, "eval_every": 3, "draft_vocab_size": 256, "k": 3, "progress": False},
        bench={"concurrency": [2], "k": [2], "requests": 4, "repeats": 1, "max_tokens": 8, "max_prompts": 8,
               "progress": False},
        serve={"name": "aerie-e2e", "port": _free_port(), "max_slots": 4, "num_cpus": 0,
               "capture": {"destination": str(tmp_path / "endpoint-capture"), "flush_seconds": 0.5}},
    )


def _stages(root: str) -> dict:
    return json.loads((Path(root) / optimize.RECORD).read_text())["stages"]


def _captured(root: Path) -> int:
    return sum(f.read_text().count("\n") for f in root.rglob("*.jsonl"))


@pytest.fixture
def serve_shutdown(ray_local):
    yield
    from ray import serve

    serve.shutdown()


def test_optimize_resumes_deploys_and_promotes_only_a_measured_gain(
    ray_local, tiny_target_dir, tmp_path, monkeypatch, serve_shutdown
):
    cfg = _config(tiny_target_dir, tmp_path)

    def interrupted(_cfg):
        raise RuntimeError("killed midway")

    import pipelines.benchmark

    monkeypatch.setattr(pipelines.benchmark, "run_benchmark", interrupted)
    with pytest.raises(optimize.StageFailed, match="stage bench failed: RuntimeError: killed midway"):
        optimize.run_optimize(cfg)
    stages = _stages(cfg.root)
    assert stages["ingest"]["status"] == stages["train-eagle3"]["status"] == "done"
    assert stages["bench"] == {"status": "failed", "error": "RuntimeError: killed midway"}
    head_result = Path(cfg.root) / "heads" / "eagle3" / "train_result.json"
    trained_at = head_result.stat().st_mtime_ns
    monkeypatch.undo()

    record = optimize.run_optimize(cfg)
    stages = record["stages"]
    assert "skipped_at" in stages["ingest"] and "skipped_at" in stages["train-eagle3"]
    assert head_result.stat().st_mtime_ns == trained_at, "the complete training stage is not redone"
    bench = Path(cfg.root) / "bench"
    assert {"results.json", "results.parquet", "report.md", "winner.json"} <= {p.name for p in bench.iterdir()}
    assert list(bench.glob("*.png"))
    deployed = json.loads((Path(cfg.root) / optimize.DEPLOY).read_text())
    assert deployed["model"] == stages["deploy"]["summary"]["model"]

    prompts = [f"def helper_{i}(items):" for i in range(24)]
    for prompt in prompts:
        reply = httpx.post(f"{deployed['url']}/v1/completions", timeout=60,
                           json={"model": deployed["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] is not None
    capture = Path(deployed["capture"])
    deadline = time.monotonic() + 30
    while _captured(capture) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _captured(capture) == len(prompts)

    second = cfg.model_copy(update={"name": "e2e-2", "continuous": ContinuousConfig(previous_run=cfg.root)})
    record = optimize.run_optimize(second)
    stages = record["stages"]
    ingest = stages["ingest"]["summary"]
    assert ingest["inputs"] == [deployed["capture"], cfg.input]
    assert ingest["counts"]["read"] == 48 + len(prompts)
    assert stages["train-eagle3"]["summary"]["warm_start"] == str(Path(cfg.root) / "heads" / "eagle3")
    rows = json.loads((Path(second.root) / "bench" / "results.json").read_text())
    assert "incumbent" in {r["variant"] for r in rows}
    decision = json.loads((Path(second.root) / optimize.DECISION).read_text())
    assert decision["decision"] in ("promote", "keep") and decision["serving_run"] == cfg.root
    assert decision["serving_output_throughput"] > 0 and decision["new_output_throughput"] > 0
    assert f"Continuous optimization: {decision['decision']}" in (Path(second.root) / "bench" / "report.md").read_text()
    now_serving = json.loads((Path(second.root) / optimize.DEPLOY).read_text())
    assert (now_serving["run"] == second.root) == (decision["decision"] == "promote")
    assert httpx.get(f"{now_serving['url']}/health", timeout=10).status_code == 200


def test_config_errors_name_the_section_and_field(tmp_path):
    base = {"name": "x", "input": "in", "target": "t"}
    with pytest.raises(ValueError, match=r"train\.lr: Input should be greater than 0"):
        OptimizeConfig(**base, train={"lr": -1})
    with pytest.raises(ValueError, match=r"bench\.out: set by the run"):
        OptimizeConfig(**base, bench={"out": "elsewhere"})
    with pytest.raises(ValueError, match=r"serve\.port"):
        OptimizeConfig(**base, serve={"port": 0})
    path = tmp_path / "bad.yaml"
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_optimize_config(str(path))
    assert optimize.main(["--config", str(path)]) == 2


def test_continuing_a_run_that_deployed_nothing_is_refused(tmp_path):
    cfg = OptimizeConfig(name="x", input="in", target="t", storage=str(tmp_path),
                         continuous={"previous_run": str(tmp_path / "never")})
    with pytest.raises(ValueError, match="continuous.previous_run: .* has no deploy.json"):
        optimize.plan(cfg, optimize._serving_record(cfg.continuous))


def test_a_rerun_reuses_outputs_only_when_made_with_the_same_settings():
    cfg = OptimizeConfig(name="x", input="in", target="t", bench={"k": [2]}, serve={"port": 8123})
    recorded = cfg.model_dump(mode="json")
    assert optimize.changed_settings(None, cfg) == []
    assert optimize.changed_settings(recorded, cfg.model_copy(update={"serve": {"port": 9000}, "deploy": False})) == []
    other = cfg.model_copy(update={"bench": {"k": [3]}, "target": "t2"})
    assert optimize.changed_settings(recorded, other) == ["target", "bench"]
