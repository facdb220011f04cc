"""`streamtune serve --engine vllm`: the same server in front of a vLLM OpenAI server.

Everything that decides *which* version answers stays in streamtune serve: the routes
acknowledged from the broadcasts and the registry, the champion/candidate split, the guard, the
decision layer, the inference log, the audit trace, the tokens and scopes. Only the decoding
moves to vLLM, which batches continuously on its own device. Two pieces take the in-process
pool's place, with the interface served.py uses:

- `VllmPool` holds the base's tokenizer (for prompt ids, usage and the chat template; no
  weights are loaded here) and the versions loaded into vLLM. `put` writes a version's checked
  files where vLLM reads them and loads them under the immutable name `<model_id>@v<N>`
  (connectors/vllm_target.py) before the route may move to it, so no request meets a
  half-loaded adapter. At most `slots` versions stay loaded (least recently used first out,
  never one with a request in flight); one unloaded since is loaded again on its next request.
- `VllmScheduler` resolves each request's route under the pool's lock, as the batch scheduler
  does, then sends its rows to vLLM by that pinned name, streaming when the client streams.
  A response is produced by exactly one version, the one `system_fingerprint` names, even when
  an alias moves while it decodes: vLLM is never asked for a moving alias name.

    streamtune serve --engine vllm --vllm-url http://vllm:8000 --vllm-artifact-dir /shared/adapters

vLLM needs `--enable-lora`, `--max-lora-rank` at least the adapters' rank,
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` and `--max-cpu-loras` at least `--slots`; the artifact
directory is a volume both processes mount. `--base-model` names a directory with the base's
tokenizer and config (the same base vLLM serves).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

from connectors.vllm_target import VllmTarget
from core.errors import ServiceUnavailable
from core.routing import BASE, pinned_name
from operators.adapter_pool import base_fingerprint
from operators.batched_decoding import Group, NotReady, Row, RowResult

log = logging.getLogger("streamtune.serve.vllm")


class VersionGone(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def _split_key(key: str) -> tuple[str, int]:
    model_id, version = key.rsplit("/", 1)
    return model_id, int(version)


class VllmPool:
    """The versions loaded into one vLLM server, behind the in-process pool's interface."""

    def __init__(self, base_model: str, target: VllmTarget, slots: int = 8):
        from transformers import AutoTokenizer

        self.base_dir, self.target, self.slots = Path(base_model), target, slots
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_dir, local_files_only=True)
        self.base_fingerprint = base_fingerprint(self.base_dir)
        self.eos_ids = {self.tokenizer.eos_token_id} - {None}
        self.lock = threading.RLock()
        self._loaded: OrderedDict[str, str] = OrderedDict()  # pool key -> vLLM name, least recent first
        self._in_flight: dict[str, int] = {}
        self.last_swap_seconds = 0.0
        self._base_name: Optional[str] = None

    def base_name(self) -> str:
        if self._base_name is None:
            self._base_name = self.target.base_model()
        return self._base_name

    def put(self, version_key: str, files: dict[str, bytes], sha256: Optional[str] = None) -> str:
        """Check the version's files whole, then load them into vLLM (outside the lock: a load
        takes a while, and requests for other versions go on meanwhile)."""
        from connectors.artifact_store import verify_artifact

        if sha256 is not None:
            files = verify_artifact(files, sha256, version_key)
        model_id, version = _split_key(version_key)
        started = time.perf_counter()
        name = self.target.load_version(model_id, version, files)
        self.last_swap_seconds = time.perf_counter() - started
        with self.lock:
            self._loaded[version_key] = name
            self._loaded.move_to_end(version_key)
            self._evict()
        return name

    def _evict(self) -> None:
        for key in [k for k in self._loaded if not self._in_flight.get(k)][:max(0, len(self._loaded) - self.slots)]:
            name = self._loaded.pop(key)
            try:
                self.target.unload(name)
            except Exception as e:  # still loaded in vLLM: harmless, it is loaded again by name
                log.warning("could not unload %s from vLLM: %s", name, e)

    def has(self, version_key: str) -> bool:
        with self.lock:
            return version_key == BASE or version_key in self._loaded

    def hot(self) -> list[str]:
        with self.lock:
            return list(self._loaded)

    def activate(self, version_key: str) -> Optional[str]:
        """Mark the version most recently used (call with `lock` held); its vLLM name."""
        if version_key == BASE:
            return None
        self._loaded.move_to_end(version_key)
        return self._loaded[version_key]

    def tokenize(self, prompt: str) -> list[int]:
        ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise ValueError("the prompt is empty (no tokens)")
        return list(ids)

    def begin(self, version_key: str) -> str:
        """A request starts on the version (hold `lock`): its vLLM name; not evicted until `end`."""
        self._in_flight[version_key] = self._in_flight.get(version_key, 0) + 1
        return self.base_name() if version_key == BASE else self.activate(version_key)

    def forget(self, name: str) -> None:
        """vLLM no longer lists `name` (it restarted): load it again when next asked for."""
        with self.lock:
            for key in [k for k, n in self._loaded.items() if n == name]:
                del self._loaded[key]

    def end(self, version_key: str) -> None:
        with self.lock:
            self._in_flight[version_key] -= 1
            if not self._in_flight[version_key]:
                del self._in_flight[version_key]

    def scheduler(self, window_ms: float = 5.0, max_batch: int = 16, on_batch=None,
                  max_wait_ms: float = 50.0) -> "VllmScheduler":
        # vLLM batches continuously on its own: no window here, one worker thread per row in flight.
        return VllmScheduler(self, max_concurrency=max(64, 4 * max_batch))


