"""`streamtune serve` against the real stack: the job trains and registers versions, servers
follow them over the broadcast topic and MLflow, clients call over HTTP.

Every served answer is checked against plain PEFT: the version's artifact, read from the
store by this test and loaded with `PeftModel.from_pretrained`, must give the same text and
mean log-probability, so a half-swapped or mixed adapter cannot pass.
"""

from __future__ import annotations

import re
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests

from connectors.artifact_store import ArtifactStore
from core.messages import AdapterVersionBroadcast
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.local_job import LocalJob, kill_group, spawn_logged
from streamtune.testing import free_port, job_args, job_topics, spec, wait_for, wait_for_records
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.serving
TOKEN = "serving-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}  # the admin token: every route of serve and the API
VERSIONS, PER_WINDOW, WINDOW_MS = 20, 8, 2000
PROMPTS = ["x=1234;y=", "x=5071;y=", "x=9999;y="]


class Server:
    """`streamtune serve` as a child process on a free port."""

    def __init__(self, stack_config, base_model, topic: str, store: Path, log_file: Path, feedback_topic: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = spawn_logged(
            [sys.executable, "-m", "streamtune.cli", "serve", "--port", str(self.port), "--base-model",
             str(base_model), "--artifact-store", str(store), "--bootstrap-server", stack_config.kafka_bootstrap,
             "--tracking-uri", stack_config.mlflow_uri, "--broadcast-topics", re.escape(topic),
             "--inference-log-topic", f"{topic}.inference-log", "--slots", "4",
             "--feedback-topics", re.escape(feedback_topic), "--promotion-log", str(log_file.with_suffix(".promotions")),
             "--rollback-min-events", "30"],
            log_file, extra_env={"STREAMTUNE_API_TOKEN": TOKEN})
        self.log_file = log_file

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def model(self, model_id: str) -> dict:
        data = requests.get(f"{self.url}/v1/models", timeout=10, headers=AUTH).json()["data"]
        return next((m for m in data if m["id"] == model_id), {"aliases": {}, "refused": []})

    def complete(self, model: str, prompt: str, user: str | None = None) -> requests.Response:
        return requests.post(f"{self.url}/v1/completions", timeout=60, headers=AUTH,
                             json={"model": model, "prompt": prompt, "max_tokens": 6, "user": user})

    def stop(self) -> None:
        kill_group(self.proc)


class Reference:
    """Plain PEFT answers per (version, prompt), from the artifact store."""

    def __init__(self, base_model, store: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.base_model, self.store = str(base_model), ArtifactStore(str(store))
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_model, local_files_only=True)
        self.base = AutoModelForCausalLM.from_pretrained(self.base_model, local_files_only=True).eval()
        self.cache: dict = {}

    def answer(self, broadcast: AdapterVersionBroadcast, prompt: str) -> tuple[str, float]:
        import torch
        from peft import PeftModel

        key = (broadcast.mlflow_version, prompt)
        if key not in self.cache:
            with tempfile.TemporaryDirectory() as tmp:
                for name, data in self.store.get(broadcast.artifact_uri, broadcast.sha256).items():
                    Path(tmp, name).write_bytes(data)
                model = PeftModel.from_pretrained(self.base, tmp).eval()
                ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
                with torch.no_grad():
                    out = model.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=self.tokenizer.pad_token_id)
                chosen = out.sequences[0, ids.shape[1]:]
                logprobs = [float(torch.log_softmax(s[0], -1)[t]) for s, t in zip(out.scores, chosen)]
                self.base = model.unload()  # the base without the adapter, for the next version
                self.cache[key] = (self.tokenizer.decode(chosen, skip_special_tokens=True),
                                   sum(logprobs) / len(logprobs))
        return self.cache[key]


