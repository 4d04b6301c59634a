"""Schemas the JSON Schema benchmarks run on, fetched from PyPI packages at run time.

Nothing here is committed data: each source is a public package that ships the files
(downloaded once with ``pip download`` into ``~/.cache/formcast-bench``, or
``$FORMCAST_BENCH_CACHE``):

- the JSON-Schema-Test-Suite, vendored in the ``jsonschema`` sdist (its ``json/``);
- SchemaStore schemas vendored by ``check-jsonschema`` (GitHub workflows, dependabot,
  renovate, gitlab-ci, azure-pipelines, ...);
- Kubernetes resource schemas from ``kubernetes-validate``;
- AWS CloudFormation resource schemas from ``cfn-lint``;
- OpenAPI component schemas (GitHub's, Stripe's and Docker's APIs) from the test
  fixtures in the ``openapi-spec-validator`` sdist;
- function-calling tool schemas from the Berkeley Function Calling Leaderboard
  (``bfcl-eval``), with BFCL's Python type names mapped to JSON Schema's as BFCL
  does for OpenAI-style tools.
"""

from __future__ import annotations

import copy
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRAFT7 = "http://json-schema.org/draft-07/schema#"


def cache_dir() -> Path:
    """Where downloads and generated instances are kept (created on first use)."""
    root = Path(os.environ.get("FORMCAST_BENCH_CACHE", "~/.cache/formcast-bench")).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    return root


def fetch(requirement: str, *, sdist: bool = False) -> Path:
    """The archive of one PyPI package (``name==version`` or ``name``), downloaded once."""
    folder = cache_dir() / "packages" / requirement.replace("=", "_")
    found = sorted(folder.glob("*.tar.gz" if sdist else "*.whl")) if folder.exists() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    kind = ["--no-binary", ":all:"] if sdist else ["--only-binary", ":all:"]
    print(f"downloading {requirement} from PyPI into {folder} ...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", *kind,
                    requirement, "-d", str(folder)], check=True)
    return sorted(folder.glob("*.tar.gz" if sdist else "*.whl"))[0]


def members(archive: Path, prefix: str, suffixes: tuple[str, ...]) -> Iterator[tuple[str, bytes]]:
    """(path inside the archive after ``prefix``, bytes) of the files under ``prefix``."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as z:
            for name in sorted(z.namelist()):
                if name.startswith(prefix) and name.endswith(suffixes):
                    yield name[len(prefix):], z.read(name)
        return
    with tarfile.open(archive) as t:
        for info in sorted(t.getmembers(), key=lambda m: m.name):
            name = info.name.split("/", 1)[1] if "/" in info.name else info.name
            if info.isfile() and name.startswith(prefix) and name.endswith(suffixes):
                yield name[len(prefix):], t.extractfile(info).read()


# --- the JSON-Schema-Test-Suite ------------------------------------------------

@dataclass(frozen=True)
class SuiteGroup:
    """One group of the suite: a schema and its instances with the expected verdicts."""

    file: str
    description: str
    schema: Any
    tests: tuple[tuple[str, Any, bool], ...]    # (description, instance, valid)


def suite_groups(draft: str, *, optional: bool) -> tuple[list[SuiteGroup], list[str]]:
    """The suite's groups for ``draft`` ("draft2020-12" or "draft7") and skip notes.

    Skipped, as the suite's own runners skip them without a remote server:
    ``refRemote.json`` and every group whose schema refers to the suite's
    ``http://localhost:1234`` remotes. ``optional/`` is skipped unless asked for.
    Draft-7 schemas without ``$schema`` get draft 7's, so the draft is known.
    """
    version = importlib.metadata.version("jsonschema")
    archive = fetch(f"jsonschema=={version}", sdist=True)
    groups, remote, optional_n = [], 0, 0
    for path, raw in members(archive, f"json/tests/{draft}/", (".json",)):
        if path.startswith("optional/") and not optional:
            optional_n += len(json.loads(raw))
            continue
        for group in json.loads(raw):
            schema = group["schema"]
            if path == "refRemote.json" or "localhost:1234" in json.dumps(schema):
                remote += 1
                continue
            if draft == "draft7" and isinstance(schema, dict) and "$schema" not in schema:
                schema = {"$schema": DRAFT7, **schema}
            tests = tuple((t["description"], t["data"], t["valid"]) for t in group["tests"])
            groups.append(SuiteGroup(path, group["description"], schema, tests))
    notes = [f"JSON-Schema-Test-Suite {draft} from the jsonschema {version} sdist",
             f"skipped {remote} groups that need the suite's remote-schema server "
             "(refRemote.json, refs to http://localhost:1234)"]
    if not optional:
        notes.append(f"skipped {optional_n} groups of optional/ (formats, bignum, "
                     "ecmascript-regex...; --optional runs them)")
    return groups, notes


# --- real-world schemas --------------------------------------------------------

@dataclass(frozen=True)
class CorpusSchema:
    """A real-world schema: where it came from, and the dialect its oracle must read."""

    source: str
    name: str
    schema: Any
    openapi30: bool = False        # OpenAPI 3.0: "nullable" adds null to the type


def _ref_closure(node: Any, lookup: dict[str, Any], prefixes: tuple[str, ...],
                 seen: set[str]) -> None:
    """Add to ``seen`` the definition names reachable by ``$ref``s ``prefix + name``."""
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            for prefix in prefixes if isinstance(ref, str) else ():
                name = ref[len(prefix):].split("/")[0] if ref.startswith(prefix) else None
                if name is not None and name not in seen and name in lookup:
                    seen.add(name)
                    stack.append(lookup[name])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _rewrite_refs(node: Any, old: str, new: str) -> Any:
    if isinstance(node, dict):
        return {k: (new + v[len(old):] if k == "$ref" and isinstance(v, str)
                    and v.startswith(old) else _rewrite_refs(v, old, new))
                for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(v, old, new) for v in node]
    return node


def bundle(root: Any, definitions: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``root`` made self-contained: the definitions it reaches through ``$ref``s that
    start with ``prefix`` (or ``#/$defs/``, inside the definitions) copied under
    ``$defs``, and those refs made local."""
    names: set[str] = set()
    _ref_closure(root, definitions, (prefix, "#/$defs/"), names)
    out = _rewrite_refs(copy.deepcopy(root), prefix, "#/$defs/")
    if names:
        out["$defs"] = {n: _rewrite_refs(definitions[n], prefix, "#/$defs/")
                        for n in sorted(names)}
    return out


