"""Scale-out on the local cluster: parallelism 4 over two TaskManagers, a TaskManager killed,
a model whose data stops, many models in one job; and the JVM fast path (--micro-batch-ms,
marker `ingest`) at parallelism 1 and 4.

The reference is the same job at parallelism 1 on the same input, every record through the
Python validation: a window holds the same samples however the partitions interleave (only
the watermark closes windows, and a window trains in source order), so the versions must
match sample for sample and byte for byte (sha256 of the adapter). The input mixes what the
fast path takes (samples as FeedbackSample.to_json writes them) with what it leaves to
Python (one sample in five in another key order, three records that are not JSON).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from connectors.kafka import create_topic
from core.messages import FeedbackSample, VersionRecord
from streamtune.feedback import digit_samples, send_config, send_samples
from streamtune.stack.flink import Flink, cancel_job, job_counters, submit_detached
from streamtune.testing import (job_args, job_report, job_topics, records_read, restored_and_running, scrape_prometheus,
                                spec, wait_for, wait_for_records)
from streamtune.tinymodel import digit_pairs

pytestmark = pytest.mark.scale
REPO = Path(__file__).resolve().parents[1]
T0 = 1_776_000_000_000
PARTITIONS = 4
MODELS = 8
PER_MODEL = 60           # over 12 s of event time: six 2 s windows of 10 samples
MAX_STEP = 8             # so a window trains in two steps: the cut must be the same too
NOT_JSON = 3             # records of the workload that are not JSON
MICRO_BATCH_MS = 1000    # --micro-batch-ms of the fast-path runs (and one as long as the window)
WINDOW_SECONDS = 2       # every model's window


@dataclass(frozen=True)
class Raw:
    """A record as a producer wrote it (produce_partitioned sends `to_json()`)."""

    model_id: str
    ts: int
    value: str

    def to_json(self) -> str:
        return self.value


def produce_partitioned(bootstrap: str, topic: str, samples: list[FeedbackSample], partitions: int,
                        per_second: float | None = None, progress: dict | None = None) -> None:
    """Samples in event-time order, dealt round-robin over the partitions: each partition is in
    order, and a model's samples are spread over all of them (keys do not pick partitions).
    With `per_second`, a live stream at that pace; else all at once. Every send is confirmed
    (a failed one raises); `progress` counts the confirmed sends and keeps the error."""
    from kafka import KafkaProducer

    progress = progress if progress is not None else {}
    progress.update(sent=0, error=None)
    p = KafkaProducer(bootstrap_servers=bootstrap, acks="all", retries=5)
    try:
        pending = []
        for i, s in enumerate(samples):
            pending.append(p.send(topic, key=s.model_id.encode(), value=s.to_json().encode(), timestamp_ms=s.ts,
                                  partition=i % partitions))
            if per_second:
                pending.pop().get(timeout=60)
                progress["sent"] += 1
                time.sleep(1 / per_second)
        for future in pending:
            future.get(timeout=60)
            progress["sent"] += 1
    except BaseException as e:
        progress["error"] = repr(e)
        raise
    finally:
        p.close()


@pytest.fixture(scope="module")
def workload():
    """The input every run reads, each from its own 4-partition topic with the same layout
    (so offsets, and with them version ids, are the same): models, samples, closers."""
    u = f"{time.time_ns() % 10**9:x}"
    models = [f"scale{m}-{u}" for m in range(MODELS)]
    pairs = digit_pairs(MODELS * PER_MODEL, seed=17)
    samples = sorted((s for i, m in enumerate(models)
                      for s in digit_samples(m, pairs[i * PER_MODEL:(i + 1) * PER_MODEL], T0 + 7 * i,
                                             12_000 / PER_MODEL, id_prefix=f"m{i}-")),
                     key=lambda s: (s.ts, s.sample_id))
    # A record 60 s later on every partition: it moves each partition's watermark past every window.
    closers = [FeedbackSample(model_id=f"closer-{u}", sample_id=f"closer-{p}", prompt="x=1;y=", completion="2",
                              ts=T0 + 72_000) for p in range(PARTITIONS)]
    # Valid in another key order (only the Python validation may take it), and not JSON at all.
    records = [Raw(s.model_id, s.ts, json.dumps(dict(reversed(json.loads(s.to_json()).items()))))
               if i % 5 == 4 else s for i, s in enumerate(samples)]
    records[10:10] = [Raw(models[0], samples[10 + k].ts, "{not json") for k in range(NOT_JSON)]
    return {"u": u, "models": models, "samples": samples, "records": records + closers, "closers": len(closers),
            "canonical": sum(isinstance(r, FeedbackSample) for r in records) + len(closers)}


def run_job(stack_config, base_model, tmp_path, workload, name: str, parallelism: int, live: bool,
            during=None, per_second: float = 40, micro_batch_ms: int = 0, full_counts: bool = False) -> dict:
    """The training job over the workload at `parallelism`, from a topic of its own: produced
    before the job starts, or `live` while it runs; its versions per model (by seq) once every
    sample is in one. `during(job_id, topics, producer_thread)` runs while the job trains.
    `full_counts`: its counters once validate has counted every record and config (Flink's
    REST metrics lag by seconds; a restored job counts only since its restore), except, with
    micro-batches, the closers: no later record closes their micro-batch (the documented limit
    of --micro-batch-ms), so they never reach validate."""
    import threading

    boot = stack_config.kafka_bootstrap
    prefix = f"test.scale-{workload['u']}-{name}"
    create_topic(boot, f"{prefix}.feedback", PARTITIONS)
    topics = job_topics(boot, prefix)
    for m in workload["models"]:
        send_config(boot, topics["configs"], spec(m, topics, min_samples=5, window_seconds=WINDOW_SECONDS,
                                                  max_samples=MAX_STEP), T0 - 1000)
    produced: dict = {}
    produce = threading.Thread(target=produce_partitioned, daemon=True, args=(
        boot, topics["feedback"], workload["records"], PARTITIONS, per_second if live else None, produced))
    if not live:
        produce.run()
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path / name, "--bootstrap-server", boot, "--parallelism", str(parallelism),
        "--checkpoint-interval-ms", "1000", "--no-register", "--job-name", f"scale-{name}-{workload['u']}",
        "--micro-batch-ms", str(micro_batch_ms)))
    try:
        if live:
            # The stream starts once every subtask runs (its Python worker started; on two
            # loaded cores that takes minutes) and the trainers have read every config.
            wait_for(lambda: _all_subtasks_running(stack_config, job), 400, "every subtask to run", interval=1)
            # A Python function opens on its first record, so the four trainers load their base
            # models only now, beside the validators: minutes too, on two cores.
            wait_for(lambda: records_read(stack_config, job, "lora-trainer") >= len(workload["models"]), 400,
                     "the configs at the trainers", interval=0.5)
            produce.start()
        if during:
            during(job, topics, produce)
        if live:
            produce.join(timeout=300)
        assert produced["sent"] == len(workload["records"]), f"the stream was produced whole: {produced}"
        expected = {s.sample_id for s in workload["samples"]}

        # At parallelism 1 the versions are read as committed. With several transactional
        # writers on one topic the local broker (Tansu) stops read_committed readers at the
        # first commit markers (seen: 16 of 96 versions visible, every transaction's markers
        # written, every checkpoint complete), so there every written copy is read, by version
        # id; assert_each_sample_once checks each id has one content. Visibility on commit is
        # the exactly-once and visibility tests' guarantee; this one's is equality with p1.
        read = committed_versions if parallelism == 1 else written_versions

        def all_trained():
            versions = read(boot, topics["versions"])
            trained = {i for v in versions.values() for i in v.lineage.sample_ids}
            return versions if trained >= expected else None

        try:
            versions = wait_for(all_trained, 600, "every sample in a committed version", interval=3)
        except AssertionError as timeout:
            raise AssertionError(f"{timeout}; {_why_stuck(stack_config, job, boot, topics, workload)}") from None
        every = len(workload["records"]) + len(workload["models"]) - (workload["closers"] if micro_batch_ms else 0)

        def counted(c: dict) -> bool:  # each subtask's counters reach the REST API on their own schedule
            read = c.get("validate.records_in", 0)
            return not full_counts or read >= every and read == c.get("validate.valid", 0) + c.get(
                "validate.dead_lettered", 0)

        counters = wait_for(lambda: counted(c := job_counters(stack_config.flink_rest_url, job)) and c,
                            60, "validate to count every record (and the counts to add up)")
    finally:
        cancel_job(stack_config, job)
    every_copy = wait_for_records(boot, topics["versions"], VersionRecord, 0, 0, read_committed=False)
    by_model: dict[str, list[VersionRecord]] = {}
    for v in sorted(versions.values(), key=lambda v: (v.model_id, v.seq)):
        by_model.setdefault(v.model_id, []).append(v)
    return {"job": job, "versions": by_model, "every_copy": every_copy, "counters": counters}


def _why_stuck(stack_config, job: str, boot: str, topics: dict, workload: dict) -> str:
    """What a timed-out run looked like: the job's state, its restarts and last exception, the
    TaskManagers, how far training got (committed and written versions), and the samples in no
    written version, by model and 2 s window."""
    committed = committed_versions(boot, topics["versions"])
    written = wait_for_records(boot, topics["versions"], VersionRecord, 0, 0, read_committed=False)
    expected = {s.sample_id for s in workload["samples"]}
    trained = {i for v in committed.values() for i in v.lineage.sample_ids}
    written_trained = {i for v in written for i in v.lineage.sample_ids}
    missing: dict[tuple[str, int], int] = {}
    for s in workload["samples"]:
        if s.sample_id not in written_trained:
            key = (s.model_id, (s.ts - T0) // 2000)
            missing[key] = missing.get(key, 0) + 1
    return (f"{job_report(stack_config, job)}; {_registered_taskmanagers(stack_config)} TaskManagers, "
            f"{len(committed)} versions committed and "
            f"{len(written)} written ({len({v.version_id for v in written})} ids), "
            f"{len(trained & expected)}/{len(expected)} samples in committed versions and "
            f"{len(written_trained & expected)} in written ones; missing (model, window): samples {missing}")


def written_versions(bootstrap: str, topic: str) -> dict[str, VersionRecord]:
    """Every version written, committed or not, by id."""
    return {v.version_id: v for v in wait_for_records(bootstrap, topic, VersionRecord, 0, 0, read_committed=False)}


def committed_versions(bootstrap: str, topic: str) -> dict[str, VersionRecord]:
    """Versions by id: Tansu shows records of aborted transactions too, so readers are idempotent."""
    return {v.version_id: v for v in wait_for_records(bootstrap, topic, VersionRecord, 0, 0)}


def fingerprint(run: dict) -> dict[str, list[tuple]]:
    return {m: [(v.seq, v.version_id, v.sha256, tuple(v.lineage.sample_ids)) for v in vs]
            for m, vs in run["versions"].items()}


def assert_each_sample_once(run: dict, workload: dict) -> None:
    trained = [i for vs in run["versions"].values() for v in vs for i in v.lineage.sample_ids]
    assert sorted(trained) == sorted(s.sample_id for s in workload["samples"]), "every sample in exactly one version"
    for m, vs in run["versions"].items():
        assert [v.seq for v in vs] == list(range(1, len(vs) + 1)), f"{m}: versions in order, none missing"
    # Every copy of a version id, aborted transactions' included, is the same version.
    for copy in run["every_copy"]:
        if copy.model_id in run["versions"]:
            same = {v.version_id: v.sha256 for v in run["versions"][copy.model_id]}
            assert same.get(copy.version_id) == copy.sha256, f"{copy.version_id}: one content per version id"


@pytest.fixture(scope="module")
def reference(stack_config, base_model, tmp_path_factory, workload):
    run = run_job(stack_config, base_model, tmp_path_factory.mktemp("p1"), workload, "p1", 1, live=False,
                  full_counts=True)
    assert_each_sample_once(run, workload)
    assert any(v.trigger == "max_samples" for vs in run["versions"].values() for v in vs), \
        "windows above max_samples_per_step train in several steps"
    return run


@pytest.fixture
def two_taskmanagers(stack_config):
    """A second TaskManager beside the stack's; stopped again afterwards."""
    flink = Flink(stack_config)
    before = set(flink.taskmanager_pids())
    for _ in range(max(1, 2 - len(before))):  # two, whatever became of the stack's own
        flink.start_taskmanager()
    wait_for(lambda: _registered_taskmanagers(stack_config) >= 2, 60, "a second TaskManager to register")
    yield flink
    for pid in set(flink.taskmanager_pids()) - before:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not (set(flink.taskmanager_pids()) - before), 60, "the extra TaskManager to stop")
    if not set(flink.taskmanager_pids()) & before:  # the stack's own was the one killed: one more
        flink.start_taskmanager()
    wait_for(lambda: _registered_taskmanagers(stack_config) == 1, 60, "one TaskManager again")