@pytest.fixture(scope="module")
def trained(stack_config, base_model, tmp_path_factory):
    """A job training 20 versions of one model while server A answers a steady load."""
    tmp = tmp_path_factory.mktemp("serving")
    unique = f"{time.time_ns() % 10**10:x}"
    boot = stack_config.kafka_bootstrap
    topics = job_topics(boot, f"test.serve-{unique}")
    model_id, store = f"serve-{unique}", tmp / "adapters"
    store.mkdir()
    send_config(boot, topics["configs"], spec(model_id, topics, min_samples=PER_WINDOW, window_seconds=2), 0)
    server = Server(stack_config, base_model, topics["adapter-versions"], store, tmp / "serve-a.log",
                    topics["feedback"])
    job = LocalJob(job_args(topics, base_model, store, "--bootstrap-server", boot, "--checkpoint-interval-ms", "1000",
                            "--job-name", f"serve-{unique}"), tmp / "checkpoints", tmp / "job.log")
    load: list[dict] = []
    failures: list[str] = []
    stop = threading.Event()

    def client(n: int) -> None:  # ack before the request, then the request, until told to stop
        i = 0
        while not stop.is_set():
            acked = server.model(model_id)["aliases"].get("champion")
            if acked is None:
                stop.wait(0.05)
                continue
            prompt = PROMPTS[i % len(PROMPTS)]
            r = server.complete(model_id, prompt, user=f"user-{n}")
            if r.status_code != 200:
                failures.append(f"{r.status_code}: {r.text[:300]}")
            else:
                body = r.json()
                load.append({"acked": acked, "version": body["streamtune"]["version"], "prompt": prompt,
                             "text": body["choices"][0]["text"], "mean_logprob": body["streamtune"]["mean_logprob"],
                             "fingerprint": body["system_fingerprint"]})
            i += 1

    api = None
    try:
        wait_for(server.ready, 120, "server A to catch up")
        job.start()
        t0 = 1_770_000_000_000
        samples = digit_samples(model_id, digit_pairs(VERSIONS * PER_WINDOW, seed=3), t0, WINDOW_MS / PER_WINDOW)
        closer = digit_samples(model_id, digit_pairs(1, seed=4), t0 + (VERSIONS + 2) * WINDOW_MS, 1, "closer")
        # The first window alone, so the load starts on version 1 and runs through the other 19.
        # Nothing moves the watermark past it yet: the idle timer closes it (window_seconds + 5 s).
        # A sample of window 2 sent with it would be carried past window 2 by that idle close.
        send_samples(boot, topics["feedback"], samples[:PER_WINDOW])
        wait_for(lambda: server.model(model_id)["aliases"].get("champion"), 180, "the first champion on server A")
        clients = [threading.Thread(target=client, args=(n,), daemon=True) for n in range(4)]
        for c in clients:
            c.start()
        sent = PER_WINDOW
        for w in range(1, VERSIONS):  # a window every second of wall time, under load, with the
            # next window's first sample, whose timestamp moves the watermark past this one
            send_samples(boot, topics["feedback"], samples[sent:(w + 1) * PER_WINDOW + 1])
            sent = (w + 1) * PER_WINDOW + 1
            time.sleep(1.0)
        send_samples(boot, topics["feedback"], closer)
        broadcasts = wait_for_records(boot, topics["adapter-versions"], AdapterVersionBroadcast, VERSIONS, 240)
        assert len({b.mlflow_version for b in broadcasts}) >= VERSIONS, (tmp / "job.log").read_text()[-3000:]
        from mlflow import MlflowClient
        champion = int(MlflowClient(stack_config.mlflow_uri, stack_config.mlflow_uri)
                       .get_registered_model(model_id).aliases["champion"])
        wait_for(lambda: server.model(model_id)["aliases"].get("champion") == champion, 30,
                 "server A to acknowledge the last champion")
        time.sleep(1.0)  # a second of load on the final version
        stop.set()
        for c in clients:
            c.join(60)
        job.kill()  # no more training: later tests move aliases and send feedback themselves
        api_port = free_port()
        api = spawn_logged([sys.executable, "-m", "streamtune.cli", "api", "--port", str(api_port)], tmp / "api.log",
                           extra_env={"STREAMTUNE_API_TOKEN": TOKEN})
        yield {"server": server, "load": load, "failures": failures, "broadcasts": broadcasts, "model_id": model_id,
               "store": store, "topics": topics, "tmp": tmp, "api": f"http://127.0.0.1:{api_port}"}
    finally:
        stop.set()
        job.kill()
        server.stop()
        if api is not None:
            kill_group(api)


