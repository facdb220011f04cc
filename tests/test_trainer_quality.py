"""Learning quality in the trainer, on the CPU without Flink: gradient accumulation, EWC, the
promotion gate and the replay buffer driven through the job's own FinetuneFunction (keyed
state held in variables), retractions, and bit-identical replays.

The tiny Llama is built here (a few seconds); nothing else runs. The same behaviour on the
real stack, through Kafka, Flink and MLflow, is tests/test_quality.py (marker quality).
"""

from __future__ import annotations

import copy
import json

import pytest

from core.messages import (AdapterConfig, ChangeOrigin, FeedbackSample, FinetuneSpec, Retraction, TrainingConfig,
                           VersionRecord)
from operators.finetune_function import FinetuneFunction
from operators.lora_trainer import LoraTrainer
from operators.quality import Kept
from operators.windowing import Pending
from streamtune.conflicting_tasks import digits_of, task_a, task_b
from streamtune.testing import KeyedTimers, trainer_function
from streamtune.tinymodel import digit_pairs

WINDOW = 64


def quality_spec(model_id: str, **sections) -> FinetuneSpec:
    return FinetuneSpec.model_validate({
        "model_id": model_id, "stream_source": "kafka://topic=feedback",
        "adapter_config": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"]},
        "trigger_policy": {"min_samples_per_window": 8, "window_seconds": 1},
        "training": {"lr": 0.01, "micro_batch_size": 32, "epochs": 4}, "seed": 7, **sections})


def pendings(pairs, prefix: str, first_offset: int, row_keys: bool = False) -> list[Pending]:
    out = []
    for i, (prompt, completion) in enumerate(pairs):
        sample_id, row_key = f"{prefix}{i}", (f'["{prefix}{i}"]' if row_keys else "")
        payload = FeedbackSample(model_id="m", sample_id=sample_id, prompt=prompt, completion=completion, ts=i,
                                 origin=ChangeOrigin(row_key=row_key, op="c", table="t") if row_keys else None)
        out.append(Pending(sample_id, prompt, completion, 1.0, first_offset + i, "feedback", 0, first_offset + i,
                           payload.to_json(), row_key))
    return out


def fire_windows(fn: FinetuneFunction, spec: FinetuneSpec, samples: list[Pending], config_version: int = 1):
    """One version record per WINDOW samples (as the job fires windows), parsed."""
    cfg = {"spec": spec.to_json(), "version": config_version, "hash": spec.spec_hash()}
    records = []
    for i in range(0, len(samples), WINDOW):
        batch = samples[i:i + WINDOW]
        records += [VersionRecord.from_json(r) for r in fn._fire(spec.model_id, spec, cfg, batch, batch[-1].ts + 1,
                                                                  "window")]
    return records


# ------------------------------------------------------------------------- accumulation

def _lora_after_one_window(trainer: LoraTrainer, model_id: str, training: TrainingConfig, samples) -> dict:
    from safetensors.torch import load

    adapter = AdapterConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    result = trainer.step(model_id, adapter, training, None, samples, seed=11)
    return load(result.state["lora"])


@pytest.mark.parametrize("weights", ["equal", "mixed"])
def test_flush_every_4_gives_the_update_of_one_batch_4_times_the_size(base, weights):
    trainer = LoraTrainer.for_base(base)
    pairs = digit_pairs(64, seed=4)
    samples = [Kept(f"s{i}", p, c, 1.0 if weights == "equal" else [0.5, 1.0, 2.0, 0.0][i % 4])
               for i, (p, c) in enumerate(pairs)]
    # 64 samples: two optimizer steps either way (the second sees the first's update).
    accumulated = _lora_after_one_window(trainer, f"acc-{weights}", TrainingConfig(
        lr=0.01, micro_batch_size=8, flush_every=4), samples)
    one_batch = _lora_after_one_window(trainer, f"big-{weights}", TrainingConfig(
        lr=0.01, micro_batch_size=32, flush_every=1), samples)
    separate = _lora_after_one_window(trainer, f"sep-{weights}", TrainingConfig(
        lr=0.01, micro_batch_size=8, flush_every=1), samples)
    assert accumulated.keys() == one_batch.keys()
    gap = max(float((accumulated[k] - one_batch[k]).abs().max()) for k in accumulated)
    # The control: eight small steps instead of two big ones move the weights far more apart.
    control = max(float((separate[k] - one_batch[k]).abs().max()) for k in separate)
    assert gap < 1e-5, gap
    assert control > 100 * max(gap, 1e-6), (control, gap)