def _registered_taskmanagers(stack_config) -> int:
    return len(requests.get(f"{stack_config.flink_rest_url}/taskmanagers", timeout=5).json()["taskmanagers"])


def _taskmanagers_of(stack_config, job: str) -> set[str]:
    """The TaskManagers running the job's subtasks."""
    details = requests.get(f"{stack_config.flink_rest_url}/jobs/{job}", timeout=5).json()
    hosts = set()
    for vertex in details["vertices"]:
        tms = requests.get(f"{stack_config.flink_rest_url}/jobs/{job}/vertices/{vertex['id']}/taskmanagers",
                           timeout=5).json()["taskmanagers"]
        hosts |= {tm["taskmanager-id"] for tm in tms}
    return hosts


def test_parallelism_4_on_two_taskmanagers_gives_the_versions_of_parallelism_1(
        stack_config, base_model, tmp_path, workload, two_taskmanagers, request):
    spread = {}

    def on_both(job, topics, producer):
        spread["tms"] = wait_for(lambda: (t := _taskmanagers_of(stack_config, job)) and len(t) >= 2 and t, 120,
                                 "the job's subtasks on both TaskManagers")

    run = run_job(stack_config, base_model, tmp_path, workload, "p4", PARTITIONS, live=True, during=on_both)
    assert len(spread["tms"]) == 2
    assert_each_sample_once(run, workload)
    reference = request.getfixturevalue("reference")
    assert fingerprint(run) == fingerprint(reference), "the same versions, sample for sample and byte for byte"
    assert run["counters"].get("lora-trainer.windows_closed_idle", 0) == 0, "the watermark closed every window"


