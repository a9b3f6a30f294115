"""`loraplex demo`: the demo world behind a real server, three tenants, a mixed concurrent workload,
checked.

Builds the world if needed, starts a registry and a server in this process on a free local port,
registers the adapters for three tenants (a shared set and one private adapter each), sends a mixed
concurrent workload through the OpenAI API (completions and chat, streamed and not, plus requests
for another tenant's adapter that must be refused), and checks every answer against the adapter's
known transform.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table

from loraplex.engines.native.client import EngineClient
from loraplex.engines.native.config import EngineConfig
from loraplex.registry import Registry

BASE = "demo-base"
ADMIN_TOKEN_BYTES = 24
TENANTS = ("acme", "globex", "initech")
PRIORITY = {"acme": 1, "globex": 0, "initech": 0}


@dataclass(frozen=True)
class Plan:
    """Who may use what: the first adapters are shared by all tenants, each tenant owns one of the
    last three."""

    shared: tuple[str, ...]
    private: dict[str, str]

    @classmethod
    def for_adapters(cls, adapters) -> Plan:
        names = sorted(adapters)
        return cls(
            tuple(names[: len(names) - len(TENANTS)]), dict(zip(TENANTS, names[-len(TENANTS) :]))
        )


@dataclass
class Result:
    tenant: str
    model: str
    text: str
    expected: str | None  # None: the request must be refused with 404
    stream: bool
    status: int = 0
    output: str = ""
    revision: str = ""
    tier: str = ""
    ttft: float | None = None

    @property
    def correct(self) -> bool:
        if self.expected is None:
            return self.status == 404
        return self.status == 200 and self.output.strip() == self.expected


def setup_registry(world, data_dir: Path, plan: Plan) -> tuple[Registry, dict[str, str]]:
    registry = Registry(
        f"sqlite:///{data_dir / 'registry.db'}",
        base_model_dir=world.model_dir,
        max_lora_rank=max(world.ranks.values()),
    )
    registry.init()
    keys = {}
    for tenant, priority in PRIORITY.items():
        registry.add_tenant(tenant, priority)
        keys[tenant] = registry.create_key(tenant)
    for name in plan.shared:
        registry.add_revision(world.adapters[name], name, shared=True, status="stable")
    for tenant, name in plan.private.items():
        registry.add_revision(world.adapters[name], name, tenant=tenant, status="stable")
    return registry, keys


class _Server(uvicorn.Server):
    """A uvicorn server that sets `up` once it listens, or once it gives up starting."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.up = threading.Event()

    async def startup(self, sockets=None) -> None:
        try:
            await super().startup(sockets=sockets)
        finally:
            self.up.set()

    def run(self, sockets=None) -> None:
        try:
            super().run(sockets=sockets)
        finally:
            self.up.set()  # also when the app's startup failed before listening