# ------------------------------------------------------------------------- losses
def test_progressive_losses_match_the_exact_passes_and_cost_no_weights(base):
    """Without exact_losses, loss_before is each sample's loss in the first pass that trains
    on it: for a window of one micro-batch, exactly the loss before training. The extra
    passes of exact_losses change nothing in the trained weights."""
    trainer = LoraTrainer.for_base(base)
    adapter = AdapterConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    samples = [Kept(f"s{i}", p, c, [1.0, 0.5][i % 2]) for i, (p, c) in enumerate(digit_pairs(32, seed=5))]
    steps = {}
    for exact in (False, True):
        training = TrainingConfig(lr=0.01, micro_batch_size=32, epochs=3, exact_losses=exact)
        first = trainer.step(f"loss-{exact}", adapter, training, None, samples, seed=2)
        steps[exact] = (first, trainer.step(f"loss-{exact}", adapter, training, first.state, samples, seed=3))
    (progressive, progressive_2), (exact, exact_2) = steps[False], steps[True]
    assert progressive.sha256 == exact.sha256 and progressive_2.sha256 == exact_2.sha256
    for fast, slow in ((progressive, exact), (progressive_2, exact_2)):
        assert fast.metrics["loss_before"] == pytest.approx(slow.metrics["loss_before"], abs=1e-5)
    # The last pass's training loss is measured before that pass's step: between the exact
    # loss before and after, and not equal to either.
    for fast, slow in ((progressive, exact), (progressive_2, exact_2)):
        assert slow.metrics["loss_after"] < fast.metrics["loss_after"] < slow.metrics["loss_before"]


def test_progressive_loss_leaves_replayed_samples_out(base):
    trainer = LoraTrainer.for_base(base)
    adapter = AdapterConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    pairs = digit_pairs(24, seed=6)
    own = [Kept(f"s{i}", p, c, 1.0) for i, (p, c) in enumerate(pairs[:8])]
    replay = [Kept(f"r{i}", p, c, 1.0) for i, (p, c) in enumerate(pairs[8:])]
    exact = TrainingConfig(lr=0.01, micro_batch_size=32, exact_losses=True)
    fast = trainer.step("replay-fast", adapter, TrainingConfig(lr=0.01, micro_batch_size=32), None, own, seed=2,
                        replay=replay)
    slow = trainer.step("replay-exact", adapter, exact, None, own, seed=2, replay=replay)
    assert fast.metrics["loss_before"] == pytest.approx(slow.metrics["loss_before"], abs=1e-5)
    mixed = trainer.step("replay-mixed", adapter, exact, None, own + replay, seed=2)
    assert abs(mixed.metrics["loss_before"] - slow.metrics["loss_before"]) > 1e-3, "the control: replay counted"


# ------------------------------------------------------------------------- gate and replay

@pytest.fixture(scope="module")
def two_task_data():
    held_a, held_b = task_a(200, seed=999), task_b(200, seed=998)
    exclude = digits_of(held_a) | digits_of(held_b)
    return task_a(WINDOW * 14, seed=1, exclude=exclude), task_b(WINDOW * 12, seed=2, exclude=exclude)


def test_without_quality_sections_records_carry_no_gate_and_train_every_sample(base, tmp_path):
    fn = trainer_function(base, tmp_path)
    spec = quality_spec("plain-old")
    records = fire_windows(fn, spec, pendings(digit_pairs(2 * WINDOW, seed=5), "s", 0))
    assert [r.gate for r in records] == [None, None]
    assert [r.metrics.samples for r in records] == [WINDOW, WINDOW] and records[0].metrics.replayed is None
    assert records[0].lineage.held_out is None
    assert spec.spec_hash() == FinetuneSpec.model_validate(json.loads(spec.to_json())).spec_hash()
    assert "evaluation" not in spec.to_json()


