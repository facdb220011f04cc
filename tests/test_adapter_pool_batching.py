"""Batched decoding in the adapter pool, on the tiny base built here (no stack): a row decoded
in a batch — left-padded beside longer and shorter prompts, beside rows of other versions and
of the base — gives the same tokens as the same request decoded alone, and alone equals
Hugging Face's `generate`."""

from __future__ import annotations

import threading

import pytest
import torch

from core.routing import BASE
from operators.adapter_pool import AdapterPool
from operators.batched_decoding import Group, Row, SamplingParams, decode_batch
from streamtune.testing import random_adapter_files
from streamtune.tinymodel import build_tiny_llama

PROMPTS = ["x=1234;y=", "x=5;y=", "a longer prompt than the others, x=99;y=", "q", "x=0000;y=0"]
VERSIONS = ["m/1", "m/2", "m/3"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    base = build_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    pool = AdapterPool(base, slots=4, device="cpu")
    for i, key in enumerate(VERSIONS):
        pool.put(key, random_adapter_files(base, seed=i)[0])
    return pool


def alone(pool, key, prompt, params):
    return pool.generate(key, prompt, params=params)


def test_alone_equals_hugging_face_generate(pool):
    for key in (BASE, "m/1"):
        for prompt in PROMPTS:
            ids = pool.tokenizer(prompt, return_tensors="pt")["input_ids"]
            with pool.lock:
                slot = pool.activate(key)
                if slot is None:
                    with pool.model.disable_adapter():
                        out = pool.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                                  do_sample=False, pad_token_id=pool.tokenizer.pad_token_id)
                else:
                    pool.model.set_adapter(slot)
                    out = pool.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=10,
                                              do_sample=False, pad_token_id=pool.tokenizer.pad_token_id)
            expected = pool.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            assert pool.generate(key, prompt, 10).text == expected, (key, prompt)


@pytest.mark.parametrize("mixing", ["stacked", "peft"])
def test_a_mixed_batch_equals_each_request_alone(pool, mixing):
    """`stacked`: the pool's gathered matmul over its slot stacks (what the scheduler uses);
    `peft`: peft's own mixed batch (`adapter_names`)."""
    keys = [BASE, *VERSIONS]
    params = [SamplingParams(max_tokens=4 + i % 7) for i in range(len(keys) * len(PROMPTS))]
    cases = [(k, p) for k in keys for p in PROMPTS]
    expected = [alone(pool, k, p, sp) for (k, p), sp in zip(cases, params)]
    with pool.lock:
        slots = {k: pool.activate(k) for k in keys}
        rows = [Row(pool.tokenize(p), sp) for (k, p), sp in zip(cases, params)]
        got = decode_batch(pool.model, pool.tokenizer, rows, [slots[k] for k, _ in cases], pool.device, pool.eos_ids,
                           pool.mixed_batch if mixing == "stacked" else None)
    for case, e, g in zip(cases, expected, got):
        assert (g.text, g.tokens, g.finish_reason) == (e.text, e.tokens, e.finish_reason), case
        assert abs(g.mean_logprob - e.mean_logprob) < 1e-4, case
        assert g.prompt_tokens == len(pool.tokenizer(case[1])["input_ids"])
    assert len({g.tokens for g in got}) > 1, "rows of different max_tokens finish apart"


