"""TRL's adapter-only sync and rollouts against a real `loraplex serve`, TRL unchanged.

TRL 1.16.0 (PyPI), `trl/experimental/async_grpo/`: `AsyncGRPOTrainer` itself cannot run on a CPU —
its `__init__` calls `torch.cuda.get_device_name` (`trl/trainer/utils.py`,
`get_peak_flops_per_device`), and its loss forward runs `tree_attention`, Flash Attention 3's
varlen kernel fetched from the Hub (`async_grpo/packing.py`, `get_kernel(
"kernels-community/flash-attn3")`), which has no CPU build. So this test runs the rest of that
trainer's loop with TRL's own code: its `VLLMClient` (the HTTP calls), `select_adapter_sync` (the
server probe that turns adapter-only sync on), the trainer's own `_sync_weight_lora` (pause, save,
`/v1/load_lora_adapter` of `trl-policy-vN`, resume, unload of the version past `max_staleness`),
and its `AsyncRolloutWorker` (a spawned process sending `/v1/completions` with `return_token_ids`
for `trl-policy-v{current version}`). The one part that is ours is the step between two syncs: a
plain policy-gradient step on the rollouts, in float32 on the CPU.

TRL's `requests` calls send no `Authorization` header; the admin token reaches the server as the
password of a netrc entry (`NETRC`), which `requests` turns into HTTP Basic authentication.

Checked: every rollout request was answered by the version it named (the audit log's digest is
that of the directory TRL saved for it), all of each rollout's sampled logprobs are HF + PEFT's
under the weights of the one version it was started with (and not under the others'), and the
versions TRL unloaded are gone while the last `max_staleness + 1` serve.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import httpx
import pytest
import torch

from loraplex.artifacts import canonical_digest

_VLLM_LOGGING = os.environ.get("VLLM_LOGGING_LEVEL")
trl = pytest.importorskip("trl")
from trl.experimental.async_grpo import AsyncGRPOConfig  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import (  # noqa: E402
    AsyncGRPOTrainer,
    select_adapter_sync,
)
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker  # noqa: E402
from trl.experimental.async_grpo.vllm_client import VLLMClient  # noqa: E402

# TRL's import sets VLLM_LOGGING_LEVEL=ERROR in this process's environment (`trl/_compat.py`); the
# other test files this pytest worker runs start vLLM processes and read their INFO lines
if _VLLM_LOGGING is None:
    os.environ.pop("VLLM_LOGGING_LEVEL", None)
else:
    os.environ["VLLM_LOGGING_LEVEL"] = _VLLM_LOGGING

ADMIN_TOKEN = "admin-token-0123456789"
LORA_NAME = "trl-policy"  # the name AsyncGRPOTrainer publishes under
MAX_STALENESS = 1
STEPS = 2
SAMPLES_PER_STEP = 4
LOGPROB_ATOL = 2e-3


def reward(completion_ids, **kwargs) -> list[float]:
    """Any reward that tells completions apart (module level: the rollout process unpickles it)."""
    return [float(sum(ids) % 7) for ids in completion_ids]


@pytest.fixture
def served(llama_dir, tmp_path, monkeypatch):
    """`loraplex serve` as a process, its admin token in a netrc file for TRL's `requests`."""
    (tmp_path / "admin-token").write_text(ADMIN_TOKEN + "\n")
    out = tmp_path / "trainer"
    out.mkdir()
    command = [sys.executable, "-m", "loraplex.server.cli", "--model", llama_dir, "--port", "0"]
    command += ["--data-dir", tmp_path / "data", "--admin-token-file", tmp_path / "admin-token"]
    command += ["--allowed-roots", out, "--audit-log", tmp_path / "audit.jsonl"]
    command += ["--dtype", "float32", "--device", "cpu", "--max-lora-rank", "8"]
    command += ["--max-loras", str(MAX_STALENESS + 2)]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen(list(map(str, command)), stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = _address(proc)
        host = url.split("//", 1)[1].rsplit(":", 1)[0]
        (tmp_path / "netrc").write_text(f"machine {host} login trl password {ADMIN_TOKEN}\n")
        monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
        yield types.SimpleNamespace(url=url, out=out, audit=tmp_path / "audit.jsonl")
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


def _address(proc, timeout: float = 180.0) -> str:
    """The URL of the line `loraplex serving NAME on URL`, read with a bound; the rest drained."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving") and not found:
                found.append(line.rsplit(" ", 1)[-1].strip())

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    if not found:
        raise AssertionError("serve did not print its address")
    return found[0]


@pytest.mark.slow
def test_trl_adapter_sync_serves_each_rollout_its_version(served, llama_dir):
    import transformers
    from accelerate import Accelerator
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    # a chat template TRL can parse responses of (its own copy of Qwen 2.5's)
    tokenizer.chat_template = (
        Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja"
    ).read_text()
    tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, lora)
    args = AsyncGRPOConfig(
        output_dir=str(served.out),
        vllm_server_base_url=served.url,
        max_staleness=MAX_STALENESS,
        num_generations=2,
        max_completion_length=6,
        report_to=[],
        use_cpu=True,
    )
    client = VLLMClient(served.url, server_timeout=60)
    client.wait_for_server_ready(poll_interval_s=0.2)
    assert select_adapter_sync(client.get_server_info(), model, args)  # TRL's own decision
    assert client.get_max_model_len() > 0

    trainer = _trainer_state(model, args, client, Accelerator(cpu=True))
    weights: dict[int, dict[str, torch.Tensor]] = {}
    digests: dict[int, str] = {}

    def sync() -> None:
        AsyncGRPOTrainer._sync_weight_lora(trainer, time.time())  # TRL's sync, as it is
        version = trainer.model_version
        weights[version] = {k: v.detach().clone() for k, v in _lora_params(model).items()}
        digests[version] = canonical_digest(served.out / ".vllm_lora" / f"{LORA_NAME}-v{version}")

    prompts = [{"prompt": [{"role": "user", "content": f"hello world {i}"}]} for i in range(8)]
    worker = AsyncRolloutWorker(
        model_name="base",
        lora_name=LORA_NAME,
        dataset=Dataset.from_list(prompts),
        reward_funcs=[reward],
        processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id],
        num_generations=args.num_generations,
        max_inflight_tasks=2,
        vllm_server_url=served.url,
        max_tokens=args.max_completion_length,
        request_timeout=120,
    )
    trainer.rollout_worker = worker
    samples = []
    sync()  # the cold sync, before the worker starts (as the trainer's train-begin callback)
    worker.start()
    try:
        for _ in range(STEPS):
            batch = _samples_of(worker, trainer.model_version, SAMPLES_PER_STEP)
            samples += batch
            _policy_step(model, batch[-SAMPLES_PER_STEP:])
            sync()
        samples += _samples_of(worker, trainer.model_version, SAMPLES_PER_STEP)
    finally:
        worker.stop()

    _check_the_audit_log(served.audit, digests)
    _check_logprobs(model, samples, weights)
    _check_the_kept_versions(served.url, trainer.model_version)
    assert not httpx.get(f"{served.url}/is_paused", auth=("trl", ADMIN_TOKEN)).json()["is_paused"]


def _trainer_state(model, args, client, accelerator) -> types.SimpleNamespace:
    """What `AsyncGRPOTrainer._sync_weight_lora` reads of its trainer, as its `__init__` sets it."""
    return types.SimpleNamespace(
        model=model,
        args=args,
        accelerator=accelerator,
        vllm_client=client,
        model_version=0,
        _lora_name=LORA_NAME,
        _lora_dir=str(Path(args.output_dir, ".vllm_lora").resolve()),
        _adapter_name=model.active_adapters[0],
        rollout_worker=None,
    )


def _lora_params(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if "lora_" in name}


def _samples_of(worker, version: int, count: int, timeout_s: float = 300.0) -> list:
    """Rollouts from the worker's queue until `count` of `version` came, at most `count` of each
    version kept: those of the version before include rollouts in flight across the last sync (a
    bound against hangs)."""
    kept: dict[int, list] = {}
    deadline = time.monotonic() + timeout_s
    while len(kept.get(version, ())) < count:
        worker.check_health(stale_after_s=timeout_s)
        assert time.monotonic() < deadline, f"no {count} rollouts of version {version} came"
        try:
            sample = worker.rollout_buffer.get(timeout=1.0)
        except queue.Empty:
            continue
        of_version = kept.setdefault(sample.model_version, [])
        if len(of_version) < count:
            of_version.append(sample)
    return [sample for samples in kept.values() for sample in samples]


def _completion_logprobs(model, sample) -> tuple[torch.Tensor, torch.Tensor]:
    """HF + PEFT's logprob of each completion token of a rollout, and the server's for it."""
    ids = torch.tensor(sample.input_ids, dtype=torch.long)
    mask = torch.tensor(sample.completion_mask, dtype=torch.bool)
    logits = model(ids[None]).logits[0, :-1].double()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[1:, None])[:, 0]
    sampled = torch.tensor(sample.old_log_probs, dtype=torch.float64)
    return logprobs[mask[1:]], sampled[1:][mask[1:]]


def _policy_step(model, batch) -> None:
    """One plain policy-gradient step on the rollouts, in place of the trainer's."""
    params = list(_lora_params(model).values())
    loss = sum(
        -(sample.advantage + 1.0) * _completion_logprobs(model, sample)[0].sum() for sample in batch
    )
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.sub_(0.5 * g)


def _check_the_audit_log(audit: Path, digests: dict[int, str]) -> None:
    records = [json.loads(line) for line in audit.read_text().splitlines()]
    rollouts = [r for r in records if r.get("endpoint") == "completions"]
    assert rollouts
    served = set()
    for record in rollouts:
        assert record["status"] == 200, record
        version = int(record["adapter"].removeprefix(f"{LORA_NAME}-v"))
        assert record["digest"] == digests[version], record
        served.add(version)
    assert served == set(digests)  # every version served rollouts


def _check_logprobs(model, samples, weights) -> None:
    """All of each rollout's sampled logprobs are those of one version: the one its group was
    started with, or a newer one (TRL's `model_version` of a sample is its group's, taken when the
    group's first rollout began; a later rollout of the group names the version of its own start).
    """
    with torch.no_grad():
        for sample in samples:
            errors = {}
            for version, tensors in weights.items():
                for name, p in _lora_params(model).items():
                    p.copy_(tensors[name])
                ours, server = _completion_logprobs(model, sample)
                errors[version] = float((ours - server).abs().max())
            used = min(errors, key=errors.__getitem__)
            assert errors[used] < LOGPROB_ATOL and used >= sample.model_version, errors
            others = [e for v, e in errors.items() if v != used]
            assert min(others) > 10 * LOGPROB_ATOL, errors  # the versions are told apart


def _check_the_kept_versions(url: str, newest: int) -> None:
    listed = {m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]}
    kept = {f"{LORA_NAME}-v{v}" for v in range(newest - MAX_STALENESS, newest + 1)}
    unloaded = {f"{LORA_NAME}-v{v}" for v in range(1, newest - MAX_STALENESS)}
    assert kept <= listed and not unloaded & listed
    for name in unloaded:
        answer = httpx.post(
            f"{url}/v1/completions", json={"model": name, "prompt": [1, 2], "max_tokens": 1}
        )
        assert answer.status_code == 404, answer.text