def _sample(items: list[Any], k: int, seed: str) -> list[Any]:
    return items if len(items) <= k else random.Random(seed).sample(items, k)


def schemastore() -> list[CorpusSchema]:
    archive = fetch("check-jsonschema")
    return [CorpusSchema("schemastore", path.rsplit("/", 1)[-1].removesuffix(".json"),
                         json.loads(raw))
            for path, raw in members(archive, "check_jsonschema/builtin_schemas/", (".json",))]


def kubernetes(k: int) -> list[CorpusSchema]:
    archive = fetch("kubernetes-validate")
    files = dict(members(archive, "kubernetes_validate/kubernetes-json-schema/", (".json",)))
    version = max((p.split("/")[0] for p in files if p.endswith("-local/_definitions.json")),
                  key=lambda v: [int(x) for x in v[1:].split("-")[0].split(".")])
    defs = json.loads(files[f"{version}/_definitions.json"])["$defs"]
    names = sorted(p for p in files if p.startswith(f"{version}/") and "_definitions" not in p
                   and not p.endswith("/all.json"))
    return [CorpusSchema("kubernetes", p.rsplit("/", 1)[-1].removesuffix(".json"),
                         bundle(json.loads(files[p]), defs, "/api/_definitions.json#/$defs/"))
            for p in _sample(names, k, "kubernetes")]


def cloudformation(k: int) -> list[CorpusSchema]:
    archive = fetch("cfn-lint")
    found = [json.loads(raw) for _, raw in members(archive, "cfnlint/data/schemas/resources/",
                                                   (".json",))]
    found.sort(key=lambda s: s.get("typeName", ""))
    return [CorpusSchema("cloudformation", s.get("typeName", "?"), s)
            for s in _sample(found, k, "cloudformation")]


def openapi(k: int) -> list[CorpusSchema]:
    import yaml

    archive = fetch("openapi-spec-validator", sdist=True)
    out: list[CorpusSchema] = []
    for path, raw in members(archive, "tests/bench/specs/", (".yaml",)):
        api = path.removesuffix(".yaml")
        if api not in ("github", "stripe", "docker"):
            continue
        spec = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if "components" in spec:
            defs, prefix = spec["components"].get("schemas", {}), "#/components/schemas/"
        else:   # Swagger 2.0
            defs, prefix = spec.get("definitions", {}), "#/definitions/"
        for name in _sample(sorted(defs), k, api):
            out.append(CorpusSchema(f"openapi-{api}", name, bundle(defs[name], defs, prefix),
                                    openapi30="openapi" in spec))
    return out


_BFCL_TYPES = {"dict": "object", "float": "number", "tuple": "array"}


def _bfcl_to_json_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _bfcl_to_json_schema(v) for k, v in node.items()}
        kind = node.get("type")
        if kind == "any":
            del out["type"]
        elif isinstance(kind, str):
            out["type"] = _BFCL_TYPES.get(kind, kind)
        return out
    if isinstance(node, list):
        return [_bfcl_to_json_schema(v) for v in node]
    return node


def function_tools(k: int) -> list[CorpusSchema]:
    archive = fetch("bfcl-eval")
    tools: dict[str, Any] = {}
    for path, raw in members(archive, "bfcl_eval/data/", (".json",)):
        if "/" in path or not ("live_" in path or "simple_python" in path or "_multiple" in path):
            continue
        for line in raw.decode("utf-8").splitlines():
            for fn in json.loads(line).get("function", []) if line.strip() else []:
                tools.setdefault(fn["name"], fn["parameters"])
    return [CorpusSchema("function-tools", name, _bfcl_to_json_schema(tools[name]))
            for name in _sample(sorted(tools), k, "bfcl")]


def real_world(per_source: int) -> list[CorpusSchema]:
    """The corpus: every SchemaStore schema, and ``per_source`` from each other source
    (OpenAPI: from each of its three APIs), sampled with a fixed seed; kept as JSON in
    the cache after the first build (parsing the OpenAPI YAML takes a while)."""
    path = cache_dir() / f"corpus-v1-{per_source}.json"
    if path.exists():
        return [CorpusSchema(**row) for row in json.loads(path.read_text())]
    corpus = [*schemastore(), *kubernetes(per_source), *cloudformation(per_source),
              *openapi(max(1, per_source // 3)), *function_tools(per_source)]
    path.write_text(json.dumps([vars(c) for c in corpus]))
    return corpus
