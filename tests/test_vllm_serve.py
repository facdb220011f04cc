"""`streamtune serve --engine vllm`: the split, the inference log, pinned names and streaming
in front of a real vLLM server, as a user deploys it; answers equal plain PEFT's.

Versions reach the server as the job's broadcasts (`--no-registry`: aliases from the
broadcasts): v1 `candidate`, v2 `champion`, then v3 (v1's weights under a new number)
`champion` while two clients keep asking. Every answer must equal plain PEFT's greedy answer
for the version its `system_fingerprint` names, so a request answered by a half-loaded
adapter, or by a version other than the one named, fails here.

Slow for the reason tests/test_vllm.py is: vLLM's own venv (scripts/vllm_env.sh).
"""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
import requests
import torch

from test_vllm import API_KEY, MAX_TOKENS, PROMPTS, Reference, VllmServer, train_versions, vllm_python
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, wait_for, wait_for_records
from streamtune.tinymodel import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.serving, pytest.mark.slow]
TOKEN = "vllm-serve-test-token"


def broadcast(bootstrap: str, topic: str, store, model_id: str, version: int, files: dict[str, bytes],
              aliases: list[str]) -> None:
    from kafka import KafkaProducer

    from connectors.artifact_store import ArtifactStore, artifact_sha256
    from core.messages import AdapterVersionBroadcast

    sha256 = artifact_sha256(files)
    message = AdapterVersionBroadcast(
        version_id=f"{model_id}@{version}", model_id=model_id, seq=version, mlflow_version=version,
        model_uri=f"models:/{model_id}/{version}", sha256=sha256, artifact_uri=ArtifactStore(str(store)).put(files, sha256),
        aliases=aliases, registered_at=int(time.time() * 1000))
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    producer.send(topic, key=model_id.encode(), value=message.to_json().encode()).get(timeout=30)
    producer.close()


