"""A faithful subset of KubeRay's RayCluster CRD schema (ray.io/v1), as a JSON Schema for `elastic cluster validate`.

No Python package ships KubeRay's CRD, so the parts a cluster manifest uses are written out here from the CRD
(`ray-operator/config/crd/bases/ray.io_rayclusters.yaml`, KubeRay v1.5) and the Kubernetes PodSpec/Container API.
Objects that are modelled field by field reject unknown fields, as `kubectl apply` with strict field validation
(its default) does, so a typo such as `nodeSelecter` fails here instead of being silently pruned. Deep
Kubernetes types that we never inspect (affinity, probes, volumes...) are accepted as any object.
"""

from __future__ import annotations

from typing import Any

_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITY: dict[str, Any] = {"anyOf": [{"type": "integer"}, {"type": "number"}, {"type": "string"}]}
_QUANTITY_MAP: dict[str, Any] = {"type": "object", "additionalProperties": _QUANTITY}
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}
_NON_NEGATIVE_INT = {"type": "integer", "minimum": 0}


def _strict(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = list(required)
    return schema


_ENV_VAR = _strict(
    {"name": {"type": "string"}, "value": {"type": "string"}, "valueFrom": _ANY_OBJECT}, required=("name",)
)

_RESOURCE_REQUIREMENTS = _strict({"limits": _QUANTITY_MAP, "requests": _QUANTITY_MAP, "claims": {"type": "array"}})

_CONTAINER = _strict(
    {
        "name": {"type": "string"},
        "image": {"type": "string"},
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "workingDir": {"type": "string"},
        "env": {"type": "array", "items": _ENV_VAR},
        "envFrom": {"type": "array", "items": _ANY_OBJECT},
        "resources": _RESOURCE_REQUIREMENTS,
        "ports": {
            "type": "array",
            "items": _strict(
                {
                    "name": {"type": "string"},
                    "containerPort": _INT32,
                    "hostPort": _INT32,
                    "hostIP": {"type": "string"},
                    "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
                },
                required=("containerPort",),
            ),
        },
        "lifecycle": _strict({"postStart": _ANY_OBJECT, "preStop": _ANY_OBJECT, "stopSignal": {"type": "string"}}),
        "livenessProbe": _ANY_OBJECT,
        "readinessProbe": _ANY_OBJECT,
        "startupProbe": _ANY_OBJECT,
        "resizePolicy": {"type": "array"},
        "restartPolicy": {"type": "string"},
        "securityContext": _ANY_OBJECT,
        "stdin": {"type": "boolean"},
        "stdinOnce": {"type": "boolean"},
        "tty": {"type": "boolean"},
        "terminationMessagePath": {"type": "string"},
        "terminationMessagePolicy": {"enum": ["File", "FallbackToLogsOnError"]},
        "volumeDevices": {"type": "array"},
        "volumeMounts": {
            "type": "array",
            "items": _strict(
                {
                    "name": {"type": "string"},
                    "mountPath": {"type": "string"},
                    "readOnly": {"type": "boolean"},
                    "subPath": {"type": "string"},
                    "subPathExpr": {"type": "string"},
                    "mountPropagation": {"type": "string"},
                    "recursiveReadOnly": {"type": "string"},
                },
                required=("name", "mountPath"),
            ),
        },
    },
    required=("name",),
)

_TOLERATION = _strict(
    {
        "key": {"type": "string"},
        "operator": {"enum": ["Exists", "Equal"]},
        "value": {"type": "string"},
        "effect": {"enum": ["NoSchedule", "PreferNoSchedule", "NoExecute", ""]},
        "tolerationSeconds": {"type": "integer"},
    }
)

_POD_SPEC = _strict(
    {
        "activeDeadlineSeconds": {"type": "integer"},
        "affinity": _ANY_OBJECT,
        "automountServiceAccountToken": {"type": "boolean"},
        "containers": {"type": "array", "items": _CONTAINER, "minItems": 1},
        "dnsConfig": _ANY_OBJECT,
        "dnsPolicy": {"type": "string"},
        "enableServiceLinks": {"type": "boolean"},
        "ephemeralContainers": {"type": "array"},
        "hostAliases": {"type": "array"},
        "hostIPC": {"type": "boolean"},
        "hostNetwork": {"type": "boolean"},
        "hostPID": {"type": "boolean"},
        "hostUsers": {"type": "boolean"},
        "hostname": {"type": "string"},
        "imagePullSecrets": {"type": "array", "items": _ANY_OBJECT},
        "initContainers": {"type": "array", "items": _CONTAINER},
        "nodeName": {"type": "string"},
        "nodeSelector": _STRING_MAP,
        "os": _ANY_OBJECT,
        "overhead": _QUANTITY_MAP,
        "preemptionPolicy": {"type": "string"},
        "priority": _INT32,
        "priorityClassName": {"type": "string"},
        "readinessGates": {"type": "array"},
        "resourceClaims": {"type": "array"},
        "resources": _RESOURCE_REQUIREMENTS,
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
        "runtimeClassName": {"type": "string"},
        "schedulerName": {"type": "string"},
        "schedulingGates": {"type": "array"},
        "securityContext": _ANY_OBJECT,
        "serviceAccount": {"type": "string"},
        "serviceAccountName": {"type": "string"},
        "setHostnameAsFQDN": {"type": "boolean"},
        "shareProcessNamespace": {"type": "boolean"},
        "subdomain": {"type": "string"},
        "terminationGracePeriodSeconds": _NON_NEGATIVE_INT,
        "tolerations": {"type": "array", "items": _TOLERATION},
        "topologySpreadConstraints": {"type": "array"},
        "volumes": {"type": "array", "items": _ANY_OBJECT},
    },
    required=("containers",),
)

_POD_TEMPLATE = _strict(
    {
        "metadata": _strict(
            {
                "annotations": _STRING_MAP,
                "labels": _STRING_MAP,
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "finalizers": {"type": "array"},
            }
        ),
        "spec": _POD_SPEC,
    },
    required=("spec",),
)

_GROUP_COMMON: dict[str, Any] = {
    "rayStartParams": _STRING_MAP,
    "template": _POD_TEMPLATE,
    # KubeRay v1.5: Ray resources and node labels of the group, read by Ray's autoscaler (Ray 2.60 ignores
    # `labels` given in rayStartParams).
    "resources": _STRING_MAP,
    "labels": _STRING_MAP,
}

_HEAD_GROUP = _strict(
    {
        **_GROUP_COMMON,
        "serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"]},
        "headService": _ANY_OBJECT,
        "enableIngress": {"type": "boolean"},
        "headPodTemplate": _ANY_OBJECT,
    },
    required=("template",),
)