def test_gate_refuses_forgetting_keeps_champion_and_promotes_replay_that_keeps_a(base, tmp_path, two_task_data):
    a, b = two_task_data
    evaluation = {"holdout_fraction": 0.25, "recent_size": 32, "retained_size": 128, "forgetting_tolerance": 0.1,
                  "tolerance": 0.05}
    results = {}
    for name, sections in (("plain", {}), ("replay", {"replay": {"buffer_size": 512, "ratio": 1.0}})):
        fn = trainer_function(base, tmp_path / name)
        spec = quality_spec(f"m-{name}", evaluation=evaluation, **sections)
        versions_a = fire_windows(fn, spec, pendings(a, "a", 0))
        versions_b = fire_windows(fn, spec, pendings(b, "b", len(a)))
        results[name] = (versions_a, versions_b, fn)
    plain_a, plain_b, plain_fn = results["plain"]
    last_a = max((v for v in plain_a if v.gate.promote), key=lambda v: v.seq)
    assert last_a.gate.sets[0].candidate.exact_match >= 0.9, "task A learned before B starts"
    first_b = plain_b[0].gate
    assert not first_b.promote and "retained (forgetting guard)" in first_b.reason
    retained = next(s for s in first_b.sets if s.name == "retained")
    assert retained.candidate.forgotten > 0.5, retained
    assert not any(v.gate.promote for v in plain_b), "plain LoRA on B fails the forgetting guard"
    assert plain_fn.quality.value().champion["version_id"] == last_a.version_id
    # Held-out samples were never trained on and are accounted for in lineage.
    trained = {s for v in plain_a + plain_b for s in v.lineage.sample_ids}
    held = {s for v in plain_a + plain_b for s in v.lineage.held_out or ()}
    assert not trained & held and len(trained) + len(held) == len(a) + len(b)
    assert 0.15 < len(held) / (len(a) + len(b)) < 0.35

    replay_a, replay_b, replay_fn = results["replay"]
    promoted = [v for v in replay_b if v.gate.promote]
    assert promoted, [v.gate.reason for v in replay_b]
    best = promoted[-1].gate
    sets = {s.name: s for s in best.sets}
    assert sets["retained"].candidate.forgotten <= 0.1 and sets["recent"].candidate.exact_match >= 0.9
    assert all(v.metrics.replayed == v.metrics.samples for v in replay_b)
    assert replay_fn.counters.counts["versions_refused"] >= 1


def test_a_replayed_window_makes_the_same_version_and_decision(base, tmp_path, two_task_data):
    a, b = two_task_data
    fn = trainer_function(base, tmp_path)
    spec = quality_spec("again", evaluation={"holdout_fraction": 0.25, "recent_size": 32},
                        replay={"buffer_size": 128, "ratio": 0.5})
    fire_windows(fn, spec, pendings(a[:3 * WINDOW], "a", 0))
    saved = {name: copy.deepcopy(getattr(fn, name).value()) for name in FinetuneFunction.KEYED_STATE}
    window = pendings(b[:WINDOW], "b", 10_000)
    first = fire_windows(fn, spec, window)[0]
    for name, value in saved.items():  # the restore: the checkpointed state, the same records
        getattr(fn, name).update(value)
    fn.champion_files.clear()
    LoraTrainer.for_base(base)._live.clear()  # as in a fresh worker: the adapter comes from state
    second = fire_windows(fn, spec, window)[0]
    assert (second.sha256, second.gate, second.lineage, second.metrics.loss_after, second.metrics.replayed) == \
        (first.sha256, first.gate, first.lineage, first.metrics.loss_after, first.metrics.replayed)
    assert first.gate.sets and first.metrics.replayed == 0.5 * first.metrics.samples