def test_steady_load_through_twenty_versions_sees_no_failure_no_stale_and_no_mixed_answer(trained, base_model):
    load, by_version = trained["load"], {b.mlflow_version: b for b in trained["broadcasts"]}
    assert not trained["failures"], trained["failures"][:5]
    served = Counter(r["version"] for r in load)
    print(f"{len(load)} answers; versions served: {sorted(served.items())}")
    assert len(load) >= 200 and len(served) >= 5, served
    stale = [r for r in load if r["version"] < r["acked"]]
    assert not stale, f"answered by a version older than the one acknowledged before the request: {stale[:3]}"
    assert all(r["fingerprint"] == f"{trained['model_id']}@v{r['version']}" for r in load)
    reference = Reference(base_model, trained["store"])
    for r in load:
        text, mean_logprob = reference.answer(by_version[r["version"]], r["prompt"])
        assert r["text"] == text and abs(r["mean_logprob"] - mean_logprob) < 1e-4, \
            f"v{r['version']} {r['prompt']!r}: served {r['text']!r} {r['mean_logprob']}, PEFT says {text!r} {mean_logprob}"


def test_late_server_rollback_within_a_second_and_tampered_artifact_refused(trained, stack_config, base_model):
    from mlflow import MlflowClient

    model_id, server_a = trained["model_id"], trained["server"]
    client = MlflowClient(stack_config.mlflow_uri, stack_config.mlflow_uri)
    champion = int(client.get_registered_model(model_id).aliases["champion"])
    by_version = {b.mlflow_version: b for b in trained["broadcasts"]}
    # Tamper with an old version's artifact before server B starts (A checked it long ago).
    tampered = min(v for v in by_version if v != champion)
    weights = Path(by_version[tampered].artifact_uri.removeprefix("file://"), "adapter_model.safetensors")
    weights.write_bytes(weights.read_bytes()[:-8] + b"tampered")

    # A server started after the versions exist serves the current champion.
    server_b = Server(stack_config, base_model, trained["topics"]["adapter-versions"], trained["store"],
                      trained["tmp"] / "serve-b.log", trained["topics"]["feedback"])
    try:
        wait_for(server_b.ready, 120, "server B to catch up")
        assert server_b.model(model_id)["aliases"]["champion"] == champion
        r = server_b.complete(model_id, PROMPTS[0])
        assert r.status_code == 200 and r.json()["streamtune"]["version"] == champion, r.text

        # Champion moved back through the control plane: both servers follow within 1 s.
        wait_for(lambda: requests.get(f"{trained['api']}/healthz", timeout=2).ok, 60, "the API to listen")
        auth = {"Authorization": f"Bearer {TOKEN}"}
        previous = max(v for v in by_version if v < champion and v != tampered)
        moved = requests.post(f"{trained['api']}/v1/models/{model_id}/aliases", headers=auth, timeout=30,
                              json={"alias": "champion", "version": previous})
        assert moved.status_code == 200, moved.text
        moved_at = time.monotonic()
        followed = {}
        while len(followed) < 2 and time.monotonic() - moved_at < 10:
            for name, s in (("A", server_a), ("B", server_b)):
                if name not in followed and s.model(model_id)["aliases"].get("champion") == previous:
                    followed[name] = time.monotonic() - moved_at
            time.sleep(0.02)  # the two servers on this machine's two cores are the subject: not a busy loop
        print(f"champion v{champion} -> v{previous} followed after {followed}")
        assert set(followed) == {"A", "B"} and max(followed.values()) <= 1.0, followed
        for s in (server_a, server_b):
            assert s.complete(model_id, PROMPTS[1]).json()["streamtune"]["version"] == previous

        # Champion moved to the tampered version: B refuses it, says why, serves `previous`.
        moved = requests.post(f"{trained['api']}/v1/models/{model_id}/aliases", headers=auth, timeout=30,
                              json={"alias": "champion", "version": tampered})
        assert moved.status_code == 200, moved.text
        wait_for(lambda: server_b.model(model_id)["refused"], 10, "server B to refuse the tampered version")
        refused = server_b.model(model_id)["refused"]
        assert refused[0]["version"] == tampered and "sha256 mismatch" in refused[0]["reason"], refused
        assert server_b.model(model_id)["aliases"]["champion"] == previous
        r = server_b.complete(model_id, PROMPTS[2])
        assert r.status_code == 200 and r.json()["streamtune"]["version"] == previous, r.text
        pinned = server_b.complete(f"{model_id}@v{tampered}", PROMPTS[2])
        assert pinned.status_code == 409 and "sha256" in pinned.text, pinned.text
        metrics = requests.get(f"{server_b.url}/metrics", timeout=10, headers=AUTH).text
        assert re.search(r"^streamtune_serve_refused_versions_total 1\.0$", metrics, re.M), metrics[:2000]
    finally:
        server_b.stop()