def test_taskmanager_killed_mid_stream_at_parallelism_4_gives_the_same_versions(
        stack_config, base_model, tmp_path, workload, two_taskmanagers, request):
    flink = two_taskmanagers
    landed = {}

    def kill_one(job, topics, producer):
        # Mid-stream: a completed checkpoint holds samples the trainer buffered, the stream goes on.
        received = wait_for(lambda: (n := records_read(stack_config, job, "lora-trainer")) >= len(workload["records"]) // 4
                            and n, 120, "a quarter of the stream at the trainer", interval=0.2)
        seen = time.time() * 1000
        wait_for(lambda: _latest_checkpoint_ms(stack_config, job) > seen, 60, "a checkpoint after that", interval=0.2)
        landed["producing"] = producer.is_alive()
        victim = flink.taskmanager_pids()[-1]
        os.kill(victim, signal.SIGKILL)
        landed["received"] = received
        # A supervisor (Kubernetes, systemd) starts the lost TaskManager again. Without it the
        # restore waits for the survivor's slots, which free up only once the cancelled tasks'
        # Python workers have stopped: minutes on two loaded cores, once past a 400 s wait.
        flink.start_taskmanager()
        wait_for(lambda: restored_and_running(stack_config, job), 300, "the job to restore a checkpoint")

    # A slower stream (about 30 s): the kill must fall while it still flows, on two loaded cores.
    run = run_job(stack_config, base_model, tmp_path, workload, "p4kill", PARTITIONS, live=True, during=kill_one,
                  per_second=15)
    # The restored trainers' idle timers fire at once; they must not close a window the
    # backlog still feeds (the idle time counts from the end of the trainer's open).
    assert "lora-trainer.windows_fired" in run["counters"], f"the restored job's counters read: {run['counters']}"
    assert run["counters"].get("lora-trainer.windows_closed_idle", 0) == 0, "the watermark closed every window"
    assert landed["producing"] and landed["received"] < len(workload["records"]), "the kill fell mid-stream"
    assert_each_sample_once(run, workload)
    assert fingerprint(run) == fingerprint(request.getfixturevalue("reference")), "the same versions after the restore"


