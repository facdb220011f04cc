"""Whole-artifact integrity: a version is every file of its artifact, not its weights alone.

A real adapter version is written through the store, then one file is changed behind its back:
one byte of `adapter_config.json` (lora_alpha 8 -> 9), one byte of the weights, or a file the
writer never wrote added beside them. Registration (the job's RegistrationFunction, driven
directly against the stack's MLflow) must dead-letter it (`artifact_integrity`) naming the
file, and `streamtune serve` (a real process following a real broadcast topic) must answer
409 `version refused` naming the file; the untouched version registers and serves.

Each test runs twice: with the defence (the address is the sha256 of manifest.json, which
lists every file) and with it off (`STREAMTUNE_ARTIFACT_ADDRESS=weights`, the old rule: the
address is the weights' sha256, for tests/demo only). With it off the changed config and the
extra file get through, registered and served: the suite itself shows the test can fail.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import requests

from connectors.artifact_store import ADDRESS_RULE_ENV, WEIGHTS, ArtifactStore, artifact_sha256
from core.messages import AdapterVersionBroadcast, DeadLetter, VersionRecord
from core.messages.version import EXAMPLE
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import InMemoryRuntimeContext, KeyedTimers, free_port, wait_for

pytestmark = [pytest.mark.security]

TOKEN = "integrity-inference-token"
CONFIG = "adapter_config.json"
EXTRA = "notes.txt"


def change_config(folder: Path) -> str:
    data = (folder / CONFIG).read_bytes()
    assert data.count(b'"lora_alpha": 8') == 1, data
    (folder / CONFIG).write_bytes(data.replace(b'"lora_alpha": 8', b'"lora_alpha": 9'))  # one byte
    return CONFIG


def change_weights(folder: Path) -> str:
    data = bytearray((folder / WEIGHTS).read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor value: still a readable safetensors file
    (folder / WEIGHTS).write_bytes(bytes(data))
    return WEIGHTS


def add_file(folder: Path) -> str:
    (folder / EXTRA).write_bytes(b"not written by the trainer")
    return EXTRA


TAMPERING = {"untouched": None, "config": change_config, "weights": change_weights, "extra": add_file}
# What gets through with the defence off (the old weights-only rule): all but changed weights.
PASSES_WITHOUT_DEFENCE = {"untouched", "config", "extra"}


@pytest.fixture(params=["manifest", "weights_only"])
def rule(request, monkeypatch) -> str:
    """The address rule: "manifest" (the defence) or "weights_only" (the defence off)."""
    if request.param == "weights_only":
        monkeypatch.setenv(ADDRESS_RULE_ENV, "weights")
    else:
        monkeypatch.delenv(ADDRESS_RULE_ENV, raising=False)
    return request.param


def expected_to_pass(rule: str, tampering: str) -> bool:
    return tampering == "untouched" if rule == "manifest" else tampering in PASSES_WITHOUT_DEFENCE


@pytest.fixture(scope="module")
def adapter(base_model) -> dict[str, bytes]:
    """A PEFT LoRA artifact of the tiny base (rank 4, alpha 8, q/v), as the trainer writes it."""
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save as save_safetensors
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                        task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_model), config)
    weights = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    peft_config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in model.peft_config["default"].to_dict().items()}
    return {"weights": weights, CONFIG: json.dumps(peft_config).encode()}


def versions_in_store(adapter: dict, store: ArtifactStore) -> dict[str, tuple[str, str, str | None]]:
    """One real version per tampering (own weights each), written through the store, then
    tampered with: {tampering: (artifact_uri, sha256, the file changed)}."""
    from safetensors.torch import save as save_safetensors

    out = {}
    for i, (name, tamper) in enumerate(TAMPERING.items(), start=1):
        weights = save_safetensors({k: v * (1 + i / 10) for k, v in adapter["weights"].items()})
        files = {CONFIG: adapter[CONFIG], WEIGHTS: weights}
        sha256 = artifact_sha256(files)  # under the rule the fixture set
        uri = store.put(files, sha256)
        changed = tamper(Path(uri.removeprefix("file://"))) if tamper else None
        out[name] = (uri, sha256, changed)
    return out


def test_same_weights_with_another_config_is_another_version(rule, adapter, tmp_path):
    """Equal weights, another alpha: with the defence, another address and each reader its own
    config; without it (the weights name the version) the second config is silently lost."""
    from safetensors.torch import save as save_safetensors

    store = ArtifactStore(str(tmp_path / "store"))
    weights = save_safetensors(adapter["weights"])
    first = {CONFIG: adapter[CONFIG], WEIGHTS: weights}
    second = {CONFIG: adapter[CONFIG].replace(b'"lora_alpha": 8', b'"lora_alpha": 64'), WEIGHTS: weights}
    uri_first = store.put(first, artifact_sha256(first))
    uri_second = store.put(second, artifact_sha256(second))
    read_back = store.get(uri_second, artifact_sha256(second))[CONFIG]
    if rule == "manifest":
        assert uri_first != uri_second and read_back == second[CONFIG]
    else:  # the defence off: the old address rule reuses the first version's config
        assert uri_first == uri_second and read_back == first[CONFIG]


# -- registration --------------------------------------------------------------------------
def register(stack_config, store: ArtifactStore, records: list[VersionRecord]) -> tuple[list[str], list[DeadLetter]]:
    """The job's registration operator, in order, as Flink drives it: (broadcast JSONs, dead letters)."""
    from pyflink.datastream import TimeDomain

    from operators.registration import RegistrationFunction
    from operators.validate import DLQ_TAG

    fn = RegistrationFunction(stack_config.mlflow_uri, store.uri)
    fn.open(InMemoryRuntimeContext())
    ctx = KeyedTimers(records[0].model_id, now_ms=1_000)
    out: list = []
    try:
        for offset, record in enumerate(records):
            out += fn.process_element((record.model_id, record.to_json(), "versions", 0, offset, offset), ctx)
        deadline = time.monotonic() + 120
        while fn.queue.value():  # each poll finds the head registered, refused, or still running
            assert time.monotonic() < deadline, f"registration stuck: {len(fn.queue.value())} queued"
            ctx.now_ms = max(ctx.processing_timers, default=ctx.now_ms)
            ctx.domain = TimeDomain.PROCESSING_TIME
            for due in ctx.due_processing_timers():
                out += fn.on_timer(due, ctx)
            time.sleep(0.02)  # polling the registration thread, as the operator's own timer does
    finally:
        fn.close()
    assert fn.counters._counters["registration_retries"].count == 0, "MLflow failed: not what is tested here"
    broadcasts = [o for o in out if isinstance(o, str)]
    dead = [DeadLetter.from_json(o[1]) for o in out if isinstance(o, tuple) and o[0] == DLQ_TAG]
    return broadcasts, dead


