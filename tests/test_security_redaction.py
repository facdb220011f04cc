"""Personal data at the edge (core/redaction.py, operators/validate.py): a planted e-mail
address reaches no training window, version record, DLQ record or MLflow run.

The training job runs on the stack's Flink cluster twice, with the same feedback: once with
redaction on (the default) and once with STREAMTUNE_REDACT=off (for tests and demos only).
The address is planted in
- a valid sample of a configured model (trained: its window, version and MLflow run),
- a valid sample of a model nobody configured: after the grace period the trainer dead-letters
  the sample exactly as it received it, which shows what a window would have held,
- a sample that fails its contract and a record that is not JSON (dead-lettered at the edge).
With redaction on the address is nowhere and the job's `redactions` counters count it; with it
off the same search finds it in the DLQ (the edge's and the trainer's): the test can fail.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from core.messages import DeadLetter, FeedbackSample, VersionRecord
from streamtune.feedback import digit_samples, send_config, send_raw, send_samples
from streamtune.stack.flink import cancel_job, job_counters, submit_detached
from streamtune.testing import job_args, job_topics, spec, wait_for, wait_for_records
from streamtune.tinymodel import digit_pairs

pytestmark = [pytest.mark.security]
REPO = Path(__file__).resolve().parents[1]
T0 = 1_750_000_000_000  # epoch aligned: one 2 s window
EMAIL = "jane.planted.{}@example.org"


def _grep(address: str, obj) -> bool:
    return address in (obj if isinstance(obj, str) else json.dumps(obj, default=str))


def _mlflow_texts(tracking_uri: str, model_id: str) -> list[str]:
    """Every run of the model's experiment as text: name, params, tags, metrics keys and the
    contents of every artifact that is text (lineage.json, adapter_config.json, ...)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri, tracking_uri)
    experiment = client.get_experiment_by_name(f"streamtune/{model_id}")
    if experiment is None:
        return []
    texts = []
    for run in client.search_runs([experiment.experiment_id]):
        texts.append(json.dumps({"name": run.info.run_name, "params": run.data.params, "tags": run.data.tags,
                                 "metrics": list(run.data.metrics)}))
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(client.download_artifacts(run.info.run_id, "", tmp))
            for path in local.rglob("*"):
                if path.is_file() and path.suffix in (".json", ".txt", ".yaml", ".md", ""):
                    texts.append(path.read_text(errors="replace"))
    for mv in client.search_model_versions(f"name = '{model_id}'"):
        texts.append(json.dumps({"tags": mv.tags, "description": mv.description, "source": mv.source}))
    return texts


@pytest.fixture(scope="module", params=["on", "off"])
def run(request, stack_config, base_model, tmp_path_factory):
    mode = request.param
    u = f"{time.time_ns() % 10**9:x}{mode}"
    address = EMAIL.format(u)
    bootstrap = stack_config.kafka_bootstrap
    topics = job_topics(bootstrap, f"test.redaction-{u}")
    model, ghost = f"pii-{u}", f"pii-ghost-{u}"
    saved = os.environ.get("STREAMTUNE_REDACT")
    os.environ["STREAMTUNE_REDACT"] = "pii" if mode == "on" else "off"  # read where `flink run` builds the job
    try:
        job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
            topics, base_model, tmp_path_factory.mktemp("adapters"), "--bootstrap-server", bootstrap,
            "--unknown-model-grace-seconds", "2", "--checkpoint-interval-ms", "1000", "--job-name", f"redact-{u}"))
    finally:
        if saved is None:
            os.environ.pop("STREAMTUNE_REDACT", None)
        else:
            os.environ["STREAMTUNE_REDACT"] = saved
    try:
        send_config(bootstrap, topics["configs"], spec(model, topics, min_samples=8, window_seconds=2), T0)
        samples = digit_samples(model, digit_pairs(12, seed=11), T0, 100, id_prefix="p")
        samples[0] = samples[0].model_copy(update={"prompt": f"reply to {address} please. {samples[0].prompt}"})
        samples[1] = samples[1].model_copy(update={"completion": f"{samples[1].completion} (cc {address})"})
        planted_ghost = FeedbackSample(model_id=ghost, sample_id="g0", prompt=f"I am {address}", completion="hi",
                                       ts=T0 + 50)
        send_samples(bootstrap, topics["feedback"], [*samples, planted_ghost])
        invalid = {"model_id": model, "sample_id": "bad", "prompt": f"mail {address}", "completion": "", "ts": T0}
        send_raw(bootstrap, topics["feedback"], model, json.dumps(invalid), T0 + 60)
        send_raw(bootstrap, topics["feedback"], model, '{"note": "' + address, T0 + 70)  # not JSON
        closer = digit_samples(model, digit_pairs(1, seed=12), T0 + 10_000, 1, id_prefix="closer")
        send_samples(bootstrap, topics["feedback"], closer)
        versions = wait_for_records(bootstrap, topics["versions"], VersionRecord, 1, timeout=120)
        dlq = wait_for_records(bootstrap, topics["dlq"], DeadLetter, 3, timeout=60)
        assert len(versions) >= 1 and len(dlq) >= 3, (versions, dlq)
        texts = wait_for(lambda: (t := _mlflow_texts(stack_config.mlflow_uri, model))
                         and any("lineage" in x or "sample_ids" in x for x in t) and t,
                         60, "the version's MLflow run", interval=1)
        counters = wait_for(lambda: (c := job_counters(stack_config.flink_rest_url, job))
                            and c.get("validate.records_in", 0) >= len(samples) + 4 and c,
                            30, "the validate counters", interval=1)
        yield {"mode": mode, "address": address, "versions": versions, "dlq": dlq, "mlflow": texts,
               "counters": counters, "model": model}
    finally:
        cancel_job(stack_config, job)


