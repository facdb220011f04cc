"""Batched decoding for the adapter pool: concurrent requests, for one or several adapter
versions, share forward passes.

`decode_batch` runs ONE decode loop over several rows: prompts left-padded with an attention
mask and position ids counted from the mask (so padding changes no row's result: what
Hugging Face's `generate` does for Llama with left padding), a KV cache, and PEFT's
mixed-adapter batch (`adapter_names`, one slot or "__base__" per row) when the rows use
different versions (or, given the pool's `mixed_batch`, one gathered batched matmul per LoRA
layer over the pool's stacked slots: a batch of 8 versions then costs about what a batch of
one does). Each row has its own max_tokens, temperature (0: greedy argmax), top_p,
seed (its own torch.Generator), stop strings and eos; a finished row stops emitting while
the others go on.

`BatchScheduler` is the thread that forms batches: it collects pending groups (one group is
one HTTP request: its prompts × n choices, all from one version) for `window_ms` (or until
`max_batch` rows). Under closed-loop load (clients that send their next request as an answer
comes back) a 5 ms window splits the clients into cohorts that take turns, each waiting out
the other's batch; so right after a batch, the scheduler expects as many rows as were in
flight when it ended (the batch plus those queued meanwhile) and waits up to `max_wait_ms`
for them. A lone client gets only the window. Then, holding the pool's lock, resolves each group's route (the group's
`resolve` callback), activates each distinct version into a slot (a batch never needs more
versions than the pool has slots: the rest wait for the next batch) and decodes. Route
resolution and generation happen under the same lock hold, so a route moved under that
lock (a swap's acknowledgement) is seen by every later batch and by none in flight.

Events a group receives on its queue, in order:
    ("retry", NotReady)                  its version is not in the pool: load it, submit again
    ("error", exception)                 nothing was generated
    ("start", version_key, route)        resolved; decoding starts
    ("delta", row, text)                 decoded text of a streaming row, as it comes
    ("row", row, RowResult)              a row finished
"""

from __future__ import annotations

import functools
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from core.routing import BASE

log = logging.getLogger("streamtune.batching")
BASE_ROW = "__base__"  # peft's name of a row without an adapter in a mixed batch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0
    seed: Optional[int] = None   # None: a fresh random seed
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class RowResult:
    text: str
    token_ids: list[int]         # generated, without eos
    logprobs: list[float]        # of every chosen token, eos included (stopping is a choice)
    finish_reason: str           # "stop" (eos or a stop string) or "length"
    prompt_tokens: int

    @property
    def tokens(self) -> int:
        return len(self.token_ids)

    @property
    def mean_logprob(self) -> float:
        return round(sum(self.logprobs) / len(self.logprobs), 6) if self.logprobs else 0.0


@dataclass
class Row:
    """One sequence to decode: its prompt's token ids and sampling parameters. `on_delta`
    (optional) receives the decoded text as it grows (never text a stop string may still take back)."""

    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    on_delta: Optional[Callable[[str], None]] = None


