"""What a rollout controller asks of a worker, behind the admin token: the per-revision figures of
the names in a split (`GET /admin/revisions`) and a run of a revision's eval set on this worker
(`POST /admin/adapters/{name}/eval`)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict

from loraplex.registry.release import parse_eval_set
from loraplex.registry.rollouts import RolloutStore
from loraplex.rollout.figures import BOUNDS_S
from loraplex.server.auth import admin_router
from loraplex.server.errors import APIError

if TYPE_CHECKING:
    from loraplex.server.server import Server

EVAL_CONCURRENCY = 8
"""Cases of one eval run in flight at once: a large eval set does not crowd out the traffic."""
EVAL_MAX_TOKENS = 32
"""Tokens of each case's greedy completion (the release checks' own)."""


class EvalBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    revision: str
    """The revision that answers."""
    cases_of: str | None = None
    """The revision whose eval set is run (default: `revision`'s own)."""


def router(token: str) -> APIRouter:
    r = admin_router(token)
    r.add_api_route("/admin/revisions", revisions, methods=["GET"])
    r.add_api_route("/admin/adapters/{name}/eval", run_eval, methods=["POST"])
    return r


def _server(request: Request) -> Server:
    return request.app.state.server


async def revisions(request: Request, name: str | None = None) -> dict:
    """{"bounds_s": the histograms' bucket bounds, "adapters": {name: {revision: figures}}}."""
    book = _server(request).revision_figures
    return {"bounds_s": list(BOUNDS_S), "adapters": book.snapshot(name)}


async def run_eval(name: str, body: EvalBody, request: Request) -> dict:
    """{"passed", "total", "failures": every failed case (prompt, completion, want)}; each case is
    a greedy completion of its prompt, at most EVAL_MAX_TOKENS; 404 for an unknown revision, 409
    when the revision named for its cases has no eval set."""
    server = _server(request)
    cases_of = body.cases_of or body.revision
    record = await run_in_threadpool(server.registry.get_revision, name, body.revision)
    text = await run_in_threadpool(RolloutStore(server.registry).eval_set, name, cases_of)
    if text is None:
        raise APIError(409, f"{name}@{cases_of} has no eval set", "lifecycle_conflict", "cases_of")
    cases = parse_eval_set(text)
    ref = server.resolver.ref_for(record, record.owner_tenant or "default")
    room = asyncio.Semaphore(EVAL_CONCURRENCY)

    async def one(prompt: str) -> str:
        async with room:
            return await server.engine.complete_text(prompt, ref, max_tokens=EVAL_MAX_TOKENS)

    completions = await asyncio.gather(*(one(c.prompt) for c in cases), return_exceptions=True)
    failures = []
    for case, completion in zip(cases, completions):
        text = completion if isinstance(completion, str) else f"<{type(completion).__name__}>"
        if not case.passes(text):
            want = case.expected if case.expected is not None else f"contains {case.contains!r}"
            failures.append({"prompt": case.prompt, "completion": text, "want": want})
    return {
        "model": record.model_id,
        "cases_of": f"{name}@{cases_of}",
        "passed": len(cases) - len(failures),
        "total": len(cases),
        "failures": failures,
    }
