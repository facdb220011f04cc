"""`streamtune follow`, the sidecar a user deploys beside vLLM: versions registered in MLflow
and broadcast on Kafka are answered by a real vLLM server, by name, through the official
`openai` client, token for token as plain PEFT answers them; a restarted vLLM gets every
alias again without anyone moving one.

Slow for the reason tests/test_vllm.py is: vLLM's own venv (scripts/vllm_env.sh).
"""

from __future__ import annotations

import re
import signal
import sys
import time
import uuid

import pytest
import requests
import torch

from test_vllm import API_KEY, MAX_TOKENS, PROMPTS, Reference, VllmServer, same_answer, train_versions, vllm_python
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, wait_for
from streamtune.tinymodel import build_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.serving, pytest.mark.slow]


def register(stack_config, model_id: str, topic: str, store, base, seq: int, files: dict[str, bytes]) -> None:
    """Version `seq` as the job emits it, through the registrar: MLflow version, champion
    (promoted by its gate), broadcast on `<topic>.adapter-versions`."""
    from kafka import KafkaProducer

    from connectors.artifact_store import ArtifactStore, artifact_sha256
    from core.messages import VersionRecord
    from streamtune.registrar import Registrar, RegistrarConfig

    sha256 = artifact_sha256(files)
    record = VersionRecord.model_validate({
        "version_id": f"{model_id}@{seq}", "model_id": model_id, "seq": seq,
        "window_start": 2_000 * seq, "window_end": 2_000 * seq + 1_999,
        "artifact_uri": ArtifactStore(str(store)).put(files, sha256), "sha256": sha256,
        "base_model": str(base), "config_version": 1, "fresh_adapter": seq == 1,
        "adapter": {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.0},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 2},
        "metrics": {"loss_before": 3.0, "loss_after": 2.0 - seq * 0.1, "samples": 64, "tokens": 640,
                    "step_seconds": 1.0},
        "lineage": {"sample_ids": [f"s{seq}"], "offsets": [{"topic": topic, "partition": 0, "first": seq,
                                                           "last": seq}]},
        "trigger": "window",
        "gate": {"promote": True, "rule": "first_version" if seq == 1 else "eval", "metric": "exact_match",
                 "reason": "test", "sets": [], "champion_version_id": None if seq == 1 else f"{model_id}@{seq - 1}"}})
    config = RegistrarConfig(bootstrap=stack_config.kafka_bootstrap, tracking_uri=stack_config.mlflow_uri,
                             versions_topic=f"{topic}.versions", broadcast_topic=f"{topic}.adapter-versions",
                             group_id=f"test-follow-{uuid.uuid4().hex[:8]}", artifact_store=str(store))
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
    producer.send(config.versions_topic, key=model_id.encode(), value=record.to_json().encode()).get(timeout=30)
    producer.close()
    with Registrar(config) as registrar:
        deadline = time.monotonic() + 90
        while registrar.counts["seen"] < seq:  # every record so far, this one last
            assert time.monotonic() < deadline, f"the registrar saw too little: {registrar.counts}"
            registrar.poll_once(500)


def test_follow_keeps_vllm_answering_each_champion_as_peft_does_across_a_vllm_restart(
        stack_config, tmp_path, unique):
    from openai import OpenAI

    python = vllm_python()
    torch.set_num_threads(1)
    model_id, topic, store = f"vfollow-{unique}", f"test.vfollow-{unique}", tmp_path / "adapters"
    base = build_tiny_llama(tmp_path / "tiny-llama-128", hidden_size=128, heads=4)
    server = VllmServer(python, base, tmp_path / "vllm.log")  # starts while the adapters train
    follow, follow_log, status_port = None, tmp_path / "follow.log", free_port()
    status = f"http://127.0.0.1:{status_port}"
    try:
        files = train_versions(base, tmp_path / "trained")
        reference = Reference(base)
        refs = {1: reference.answers(tmp_path / "trained/v1"), 2: reference.answers(tmp_path / "trained/v2")}
        assert any(not same_answer(refs[1][p], refs[2][p]) for p in PROMPTS), "the versions must answer apart"
        wait_for(server.ready, 600, "vLLM /health", interval=2)

        follow = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "follow", "--vllm-url", server.url,
             "--artifact-dir", str(tmp_path / "served"), "--artifact-store", str(store),
             "--bootstrap-server", stack_config.kafka_bootstrap, "--tracking-uri", stack_config.mlflow_uri,
             "--broadcast-topics", re.escape(f"{topic}.adapter-versions"), "--port", str(status_port),
             "--check-seconds", "1"],
            follow_log, extra_env={"VLLM_API_KEY": API_KEY})

        def readyz() -> dict | None:
            assert follow.poll() is None, f"streamtune follow exited {follow.returncode}:\n{follow_log.read_text()}"
            try:
                r = requests.get(f"{status}/readyz", timeout=2)
            except requests.RequestException:
                return None
            return r.json() if r.status_code == 200 else None

        wait_for(readyz, 120, "streamtune follow ready", interval=0.5)
        client = OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)

        def answers(model: str) -> dict | None:
            out = {}
            for prompt in PROMPTS:
                try:
                    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                                  logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
                except Exception:  # not loaded yet: NotFoundError
                    return None
                choice = r.choices[0]
                out[prompt] = (choice.model_extra["token_ids"], choice.logprobs.token_logprobs)
            return out

        def answering_as(model: str, version: int):
            got = answers(model)
            return got is not None and all(same_answer(got[p], refs[version][p]) for p in PROMPTS)

        for version in (1, 2):
            register(stack_config, model_id, topic, store, base, version, files[version - 1])
            wait_for(lambda: answering_as(f"{model_id}@champion", version), 120,
                     f"vLLM to answer {model_id}@champion as PEFT v{version}", interval=1)
            assert answering_as(f"{model_id}@v{version}", version), "the pinned name answers its version"
            assert answering_as(model_id, version), "the bare model id is the champion"

        # vLLM restarts and forgets every adapter: the sidecar notices and loads them again.
        port = server.port
        server.stop()
        wait_for(lambda: (r := requests.get(f"{status}/readyz", timeout=2)).status_code == 503 and r.json()["reason"],
                 60, "/readyz to say vLLM is gone", interval=0.5)
        server = VllmServer(python, base, tmp_path / "vllm-2.log", port=port)
        wait_for(server.ready, 600, "the restarted vLLM /health", interval=2)
        ready = wait_for(readyz, 120, "streamtune follow ready again", interval=0.5)
        assert ready["resyncs"] >= 1, ready
        assert answering_as(f"{model_id}@champion", 2) and answering_as(model_id, 2), "after the restart: v2 again"

        follow.send_signal(signal.SIGTERM)
        assert follow.wait(timeout=30) == 0, follow_log.read_text()[-2000:]
    finally:
        if follow is not None and follow.poll() is None:
            kill_group(follow)
        server.stop()
