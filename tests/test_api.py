"""The REST control plane (streamtune/api), in process (TestClient) against the local stack.

Fuzzing (schemathesis) runs the app against the real stack, Flink's REST port open, so a
generated spec reaches the submission logic: positive cases get a stream_source in a topic
namespace of the test's own (a few topics, so a few jobs at most, all cancelled at the end).
The oracle, in place of schemathesis' not_a_server_error: a 5xx fails the test unless it is
a documented 501, or a documented 503 whose named service (Flink, Kafka, MLflow) does not
answer a probe right after it. A 503 while that service answers is a bug: the API blamed the
stack for its own failure. `test_fuzz_oracle_*` proves the oracle flags exactly that.
"""

from __future__ import annotations

import socket
import time

import pytest
import requests

from streamtune.testing import wait_for

pytestmark = pytest.mark.api

TOKEN = "test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SEED = {"model_id": "llama3-8b-streaming-v2", "stream_source": "kafka://topic=user_feedback_v3",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 50, "window_seconds": 60}}


def make_client(stack, tmp_path, **overrides):
    from fastapi.testclient import TestClient

    from streamtune.api import ApiSettings, create_app

    settings = ApiSettings(stack=stack, token=TOKEN, jobs_file=tmp_path / "api" / "jobs.json",
                           promotion_log=tmp_path / "api" / "promotions.jsonl",
                           artifact_store=str(tmp_path / "adapters"), **overrides)
    return TestClient(create_app(settings)), settings


def jobs_named(stack, name: str) -> list[dict]:
    jobs = requests.get(f"{stack.flink_rest_url}/jobs/overview", timeout=5).json()["jobs"]
    return [j for j in jobs if j["name"] == name]


