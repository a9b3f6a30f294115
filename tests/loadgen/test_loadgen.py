"""`loraplex bench serve` against a real worker (more adapters than slots), and its summary on fake
records."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from collections import Counter

import httpx
import pytest

from loraplex.loadgen import traffic
from loraplex.loadgen.procs import start_worker
from loraplex.loadgen.traffic import Record
from loraplex.sim.workload import Request, Tenant, WorkloadSpec, generate, write_trace

KEYS = {"alice": "alice-key-0123456789abcdef", "bob": "bob-key-0123456789abcdef00"}
ADAPTERS = ["ad-0", "ad-1", "ad-2", "ad-3"]


@pytest.fixture(scope="module")
def worker(llama_dir, llama_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("loadgen")
    keys = root / "keys.txt"
    keys.write_text("# tenant key\n" + "".join(f"{t} {k}\n" for t, k in KEYS.items()))
    paths = list(llama_adapters.values())
    adapters = {name: paths[i % len(paths)] for i, name in enumerate(ADAPTERS)}
    proc = start_worker(
        llama_dir,
        root / "worker",
        adapters,
        "--max-loras",
        "2",
        "--served-model-name",
        "base",
        "--api-keys",
        str(keys),
    )
    try:
        yield proc.url, keys
    finally:
        proc.stop()


def small_trace(n: int = 24) -> list[Request]:
    """Zipf over the worker's four adapters (`ad-0` the most popular), two tenants, short
    requests."""
    spec = WorkloadSpec(
        name="ad",
        seed=3,
        duration_s=10.0,
        rate=8.0,
        num_adapters=len(ADAPTERS),
        s=1.2,
        tenants=(Tenant("alice"), Tenant("bob")),
        prompt_tokens=(8, 24),
        output_tokens=(2, 6),
    )
    return generate(spec)[:n]


def bench(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    # pytest sets 80: keep table rows whole
    return subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "bench", "serve", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "COLUMNS": "200"},
    )


def requests_total(url: str) -> Counter:
    """(tenant, code) -> count from the worker's `loraplex_requests_total`."""
    out = Counter()
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loraplex_requests_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            out[(labels["tenant"], labels["code"])] += int(float(line.rsplit(" ", 1)[1]))
    return out


def delta(after: Counter, before: Counter) -> Counter:
    return Counter({k: after[k] - before[k] for k in after if after[k] != before[k]})


def check_summary(summary: dict, n: int) -> None:
    assert summary["requests"] == summary["ok"] == n, summary["errors"]
    assert summary["errors"] == {}
    tiers = summary["tiers"]
    assert sum(tiers.values()) == n
    assert tiers["unknown"] == 0  # a loraplex worker always says
    # 4 adapters, 2 slots: hits and cold starts
    assert tiers["gpu"] > 0 and summary["cold_starts"] > 0, tiers
    assert summary["cold_starts"] == tiers["cpu"] + tiers["disk"] + tiers["remote"]
    assert summary["cold_start_rate"] == pytest.approx(summary["cold_starts"] / n, abs=1e-3)
    assert summary["latency"]["all"]["n"] == n
    assert sum(lat["n"] for tier, lat in summary["latency"].items() if tier != "all") == n
    for lat in summary["latency"].values():
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            p = lat[key]
            assert p["p50"] is not None and 0 <= p["p50"] <= p["p95"] <= p["p99"], (key, lat)
    assert summary["output_tokens"] > 0 and summary["throughput"]["requests_per_s"] > 0


