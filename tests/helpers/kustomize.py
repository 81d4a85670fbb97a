"""`kubectl kustomize` for the features deploy/k8s uses, in Python (no kubectl on test machines).

A subset, and it says so: anything outside it raises `Unsupported` instead of rendering something
kustomize would not. Supported: `resources` (files under the kustomization's root, directories
anywhere), `components` (kind Component), `configMapGenerator` with `literals` (behaviors create and
merge) and `generatorOptions.disableNameSuffixHash: true`, `patches` (strategic merge, from `path`
or inline `patch`, with or without a `target` of kind/name/labelSelector), `labels` (pairs,
includeTemplates; not includeSelectors), `namespace`, `images` (newName/newTag/digest).

Order, as kustomize: a kustomization's resources (bases built first), its generators, its
components (each a kustomization applied to what is accumulated), then its transformers
(patches, labels, namespace, images).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

KNOWN_FIELDS = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "labels",
    "namespace",
    "images",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PriorityClass",
}
# patchMergeKey of the Kubernetes lists the manifests patch (other lists are replaced whole).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}


class Unsupported(ValueError):
    """The kustomization uses something this subset does not render."""


def _kustomization(folder: Path) -> dict[str, Any]:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (folder / name).is_file():
            k = yaml.safe_load((folder / name).read_text()) or {}
            unknown = set(k) - KNOWN_FIELDS
            if unknown:
                raise Unsupported(f"{folder}: fields {sorted(unknown)}")
            return k
    raise FileNotFoundError(f"no kustomization in {folder}")


def _load_file(path: Path, root: Path) -> list[Resource]:
    if root.resolve() not in path.resolve().parents:
        raise Unsupported(f"{path}: a file outside the kustomization root {root} (kustomize refuses it)")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes strategic merge for maps and the MERGE_KEYS lists; `key: null` deletes."""
    if not isinstance(base, dict) or not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(base)
    for key, value in patch.items():
        if key.startswith("$"):
            raise Unsupported(f"patch directive {key}")
        if value is None:
            out.pop(key, None)
        elif key in MERGE_KEYS and isinstance(value, list) and isinstance(out.get(key), list):
            merge_key = MERGE_KEYS[key]
            merged = [copy.deepcopy(item) for item in out[key]]
            for item in value:
                match = next(
                    (i for i, m in enumerate(merged) if m.get(merge_key) == item.get(merge_key)), None
                )
                if match is None:
                    merged.append(copy.deepcopy(item))
                else:
                    merged[match] = strategic_merge(merged[match], item)
            out[key] = merged
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = strategic_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _selected(resource: Resource, target: dict[str, Any]) -> bool:
    unknown = set(target) - {"kind", "name", "labelSelector", "group", "version"}
    if unknown:
        raise Unsupported(f"patch target fields {sorted(unknown)}")
    meta = resource.get("metadata", {})
    if "kind" in target and resource.get("kind") != target["kind"]:
        return False
    if "name" in target and meta.get("name") != target["name"]:
        return False
    for term in filter(None, (target.get("labelSelector") or "").split(",")):
        if "=" not in term or any(op in term for op in ("!=", " in ", " notin ")):
            raise Unsupported(f"label selector {term!r} (only key=value)")
        key, value = term.split("=", 1)
        if meta.get("labels", {}).get(key.strip()) != value.strip():
            return False
    return True


