"""Learning quality on the local stack: the promotion gate, replay and a hot tolerance update,
through Kafka, the Flink job (trainer and registration) and MLflow.

Two models learn task A, then the conflicting task B (streamtune/conflicting_tasks.py), in
one job. `plain` has the gate only: its versions on B forget A, the forgetting guard refuses
them and the A champion stays, until a spec update loosens the tolerance. `replay` also
replays older samples: it learns B without forgetting A, and such a version is promoted.
What the gate decided is checked on the version records, on MLflow (aliases and tags), and
by loading each `champion` from MLflow with plain PEFT and measuring it on fresh held-out
sets of both tasks.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from connectors.mlflow_registry import find_version, make_client
from core.messages import AdapterVersionBroadcast, FinetuneSpec, VersionRecord
from streamtune.conflicting_tasks import digits_of, task_a, task_b
from streamtune.demo import champion_exact_match
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.stack.flink import cancel_job, submit_detached
from streamtune.testing import job_args, job_topics, records_read, wait_for, wait_for_records

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
    # In event-time order, as a live stream would be: a model's windows close on its own
    # samples or the watermark, never on another model's backlog running ahead.
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
        topics, base_model, tmp_path_factory.mktemp("adapters"), "--bootstrap", bs,
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