def test_retracted_rows_leave_eval_sets_and_replay_buffer(base, tmp_path):
    fn = trainer_function(base, tmp_path)
    spec = quality_spec("cdc", evaluation={"holdout_fraction": 0.3, "recent_size": 8, "retained_size": 64},
                        replay={"buffer_size": 64})
    samples = pendings(digit_pairs(2 * WINDOW, seed=6), "r", 0, row_keys=True)
    fire_windows(fn, spec, samples)
    before = fn.quality.value()
    in_eval = before.retained[0].row_key
    in_replay = before.replay[0].row_key
    for row_key in (in_eval, in_replay):
        fn._on_retract(Retraction(row_key=row_key, origin=ChangeOrigin(row_key=row_key, op="d", table="t")))
    after = fn.quality.value()
    kept_rows = {s.row_key for s in after.recent + after.retained + after.replay}
    assert in_eval not in kept_rows and in_replay not in kept_rows
    assert len(after.retained) == len(before.retained) - 1 and len(after.replay) == len(before.replay) - 1
    assert fn.counters.counts["kept_samples_dropped"] == 2
    # A newer change of a kept row replaces its older text there too (it waits in pending, to be
    # trained or held out with its window).
    changed = after.replay[0]
    fn.config.update({"spec": spec.to_json(), "version": 1, "hash": spec.spec_hash()})
    newer = pendings([("x=0000;y=", "1111")], "new", 5000, row_keys=True)[0]
    newer_payload = FeedbackSample.from_json(newer.payload).model_copy(update={
        "origin": ChangeOrigin(row_key=changed.row_key, op="u", table="t")})
    list(fn.process_element(("sample", "cdc", newer_payload.to_json(), "feedback", 0, 5000, 10 ** 6), KeyedTimers("cdc")))
    assert changed.row_key not in {s.row_key for s in fn.quality.value().replay}
    assert [p.row_key for p in fn.pending.value()] == [changed.row_key]


# ------------------------------------------------------------------------- EWC

def test_ewc_pulls_the_next_steps_towards_the_previous_version(base):
    from safetensors.torch import load

    from core.messages import EwcConfig

    trainer = LoraTrainer.for_base(base)
    adapter = AdapterConfig(rank=8, alpha=16, target_modules=["q_proj", "v_proj"])
    training = TrainingConfig(lr=0.01, micro_batch_size=32, epochs=2)
    a = [Kept(f"a{i}", p, c) for i, (p, c) in enumerate(task_a(128, seed=1))]
    b = [Kept(f"b{i}", p, c) for i, (p, c) in enumerate(task_b(128, seed=2))]
    moved = {}
    for strength in (None, 1e6):
        ewc = EwcConfig(strength=strength) if strength else None
        model_id = f"ewc-{strength}"
        state = trainer.step(model_id, adapter, training, None, a, seed=1, ewc=ewc).state
        assert ("ewc" in state) == bool(ewc)
        after_a = load(state["lora"])
        after_b = load(trainer.step(model_id, adapter, training, state, b, seed=2, ewc=ewc).state["lora"])
        moved[strength] = sum(float((after_b[k] - after_a[k]).norm()) for k in after_a)
    assert moved[1e6] < 0.5 * moved[None], moved


# ------------------------------------------------------------------------- fixed eval set

def test_a_fixed_eval_set_scores_both_versions_and_an_unreadable_one_refuses(base, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMTUNE_EVAL_ROOTS", str(tmp_path))  # eval files are read only under the eval roots
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in task_a(40, seed=77)))
    fn = trainer_function(base, tmp_path / "store")
    spec = quality_spec("fixed", evaluation={"eval_uri": f"file://{eval_file}", "fixed_size": 30, "metric": "loss",
                                             "tolerance": 10.0})
    first, second = fire_windows(fn, spec, pendings(task_a(2 * WINDOW, seed=3), "a", 0))
    assert first.gate.rule == "first_version" and second.gate.rule == "eval" and second.gate.promote
    fixed = second.gate.sets[0]
    assert (fixed.name, fixed.size, fixed.tolerance) == ("fixed", 30, 10.0)
    assert fixed.champion.loss > fixed.candidate.loss, "the second window improved on the first"
    assert second.lineage.held_out is None and second.metrics.samples == WINDOW  # nothing held out of the stream

    eval_file.unlink()
    third = fire_windows(fn, spec.model_copy(update={"evaluation": spec.evaluation.model_copy(update={
        "eval_uri": f"file://{tmp_path}/missing.jsonl"})}), pendings(task_a(WINDOW, seed=4), "c", 1000))[0]
    assert not third.gate.promote and third.gate.reason.startswith("not evaluated: fixed eval set")
    assert fn.quality.value().champion["version_id"] == second.version_id
