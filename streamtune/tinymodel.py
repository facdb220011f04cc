"""A tiny Llama and a digit task, built locally, for tests and demos of LoRA fine-tuning.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here with `tokenizers`
on generated text, and the model is a `LlamaForCausalLM` built from a config with
random weights. Both are saved as a standard Hugging Face directory.

The task: ``"x=1234;y="`` -> ``"2345"`` (each digit plus one, mod 10). A LoRA adapter
on q_proj/v_proj of the random tiny Llama learns it to held-out exact match >= 0.95 in
about 100 steps of batch 32 at lr 1e-2 (about 10 ms a step on one CPU thread).

Example (runs in a few seconds on CPU)::

    import tempfile
    from pathlib import Path

    import torch

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.batching import collate, encode_example
    from streamtune.tinymodel import build_tiny_llama, digit_pairs, exact_match

    torch.set_num_threads(1)
    out = build_tiny_llama(Path(tempfile.mkdtemp()) / "tiny")
    tok = AutoTokenizer.from_pretrained(out)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(out), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    held_out = digit_pairs(100, seed=1)
    train = digit_pairs(32 * 100, seed=0, exclude={p[2:6] for p, _ in held_out})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for i in range(0, len(train), 32):
        batch = collate([encode_example(tok, p, c, 32) for p, c in train[i:i + 32]],
                        tok.pad_token_id)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    print(exact_match(model, tok, held_out))  # ~1.0
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

MARKER = "streamtune-tiny.json"
BOS, EOS, PAD = "<s>", "</s>", "<pad>"

# ---------------------------------------------------------------------------- digit task


def digit_prompt(digits: str) -> str:
    """The prompt for a digit string: ``"1234"`` -> ``"x=1234;y="``."""
    return f"x={digits};y="


def digit_completion(digits: str) -> str:
    """Each digit plus one, mod 10: ``"1234"`` -> ``"2345"``, ``"0919"`` -> ``"1020"``."""
    return "".join(str((int(d) + 1) % 10) for d in digits)


def digit_pairs(n: int, seed: int, exclude: Iterable[str] = frozenset()) -> list[tuple[str, str]]:
    """``n`` (prompt, completion) pairs of 4 random digits drawn from ``random.Random(seed)``.

    Digit strings in ``exclude`` are never yielded, so a held-out set passed as
    ``exclude`` stays disjoint from the training set. Duplicates may occur otherwise.
    """
    exclude = set(exclude)
    if n > 0 and len(exclude) >= 10_000:
        raise ValueError("exclude covers every 4-digit string")
    rng = random.Random(seed)
    pairs: list[tuple[str, str]] = []
    while len(pairs) < n:
        digits = f"{rng.randrange(10_000):04d}"
        if digits not in exclude:
            pairs.append((digit_prompt(digits), digit_completion(digits)))
    return pairs


# ---------------------------------------------------------------------------- model


def _corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: digit-task lines plus generic ASCII."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while streams of events flow "
             "through windows keys values state model adapter step loss train test "
             "Hello World JSON {\"key\": [1, 2]} a+b=c; f(x) = y * 2 - 1 / 3 % 4 < 5 > 6 "
             "path/to/file.txt user@example.com #tag $var & | ^ ~ ` ' ? ! _").split()
    lines = [f"{p}{c}" for p, c in digit_pairs(2000, seed)]
    lines += [" ".join(rng.choice(words) for _ in range(12)) for _ in range(500)]
    lines.append("".join(chr(c) for c in range(32, 127)))  # every printable ASCII char
    return lines


def _train_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits are split one per pre-token before byte-level BPE, so each digit is one token
    # and a prompt's tokens are always a prefix of prompt+completion's tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encoding with special tokens prepends <s>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, padding_side="right")


def build_tiny_llama(out_dir: Path, *, vocab_size: int = 512, hidden_size: int = 64,
                     layers: int = 2, heads: int = 4, seed: int = 0,
                     init_range: float = 0.05) -> Path:
    """Build (or reuse) a random tiny Llama and its tokenizer in ``out_dir``; return it.

    Loadable with ``AutoModelForCausalLM.from_pretrained(out_dir)`` and
    ``AutoTokenizer.from_pretrained(out_dir)``. If ``out_dir`` already holds a build with
    the same parameters (marker file ``streamtune-tiny.json``), nothing is rebuilt. The
    directory is written to a temporary sibling first and moved into place, marker last.

    ``init_range`` is the weights' init std. The frozen random base bounds how far a
    q/v LoRA can move the logits: at Hugging Face's default 0.02 the digit task still
    reaches exact match ~1.0 but its loss stays near log(vocab); at 0.05 the loss falls
    visibly (about 5.3 -> 3.1 in 100 steps) and exact match is 1.0 by step 100.
    """
    out_dir = Path(out_dir)
    params = {"vocab_size": vocab_size, "hidden_size": hidden_size, "layers": layers,
              "heads": heads, "seed": seed, "init_range": init_range}
    marker = out_dir / MARKER
    try:
        if json.loads(marker.read_text()) == params:
            return out_dir
    except (OSError, ValueError):
        pass

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(vocab_size, seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=256, initializer_range=init_range,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):  # seeded weights; the caller's RNG is untouched
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=False)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(params, sort_keys=True) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ---------------------------------------------------------------------------- data


# ---------------------------------------------------------------------------- evaluation


@torch.no_grad()
def exact_match(model: Any, tokenizer, pairs: Sequence[tuple[str, str]],
                max_new_tokens: int | None = None, batch_size: int = 256) -> float:
    """Fraction of (prompt, completion) pairs whose greedy continuation equals the completion.

    Prompts are left-padded and decoded greedily in batches (``model.generate`` with
    ``do_sample=False``); the new tokens up to the first eos are decoded, stripped and
    compared exactly. ``max_new_tokens`` defaults to the longest completion's token count
    plus one (room for eos). Works for a plain model and a ``peft.PeftModel``; the
    model's train/eval mode is restored afterwards.
    """
    if not pairs:
        return 0.0
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if pad is None:
        pad = eos
    if max_new_tokens is None:
        max_new_tokens = 1 + max(
            len(tokenizer(c, add_special_tokens=False)["input_ids"]) for _, c in pairs)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    hits = 0
    try:
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            encoded = [tokenizer(p)["input_ids"] for p, _ in chunk]
            width = max(len(ids) for ids in encoded)
            input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded],
                                     device=device)
            attention_mask = torch.tensor(
                [[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=pad)
            for row, (_, completion) in zip(out[:, width:].tolist(), chunk):
                if eos in row:
                    row = row[:row.index(eos)]
                text = tokenizer.decode(row, skip_special_tokens=True).strip()
                hits += text == completion
    finally:
        model.train(was_training)
    return hits / len(pairs)