def topic_records(stack, topic: str) -> list:
    """The topic's records (uncommitted too); [] when the topic does not exist (not created here)."""
    from kafka import KafkaAdminClient

    from connectors.kafka import read_topic

    admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap, request_timeout_ms=10000)
    try:
        if topic not in admin.list_topics():
            return []
    finally:
        admin.close()
    return read_topic(stack.kafka_bootstrap, topic, timeout=4, idle=1.0, read_committed=False)


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_end_to_end_submit_feedback_version_promote_rollback(stack_config, base_model, unique, tmp_path):
    from mlflow import MlflowClient

    from streamtune.stack.flink import cancel_job

    client, _ = make_client(stack_config, tmp_path, base_model=base_model,
                            extra_job_args=["--checkpoint-interval-ms", "1000"])
    model_id, topic = f"api-{unique}", f"test.api-{unique}"
    spec = dict(SEED, model_id=model_id, stream_source=f"kafka://topic={topic}",
                trigger_policy={"min_samples_per_window": 8, "window_seconds": 2}, training={"lr": 0.01})
    r = client.post("/v1/stream-finetune", json=spec, headers=AUTH)
    assert r.status_code == 202, r.text
    body = r.json()
    job_id = body["job_id"]
    try:
        assert body["submitted"] is True and body["model_id"] == model_id
        deadline = time.monotonic() + 90
        while client.get(f"/v1/stream-finetune/{model_id}", headers=AUTH).json()["job_state"] != "RUNNING":
            assert time.monotonic() < deadline, "the job never reached RUNNING"
            time.sleep(1)
        assert jobs_named(stack_config, f"streamtune-{topic}")[0]["jid"] == job_id

        # Idempotent: the same spec again answers 200 with the same body and publishes nothing.
        configs_before = len(topic_records(stack_config, f"{topic}.configs"))
        again = client.post("/v1/stream-finetune", json=spec, headers=AUTH)
        assert again.status_code == 200 and again.json() == body
        assert len(topic_records(stack_config, f"{topic}.configs")) == configs_before == 1

        # ~40 corrections over three 2 s windows (event time, after the config), one later closer.
        t0 = (int(time.time() * 1000) // 2000 + 2) * 2000
        events = [{"type": "correction", "model_id": model_id, "event_id": f"e{i}", "prompt": f"x={i};y=",
                   "corrected_completion": str((3 * i) % 10), "ts": t0 + i * 150} for i in range(40)]
        closer = {"type": "correction", "model_id": model_id, "event_id": "closer", "prompt": "x=1;y=",
                  "corrected_completion": "3", "ts": t0 + 12_000}
        r = client.post("/v1/feedback", json=events, headers=AUTH)
        assert r.status_code == 202, r.text
        assert r.json()["accepted"] == 40
        assert client.post("/v1/feedback", json=closer, headers=AUTH).status_code == 202

        mlflow = MlflowClient(tracking_uri=stack_config.mlflow_uri, registry_uri=stack_config.mlflow_uri)
        # The job registers its own versions: nothing else runs.
        deadline = time.monotonic() + 150
        while True:
            versions = client.get(f"/v1/models/{model_id}/versions", headers=AUTH)
            numbers = [v["version"] for v in versions.json()["versions"]] if versions.status_code == 200 else []
            if len(numbers) >= 3:  # three windows of 2 s; the closer's own window stays open
                break
            assert time.monotonic() < deadline, f"fewer than 3 versions registered: {versions.text}"
            time.sleep(1)
        # The job moves aliases as it registers: promote only once all three are broadcast
        # (registered, aliases moved), or its last move races ours.
        from core.messages import AdapterVersionBroadcast
        from streamtune.testing import wait_for_records
        assert len(wait_for_records(stack_config.kafka_bootstrap, f"{topic}.adapter-versions",
                                    AdapterVersionBroadcast, 3, 60)) >= 3
        status = client.get(f"/v1/stream-finetune/{model_id}", headers=AUTH).json()
        assert status["job_state"] == "RUNNING" and status["config_version"] == body["config_version"]
        assert status["last_version"]["version"] == numbers[-1] and status["last_window"] is not None
        # The job's own Flink counters (published every few seconds): 41+ samples read, none
        # rejected, the three versions' samples trained.
        counters = wait_for(lambda: ((c := client.get(f"/v1/stream-finetune/{model_id}", headers=AUTH).json()["counters"])
                            ["samples_trained"] or 0) >= 30 and c, 30, "the job's counters")
        assert counters["records_in"] >= 41 and counters["valid"] == counters["records_in"]
        assert counters["dead_lettered"] == 0 and counters["windows_fired"] >= 3

        # Promote the newest, then roll back to the first: champion follows each move.
        for target in (numbers[-1], numbers[0]):
            r = client.post(f"/v1/models/{model_id}/aliases", json={"alias": "champion", "version": target},
                            headers=AUTH)
            assert r.status_code == 200, r.text
            assert int(mlflow.get_model_version_by_alias(model_id, "champion").version) == target
        log = client.get(f"/v1/models/{model_id}/promotions", headers=AUTH).json()["promotions"]
        assert [(e["from"], e["to"]) for e in log][-1] == (numbers[-1], numbers[0])
        assert len(log) == 2

        # Stopping the job's only model stops the job with a savepoint.
        r = client.delete(f"/v1/stream-finetune/{model_id}", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["job_stopped"] is True and r.json()["savepoint"]
        assert client.get(f"/v1/stream-finetune/{model_id}", headers=AUTH).status_code == 404
    finally:
        cancel_job(stack_config, job_id)


def test_unauthenticated_mutations_get_401_and_change_nothing(stack_config, unique, tmp_path):
    client, settings = make_client(stack_config, tmp_path)
    model_id, topic = f"auth-{unique}", f"test.api-auth-{unique}"
    spec = dict(SEED, model_id=model_id, stream_source=f"kafka://topic={topic}")
    event = {"type": "click", "model_id": model_id, "event_id": "e1", "prompt": "p", "completion": "c", "ts": 1}
    wrong = {"Authorization": "Bearer wrong-token"}
    for headers in ({}, wrong, {"Authorization": TOKEN}):
        calls = [client.post("/v1/stream-finetune", json=spec, headers=headers),
                 client.delete(f"/v1/stream-finetune/{model_id}", headers=headers),
                 client.post(f"/v1/models/{model_id}/aliases", json={"version": 1}, headers=headers),
                 client.post("/v1/feedback", json=event, headers=headers),
                 client.get(f"/v1/stream-finetune/{model_id}", headers=headers)]  # reads need a token too
        for r in calls:
            assert r.status_code == 401, (r.request.method, r.request.url, r.status_code, r.text)
            assert r.headers["WWW-Authenticate"] == "Bearer"
    assert not settings.jobs_file.exists()
    assert not settings.promotion_log.exists()
    assert jobs_named(stack_config, f"streamtune-{topic}") == []
    assert topic_records(stack_config, f"{topic}.configs") == []
    assert topic_records(stack_config, topic) == []


def test_malformed_spec_gets_422_per_field_and_changes_nothing(stack_config, unique, tmp_path):
    client, settings = make_client(stack_config, tmp_path)
    topic = f"test.api-bad-{unique}"
    bad = dict(SEED, model_id="has spaces!", stream_source=f"kafka://topic={topic}",
               adapter_config={"rank": 0, "alpha": 32, "target_modules": []},
               trigger_policy={"min_samples_per_window": 50, "window_seconds": 60, "surprise": 1})
    r = client.post("/v1/stream-finetune", json=bad, headers=AUTH)
    assert r.status_code == 422, r.text
    locs = {tuple(e["loc"]) for e in r.json()["detail"]}
    assert {("body", "model_id"), ("body", "adapter_config", "rank"), ("body", "adapter_config", "target_modules"),
            ("body", "trigger_policy", "surprise")} <= locs
    r = client.post("/v1/stream-finetune", content=b'{"model_id": "x", "broken', headers=AUTH)
    assert r.status_code == 422
    # A CDC source is valid, but rows need a mapping to samples: it is applied as a pipeline.
    r = client.post("/v1/stream-finetune", headers=AUTH,
                    json=dict(SEED, model_id=f"pg-{unique}", stream_source="postgres://h/db?table=feedback"))
    assert r.status_code == 501 and "POST /v1/pipelines" in r.json()["detail"]
    assert not settings.jobs_file.exists()
    assert jobs_named(stack_config, f"streamtune-{topic}") == []
    assert topic_records(stack_config, f"{topic}.configs") == []
    # Feedback: a batch over the limit, and a bad event, change nothing either.
    small, _ = make_client(stack_config, tmp_path, max_feedback_batch=2, max_body_bytes=4096)
    event = {"type": "dwell", "model_id": "m", "event_id": "e", "prompt": "p", "completion": "c",
             "dwell_seconds": 4, "ts": 1}
    assert small.post("/v1/feedback", json=[event] * 3, headers=AUTH).status_code == 413
    assert small.post("/v1/feedback", json=dict(event, dwell_seconds=-1), headers=AUTH).status_code == 422
    assert small.post("/v1/feedback", json=dict(event, prompt="x" * 5000), headers=AUTH).status_code == 413


@pytest.mark.guarantees
def test_spec_whose_job_topics_kafka_refuses_gets_422_and_changes_nothing(stack_config, unique, tmp_path):
    """The schema takes any topic of up to 249 characters, but the job also needs T.configs …
    T.adapter-versions: the longest usable T is 232 characters, and "." is no topic at all."""
    from kafka import KafkaAdminClient

    client, settings = make_client(stack_config, tmp_path)
    for topic in (f"test.api-long-{unique}-".ljust(233, "x"), f"test.api-long-{unique}-".ljust(249, "x"), "."):
        r = client.post("/v1/stream-finetune", headers=AUTH,
                        json=dict(SEED, model_id=f"long-{unique}", stream_source=f"kafka://topic={topic}"))
        assert r.status_code == 422, r.text
        assert [e["loc"] for e in r.json()["detail"]] == [["body", "stream_source"]]
        assert jobs_named(stack_config, f"streamtune-{topic}") == []
    admin = KafkaAdminClient(bootstrap_servers=stack_config.kafka_bootstrap, request_timeout_ms=10000)
    try:
        created = [t for t in admin.list_topics() if t.startswith(f"test.api-long-{unique}")]
    finally:
        admin.close()
    assert created == [], "a topic was created for a refused spec"
    assert not settings.jobs_file.exists()


def test_feedback_event_mapping():
    from streamtune.api.models import ClickEvent, CorrectionEvent, DwellEvent, to_sample

    base = {"model_id": "m", "event_id": "e", "prompt": "p", "ts": 5}
    assert to_sample(CorrectionEvent(type="correction", corrected_completion="fixed", original_completion="bad",
                                     **base)).to_dict() == {**{k: v for k, v in base.items() if k != "event_id"},
                                                            "sample_id": "e", "completion": "fixed",
                                                            "label": "corrected", "weight": 1.0}
    assert to_sample(ClickEvent(type="click", completion="c", **base)).label == "accepted"
    assert to_sample(DwellEvent(type="dwell", completion="c", dwell_seconds=5, **base)).weight == 0.5
    assert to_sample(DwellEvent(type="dwell", completion="c", dwell_seconds=600, **base)).weight == 3.0


# ---------------------------------------------------------------- fuzzing and its oracle

SERVICES = ("Flink", "Kafka", "MLflow", "streamtune serve")


def service_named(detail: str) -> str | None:
    """The service a 503's detail blames: the first of Flink, Kafka, MLflow and the inference
    server (GET /v1/models/{id}/serving) it names."""
    found = sorted((detail.lower().find(name.lower()), name) for name in SERVICES if name.lower() in detail.lower())
    return found[0][1] if found else None


def service_answers(stack, service: str) -> bool:
    """Whether `stack`'s `service` answers a probe over its own protocol right now."""
    try:
        if service == "Flink":
            return requests.get(f"{stack.flink_rest_url}/overview", timeout=5).status_code == 200
        if service == "MLflow":
            return requests.get(f"{stack.mlflow_uri}/health", timeout=5).status_code == 200
        if service == "streamtune serve":  # where the app looks for it: STREAMTUNE_SERVE_URL unset
            from streamtune.api.gateway import SERVE_PORT

            return requests.get(f"http://{stack.host}:{SERVE_PORT}/healthz", timeout=5).status_code == 200
        from kafka import KafkaAdminClient

        admin = KafkaAdminClient(bootstrap_servers=stack.kafka_bootstrap, request_timeout_ms=5000)
        try:
            admin.list_topics()
            return True
        finally:
            admin.close()
    except Exception:  # any failure to answer is the service being down, which is what is asked
        return False


def server_error_check(stack):
    """The oracle, as a schemathesis check: a 5xx fails unless it is a documented 501, or a
    documented 503 whose named service in `stack` does not answer a probe right after it."""

    def no_5xx_unless_its_service_is_down(ctx, response, case):
        status = response.status_code
        if status < 500:
            return
        documented = case.operation.definition.raw.get("responses", {})
        seen = f"{case.operation.label}: {status} {response.text[:300]}"
        if status == 501 and "501" in documented:
            return
        if status != 503 or "503" not in documented:
            raise AssertionError(f"undocumented server error: {seen}")
        try:
            detail = str(response.json()["detail"])
        except (ValueError, KeyError, TypeError):
            raise AssertionError(f"503 without a JSON detail: {seen}") from None
        service = service_named(detail)
        if service is None:
            raise AssertionError(f"503 that names no service: {seen}")
        if service_answers(stack, service):
            raise AssertionError(f"503 blames {service}, but {service} answers: {seen}")

    return no_5xx_unless_its_service_is_down


# service: (the StackConfig port that reaches it, the request whose first stack call needs it)
OUTAGES = {"Flink": ("flink_rest_port", "POST", "/v1/stream-finetune"),
           "Kafka": ("kafka_port", "POST", "/v1/stream-finetune"),
           "MLflow": ("mlflow_port", "GET", "/v1/models/{model_id}/versions")}


def planted_503(stack_config, service: str, unique: str, tmp_path):
    """A real 503 blaming `service`: from an app whose port for it is closed, while the real
    service keeps answering. Answers (case, response, the app's stack)."""
    import dataclasses

    import schemathesis

    from streamtune.api import ApiSettings, create_app

    port_field, method, path = OUTAGES[service]
    down = dataclasses.replace(stack_config, **{port_field: closed_port()})
    app = create_app(ApiSettings(stack=down, token=TOKEN, jobs_file=tmp_path / "api" / "jobs.json",
                                 promotion_log=tmp_path / "api" / "promotions.jsonl",
                                 artifact_store=str(tmp_path / "adapters")))
    operation = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)[path][method]
    if method == "POST":  # a topic no job serves: Flink is asked first, then Kafka creates topics
        case = operation.Case(body=dict(SEED, model_id=f"oracle-{unique}",
                                        stream_source=f"kafka://topic=test.api-oracle-{unique}"),
                              media_type="application/json")
    else:
        case = operation.Case(path_parameters={"model_id": f"oracle-{unique}"})
    response = case.call(headers=AUTH)
    assert response.status_code == 503 and service in response.json()["detail"], response.text
    return case, response, down


@pytest.mark.guarantees
# streamtune serve: no server runs to answer the probe. Kafka's outage takes a minute (the
# client's metadata timeout).
@pytest.mark.parametrize("service", OUTAGES)
def test_fuzz_oracle_flags_a_503_while_its_service_answers(service, stack_config, unique, tmp_path, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a closed MLflow port fails at once
    case, response, down = planted_503(stack_config, service, unique, tmp_path)
    # Probing the stack the app was given: the service is down, the 503 is the right answer.
    server_error_check(down)(None, response, case)
    # Probing the real stack: the service answers, so the same 503 is a bug the oracle must flag.
    with pytest.raises(AssertionError, match=f"503 blames {service}, but {service} answers"):
        server_error_check(stack_config)(None, response, case)
    # Whatever is down, any other 5xx fails, and so does a 503 that names no service.
    for status, detail in ((500, "Internal Server Error"), (502, f"{service} gateway"), (503, "overloaded")):
        other = SimpleNamespace(status_code=status, text=detail, json=lambda d=detail: {"detail": d})
        with pytest.raises(AssertionError):
            server_error_check(down)(None, other, case)


def submittable(spec: dict, topic: str) -> dict:
    """A generated spec with what the schema cannot say made true: a source on `topic`,
    distinct non-empty target_modules, max_samples_per_step >= min_samples_per_window.
    Every other generated value stays, so the submission logic sees them."""
    spec = {**spec, "stream_source": f"kafka://topic={topic}"}
    adapter, policy = spec.get("adapter_config"), spec.get("trigger_policy")
    if isinstance(adapter, dict) and isinstance(adapter.get("target_modules"), list):
        modules = list(dict.fromkeys(m for m in adapter["target_modules"] if m))
        spec["adapter_config"] = {**adapter, "target_modules": modules or ["q_proj"]}
    if isinstance(policy, dict) and isinstance(policy.get("min_samples_per_window"), (int, float)):
        spec["trigger_policy"] = {**policy, "max_samples_per_step": max(policy.get("max_samples_per_step", 1024),
                                                                        policy["min_samples_per_window"])}
    return spec


def cancel_jobs_named(stack, names: set[str]) -> list[str]:
    """Cancel every live Flink job with one of `names` (Flink REST); wait until none is live.
    Answers the ids of all jobs with those names, live or not."""
    from streamtune.api.gateway import LIVE_STATES

    def jobs():
        return [j for j in requests.get(f"{stack.flink_rest_url}/jobs/overview", timeout=10).json()["jobs"]
                if j["name"] in names]

    for job in jobs():
        if job["state"] in LIVE_STATES:
            requests.patch(f"{stack.flink_rest_url}/jobs/{job['jid']}", params={"mode": "cancel"}, timeout=10)
    deadline = time.monotonic() + 60
    while live := [j["jid"] for j in jobs() if j["state"] in LIVE_STATES]:
        assert time.monotonic() < deadline, f"fuzz jobs still live after cancel: {live}"
        time.sleep(1)
    return [j["jid"] for j in jobs()]


@pytest.mark.guarantees
def test_fuzzing_openapi_against_the_real_stack(stack_config, base_model, unique, tmp_path):
    """Every operation, positive and negative cases; no 5xx unless its service is down, every
    answer as documented. Positive specs train from topics of this test's own namespace."""
    import collections

    import schemathesis
    from hypothesis import HealthCheck, given, settings, strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,
                                                   status_code_conformance)

    from streamtune.api import ApiSettings, create_app
    from streamtune.api.gateway import job_name

    # The oracle's silence means something only if it catches a planted false 503.
    planted_case, planted, _ = planted_503(stack_config, "Flink", unique, tmp_path / "planted")
    with pytest.raises(AssertionError, match="503 blames Flink, but Flink answers"):
        server_error_check(stack_config)(None, planted, planted_case)

    namespace = f"test.fuzz-{unique}"
    # Two topics a job can serve (so two jobs at most), the second the longest whose job
    # topics Kafka accepts (T.adapter-versions: 249 characters), and two the schema accepts
    # but Kafka refuses as a job's topics.
    topics = [f"{namespace}.a"] + [f"{namespace}.long-".ljust(n, "x") for n in (232, 233, 249)]
    app = create_app(ApiSettings(stack=stack_config, token=TOKEN, jobs_file=tmp_path / "api" / "jobs.json",
                                 promotion_log=tmp_path / "api" / "promotions.jsonl",
                                 artifact_store=str(tmp_path / "adapters"), base_model=base_model))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    checks = [server_error_check(stack_config), status_code_conformance, content_type_conformance,
              response_schema_conformance]
    answered: collections.Counter = collections.Counter()  # (operation, status) -> count
    reported_jobs: set[str] = set()  # job ids of 202 answers that say they submitted a job
    failures = []

    def call(case):
        response = case.call(headers=AUTH)
        answered[(case.operation.label, response.status_code)] += 1
        if case.operation.label == "POST /v1/stream-finetune" and response.status_code == 202:
            body = response.json()
            if body.get("submitted"):
                reported_jobs.add(body.get("job_id"))
        case.validate_response(response, checks=checks)
        return response

    try:
        # The example spec on a namespace topic: one job certainly submitted before fuzzing.
        seeded = schema["/v1/stream-finetune"]["POST"].Case(
            body=dict(SEED, stream_source=f"kafka://topic={topics[0]}"), media_type="application/json")
        assert call(seeded).status_code == 202
        for result in schema.get_all_operations():
            operation = result.ok()
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                # Positive specs reach submission only as `submittable` makes them (our topics).
                submits = operation.label == "POST /v1/stream-finetune" and mode == GenerationMode.POSITIVE

                @settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
                @given(case=operation.as_strategy(generation_mode=mode), topic=st.sampled_from(topics))
                def run(case, topic):
                    if submits and isinstance(case.body, dict):
                        case.body = submittable(case.body, topic)
                    call(case)

                try:
                    run()
                except Unsatisfiable:  # nothing to make invalid: an operation with no parameters or body
                    if mode != GenerationMode.NEGATIVE:
                        failures.append(f"{operation.label} ({mode}): no case could be generated")
                except Exception as e:  # collect every operation's failure, not just the first
                    failures.append(f"{operation.label} ({mode}): {e}")
    finally:
        jobs = cancel_jobs_named(stack_config, {job_name(t) for t in topics})
    assert not failures, "\n\n".join(failures)
    # Fuzzing reached the submission logic: generated specs were submitted or hot-updated.
    accepted = sum(n for (label, status), n in answered.items()
                   if label == "POST /v1/stream-finetune" and status in (200, 202))
    assert accepted >= 5, dict(answered)
    # Every job on the cluster for our topics is one an answer reported, and the other way round.
    assert set(jobs) == reported_jobs, (jobs, reported_jobs)
