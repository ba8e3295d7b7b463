"""A small kustomize in Python: exactly the features deploy/kubernetes uses, so the
overlays can be rendered and checked where no kustomize binary is installed.

Supported: `resources` (files and kustomization folders), `components`, `namespace`,
`labels` (metadata only), `configMapGenerator` (files, options.labels, no hash suffix),
`patches` holding RFC 6902 operations (add, remove, replace, test) with a kind/name
target, and `images` (newName/newTag on containers and initContainers at any depth).
Anything else raises Unsupported instead of rendering something kustomize would not;
tests/deploy compares the output with `kubectl kustomize` where kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "namespace", "labels", "resources", "components",
                      "generatorOptions", "configMapGenerator", "patches", "images"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                        "StorageClass", "PriorityClass", "CustomResourceDefinition"}


class Unsupported(ValueError):
    pass


def build(folder: str | Path) -> list[dict]:
    """The rendered objects of the kustomization in `folder`, in kustomize's order of
    accumulation (resources, components, generated, then transformed)."""
    return _accumulate(Path(folder), [])


def load_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(folder: Path) -> dict:
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise Unsupported(f"{folder}: kustomization keys {sorted(unknown)}")
    return k


def _accumulate(folder: Path, objects: list[dict]) -> list[dict]:
    k = _kustomization(folder)
    for entry in k.get("resources", []):
        path = folder / entry
        objects.extend(build(path) if path.is_dir() else load_documents(path))
    for entry in k.get("components", []):
        if _kustomization(folder / entry).get("kind") != "Component":
            raise Unsupported(f"{entry} is not a Component")
        _accumulate(folder / entry, objects)
    objects.extend(_config_maps(folder, k))
    for patch in k.get("patches", []):
        _patch(folder, patch, objects)
    for obj in objects:
        _transform(obj, k)
    return objects


def _config_maps(folder: Path, k: dict) -> list[dict]:
    no_hash = k.get("generatorOptions", {}).get("disableNameSuffixHash", False)
    made = []
    for gen in k.get("configMapGenerator", []):
        options = gen.get("options", {})
        if set(gen) - {"name", "files", "options"} or set(options) - {"labels",
                                                                      "disableNameSuffixHash"}:
            raise Unsupported(f"configMapGenerator {gen['name']}: {sorted(gen)}")
        if not options.get("disableNameSuffixHash", no_hash):
            raise Unsupported(f"configMapGenerator {gen['name']}: name hash suffixes")
        data = {}
        for entry in gen.get("files", []):
            key, _, path = entry.rpartition("=") if "=" in entry else ("", "", entry)
            data[key or Path(path).name] = (folder / path).read_text()
        metadata = {"name": gen["name"]}
        if options.get("labels"):
            metadata["labels"] = dict(options["labels"])
        made.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata,
                     "data": data})
    return made


def _transform(obj: dict, k: dict) -> None:
    if "namespace" in k and obj["kind"] not in CLUSTER_SCOPED_KINDS:
        obj["metadata"]["namespace"] = k["namespace"]
    for label in k.get("labels", []):
        if label.get("includeSelectors") or label.get("includeTemplates"):
            raise Unsupported("labels on selectors or templates")
        obj["metadata"].setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        _set_images(obj, image)


def _set_images(node, image: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    container["image"] = _new_image(container["image"], image)
            _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)


def _new_image(current: str, image: dict) -> str:
    name, _, tag = current.rpartition(":") if ":" in current.rsplit("/", 1)[-1] \
        else (current, "", "")
    if "@" in current or set(image) - {"name", "newName", "newTag"}:
        raise Unsupported(f"image {current} / {image}")
    if name != image["name"]:
        return current
    name = image.get("newName", name)
    tag = image.get("newTag", tag)
    return f"{name}:{tag}" if tag else name


# -- RFC 6902 patches ---------------------------------------------------------------------

def _patch(folder: Path, patch: dict, objects: list[dict]) -> None:
    ops = yaml.safe_load((folder / patch["path"]).read_text()) if "path" in patch \
        else yaml.safe_load(patch["patch"])
    if not isinstance(ops, list):
        raise Unsupported(f"{patch}: only RFC 6902 (JSON) patches")
    target = patch["target"]
    if set(target) - {"group", "version", "kind", "name"}:
        raise Unsupported(f"patch target {target}")
    matched = [o for o in objects if _matches(o, target)]
    if not matched:
        raise ValueError(f"patch target {target} matches nothing")
    for obj in matched:
        for op in ops:
            _apply(obj, op)


def _matches(obj: dict, target: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return (obj["kind"] == target.get("kind", obj["kind"])
            and obj["metadata"]["name"] == target.get("name", obj["metadata"]["name"])
            and group == target.get("group", group)
            and version == target.get("version", version))


def _apply(obj: dict, op: dict) -> None:
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    parent = obj
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    kind = op["op"]
    if isinstance(parent, list):
        index = len(parent) if last == "-" else int(last)
        if kind == "add":
            parent.insert(index, copy.deepcopy(op["value"]))
        elif kind == "replace":
            parent[index] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[index]
        elif kind == "test":
            _test(parent[index], op)
        else:
            raise Unsupported(f"patch op {kind}")
    else:
        if kind in ("replace", "remove", "test") and last not in parent:
            raise ValueError(f"{op['path']}: no such path to {kind}")
        if kind in ("add", "replace"):
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del parent[last]
        elif kind == "test":
            _test(parent[last], op)
        else:
            raise Unsupported(f"patch op {kind}")


def _test(value, op: dict) -> None:
    if value != op["value"]:
        raise ValueError(f"patch test failed at {op['path']}: {value!r} != {op['value']!r}")