def test_serve_in_front_of_vllm_splits_logs_and_answers_each_version_as_peft(stack_config, tmp_path, unique):
    from openai import OpenAI

    from connectors.kafka import create_topic
    from core.messages import InferenceRecord

    python = vllm_python()
    torch.set_num_threads(1)
    model_id, topic, log_topic = f"vserve-{unique}", f"test.vserve-{unique}.adapter-versions", \
        f"test.vserve-{unique}.inference"
    base = build_tiny_llama(tmp_path / "tiny-llama-128", hidden_size=128, heads=4)
    vllm = VllmServer(python, base, tmp_path / "vllm.log")  # starts while the adapters train
    serve, serve_log = None, tmp_path / "serve.log"
    try:
        files = train_versions(base, tmp_path / "trained")
        reference = Reference(base)
        eos = reference.tokenizer.eos_token_id

        def text_of(ids: list[int]) -> str:  # PEFT's greedy answer as a client reads it: up to eos
            return reference.tokenizer.decode(ids[:ids.index(eos)] if eos in ids else ids, skip_special_tokens=True)

        refs = {v: {p: text_of(a[0]) for p, a in reference.answers(tmp_path / f"trained/v{v}").items()}
                for v in (1, 2)}
        refs[3] = refs[1]
        assert refs[1] != refs[2], "the versions must answer apart"
        create_topic(stack_config.kafka_bootstrap, topic)
        store = tmp_path / "store"
        broadcast(stack_config.kafka_bootstrap, topic, store, model_id, 1, files[0], ["candidate"])
        broadcast(stack_config.kafka_bootstrap, topic, store, model_id, 2, files[1], ["champion"])
        wait_for(vllm.ready, 600, "vLLM /health", interval=2)

        port = free_port()
        serve = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "serve", "--engine", "vllm", "--vllm-url", vllm.url,
             "--vllm-artifact-dir", str(tmp_path / "served"), "--port", str(port), "--base-model", str(base),
             "--artifact-store", str(store), "--bootstrap-server", stack_config.kafka_bootstrap, "--no-registry",
             "--no-auto-rollback", "--inference-log-topic", log_topic, "--broadcast-topics", re.escape(topic),
             "--candidate-fraction", "0.5", "--slots", "2"],
            serve_log, extra_env={"STREAMTUNE_API_TOKEN": TOKEN, "VLLM_API_KEY": API_KEY,
                                  "STREAMTUNE_RESPONSE_SIGNING_KEY": "", "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE": ""})
        url = f"http://127.0.0.1:{port}"

        def routed() -> bool:
            assert serve.poll() is None, serve_log.read_text()[-3000:]
            try:
                models = requests.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {TOKEN}"},
                                      timeout=5).json()["data"]
            except (requests.RequestException, ValueError, KeyError):
                return False
            return any(m["id"] == model_id and m["aliases"] == {"candidate": 1, "champion": 2} for m in models)

        wait_for(routed, 180, "streamtune serve to load v1 and v2 into vLLM and route them", interval=0.5)
        client = OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)

        def ask(model: str, prompt: str, user: str | None = None):
            r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                          user=user)
            version = int(r.system_fingerprint.rsplit("@v", 1)[1])
            return version, r.choices[0].text, r

        # The split: sticky per user, both arms taken, each answer its version's.
        seen: dict[str, int] = {}
        for i in range(16):
            user, prompt = f"user-{i}", PROMPTS[i % len(PROMPTS)]
            version, text, r = ask(model_id, prompt, user)
            assert text == refs[version][prompt], (user, version, text, refs[version][prompt])
            assert r.model_extra["streamtune"]["arm"] == {1: "candidate", 2: "champion"}[version]
            again, _, _ = ask(model_id, prompt, user)
            assert again == version, "the split is sticky per user"
            seen[user] = version
        assert set(seen.values()) == {1, 2}, f"both arms answered: {seen}"
        # Pinned names and streaming.
        for v in (1, 2):
            assert ask(f"{model_id}@v{v}", PROMPTS[0])[:2] == (v, refs[v][PROMPTS[0]])
        chunks = list(client.completions.create(model=f"{model_id}@v1", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[1][PROMPTS[1]]
        assert {c.system_fingerprint for c in chunks} == {f"{model_id}@v1"}
        # The inference log: a record per response, naming the version and arm that answered.
        records = wait_for_records(stack_config.kafka_bootstrap, log_topic, InferenceRecord, 32 + 3, 60,
                                   read_committed=False)
        by_user = {r.user: r for r in records if r.user}
        assert all(by_user[u].version == v and by_user[u].completion == refs[v][by_user[u].prompt]
                   for u, v in seen.items()), "the log names each response's version and holds its text"

        # A new champion while clients ask: loaded into vLLM before the route moves to it.
        answers: list[tuple[int, str, str]] = []
        failures: list[str] = []
        halt = threading.Event()

        def caller(prompt: str) -> None:
            while not halt.is_set():
                try:
                    version, text, _ = ask(f"{model_id}@champion", prompt)
                    answers.append((version, prompt, text))
                except Exception as e:  # noqa: BLE001 - a failed request is what this test catches
                    failures.append(repr(e))

        callers = [threading.Thread(target=caller, args=(p,), daemon=True) for p in PROMPTS[:2]]
        for t in callers:
            t.start()
        wait_for(lambda: len(answers) >= 4, 60, "answers before the move", interval=0.1)
        broadcast(stack_config.kafka_bootstrap, topic, store, model_id, 3, files[0], ["champion"])
        try:
            wait_for(lambda: sum(v == 3 for v, _, _ in answers) >= 4, 120, "v3 answering as champion", interval=0.2)
        finally:
            halt.set()
            for t in callers:
                t.join(120)
        assert not failures, failures[:5]
        assert {v for v, _, _ in answers} == {2, 3}
        wrong = [(v, p, t) for v, p, t in answers if t != refs[v][p]]
        assert not wrong, f"answers unlike their version's: {wrong[:5]}"
        # --slots 2: at most two of the model's versions stay loaded in vLLM, the newest among them.
        loaded = requests.get(f"{vllm.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=10).json()["data"]
        names = {m["id"] for m in loaded if m.get("parent")}
        assert f"{model_id}@v3" in names and len({n for n in names if n.startswith(model_id)}) <= 2, names
    finally:
        if serve is not None and serve.poll() is None:
            kill_group(serve)
        vllm.stop()
