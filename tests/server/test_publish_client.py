"""`loraplex.client` against a real server over sockets: a PEFT model published from memory serves
the numbers HF transformers + PEFT give; revisions beyond a name's `keep` are retired and leave the
worker once no request holds them; vLLM's `load_inplace` replaces a loaded name's weights."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import openai
import pytest
import torch
from harness import ADMIN_TOKEN

from loraplex.artifacts import canonical_digest
from loraplex.client import Publisher, PublishError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def peft_model(llama_dir):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(3.0)
    return model.eval()


def greedy_logprobs(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """HF + PEFT's greedy tokens and their logprobs."""
    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            probs = torch.log_softmax(logits.double(), -1)
            token = int(torch.argmax(logits))
            ids.append(token)
            out.append(token)
            logprobs.append(float(probs[token]))
    return out, logprobs


def metric(running, name: str) -> float:
    text = httpx.get(f"{running.url}/metrics", timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    assert match, name
    return float(match[1])


def resident(running, name: str) -> set[str]:
    return {a["revision"] for a in running.state()["adapters"] if a["name"] == name}


def test_a_peft_model_published_from_memory_serves_peft_numbers(running, peft_model, llama_dir):
    with Publisher(running.url, ADMIN_TOKEN) as publisher:
        published = publisher.publish_model("policy", peft_model, stable=True)
    assert published.status == "stable" and published.model == f"policy@{published.revision}"
    tokens, expected = greedy_logprobs(peft_model, PROMPT, 4)
    with peft_model.disable_adapter():
        base_tokens, base_logprobs = greedy_logprobs(peft_model, PROMPT, 4)
    answer = running.client().completions.create(
        model=published.model,
        prompt=PROMPT,
        max_tokens=4,
        temperature=0,
        logprobs=1,
        extra_body=NO_EOS,
    )
    got = answer.choices[0].logprobs.token_logprobs
    assert got == pytest.approx(expected, abs=1e-4)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(llama_dir)
    assert answer.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)
    # the adapter changes the output, so the comparison has teeth
    assert tokens != base_tokens or max(abs(a - b) for a, b in zip(expected, base_logprobs)) > 1e-3


def test_revisions_beyond_keep_are_retired_and_unloaded(running, adapter_variants):
    before = metric(running, "loraplex_adapter_retired_unloads_total")
    with Publisher(running.url, ADMIN_TOKEN) as publisher:
        first = publisher.publish_dir("rl", adapter_variants[2], stable=True, keep=2)
        running.client().completions.create(model="rl", prompt="x", max_tokens=1)
        assert first.revision in resident(running, "rl")
        publisher.publish_dir("rl", adapter_variants[4], stable=True)
        third = publisher.publish_dir("rl", adapter_variants[6], stable=True)
    assert running.registry.get_revision("rl", first.revision).status == "retired"
    assert running.registry.get_revision("rl", third.revision).status == "stable"
    running.wait_for(
        lambda: first.revision not in resident(running, "rl"), what="the retired revision to go"
    )
    assert metric(running, "loraplex_adapter_retired_unloads_total") == before + 1
    with pytest.raises(openai.NotFoundError):
        running.client().completions.create(model=first.model, prompt="x", max_tokens=1)


def test_a_retired_revision_stays_until_its_request_ends(start, adapter_variants):
    with (
        start(engine={"max_model_len": 4096}) as running,
        Publisher(running.url, ADMIN_TOKEN) as publisher,
    ):
        old = publisher.publish_dir("rl-held", adapter_variants[8], stable=True, keep=1)
        stream = running.client().completions.create(
            model="rl-held", prompt="x", max_tokens=4000, stream=True, extra_body=NO_EOS
        )
        chunks = iter(stream)
        next(chunks)
        held = [a for a in running.state()["adapters"] if a["revision"] == old.revision]
        assert held[0]["in_flight"] == 1
        before = metric(running, "loraplex_adapter_retired_unloads_total")
        publisher.publish_dir("rl-held", adapter_variants[10], stable=True)
        assert running.registry.get_revision("rl-held", old.revision).status == "retired"
        assert old.revision in resident(running, "rl-held")  # its request still holds it
        with pytest.raises(openai.NotFoundError):
            running.client().completions.create(model=old.model, prompt="x", max_tokens=1)
        rest = list(chunks)
        assert rest[-1].choices[0].finish_reason == "length"
        running.wait_for(
            lambda: old.revision not in resident(running, "rl-held"),
            what="the retired revision to go",
        )
        assert metric(running, "loraplex_adapter_retired_unloads_total") == before + 1


def test_publish_errors_carry_the_servers_refusal(running, tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"\x02" + bytes(7) + b"{}")
    with Publisher(running.url, ADMIN_TOKEN) as publisher, pytest.raises(PublishError) as refused:
        publisher.publish_dir("broken", tmp_path)
    assert refused.value.status == 400 and refused.value.param == "weights"
    with Publisher(running.url, "wrong-token-0123456789") as publisher:
        with pytest.raises(PublishError) as unauthorized:
            publisher.publish_dir("broken", tmp_path)
    assert unauthorized.value.status == 401


def test_load_inplace_replaces_a_loaded_names_weights(start, adapter_variants):
    roots = (str(adapter_variants[0].parent),)
    with start(allowed_roots=roots) as running:
        first = {"lora_name": "trl", "lora_path": str(adapter_variants[1])}
        assert running.admin("POST", "/v1/load_lora_adapter", json=first).status_code == 200
        again = {"lora_name": "trl", "lora_path": str(adapter_variants[3])}
        refused = running.admin("POST", "/v1/load_lora_adapter", json=again)
        assert refused.status_code == 400 and "already been loaded" in refused.text
        digest = canonical_digest(adapter_variants[3])
        replaced = running.admin(
            "POST", "/v1/load_lora_adapter", json={**again, "load_inplace": True}
        )
        assert replaced.status_code == 200, replaced.text
        answer = running.client().completions.with_raw_response.create(
            model="trl", prompt="x", max_tokens=1
        )
        assert answer.headers["x-loraplex-adapter-digest"] == digest
        revisions = running.registry.show("trl").revisions
        serving = [r for r in revisions if r.traffic_weight]
        assert [r.digest for r in serving] == [digest] and len(revisions) == 2


def test_the_publish_command_uploads_a_directory(running, adapter_variants, tmp_path):
    token = tmp_path / "admin-token"
    token.write_text(ADMIN_TOKEN + "\n")
    command = [sys.executable, "-m", "loraplex.cli", "publish", "--url", running.url]
    command += ["--admin-token-file", str(token), "--name", "cli-up", "--stable"]
    done = subprocess.run([*command, str(adapter_variants[5])], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    model, digest = done.stdout.split()
    record = running.registry.show("cli-up").revisions[0]
    assert model == f"cli-up@{record.revision}" and digest == record.digest == canonical_digest(
        adapter_variants[5]
    )
    refused = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: 400: ") and len(refused.stderr.splitlines()) == 1
