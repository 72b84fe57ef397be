#!/usr/bin/env python3
"""Checks deploy/kubernetes: renders every kustomization the way kustomize does for the features
these manifests use (resources, labels, images, configMapGenerator, strategic-merge patches with
`$patch: replace`), then validates every rendered object strictly against the Kubernetes OpenAPI
schemas (kubernetes-validate: unknown fields are errors). Each generated headroom config is checked
by `headroom serve --check`. Exit status 1 on the first kind of failure, with every problem listed.

    python3 scripts/check_deploy.py [--headroom target/release/headroom] [--kubernetes 1.31.0]
"""

import argparse
import copy
import pathlib
import subprocess
import sys

import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
KUSTOMIZATIONS = ["deploy/kubernetes/base", "deploy/kubernetes/sim", "deploy/kubernetes/replay"]
# Where each generated ConfigMap's files came from (by the object's id), to check them with headroom.
GENERATED_FROM = {}
KNOWN_KEYS = {"apiVersion", "kind", "resources", "labels", "images", "configMapGenerator", "patches"}


def merge(base, patch):
    """Strategic merge as kustomize applies it to these manifests: maps merge key by key, lists of
    maps with a `name` merge by name, other lists replace, and `$patch: replace` replaces."""
    if isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: v for k, v in patch.items() if k != "$patch"}
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for k, v in patch.items():
            out[k] = merge(out.get(k), v)
        return out
    if isinstance(patch, list):
        if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
            return [p for p in patch if not (isinstance(p, dict) and "$patch" in p)]
        if isinstance(base, list) and all(isinstance(p, dict) and "name" in p for p in patch):
            out = copy.deepcopy(base)
            for p in patch:
                for i, b in enumerate(out):
                    if isinstance(b, dict) and b.get("name") == p["name"]:
                        out[i] = merge(b, p)
                        break
                else:
                    out.append(p)
            return out
        return copy.deepcopy(patch)
    return copy.deepcopy(patch)


def set_image(obj, name, tag):
    """Applies an `images` entry to every container of a pod template or pod spec in `obj`."""
    if isinstance(obj, dict):
        for key in ("containers", "initContainers"):
            for c in obj.get(key, []) or []:
                if c.get("image") == name:
                    c["image"] = f"{name}:{tag}"
        for v in obj.values():
            set_image(v, name, tag)
    elif isinstance(obj, list):
        for v in obj:
            set_image(v, name, tag)


def render(directory, problems):
    """The objects a kustomization directory produces."""
    directory = ROOT / directory if not pathlib.Path(directory).is_absolute() else pathlib.Path(directory)
    path = directory / "kustomization.yaml"
    k = yaml.safe_load(path.read_text())
    unknown = set(k) - KNOWN_KEYS
    if unknown:
        problems.append(f"{path}: fields this check does not render: {sorted(unknown)}")
    objects = []
    for r in k.get("resources", []):
        target = directory / r
        if target.is_dir():
            objects += render(target, problems)
        elif target.is_file():
            objects += [d for d in yaml.safe_load_all(target.read_text()) if d is not None]
        else:
            problems.append(f"{path}: resource {r} does not exist")
    for g in k.get("configMapGenerator", []):
        data = {}
        for f in g.get("files", []):
            source = directory / f
            if not source.is_file():
                problems.append(f"{path}: configMapGenerator file {f} does not exist")
                continue
            data[pathlib.Path(f).name] = source.read_text()
        config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]}, "data": data}
        GENERATED_FROM[id(config_map)] = [directory / f for f in g.get("files", [])]
        objects.append(config_map)
    for p in k.get("patches", []):
        patch = yaml.safe_load((directory / p["path"]).read_text())
        hits = [o for o in objects if o.get("kind") == patch.get("kind")
                and o["metadata"]["name"] == patch["metadata"]["name"]]
        if not hits:
            problems.append(f"{path}: patch {p['path']} matches no object")
        for o in hits:
            o.update(merge(o, patch))
    for label in k.get("labels", []):
        for o in objects:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(label["pairs"])
    for image in k.get("images", []):
        for o in objects:
            set_image(o, image["name"], image["newTag"])
    return objects


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--headroom", default=str(ROOT / "target/release/headroom"))
    parser.add_argument("--kubernetes", default="1.31.0", help="schema version to validate against")
    args = parser.parse_args()
    problems = []
    checked = 0
    for directory in KUSTOMIZATIONS:
        objects = render(directory, problems)
        for o in objects:
            name = f"{directory}: {o.get('kind')}/{o.get('metadata', {}).get('name')}"
            try:
                kubernetes_validate.validate(o, args.kubernetes, strict=True)
            except kubernetes_validate.ValidationError as e:
                problems.append(f"{name}: {e.message} at {'/'.join(map(str, e.path))}")
            except Exception as e:  # an unknown kind or apiVersion
                problems.append(f"{name}: {e}")
            checked += 1
            for config in [f for f in GENERATED_FROM.get(id(o), []) if f.suffix == ".toml"]:
                run = subprocess.run([args.headroom, "serve", "--config", str(config), "--check"],
                                     capture_output=True, text=True)
                if run.returncode != 0:
                    problems.append(f"{config}: headroom serve --check failed:\n{run.stderr}")
            for c in (o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []) or []):
                image = c.get("image", "")
                if ":" not in image or image.endswith(":latest"):
                    problems.append(f"{name}: container {c['name']} image {image!r} has no pinned tag")
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    print(f"{checked} objects from {len(KUSTOMIZATIONS)} kustomizations checked against Kubernetes "
          f"{args.kubernetes} (strict): {len(problems)} problems")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
