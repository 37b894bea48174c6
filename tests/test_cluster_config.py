"""cluster.yaml is a valid Ray cluster launcher config (Ray's own schema) with the node types and
setup the README promises. It cannot be launched here; this is what `ray up` checks first."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[1] / "cluster.yaml"


@pytest.fixture(scope="module")
def cluster() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def test_cluster_yaml_passes_rays_schema(cluster):
    validate_config(prepare_config(copy.deepcopy(cluster)))


def test_a_misspelt_field_is_refused(cluster):
    broken = copy.deepcopy(cluster)
    broken["available_node_types"]["gpu_train"]["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError, match="min_worker"):
        validate_config(prepare_config(broken))


def test_gpu_workers_s3_profile_and_cuda_torch(cluster):
    types = cluster["available_node_types"]
    assert cluster["provider"]["type"] == "aws"
    gpu_types = {name: t for name, t in types.items() if name != cluster["head_node_type"]}
    assert {t["node_config"]["InstanceType"].split(".")[0] for t in gpu_types.values()} <= {"p5", "p4d", "g6e", "g5"}
    for node in types.values():
        assert node["node_config"]["IamInstanceProfile"]["Name"], "S3 access goes through an instance profile"
    setup = " ".join(cluster["setup_commands"])
    assert "download.pytorch.org/whl/cu" in setup and "pip install -q -e ~/aerie" in setup