def test_planted_address_reaches_no_dlq_record(run):
    found = [d.reason for d in run["dlq"] if _grep(run["address"], d.to_json())]
    reasons = sorted(d.reason for d in run["dlq"])
    assert {"schema", "bad_json", "unknown_model"} <= set(reasons), reasons
    if run["mode"] == "on":
        assert found == [], f"the address reached the DLQ in {found}"
        assert all("[email]" in (d.payload or "") for d in run["dlq"]), "each planted record was redacted"
    else:  # the control: without redaction the edge's and the trainer's dead letters carry it
        assert sorted(found) == ["bad_json", "schema", "unknown_model"], found


def test_planted_address_reaches_no_training_window(run):
    """The trainer dead-letters an unconfigured model's sample as it received it: what its
    window would have held."""
    unknown = [d for d in run["dlq"] if d.reason == "unknown_model"]
    assert len(unknown) == 1
    prompt = FeedbackSample.from_json(unknown[0].payload).prompt
    assert (run["address"] in prompt) is (run["mode"] == "off"), prompt


def test_planted_address_reaches_no_version_record_or_mlflow_run(run):
    mine = [v for v in run["versions"] if v.model_id == run["model"]]
    assert mine and any(set(v.lineage.sample_ids) & {"p0", "p1"} for v in mine), "the planted samples trained"
    assert not [v.version_id for v in mine if _grep(run["address"], v.to_json())]
    assert not [t for t in run["mlflow"] if run["address"] in t]


def test_redactions_are_counted(run):
    c = run["counters"]
    if run["mode"] == "on":
        # two trained samples, the ghost's sample, two dead letters' payloads
        assert c.get("validate.redactions_email", 0) >= 5 and c["validate.redactions"] >= 5, c
    else:
        assert c.get("validate.redactions", 0) == 0, c


# -- the API's own dead letters (POST /v1/feedback refuses an event before any job sees it) ---
@pytest.mark.parametrize("defence", ["on", "off"])
def test_api_dead_letters_carry_no_address(defence, stack_config, unique, tmp_path, monkeypatch):
    """An event stamped ten years ahead is dead-lettered by the API itself (`timestamp`), with
    its payload: redacted there too; STREAMTUNE_REDACT=off (tests/demos only) keeps the address."""
    from fastapi.testclient import TestClient

    from connectors.kafka import create_topic, read_topic
    from streamtune.api import ApiSettings, create_app
    from streamtune.api.jobs_file import JobsFile

    monkeypatch.setenv("STREAMTUNE_REDACT", "pii" if defence == "on" else "off")
    address = EMAIL.format(unique)
    model_id, topic = f"pii-api-{unique}", f"test.pii-api-{unique}"
    for t in (topic, f"{topic}.dlq"):
        create_topic(stack_config.kafka_bootstrap, t)
    jobs_file = tmp_path / "api" / "jobs.json"
    JobsFile(jobs_file).save({"models": {model_id: {"topic": topic}}, "jobs": {}})
    settings = ApiSettings(stack=stack_config, token="admin-token-0123456789", feedback_token="fb-token-0123456789",
                           jobs_file=jobs_file, promotion_log=tmp_path / "api" / "promotions.jsonl",
                           artifact_store=str(tmp_path / "adapters"))
    future = int(time.time() * 1000) + 10 * 365 * 86_400_000
    event = {"type": "correction", "model_id": model_id, "event_id": "e0", "prompt": f"write to {address}",
             "corrected_completion": "ok", "ts": future}
    with TestClient(create_app(settings)) as client:
        r = client.post("/v1/feedback", json=[event], headers={"Authorization": "Bearer fb-token-0123456789"})
    assert r.status_code == 202 and r.json()["dead_lettered"] == 1, r.text
    letters = [DeadLetter.from_json(rec.value)
               for rec in read_topic(stack_config.kafka_bootstrap, f"{topic}.dlq", timeout=8, idle=1.0,
                                     read_committed=False)]
    assert [d.reason for d in letters] == ["timestamp"]
    assert (address in letters[0].payload) is (defence == "off"), letters[0].payload
