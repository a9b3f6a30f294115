"""`loraplex serve` as a real process with a model of Llama-3-8B's KV shape (32 layers, 8 KV heads,
head dim 128: 128 KiB of bf16 KV per token), sized by the engine flags, a --config file and the
refusals of a KV budget too small for --max-model-len."""

import json
import subprocess
import sys
import threading

import openai
import pytest
from tinymodels import make_model


@pytest.fixture(scope="module")
def kv8b_dir(tmp_path_factory):
    """Llama-3-8B's KV shape with a hidden size of 64 (a few MB of weights)."""
    return make_model(
        tmp_path_factory.mktemp("kv8b"),
        "llama",
        hidden_size=64,
        num_hidden_layers=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=128,
        max_position_embeddings=8192,
    )


def _serve(args: list, tmp_path):
    stderr = open(tmp_path / "stderr.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "loraplex.cli", "serve", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def _address(proc, timeout: float = 180.0) -> str | None:
    """The URL from `loraplex serving NAME on URL`, or None when the process ends first."""
    found: list[str] = []

    def read():
        for line in proc.stdout:
            if line.startswith("loraplex serving"):
                found.append(line.rsplit(" ", 1)[-1].strip())
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0] if found else None


def _refusal(args: list, tmp_path) -> str:
    """The one stderr line of a serve that must exit 2 before serving."""
    proc = _serve(args, tmp_path)
    try:
        assert proc.wait(180) == 2
        lines = (tmp_path / "stderr.log").read_text().strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _log_lines(tmp_path) -> list[dict]:
    text = (tmp_path / "stderr.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _base(kv8b_dir, tmp_path) -> list:
    return [
        "--model",
        kv8b_dir,
        "--served-model-name",
        "base",
        "--port",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "bfloat16",
        "--data-dir",
        tmp_path / "data",
    ]


def test_kv_budget_too_small_names_the_flag_and_by_how_much(kv8b_dir, tmp_path):
    # 256 MiB at 128 KiB a token: 2048 tokens; the model's 8192 positions make max-model-len 4096
    line = _refusal([*_base(kv8b_dir, tmp_path), "--kv-cache-memory-bytes", "256MiB"], tmp_path)
    assert line == (
        "error: --kv-cache-memory-bytes 256MiB holds 2048 tokens, fewer than "
        "--max-model-len 4096: raise it by 256MiB to 512MiB, or lower --max-model-len to 2048"
    )


def test_engine_flags_size_the_kv_cache_and_the_batch(kv8b_dir, tmp_path):
    proc = _serve(
        [
            *_base(kv8b_dir, tmp_path),
            "--kv-cache-memory-bytes",
            "256MiB",
            "--max-model-len",
            "2048",
            "--max-num-batched-tokens",
            "2048",
            "--block-size",
            "32",
            "--max-num-seqs",
            "3",
        ],
        tmp_path,
    )
    try:
        url = _address(proc)
        assert url is not None, (tmp_path / "stderr.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        out = client.completions.create(
            model="base", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError, match="max_model_len 2048"):
            client.completions.create(model="base", prompt="hello", max_tokens=2048)
        kv = [r["msg"] for r in _log_lines(tmp_path) if r["msg"].startswith("KV cache:")]
        assert kv == ["KV cache: 256MiB for 2048 tokens (kv_cache_memory_bytes)"]
    finally:
        proc.kill()
        proc.wait()


def test_a_step_budget_below_max_model_len_prefills_a_long_prompt_in_chunks(kv8b_dir, tmp_path):
    # as --max-num-batched-tokens' help says; the chunks' tokens are those of one prefill
    # (tests/engines/native/test_loading.py)
    help_text = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert (
        "--max-num-batched-tokens N Tokens one step processes; a longer prompt is prefilled in "
        "chunks over several steps [default: 4096]"
    ) in " ".join(help_text.split())
    args = [*_base(kv8b_dir, tmp_path), "--kv-cache-memory-bytes", "64MiB"]
    args += ["--max-model-len", "256", "--max-num-batched-tokens", "16"]
    proc = _serve(args, tmp_path)
    try:
        url = _address(proc)
        assert url is not None, (tmp_path / "stderr.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        prompt = [3 + i % 50 for i in range(100)]  # 7 steps' worth of prefill
        out = client.completions.create(
            model="base", prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
        )
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (100, 2)
    finally:
        proc.kill()
        proc.wait()


def test_default_kv_budget_on_cpu_starts_an_8b_shaped_model(kv8b_dir, tmp_path):
    # No KV flag: the smaller of what max-num-seqs sequences of max-model-len need (2 x 4096 tokens,
    # 1 GiB) and a quarter of the host's available memory.
    proc = _serve([*_base(kv8b_dir, tmp_path), "--max-num-seqs", "2"], tmp_path)
    try:
        url = _address(proc)
        assert url is not None, (tmp_path / "stderr.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert (
            client.completions.create(
                model="base", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True}
            ).usage.completion_tokens
            == 2
        )
        kv = [r["msg"] for r in _log_lines(tmp_path) if r["msg"].startswith("KV cache:")]
        assert kv == ["KV cache: 1GiB for 8192 tokens (host)"]
    finally:
        proc.kill()
        proc.wait()


def test_config_file_sets_options_and_flags_override_it(kv8b_dir, tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("kv-cache-memory-bytes: 256MiB\nmax-model-len: 4096\nmax_num_seqs: 2\n")
    line = _refusal([*_base(kv8b_dir, tmp_path), "--config", config], tmp_path)
    assert line.startswith("error: --kv-cache-memory-bytes 256MiB holds 2048 tokens")
    # the flag wins over the file's max-model-len
    proc = _serve(
        [*_base(kv8b_dir, tmp_path), "--config", config, "--max-model-len", "1024"], tmp_path
    )
    try:
        assert _address(proc) is not None, (tmp_path / "stderr.log").read_text()
        kv = [r["msg"] for r in _log_lines(tmp_path) if r["msg"].startswith("KV cache:")]
        assert kv == ["KV cache: 256MiB for 2048 tokens (kv_cache_memory_bytes)"]
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize(
    "text, message",
    [
        ("max-num-seqs: many\n", "key 'max-num-seqs': 'many' is not an integer"),
        ("max-modle-len: 4096\n", "unknown key 'max-modle-len'"),
        ("- max-model-len\n", "expected a mapping of option names to values"),
        ("kv-cache-memory-bytes: lots\n", "key 'kv-cache-memory-bytes': bad size 'lots'"),
        (
            "score-weights: {recency: 1, fame: 2}\n",
            "key 'score-weights': 'fame=2': expected NAME=WEIGHT",
        ),
        (
            "gpu-memory-utilization: 1.5\n",
            "key 'gpu-memory-utilization': 1.5: must be a share in (0, 1]",
        ),
    ],
)
def test_bad_config_file_is_one_line_naming_the_key(kv8b_dir, tmp_path, text, message):
    config = tmp_path / "serve.yaml"
    config.write_text(text)
    line = _refusal([*_base(kv8b_dir, tmp_path), "--config", config], tmp_path)
    assert line.startswith("error: ") and message in line, line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--score-weights", "fame=1"], "error: --score-weights: 'fame=1': expected NAME=WEIGHT"),
        (["--load-factor", "0.5"], "error: --load-factor 0.5: must be at least 1 (the mean load)"),
        (
            ["--saturation-kv-usage", "2"],
            "error: --saturation-kv-usage 2: must be a share in (0, 1]",
        ),
        (["--poll-timeout-s", "0"], "error: --poll-timeout-s 0: must be positive"),
        (["--policy", "random"], "error: --policy random: use affinity | round-robin"),
    ],
)
def test_router_tuning_flags_are_checked(args, message, tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraplex.cli",
            "router",
            "--worker",
            "http://127.0.0.1:9",
            "--port",
            "0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_every_option_reaches_the_engine_server_and_policy_configs(tmp_path, llama_dir):
    from loraplex.registry import Registry
    from loraplex.server.serve import (
        ServeSettings,
        engine_config,
        eviction_policy,
        server_config,
    )

    options = ServeSettings(
        model=llama_dir,
        data_dir=tmp_path,
        max_model_len=128,
        max_num_seqs=3,
        max_num_batched_tokens=256,
        block_size=8,
        seed=7,
        kv_cache_memory_bytes=2**20,
        gpu_memory_utilization=0.5,
        max_lora_bytes_per_step=4096,
        max_gpu_preferred=1,
        thrash_window_s=5.0,
        load_threads=3,
        tenant_gpu_share=0.5,
        tenant_cpu_share=0.25,
        score_weights=(("priority", 3.0), ("size", 0.0)),
        min_residency_s=0.0,
        max_requests_per_tenant=9,
        max_waiting=10,
        max_prompt_tokens=100,
        max_body_bytes=1000,
        unload_timeout_s=1.0,
        shutdown_timeout_s=2.0,
        release_min_pass_rate=0.5,
        key_cache_ttl_s=1.5,
        audit_log="off",
        top_k_adapter_metrics=4,
        registry_watch_s=0.5,
    )
    registry = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    e = engine_config(options, registry.store)
    assert str(registry.store.root.resolve()) in e.allowed_roots
    assert (e.max_model_len, e.max_num_seqs, e.max_num_batched_tokens, e.block_size, e.seed) == (
        128,
        3,
        256,
        8,
        7,
    )
    assert (e.kv_cache_memory_bytes, e.gpu_memory_utilization, e.max_lora_bytes_per_step) == (
        2**20,
        0.5,
        4096,
    )
    assert (e.max_gpu_preferred, e.thrash_window_s, e.load_threads) == (1, 5.0, 3)
    assert (e.tenant_gpu_share, e.tenant_cpu_share) == (0.5, 0.25)
    config = server_config(options, None, None)
    s = config.settings  # what the server reads, under the settings' own names
    assert (s.max_requests_per_tenant, s.max_waiting, s.max_prompt_tokens, s.max_body_bytes) == (
        9,
        10,
        100,
        1000,
    )
    assert (s.unload_timeout_s, s.shutdown_timeout_s, s.release_min_pass_rate) == (1.0, 2.0, 0.5)
    assert (s.key_cache_ttl_s, config.audit_log, s.top_k_adapter_metrics, s.registry_watch_s) == (
        1.5,
        None,
        4,
        0.5,
    )
    policy = eviction_policy(options)
    assert (
        policy.w_priority,
        policy.w_size_per_gib,
        policy.min_residency_s,
        policy.w_frequency,
    ) == (3.0, 0, 0, 2.0)
    with pytest.raises(
        ValueError, match="--score-weights and --min-residency-s apply to --eviction-policy score"
    ):
        eviction_policy(
            ServeSettings(
                model=llama_dir, data_dir=tmp_path, eviction_policy="lru", min_residency_s=1.0
            )
        )
    with pytest.raises(ValueError, match="^max_waiting -1: must be at least 0"):
        ServeSettings(model=llama_dir, data_dir=tmp_path, max_waiting=-1)
    registry.close()


def test_trusted_key_refuses_an_unsigned_lora_module_and_serves_a_signed_one(
    llama_dir, llama_adapters, tmp_path
):
    from loraplex.artifacts import canonical_digest
    from loraplex.registry.signing import (
        SIGNATURE_FILE,
        generate_keypair,
        load_private_key,
        sign_digest,
    )

    private, public = generate_keypair()
    (tmp_path / "release.key").write_bytes(private)
    (tmp_path / "release.pub").write_bytes(public)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for f in llama_adapters["attn-r8"].iterdir():
        (adapter / f.name).write_bytes(f.read_bytes())
    base = [
        "--model",
        llama_dir,
        "--port",
        "0",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--data-dir",
        tmp_path / "data",
        "--trusted-key",
        tmp_path / "release.pub",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"one={adapter}",
    ]
    line = _refusal(base, tmp_path)
    assert line == (
        "error: --lora-modules one: signature: the revision is unsigned and trusted "
        "keys are configured"
    )
    signature = sign_digest(canonical_digest(adapter), load_private_key(tmp_path / "release.key"))
    (adapter / SIGNATURE_FILE).write_text(signature + "\n")
    proc = _serve(base, tmp_path)
    try:
        url = _address(proc)
        assert url is not None, (tmp_path / "stderr.log").read_text()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        assert client.completions.create(model="one", prompt="hi", max_tokens=1).usage
    finally:
        proc.kill()
        proc.wait()
