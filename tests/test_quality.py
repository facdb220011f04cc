"""Learning quality on the local stack: the promotion gate, replay and a hot tolerance update,
through Kafka, the Flink job (trainer and registration) and MLflow.

Two models learn task A, then the conflicting task B (streamtune/conflicting_tasks.py), in
one job. `plain` has the gate only: its versions on B forget A, the forgetting guard refuses
them and the A champion stays, until a spec update loosens the tolerance. `replay` also
replays older samples: it learns B without forgetting A, and such a version is promoted.
What the gate decided is checked on the version records, on MLflow (aliases and tags), and
by loading each `champion` from MLflow with plain PEFT and measuring it on fresh held-out
sets of both tasks.

Pseudo-labels (the last test) run in a job of their own: inference-log records of known
confidence around a spec's threshold, checked on the versions' lineage, the review topic,
the DLQ and the job's own counters.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from connectors.kafka import create_topic
from connectors.mlflow_registry import find_version, make_client
from core.messages import (AdapterVersionBroadcast, DeadLetter, FeedbackSample, FinetuneSpec, InferenceRecord,
                           RetrainTrigger, ReviewRecord, VersionRecord)
from streamtune.conflicting_tasks import digits_of, task_a, task_b
from streamtune.demo import champion_exact_match
from streamtune.feedback import digit_samples, producer, send_config, send_samples
from streamtune.stack.flink import cancel_job, job_counters, submit_detached
from streamtune.testing import job_args, job_topics, records_read, spec, wait_for, wait_for_records
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.quality
REPO = Path(__file__).resolve().parents[1]
T0 = 1_750_000_000_000
WINDOW_MS, PER_WINDOW = 2000, 64
A_WINDOWS, B1_WINDOWS, B2_WINDOWS, REPLAY_B_WINDOWS = 14, 6, 2, 14
EVALUATION = {"holdout_fraction": 0.25, "recent_size": 32, "retained_size": 128, "tolerance": 0.05,
              "forgetting_tolerance": 0.1}


def quality_spec(model_id: str, topics: dict, **sections) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": f"kafka://topic={topics['feedback']}",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": WINDOW_MS // 1000},
        "training": {"lr": 0.01, "micro_batch_size": 32, "epochs": 4}, "seed": 7, **sections})


def windows(model_id: str, pairs: list, first_window: int, prefix: str):
    """PER_WINDOW samples per window from `first_window` on, evenly spread in event time."""
    return digit_samples(model_id, pairs, T0 + first_window * WINDOW_MS, WINDOW_MS / PER_WINDOW, id_prefix=prefix)


@pytest.fixture(scope="module")
def run(stack_config, base_model, tmp_path_factory):
    bs = stack_config.kafka_bootstrap
    u = f"{time.time_ns() % 10**9:x}"
    topics = job_topics(bs, f"test.quality-{u}")
    plain, replay = f"plain-{u}", f"replay-{u}"
    held_a, held_b = task_a(100, seed=999), task_b(100, seed=998)
    exclude = digits_of(held_a) | digits_of(held_b)
    a = task_a(PER_WINDOW * A_WINDOWS, seed=1, exclude=exclude)
    b = task_b(PER_WINDOW * REPLAY_B_WINDOWS, seed=2, exclude=exclude)
    b_end = A_WINDOWS + B1_WINDOWS  # the window where plain's spec update takes effect
    plain_samples = (windows(plain, a, 0, "a") + windows(plain, b[:PER_WINDOW * (B1_WINDOWS + B2_WINDOWS)], A_WINDOWS, "b")
                     + windows(plain, b[:1], b_end + B2_WINDOWS, "closer"))
    replay_samples = (windows(replay, a, 0, "a") + windows(replay, b, A_WINDOWS, "b")
                      + windows(replay, b[:1], A_WINDOWS + REPLAY_B_WINDOWS, "closer"))
    # In event-time order, as a live stream would be.
    ordered = sorted(plain_samples + replay_samples, key=lambda s: s.ts)
    cut = T0 + b_end * WINDOW_MS  # everything before plain's first window under the update, and one sample
    first = [s for s in ordered if s.ts < cut] + [s for s in ordered if s.ts >= cut][:1]
    later = [s for s in ordered if s.ts >= cut][1:]
    specs = {plain: quality_spec(plain, topics, evaluation=EVALUATION),
             replay: quality_spec(replay, topics, evaluation=EVALUATION, replay={"buffer_size": 512, "ratio": 2.0})}
    loosened = quality_spec(plain, topics, evaluation={**EVALUATION, "forgetting_tolerance": 1.0, "tolerance": 1.0})
    expected = {plain: A_WINDOWS + B1_WINDOWS + B2_WINDOWS, replay: A_WINDOWS + REPLAY_B_WINDOWS}

    started = time.monotonic()
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path_factory.mktemp("adapters"), "--bootstrap-server", bs,
        "--checkpoint-interval-ms", "1000", "--job-name", f"quality-{u}"))
    try:
        for spec in specs.values():
            send_config(bs, topics["configs"], spec, T0)
        wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= 2, 90, "the trainer to read the specs",
                 interval=0.5)
        send_samples(bs, topics["feedback"], first)
        read = 2 + len(first)
        # The update must follow the samples already sent (configs travel on their own topic).
        wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= read, 180,
                 "the trainer to read the first samples", interval=0.5)
        # Windows close on the watermark (or the idle timer), not on a sample's arrival: the
        # update goes out once every window before `cut` has been trained under the old spec.
        wait_for_records(bs, topics["versions"], VersionRecord, b_end, timeout=240,
                         predicate=lambda v: v.model_id == plain)
        send_config(bs, topics["configs"], loosened, T0 + 1)
        wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= read + 1, 60,
                 "the trainer to read the update", interval=0.5)
        send_samples(bs, topics["feedback"], later)
        total = sum(expected.values())
        versions = wait_for_records(bs, topics["versions"], VersionRecord, total, timeout=300)
        broadcasts = wait_for_records(bs, topics["adapter-versions"], AdapterVersionBroadcast, total, timeout=180)
    finally:
        cancel_job(stack_config, job)
    yield {"plain": plain, "replay": replay, "versions": versions, "broadcasts": broadcasts, "expected": expected,
           "held_a": held_a, "held_b": held_b, "seconds": time.monotonic() - started}


def by_model(run, model_id: str) -> list[VersionRecord]:
    versions = sorted((v for v in run["versions"] if v.model_id == model_id), key=lambda v: v.seq)
    assert [v.seq for v in versions] == list(range(1, run["expected"][model_id] + 1))
    return versions


@pytest.mark.slow  # the A-then-B run: about 4 minutes in CI; the gate logic runs on the CPU in test_trainer_quality.py
def test_gate_refuses_a_version_that_forgets_a_and_keeps_the_champion(run, stack_config, base_model):
    versions = by_model(run, run["plain"])
    a_phase, b_phase = versions[:A_WINDOWS], versions[A_WINDOWS:A_WINDOWS + B1_WINDOWS]
    champion = [v for v in a_phase if v.gate.promote][-1]
    assert next(s for s in champion.gate.sets if s.name == "recent").candidate.exact_match >= 0.9, "A learned"
    assert all(not v.gate.promote and v.gate.champion_version_id == champion.version_id for v in b_phase)
    first = b_phase[0].gate
    assert "retained (forgetting guard)" in first.reason
    retained = next(s for s in first.sets if s.name == "retained")
    assert retained.champion.exact_match >= 0.9 and retained.candidate.forgotten >= 0.8 and not retained.passed
    assert len(b_phase[0].lineage.held_out) > 0 and not set(b_phase[0].lineage.held_out) & set(
        b_phase[0].lineage.sample_ids)

    client = make_client(stack_config.mlflow_uri)
    refused = find_version(client, run["plain"], b_phase[0].version_id)
    assert refused.tags["streamtune.gate"] == "refused"
    assert refused.tags["streamtune.gate_reason"] == first.reason
    assert float(refused.tags["streamtune.eval.retained.exact_match"]) == retained.candidate.exact_match
    assert float(refused.tags["streamtune.eval.retained.forgotten"]) == retained.candidate.forgotten
    assert float(refused.tags["streamtune.eval.retained.champion_exact_match"]) == retained.champion.exact_match
    kept = find_version(client, run["plain"], champion.version_id)
    assert kept.tags["streamtune.gate"] == "promoted"
    # Until the update, the A champion stayed: MLflow's champion during B1 is checked through the
    # broadcasts, which carry the aliases a version had when it was registered.
    during_b1 = [x for x in run["broadcasts"] if x.version_id in {v.version_id for v in b_phase}]
    assert len({x.version_id for x in during_b1}) == B1_WINDOWS
    assert all("champion" not in x.aliases for x in during_b1)
    assert all("candidate" in x.aliases for x in during_b1)


@pytest.mark.slow  # the A-then-B run: about 4 minutes in CI; the gate logic runs on the CPU in test_trainer_quality.py
def test_a_later_version_with_replay_learns_b_without_forgetting_a_and_is_promoted(run, stack_config, base_model):
    versions = by_model(run, run["replay"])
    b_phase = versions[A_WINDOWS:]
    promoted = [v for v in b_phase if v.gate.promote]
    assert promoted, [v.gate.reason for v in b_phase]
    assert all(v.metrics.replayed == 2 * v.metrics.samples for v in b_phase)  # ratio 2
    client = make_client(stack_config.mlflow_uri)
    champion = client.get_registered_model(run["replay"]).aliases["champion"]
    assert champion == find_version(client, run["replay"], promoted[-1].version_id).version
    # The champion itself, from MLflow with plain PEFT, on held-out sets never streamed.
    _, on_a = champion_exact_match(stack_config, run["replay"], base_model, run["held_a"])
    _, on_b = champion_exact_match(stack_config, run["replay"], base_model, run["held_b"])
    assert on_a >= 0.9 and on_b >= 0.9, (on_a, on_b)


@pytest.mark.slow  # the A-then-B run: about 4 minutes in CI; the gate logic runs on the CPU in test_trainer_quality.py
def test_a_tolerance_update_applies_from_the_next_version(run, stack_config, base_model):
    versions = by_model(run, run["plain"])
    before, after = versions[A_WINDOWS + B1_WINDOWS - 1], versions[A_WINDOWS + B1_WINDOWS]
    assert (before.config_version, after.config_version) == (1, 2)
    assert not before.gate.promote
    assert {s.name: s.tolerance for s in before.gate.sets} == {"recent": 0.05, "retained": 0.1}
    assert after.gate.promote and {s.name: s.tolerance for s in after.gate.sets} == {"recent": 1.0, "retained": 1.0}
    retained = next(s for s in after.gate.sets if s.name == "retained")
    assert retained.candidate.forgotten > EVALUATION["forgetting_tolerance"], \
        "promoted only because the tolerance moved: under the old one it would have been refused"
    client = make_client(stack_config.mlflow_uri)
    assert client.get_registered_model(run["plain"]).aliases["champion"] == \
        find_version(client, run["plain"], versions[-1].version_id).version
    # The plain champion now answers B and has forgotten A: what the guard had held back.
    _, on_a = champion_exact_match(stack_config, run["plain"], base_model, run["held_a"])
    assert on_a <= 0.2, on_a


# ------------------------------------------------------------------------------ pseudo-labels

THRESHOLD = 0.8
AT = math.log(THRESHOLD)  # a response logged with ln(threshold) is at it exactly
PSEUDO = {  # request_id -> mean_logprob, for the model whose spec has pseudo_labels
    "above0": math.log(0.95), "above1": math.log(0.9), "above2": math.nextafter(AT, 0.0),  # one ulp above
    "at0": AT, "at1": AT,
    "below0": AT - 1e-9, "below1": math.log(0.5), "below2": math.log(0.05),
    "positive": 0.5,  # not a log-probability: dead-lettered by the pseudo-label step
}


@pytest.fixture(scope="module")
def pseudo_run(stack_config, base_model, tmp_path_factory):
    bs = stack_config.kafka_bootstrap
    u = f"{time.time_ns() % 10**9:x}"
    prefix = f"test.pseudo-{u}"
    topics = {**job_topics(bs, prefix), "inference": f"{prefix}.inference-log", "review": f"{prefix}.review"}
    for name in ("inference", "review"):
        create_topic(bs, topics[name])
    model, off = f"pseudo-{u}", f"nopseudo-{u}"
    pairs = iter(digit_pairs(20, seed=11))

    def inference(request_id: str, mean_logprob: float, model_id: str = model, ts: int = T0 + 100) -> str:
        prompt, completion = next(pairs)
        return json.dumps({"request_id": request_id, "model_id": model_id, "version": 1, "alias": "champion",
                           "arm": "champion", "prompt": prompt, "completion": completion,
                           "mean_logprob": mean_logprob, "latency_ms": 3.0, "ts": ts})

    # On the inference-log topic, in this order (one partition): each kind of record once or more.
    records = [(model, inference(rid, lp)) for rid, lp in PSEUDO.items()]
    records += [(off, inference("off0", AT, off)),  # its model's spec has no pseudo_labels
                (model, '{"request_id": "broken", "model_id": "' + model),  # bad_json, at validation
                (model, json.dumps({k: v for k, v in json.loads(inference("nocompletion", AT)).items()
                                    if k != "completion"})),  # schema, at validation
                # Feedback already judged, citing a response: a sample like any other, not a pseudo-label.
                (model, FeedbackSample(model_id=model, sample_id="fix-below1", prompt="x=1;y=", completion="2",
                                       label="corrected", request_id="below1", ts=T0 + 200).to_json()),
                # Its event time carries the watermark past the first window's end (or the idle close
                # does): that window closes; this one waits for the retrain trigger below or the
                # trainer's idle close, whichever comes first.
                (model, inference("closer", math.log(0.99), ts=T0 + 5000))]
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path_factory.mktemp("adapters"), "--bootstrap-server", bs,
        "--inference-log-topic", topics["inference"], "--review-topic", topics["review"],
        "--checkpoint-interval-ms", "1000", "--job-name", f"pseudo-{u}"))
    try:
        send_config(bs, topics["configs"], spec(model, topics, min_samples=1, pseudo_labels={"threshold": THRESHOLD}),
                    T0)
        send_config(bs, topics["configs"], spec(off, topics, min_samples=1), T0)
        wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= 2, 90, "the trainer to read the specs",
                 interval=0.5)
        p = producer(bs)
        try:
            for key, value in records:
                # The Kafka timestamp is the event time: the record's ts, T0 + 100 for the unparsable one.
                ts = json.loads(value)["ts"] if value.endswith("}") else T0 + 100
                p.send(topics["inference"], key=key.encode(), value=value.encode(), timestamp_ms=ts)
            p.flush()
        finally:
            p.close()
        wait_for_records(bs, topics["versions"], VersionRecord, 1, timeout=180, predicate=lambda v: v.model_id == model)
        # The first window has closed, so the trainer holds the closer: train it now (a no-op
        # if its window has closed already). Either way it is the second and last version.
        send_config(bs, topics["configs"], RetrainTrigger(model_id=model, reason="test: train the closer"), T0 + 6000)
        versions = wait_for_records(bs, topics["versions"], VersionRecord, 2, timeout=120,
                                    predicate=lambda v: v.model_id == model)
        review = wait_for_records(bs, topics["review"], ReviewRecord, 3, timeout=60)
        dlq = wait_for_records(bs, topics["dlq"], DeadLetter, 4, timeout=60)
        counters: dict[str, int] = {}
        control = 3  # two specs and the trigger, on the config topic
        expected = {"validate.records_in": control + len(records), "validate.valid": control + len(records) - 2,
                    "validate.dead_lettered": 2, "pseudo-labels.pseudo_records_in": len(PSEUDO) + 2,
                    "pseudo-labels.pseudo_labeled": 6, "pseudo-labels.pseudo_held_for_review": 3,
                    "pseudo-labels.pseudo_dead_lettered": 2, "lora-trainer.samples_trained": 7}

        def caught_up() -> bool:  # Flink publishes metrics every few seconds
            counters.update(job_counters(stack_config.flink_rest_url, job))
            return all(counters.get(k) == v for k, v in expected.items())

        try:
            wait_for(caught_up, 60, "the job's counters to reach what was sent", interval=1)
        except AssertionError:
            pass  # the test compares them and shows both
        yield {"model": model, "off": off, "topics": topics, "versions": versions, "review": review, "dlq": dlq,
               "counters": counters, "expected": expected, "sent": control + len(records)}
    finally:
        cancel_job(stack_config, job)


def test_pseudo_labels_only_at_or_above_the_threshold_and_the_counters_reconcile(pseudo_run):
    """Acceptance: pseudo-labels are used only at or above the threshold, and the
    counters reconcile."""
    trained = sorted(s for v in pseudo_run["versions"] for s in v.lineage.sample_ids)
    # At or above: trained as pseudo:<request_id>; the labelled correction as itself; nothing below.
    assert trained == sorted(["pseudo:above0", "pseudo:above1", "pseudo:above2", "pseudo:at0", "pseudo:at1",
                              "pseudo:closer", "fix-below1"]), trained
    assert [v.lineage.sample_ids[-1:] for v in pseudo_run["versions"]][1:] == [["pseudo:closer"]]

    review = {r.inference.request_id: r for r in pseudo_run["review"]}
    assert set(review) == {"below0", "below1", "below2"} and len(pseudo_run["review"]) == 3
    for rid, r in review.items():
        assert r.confidence == pytest.approx(math.exp(PSEUDO[rid]), rel=1e-12) and r.confidence < THRESHOLD
        assert (r.reason, r.threshold, r.source.topic) == ("below_threshold", THRESHOLD, pseudo_run["topics"]["inference"])
        assert r.inference.model_id == pseudo_run["model"]

    dead = sorted((d.reason, d.kind, d.model_id or "") for d in pseudo_run["dlq"])
    assert len(pseudo_run["dlq"]) == 4 and dead == sorted([
        ("bad_json", "inference", ""), ("schema", "inference", ""),
        ("no_pseudo_labels", "inference", pseudo_run["off"]), ("schema", "inference", pseudo_run["model"])]), dead
    by_reason = {d.reason: d for d in pseudo_run["dlq"] if d.model_id}
    assert InferenceRecord.from_json(by_reason["no_pseudo_labels"].payload).request_id == "off0"
    assert "pseudo_labels" in by_reason["no_pseudo_labels"].detail
    assert "log-probability" in by_reason["schema"].detail
    assert all(d.detail and d.source.topic == pseudo_run["topics"]["inference"] for d in pseudo_run["dlq"])

    assert not {s for s in trained if "below" in s and s.startswith("pseudo:")}, "nothing below the threshold"

    counters, expected = pseudo_run["counters"], pseudo_run["expected"]
    assert {k: counters.get(k) for k in expected} == expected
    # The job's own counters against each other and against what was sent.
    pseudo = {k.split(".")[1]: v for k, v in counters.items() if k.startswith("pseudo-labels.")}
    assert pseudo["pseudo_records_in"] == (pseudo["pseudo_labeled"] + pseudo["pseudo_held_for_review"]
                                           + pseudo["pseudo_dead_lettered"])
    assert counters["validate.records_in"] == pseudo_run["sent"]
    assert counters["validate.dead_lettered"] + pseudo["pseudo_dead_lettered"] == len(pseudo_run["dlq"])
    assert pseudo["pseudo_held_for_review"] == len(pseudo_run["review"])
    assert counters["lora-trainer.samples_trained"] == len(trained)