class NotReady(Exception):
    """Raised by a group's `resolve` when its version is not in the pool yet: the group is
    handed back (event "retry") to be loaded outside the lock and submitted again."""

    def __init__(self, payload: Any = None):
        super().__init__("version not loaded")
        self.payload = payload


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of `text` may still begin a stop string (or an unfinished
    multi-byte character): not to be streamed yet."""
    hold = 1 if text.endswith("\ufffd") else 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


def _first_stop(text: str, stops: tuple[str, ...]) -> int:
    at = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(at) if at else -1


@torch.no_grad()
def decode_batch(model, tokenizer, rows: list[Row], adapters: list[Optional[str]], device: torch.device,
                 eos_ids: set[int], mixed: Optional[Callable] = None) -> list[RowResult]:
    """Decode `rows` together; `adapters[i]` is row i's slot (None: the base). `model` is the
    PeftModel; call with the pool's lock held. `mixed(adapters)`, when given, is the context
    in which a batch of several slots decodes (AdapterPool.mixed_batch); without it, peft's
    `adapter_names`."""
    return list(iter_decode(model, tokenizer, rows, adapters, device, eos_ids, lambda i, r: None, mixed))


def iter_decode(model, tokenizer, rows: list[Row], adapters: list[Optional[str]], device: torch.device,
                eos_ids: set[int], on_row: Callable[[int, RowResult], None],
                mixed: Optional[Callable] = None) -> list[RowResult]:
    """`decode_batch`, calling `on_row(i, result)` as each row finishes; returns results in order."""
    with torch.no_grad():
        return _decode(model, tokenizer, rows, adapters, device, eos_ids, on_row, mixed)


def _decode(model, tokenizer, rows, adapters, device, eos_ids, on_row, mixed):
    b = len(rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else next(iter(eos_ids))
    lengths = [len(r.prompt_ids) for r in rows]
    width = max(lengths)
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - lengths[i]:] = torch.tensor(r.prompt_ids, dtype=torch.long)
        mask[i, width - lengths[i]:] = 1
    ids, mask = ids.to(device), mask.to(device)

    # One adapter for every row: the plain forward; several: peft's mixed batch.
    distinct = set(adapters)
    kwargs: dict = {}
    context = None
    if distinct == {None}:
        context = model.disable_adapter()
    elif len(distinct) == 1:
        model.set_adapter(next(iter(distinct)))
    elif mixed is not None:
        context = mixed(adapters)
    else:
        kwargs["adapter_names"] = [a if a is not None else BASE_ROW for a in adapters]

    generators = []
    for r in rows:
        g = None
        if r.params.temperature > 0:
            g = torch.Generator(device=device)
            g.manual_seed(r.params.seed if r.params.seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        generators.append(g)
    greedy = torch.tensor([r.params.temperature <= 0 for r in rows], device=device)
    streams = [r.on_delta is not None or bool(r.params.stop) for r in rows]

    chosen: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[float]] = [[] for _ in rows]
    sent = [0] * b                       # characters already streamed
    results: list[Optional[RowResult]] = [None] * b
    steps = max(r.params.max_tokens for r in rows)

    def finish(i: int, text: str, reason: str) -> None:
        r = rows[i]
        if r.on_delta is not None and len(text) > sent[i]:
            r.on_delta(text[sent[i]:])
            sent[i] = len(text)
        results[i] = RowResult(text, [t for t in chosen[i] if t not in eos_ids and t != pad], logprobs[i], reason,
                               lengths[i])
        on_row(i, results[i])

    past = None
    cache_kw = _cache_argument(type(model.get_base_model()))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_ids = ids
    with (context if context is not None else _nothing()):
        for step in range(steps):
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{cache_kw: past}, **kwargs)
            past = getattr(out, cache_kw)
            logits = out.logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1)
            picks = logits.argmax(dim=-1)
            if not bool(greedy.all()):
                for i, r in enumerate(rows):
                    if results[i] is not None or generators[i] is None:
                        continue
                    probs = torch.softmax(logits[i] / r.params.temperature, dim=-1)
                    if r.params.top_p < 1.0:
                        sorted_p, order = probs.sort(descending=True)
                        keep = sorted_p.cumsum(-1) - sorted_p < r.params.top_p   # the nucleus, top token always
                        sorted_p = sorted_p * keep
                        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
                    picks[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
            picked = picks.tolist()
            picked_logp = logp.gather(1, picks[:, None])[:, 0].tolist()
            for i, r in enumerate(rows):
                if results[i] is not None:
                    continue
                token = picked[i]
                chosen[i].append(token)
                logprobs[i].append(picked_logp[i])
                ended = token in eos_ids
                full = len(chosen[i]) >= r.params.max_tokens
                if not (streams[i] or ended or full):
                    continue
                text = tokenizer.decode([t for t in chosen[i] if t not in eos_ids], skip_special_tokens=True)
                if r.params.stop:
                    at = _first_stop(text, r.params.stop)
                    if at >= 0:
                        finish(i, text[:at], "stop")
                        continue
                if ended or full:
                    finish(i, text, "stop" if ended else "length")
                    continue
                if r.on_delta is not None:
                    ready = len(text) - _held_back(text, r.params.stop)
                    if ready > sent[i]:
                        r.on_delta(text[sent[i]:ready])
                        sent[i] = ready
            if all(x is not None for x in results):
                break
            step_ids = picks[:, None]
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
            positions = mask.sum(-1, keepdim=True) - 1
    return results


@functools.lru_cache(maxsize=None)
def _cache_argument(model_class) -> str:
    """The KV cache's name in the model's forward: `cache` (transformers 5), else `past_key_values`."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# -- the scheduler --------------------------------------------------------------------------
@dataclass
class Group:
    """One request: rows decoded together, from the one version `resolve` names.

    `resolve()` is called with the pool's lock held, right before the batch decodes; it
    returns (version_key, route) — route is passed back in the "start" event — or raises
    (NotReady: load and submit again; anything else: the request's error)."""

    rows: list[Row]
    resolve: Callable[[], tuple[str, Any]]
    events: "queue.Queue" = field(default_factory=queue.Queue)


