"""deploy/: the KubeRay manifest against (a trimmed copy of) the RayService CRD's schema, and the
Ray Serve config against Ray Serve's own schema and the manifest's copy of it."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

DEPLOY = Path(__file__).parents[1] / "deploy"


@pytest.fixture(scope="module")
def manifest():
    return yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())


@pytest.fixture(scope="module")
def validator():
    schema = json.loads((DEPLOY / "rayservice.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_manifest_matches_the_crd(manifest, validator):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    validator.validate(manifest)


def test_misspelt_key_fails(manifest, validator):
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["workerGroupSpec"] = bad["spec"]["rayClusterConfig"].pop("workerGroupSpecs")
    with pytest.raises(jsonschema.ValidationError, match="workerGroupSpec"):
        validator.validate(bad)


def test_wrong_type_fails(manifest, validator):
    bad = copy.deepcopy(manifest)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        validator.validate(bad)


def test_serve_config_v2_is_serve_yaml(manifest):
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"]) == yaml.safe_load((DEPLOY / "serve.yaml").read_text())


def test_serve_yaml_matches_ray_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    config = ServeDeploySchema.model_validate(yaml.safe_load((DEPLOY / "serve.yaml").read_text()))
    assert [app.import_path for app in config.applications] == ["specee.deploy:build"]
