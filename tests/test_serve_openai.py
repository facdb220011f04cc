"""`streamtune serve` through the official `openai` client: completions and chat, streaming,
sampling parameters, usage, errors, and concurrent requests batched across versions.

One server process for the module, following a broadcast topic of its own (`--no-registry`:
aliases from the broadcasts) with two random adapter versions of the tiny base (a copy of
it with a chat template, so /v1/chat/completions answers), its inference log on a topic of
its own. Every batched answer is compared with the same request answered alone by the same
server, and /metrics must show batches of more than one row.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import time

import pytest
import requests

from connectors.artifact_store import ArtifactStore
from core.messages import AdapterVersionBroadcast, InferenceRecord
from streamtune.local_job import kill_group, spawn_logged
from streamtune.testing import free_port, random_adapter_files, wait_for, wait_for_records

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.serving
TOKEN = "serve-openai-test-token"
PROMPTS = ["x=1234;y=", "x=5071;y=", "x=9999;y=", "a longer prompt, x=31;y="]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module")
def server(stack_config, base_model, tmp_path_factory):
    from kafka import KafkaProducer

    from connectors.kafka import create_topic

    tmp = tmp_path_factory.mktemp("serve-openai")
    unique = f"{time.time_ns() % 10**10:x}"
    model_id, topic, log_topic = f"oai-{unique}", f"test.oai-{unique}.adapter-versions", f"test.oai-{unique}.inference"
    base = tmp / "tiny-chat"  # the tiny base with a chat template
    shutil.copytree(base_model, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    (base / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    store = ArtifactStore(str(tmp / "store"))
    create_topic(stack_config.kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
    for version in (1, 2):
        files, sha256 = random_adapter_files(base, seed=version)
        broadcast = AdapterVersionBroadcast(
            version_id=f"{model_id}@{version}", model_id=model_id, seq=version, mlflow_version=version,
            model_uri=f"models:/{model_id}/{version}", sha256=sha256, artifact_uri=store.put(files, sha256),
            aliases=["champion"] if version == 2 else [], registered_at=int(time.time() * 1000))
        producer.send(topic, key=model_id.encode(), value=broadcast.to_json().encode())
    producer.flush()
    producer.close()
    port = free_port()
    log_file = tmp / "serve.log"
    proc = spawn_logged(
        [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(port), "--base-model", str(base),
         "--artifact-store", str(tmp / "store"), "--bootstrap-server", stack_config.kafka_bootstrap, "--no-registry",
         "--no-auto-rollback", "--inference-log-topic", log_topic, "--broadcast-topics", re.escape(topic),
         "--slots", "4",
         # every answer is below 0 (a mean log-probability): a budget decides alone
         "--confidence-threshold", "*=0.0"],
        log_file, extra_env={"STREAMTUNE_API_TOKEN": TOKEN, "STREAMTUNE_RESPONSE_SIGNING_KEY": "",
                             "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE": ""})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert proc.poll() is None, log_file.read_text()[-3000:]
        try:
            return requests.get(f"{url}/readyz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    try:
        wait_for(ready, 120, "streamtune serve to catch up on the broadcasts", interval=0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        wait_for(lambda: any(m["id"] == model_id and m["aliases"].get("champion") == 2 for m in
                             requests.get(f"{url}/v1/models", headers=auth, timeout=10).json()["data"]),
                 30, "the champion to be routed", interval=0.2)
        yield {"client": client, "url": url, "model_id": model_id, "base": base, "log_topic": log_topic,
               "bootstrap": stack_config.kafka_bootstrap, "log_file": log_file, "proc": proc}
    finally:
        kill_group(proc)


def metric(server, name: str) -> float:
    text = requests.get(f"{server['url']}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_completions_chat_usage_and_the_version_named(server):
    from transformers import AutoTokenizer

    client, model_id = server["client"], server["model_id"]
    tokenizer = AutoTokenizer.from_pretrained(str(server["base"]), local_files_only=True)
    r = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=6)
    assert r.object == "text_completion" and r.system_fingerprint == f"{model_id}@v2"
    assert len(r.choices) == 1 and r.choices[0].finish_reason in ("stop", "length")
    prompt_tokens = len(tokenizer(PROMPTS[0])["input_ids"])
    assert r.usage.prompt_tokens == prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if r.usage.completion_tokens == 6:
        assert r.choices[0].finish_reason == "length"
    # Greedy by default: the same request, the same text; temperature 0 is greedy too.
    assert client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=6).choices[0].text == r.choices[0].text
    assert client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=6,
                                     temperature=0).choices[0].text == r.choices[0].text

    messages = [{"role": "user", "content": "x=1234;y="}]
    chat = client.chat.completions.create(model=f"{model_id}@v1", messages=messages, max_tokens=6)
    assert chat.object == "chat.completion" and chat.system_fingerprint == f"{model_id}@v1"
    assert chat.choices[0].message.role == "assistant" and chat.id.startswith("chatcmpl-")
    chat_prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.usage.prompt_tokens == len(tokenizer(chat_prompt)["input_ids"])
    same = client.completions.create(model=f"{model_id}@v1", prompt=chat_prompt, max_tokens=6)
    assert chat.choices[0].message.content == same.choices[0].text


def test_streaming_sends_chunks_as_decoded_and_equals_the_whole_answer(server):
    client, model_id = server["client"], server["model_id"]
    whole = client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=12)
    chunks = list(client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len([t for t in texts if t]) > 1, chunks
    assert "".join(texts) == whole.choices[0].text
    assert all(c.system_fingerprint == f"{model_id}@v2" for c in chunks)
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "x=5071;y="}]
    whole_chat = client.chat.completions.create(model="base", messages=messages, max_tokens=12)
    stream = client.chat.completions.create(model="base", messages=messages, max_tokens=12, stream=True)
    chat_chunks = list(stream)
    assert chat_chunks[0].object == "chat.completion.chunk" and chat_chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks) == whole_chat.choices[0].message.content
    assert chat_chunks[-1].choices[0].finish_reason == whole_chat.choices[0].finish_reason
    assert all(c.system_fingerprint == "base" for c in chat_chunks)

    # The inference log: one record per response, the whole text, streamed or not.
    records = wait_for_records(server["bootstrap"], server["log_topic"], InferenceRecord, 1, 30, read_committed=False,
                               predicate=lambda rec: rec.request_id == chunks[0].id)
    assert len(records) == 1 and records[0].completion == whole.choices[0].text and records[0].version == 2


def test_time_to_first_token_comes_before_the_end(server):
    """The first chunk arrives well before the last: text is sent as decoded, not at the end."""
    client, model_id = server["client"], server["model_id"]
    # One request first: what happens once (the connection, the version's adapter) is not the
    # question, and on a loaded machine it took longer than the whole decode (CI: 0.13 s of 0.25).
    client.completions.create(model=f"{model_id}@v1", prompt=PROMPTS[3], max_tokens=1)
    started = time.perf_counter()
    arrivals = []
    for chunk in client.completions.create(model=f"{model_id}@v1", prompt=PROMPTS[3], max_tokens=200,
                                           stop=None, stream=True):
        if chunk.choices and chunk.choices[0].text:
            arrivals.append(time.perf_counter() - started)
    assert len(arrivals) > 3, arrivals
    assert arrivals[0] < arrivals[-1] / 2, f"first text after {arrivals[0]:.3f} s, last after {arrivals[-1]:.3f} s"


def test_sampling_seed_n_prompt_lists_and_stop(server):
    client, model_id = server["client"], server["model_id"]
    one = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=11)
    again = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=11)
    assert one.choices[0].text == again.choices[0].text
    others = {client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=10, temperature=1.0,
                                        seed=s).choices[0].text for s in range(12, 16)}
    assert len(others | {one.choices[0].text}) > 1, "four other seeds all gave the same sample"

    two = client.completions.create(model=model_id, prompt=PROMPTS[2], max_tokens=10, temperature=1.0, seed=11, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == one.choices[0].text
    chat_two = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=5, n=2, temperature=1.0, seed=5)
    assert [c.index for c in chat_two.choices] == [0, 1]

    greedy = {p: client.completions.create(model=model_id, prompt=p, max_tokens=8).choices[0].text for p in PROMPTS[:2]}
    listed = client.completions.create(model=model_id, prompt=PROMPTS[:2], max_tokens=8, n=2)
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert [c.text for c in listed.choices] == [greedy[PROMPTS[0]]] * 2 + [greedy[PROMPTS[1]]] * 2

    text = greedy[PROMPTS[0]]
    assert len(text) >= 3, text
    stop = text[1:3]
    cut = client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=8, stop=[stop, "never-seen"])
    assert cut.choices[0].text == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt=PROMPTS[0], max_tokens=8, stop=stop, stream=True) if c.choices)
    assert streamed == cut.choices[0].text


def test_errors_are_openai_errors(server):
    client, model_id = server["client"], server["model_id"]
    wrong = openai.OpenAI(base_url=client.base_url, api_key="not-the-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=model_id, prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{model_id}@v99", prompt="x", max_tokens=2, stream=True)
    for bad in ({"temperature": 3.0}, {"top_p": 0}, {"n": 9}, {"stop": ["a", "b", "c", "d", "e"]},
                {"max_tokens": 0}):
        with pytest.raises((openai.BadRequestError, openai.UnprocessableEntityError)) as e:
            client.completions.create(model=model_id, prompt="x", **{"max_tokens": 2, **bad})
        assert e.value.body["message"] and e.value.body["type"] == "invalid_request_error", bad
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="x", max_tokens=100_000)


def test_concurrent_requests_are_batched_across_versions_and_equal_each_alone(server):
    client, model_id = server["client"], server["model_id"]
    models = ["base", f"{model_id}@v1", f"{model_id}@v2"]
    cases = [(models[i % 3], PROMPTS[i % len(PROMPTS)], 4 + i % 5) for i in range(16)]
    alone = {case: client.completions.create(model=case[0], prompt=case[1], max_tokens=case[2])
             for case in set(cases)}
    rows_before, batches_before = (metric(server, "streamtune_serve_batch_size_sum"),
                                   metric(server, "streamtune_serve_batch_size_count"))
    answers: dict[int, object] = {}
    failures: list[str] = []
    barrier = threading.Barrier(len(cases))

    def ask(i: int) -> None:
        model, prompt, max_tokens = cases[i]
        barrier.wait()
        try:
            answers[i] = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"{cases[i]}: {e!r}")

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures, failures
    for i, case in enumerate(cases):
        got, expected = answers[i], alone[case]
        assert got.system_fingerprint == expected.system_fingerprint == (
            "base" if case[0] == "base" else case[0]), case
        assert got.choices[0].text == expected.choices[0].text, (case, got.choices[0].text, expected.choices[0].text)
        assert got.model_extra["streamtune"]["mean_logprob"] == pytest.approx(
            expected.model_extra["streamtune"]["mean_logprob"], abs=1e-4)
    rows = metric(server, "streamtune_serve_batch_size_sum") - rows_before
    batches = metric(server, "streamtune_serve_batch_size_count") - batches_before
    print(f"{int(rows)} rows in {int(batches)} batches")
    assert rows == len(cases) and batches < rows, "no batch of more than one request"


def test_a_latency_budget_takes_the_accurate_path_only_when_it_fits(server):
    """The decision layer: below the confidence threshold, a generous budget takes the accurate
    path (best-of-k on the same version), a tight one keeps the fast answer, none decides nothing."""
    url, model_id = server["url"], server["model_id"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    accurate = f'streamtune_serve_path_decisions_total{{model_id="{model_id}",path="accurate",reason="below threshold"}}'
    before = metric(server, accurate)

    def ask(headers: dict, extra: dict | None = None) -> tuple[dict, dict]:
        r = requests.post(f"{url}/v1/completions", headers={**auth, **headers}, timeout=60,
                          json={"model": model_id, "prompt": PROMPTS[2], "max_tokens": 8, **(extra or {})})
        assert r.status_code == 200, r.text
        body = r.json()
        (decision,) = [s for s in body["streamtune"]["audit_trace"] if s["stage"] == "decision"]
        return body, decision

    fast, d = ask({})
    assert (d["path"], d["reason"]) == ("fast", "no slo")
    body, d = ask({"X-Streamtune-SLO-Ms": "60000"})
    assert (d["path"], d["reason"], d["candidates"]) == ("accurate", "below threshold", 5), d
    assert body["system_fingerprint"] == f"{model_id}@v2", "one version answers both paths"
    assert body["streamtune"]["mean_logprob"] >= fast["streamtune"]["mean_logprob"] == d["confidence"]
    body, d = ask({}, {"streamtune": {"slo_ms": 60000}})
    assert d["path"] == "accurate", "the budget in the body works as the header"
    body, d = ask({"X-Streamtune-SLO-Ms": "0.5"})
    assert (d["path"], d["reason"]) == ("fast", "no budget") and body["choices"][0]["text"] == fast["choices"][0]["text"]
    r = requests.post(f"{url}/v1/completions", headers={**auth, "X-Streamtune-SLO-Ms": "soon"}, timeout=60,
                      json={"model": model_id, "prompt": PROMPTS[2], "max_tokens": 8})
    assert r.status_code == 400 and "latency budget" in r.json()["error"]["message"]
    assert metric(server, accurate) == before + 2


# Last in the module: it stops the module's server.
def test_sigterm_finishes_the_streams_in_flight_then_exits(server):
    """A replica told to stop (SIGTERM, as Kubernetes does before replacing a pod) finishes
    every response it already started, whole, then shuts down cleanly and takes no new request."""
    import signal

    client, model_id, proc = server["client"], server["model_id"], server["proc"]
    started = [threading.Event() for _ in range(4)]
    finished: dict[int, tuple] = {}

    def stream(i: int) -> None:
        text, reason = "", None
        try:
            for chunk in client.completions.create(model=f"{model_id}@v1", prompt=PROMPTS[3], max_tokens=200,
                                                   stop=None, stream=True):
                started[i].set()
                if chunk.choices:
                    text += chunk.choices[0].text
                    reason = chunk.choices[0].finish_reason or reason
            finished[i] = ("ok", text, reason)
        except Exception as e:  # a dropped stream is the failure this test exists to catch
            finished[i] = ("error", repr(e), None)
        finally:
            started[i].set()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(started))]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(60), "every stream started"
    in_flight = len(started) - len(finished)
    proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(timeout=120)
    assert in_flight > 0, "the stop fell after every stream had ended: nothing was in flight"
    assert all(finished[i][0] == "ok" and finished[i][2] in ("stop", "length") for i in range(len(started))), finished
    whole = {finished[i][1] for i in range(len(started))}
    assert len(whole) == 1 and whole != {""}, "the same greedy answer, whole, on every stream"
    # uvicorn re-raises SIGTERM once its shutdown is complete: -15 after a clean finish.
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM), server["log_file"].read_text()[-2000:]
    assert "Finished server process" in server["log_file"].read_text(), "a clean shutdown, not a kill"
    with pytest.raises(openai.APIConnectionError):
        client.completions.create(model=model_id, prompt=PROMPTS[0], max_tokens=2)