def _apply_patch(resources: list[Resource], entry: dict[str, Any], folder: Path) -> None:
    if "path" in entry:
        docs = _load_file(folder / entry["path"], folder)
    elif "patch" in entry:
        docs = [d for d in yaml.safe_load_all(entry["patch"]) if d]
    else:
        raise Unsupported(f"patch entry {entry}")
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise Unsupported(f"{entry}: one strategic-merge patch per entry (JSON 6902 patches unsupported)")
    patch = docs[0]
    target = entry.get("target") or {"kind": patch.get("kind"), "name": patch.get("metadata", {}).get("name")}
    hits = [i for i, r in enumerate(resources) if _selected(r, target)]
    if not hits:
        raise ValueError(f"{folder}: patch {entry} matches no resource")
    for i in hits:
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
        merged = strategic_merge(resources[i], body)
        if "labels" in patch.get("metadata", {}) or "annotations" in patch.get("metadata", {}):
            merged["metadata"] = strategic_merge(merged["metadata"], patch["metadata"] | {"name": None})
            merged["metadata"]["name"] = resources[i]["metadata"]["name"]
        resources[i] = merged


def _generate_configmaps(resources: list[Resource], k: dict[str, Any], folder: Path) -> None:
    generators = k.get("configMapGenerator") or []
    if generators and not (k.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        raise Unsupported(f"{folder}: name suffix hashes (set generatorOptions.disableNameSuffixHash)")
    for gen in generators:
        if set(gen) - {"name", "literals", "behavior"}:
            raise Unsupported(
                f"configMapGenerator fields {sorted(set(gen) - {'name', 'literals', 'behavior'})}"
            )
        data = dict(line.split("=", 1) for line in gen.get("literals", []))
        behavior = gen.get("behavior", "create")
        existing = next(
            (r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == gen["name"]), None
        )
        if behavior == "create":
            if existing is not None:
                raise ValueError(f"ConfigMap {gen['name']} exists already (behavior: create)")
            resources.append(
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data}
            )
        elif behavior == "merge":
            if existing is None:
                raise ValueError(f"ConfigMap {gen['name']} to merge into does not exist")
            existing["data"] = {**existing.get("data", {}), **data}
        else:
            raise Unsupported(f"configMapGenerator behavior {behavior}")


def _pod_spec(resource: Resource) -> dict[str, Any] | None:
    return resource.get("spec", {}).get("template", {}).get("spec")


def _label(resources: list[Resource], entries: list[dict[str, Any]]) -> None:
    for entry in entries:
        if entry.get("includeSelectors"):
            raise Unsupported("labels.includeSelectors")
        for r in resources:
            r.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
            if entry.get("includeTemplates") and "template" in r.get("spec", {}):
                r["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(
                    entry["pairs"]
                )


def _set_images(resources: list[Resource], images: list[dict[str, Any]]) -> None:
    for r in resources:
        spec = _pod_spec(r)
        if spec is None:
            continue
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            name = (
                c["image"].split("@")[0].rsplit(":", 1)[0] if "/" in c["image"] else c["image"].split(":")[0]
            )
            for img in images:
                if img["name"] == name:
                    new = img.get("newName", name)
                    c["image"] = (
                        f"{new}@{img['digest']}"
                        if "digest" in img
                        else f"{new}:{img.get('newTag', 'latest')}"
                    )


def build(
    folder: str | Path, *, component: bool = False, into: list[Resource] | None = None
) -> list[Resource]:
    """The resources `kubectl kustomize folder` prints, as dicts (a Component applies to `into`)."""
    folder = Path(folder)
    k = _kustomization(folder)
    expected = "Component" if component else "Kustomization"
    if k.get("kind", "Kustomization") != expected:
        raise ValueError(f"{folder}: kind {k.get('kind')}, expected {expected}")
    resources = into if into is not None else []
    for entry in k.get("resources", []):
        path = folder / entry
        resources.extend(build(path) if path.is_dir() else _load_file(path, folder))
    _generate_configmaps(resources, k, folder)
    for entry in k.get("components", []):
        build(folder / entry, component=True, into=resources)
    for entry in k.get("patches", []):
        _apply_patch(resources, entry, folder)
    _label(resources, k.get("labels", []))
    if "namespace" in k:
        for r in resources:
            if r["kind"] not in CLUSTER_SCOPED:
                r["metadata"]["namespace"] = k["namespace"]
    _set_images(resources, k.get("images", []))
    return resources
