"""The JSON Schema of `serve`'s settings as a `--config` file, made from `ServeSettings`: the Helm
chart's `worker.serve` (deploy/helm/loraplex/values.schema.json). `python -m
loraplex.settings.docs` writes it with the docs' tables; its drift test fails when they differ.

Each setting's type, choices and range (`Bounds`, `Matches`) become its keywords. A key the chart
sets as a flag, and the checks across settings that JSON Schema can state, are there too. JSON
Schema has no keyword for a message, so a refused value is a `const` that reads as one: Helm
prints `value must be 'the chart sets --port itself from worker.ports.http'`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loraplex.settings.fields import Setting, settings_of
from loraplex.settings.serve import ServeSettings
from loraplex.units import size_pattern

CHART_SCHEMA = "deploy/helm/loraplex/values.schema.json"
"""The chart's values schema, relative to the repository root."""
CHART_FLAGS = {
    "engine": "from worker.engine",
    "model": "from worker.model.claimName",
    "served-model-name": "from worker.model.servedName",
    "host": "(0.0.0.0, every address of the pod)",
    "port": "from worker.ports.http",
    "admin-port": "from worker.ports.admin",
    "data-dir": "on worker.diskTier",
    "registry": "from registry.urlSecret",
    "store": "from store.url (a directory on store.volume)",
    "storage-base": "from store.url (an OCI repository or an S3 prefix)",
    "api-keys": "from secrets.apiKeys",
    "admin-token-file": "from secrets.adminToken",
}
"""The `serve` flags the chart's worker template sets, which a `--config` key cannot override."""
SERVE_DESCRIPTION = (
    "`loraplex serve` settings by flag name (no `--`), mounted as `serve --config FILE`; null "
    "drops a default; the keys the chart sets from other values (engine, model, ports, ...) are "
    "refused"
)


def describable(s: Setting) -> bool:
    """Whether the schema states all that the setting's own check refuses."""
    return s.spec.check is None or hasattr(s.spec.check, "schema")


def value_schema(s: Setting) -> dict[str, Any]:
    """The JSON Schema of one setting's value in a `--config` file."""
    if s.spec.schema is not None:
        out = dict(s.spec.schema)
    elif s.spec.choices:
        out = {"enum": list(s.spec.choices)}
    elif s.multiple:  # a list, or words in one string
        out = {"type": ["array", "string"], "items": _item_schema(s)}
    else:
        out = _item_schema(s)
    if s.optional:
        out = _nullable(out)
    return {"description": s.spec.help, **out}


def _item_schema(s: Setting) -> dict[str, Any]:
    check = s.spec.check
    limits = check.schema() if check is not None and hasattr(check, "schema") else {}
    if s.spec.unit == "size":  # bytes, or a size's text (`8GiB`)
        texts = {"type": "string", "pattern": size_pattern()}
        return {"anyOf": [{"type": "integer", **limits}, texts]}
    if s.kind is bool:
        return {"type": "boolean"}
    if s.kind is int:
        return {"type": "integer", **limits}
    if s.kind is float:
        return {"type": "number", **limits}
    return {"type": "string", **limits}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    if "enum" in schema:
        return {**schema, "enum": [*schema["enum"], None]}
    if "anyOf" in schema:
        return {**schema, "anyOf": [*schema["anyOf"], {"type": "null"}]}
    kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return {**schema, "type": [*kinds, "null"]}


def config_schema(model: type, description: str) -> dict[str, Any]:
    """A `--config` file of `model`'s settings: an object of their keys, no others."""
    return {
        "type": "object",
        "description": description,
        "additionalProperties": False,
        "properties": {s.key: value_schema(s) for s in settings_of(model)},
    }


def _refused(message: str) -> dict[str, str]:
    return {"const": message}


GROUP_SERVE_DESCRIPTION = (
    "the group's `loraplex serve` settings over worker.serve's, key by key; the keys the chart "
    "sets from other values are refused"
)


def serve_schema() -> dict[str, Any]:
    """The chart's `worker.serve`: serve's settings less the ones the chart sets as flags, and
    the rules across settings that need no other value of the chart."""
    schema = config_schema(ServeSettings, SERVE_DESCRIPTION)
    for key, source in CHART_FLAGS.items():
        schema["properties"][key] = _refused(f"the chart sets --{key} itself {source}")
    both = _refused("give max-cpu-loras or cpu-cache-bytes, not both")
    schema["dependentSchemas"] = {"cpu-cache-bytes": {"properties": {"max-cpu-loras": both}}}
    lru = _refused("score-weights and min-residency-s apply to eviction-policy score, not lru")
    schema["if"] = {
        "properties": {"eviction-policy": {"const": "lru"}},
        "required": ["eviction-policy"],
    }
    schema["then"] = {"properties": {"score-weights": lru, "min-residency-s": lru}}
    return schema


def engine_rules() -> dict[str, Any]:
    """The chart's `worker`: what the vLLM engine (`worker.engine`) refuses in `worker.serve`."""
    vllm = {
        "cpu-cache-bytes": _refused(
            "the vLLM engine counts its host cache in adapters: use max-cpu-loras"
        ),
        "tenant-cpu-share": {"enum": [1, None]},
        "engine-core": {"enum": ["thread", None]},
    }
    return {
        "allOf": [
            {
                "if": {"properties": {"engine": {"const": "vllm"}}, "required": ["engine"]},
                "then": {"properties": {"serve": {"properties": vllm}}},
            }
        ]
    }


def group_engine_rules(vllm_rules: dict[str, Any]) -> dict[str, Any]:
    """The chart's top level: the vLLM engine's refusals (`worker.engine`) in each
    `workerGroups[].serve`, whose engine is the worker's."""
    serve = vllm_rules["allOf"][0]["then"]["properties"]["serve"]
    group = {"items": {"properties": {"serve": serve}}}
    return {
        "allOf": [
            {
                "if": {
                    "properties": {"worker": {"properties": {"engine": {"const": "vllm"}}}},
                    "required": ["worker"],
                },
                "then": {"properties": {"workerGroups": group}},
            }
        ]
    }


def chart_schema(text: str) -> str:
    """The chart's values schema (its JSON text) with `worker.serve` and each
    `workerGroups[].serve` made anew."""
    schema = json.loads(text)
    worker = schema["properties"]["worker"]
    worker["properties"]["serve"] = serve_schema()
    worker.update(engine_rules())
    group_serve = serve_schema()
    group_serve["description"] = GROUP_SERVE_DESCRIPTION
    schema["properties"]["workerGroups"]["items"]["properties"]["serve"] = group_serve
    schema.update(group_engine_rules(engine_rules()))
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def stale_chart_schema(root: Path, write: bool) -> list[str]:
    """[CHART_SCHEMA] when its `worker.serve` differs from the settings (rewritten when
    `write`), else []."""
    path = root / CHART_SCHEMA
    text = path.read_text()
    made = chart_schema(text)
    if made == text:
        return []
    if write:
        path.write_text(made)
    return [CHART_SCHEMA]