def test_registration_dead_letters_a_changed_file_by_name(rule, adapter, stack_config, tmp_path, unique):
    store = ArtifactStore(str(tmp_path / "store"))
    model_id = f"integrity-{unique}"
    stored = versions_in_store(adapter, store)
    records = [VersionRecord.model_validate({
        **EXAMPLE, "version_id": f"{model_id}@{seq}", "model_id": model_id, "seq": seq,
        "window_start": seq * 1000, "window_end": seq * 1000 + 999, "artifact_uri": uri, "sha256": sha256,
        "fresh_adapter": seq == 1, "metrics": {**EXAMPLE["metrics"], "loss_after": 1.0}})
        for seq, (uri, sha256, _) in enumerate(stored.values(), start=1)]
    broadcasts, dead = register(stack_config, store, records)

    by_version = {r.version_id: name for r, name in zip(records, stored)}
    registered = {by_version[AdapterVersionBroadcast.from_json(b).version_id] for b in broadcasts}
    refused = {by_version[VersionRecord.from_json(d.payload).version_id]: d for d in dead}
    assert registered == {name for name in stored if expected_to_pass(rule, name)}, (registered, refused)
    assert set(refused) == set(stored) - registered
    for name, letter in refused.items():
        assert (letter.reason, letter.kind) == ("artifact_integrity", "version")
        assert stored[name][2] in letter.detail, f"the dead letter names the file: {letter.detail}"
    if rule == "weights_only":  # the defence off: the changed config was registered as it is
        assert {"config", "extra"} <= registered


# -- serving -------------------------------------------------------------------------------
def publish_broadcasts(bootstrap: str, topic: str, model_id: str, stored: dict) -> dict[str, int]:
    """Each stored version announced as registered (MLflow version = seq): {tampering: version}."""
    from kafka import KafkaProducer

    from connectors.kafka import create_topic

    create_topic(bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    versions = {}
    for seq, (name, (uri, sha256, _)) in enumerate(stored.items(), start=1):
        broadcast = AdapterVersionBroadcast(version_id=f"{model_id}@{seq}", model_id=model_id, seq=seq,
                                            mlflow_version=seq, model_uri=f"models:/{model_id}/{seq}", sha256=sha256,
                                            artifact_uri=uri, aliases=[], registered_at=int(time.time() * 1000))
        producer.send(topic, key=model_id.encode(), value=broadcast.to_json().encode())
        versions[name] = seq
    producer.flush()
    producer.close()
    return versions


def test_serving_answers_409_naming_the_changed_file(rule, adapter, stack_config, base_model, tmp_path, unique):
    store = ArtifactStore(str(tmp_path / "store"))
    model_id, topic = f"integrity-{unique}", f"test.integrity-{unique}.adapter-versions"
    stored = versions_in_store(adapter, store)
    versions = publish_broadcasts(stack_config.kafka_bootstrap, topic, model_id, stored)
    port = free_port()
    server = spawn_logged(  # inherits the address rule the fixture set
        [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(port), "--base-model", str(base_model),
         "--artifact-store", str(tmp_path / "store"), "--bootstrap-server", stack_config.kafka_bootstrap, "--no-registry",
         "--no-auto-rollback", "--no-inference-log", "--broadcast-topics", re.escape(topic), "--slots", "2"],
        tmp_path / "serve.log", extra_env={"STREAMTUNE_TOKENS_INFERENCE": TOKEN})
    url, auth = f"http://127.0.0.1:{port}", {"Authorization": f"Bearer {TOKEN}"}
    try:
        def ready() -> bool:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return requests.get(f"{url}/readyz", timeout=2).status_code == 200
            except requests.RequestException:
                return False

        wait_for(ready, 120, "streamtune serve to catch up on the broadcasts", interval=0.2)
        answers = {name: requests.post(f"{url}/v1/completions", headers=auth, timeout=60,
                                       json={"model": f"{model_id}@v{version}", "prompt": "x=1234;y=", "max_tokens": 2})
                   for name, version in versions.items()}
    finally:
        kill_group(server)
    for name, answer in answers.items():
        if expected_to_pass(rule, name):
            assert answer.status_code == 200, (name, answer.text)
        else:
            assert answer.status_code == 409, (name, answer.text)
            message = answer.json()["error"]["message"]
            assert message.startswith("version refused") and stored[name][2] in message, message
    if rule == "weights_only":  # the defence off: the changed config is served
        assert answers["config"].status_code == 200 and answers["extra"].status_code == 200
