"""The tiny local Llama and the digit task (fast, CPU, nothing downloaded)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from streamtune.tinymodel import (  # noqa: E402
    MARKER, build_tiny_llama, digit_completion, digit_pairs, digit_prompt, exact_match)
from core.batching import collate, encode_example  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_dir)


def test_digit_prompt_and_completion():
    assert digit_prompt("1234") == "x=1234;y="
    assert digit_completion("1234") == "2345"
    assert digit_completion("0919") == "1020"
    assert digit_completion("9999") == "0000"


def test_digit_pairs_deterministic_by_seed():
    assert digit_pairs(50, seed=3) == digit_pairs(50, seed=3)
    assert digit_pairs(50, seed=3) != digit_pairs(50, seed=4)
    pairs = digit_pairs(50, seed=3)
    assert len(pairs) == 50
    for prompt, completion in pairs:
        digits = prompt[2:6]
        assert len(digits) == 4 and digits.isdigit()
        assert (prompt, completion) == (digit_prompt(digits), digit_completion(digits))


def test_digit_pairs_exclude_keeps_sets_disjoint():
    held_out = digit_pairs(200, seed=1)
    held_digits = {p[2:6] for p, _ in held_out}
    train = digit_pairs(5000, seed=0, exclude=held_digits)
    assert len(train) == 5000
    assert not {p for p, _ in train} & {p for p, _ in held_out}


def test_tokenizer_splits_digits(tokenizer):
    ids = tokenizer("x=1234;y=", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids)[-7:-3] == ["1", "2", "3", "4"]
    assert tokenizer.decode(ids) == "x=1234;y="
    assert len(tokenizer("2345", add_special_tokens=False)["input_ids"]) == 4


def test_encode_example_masks_prompt(tokenizer):
    prompt, completion = digit_prompt("1234"), digit_completion("1234")
    ex = encode_example(tokenizer, prompt, completion, max_len=64)
    n_prompt = len(tokenizer(prompt)["input_ids"])
    assert len(ex["input_ids"]) == len(ex["labels"]) == n_prompt + 4 + 1
    assert ex["labels"][:n_prompt] == [-100] * n_prompt
    assert ex["labels"][n_prompt:] == ex["input_ids"][n_prompt:]
    assert ex["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ex["labels"][n_prompt:-1]) == "2345"
    short = encode_example(tokenizer, prompt, completion, max_len=5)
    assert len(short["input_ids"]) == len(short["labels"]) == 5


def test_collate_right_pads(tokenizer):
    a = encode_example(tokenizer, "x=1;y=", "2", 64)
    b = encode_example(tokenizer, digit_prompt("1234"), "2345", 64)
    batch = collate([a, b], tokenizer.pad_token_id)
    width = len(b["input_ids"])
    assert batch["input_ids"].shape == batch["labels"].shape == (2, width)
    n = len(a["input_ids"])
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (width - n)
    assert batch["input_ids"][0, n:].eq(tokenizer.pad_token_id).all()
    assert batch["labels"][0, n:].eq(-100).all()
    assert batch["attention_mask"][1].all()


def test_build_round_trips_and_is_idempotent(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    assert {"q_proj", "v_proj"} <= names
    assert model.config.vocab_size == len(tokenizer)
    assert tokenizer.pad_token_id is not None and tokenizer.eos_token_id is not None
    assert json.loads((tiny_dir / MARKER).read_text())["hidden_size"] == 64

    weights = tiny_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_llama(tiny_dir) == tiny_dir
    assert weights.stat().st_mtime_ns == mtime  # same parameters: not rebuilt
    build_tiny_llama(tiny_dir, hidden_size=32)  # other parameters: rebuilt in place
    assert AutoModelForCausalLM.from_pretrained(tiny_dir).config.hidden_size == 32
    build_tiny_llama(tiny_dir)
    assert AutoModelForCausalLM.from_pretrained(tiny_dir).config.hidden_size == 64


def test_exact_match_untrained_is_low(tiny_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.train()
    assert exact_match(model, tokenizer, digit_pairs(50, seed=1)) <= 0.1
    assert model.training  # mode restored


def test_lora_learns_digit_task(tiny_dir, tokenizer):
    """The setting the module documents: q/v LoRA r=16, batch 32, lr 1e-2, 100 steps."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_dir), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    held_out = digit_pairs(100, seed=1000)
    train = digit_pairs(32 * 100, seed=0, exclude={p[2:6] for p, _ in held_out})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for i in range(0, len(train), 32):
        batch = collate([encode_example(tokenizer, p, c, 32) for p, c in train[i:i + 32]],
                        tokenizer.pad_token_id)
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad()
    assert exact_match(model, tokenizer, held_out) >= 0.9