_WORKER_GROUP = _strict(
    {
        **_GROUP_COMMON,
        "groupName": {"type": "string", "minLength": 1, "maxLength": 63},
        "replicas": _INT32,
        "minReplicas": {**_INT32, "minimum": 0},
        "maxReplicas": {**_INT32, "minimum": 0},
        "idleTimeoutSeconds": _INT32,
        "numOfHosts": {**_INT32, "minimum": 1},
        "scaleStrategy": _strict({"workersToDelete": {"type": "array", "items": {"type": "string"}}}),
        "suspend": {"type": "boolean"},
    },
    required=("groupName", "template", "minReplicas", "maxReplicas"),
)

_AUTOSCALER_OPTIONS = _strict(
    {
        "version": {"enum": ["v1", "v2"]},
        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
        "idleTimeoutSeconds": _INT32,
        "image": {"type": "string"},
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "resources": _RESOURCE_REQUIREMENTS,
        "env": {"type": "array", "items": _ENV_VAR},
        "envFrom": {"type": "array"},
        "securityContext": _ANY_OBJECT,
        "volumeMounts": {"type": "array"},
    }
)

RAYCLUSTER_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "RayCluster (ray.io/v1), subset",
    "type": "object",
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayCluster"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _STRING_MAP,
                "annotations": _STRING_MAP,
            },
        },
        "spec": _strict(
            {
                "rayVersion": {"type": "string"},
                "enableInTreeAutoscaling": {"type": "boolean"},
                "autoscalerOptions": _AUTOSCALER_OPTIONS,
                "headGroupSpec": _HEAD_GROUP,
                "workerGroupSpecs": {"type": "array", "items": _WORKER_GROUP},
                "headServiceAnnotations": _STRING_MAP,
                "gcsFaultToleranceOptions": _ANY_OBJECT,
                "managedBy": {"type": "string"},
                "suspend": {"type": "boolean"},
                "upgradeStrategy": _ANY_OBJECT,
            },
            required=("headGroupSpec",),
        ),
        "status": _ANY_OBJECT,
    },
    "required": ["apiVersion", "kind", "metadata", "spec"],
}
