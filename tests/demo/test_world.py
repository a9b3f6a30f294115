"""The demo world: every adapter does its transform (checked with transformers + peft), formats,
reproducibility."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from loraplex.demo import world as demo  # noqa: E402
from loraplex.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID, SEP_ID  # noqa: E402
from loraplex.lora_format import PICKLE_SUFFIXES, read_adapter  # noqa: E402
from loraplex.model_config import ModelConfig  # noqa: E402

FRESH_SEED = 4242  # held-out inputs the build never measured on
NUM_FRESH = 100


@pytest.fixture(scope="module")
def world(demo_world) -> demo.World:
    return demo_world


@pytest.fixture(scope="module")
def hf_tokenizer(world):
    tokenizer = transformers.AutoTokenizer.from_pretrained(world.model_dir)
    tokenizer.padding_side = "left"
    return tokenizer


def _load_base(world):
    model = transformers.AutoModelForCausalLM.from_pretrained(world.model_dir, dtype=torch.float32)
    return model.eval()


def _generate(model, tokenizer, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy answers of the prompts as a client would see them: decoded text up to `</s>`."""
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=False)
    return [t.split("</s>")[0] if "</s>" in t else "<no eos>" for t in texts]


def _exact_match(model, tokenizer, name: str, inputs: list[str]) -> float:
    transform = demo.TRANSFORMS[name]
    answers = _generate(model, tokenizer, [demo.make_prompt(text) for text in inputs], 2 * 12 + 2)
    return sum(a == transform(text) for a, text in zip(answers, inputs)) / len(inputs)


def test_world_covers_every_transform(world):
    assert set(world.adapters) == set(demo.TRANSFORMS) - {"copy"}
    assert set(world.accuracy) == set(demo.TRANSFORMS)
    assert min(world.ranks.values()) == 4 and max(world.ranks.values()) == 32
    configs = [
        json.loads((path / "adapter_config.json").read_text()) for path in world.adapters.values()
    ]
    assert len({tuple(c["target_modules"]) for c in configs}) >= 3
    assert any(c["lora_alpha"] != c["r"] for c in configs)
    assert all(acc >= demo.ACCURACY_BAR for acc in world.accuracy.values()), world.accuracy


def test_base_copies_fresh_inputs(world, hf_tokenizer):
    inputs = demo.random_inputs(NUM_FRESH, FRESH_SEED)
    assert _exact_match(_load_base(world), hf_tokenizer, "copy", inputs) >= demo.ACCURACY_BAR


@pytest.mark.parametrize("name", [n for n in demo.TRANSFORMS if n != "copy"])
def test_adapter_does_its_transform_on_fresh_inputs(world, hf_tokenizer, name):
    model = peft.PeftModel.from_pretrained(_load_base(world), world.adapters[name]).eval()
    assert isinstance(model.base_model, peft.tuners.lora.LoraModel)
    inputs = demo.random_inputs(NUM_FRESH, FRESH_SEED)
    assert _exact_match(model, hf_tokenizer, name, inputs) >= demo.ACCURACY_BAR


def test_adapters_in_one_mixed_batch(world, hf_tokenizer):
    """All adapters loaded in one PeftModel, one request per adapter (and the base) in the same
    batch."""
    names = list(world.adapters)
    model = peft.PeftModel.from_pretrained(
        _load_base(world), world.adapters[names[0]], adapter_name=names[0]
    )
    for name in names[1:]:
        model.load_adapter(world.adapters[name], adapter_name=name)
    model.eval()
    text = demo.random_inputs(1, FRESH_SEED + 1)[0]
    rows = ["__base__", *names]
    batch = hf_tokenizer(
        [demo.make_prompt(text)] * len(rows), return_tensors="pt", add_special_tokens=False
    )
    with torch.no_grad():
        out = model.generate(**batch, adapter_names=rows, max_new_tokens=26, do_sample=False)
    answers = [
        t.split("</s>")[0] for t in hf_tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :])
    ]
    expected = [demo.TRANSFORMS["copy" if r == "__base__" else r](text) for r in rows]
    assert answers == expected


def test_prompt_without_bos_still_works(world, hf_tokenizer):
    """A client that sends `TEXT<sep>` (no `<s>`) gets the same answers: a quarter of training
    prompts had none."""
    inputs = demo.random_inputs(50, FRESH_SEED)
    answers = _generate(_load_base(world), hf_tokenizer, [f"{text}<sep>" for text in inputs], 14)
    assert sum(a == t for a, t in zip(answers, inputs)) / len(inputs) >= 0.9