def test_open_loop_replays_a_trace_file_with_tenant_keys(worker, tmp_path):
    url, keys = worker
    trace = small_trace()
    write_trace(trace, tmp_path / "trace.jsonl")
    before = requests_total(url)
    out = tmp_path / "open.json"
    done = bench(
        "--url",
        url,
        "--trace",
        tmp_path / "trace.jsonl",
        "--api-keys",
        keys,
        "--time-scale",
        "0.5",
        "--json",
        out,
        "--per-request",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    check_summary(summary, len(trace))
    assert summary["config"]["mode"] == "open" and summary["config"]["time_scale"] == 0.5
    assert summary["trace"]["requests"] == len(trace)
    records = summary["records"]
    assert [r["model"] for r in records] == [r.adapter for r in trace]
    # ignore_eos held
    assert all(r["output_tokens"] == req.output_tokens for r, req in zip(records, trace))
    # The worker counted every request, each under its trace tenant's key.
    sent = Counter((r.tenant, "200") for r in trace)
    assert delta(requests_total(url), before) == sent
    assert (
        "TTFT p50" in done.stdout
        and "gpu" in done.stdout
        and f"{len(trace)}/{len(trace)} ok" in done.stdout
    )


def test_closed_loop_maps_a_named_workload_onto_served_adapters(worker, tmp_path):
    url, _ = worker
    before = requests_total(url)
    out = tmp_path / "closed.json"
    done = bench(
        "--url",
        url,
        "--workload",
        "zipf",
        "--adapters",
        ",".join(ADAPTERS),
        "--limit",
        20,
        "--clients",
        3,
        "--max-prompt-tokens",
        24,
        "--max-output-tokens",
        4,
        "--api-key",
        KEYS["bob"],
        "--json",
        out,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    check_summary(summary, 20)
    assert summary["config"] == {
        "url": url,
        "mode": "closed",
        "clients": 3,
        "time_scale": 1.0,
        "prompt_unit": "char",
    }
    assert summary["trace"] == {"source": "zipf", "seed": 0, "requests": 20}
    assert "records" not in summary  # no per-request list without --per-request
    # no trace times to be late for
    assert summary["send_lag_ms"] == {
        "p50": None,
        "p95": None,
        "p99": None,
    }
    assert delta(requests_total(url), before) == Counter({("bob", "200"): 20})


def test_errors_are_counted_by_code(worker, tmp_path):
    url, _ = worker
    keys = tmp_path / "keys.txt"  # alice's key is right, bob's is wrong
    keys.write_text(f"alice {KEYS['alice']}\nbob wrong-key-0123456789abcdef\n")
    # 3 × 404, 3 ok
    alice = [
        "no-such-adapter",
        "ad-0",
        "no-such-adapter",
        None,
        "no-such-adapter",
        "ad-0",
    ]
    sent = [("alice", a) for a in alice] + [("bob", "ad-0")] * 6  # 6 × 401
    trace = [Request(0.01 * i, tenant, adapter, 8, 3) for i, (tenant, adapter) in enumerate(sent)]
    write_trace(trace, tmp_path / "trace.jsonl")
    before = requests_total(url)
    out = tmp_path / "errors.json"
    done = bench(
        "--url",
        url,
        "--trace",
        tmp_path / "trace.jsonl",
        "--api-keys",
        keys,
        "--json",
        out,
        "--per-request",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(out.read_text())
    assert summary["errors"] == {"401": 6, "404": 3}
    assert summary["ok"] == 3 and summary["failed"] == 9
    assert sum(summary["tiers"].values()) == 3
    ok = [r for r in summary["records"] if r["code"] == "200"]
    # the base model's name from /v1/models
    assert sorted(r["model"] for r in ok) == [
        "ad-0",
        "ad-0",
        "base",
    ]
    assert all(r["tier"] == "unknown" for r in summary["records"] if r["code"] == "401")
    assert delta(requests_total(url), before) == Counter(
        {("unauthenticated", "401"): 6, ("alice", "404"): 3, ("alice", "200"): 3}
    )
    assert "401 ×6" in done.stdout and "404 ×3" in done.stdout


def test_unreachable_server_exits_2_with_one_line(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the run: nothing listens there
    done = bench("--url", f"http://127.0.0.1:{port}", "--workload", "zipf", "--limit", 3)
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"error: cannot reach http://127.0.0.1:{port}")
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    bad = bench("--url", "localhost:8000", "--workload", "zipf", "--limit", 3)
    assert bad.returncode == 2 and "http://" in bad.stderr and "Traceback" not in bad.stderr
    port = bench("--url", "http://127.0.0.1:99999", "--workload", "zipf", "--limit", 3)
    assert (
        port.returncode == 2
        and "port 99999 is not in 1-65535" in port.stderr
        and "Traceback" not in port.stderr
    )


def test_an_unwritable_json_path_is_refused_before_any_request(tmp_path):
    tmp_path = tmp_path / ("long-" * 30)  # its line is over 200 columns: never wrapped
    tmp_path.mkdir()
    (tmp_path / "a-file").write_text("")
    cases = {
        "/proc/out.json": "cannot write in /proc: ",  # refused on writing, root's permissions too
        str(tmp_path / "a-file" / "out.json"): f"{tmp_path / 'a-file'} is not a directory",
        str(tmp_path): "a directory",
    }
    for path, message in cases.items():  # nothing listens at port 1: a run would fail to reach it
        done = bench("--url", "http://127.0.0.1:1", "--workload", "zipf", "--json", path)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()  # whole, however long the path
        assert line.startswith(f"error: --json {path}: {message}"), done.stderr


def test_unknown_workload_is_a_clear_error():
    done = bench("--url", "http://127.0.0.1:1", "--workload", "nope")
    assert done.returncode == 2
    assert "unknown workload 'nope'" in done.stderr and "zipf" in done.stderr


# -- pure: the summary of fake records -------------------------------------------------------------
def rec(i, tier="gpu", code="200", ttft=0.1, e2e=0.5, tokens=5) -> Record:
    return Record(i, "t", "m", code, tier, sent_s=0.0, ttft_s=ttft, e2e_s=e2e, output_tokens=tokens)


def test_percentiles_interpolate_and_handle_empty():
    assert traffic.percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert traffic.percentiles([0.004], 1000) == {"p50": 4.0, "p95": 4.0, "p99": 4.0}
    p = traffic.percentiles([float(v) for v in range(1, 101)])
    assert p == {"p50": 50.5, "p95": 95.05, "p99": 99.01}


def test_summary_splits_by_tier_and_counts_cold_starts_and_errors():
    records = [
        rec(0, "gpu", ttft=0.01, e2e=0.05),
        rec(1, "gpu", ttft=0.03, e2e=0.07),
        rec(2, "cpu", ttft=0.2),
        rec(3, "remote", ttft=0.9, e2e=1.3),
        rec(4, "unknown"),
        rec(5, "unknown", code="404", ttft=None),
        rec(6, "unknown", code="connect", ttft=None, e2e=None),
        rec(7, "gpu", code="stream:adapter_unavailable"),
    ]
    s = traffic.summarize(records, duration_s=2.0)
    assert (s["requests"], s["ok"], s["failed"]) == (8, 5, 3)
    assert s["errors"] == {"404": 1, "connect": 1, "stream:adapter_unavailable": 1}
    assert s["tiers"] == {"gpu": 2, "cpu": 1, "disk": 0, "remote": 1, "unknown": 1}
    assert s["cold_starts"] == 2 and s["cold_start_rate"] == 0.5  # unknown is neither warm nor cold
    # as loraplex plan counts: disk and remote
    assert s["storage_loads"] == 1 and s["storage_load_rate"] == 0.25
    assert s["throughput"] == {"requests_per_s": 2.5, "output_tokens_per_s": 12.5}
    assert set(s["latency"]) == {"all", "gpu", "cpu", "remote", "unknown"}
    assert s["latency"]["gpu"]["ttft_ms"]["p50"] == 20.0
    assert s["latency"]["remote"]["tpot_ms"]["p50"] == 100.0  # (1.3 - 0.9) / (5 - 1)
    assert s["latency"]["all"]["n"] == 5


def test_tpot_needs_two_tokens():
    assert rec(0, tokens=1).tpot_s is None
    assert rec(0, ttft=None).tpot_s is None
    assert rec(0, ttft=0.1, e2e=0.3, tokens=3).tpot_s == pytest.approx(0.1)


def test_adapters_map_by_popularity_and_prompts_are_deterministic():
    trace = [Request(i, "t", a, 10, 2) for i, a in enumerate(["x", "y", "y", None, "z", "y", "x"])]
    mapped = traffic.prepare_trace(trace, adapters=["hot", "warm"], limit=6, max_prompt_tokens=4)
    # y→hot, x→warm, z→hot
    assert [r.adapter for r in mapped] == [
        "warm",
        "hot",
        "hot",
        None,
        "hot",
        "hot",
    ]
    assert all(r.prompt_tokens == 4 for r in mapped)
    assert traffic.make_prompt(7, 40) == traffic.make_prompt(7, 40) != traffic.make_prompt(8, 40)
    assert len(traffic.make_prompt(7, 40)) == 40 and traffic.make_prompt(7, 40).startswith("7:")
    assert len(traffic.make_prompt(7, 40, "word").split()) == 39


def test_stream_parsing_against_a_fake_server_without_tier_header():
    """As against vLLM: no tier header → unknown; tokens from `usage`; an error event inside a 200
    stream."""
    events = {
        "good": [
            {"choices": [{"text": ""}]},
            {"choices": [{"text": "ab"}]},
            {"choices": [{"text": "c", "finish_reason": "length"}]},
            {"choices": [], "usage": {"completion_tokens": 3}},
        ],
        "broken": [
            {"choices": [{"text": "a"}]},
            {"error": {"message": "store down", "code": "adapter_unavailable"}},
        ],
        # JSON, but no event (a TypeError ended the whole run)
        "null": [
            {"choices": [{"text": "a"}]},
            None,
        ],
    }

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert (
            body["stream"]
            and body["ignore_eos"]
            and body["temperature"] == 0
            and body["max_tokens"] == 3
        )
        sse = (
            "".join(f"data: {json.dumps(e)}\n\n" for e in events[body["model"]])
            + "data: [DONE]\n\n"
        )
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def go():
        config = traffic.LoadConfig("http://fake/v1")
        async with httpx.AsyncClient(
            base_url=config.url, transport=httpx.MockTransport(handler)
        ) as client:
            request = Request(0.0, "t", "good", 10, 3)
            return [
                await traffic.send(client, config, request, i, model, start=0.0)
                for i, model in enumerate(["good", "broken", "null"])
            ]

    good, broken, null = asyncio.run(go())
    assert null.code == "stream:invalid_event" and not null.ok
    assert (good.code, good.tier, good.output_tokens) == ("200", "unknown", 3)
    assert 0 < good.ttft_s <= good.e2e_s and good.tpot_s is not None
    assert broken.code == "stream:adapter_unavailable" and not broken.ok


@pytest.mark.parametrize(
    "line", ["[1, 2]", '{"time": null, "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}']
)
def test_a_bad_trace_line_is_a_clear_error(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"time": 0.0, "adapter": "x", "prompt_tokens": 8, "output_tokens": 4}\n' + line + "\n"
    )
    done = bench("--url", "http://127.0.0.1:1", "--trace", path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"{path} line 2" in done.stderr
