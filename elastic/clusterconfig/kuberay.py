"""Checks of KubeRay RayCluster manifests: the RayCluster schema, spot node selectors and tolerations, grace
periods that outlive the drain deadline, autoscaling, and the labels jobs select nodes by."""

from __future__ import annotations

import re

import jsonschema

from elastic.clusterconfig.crd_schema import kuberay_release, raycluster_schema
from elastic.clusterconfig.problems import Problem, key_path, one_line, suggest
from elastic.clusterconfig.rules import STORAGE_ENV, WATCHER, check_labels, storage_problem
from elastic.placement.labels import MARKET_LABEL, MARKETS, ROLE_LABEL, WORKER_ROLE

# The longest spot notice among the clouds (AWS: 2 minutes); Ray drains a node within it. Pods of a KubeRay
# worker group must be allowed to outlive it, so the drain and the just-in-time checkpoint finish.
DRAIN_DEADLINE_S = 120
# Node selectors that put a pod on spot capacity, by platform; the value selects spot.
K8S_SPOT_SELECTORS = {
    "cloud.google.com/gke-spot": "true",
    "cloud.google.com/gke-preemptible": "true",
    "eks.amazonaws.com/capacityType": "SPOT",
    "karpenter.sh/capacity-type": "spot",
    "kubernetes.azure.com/scalesetpriority": "spot",
}


# ---------------------------------------------------------------------------------------------------------
# KubeRay


