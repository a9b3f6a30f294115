"""`loraplex registry reference`, `write-reference` and `verify`: the parity gate
(`registry.parity`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import httpx
import typer

from loraplex.registry import parity
from loraplex.registry.cli.common import app, errors, open_registry
from loraplex.registry.errors import RegistryError


@app.command("reference")
@errors
def attach_reference(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Adapter name")],
    revision: Annotated[str, typer.Argument(help="Its revision")],
    file: Annotated[
        Path, typer.Argument(help="Reference JSON (registry write-reference makes one)")
    ],
):
    """Attach a parity reference to a revision: token ids and the trainer's log-probabilities."""
    reference = parity.set_reference(open_registry(ctx).db, name, revision, file.read_text())
    tokens = sum(len(s.ids) for s in reference.sequences)
    count = len(reference.sequences)
    typer.echo(f"{name}@{revision}: reference of {count} sequences, {tokens} tokens")


def _sequences(tokens: Path | None, prompts: list[str], model: Path) -> list[list[int]]:
    """Token sequences from a JSONL file of {"ids": [...]} lines, or prompts in the model's
    tokenizer."""
    sequences = []
    if tokens is not None:
        for number, line in enumerate(tokens.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    sequences.append([int(t) for t in json.loads(line)["ids"]])
                except (ValueError, KeyError, TypeError):
                    where = f"{tokens}:{number}"
                    raise RegistryError(f'{where}: needs {{"ids": [token ids]}}') from None
    if prompts:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(model)
        except (OSError, ValueError) as exc:
            raise RegistryError(f"--prompt needs the model's tokenizer: {exc}") from None
        sequences += [tokenizer(p)["input_ids"] for p in prompts]
    if not sequences or any(len(s) < 2 for s in sequences):
        raise RegistryError("give --tokens or --prompt, each sequence at least 2 tokens")
    return sequences


@app.command("write-reference")
@errors
def write_reference(
    adapter: Annotated[Path, typer.Argument(help="The PEFT adapter directory the trainer wrote")],
    model: Annotated[Path, typer.Option(help="The base model directory", metavar="DIR")],
    out: Annotated[Path, typer.Option(help="Where to write the reference JSON", metavar="FILE")],
    tokens: Annotated[
        Path | None,
        typer.Option(help='JSONL of {"ids": [token ids]}, one sequence a line', metavar="FILE"),
    ] = None,
    prompt: Annotated[
        list[str] | None,
        typer.Option(help="A prompt, in the model's tokenizer; repeat", metavar="TEXT"),
    ] = None,
):
    """Write a parity reference with HF transformers and PEFT (float32, CPU)."""
    reference = parity.write_reference(model, adapter, _sequences(tokens, prompt or [], model))
    out.write_text(reference.to_json())
    typer.echo(f"{out}: {len(reference.sequences)} sequences")


@app.command("verify")
@errors
def verify(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Adapter name")],
    revision: Annotated[str, typer.Argument(help="Its revision")],
    url: Annotated[
        str, typer.Option(help="A worker or the router serving it", metavar="URL")
    ] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="LORAPLEX_API_KEY", metavar="KEY", help="A key of a tenant that may use it"
        ),
    ] = None,
    factor: Annotated[
        float, typer.Option(metavar="F", help="Refuse beyond this many noise floors", min=1.0)
    ] = parity.DEFAULT_FACTOR,
):
    """Serve a revision's reference tokens and compare with its trainer's (exit 1: refused)."""
    registry = open_registry(ctx)
    reference = parity.read_reference(registry.db, name, revision)
    if reference is None:
        raise RegistryError(f"{name}@{revision} has no reference (registry reference attaches one)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as client:
        try:
            models = client.get("/v1/models")
            models.raise_for_status()
            base = next(m["id"] for m in models.json()["data"] if m.get("parent") is None)
            verdict = parity.verify(client, reference, f"{name}@{revision}", base, factor)
        except (httpx.HTTPError, StopIteration, KeyError) as exc:
            raise RegistryError(f"{url}: {type(exc).__name__}: {exc}") from None
    parity.record_verdict(registry.db, name, revision, verdict)
    typer.echo(verdict.line(f"{name}@{revision}"))
    if not verdict.passed:
        raise typer.Exit(1)