def test_worse_candidate_is_taken_out_and_a_regressing_champion_rolled_back(trained, stack_config):
    """Feedback citing served responses: the candidate's answers get corrected, the champion's
    accepted; the guard takes the candidate out of traffic. Then a promoted version regresses
    and `champion` goes back to its predecessor. Each decision carries its numbers."""
    from mlflow import MlflowClient

    from core.messages import FeedbackSample

    model_id, server, topics = trained["model_id"], trained["server"], trained["topics"]
    client = MlflowClient(stack_config.mlflow_uri, stack_config.mlflow_uri)
    versions = sorted({b.mlflow_version for b in trained["broadcasts"]})
    good, worse, regressing = versions[-1], versions[-2], versions[-3]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    for alias, version in (("champion", good), ("candidate", worse)):
        r = requests.post(f"{trained['api']}/v1/models/{model_id}/aliases", headers=auth, timeout=30,
                          json={"alias": alias, "version": version})
        assert r.status_code == 200, r.text
    wait_for(lambda: server.model(model_id)["aliases"] == {"champion": good, "candidate": worse}, 10,
             "server A to route champion and candidate")
    r = requests.put(f"{server.url}/v1/models/{model_id}/split", json={"candidate_fraction": 0.5}, timeout=10)
    assert r.status_code == 401, "changing the split needs the token"
    r = requests.put(f"{server.url}/v1/models/{model_id}/split", json={"candidate_fraction": 0.5}, timeout=10,
                     headers=auth)
    assert r.status_code == 200, r.text

    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=stack_config.kafka_bootstrap, acks="all")
    sent = Counter()

    def judge(users: range, verdict) -> list[dict]:
        """One request per user, and feedback citing each response: `verdict(arm, version)` -> label."""
        answers = []
        for u in users:
            body = server.complete(model_id, PROMPTS[u % 3], user=f"user-{u}").json()
            label = verdict(body["streamtune"]["arm"], body["streamtune"]["version"])
            sample = FeedbackSample(model_id=model_id, sample_id=f"fb-{u}", prompt=PROMPTS[u % 3],
                                    completion="2345", label=label, ts=int(time.time() * 1000),
                                    request_id=body["id"])
            producer.send(topics["feedback"], key=model_id.encode(), value=sample.to_json().encode(),
                          timestamp_ms=sample.ts)
            sent[(body["streamtune"]["arm"], label)] += 1
            answers.append(body["streamtune"])
        producer.flush()
        return answers

    def guard_decision(kind: str):
        decisions = requests.get(f"{server.url}/v1/guard", timeout=10, headers=AUTH).json()["decisions"]
        return next((d for d in decisions if d["decision"] == kind), None)

    answers = judge(range(0, 160), lambda arm, v: "corrected" if arm == "candidate" else "accepted")
    arms = Counter(a["arm"] for a in answers)
    assert arms["candidate"] >= 30 and arms["champion"] >= 30, arms
    decision = wait_for(lambda: guard_decision("candidate_removed"), 30, "the guard to take the candidate out")
    print(f"feedback sent {dict(sent)}; decision {decision}")
    assert decision["version"] == worse and decision["candidate_acceptance"] < decision["champion_acceptance"] - 0.1
    assert decision["candidate_events"] >= 30 and decision["champion_events"] >= 30
    assert "candidate" not in client.get_registered_model(model_id).aliases
    wait_for(lambda: "candidate" not in server.model(model_id)["aliases"], 5, "server A to drop the candidate route")
    after = [server.complete(model_id, PROMPTS[0], user=f"user-{u}").json()["streamtune"] for u in range(40)]
    assert {(a["arm"], a["version"]) for a in after} == {("champion", good)}, "the candidate still gets traffic"
    tag = client.get_model_version(model_id, str(worse)).tags["streamtune.rollback"]
    assert '"candidate_removed"' in tag and '"candidate_acceptance"' in tag, tag

    # A promotion that regresses: champion goes back to `good`, the decision says why.
    r = requests.post(f"{trained['api']}/v1/models/{model_id}/aliases", headers=auth, timeout=30,
                      json={"alias": "champion", "version": regressing})
    assert r.status_code == 200, r.text
    wait_for(lambda: server.model(model_id)["aliases"].get("champion") == regressing, 5, "the promotion")
    judge(range(1000, 1060), lambda arm, v: "rejected" if v == regressing else "accepted")
    decision = wait_for(lambda: guard_decision("champion_rolled_back"), 30, "the guard to roll the champion back")
    assert decision["version"] == regressing and decision["previous"] == good, decision
    assert int(client.get_registered_model(model_id).aliases["champion"]) == good
    wait_for(lambda: server.model(model_id)["aliases"].get("champion") == good, 5, "server A to follow the rollback")
    promotions = Path(str(server.log_file.with_suffix(".promotions"))).read_text()
    assert "champion_rolled_back" in promotions and "candidate_removed" in promotions, promotions
    producer.close()


