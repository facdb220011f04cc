"""Training examples as token ids: the prompt masked out of the loss, right-padded batches.

>>> class Tok:  # a stand-in with the two calls a Hugging Face tokenizer answers
...     eos_token_id = 2
...     def __call__(self, text, add_special_tokens=True):
...         return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}
>>> e = encode_example(Tok(), "a", "b", max_len=8)
>>> e
{'input_ids': [1, 97, 98, 2], 'labels': [-100, -100, 98, 2]}
>>> collate([e, {"input_ids": [5], "labels": [5]}], pad_id=0)["attention_mask"].tolist()
[[1, 1, 1, 1], [1, 0, 0, 0]]
"""

from __future__ import annotations

from typing import Sequence

import torch

IGNORE_INDEX = -100  # labels the loss skips: prompt tokens and padding


def encode_example(tokenizer, prompt: str, completion: str, max_len: int) -> dict[str, list[int]]:
    """Token ids of prompt + completion + eos, with labels -100 on the prompt tokens.

    The prompt is encoded with the tokenizer's special tokens (a leading ``<s>`` for the
    tiny Llama), the completion without; both lists are truncated to ``max_len``.
    """
    prompt_ids = tokenizer(prompt)["input_ids"]
    completion_ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    completion_ids = completion_ids + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + completion_ids)[:max_len]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + completion_ids)[:max_len]
    return {"input_ids": input_ids, "labels": labels}


def collate(examples: Sequence[dict[str, list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad encoded examples into ``input_ids``, ``attention_mask`` and ``labels``."""
    width = max(len(e["input_ids"]) for e in examples)
    input_ids, attention_mask, labels = [], [], []
    for e in examples:
        pad = width - len(e["input_ids"])
        input_ids.append(list(e["input_ids"]) + [pad_id] * pad)
        attention_mask.append([1] * len(e["input_ids"]) + [0] * pad)
        labels.append(list(e["labels"]) + [IGNORE_INDEX] * pad)
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask),
            "labels": torch.tensor(labels)}