def _all_subtasks_running(stack_config, job: str) -> bool:
    rest = stack_config.flink_rest_url
    for vertex in requests.get(f"{rest}/jobs/{job}", timeout=5).json()["vertices"]:
        subtasks = requests.get(f"{rest}/jobs/{job}/vertices/{vertex['id']}", timeout=5).json()["subtasks"]
        if any(s["status"] != "RUNNING" for s in subtasks):
            return False
    return True


def _latest_checkpoint_ms(stack_config, job: str) -> int:
    """When the job's latest completed checkpoint was triggered (0: none yet)."""
    checkpoints = requests.get(f"{stack_config.flink_rest_url}/jobs/{job}/checkpoints", timeout=5).json()
    return ((checkpoints.get("latest") or {}).get("completed") or {}).get("trigger_timestamp", 0)


def test_a_model_whose_data_stops_gets_its_last_version_within_the_bound(stack_config, base_model, tmp_path, unique):
    """A live model stops sending: its last window closes on the idle timer, window_seconds +
    --idle-close-ms after its last sample reached the trainer, and commits with the next checkpoint."""
    boot, model_id = stack_config.kafka_bootstrap, f"quiet-{unique}"
    topics = job_topics(boot, f"test.quiet-{unique}")
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path, "--bootstrap-server", boot, "--checkpoint-interval-ms", "1000", "--no-register",
        "--idle-close-ms", "3000", "--job-name", f"quiet-{unique}"))
    window_s, idle_s, checkpoint_s = 4, 3, 1
    try:
        wait_for(lambda: _all_subtasks_running(stack_config, job), 120, "every subtask to run", interval=0.5)
        # A Python function opens on its first record (Beam builds the bundle processor then),
        # and the trainer's open loads the base model: about 5 s here, which the first sample of
        # a new job waits (docs/guides/scaling.md). The config is that first record; the trainer's gauges
        # appear once it has opened.
        send_config(boot, topics["configs"], spec(model_id, topics, min_samples=4, window_seconds=window_s),
                    int(time.time() * 1000))
        wait_for(lambda: ("lora_trainer", "live_adapters") in scrape_prometheus(stack_config.host, f"quiet-{unique}"),
                 120, "the trainer to open", interval=0.5)
        # Start on a window's first millisecond: the 12 samples (about 1.5 s) fall in one
        # window. Split over two, the second could hold fewer than min_samples and wait
        # (carried) for data that never comes.
        time.sleep((window_s * 1000 - int(time.time() * 1000) % (window_s * 1000)) / 1000)
        samples = digit_samples(model_id, digit_pairs(12, seed=5), int(time.time() * 1000), 100, id_prefix="live-")
        for s in samples:  # live: stamped now, 10 a second
            send_samples(boot, topics["feedback"], [s.model_copy(update={"ts": int(time.time() * 1000)})])
            time.sleep(0.1)
        stopped = time.monotonic()
        last = first_committed(boot, topics["versions"], lambda v: samples[-1].sample_id in v.lineage.sample_ids, 60)
        waited = time.monotonic() - stopped
        # From the Prometheus reporter: after a TaskManager kill (the tests above) Flink's REST
        # API once served no task metrics at all for later jobs on this stack.
        closed_idle = wait_for(lambda: sum(scrape_prometheus(stack_config.host, f"quiet-{unique}").get(
            ("lora_trainer", "windows_closed_idle"), [])), 30, "the idle close counted", interval=0.5)
    finally:
        cancel_job(stack_config, job)
    trained = {i for v in wait_for_records(boot, topics["versions"], VersionRecord, 0, 0) for i in v.lineage.sample_ids}
    assert trained == {s.sample_id for s in samples}, "every sample trained, the last window's too"
    assert closed_idle >= 1 and last.trigger == "window"
    # The documented bound (docs/guides/scaling.md, "Models whose data stops"): the window and the idle timer
    # after the last sample, then the next checkpoint, one interval later. The slack is the
    # step itself (0.6-0.8 s here) and the checkpoint's own duration.
    slack_s = 2
    bound = window_s + idle_s + checkpoint_s
    print(f"last version {waited:.1f} s after the data stopped (documented bound {bound} s, "
          f"step {last.metrics.operator_seconds:.2f} s)")
    assert waited <= bound + slack_s, f"last version {waited:.1f} s after the data stopped (bound {bound} s)"


