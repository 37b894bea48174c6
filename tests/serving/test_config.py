"""ServeConfig: exactly one way to name the model, the winner file resolved, errors that name the field."""

from __future__ import annotations

import typing

import pytest
from pydantic import ValidationError

from aerie.engine.build import METHODS
from aerie.serving.config import Method, ServeConfig
from aerie.winner import Winner


def _error(**values) -> str:
    with pytest.raises(ValidationError) as info:
        ServeConfig(**values)
    return str(info.value)


def test_methods_are_the_engines():
    assert typing.get_args(Method) == METHODS


def test_winner_file_gives_the_model(tmp_path):
    path = tmp_path / "winner.json"
    Winner(target="s3://models/targets/tiny-llama/", method="peagle", head="s3://models/heads/peagle", k="auto",
           k_by_concurrency={1: 5, 8: 2, 32: 0}).save(path)
    served = ServeConfig(winner=str(path)).resolved()
    assert (served.target, served.method, served.head, served.k) == (
        "s3://models/targets/tiny-llama/", "peagle", "s3://models/heads/peagle", "auto")
    assert served.k_by_concurrency == {1: 5, 8: 2, 32: 0}
    assert served.served_model == "tiny-llama"
    assert ServeConfig(winner=str(path), model_name="prod").resolved().served_model == "prod"
    assert not served.lookup
    Winner(target="t", method="eagle3", head="h", k=4, lookup=True).save(path)
    assert ServeConfig(winner=str(path)).resolved().lookup


def test_explicit_model_defaults():
    served = ServeConfig(target=".aerie/targets/tiny-llama").resolved()
    assert (served.method, served.head, served.k, served.served_model) == ("none", None, 0, "tiny-llama")


@pytest.mark.parametrize("values, message", [
    ({}, "give winner (a winner.json) or target"),
    ({"winner": "w.json", "target": "t"}, "give winner or target, not both"),
    ({"winner": "w.json", "k": 3}, "k: comes from the winner file"),
    ({"target": "t", "method": "eagle3"}, "head: method eagle3 needs a draft head"),
    ({"target": "t", "head": "h"}, "head: method none takes no head"),
    ({"target": "t", "k": 3}, "k: method none drafts nothing"),
    ({"target": "t", "method": "peagle", "head": "h", "tree": True}, "tree: method peagle cannot draft a tree"),
    ({"target": "t", "method": "ngram", "lookup": True}, "lookup: prompt lookup first goes before a head"),
    ({"target": "t", "method": "eagle3", "head": "h", "tree": True, "lookup": True},
     "not method eagle3 drafting a tree"),
    ({"winner": "w.json", "lookup": True}, "lookup: comes from the winner file"),
    ({"target": "t", "method": "medusa"}, "method\n  Input should be 'none', 'ngram', 'eagle3', 'peagle' or 'eagle'"),
    ({"target": "t", "k": -1}, "must be >= 0 or 'auto'"),
    ({"target": "t", "port": 0}, "port\n  Input should be greater than or equal to 1"),
    ({"target": "t", "max_len": 512, "max_prompt_tokens": 512}, "max_prompt_tokens (512) must be < max_len (512)"),
    ({"target": "t", "num_replicas": 2, "autoscaling": {}}, "num_replicas: give num_replicas or autoscaling"),
    ({"target": "t", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "min_replicas must be <= max_replicas"),
    ({"target": "t", "replicas": 2}, "replicas\n  Extra inputs are not permitted"),
    ({"target": "gs://b/t"}, "target\n  Value error, must be a local path or an s3:// URI"),
    ({"target": "t", "capture": {"destination": "d", "sampling_percentage": 120}}, "capture.sampling_percentage"),
    ({"target": "t", "capture": {"destination": "d", "encoding": "CSV"}}, "capture.encoding"),
])
def test_bad_configs_name_the_field(values, message):
    assert message in _error(**values)


def test_capture_is_named_after_the_application():
    config = ServeConfig(target="t", name="prod-endpoint", capture={"destination": "s3://b/capture"})
    assert config.capture.endpoint == "prod-endpoint"
    assert config.capture.uri == "s3://b/capture/prod-endpoint/AllTraffic"
    named = ServeConfig(target="t", capture={"destination": "d", "endpoint": "e", "variant": "v"})
    assert (named.capture.endpoint, named.capture.variant) == ("e", "v")


def test_api_key_stays_out_of_the_repr():
    assert "s3cret" not in repr(ServeConfig(target="t", api_key="s3cret"))
