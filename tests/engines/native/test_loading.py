"""Loading a model directory: dtypes, clear one-line failures, tokenizer and chat template."""

import json
import shutil

import pytest
import torch

from loraplex.engines.native.config import EngineConfig
from loraplex.engines.native.llm_engine import LLMEngine
from loraplex.engines.native.sequence import SamplingParams
from loraplex.engines.native.tokenizer import Tokenizer
from loraplex.model_config import ModelConfigError, _sliding_windows


def engine_for(model_dir, **kw):
    return LLMEngine(
        EngineConfig(model_dir=model_dir, kv_cache_memory_bytes=2**20, max_lora_rank=16, **kw)
    )


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close_to_float32(llama_dir, llama_adapters, dtype):
    prompt = [5, 6, 7, 8, 9, 10]
    ref32 = engine_for(llama_dir, dtype="float32")
    half = engine_for(llama_dir, dtype=dtype)
    assert half.model.lm_head.weight.dtype == getattr(torch, dtype)
    assert half.model.inv_freq.dtype == torch.float32
    for eng in (ref32, half):
        eng.ad = eng.adapter_ref("attn-r8", llama_adapters["attn-r8"])
    full = ref32.score([prompt], [ref32.ad])[0]
    low = half.score([prompt], [half.ad])[0]
    assert (full - low).abs().max() < 0.1
    assert (full.argmax(-1) == low.argmax(-1)).float().mean() >= 0.8
    assert (
        len(half.generate([prompt], SamplingParams(max_tokens=4, temperature=0), [half.ad])[0]) == 4
    )


def test_float32_linear_weights_on_cpu_are_packed_for_onednn_and_give_the_same_numbers(llama_dir):
    from safetensors.torch import load_file

    from loraplex.engines.native.loader import load_model
    from loraplex.engines.native.model import LoRALinear

    model = load_model(llama_dir, torch.float32, torch.device("cpu"))
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert layers and all(m.packed is not None and m.weight.numel() == 0 for m in layers)
    plain = load_file(str(llama_dir / "model.safetensors"))
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(5, q.in_features)
    expected = x @ plain["model.layers.0.self_attn.q_proj.weight"].t()
    torch.testing.assert_close(q(x, None), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "broken, message",
    [
        ("config.json", "missing config.json"),
        ("tokenizer.json", "missing tokenizer.json"),
        ("model.safetensors", "missing model.safetensors"),
    ],
)
def test_missing_files_fail_at_start_naming_the_file(llama_dir, tmp_path, broken, message):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    (model / broken).unlink()
    with pytest.raises(ModelConfigError, match=message):
        engine_for(model)


def test_unsupported_architecture_and_pickle_weights_are_refused(llama_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelConfigError, match="unsupported architecture GPT2LMHeadModel"):
        engine_for(model)
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    with pytest.raises(ModelConfigError, match="pickle"):
        engine_for(model)


def test_chat_template_and_plain_fallback(llama_dir, tmp_path):
    tok = Tokenizer(llama_dir)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "<s>user: hi\nassistant:"
    plain = tmp_path / "plain"
    shutil.copytree(llama_dir, plain)
    (plain / "tokenizer_config.json").write_text("{}")
    assert Tokenizer(plain).apply_chat_template(messages) == "user: hi\nassistant:"
    text = "hello world"
    assert tok.decode(tok.encode(text)) == text


def test_a_template_that_fails_on_a_message_field_is_a_value_error(llama_dir, tmp_path):
    """Extra message fields reach the template (as `tool_calls` does in Qwen's and Llama's): a
    TypeError there comes from the request's data, so it is a ValueError (400) like a template
    error, not a 500."""
    model = tmp_path / "tool-calls"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{%- for m in messages %}{%- if m.tool_calls is defined %}{%- for c in m.tool_calls %}"
        "{{ c.function.name }}{%- endfor %}{%- else %}{{ m.content }}{%- endif %}{%- endfor %}"
    )
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(model)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    with pytest.raises(ValueError, match="chat template failed: TypeError"):
        tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": 5}])