def check_kuberay(manifest: dict) -> list[Problem]:
    problems = crd_problems(manifest)
    if problems:  # our checks assume the shape the CRD guarantees
        return problems
    groups = [("spec.headGroupSpec", manifest["spec"]["headGroupSpec"])] + [
        (f"spec.workerGroupSpecs[{i}]", g) for i, g in enumerate(manifest["spec"].get("workerGroupSpecs") or [])
    ]
    empty = [key for key, group in groups if not group["template"]["spec"].get("containers")]
    if empty:  # the API server would refuse the pods; the rules below read the Ray container
        return [Problem(f"{key}.template.spec.containers", "no containers; the first one runs Ray") for key in empty]
    spec = manifest["spec"]
    kuberay_token_auth = (spec.get("authOptions") or {}).get("mode") == "token"
    if "authOptions" in spec and not kuberay_token_auth:
        problems.append(
            Problem(
                "spec.authOptions.mode",
                f"{(spec['authOptions'] or {}).get('mode') or '(unset)'}: KubeRay turns token authentication on "
                "only with mode: token; set authOptions: {mode: token, secretName: SECRET}",
            )
        )
    if spec.get("enableInTreeAutoscaling") is not True:
        problems.append(
            Problem(
                "spec.enableInTreeAutoscaling",
                "autoscaling is off: reclaimed spot pods are not replaced; set enableInTreeAutoscaling: true",
            )
        )
    mode = (spec.get("autoscalerOptions") or {}).get("upscalingMode", "Default")
    if spec.get("enableInTreeAutoscaling") is True and mode != "Conservative":
        problems.append(
            Problem(
                "spec.autoscalerOptions.upscalingMode",
                f"{mode} scales up without a rate limit (Ray's upscaling_speed 1000): a burst of spot requests "
                "that a short pool refuses together; set upscalingMode: Conservative",
            )
        )
    head = spec["headGroupSpec"]
    problems += _check_k8s_group("spec.headGroupSpec", head, True, kuberay_token_auth)
    problems += _check_head_placement_and_account(spec)
    if head.get("serviceType") in ("NodePort", "LoadBalancer") or head.get("enableIngress") is True:
        what = "enableIngress: true" if head.get("enableIngress") is True else f"serviceType: {head['serviceType']}"
        problems.append(
            Problem(
                "spec.headGroupSpec",
                f"{what} exposes the dashboard and job API outside the "
                "cluster; use serviceType: ClusterIP and `kubectl "
                "port-forward svc/CLUSTER-head-svc 8265`",
            )
        )
    params = head.get("rayStartParams") or {}
    resources = head.get("resources") or {}
    if str(resources.get("CPU", params.get("num-cpus"))) != "0":
        problems.append(
            Problem(
                "spec.headGroupSpec.rayStartParams",
                'the head offers CPUs to training; set rayStartParams num-cpus: "0"',
            )
        )
    spot, on_demand = [], []
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        key = f"spec.workerGroupSpecs[{i}]"
        problems += _check_k8s_group(key, group, False, kuberay_token_auth)
        selected = _k8s_market(group)
        if (group.get("labels") or {}).get(ROLE_LABEL) == WORKER_ROLE and _k8s_gpus(group) > 0:
            (spot if selected == "spot" else on_demand).append(group["groupName"])
        pod = group["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if grace <= DRAIN_DEADLINE_S:
            problems.append(
                Problem(
                    f"{key}.template.spec.terminationGracePeriodSeconds",
                    f"{grace} s does not outlive the {DRAIN_DEADLINE_S} s drain deadline: the pod "
                    "would be killed before the just-in-time checkpoint is written; use at least "
                    f"{DRAIN_DEADLINE_S + 30}",
                )
            )
        if selected == "spot":
            problems += _check_k8s_spot_group(key, group)
    if not spot:
        problems.append(
            Problem(
                "spec.workerGroupSpecs",
                "no spot GPU worker group; add one with a spot "
                'nodeSelector (e.g. cloud.google.com/gke-spot: "true"), '
                "its toleration, nvidia.com/gpu limits and labels "
                f"{{{MARKET_LABEL}: spot, {ROLE_LABEL}: {WORKER_ROLE}}}",
            )
        )
    if not on_demand:
        problems.append(
            Problem(
                "spec.workerGroupSpecs",
                "no on-demand GPU worker group (the fallback when spot "
                "capacity is short); add one with nvidia.com/gpu limits "
                f"and labels {{{MARKET_LABEL}: on-demand, "
                f"{ROLE_LABEL}: {WORKER_ROLE}}}",
            )
        )
    return problems


def crd_problems(manifest: dict) -> list[Problem]:
    """KubeRay's own CRD schema (crd_schema.py): one problem per violation, unknown fields with a suggestion."""
    validator = jsonschema.Draft7Validator(raycluster_schema())
    errors = sorted(validator.iter_errors(manifest), key=lambda e: list(map(str, e.absolute_path)))
    where = f"(KubeRay {kuberay_release()} RayCluster CRD)"
    problems = []
    for error in errors:
        message = one_line(error.message)
        if error.validator == "additionalProperties" and isinstance(error.instance, dict):
            known = error.schema.get("properties") or {}
            unknown = [name for name in error.instance if name not in known]
            hint = suggest(unknown[0], known).strip() if unknown else ""
            message += f" {where}{'; ' + hint.strip('()') if hint else ''}"
        else:
            message += f" {where}"
        problems.append(Problem(key_path(error.absolute_path) or "(top level)", message))
    return problems


def _check_k8s_group(key: str, group: dict, is_head: bool, kuberay_token_auth: bool) -> list[Problem]:
    problems = []
    params = group.get("rayStartParams") or {}
    if "labels" in params:
        problems.append(
            Problem(
                f"{key}.rayStartParams.labels",
                "Ray's autoscaler ignores labels given in "
                "rayStartParams; move them to the group's labels "
                "field (KubeRay >= 1.5)",
            )
        )
    problems += check_labels(f"{key}.labels", group.get("labels") or {}, head=is_head)
    labels = group.get("labels") or {}
    selected = _k8s_market(group)
    tolerated = [
        t.get("key") or "(every taint)"
        for t in group["template"]["spec"].get("tolerations") or []
        if t.get("key") in K8S_SPOT_SELECTORS or (t.get("operator") == "Exists" and not t.get("key"))
    ]
    if is_head and tolerated:
        problems.append(
            Problem(
                f"{key}.template.spec.tolerations",
                f"the head tolerates the spot taint ({tolerated[0]}) and may be scheduled on a "
                "spot node; remove that toleration from the head",
            )
        )
    if is_head and selected == "spot":
        problems.append(
            Problem(
                f"{key}.template.spec.nodeSelector",
                "the head is scheduled on spot nodes: a reclaim ends every driver, the autoscaler "
                "and the job API; select on-demand nodes for the head",
            )
        )
    elif labels.get(MARKET_LABEL) in MARKETS and labels[MARKET_LABEL] != selected:
        problems.append(
            Problem(
                f"{key}.labels.{MARKET_LABEL}",
                f"labeled '{labels[MARKET_LABEL]}' but the nodeSelector puts it on {selected} "
                f"nodes; label it '{selected}' or change the nodeSelector",
            )
        )
    ray_env = {env["name"] for env in group["template"]["spec"]["containers"][0].get("env") or []}
    if "RAY_AUTH_MODE" not in ray_env and not kuberay_token_auth:  # KubeRay sets it in the Ray container
        problems.append(
            Problem(
                f"{key}.template.spec.containers[0].env",
                "Ray token authentication is off in this group; set spec.authOptions: {mode: token, "
                "secretName: SECRET} (KubeRay >= 1.5), or RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from a Secret "
                "in the Ray container",
            )
        )
    for c, container in enumerate(group["template"]["spec"]["containers"]):
        for e, env in enumerate(container.get("env") or []):
            ckey = f"{key}.template.spec.containers[{c}].env[{e}]"
            if env["name"] == "RAY_AUTH_MODE" and env.get("value") != "token":
                problems.append(
                    Problem(
                        ckey,
                        f"RAY_AUTH_MODE={env.get('value')} turns Ray token authentication "
                        "off; use token (with RAY_AUTH_TOKEN from a Secret)",
                    )
                )
            if STORAGE_ENV.match(env["name"]) and "value" in env:
                problems += storage_problem(ckey, env["name"], env["value"])
    return problems


def _check_head_placement_and_account(spec: dict) -> list[Problem]:
    problems = []
    pod = spec["headGroupSpec"]["template"]["spec"]
    if not _avoids_spot(pod):
        problems.append(
            Problem(
                "spec.headGroupSpec.template.spec.affinity",
                "nothing keeps the head off spot nodes of a pool created without the spot taint; add a required "
                "nodeAffinity with {key: cloud.google.com/gke-spot, operator: NotIn, values: ['true']} (or your "
                "platform's spot label)",
            )
        )
    head_account = pod.get("serviceAccountName") or "(the cluster's name)"
    for i, group in enumerate(spec.get("workerGroupSpecs") or []):
        if spec.get("enableInTreeAutoscaling") is True and group["template"]["spec"].get("serviceAccountName") == (
            pod.get("serviceAccountName") or spec.get("metadata", {}).get("name")
        ):
            problems.append(
                Problem(
                    f"spec.workerGroupSpecs[{i}].template.spec.serviceAccountName",
                    f"shares the head's service account {head_account}, to which KubeRay binds the autoscaler's "
                    "Role (patch pods and the RayCluster): every worker pod would hold it; give the head its own",
                )
            )
    return problems


def _avoids_spot(pod: dict) -> bool:
    """A required node affinity that excludes a spot label (NotIn its spot value, or DoesNotExist)."""
    required = ((pod.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or {}
    terms = required.get("nodeSelectorTerms") or []
    return bool(terms) and all(
        any(
            e.get("key") in K8S_SPOT_SELECTORS
            and (
                e.get("operator") == "DoesNotExist"
                or (e.get("operator") == "NotIn" and K8S_SPOT_SELECTORS[e["key"]] in (e.get("values") or []))
            )
            for e in term.get("matchExpressions") or []
        )
        for term in terms
    )


def _check_k8s_spot_group(key: str, group: dict) -> list[Problem]:
    problems = []
    pod = group["template"]["spec"]
    selector = _spot_selector_key(pod)
    tolerations = pod.get("tolerations") or []
    if not any(t.get("key") == selector or (t.get("operator") == "Exists" and "key" not in t) for t in tolerations):
        value = K8S_SPOT_SELECTORS.get(selector, "true")
        problems.append(
            Problem(
                f"{key}.template.spec.tolerations",
                "no toleration for the spot taint (spot nodes are tainted so that nothing else "
                f'lands there); add {{key: {selector}, operator: Equal, value: "{value}", '
                "effect: NoSchedule}",
            )
        )
    ray = pod["containers"][0]
    hook = " ".join(((((ray.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command")) or [])
    drain = re.search(r"--drain-now[= ]+(\d+(\.\d+)?)", hook) if WATCHER.search(hook) else None
    watcher_container = any(
        WATCHER.search(" ".join(c.get("command", []) + c.get("args", []))) for c in pod["containers"][1:]
    )
    if drain is None and not watcher_container:
        problems.append(
            Problem(
                f"{key}.template.spec.containers[0].lifecycle",
                "spot pods never drain their Ray node before they stop; add lifecycle: {preStop: {exec: {command: "
                "[elastic, watch-preemption, --drain-now, '13']}}} to the Ray container",
            )
        )
    grace = pod.get("terminationGracePeriodSeconds", 30)
    if drain is not None and float(drain.group(1)) >= grace:
        problems.append(
            Problem(
                f"{key}.template.spec.containers[0].lifecycle.preStop",
                f"--drain-now {drain.group(1)} holds the pod past its terminationGracePeriodSeconds ({grace}): "
                "the kubelet kills it before the drain's deadline; lower --drain-now or raise the grace period",
            )
        )
    return problems


def _spot_selector_key(pod: dict) -> str | None:
    for k, v in (pod.get("nodeSelector") or {}).items():
        if k in K8S_SPOT_SELECTORS and str(v).lower() == K8S_SPOT_SELECTORS[k].lower():
            return k
    return None


def _k8s_market(group: dict) -> str:
    return "spot" if _spot_selector_key(group["template"]["spec"]) else "on-demand"


def _k8s_gpus(group: dict) -> float:
    resources = group.get("resources") or {}
    if "GPU" in resources:
        return float(resources["GPU"])
    if "num-gpus" in (group.get("rayStartParams") or {}):
        return float(group["rayStartParams"]["num-gpus"])
    container = group["template"]["spec"]["containers"][0].get("resources") or {}
    for section in ("limits", "requests"):
        for name, value in (container.get(section) or {}).items():
            if name.endswith("gpu"):
                return float(value)
    return 0.0


# ---------------------------------------------------------------------------------------------------------
# helpers
