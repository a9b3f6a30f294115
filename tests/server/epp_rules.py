"""The llm-d Endpoint Picker's reading of a model server's /metrics, restated in Python for the
conformance tests.

Source: llm-d/llm-d-router at ebab687 (2026-08-22),
pkg/epp/framework/plugins/datalayer/extractor/metrics (extractor.go, spec.go, loraspec.go,
factories.go) and scheduling/scorer/loraaffinity. The EPP parses the text format with Prometheus'
expfmt TextParser (legacy name validation), then per engine mapping:
- a gauge spec takes the matching series with the highest timestamp (the first one when none has
  a timestamp), and a missing family or series is an error;
- the LoRA spec takes the series with the highest value (each label set is its own series, its
  value the time it was current); running and waiting lists are split on commas, trimmed, empties
  dropped; `max_lora` must be an integer (strconv.Atoi) when not empty."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

# The loraplex mapping: the names the engine config in deploy/kubernetes declares (the vLLM names).
MAPPING = {
    "queue": "vllm:num_requests_waiting",
    "running": "vllm:num_requests_running",
    "kv": "vllm:kv_cache_usage_perc",
    "lora": "vllm:lora_requests_info",
}
LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
ATOI = re.compile(r"^[+-]?[0-9]+$")


class ExtractError(AssertionError):
    """What the EPP would count as an extraction error for this endpoint."""


@dataclass
class EndpointMetrics:
    waiting_queue_size: int = 0
    running_requests_size: int = 0
    kv_cache_usage_percent: float = 0.0
    active_models: set[str] = field(default_factory=set)
    waiting_models: set[str] = field(default_factory=set)
    max_active_models: int = 0
    lora_info_value: float | None = None


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    value: float
    timestamp: float | None


def parse(text: str) -> dict[str, tuple[str, list[Series]]]:
    """Families by name: (type, series). Names and labels must pass the legacy validation the EPP
    uses."""
    families = {}
    for family in text_string_to_metric_families(text):
        if not LEGACY_NAME.match(family.name):
            raise ExtractError(f"invalid metric name {family.name!r}")
        series = []
        for sample in family.samples:
            for label in sample.labels:
                if not LEGACY_LABEL.match(label):
                    raise ExtractError(f"invalid label name {label!r} on {family.name}")
            series.append(Series(dict(sample.labels), sample.value, sample.timestamp))
        families[family.name] = (family.type, series)
    return families


def _gauge(families, name: str) -> float:
    if name not in families or not families[name][1]:
        raise ExtractError(f"metric family {name!r} not found")
    kind, series = families[name]
    # extractValue reads only gauges and counters (anything else is 0)
    if kind not in ("gauge", "counter"):
        raise ExtractError(f"{name} is a {kind}, not a gauge")
    latest, recent = None, -1.0
    for s in series:
        ts = s.timestamp or 0.0
        if ts > recent:  # strictly greater: the first series wins among equal timestamps
            latest, recent = s, ts
    return latest.value


def _adapters(csv: str) -> set[str]:
    return {name.strip() for name in csv.split(",") if name.strip()}


def extract(text: str) -> EndpointMetrics:
    """The EPP's per-endpoint figures from a /metrics body; ExtractError where the EPP would record
    an error."""
    families = parse(text)
    out = EndpointMetrics(
        waiting_queue_size=int(_gauge(families, MAPPING["queue"])),
        running_requests_size=int(_gauge(families, MAPPING["running"])),
        kv_cache_usage_percent=_gauge(families, MAPPING["kv"]),
    )
    _, series = families.get(MAPPING["lora"], (None, []))
    latest, recent = None, -1.0
    for s in series:
        if s.value > recent:
            latest, recent = s, s.value
    if latest is not None:
        out.lora_info_value = latest.value
        out.active_models = _adapters(latest.labels.get("running_lora_adapters", ""))
        out.waiting_models = _adapters(latest.labels.get("waiting_lora_adapters", ""))
        max_lora = latest.labels.get("max_lora", "")
        if max_lora:
            if not ATOI.match(max_lora):
                raise ExtractError(f"max_lora {max_lora!r} is not an integer")
            out.max_active_models = int(max_lora)
    return out


def lora_affinity(m: EndpointMetrics, model: str) -> float:
    """lora-affinity-scorer: 1.0 active, 0.8 spare capacity, 0.6 waiting, else 0."""
    if model in m.active_models:
        return 1.0
    if len(m.active_models) + len(m.waiting_models) < m.max_active_models:
        return 0.8
    return 0.6 if model in m.waiting_models else 0.0