def test_rank_aware_admission_keeps_a_second_big_adapter_out_of_the_step(llama_dir, llama_adapters):
    eng = engine_for(llama_dir, dtype="float32", max_loras=3)
    big = eng.adapter_ref("big", llama_adapters["all-r16-rslora"])
    other = eng.adapter_ref("other", llama_adapters["attn-r8"])
    eng.generate([[3, 4]], SamplingParams(max_tokens=1), [big])  # learn its size
    eng.generate([[3, 4]], SamplingParams(max_tokens=1), [other])
    limit = eng.adapters.nbytes_of(big.key) + eng.adapters.nbytes_of(other.key) - 1
    capped = engine_for(llama_dir, dtype="float32", max_loras=3, max_lora_bytes_per_step=limit)
    capped.generate([[3, 4]], SamplingParams(max_tokens=1), [capped.adapter_ref("big", big.path)])
    capped.generate(
        [[3, 4]], SamplingParams(max_tokens=1), [capped.adapter_ref("other", other.path)]
    )
    a = capped.add_request(
        [3, 4, 5], SamplingParams(max_tokens=6, temperature=0), capped.adapter_ref("big", big.path)
    )
    b = capped.add_request(
        [3, 4, 5],
        SamplingParams(max_tokens=6, temperature=0),
        capped.adapter_ref("other", other.path),
    )
    together = 0
    while capped.has_work():
        capped.step()
        keys = {s.adapter.key for s in capped.scheduler.running}
        together = max(together, len(keys))
    assert together == 1  # never both adapters in one step
    assert not capped.requests and a != b


def test_a_prompt_longer_than_the_step_budget_is_prefilled_in_chunks(llama_dir):
    """A sequence longer than one step's token budget (a long prompt, or a request preempted late
    and recomputed) is prefilled over several steps, beside the decodes, and gives what one prefill
    gives."""
    chunked = engine_for(llama_dir, max_model_len=64, max_num_batched_tokens=16)
    whole = engine_for(llama_dir, max_model_len=64, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [[3 + i % 50 for i in range(60)], [7, 8, 9]]
    assert chunked.generate(prompts, params) == whole.generate(prompts, params)


def test_qwen_sliding_layers_follow_transformers_without_layer_types():
    """A hand-written Qwen2/Qwen3 config.json with use_sliding_window and no `layer_types` nor
    `max_window_layers`:
    transformers slides from layer 28 (its default), so must we."""
    import transformers

    raw = {"num_hidden_layers": 30, "use_sliding_window": True, "sliding_window": 4}
    for model_type, config_class in (
        ("qwen2", transformers.Qwen2Config),
        ("qwen3", transformers.Qwen3Config),
    ):
        expected = tuple(
            4 if t == "sliding_attention" else None for t in config_class(**raw).layer_types
        )
        assert _sliding_windows(raw, model_type) == expected
        assert expected[27:] == (None, 4, 4)


def test_requests_waiting_for_a_loading_adapter_ask_the_cache_once_per_step(
    llama_dir, llama_adapters
):
    """The scheduler walks the waiting queue at every step; the requests behind the first one whose
    adapter is loading skip the cache (its acquire could only fail until the load is taken in,
    between steps), as the simulator does: with many requests waiting each asked the cache, at every
    step."""
    eng = engine_for(llama_dir, dtype="float32", max_loras=2)
    ref = eng.adapter_ref("a", llama_adapters["attn-r8"])
    ids = [
        eng.add_request(
            [3, 4, 5], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), ref
        )
        for _ in range(5)
    ]
    asked, acquire = [], eng.adapters.acquire
    eng.adapters.acquire = lambda r: asked.append(r.key) or acquire(r)
    eng.step()
    # the first request started the load; the four behind it waited without asking
    assert asked == [ref.key]
    done = {}
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(ids) and all(
        o.num_output_tokens == 2 and o.error is None for o in done.values()
    )
