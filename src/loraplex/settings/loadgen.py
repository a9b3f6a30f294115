"""`loraplex bench serve`'s settings, declared once (flags, `--config` keys, `LORAPLEX_BENCH_*`
variables, docs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.settings.fields import at_least, check_fields, positive, setting
from loraplex.settings.sim import WORKLOADS, _joined, comma_list

ENV_PREFIX = "LORAPLEX_BENCH_"


@dataclass(frozen=True)
class BenchServeSettings:
    url: str = setting(
        help="Base URL of a server or router (http://HOST:PORT)",
        metavar="URL",
        doc="the server's or router's base URL (a trailing `/v1` is dropped)",
    )
    trace: Path | None = setting(
        None,
        "A trace (or audit log) .jsonl file to replay",
        metavar="FILE",
        doc="a trace `.jsonl` (`loraplex.sim.workload.write_trace`) or an audit log",
    )
    workload: str | None = setting(
        None, "Generate a named workload: " + ", ".join(WORKLOADS), metavar="NAME"
    )
    seed: int = setting(0, "Seed of the generated workload")
    clients: int | None = setting(
        None,
        "Closed loop with N clients (default: open loop at the trace's times)",
        check=at_least(1),
        default_text="open loop",
        doc="closed loop with N clients; without it, open loop",
    )
    time_scale: float = setting(
        1.0, "Open loop: send at trace time x X (0.5: twice as fast)", check=positive
    )
    duration: float | None = setting(None, "Keep the trace's first S seconds", check=positive)
    limit: int | None = setting(
        None, "Send at most N requests (the trace's first N)", check=at_least(1)
    )
    adapters: tuple[str, ...] = setting(
        (),
        "Comma-separated served adapter names: the trace's k-th most requested adapter becomes "
        "the (k mod n)-th",
        metavar="NAME,...",
        parse=comma_list(),
        show=_joined,
        doc="rename the trace's adapters onto served ones: the k-th most requested becomes "
        "the (k mod n)-th name, so popular stays popular. Named workloads use their own "
        "names (`zipf-017`, `hot-2`), which a server does not know without it (404s).",
    )
    base_model: str | None = setting(
        None,
        "`model` for requests without an adapter",
        metavar="NAME",
        default_text="the base model /v1/models lists",
    )
    api_key: str | None = setting(
        None,
        "Bearer key for every request (and for tenants missing from --api-keys)",
        metavar="KEY",
    )
    api_keys: Path | None = setting(
        None,
        "File of `TENANT KEY` lines: each trace tenant sends its own key (others: --api-key)",
        metavar="FILE",
        doc="`TENANT KEY` lines, `#` comments (the format of `loraplex serve --api-keys`): each "
        "trace tenant sends its own key",
    )
    max_prompt_tokens: int | None = setting(
        None, "Cap the trace's prompt lengths", check=at_least(1)
    )
    max_output_tokens: int | None = setting(
        None, "Cap the trace's output lengths", check=at_least(1)
    )
    prompt_unit: str = setting(
        "char",
        "A prompt of N tokens is N chars (byte-level tokenizers) or N words",
        choices=("char", "word"),
        doc="a prompt of N tokens is N characters (byte-level tokenizers such as the demo "
        "model's) or N words (BPE tokenizers, roughly one token per common word)",
    )
    timeout: float = setting(
        600.0, "Seconds to wait for a connection or the next chunk", check=positive
    )
    json: Path | None = setting(None, "Write the summary as JSON", metavar="FILE")
    per_request: bool = setting(False, "Also write every request's record in the JSON")

    def __post_init__(self):
        check_fields(self, BenchServeSettings)
        if (self.trace is None) == (self.workload is None):
            raise ValueError("give one of --trace FILE or --workload NAME")
