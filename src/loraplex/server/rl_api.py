"""vLLM's endpoints for a reinforcement-learning trainer that drives its rollout server, behind the
admin token: `GET /server_info` (the configuration a trainer probes), `POST /pause`,
`POST /resume` and `GET /is_paused`.

A pause holds new generation requests (they wait, they are not refused) until the resume. Requests
in flight go on: each keeps the revision it started with to its end (a new revision never replaces
weights under it), so there is nothing to freeze them for.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from loraplex.server.auth import admin_router
from loraplex.server.errors import APIError

if TYPE_CHECKING:
    from loraplex.server.server import Server

PAUSE_MODES = ("keep", "wait")
MAX_PAUSE_S = 86400.0
"""The longest timeout a pause may set."""
WAIT_POLL_S = 0.01
"""How often `/pause?mode=wait` looks whether the requests in flight have finished."""


def router(token: str) -> APIRouter:
    r = admin_router(token)
    r.add_api_route("/server_info", server_info, methods=["GET"])
    r.add_api_route("/pause", pause, methods=["POST"])
    r.add_api_route("/resume", resume, methods=["POST"])
    r.add_api_route("/is_paused", is_paused, methods=["GET"])
    return r


def _server(request: Request) -> Server:
    return request.app.state.server


async def pause(
    request: Request, mode: str = "abort", clear_cache: bool = True, timeout: float | None = None
) -> dict:
    """`keep`: new requests wait from now on; `wait`: the same, answered once the requests in flight
    have finished. vLLM's default `abort` is refused: a request is never cut off for a new
    revision here. `clear_cache` is accepted and has no effect (the prefix cache is kept per
    revision). `timeout`: seconds after which the worker resumes by itself if no `/resume` came
    (none: it waits for the resume)."""
    if mode not in PAUSE_MODES:
        raise APIError(
            400,
            f"mode={mode!r}: give keep or wait (requests in flight keep their revision to their "
            "end, so none is aborted for a weight update)",
            "invalid_value",
            "mode",
        )
    if timeout is not None and not 0 < timeout <= MAX_PAUSE_S:
        raise APIError(
            400,
            f"timeout={timeout}: give seconds, more than 0 and at most {MAX_PAUSE_S:g}",
            "invalid_value",
            "timeout",
        )
    server = _server(request)
    server.pause.pause(timeout)
    while mode == "wait" and server.admission.num_in_flight and server.pause.is_paused:
        await asyncio.sleep(WAIT_POLL_S)
    return {"status": "paused"}


async def resume(request: Request) -> dict:
    _server(request).pause.resume()
    return {"status": "resumed"}


async def is_paused(request: Request) -> dict:
    return {"is_paused": _server(request).pause.is_paused}


async def server_info(request: Request, config_format: str = "text") -> dict:
    """The parts of vLLM's `vllm_config` a trainer reads, with this server's values: the model's
    dtype and length, the LoRA capacity, one data-parallel replica."""
    if config_format not in ("text", "json"):
        raise APIError(
            400,
            f"config_format={config_format!r}: give text or json",
            "invalid_value",
            "config_format",
        )
    config = vllm_config(_server(request))
    return {"vllm_config": config if config_format == "json" else json.dumps(config)}


def vllm_config(server: Server) -> dict:
    live = server.engine.live_figures()
    return {
        "model_config": {
            "model": str(server.engine.model_dir),
            "served_model_name": server.config.served_model_name,
            "dtype": f"torch.{_dtype(server)}",
            "max_model_len": server.engine.max_model_len,
        },
        "lora_config": {"max_lora_rank": live["max_lora_rank"], "max_loras": live["max_loras"]},
        "parallel_config": {
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        },
    }


def _dtype(server: Server) -> str:
    """`--dtype`, or with `auto` the model's own (its config.json's), float32 when it names none."""
    chosen = server.config.settings.dtype
    if chosen != "auto":
        return chosen
    path = server.engine.model_dir / "config.json"
    model = json.loads(path.read_text()) if path.is_file() else {}
    return str(model.get("dtype") or model.get("torch_dtype") or "float32")