def first_committed(bootstrap: str, topic: str, predicate, timeout: float) -> VersionRecord:
    """The first committed version matching `predicate`, read as it arrives (100 ms polls)."""
    from streamtune.testing import committed_reader

    consumer = committed_reader(bootstrap, topic)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=100).values():
                for r in records:
                    version = VersionRecord.from_json(r.value)
                    if predicate(version):
                        return version
        raise AssertionError(f"no matching version on {topic} within {timeout} s")
    finally:
        consumer.close()


def test_100_models_in_one_job_all_train_within_the_adapter_bound(stack_config, base_model, tmp_path, unique):
    """100 model_ids on one trainer with --max-live-adapters 16: every model trains, and the
    trainer holds at most 16 adapters (weights + optimizer) at any sampled moment."""
    from connectors.artifact_store import ArtifactStore, store_uri

    boot, bound = stack_config.kafka_bootstrap, 16
    topics = job_topics(boot, f"test.many-{unique}")
    models = [f"many{m}-{unique}" for m in range(100)]
    for m in models:
        send_config(boot, topics["configs"], spec(m, topics, min_samples=4, window_seconds=2), T0 - 1000)
    pairs = digit_pairs(len(models) * 6, seed=23)
    samples = sorted((s for i, m in enumerate(models)
                      for s in digit_samples(m, pairs[i * 6:(i + 1) * 6], T0 + i, 300, id_prefix=f"{i}-")),
                     key=lambda s: s.ts)
    send_samples(boot, topics["feedback"], samples)
    job = submit_detached(stack_config, REPO / "jobs" / "stream_finetune.py", job_args(
        topics, base_model, tmp_path, "--bootstrap-server", boot, "--checkpoint-interval-ms", "1000", "--no-register",
        "--idle-close-ms", "3000", "--max-live-adapters", str(bound), "--job-name", f"many-{unique}"))
    held = []
    try:
        def sample_gauges():  # from the Prometheus reporter: Flink's REST API leaves Python gauges out
            gauges = scrape_prometheus(stack_config.host, f"many-{unique}")
            if ("lora_trainer", "live_adapters") in gauges:
                held.append((sum(gauges[("lora_trainer", "live_adapters")]),
                             sum(gauges[("lora_trainer", "live_adapter_bytes")])))
            return held

        def trained_models():
            sample_gauges()
            versions = wait_for_records(boot, topics["versions"], VersionRecord, 0, 0)
            return versions if {v.model_id for v in versions} == set(models) else None

        versions = wait_for(trained_models, 600, "a version of every model", interval=2)
        wait_for(sample_gauges, 60, "the trainer's live_adapters gauge", interval=2)  # a backlog trains fast
    finally:
        cancel_job(stack_config, job)
    trained = sorted(i for v in {v.version_id: v for v in versions}.values() for i in v.lineage.sample_ids)
    assert trained == sorted(s.sample_id for s in samples), "every sample of every model in one version"
    one = ArtifactStore(store_uri(str(tmp_path))).get(versions[0].artifact_uri, versions[0].sha256)
    weights = len(one["adapter_model.safetensors"])
    assert held and max(n for n, _ in held) <= bound, f"live adapters sampled: {held}"
    # Weights and AdamW's two moments per adapter held, at most `bound` of them.
    assert max(b for _, b in held) <= bound * 3 * weights, f"live adapter bytes sampled: {held}"