class VllmScheduler:
    """Requests to vLLM by pinned version name, each row its own (streamed) completion."""

    def __init__(self, pool: VllmPool, max_concurrency: int = 64):
        self.pool = pool
        # Requests wait on their rows; rows only talk to vLLM: two pools, so none waits on itself.
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-request")
        self._rows = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="vllm-row")
        self._stopped = False
        self.batches = 0

    def submit(self, group: Group) -> Group:
        if self._stopped:
            raise RuntimeError("the scheduler is stopped")
        self._executor.submit(self._run, group)
        return group

    def stop(self) -> None:
        self._stopped = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._rows.shutdown(wait=False, cancel_futures=True)

    def _run(self, group: Group) -> None:
        pool = self.pool
        with pool.lock:
            try:
                key, route = group.resolve()
                name = pool.begin(key)
            except NotReady as e:
                group.events.put(("retry", e))
                return
            except Exception as e:
                group.events.put(("error", e))
                return
        try:
            group.events.put(("start", key, route))
            rows = [self._rows.submit(self._row, group, j, row, name) for j, row in enumerate(group.rows[1:], 1)]
            if group.rows:
                self._row(group, 0, group.rows[0], name)  # the first on this thread
            for future in rows:
                future.result()
        finally:
            pool.end(key)

    def _row(self, group: Group, j: int, row: Row, name: str) -> None:
        try:
            group.events.put(("row", j, self.complete(name, row)))
        except VersionGone as e:
            self.pool.forget(e.name)
            group.events.put(("error", ServiceUnavailable(f"vLLM no longer serves {e.name} (restarted?): "
                                                          "it is loaded again for the next request")))
        except Exception as e:
            group.events.put(("error", e))

    def complete(self, name: str, row: Row) -> RowResult:
        """One row through vLLM's /v1/completions: its text, token ids and log-probabilities."""
        p = row.params
        body = {"model": name, "prompt": row.prompt_ids, "max_tokens": p.max_tokens, "temperature": p.temperature,
                "top_p": p.top_p, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True}
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        stream = row.on_delta is not None
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        target = self.pool.target
        try:
            response = target.session.post(f"{target.base_url}/v1/completions", json=body, timeout=target.timeout,
                                           stream=stream)
        except Exception as e:
            raise ServiceUnavailable(f"vLLM at {target.base_url} unreachable: {type(e).__name__}: {e}") from e
        if response.status_code >= 400:
            message = response.text[:300]
            if response.status_code == 404:  # unloaded behind our back (a vLLM restart)
                raise VersionGone(name)
            raise ServiceUnavailable(f"vLLM answered {response.status_code}: {message}")
        text, token_ids, logprobs, finish, prompt_tokens = "", [], [], "length", len(row.prompt_ids)
        chunks = _sse_payloads(response) if stream else [response.json()]
        for chunk in chunks:
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") or ""
                if piece:
                    text += piece
                    if stream:
                        row.on_delta(piece)
                token_ids += choice.get("token_ids") or []
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage")
            if usage:
                prompt_tokens = usage.get("prompt_tokens", prompt_tokens)
        token_ids = [t for t in token_ids if t not in self.pool.eos_ids]
        return RowResult(text, token_ids, [float(x) for x in logprobs if x is not None], finish, prompt_tokens)


def _sse_payloads(response):
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            raise ServiceUnavailable(f"vLLM: {payload['error']}")
        yield payload
