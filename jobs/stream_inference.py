"""Streaming inference on Flink: requests → key_by(model) ⋈ adapter versions (broadcast) → responses.

    flink run -py jobs/stream_inference.py --requests-topic R --responses-topic S \\
        [--broadcast-topic streamtune.adapter-versions] [--alias-moves-topic streamtune.alias-moves] \\
        [--base-model DIR] [--artifact-store URI]

A request is JSON: {"request_id": "...", "model": "<model_id>[@alias|/version]|base",
"prompt": "...", "max_tokens": 16}. Each response names the version that answered and an
`audit_trace` (routing, adapter version and sha256, base model), or carries `error`
(operators/inference_function.py). The adapter versions come from the registration
broadcast and later alias moves (promotions, rollbacks) from the alias-moves topic that the
control plane and the rollback guard publish to, so the job needs no MLflow; an alias moved
in MLflow by another tool is seen at the model's next registration. The artifacts are read
from the shared store and checked against their sha256. Responses go out at least once (a restore may answer a
request again, with the same request_id).
"""

from __future__ import annotations

import argparse

from pyflink.common import Types

from connectors.flink_kafka import at_least_once_sink
from connectors.kafka import create_topic
from core import defaults
from core.options import add_bootstrap_option
from jobs.wiring import JobConfig, environment, kafka_rows, table_environment
from operators.inference_function import ROUTES, InferenceFunction, model_of

ROW = Types.TUPLE([Types.STRING(), Types.STRING()])  # (model_id, payload)
ROUTE_UPDATE = Types.TUPLE([Types.STRING(), Types.LONG()])  # (payload, Kafka record time ms)


def build(env, job: JobConfig, requests_topic: str, responses_topic: str, slots: int, alias_moves_topic: str) -> None:
    t_env = table_environment(env)
    requests = kafka_rows(t_env, job, "requests_input", [requests_topic], reader="requests")
    updates = kafka_rows(t_env, job, "route_updates_input", [job.broadcast_topic, alias_moves_topic],
                         reader="broadcasts")
    keyed = (requests.map(lambda r: (model_of(r[1]), r[1]), output_type=ROW).name("parse-requests")
             .key_by(lambda r: r[0], key_type=Types.STRING()))
    broadcast = (updates.map(lambda r: (r["payload"], r["ts"].to_epoch_milli()), output_type=ROUTE_UPDATE)
                 .name("read-route-updates").broadcast(ROUTES))
    responses = (keyed.connect(broadcast)
                 .process(InferenceFunction(job.base_model, job.artifact_store, slots), output_type=Types.STRING())
                 .name("generate").uid("generate"))
    responses.sink_to(at_least_once_sink(job.bootstrap, responses_topic)).name("responses-sink").uid("responses-sink")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="stream_inference", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests-topic", required=True)
    p.add_argument("--responses-topic", required=True)
    p.add_argument("--broadcast-topic", default=defaults.ADAPTER_VERSIONS_TOPIC)
    p.add_argument("--alias-moves-topic", default=defaults.ALIAS_MOVES_TOPIC)
    add_bootstrap_option(p, default=defaults.kafka_bootstrap())
    p.add_argument("--base-model", default=str(defaults.base_model_dir()))
    p.add_argument("--artifact-store", default=defaults.artifact_store())
    p.add_argument("--slots", type=int, default=8, help="adapters held in memory per worker")
    p.add_argument("--checkpoint-interval-ms", type=int, default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--restore-from", default=None)
    p.add_argument("--parallelism", type=int, default=None)
    p.add_argument("--job-name", default="streamtune-inference")
    args = p.parse_args(argv)
    job = JobConfig(job_name=args.job_name, bootstrap=args.bootstrap, broadcast_topic=args.broadcast_topic,
                    base_model=args.base_model, artifact_store=args.artifact_store,
                    checkpoint_interval_ms=args.checkpoint_interval_ms, checkpoint_dir=args.checkpoint_dir,
                    restore_from=args.restore_from, parallelism=args.parallelism)
    for topic in (args.requests_topic, args.responses_topic, args.broadcast_topic, args.alias_moves_topic):
        create_topic(job.bootstrap, topic)
    env = environment(job)
    build(env, job, args.requests_topic, args.responses_topic, args.slots, args.alias_moves_topic)
    env.execute(job.job_name)


if __name__ == "__main__":
    main()
