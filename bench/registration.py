"""Registration: what a version's broadcast waits for, against the whole of its registration.

The job's registration thread (operators/registration.py) calls
`connectors.mlflow_registry.publish_version` (the run, the adapter's files, the model version
and its aliases), hands the broadcast on, then calls `finish_run` (the run's params, metrics,
`lineage.json`, the training-run curve, FINISHED). This registers `--versions` records of one
model against the stack's MLflow server, as that thread does, timing both halves of each
version and counting the HTTP requests each makes. Printed: p50 / p95 of each half and of
both, and the ratio the broadcast gains: publish ÷ (publish + finish), from the same versions.
Until 2026-12-04 all of it came before the broadcast, in 16 requests.

publish_version sends the requests that do not wait on each other together (four rounds:
the run and the champion's loss, the two uploads, the model version, the aliases). Every
other version here is published with one request at a time instead (its request pool
swapped for a single thread), so the gain is measured in the same run, interleaved.

No goal of its own: the project's goal is window end → broadcast p95 ≤ one checkpoint
interval, measured by bench/freshness.py; this shows how much of the registration stays on
that path.

    .venv/bin/python bench/registration.py [--versions 400]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import requests  # noqa: E402

from connectors.artifact_store import ArtifactStore, artifact_sha256  # noqa: E402
import connectors.mlflow_registry as mlflow_registry  # noqa: E402
from connectors.mlflow_registry import RegistryCache, finish_run, make_client, publish_version  # noqa: E402
from core.messages import VersionRecord  # noqa: E402
from core.messages.version import EXAMPLE  # noqa: E402
from streamtune.demo import quiet_libraries  # noqa: E402
from streamtune.stack import StackConfig  # noqa: E402

def percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def record(store: ArtifactStore, model_id: str, seq: int) -> VersionRecord:
    """A version record like the trainer's, with its own small adapter in the store."""
    weights = f"weights of {model_id} {seq}".encode() * 256
    files = {"adapter_model.safetensors": weights, "adapter_config.json": b'{"peft_type": "LORA"}'}
    uri = store.put(files, artifact_sha256(files))
    return VersionRecord.model_validate({
        **EXAMPLE, "version_id": f"{model_id}@{seq * 1000}#0:{seq}-0:{seq}", "model_id": model_id, "seq": seq,
        "window_start": (seq - 1) * 1000, "window_end": seq * 1000,
        "artifact_uri": uri, "sha256": artifact_sha256(files), "fresh_adapter": seq == 1,
        "metrics": {**EXAMPLE["metrics"], "loss_after": 2.0 - seq / 1000}})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=400, help="half of them with one request at a time")
    args = parser.parse_args()
    quiet_libraries()
    config = StackConfig.from_env()
    client, cache = make_client(config.mlflow_uri), RegistryCache()
    store = ArtifactStore(tempfile.mkdtemp(prefix="bench-registration-"))
    model_id = f"bench-registration-{uuid.uuid4().hex[:8]}"

    requests_made = [0]
    send = requests.Session.send

    def counted(self, request, **kwargs):
        requests_made[0] += 1
        return send(self, request, **kwargs)

    requests.Session.send = counted
    rows = []  # (publish s, finish s, publish requests, finish requests)
    one_at_a_time = []  # publish s, with one request at a time
    parallel_pool = mlflow_registry._request_pool
    single = ThreadPoolExecutor(max_workers=1)
    warm_up = 3  # the model, its experiment and its training run are created by the first versions
    print(f"registering {args.versions + warm_up} versions of {model_id} at {config.mlflow_uri}, every other one "
          "with one request at a time ...", flush=True)
    for seq in range(1, args.versions + warm_up + 1):
        r = record(store, model_id, seq)
        sequential = seq % 2 == 1
        mlflow_registry._request_pool = (lambda: single) if sequential else parallel_pool
        n0, t0 = requests_made[0], time.perf_counter()
        mv, created = publish_version(client, r, store, cache)
        n1, t1 = requests_made[0], time.perf_counter()
        finish_run(client, r, mv.run_id, cache)
        n2, t2 = requests_made[0], time.perf_counter()
        if not created:
            raise SystemExit(f"version {seq} was found, not created: is another registrar on {model_id}?")
        if seq > warm_up:
            if sequential:
                one_at_a_time.append(t1 - t0)
            else:
                rows.append((t1 - t0, t2 - t1, n1 - n0, n2 - n1))
    requests.Session.send = send
    mlflow_registry._request_pool = parallel_pool
    single.shutdown()

    def stats(values: list[float]) -> dict:
        values = sorted(values)
        return {"p50_ms": round(1000 * statistics.median(values), 1),
                "p95_ms": round(1000 * percentile(values, 0.95), 1)}

    result = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({platform.machine()})",
              "versions": len(rows),
              "publish": {**stats([r[0] for r in rows]), "requests": statistics.median(r[2] for r in rows)},
              "finish": {**stats([r[1] for r in rows]), "requests": statistics.median(r[3] for r in rows)},
              "whole": {**stats([r[0] + r[1] for r in rows]), "requests": statistics.median(r[2] + r[3] for r in rows)}}
    result["ratio_p50"] = round(result["publish"]["p50_ms"] / result["whole"]["p50_ms"], 3)
    result["publish_one_at_a_time"] = {**stats(one_at_a_time), "versions": len(one_at_a_time)}
    result["parallel_ratio_p50"] = round(result["publish"]["p50_ms"] / result["publish_one_at_a_time"]["p50_ms"], 3)
    print(f"\n{len(rows)} versions, ms a version (MLflow {config.mlflow_uri}):")
    print(f"{'':<30}{'requests':>9}{'p50':>8}{'p95':>8}")
    for name, label in (("publish", "publish_version (broadcast)"), ("finish", "finish_run (after it)"),
                        ("whole", "both")):
        s = result[name]
        print(f"{label:<30}{s['requests']:>9.0f}{s['p50_ms']:>8.1f}{s['p95_ms']:>8.1f}")
    seq_s = result["publish_one_at_a_time"]
    print(f"{'publish_version, one at a time':<30}{result['publish']['requests']:>9.0f}{seq_s['p50_ms']:>8.1f}"
          f"{seq_s['p95_ms']:>8.1f}   ({seq_s['versions']} other versions, interleaved)")
    print(f"\npublish_version, independent requests together ÷ one at a time: {result['parallel_ratio_p50']:.2f} (p50)")
    print(f"the broadcast waits for {result['ratio_p50']:.2f} of the registration (p50 ÷ p50; no goal of "
          "its own: bench/freshness.py measures window end → broadcast)")
    (REPO / "bench" / "results").mkdir(exist_ok=True)
    (REPO / "bench" / "results" / "registration.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
