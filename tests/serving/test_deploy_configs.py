"""`aerie serve --write-config` / `--vllm-config`: Serve configs the installed Ray accepts (its deploy
schema, Ray Serve LLM's LLMConfig), with vLLM's speculative_config for the winner."""

from __future__ import annotations

import json

import pytest
import yaml
from pydantic import ValidationError
from random_models import random_model
from ray.serve import Application
from typer.testing import CliRunner

from aerie.cli import app
from aerie.heads import new_head
from aerie.heads.io import save_head
from aerie.serving.config import ServeConfig
from aerie.serving.deploy_configs import k_schedule, serve_config, vllm_config
from aerie.target import Target
from aerie.winner import Winner
from serve_apps.config_check import check_serve_config, check_vllm_config, llm_config_class
from serve_apps.openai_app import build_app


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    target = Target(random_model("llama"))
    root = tmp_path_factory.mktemp("heads")
    return {m: save_head(new_head(target, m, speculative_tokens=5), root / m) for m in ("eagle3", "peagle")}


def test_serve_config_is_a_valid_serve_deploy_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = ServeConfig(target="targets/tiny", name="prod", port=8123, api_key="k", max_slots=16,
                         capture={"destination": "capture", "sampling_percentage": 20})
    document = serve_config(config)
    check_serve_config(document)
    assert document["http_options"] == {"host": "127.0.0.1", "port": 8123}
    [application] = document["applications"]
    assert application["import_path"] == "serve_apps.openai_app:build_app" and application["name"] == "prod"
    args = application["args"]
    assert args["target"] == str(tmp_path / "targets/tiny")
    assert args["capture"]["destination"] == str(tmp_path / "capture")
    rebuilt = ServeConfig.model_validate({**args, "name": "prod", "port": 8123})
    assert rebuilt.capture.endpoint == "prod" and rebuilt.api_key == "k" and rebuilt.max_slots == 16
    assert isinstance(build_app(args), Application)


def test_vllm_config_for_an_adaptive_peagle_winner(tmp_path, heads):
    winner = tmp_path / "winner.json"
    Winner(target="s3://models/tiny-llama", method="peagle", head=heads["peagle"], k="auto",
           k_by_concurrency={1: 4, 4: 3, 16: 0}).save(winner)
    config = ServeConfig(winner=str(winner), autoscaling={"min_replicas": 1, "max_replicas": 4})
    document = vllm_config(config)
    check_vllm_config(document)
    [llm] = document["applications"][0]["args"]["llm_configs"]
    assert document["applications"][0]["import_path"] == "ray.serve.llm:build_openai_app"
    assert llm["model_loading_config"] == {"model_id": "tiny-llama", "model_source": "s3://models/tiny-llama"}
    assert llm["engine_kwargs"]["speculative_config"] == {
        "method": "eagle3", "model": heads["peagle"], "parallel_drafting": True,
        "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 3], [5, 16, 0]],
        "num_speculative_tokens": 5,  # the head's own K: at least every K of the schedule
    }
    assert llm["deployment_config"]["autoscaling_config"]["max_replicas"] == 4
    parsed = llm_config_class().model_validate(llm)
    assert parsed.engine_kwargs["speculative_config"]["parallel_drafting"] is True


def test_vllm_config_static_k_and_plain(heads):
    static = vllm_config(ServeConfig(target="t", method="eagle3", head=heads["eagle3"], k=3))
    spec = static["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]["speculative_config"]
    assert spec == {"method": "eagle3", "model": heads["eagle3"], "num_speculative_tokens": 3}
    plain = vllm_config(ServeConfig(target="t"))
    assert "speculative_config" not in plain["applications"][0]["args"]["llm_configs"][0]["engine_kwargs"]


def test_a_wrong_field_is_refused_by_rays_llm_config(heads):
    document = vllm_config(ServeConfig(target="t", method="eagle3", head=heads["eagle3"]))
    llm = document["applications"][0]["args"]["llm_configs"][0]
    llm["speculative_config"] = llm["engine_kwargs"].pop("speculative_config")  # not an LLMConfig field
    with pytest.raises(ValidationError, match="speculative_config"):
        check_vllm_config(document)


def test_k_schedule_covers_every_batch_size_from_one():
    assert k_schedule({16: 0, 1: 5, 2: 4, 8: 2}) == [[1, 1, 5], [2, 2, 4], [3, 8, 2], [9, 16, 0]]
    assert k_schedule({4: 3}) == [[1, 4, 3]]
    assert k_schedule({}) is None


def test_cli_writes_both_configs(tmp_path, heads):
    serve_file, vllm_file = tmp_path / "serve.yaml", tmp_path / "vllm.json"
    result = CliRunner().invoke(app, [
        "serve", "--target", str(tmp_path / "t"), "--method", "eagle3", "--head", heads["eagle3"], "--k", "auto",
        "--port", "8100", "--capture", str(tmp_path / "cap"), "--write-config", str(serve_file),
        "--vllm-config", str(vllm_file),
    ])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"serve_config": str(serve_file), "vllm_config": str(vllm_file)}
    served = yaml.safe_load(serve_file.read_text())
    assert served["applications"][0]["args"]["k"] == "auto" and served["http_options"]["port"] == 8100
    assert serve_file.read_text().startswith("# Ray Serve config written by `aerie serve --write-config`.")
    check_vllm_config(json.loads(vllm_file.read_text()))
    bad = CliRunner().invoke(app, ["serve", "--target", "t", "--method", "eagle3", "--write-config", "x.yaml"])
    assert bad.exit_code == 2 and "head: method eagle3 needs a draft head directory" in bad.output