@pytest.mark.ingest
@pytest.mark.parametrize("parallelism, micro_batch_ms", [(1, MICRO_BATCH_MS), (PARTITIONS, MICRO_BATCH_MS),
                                                         (1, WINDOW_SECONDS * 1000)])
def test_micro_batches_give_the_versions_of_the_python_path(
        stack_config, base_model, tmp_path, workload, request, parallelism, micro_batch_ms):
    """The JVM proves the canonical samples valid and hands them to the trainer in micro-batches
    (operators/micro_batches.py) of a second, or of a whole window; the rest takes the Python
    validation. Same versions."""
    run = run_job(stack_config, base_model, tmp_path, workload, f"mb{parallelism}-{micro_batch_ms}", parallelism,
                  live=parallelism > 1, micro_batch_ms=micro_batch_ms, full_counts=True)
    assert_each_sample_once(run, workload)
    reference = request.getfixturevalue("reference")
    assert fingerprint(run) == fingerprint(reference), "the same versions, sample for sample and byte for byte"
    counters, python_path = run["counters"], reference["counters"]
    # The closers wait in their micro-batch for a later record that never comes (the limit
    # docs/concepts/streaming-job.md states); every other record is counted as by Python.
    held = workload["closers"]
    for name, missing in (("records_in", held), ("valid", held), ("dead_lettered", 0)):
        assert counters[f"validate.{name}"] == python_path[f"validate.{name}"] - missing, \
            f"validate.{name}: the counts add up"
    assert counters["validate.dead_lettered"] == NOT_JSON
    # Every canonical record is proved in the JVM (at parallelism 1, read as a backlog, none is
    # behind the watermark); a live run may see a few behind it, which Python then validates.
    taken, canonical = counters.get("validate.micro_batched", 0), workload["canonical"] - held
    if parallelism == 1:
        assert taken == canonical, "the fast path took every canonical record, and nothing else"
    else:
        assert 0.9 * canonical <= taken <= canonical, f"{taken} records micro-batched"
    assert python_path.get("validate.micro_batched", 0) == 0, "the reference ran the Python path only"
