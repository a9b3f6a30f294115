"""vLLM's endpoints for RL trainers over a real server: `/server_info`, `/pause`, `/resume` and
`/is_paused` behind the admin token (as a Basic password too), completions' `return_token_ids`, and
`max_model_len` on the base model's card."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from harness import ADMIN_TOKEN, KEYS

ALICE = {"Authorization": f"Bearer {KEYS['alice']}"}
PROMPT = [5, 6, 7, 8, 9]


def test_server_info_gives_what_a_trainer_probes(running):
    info = running.admin("GET", "/server_info", params={"config_format": "json"}).json()
    config = info["vllm_config"]
    assert config["lora_config"]["max_lora_rank"] == 16 and config["lora_config"]["max_loras"] == 2
    assert config["parallel_config"]["data_parallel_size"] == 1
    assert config["model_config"]["max_model_len"] == running.server.engine.max_model_len
    assert config["model_config"]["dtype"].startswith("torch.")
    text = running.admin("GET", "/server_info").json()["vllm_config"]
    assert isinstance(text, str) and '"max_lora_rank": 16' in text
    bad = running.admin("GET", "/server_info", params={"config_format": "yaml"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "config_format"


@pytest.mark.parametrize("path", ["/server_info", "/is_paused"])
def test_the_endpoints_need_the_admin_token(running, path):
    assert running.admin("GET", path, token=None).status_code == 401
    assert running.admin("GET", path, token=KEYS["alice"]).status_code == 401
    for method, write in (("POST", "/pause"), ("POST", "/resume")):
        refused = running.admin(method, write, token=None)
        assert (
            refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_admin_token"
        )
    basic = httpx.get(f"{running.url}{path}", auth=("trainer", ADMIN_TOKEN))
    assert basic.status_code == 200  # the token as a Basic password (what netrc gives)
    wrong = httpx.get(f"{running.url}{path}", auth=(ADMIN_TOKEN, "x"))
    assert wrong.status_code == 401


def _complete(running, out: list) -> None:
    body = {"model": "shared-a", "prompt": PROMPT, "max_tokens": 2}
    out.append(httpx.post(f"{running.url}/v1/completions", json=body, headers=ALICE, timeout=60))


def test_a_pause_holds_new_requests_until_the_resume(running):
    assert running.admin("POST", "/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    try:
        assert running.admin("GET", "/is_paused").json() == {"is_paused": True}
        answers: list = []
        held = threading.Thread(target=_complete, args=(running, answers))
        held.start()
        held.join(1.0)
        assert held.is_alive() and not answers  # waiting, not refused
    finally:
        assert running.admin("POST", "/resume").json() == {"status": "resumed"}
    held.join(60)
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].headers["x-loraplex-adapter"].startswith("shared-a@")
    assert running.admin("GET", "/is_paused").json() == {"is_paused": False}


def test_pause_wait_answers_once_nothing_is_in_flight_and_abort_is_refused(running):
    try:
        done = running.admin("POST", "/pause", params={"mode": "wait"})
        assert done.json() == {"status": "paused"}
        assert running.server.admission.num_in_flight == 0
    finally:
        running.admin("POST", "/resume")
    refused = running.admin("POST", "/pause")  # vLLM's default mode, abort
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
    assert running.admin("GET", "/is_paused").json() == {"is_paused": False}


def test_a_pause_with_a_timeout_resumes_by_itself(running):
    """A trainer that dies between its pause and its resume: the held request is served once the
    pause's timeout has passed, with no /resume."""
    paused = running.admin("POST", "/pause", params={"mode": "keep", "timeout": 2})
    assert paused.json() == {"status": "paused"}
    answers: list = []
    held = threading.Thread(target=_complete, args=(running, answers))
    try:
        assert running.admin("GET", "/is_paused").json() == {"is_paused": True}
        held.start()
        held.join(60)
    finally:
        if held.is_alive():
            running.admin("POST", "/resume")
    assert answers and answers[0].status_code == 200, answers
    assert running.admin("GET", "/is_paused").json() == {"is_paused": False}


def test_a_resume_or_a_later_pause_cancels_the_timeout(running):
    running.admin("POST", "/pause", params={"mode": "keep", "timeout": 0.2})
    running.admin("POST", "/resume")
    try:
        running.admin("POST", "/pause", params={"mode": "keep"})  # no timeout: until the resume
        time.sleep(1.0)  # past the first pause's timeout
        assert running.admin("GET", "/is_paused").json() == {"is_paused": True}
    finally:
        running.admin("POST", "/resume")
    for bad in ("0", "-1", "nan", "inf", "1e9"):
        refused = running.admin("POST", "/pause", params={"mode": "keep", "timeout": bad})
        assert refused.status_code == 400, (bad, refused.text)
        assert refused.json()["error"]["param"] == "timeout"
    assert running.admin("GET", "/is_paused").json() == {"is_paused": False}


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(running):
    body = {"model": "shared-a", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    body |= {"return_token_ids": True, "logprobs": 0, "temperature": 0}
    choice = httpx.post(f"{running.url}/v1/completions", json=body, headers=ALICE).json()
    choice = choice["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 4
    decode = running.server.engine.tokenizer.decode
    assert [decode([t]) for t in choice["token_ids"]] == choice["logprobs"]["tokens"]
    with httpx.stream(
        "POST", f"{running.url}/v1/completions", json={**body, "stream": True}, headers=ALICE
    ) as streamed:
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    choices = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == PROMPT
    assert all(c["prompt_token_ids"] is None for c in choices[1:])
    assert sum((c["token_ids"] for c in choices), []) == choice["token_ids"]
    plain = {**body, "return_token_ids": False}
    plain = httpx.post(f"{running.url}/v1/completions", json=plain, headers=ALICE).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_the_base_models_card_gives_max_model_len(running):
    data = httpx.get(f"{running.url}/v1/models", headers=ALICE).json()["data"]
    assert data[0]["max_model_len"] == running.server.engine.max_model_len
    assert all("max_model_len" not in card for card in data[1:])


def test_a_stream_gives_every_token_id_though_its_text_is_held_back(running):
    """Without logprobs, a token whose text waits for the rest of its character still sends its id:
    the streamed ids are the whole output's."""
    body = {"model": "shared-a", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True}
    body |= {"return_token_ids": True, "temperature": 0}
    whole = httpx.post(f"{running.url}/v1/completions", json=body, headers=ALICE).json()
    whole = whole["choices"][0]
    with httpx.stream(
        "POST", f"{running.url}/v1/completions", json={**body, "stream": True}, headers=ALICE
    ) as streamed:
        chunks = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    choices = [json.loads(c.removeprefix("data: "))["choices"][0] for c in chunks]
    assert sum((c["token_ids"] for c in choices), []) == whole["token_ids"]
    assert "".join(c["text"] for c in choices) == whole["text"]
    assert any(c["text"] == "" and c["token_ids"] for c in choices)  # a held-back token was sent
