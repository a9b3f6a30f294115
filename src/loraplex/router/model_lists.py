"""`GET /v1/models` across a fleet: the workers' lists merged into one, each model once."""

from __future__ import annotations

from collections.abc import Iterable


def entries(body: object) -> list[dict]:
    """The entries of a worker's `/v1/models` body (none from a body of another shape)."""
    data = body.get("data", []) if isinstance(body, dict) else []
    if not isinstance(data, list):
        return []
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def merged(listed: Iterable[list[dict]]) -> dict:
    """One OpenAI list of the models in `listed`, each id once (the last entry for it), in the
    order first listed."""
    by_id = {m["id"]: m for models in listed for m in models}
    return {"object": "list", "data": list(by_id.values())}