class BatchScheduler:
    def __init__(self, pool, window_ms: float = 5.0, max_batch: int = 16,
                 on_batch: Optional[Callable[[int, int], None]] = None, max_wait_ms: float = 50.0):
        if max_batch < 1 or window_ms < 0 or max_wait_ms < 0:
            raise ValueError("max_batch must be at least 1, window_ms and max_wait_ms at least 0")
        self.pool, self.window_s, self.max_batch = pool, window_ms / 1000.0, max_batch
        self.max_wait_s = max(max_wait_ms, window_ms) / 1000.0
        self._expected = 1              # rows in flight when the last batch ended: the next batch's aim
        self.on_batch = on_batch      # (rows, distinct versions) of each batch decoded
        self._queue: "queue.Queue[Optional[Group]]" = queue.Queue()
        self._waiting: list[Group] = []  # left for the next batch (too many rows or versions)
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start_lock = threading.Lock()
        self.batches = 0

    def submit(self, group: Group) -> Group:
        if self._stopped.is_set():
            raise RuntimeError("the batch scheduler is stopped")
        self._ensure_started()
        self._queue.put(group)
        return group

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(10)

    def _collect(self) -> list[Group]:
        pending = self._waiting
        self._waiting = []
        if not pending:
            first = self._queue.get()
            if first is None:
                return []
            pending.append(first)
        started = time.monotonic()
        window, longest = started + self.window_s, started + self.max_wait_s
        aim = min(self.max_batch, self._expected)
        while (rows := sum(len(g.rows) for g in pending)) < self.max_batch:
            left = (window if rows >= aim else longest) - time.monotonic()
            try:
                group = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if group is None:
                break
            pending.append(group)
        return pending

    def _run(self) -> None:
        while not self._stopped.is_set():
            pending = self._collect()
            if not pending:
                continue
            try:
                decoded = self._batch(pending)
            except Exception:  # never lose the thread: the groups got their error
                log.exception("batch failed")
                decoded = 0
            self._expected = max(1, decoded + self._queued_rows())

    def _queued_rows(self) -> int:
        """Rows waiting now: the groups left over and those queued while the batch decoded
        (moved to `_waiting`, in order, to count them)."""
        while True:
            try:
                group = self._queue.get_nowait()
            except queue.Empty:
                break
            if group is None:  # stop(): put it back for _collect
                self._queue.put(None)
                break
            self._waiting.append(group)
        return sum(len(g.rows) for g in self._waiting)

    def _batch(self, pending: list[Group]) -> int:
        """Decode what fits of `pending` as one batch; the rows decoded."""
        pool = self.pool
        with pool.lock:
            chosen: list[tuple[Group, str, Any]] = []
            keys: list[str] = []
            rows = 0
            for group in pending:
                if chosen and rows + len(group.rows) > self.max_batch:
                    self._waiting.append(group)
                    continue
                try:
                    key, route = group.resolve()
                except NotReady as e:
                    group.events.put(("retry", e))
                    continue
                except Exception as e:
                    group.events.put(("error", e))
                    continue
                versions = {k for k in keys if k != BASE}
                if key != BASE and key not in versions and len(versions) >= len(pool.slot_names):
                    self._waiting.append(group)  # resolved again, under the lock, in the next batch
                    continue
                if key not in keys:
                    keys.append(key)
                chosen.append((group, key, route))
                rows += len(group.rows)
            if not chosen:
                return 0
            slots: dict[str, Optional[str]] = {}
            started = []
            for group, key, route in chosen:
                try:
                    if key not in slots:
                        slots[key] = pool.activate(key)
                except Exception as e:  # evicted from the CPU cache since: nothing generated
                    group.events.put(("error", e))
                    continue
                started.append((group, key, route))
            batch_rows: list[Row] = []
            adapters: list[Optional[str]] = []
            owners: list[tuple[Group, int]] = []
            for group, key, route in started:
                group.events.put(("start", key, route))
                for j, row in enumerate(group.rows):
                    batch_rows.append(row)
                    adapters.append(slots[key])
                    owners.append((group, j))
            if not batch_rows:
                return 0
            self.batches += 1
            if self.on_batch is not None:
                self.on_batch(len(batch_rows), len(slots))

            def on_row(i: int, result: RowResult) -> None:
                group, j = owners[i]
                group.events.put(("row", j, result))

            try:
                iter_decode(pool.model, pool.tokenizer, batch_rows, adapters, pool.device, pool.eos_ids, on_row,
                            pool.mixed_batch)
            except Exception as e:
                log.exception("decoding a batch of %d rows failed", len(batch_rows))
                for group, _, _ in started:
                    group.events.put(("error", e))
            return len(batch_rows)
