"""Cluster configs: checks of `ray up` cluster configs and KubeRay manifests against Ray's schema and our rules."""