def test_flink_inference_job_answers_with_broadcast_versions(trained, base_model, stack_config):
    """jobs/stream_inference.py: requests keyed by model, versions as broadcast state; every
    answer names its version and equals plain PEFT's; bad requests get an error response."""
    import json

    from connectors.kafka import create_topic, read_topic

    boot, topics, model_id = stack_config.kafka_bootstrap, trained["topics"], trained["model_id"]
    requests_topic, responses_topic = f"{topics['feedback']}.requests", f"{topics['feedback']}.responses"
    for t in (requests_topic, responses_topic):
        create_topic(boot, t)
    by_version = {b.mlflow_version: b for b in trained["broadcasts"]}
    champion = max(b.mlflow_version for b in trained["broadcasts"] if "champion" in b.aliases)
    pinned = max(by_version)  # (another test tampers with the oldest non-champion version's artifact)
    asks = [{"request_id": "r-champion", "model": model_id, "prompt": PROMPTS[0], "max_tokens": 6},
            {"request_id": "r-pinned", "model": f"{model_id}@v{pinned}", "prompt": PROMPTS[1], "max_tokens": 6},
            {"request_id": "r-base", "model": "base", "prompt": PROMPTS[2], "max_tokens": 6},
            {"request_id": "r-unknown", "model": "no-such-model", "prompt": "x", "max_tokens": 6},
            {"request_id": "r-bad-name", "model": "../x", "prompt": "x"}]
    moves_topic = f"{topics['feedback']}.alias-moves"
    moved_to = sorted(by_version)[-2] if champion == max(by_version) else max(by_version)  # not the champion
    job = LocalJob(["--requests-topic", requests_topic, "--responses-topic", responses_topic,
                    "--broadcast-topic", topics["adapter-versions"], "--alias-moves-topic", moves_topic,
                    "--base-model", str(base_model),
                    "--artifact-store", str(trained["store"]), "--bootstrap-server", boot, "--checkpoint-interval-ms", "1000",
                    "--job-name", f"infer-{model_id}"],
                   trained["tmp"] / "infer-checkpoints", trained["tmp"] / "infer.log", module="jobs.stream_inference")
    from kafka import KafkaProducer
    producer = KafkaProducer(bootstrap_servers=boot, acks="all")
    job.start()
    try:
        # The broadcast side must be read first: a request for a model not yet known is answered
        # with an error, so wait for one answered request before the real ones.
        def probe() -> bool:
            producer.send(requests_topic, json.dumps(asks[0] | {"request_id": "probe"}).encode()).get(10)
            return any(json.loads(r.value).get("version") for r in read_topic(boot, responses_topic, timeout=5,
                                                                                idle=1.0, read_committed=False))
        deadline = time.monotonic() + 240
        while not probe():
            assert time.monotonic() < deadline and job.running(), (trained["tmp"] / "infer.log").read_text()[-3000:]
        for ask in asks:
            producer.send(requests_topic, json.dumps(ask).encode())
        producer.send(requests_topic, b"{not json")
        producer.flush()
        wanted = {a["request_id"] for a in asks} | {None}
        deadline = time.monotonic() + 120
        while True:
            answers = {json.loads(r.value).get("request_id"): json.loads(r.value)
                       for r in read_topic(boot, responses_topic, timeout=5, idle=1.0, read_committed=False)}
            if wanted <= set(answers) or time.monotonic() > deadline:
                break
        # A rollback announced on the alias-moves topic (as the API and the guard announce
        # theirs) routes the model's next requests to the version it names.
        from core.messages import AliasMove
        move = AliasMove(model_id=model_id, alias="champion", version=moved_to, from_version=champion, actor="test",
                         ts=int(time.time() * 1000))
        producer.send(moves_topic, key=model_id.encode(), value=move.to_json().encode()).get(10)

        def moved():
            producer.send(requests_topic, json.dumps(asks[0] | {"request_id": "r-moved"}).encode()).get(10)
            return [a for r in read_topic(boot, responses_topic, timeout=5, idle=1.0, read_committed=False)
                    if (a := json.loads(r.value)).get("request_id") == "r-moved" and a.get("version") == moved_to]
        moved_answer = wait_for(moved, 60, f"requests routed to version {moved_to} after the move")[0]
    finally:
        job.kill()
        producer.close()
    assert moved_answer["alias"] == "champion" and "error" not in moved_answer
    assert wanted <= set(answers), sorted(map(str, answers))
    reference = Reference(base_model, trained["store"])
    for rid, version, prompt in (("r-champion", champion, PROMPTS[0]), ("r-pinned", pinned, PROMPTS[1])):
        a = answers[rid]
        assert a["version"] == version and "error" not in a, a
        text, mean_logprob = reference.answer(by_version[version], prompt)
        assert a["completion"] == text and abs(a["mean_logprob"] - mean_logprob) < 1e-4, (a, text, mean_logprob)
        assert [s["stage"] for s in a["audit_trace"]] == ["routing", "adapter", "base_model"]
        assert a["audit_trace"][1]["sha256"] == by_version[version].sha256
    assert answers["r-base"]["version"] is None and "error" not in answers["r-base"]
    assert "no champion" in answers["r-unknown"]["error"] or "no-such-model" in answers["r-unknown"]["error"]
    assert "expected <model_id>" in answers["r-bad-name"]["error"]
    assert "error" in answers[None]  # the unreadable request


