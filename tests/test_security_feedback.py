"""Feedback that cannot steer production, at the edge (marker `security`).

An attacker holding only the feedback token (it is embedded in public pages) and the
inference token posts to POST /v1/feedback, or writes straight to a job's input topic:

- forged response ids: corrections citing ids no server issued are dead-lettered
  (`unsigned_response`) instead of reaching the topic the guard judges from;
- weight: a dwell of ten minutes weighs no more than the cap (1);
- rate: a token's events beyond its bucket get 429 with Retry-After, nothing produced;
- event time: a `ts` ten years ahead (or a month old) is dead-lettered (`timestamp`) by the
  API; in the job, a far-future record is dead-lettered and does not move the watermark,
  so windows still close on normal records' time.

Each test runs twice: with the defence on (the attack fails) and with it off through the
switch documented for tests and demos (the attack succeeds), so the suite shows each test
can fail. The API runs in process (TestClient) as in tests/test_api.py, against the local
stack's Kafka; the job test submits jobs/stream_finetune.py to the local Flink cluster.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from core.messages import DeadLetter, FeedbackSample
from core.response_ids import new_response_id

pytestmark = [pytest.mark.security]
REPO = Path(__file__).resolve().parents[1]
ADMIN, FEEDBACK = "admin-token-0123456789", "feedback-token-0123456789"
FEEDBACK_AUTH = {"Authorization": f"Bearer {FEEDBACK}"}
KEY = b"response-signing-key-for-tests-0123"
YEAR_MS = 365 * 86_400_000


def feedback_api(stack, tmp_path, unique, **limits):
    """An in-process control plane whose jobs file registers one model on a fresh topic (no
    Flink job: POST /v1/feedback only needs the model's topic); (client, model_id, topic)."""
    from fastapi.testclient import TestClient

    from connectors.kafka import create_topic
    from streamtune.api import ApiSettings, create_app
    from streamtune.api.jobs_file import JobsFile

    model_id, topic = f"fb-{unique}", f"test.secfb-{unique}"
    for t in (topic, f"{topic}.dlq"):
        create_topic(stack.kafka_bootstrap, t)
    jobs_file = tmp_path / "api" / "jobs.json"
    JobsFile(jobs_file).save({"models": {model_id: {"topic": topic}}, "jobs": {}})
    settings = ApiSettings(stack=stack, token=ADMIN, feedback_token=FEEDBACK, jobs_file=jobs_file,
                           promotion_log=tmp_path / "api" / "promotions.jsonl",
                           artifact_store=str(tmp_path / "adapters"), **limits)
    return TestClient(create_app(settings)), model_id, topic


def samples_on(stack, topic: str) -> list:
    from connectors.kafka import read_topic

    return read_topic(stack.kafka_bootstrap, topic, timeout=8, idle=1.0, read_committed=False)


def correction(model_id: str, i: int, ts: int, request_id: str | None = None) -> dict:
    event = {"type": "correction", "model_id": model_id, "event_id": f"e{i}", "prompt": f"x={i};y=",
             "corrected_completion": "poison", "ts": ts}
    return {**event, "request_id": request_id} if request_id else event


@pytest.mark.parametrize("defence", ["on", "off"])
def test_corrections_citing_forged_response_ids_are_dead_lettered(defence, stack_config, unique, tmp_path):
    """On: only the correction citing an id a server signed reaches the feedback topic; the
    made-up and the re-signed ids are dead-lettered (`unsigned_response`), listed in the answer
    and on the job's DLQ topic. Off (no signing key): every forged judgment reaches the topic."""
    client, model_id, topic = feedback_api(stack_config, tmp_path, unique,
                                           response_signing_key=KEY if defence == "on" else None)
    now = int(time.time() * 1000)
    served = new_response_id(KEY)  # what streamtune serve answers with the deployment's key
    made_up = "cmpl-" + "ab" * 16
    other_key = new_response_id(b"another-deployment-key-0123")
    events = [correction(model_id, 0, now, served), correction(model_id, 1, now, made_up),
              correction(model_id, 2, now, other_key)]
    r = client.post("/v1/feedback", json=events, headers=FEEDBACK_AUTH)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["accepted"] + body["dead_lettered"] == len(events)
    on_topic = [FeedbackSample.from_json(rec.value) for rec in samples_on(stack_config, topic)]
    if defence == "on":
        assert body["accepted"] == 1 and [d["event_id"] for d in body["dead_letters"]] == ["e1", "e2"]
        assert {d["reason"] for d in body["dead_letters"]} == {"unsigned_response"}
        assert [s.request_id for s in on_topic] == [served]
        letters = [DeadLetter.from_json(rec.value) for rec in samples_on(stack_config, f"{topic}.dlq")]
        assert sorted((d.reason, d.model_id, d.kind) for d in letters) == [("unsigned_response", model_id, "sample")] * 2
        assert made_up in " ".join(d.payload for d in letters)
    else:
        assert body["accepted"] == 3 and body["dead_lettered"] == 0
        assert sorted(s.request_id for s in on_topic) == sorted([served, made_up, other_key])


@pytest.mark.parametrize("defence", ["on", "off"])
def test_dwell_weight_is_capped(defence, stack_config, unique, tmp_path):
    """On: a ten-minute dwell weighs 1 like a click. Off (cap 0): it weighs 3 samples."""
    client, model_id, topic = feedback_api(stack_config, tmp_path, unique,
                                           feedback_max_weight=1.0 if defence == "on" else 0)
    event = {"type": "dwell", "model_id": model_id, "event_id": "d1", "prompt": "x=1;y=", "completion": "poison",
             "dwell_seconds": 600, "ts": int(time.time() * 1000)}
    assert client.post("/v1/feedback", json=event, headers=FEEDBACK_AUTH).status_code == 202
    [sample] = [FeedbackSample.from_json(rec.value) for rec in samples_on(stack_config, topic)]
    assert sample.weight == (1.0 if defence == "on" else 3.0)


@pytest.mark.parametrize("defence", ["on", "off"])
def test_a_token_beyond_its_rate_gets_429_and_produces_nothing(defence, stack_config, unique, tmp_path):
    """On (1 event/s, burst 5): a second batch of 5 at once is refused with Retry-After and
    the topic holds the first 5 only. Off (rate 0): all 10 are produced."""
    client, model_id, topic = feedback_api(stack_config, tmp_path, unique, feedback_burst=5,
                                           feedback_rate=1.0 if defence == "on" else 0)
    now = int(time.time() * 1000)
    first = client.post("/v1/feedback", json=[correction(model_id, i, now) for i in range(5)], headers=FEEDBACK_AUTH)
    second = client.post("/v1/feedback", json=[correction(model_id, i, now) for i in range(5, 10)],
                         headers=FEEDBACK_AUTH)
    assert first.status_code == 202, first.text
    if defence == "on":
        assert second.status_code == 429, second.text
        assert int(second.headers["Retry-After"]) >= 1
        assert len(samples_on(stack_config, topic)) == 5
    else:
        assert second.status_code == 202, second.text
        assert len(samples_on(stack_config, topic)) == 10


@pytest.mark.parametrize("defence", ["on", "off"])
def test_api_dead_letters_event_times_beyond_skew_or_retention(defence, stack_config, unique, tmp_path):
    """On: a click stamped ten years ahead and one a month old are dead-lettered (`timestamp`),
    a click stamped now is produced. Off (skew and age 0): the far-future `ts` becomes the
    record timestamp on the feedback topic, the one a job's watermark follows."""
    limits = {} if defence == "on" else {"feedback_max_skew_ms": 0, "feedback_max_age_ms": 0}
    client, model_id, topic = feedback_api(stack_config, tmp_path, unique, **limits)
    now = int(time.time() * 1000)
    future, old = now + 10 * YEAR_MS, now - 30 * 86_400_000
    events = [correction(model_id, 0, now), correction(model_id, 1, future), correction(model_id, 2, old)]
    r = client.post("/v1/feedback", json=events, headers=FEEDBACK_AUTH)
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["accepted"] + body["dead_lettered"] == len(events)
    stamps = sorted(rec.timestamp for rec in samples_on(stack_config, topic))
    if defence == "on":
        assert [(d["event_id"], d["reason"]) for d in body["dead_letters"]] == [("e1", "timestamp"),
                                                                                ("e2", "timestamp")]
        assert stamps == [now]
        letters = [DeadLetter.from_json(rec.value) for rec in samples_on(stack_config, f"{topic}.dlq")]
        assert sorted(d.source.timestamp for d in letters) == [old, future]
        assert {d.reason for d in letters} == {"timestamp"}
    else:
        assert body["accepted"] == 3
        assert stamps == [old, now, future]


def test_serve_beyond_loopback_needs_a_signing_key_unless_insecure(monkeypatch, tmp_path):
    """streamtune serve on 0.0.0.0 refuses to start without a response signing key; with
    --insecure (tests and demos only) it starts with unsigned ids; with a key file it signs."""
    from core.errors import ConfigError
    from core.response_ids import verify_response_id
    from streamtune.serve.cli import response_signing_key

    monkeypatch.delenv("STREAMTUNE_RESPONSE_SIGNING_KEY", raising=False)
    monkeypatch.delenv("STREAMTUNE_RESPONSE_SIGNING_KEY_FILE", raising=False)
    args = dict(host="0.0.0.0", insecure=False, response_signing_key_file=None)
    with pytest.raises(ConfigError, match="without a response signing key"):
        response_signing_key(argparse.Namespace(**args))
    assert response_signing_key(argparse.Namespace(**{**args, "insecure": True})) is None
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key = response_signing_key(argparse.Namespace(**{**args, "response_signing_key_file": str(key_file)}))
    assert key == KEY and verify_response_id(KEY, new_response_id(key))


@pytest.mark.parametrize("defence", ["on", "off"])
def test_job_far_future_record_does_not_move_event_time(defence, stack_config, base_model, unique, tmp_path):
    """A producer writes straight to the job's topic. Ten samples of window W1 and ten of W2:
    W1 closes on W2's samples (version 1) while W2 waits for a later sample (the config, stamped
    at W1's start, moves event time no further than the samples do). Then one sample
    stamped ten years ahead. On: it is dead-lettered (`timestamp`, kind sample) and W2 closes
    only when a normal sample passes its end (version 2, its ten samples). Off
    (--max-event-skew-ms 0): the far-future record alone closes W2: event time moved forward."""
    from core.messages import VersionRecord
    from streamtune.feedback import digit_samples, send_config, send_samples
    from streamtune.stack.flink import cancel_job, job_state, submit_detached
    from streamtune.testing import input_watermark, job_args, job_topics, spec, wait_for, wait_for_records
    from streamtune.tinymodel import digit_pairs

    boot = stack_config.kafka_bootstrap
    topics = job_topics(boot, f"test.secfb-job-{unique}")
    skew = [] if defence == "on" else ["--max-event-skew-ms", "0"]
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / "store", "--bootstrap-server", boot, "--tracking-uri", stack_config.mlflow_uri,
        "--checkpoint-interval-ms", "1000", "--idle-close-ms", "600000", "--no-register",
        "--job-name", f"secfb-{unique}", *skew))
    try:
        wait_for(lambda: job_state(stack_config, job) == "RUNNING", 90, "the job to run")
        model_id, t0 = f"ev-{unique}", 1_776_000_000_000  # past windows of 2 s: W1 = [t0, t0+2s), W2 after it
        # The config comes through a source of its own (jobs/wiring.py input_rows): once both
        # sources are idle the job's watermark is the higher of the two, so the config is stamped
        # at W1's start, where it cannot close W2 by itself.
        send_config(boot, topics["configs"], spec(model_id, topics, min_samples=8, window_seconds=2), t0)
        # The samples go once validate's Python worker has started (the config's watermark is
        # through it). A Python operator holds a watermark until its bundle ends but passes on
        # "idle" at once, and Flink drops a watermark sent after "idle": samples sent into a
        # worker still starting could see their watermark lost once both sources fell idle,
        # and here (idle close off) nothing else would close W1.
        wait_for(lambda: input_watermark(stack_config, job, "lora-trainer") >= t0, 400,
                 "the config's watermark through validate")
        send_samples(boot, topics["feedback"], digit_samples(model_id, digit_pairs(10, seed=4), t0 + 100, 100, "a")
                     + digit_samples(model_id, digit_pairs(10, seed=5), t0 + 2100, 100, "b"))
        # The first version waits on the Python workers' start and the base model's load:
        # minutes on two loaded cores, so a generous bound (it returns as soon as it is there).
        [first] = wait_for_records(boot, topics["versions"], VersionRecord, 1, 400)
        assert (first.window_start, first.metrics.samples) == (t0, 10), first

        far = digit_samples(model_id, digit_pairs(1, seed=9), int(time.time() * 1000) + 10 * YEAR_MS, 1, "far")
        send_samples(boot, topics["feedback"], far)
        if defence == "off":
            versions = wait_for_records(boot, topics["versions"], VersionRecord, 2, 120)
            assert [(v.window_start, v.metrics.samples) for v in versions] == [(t0, 10), (t0 + 2000, 10)], versions
            return
        [letter] = wait_for_records(boot, topics["dlq"], DeadLetter, 1, 120)
        assert (letter.reason, letter.kind, letter.source.timestamp) == ("timestamp", "sample", far[0].ts), letter
        assert len(wait_for_records(boot, topics["versions"], VersionRecord, 2, 0)) == 1, "W2 closed by the far record"
        send_samples(boot, topics["feedback"], digit_samples(model_id, digit_pairs(1, seed=6), t0 + 4100, 1, "c"))
        versions = wait_for_records(boot, topics["versions"], VersionRecord, 2, 120)
        assert [(v.window_start, v.metrics.samples) for v in versions] == [(t0, 10), (t0 + 2000, 10)], versions
    finally:
        cancel_job(stack_config, job)