def test_per_row_stop_strings_seeds_and_streaming(pool):
    greedy = pool.generate("m/2", PROMPTS[0], 12).text
    assert len(greedy) >= 3
    stop = greedy[2:4]
    sampled = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    rows = [Row(pool.tokenize(PROMPTS[0]), SamplingParams(max_tokens=12, stop=(stop,))),
            Row(pool.tokenize(PROMPTS[1]), sampled), Row(pool.tokenize(PROMPTS[2]), sampled),
            Row(pool.tokenize(PROMPTS[0]), SamplingParams(max_tokens=12))]
    deltas: dict[int, list[str]] = {0: [], 3: []}
    rows[0].on_delta, rows[3].on_delta = deltas[0].append, deltas[3].append
    with pool.lock:
        slot = pool.activate("m/2")
        got = decode_batch(pool.model, pool.tokenizer, rows, [slot, slot, None, slot], pool.device, pool.eos_ids,
                           pool.mixed_batch)
    cut = greedy[:greedy.find(stop)]
    assert got[0].text == cut and got[0].finish_reason == "stop"
    assert "".join(deltas[0]) == cut, "streamed text beyond a stop string"
    assert "".join(deltas[3]) == got[3].text == greedy and len(deltas[3]) > 1
    # The same seed gives the same sample, alone or in a batch; another seed (most likely) not.
    assert got[1].text == alone(pool, "m/2", PROMPTS[1], sampled).text
    assert got[2].text == alone(pool, BASE, PROMPTS[2], sampled).text
    assert alone(pool, "m/2", PROMPTS[1], sampled).text == alone(pool, "m/2", PROMPTS[1], sampled).text
    # Temperature 0 is greedy, whatever top_p and seed say.
    assert alone(pool, "m/2", PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, top_p=0.5, seed=3)).text == greedy


def test_the_scheduler_batches_concurrent_requests_across_versions_and_within_slots(pool):
    base_dir = pool.base_dir
    small = AdapterPool(base_dir, slots=2, device="cpu")  # fewer slots than the versions asked for
    for i, key in enumerate(VERSIONS):
        small.put(key, random_adapter_files(base_dir, seed=i)[0])
    keys = [BASE, *VERSIONS]
    cases = [(keys[i % len(keys)], PROMPTS[i % len(PROMPTS)]) for i in range(16)]
    expected = [small.generate(k, p, 8) for k, p in cases]
    batches: list[tuple[int, int]] = []
    scheduler = small.scheduler(window_ms=50, max_batch=16, on_batch=lambda rows, versions: batches.append(
        (rows, versions)))
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(cases))

    def request(i: int) -> None:
        key, prompt = cases[i]
        group = Group([Row(small.tokenize(prompt), SamplingParams(max_tokens=8))], lambda: (key, key))
        barrier.wait()
        scheduler.submit(group)
        events = []
        while not events or events[-1][0] not in ("row", "error"):
            events.append(group.events.get(timeout=120))
        results[i] = events

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    scheduler.stop()
    for i, (key, prompt) in enumerate(cases):
        events = results[i]
        assert events[0] == ("start", key, key) and events[-1][0] == "row", events
        g = events[-1][2]
        assert (g.text, g.tokens) == (expected[i].text, expected[i].tokens), cases[i]
    assert sum(rows for rows, _ in batches) == len(cases)
    assert max(rows for rows, _ in batches) > 1, batches
    assert max(versions for _, versions in batches) <= 2 + 1, batches  # two slots (+ the base)


@pytest.mark.parametrize("max_wait_ms", [3000, 0], ids=["waits-for-the-rows-in-flight", "control-window-only"])
def test_after_a_batch_the_scheduler_waits_for_as_many_rows_as_were_in_flight(pool, max_wait_ms):
    """Closed-loop clients whose next requests come back a little apart join one batch, not
    cohorts that take turns; with no extra wait (the control) they split, as before."""
    batches: list[int] = []
    scheduler = pool.scheduler(window_ms=5, max_batch=16, on_batch=lambda rows, versions: batches.append(rows),
                               max_wait_ms=max_wait_ms)

    def group(prompt: str) -> Group:
        return Group([Row(pool.tokenize(prompt), SamplingParams(max_tokens=2))], lambda: ("m/1", "m/1"))

    def answered(group: Group) -> None:
        while group.events.get(timeout=120)[0] not in ("row", "error"):
            pass

    try:
        first = [group(p) for p in PROMPTS[:3]]
        for g in first:  # within microseconds: one window
            scheduler.submit(g)
        for g in first:
            answered(g)
        assert batches == [3], batches
        # The three clients send again 300 ms apart: far beyond the 5 ms window.
        second = [group(p) for p in PROMPTS[:3]]
        for i, g in enumerate(second):
            if i:
                threading.Event().wait(0.3)  # the clients' think time: the input, not a wait for state
            scheduler.submit(g)
        for g in second:
            answered(g)
        assert batches[1:] == ([3] if max_wait_ms else [1, 1, 1]), batches
    finally:
        scheduler.stop()
