"""Helpers for tests that run the fine-tuning job: topics, arguments, specs, waiting."""

from __future__ import annotations


def job_topics(bootstrap: str, prefix: str) -> dict:
    from connectors.kafka import create_topic

    topics = {k: f"{prefix}.{k}" for k in ("feedback", "configs", "versions", "dlq")}
    for topic in topics.values():
        create_topic(bootstrap, topic)
    return topics


def job_args(topics: dict, base_model, artifact_dir, *extra: str) -> list[str]:
    return ["--feedback-topic", topics["feedback"], "--config-topic", topics["configs"],
            "--versions-topic", topics["versions"], "--dlq-topic", topics["dlq"],
            "--base-model", str(base_model), "--artifact-dir", str(artifact_dir), *extra]


def spec(model_id: str, topics: dict, *, rank=4, targets=("q_proj", "v_proj"), min_samples=8,
         window_seconds=2, **extra) -> dict:
    return {"model_id": model_id, "stream_source": f"kafka://topic={topics['feedback']}",
            "adapter_config": {"rank": rank, "alpha": 2 * rank, "target_modules": list(targets)},
            "trigger_policy": {"min_samples_per_window": min_samples, "window_seconds": window_seconds},
            "training": {"lr": 0.01, "micro_batch_size": 8}, **extra}


def wait_for_records(bootstrap: str, topic: str, count: int, timeout: float, read_committed=True,
                     predicate=None) -> list:
    """Poll a topic until `count` records (matching `predicate`) are there, or time out."""
    import json
    import time

    from connectors.kafka import read_topic

    deadline = time.monotonic() + timeout
    while True:
        records = [json.loads(r.value) for r in read_topic(bootstrap, topic, timeout=10, idle=1.0,
                                                          read_committed=read_committed)]
        if predicate:
            records = [r for r in records if predicate(r)]
        if len(records) >= count or time.monotonic() > deadline:
            return records
        time.sleep(1)