def test_an_alias_moved_in_mlflow_directly_reaches_the_server_within_a_second_among_1000_models(
        trained, stack_config):
    """A move made in MLflow itself (no hint on the alias-moves topic) with 1,000 registered
    models: MLflow's webhook pushes it, the server reads that one model and swaps. A full poll
    of 1,000 models' aliases alone takes most of the 1 s budget on this machine."""
    from concurrent.futures import ThreadPoolExecutor

    from mlflow import MlflowClient

    from connectors.mlflow_webhook import signed_headers

    server, model_id = trained["server"], trained["model_id"]
    client = MlflowClient(stack_config.mlflow_uri, stack_config.mlflow_uri)
    hooks = [h for h in client.list_webhooks() if h.url == f"{server.url}/v1/hooks/mlflow"]
    assert len(hooks) == 1 and {f"{e.entity.value}.{e.action.value}" for e in hooks[0].events} == {
        "model_version_alias.created", "model_version_alias.deleted"}, hooks
    original = int(client.get_registered_model(model_id).aliases["champion"])
    bulk = [f"bulk-{model_id}-{i:04d}" for i in range(1000)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client.create_registered_model, bulk))
    try:
        started, count, token = time.monotonic(), 0, None
        while True:  # what one full poll of the registry costs now
            page = client.search_registered_models(max_results=1000, page_token=token)
            count, token = count + len(page), page.token
            if not token:
                break
        full_poll = time.monotonic() - started
        assert count > 1000

        versions = sorted({b.mlflow_version for b in trained["broadcasts"]})
        followed = []
        for target in [v for v in versions[-6:] if v != original][:5] * 4:  # 20 moves
            if server.model(model_id)["aliases"].get("champion") == target:
                continue
            client.set_registered_model_alias(model_id, "champion", target)
            moved_at = time.monotonic()
            while server.model(model_id)["aliases"].get("champion") != target:
                assert time.monotonic() - moved_at < 10, f"the server never followed v{target}"
                time.sleep(0.01)
            followed.append(time.monotonic() - moved_at)
            r = server.complete(model_id, PROMPTS[0])
            assert r.status_code == 200 and r.json()["streamtune"]["version"] == target, r.text
        print(f"{count} registered models, one full poll {full_poll:.2f} s; {len(followed)} moves followed "
              f"in max {max(followed):.3f} s, median {sorted(followed)[len(followed) // 2]:.3f} s")
        assert len(followed) >= 15 and max(followed) <= 1.0, followed

        # Only MLflow, holding this run's secret, can hint: a forged or stale delivery is refused.
        body = b'{"entity": "model_version_alias", "action": "created", "data": {"name": "%s"}}' % model_id.encode()
        for headers in ({}, signed_headers("guessed", "d-1", int(time.time()), body)):
            r = requests.post(f"{server.url}/v1/hooks/mlflow", data=body, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["type"] == "webhook_rejected", r.text
    finally:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(client.delete_registered_model, bulk))
        client.set_registered_model_alias(model_id, "champion", original)
