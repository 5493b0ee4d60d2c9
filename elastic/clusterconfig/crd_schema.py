"""KubeRay's RayCluster CRD schema, vendored from a pinned KubeRay release, as a JSON Schema that rejects unknown
fields the way the API server does.

`schemas/kuberay-v1.7.0-raycluster.json` holds the `openAPIV3Schema` of the CRD's `v1` version, unchanged, with
where it came from (release, commit, URL). To move to another KubeRay release, take
`ray-operator/config/crd/bases/ray.io_rayclusters.yaml` at its tag, store the `v1` version's `openAPIV3Schema` the
same way, and point `VENDORED_SCHEMA` at it.

A CRD schema is OpenAPI v3 with Kubernetes extensions; `as_json_schema` turns it into draft-7 JSON Schema:

- An object with `properties` accepts no other field unless it is marked `x-kubernetes-preserve-unknown-fields`:
  the API server prunes unknown fields, and `kubectl apply` (strict field validation, its default) rejects them,
  so a typo such as `nodeSelecter` would silently vanish. An object without `properties` (the top-level
  `metadata`, which the API server checks as ObjectMeta itself) accepts anything.
- `nullable: true` also accepts null; `x-kubernetes-int-or-string` comes with its own `anyOf` in the CRD.
- CEL rules (`x-kubernetes-validations`) compare with the stored object (immutability) or restate enums; they are
  not evaluated here.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files
from typing import Any

VENDORED_SCHEMA = "kuberay-v1.7.0-raycluster.json"

# What the CRD leaves to the API server's envelope checks, and what this project supports: the served `v1` API.
_ENVELOPE: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
    },
}


@cache
def vendored() -> dict[str, Any]:
    """The vendored file: release, commit, source URL and the CRD's openAPIV3Schema."""
    return json.loads(files("elastic.clusterconfig").joinpath("schemas", VENDORED_SCHEMA).read_text())


def kuberay_release() -> str:
    return vendored()["release"]


@cache
def raycluster_schema() -> dict[str, Any]:
    """The RayCluster JSON Schema: KubeRay's CRD (unknown fields rejected where it does not preserve them) and
    the envelope (apiVersion ray.io/v1, kind RayCluster, metadata.name)."""
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": f"RayCluster (ray.io/v1), KubeRay {kuberay_release()} CRD",
        "allOf": [as_json_schema(vendored()["openAPIV3Schema"]), _ENVELOPE],
    }


def as_json_schema(node: Any) -> Any:
    """A CRD's structural OpenAPI v3 schema -> JSON Schema (draft 7), recursively; see the module docstring."""
    if isinstance(node, list):
        return [as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {
        key: as_json_schema(value)
        for key, value in node.items()
        if not key.startswith("x-kubernetes-") and key != "properties"
    }
    if "properties" in node:  # a map from field names (`type` is one in places) to schemas
        out["properties"] = {name: as_json_schema(schema) for name, schema in node["properties"].items()}
    if (
        node.get("type") == "object"
        and "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False):
        return {"anyOf": [out, {"type": "null"}]}
    return out