def test_files_are_safetensors_and_pass_the_adapter_validator(world):
    files = [p for p in world.root.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in PICKLE_SUFFIXES]
    assert (world.model_dir / "model.safetensors").is_file()
    model_config = ModelConfig.from_dir(world.model_dir)
    assert model_config.head_dim == 32 and model_config.eos_token_ids == (EOS_ID,)
    for name, path in world.adapters.items():
        assert sorted(p.name for p in path.iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        spec = read_adapter(path, model_config, max_rank=64)
        assert spec.rank == world.ranks[name] and spec.dtype == "F32"
        assert spec.base_model_name == demo.BASE_MODEL_NAME


def test_tokenizer_round_trips(world, hf_tokenizer):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(world.model_dir / "tokenizer.json"))
    prompt = demo.make_prompt("hello")
    assert prompt == "<s>hello<sep>"
    assert tokenizer.encode(prompt).ids == [BOS_ID, *b"hello", SEP_ID]
    # special tokens are parsed from plain text
    assert tokenizer.encode("hello<sep>").ids == [
        *b"hello",
        SEP_ID,
    ]
    for text in [prompt + "HELLO</s>", "any bytes: é ü ✓ \t\n", "<pad><s>"]:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == ids
        # nothing added on its own: the prompt carries its `<s>`
        assert hf_tokenizer(text)["input_ids"] == ids
    assert tokenizer.decode([*b"HELLO", EOS_ID]) == "HELLO"
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    generation = json.loads((world.model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_ID


def test_chat_template_renders_the_completion_prompt(hf_tokenizer):
    messages = [
        {"role": "system", "content": "ignored"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "FIRST"},
        {"role": "user", "content": "hello"},
    ]
    rendered = hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert rendered == demo.make_prompt("hello")


def test_random_inputs_are_seeded_and_tell_the_transforms_apart():
    inputs = demo.random_inputs(300, 7)
    assert inputs == demo.random_inputs(300, 7) and inputs != demo.random_inputs(300, 8)
    for text in inputs:
        assert text.isascii() and text.islower() and 3 <= len(text) <= 12
        assert len({fn(text) for fn in demo.TRANSFORMS.values()}) == len(demo.TRANSFORMS)


def test_half_built_or_stale_world_is_not_loaded(world, tmp_path):
    copy = tmp_path / "world"
    shutil.copytree(world.root, copy, ignore=shutil.ignore_patterns(".lock"))
    loaded = demo.load_world(copy)
    assert loaded is not None and loaded.adapters["rot13"] == copy / "adapters" / "rot13"
    assert loaded.accuracy == world.accuracy

    (copy / "adapters" / "reverse" / "adapter_model.safetensors").unlink()
    assert demo.load_world(copy) is None
    meta = json.loads((copy / demo.MARKER).read_text())
    shutil.copy(
        world.adapters["reverse"] / "adapter_model.safetensors", copy / "adapters" / "reverse"
    )
    (copy / demo.MARKER).write_text(json.dumps({**meta, "version": "0"}))
    assert demo.load_world(copy) is None
    (copy / demo.MARKER).unlink()
    assert demo.load_world(copy) is None


def test_rebuild_gives_identical_bytes(tmp_path):
    """Same plan, same seed: two builds write byte-identical weights and configs.

    Bytes, not just outputs: training runs on CPU in a fixed number of single-threaded processes
    with a deterministic all-reduce, so nothing depends on timing. The steps are cut short to keep
    this test quick; the code path is the full build's. (Another CPU model or torch build may round
    differently, so a world is reproducible on the same kind of machine and library versions, which
    world.json records.)
    """
    from loraplex.demo.build import run_build

    recipe = dataclasses.replace(demo.ADAPTER_RECIPES[0], steps=4)
    eval_inputs = tuple(demo.random_inputs(8, 1))
    plan = dataclasses.replace(
        demo.build_plan(), base_steps=6, adapters=(recipe,), eval_inputs=eval_inputs
    )
    files = []
    for attempt in ("first", "second"):
        model_dir, adapters_dir = tmp_path / attempt / "model", tmp_path / attempt / "adapters"
        model_dir.mkdir(parents=True)
        adapters_dir.mkdir()
        results = run_build(plan, model_dir, adapters_dir, report=None)
        assert [r.name for r in results] == ["copy", recipe.name]
        adapter_dir = adapters_dir / recipe.name
        files.append(
            [
                model_dir / "model.safetensors",
                adapter_dir / "adapter_model.safetensors",
                adapter_dir / "adapter_config.json",
            ]
        )
    for first, second in zip(*files):
        assert first.read_bytes() == second.read_bytes(), f"{first.name} differs between two builds"


def test_a_build_whose_output_is_not_a_terminal_prints_one_line_per_stage():
    """Piped or logged, a progress bar shows nothing until the end: a line per stage instead."""
    import io

    from loraplex.demo.build import StageResult
    from loraplex.demo.world import _progress_reporter, build_plan

    plan, out = build_plan(), io.StringIO()
    stages = ["copy", *(r.name for r in plan.adapters)]
    with _progress_reporter(plan, True, out) as (report, on_result):
        assert report is None
        after = []
        for i, name in enumerate(stages):
            on_result(StageResult(name, 1.0, 10.0 + i))
            after.append(len(out.getvalue().splitlines()))
    lines = out.getvalue().splitlines()
    first = f"building the demo world: the base model and {len(plan.adapters)} adapters"
    assert lines[0].startswith(first)
    assert after == list(range(2, len(stages) + 2))  # each line printed as its stage ends
    n = len(stages)
    assert lines[1] == f"[1/{n}] base (copy): {plan.base_steps} steps, exact match 100.0%, 10 s"
    last = plan.adapters[-1]
    assert lines[-1] == f"[{n}/{n}] {last.name}: {last.steps} steps, exact match 100.0%, {9 + n} s"
