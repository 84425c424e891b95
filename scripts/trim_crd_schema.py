"""Trim KubeRay's RayService CRD schema to the fields a manifest uses, as a JSON schema.

The CRD's `v1` openAPIV3Schema is pruned, recursively, to the keys that occur in the manifest:
every object that lists `properties` keeps only the used ones and gets `additionalProperties:
false` (so an unknown or misspelt key fails), an array's `items` are pruned by the union of the
manifest's elements, and objects without `properties` (maps, `x-kubernetes-preserve-unknown-fields`)
stay as they are. `x-kubernetes-int-or-string` nodes get `anyOf: [integer, string]` where the CRD
lacks it, and `description`s are dropped, so the result is small and plain jsonschema can check it.

    curl -fsSLo /tmp/ray.io_rayservices.yaml \
        https://raw.githubusercontent.com/ray-project/kuberay/COMMIT/ray-operator/config/crd/bases/ray.io_rayservices.yaml
    python scripts/trim_crd_schema.py --crd /tmp/ray.io_rayservices.yaml \
        --manifest deploy/rayservice.yaml --out deploy/rayservice.schema.json \
        --crd-source https://raw.githubusercontent.com/ray-project/kuberay/COMMIT/ray-operator/config/crd/bases/ray.io_rayservices.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml


def _plain(node):
    """A retained subtree as it is, less its descriptions, with int-or-string made checkable."""
    if isinstance(node, list):
        return [_plain(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _plain(v) for k, v in node.items() if k != "description"}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out.pop("type", None)
    return out


def prune(schema: dict, values: list, path: str, unknown: list[str]) -> dict:
    """`schema` cut down to what `values` (the manifest's values at `path`) use."""
    if not isinstance(schema, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return _plain(schema)
    if "properties" in schema:
        dicts = [v for v in values if isinstance(v, dict)]
        used = {k for d in dicts for k in d}
        unknown += [f"{path}.{k}" for k in sorted(used - schema["properties"].keys())]
        out = {k: _plain(v) for k, v in schema.items() if k not in ("properties", "description")}
        out["properties"] = {
            k: prune(sub, [d[k] for d in dicts if k in d], f"{path}.{k}", unknown)
            for k, sub in schema["properties"].items()
            if k in used
        }
        out["additionalProperties"] = False
        return out
    if schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        elements = [e for v in values if isinstance(v, list) for e in v]
        out = {k: _plain(v) for k, v in schema.items() if k not in ("items", "description")}
        out["items"] = prune(schema["items"], elements, f"{path}[]", unknown)
        return out
    return _plain(schema)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--crd", required=True, help="KubeRay's ray.io_rayservices.yaml")
    ap.add_argument("--manifest", default="deploy/rayservice.yaml")
    ap.add_argument("--out", default="deploy/rayservice.schema.json")
    ap.add_argument("--crd-source", default="", help="where the CRD came from (a URL), for the description")
    args = ap.parse_args(argv)

    crd = yaml.safe_load(Path(args.crd).read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    manifest = yaml.safe_load(Path(args.manifest).read_text())

    unknown: list[str] = []
    schema = prune(version["schema"]["openAPIV3Schema"], [manifest], "$", unknown)
    if unknown:
        print("keys the CRD does not have: " + ", ".join(unknown), file=sys.stderr)
        return 1

    command = (
        f"python scripts/trim_crd_schema.py --crd {args.crd} --manifest {args.manifest} --out {args.out}"
    )
    if args.crd_source:
        command = f"curl -fsSLo {args.crd} {args.crd_source} && {command} --crd-source {args.crd_source}"
    head = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "KubeRay RayService (ray.io/v1), trimmed to the fields of " + args.manifest,
        "description": "Generated from KubeRay's RayService CRD "
        f"({args.crd_source or args.crd}); do not edit. Regenerate: {command}",
    }
    Path(args.out).write_text(json.dumps({**head, **schema}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