@contextlib.contextmanager
def serving(app):
    """The app on a free loopback port in a thread; yields the base URL and stops it at the end."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = _Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    server.up.wait()
    if not server.started:
        raise RuntimeError("the demo server did not start")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def workload(inputs: list[str], plan: Plan) -> list[Result]:
    from loraplex.demo.world import TRANSFORMS

    jobs, i = [], 0
    for _ in range(2):
        for tenant, own in plan.private.items():
            for model in (*plan.shared, own, BASE):
                text = inputs[i % len(inputs)]
                expected = TRANSFORMS["copy" if model == BASE else model](text)
                jobs.append(Result(tenant, model, text, expected, stream=i % 2 == 0))
                i += 1
        # Each tenant also asks for another tenant's private adapter: it must look like it does not
        # exist.
        for tenant, other in zip(TENANTS, TENANTS[1:] + TENANTS[:1]):
            jobs.append(
                Result(tenant, plan.private[other], inputs[i % len(inputs)], None, stream=False)
            )
            i += 1
    return jobs


async def send(client: httpx.AsyncClient, url: str, key: str, job: Result, chat: bool) -> None:
    from loraplex.demo.world import make_prompt

    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": job.model, "max_tokens": 40, "temperature": 0, "stream": job.stream}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": job.text}]
    else:
        path, body["prompt"] = "/v1/completions", make_prompt(job.text)
    start = time.perf_counter()
    async with client.stream("POST", url + path, json=body, headers=headers) as response:
        job.status = response.status_code
        job.revision = response.headers.get("x-loraplex-adapter", "")
        job.tier = response.headers.get("x-loraplex-cache-tier", "")
        if not job.stream or response.status_code != 200:
            data = json.loads(await response.aread())
            if response.status_code == 200:
                choice = data["choices"][0]
                job.output = choice["message"]["content"] if chat else choice["text"]
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if not choice:
                continue
            delta = choice[0].get("delta", {}).get("content") if chat else choice[0].get("text")
            if delta:
                job.ttft = job.ttft or time.perf_counter() - start
                job.output += delta


async def run_workload(
    url: str, keys: dict[str, str], jobs: list[Result], concurrency: int = 8
) -> None:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(index: int, job: Result):
            async with gate:
                await send(client, url, keys[job.tenant], job, chat=index % 3 == 2)

        await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))


def report(console: Console, jobs: list[Result], state: dict, plan: Plan) -> tuple[int, int]:
    for tenant in TENANTS:
        table = Table(title=f"tenant {tenant}", title_justify="left")
        for column in ("model", "revision", "tier", "stream", "input", "output", "correct"):
            table.add_column(column)
        for job in (j for j in jobs if j.tenant == tenant):
            output = job.output if job.status == 200 else f"HTTP {job.status}"
            mark = (
                "[green]yes[/]"
                if job.correct
                else f"[red]no[/] (want {job.expected or 'HTTP 404'})"
            )
            table.add_row(
                job.model,
                job.revision or "-",
                job.tier or "-",
                "yes" if job.stream else "no",
                job.text,
                output,
                mark,
            )
        console.print(table)
    served = [j for j in jobs if j.status == 200]
    tiers = [j.tier for j in served]
    warm = [j.ttft * 1000 for j in served if j.ttft and j.tier in ("gpu", "cpu")]
    cold = [j.ttft * 1000 for j in served if j.ttft and j.tier in ("disk", "remote")]

    def pct(values, q):
        return (
            f"{sorted(values)[min(len(values) - 1, int(q * len(values)))]:.0f}" if values else "-"
        )

    evictions = sum(a["evictions"] for a in state["adapters"])
    console.print(
        "hit rate per tier: "
        + ", ".join(
            f"{t} {tiers.count(t) / len(tiers):.0%}" for t in ("gpu", "cpu", "disk", "remote")
        )
        + "\n"
        f"TTFT (streamed requests) warm p50 {pct(warm, 0.5)} ms p99 {pct(warm, 0.99)} ms; "
        f"cold p50 {pct(cold, 0.5)} ms p99 {pct(cold, 0.99)} ms\n"
        f"evictions {evictions} with {state['load']['num_slots']} slots for "
        f"{len(plan.shared) + len(plan.private)} adapters; refused cross-tenant requests: "
        f"{sum(1 for j in jobs if j.expected is None and j.status == 404)}"
    )
    correct = sum(j.correct for j in jobs)
    return correct, len(jobs)


def hints(console: Console, url: str, keys: dict[str, str], plan: Plan) -> None:
    key, shared, own = keys["acme"], plan.shared[0], plan.private["acme"]
    console.print(
        "\nTry it by hand:\n"
        f"  curl -s {url}/v1/completions -H 'Authorization: Bearer {key}' -H 'Content-Type: "
        "application/json' "
        f'-d \'{{"model": "{shared}", "prompt": "<s>hello<sep>", "max_tokens": 20}}\'\n'
        f"  curl -s {url}/v1/models -H 'Authorization: Bearer {key}'\n"
        f"  python -c \"import openai; c = openai.OpenAI(base_url='{url}/v1', api_key='{key}'); "
        f"print(c.chat.completions.create(model='{own}', messages=[{{'role': 'user', 'content': "
        f"'hello'}}])"
        '.choices[0].message.content)"',
        soft_wrap=True,
    )


def run_demo(out_dir: Path | None, serve: bool = False, max_loras: int = 3) -> int:
    from loraplex.demo.world import build_world, random_inputs
    from loraplex.server.app import ServerConfig, create_app

    console = Console()
    world = build_world(out_dir)
    plan = Plan.for_adapters(world.adapters)
    with tempfile.TemporaryDirectory(prefix="loraplex-demo-") as tmp:
        data_dir = Path(tmp)
        registry, keys = setup_registry(world, data_dir, plan)
        engine = EngineClient(  # in a process of its own, as `loraplex serve` runs it
            EngineConfig(
                model_dir=world.model_dir,
                dtype="float32",
                max_loras=max_loras,
                max_lora_rank=max(world.ranks.values()),
                kv_cache_memory_bytes=64 * 2**20,
                disk_cache_dir=data_dir / "cache",
                allowed_roots=(str(registry.store.root.resolve()),),
            )
        )
        token = secrets.token_hex(ADMIN_TOKEN_BYTES)
        config = ServerConfig(
            served_model_name=BASE, admin_token=token, audit_log=data_dir / "audit.jsonl"
        )
        app = create_app(engine, registry, config)
        with serving(app) as url:
            console.print(
                f"demo server on {url}: base model {BASE!r}, {len(world.adapters)} adapters, "
                f"{max_loras} slots, tenants {', '.join(TENANTS)}"
            )
            jobs = workload(random_inputs(64, seed=7), plan)
            asyncio.run(run_workload(url, keys, jobs))
            state = httpx.get(
                f"{url}/admin/state", headers={"Authorization": f"Bearer {token}"}
            ).json()
            correct, checked = report(console, jobs, state, plan)
            hints(console, url, keys, plan)
            console.print(f"{correct}/{checked} correct")
            if serve:
                console.print(f"serving on {url} until Ctrl-C (admin token {token})")
                with contextlib.suppress(KeyboardInterrupt):
                    threading.Event().wait()  # until Ctrl-C
        return 0 if correct == checked else 1
