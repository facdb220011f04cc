"""Kubernetes manifests for one pipeline spec: `streamtune render -f pipeline.yaml [--overlay gpu]`.

The objects a pipeline needs on top of the shared services of deploy/k8s (namespace
streamtune, the streamtune-flink account and streamtune-flink-data volume, MLflow, Kafka,
the streamtune-env ConfigMap), one function per kind:

| object                              | kafka:// source                 | postgres:// / mongodb:// source          |
|-------------------------------------|---------------------------------|------------------------------------------|
| ConfigMap `<name>-pipeline`         | spec.json                       | spec.json and the mapping (mapping.json) |
| Deployment `<name>-capture`         |                                 | `streamtune cdc` (one replica)           |
| FlinkDeployment `<name>`            | jobs/stream_finetune.py         | jobs/cdc_retrain.py --mapping            |
| (or FlinkSessionJob, `--session`)   | into streamtune-session         | not possible: the mapping file is local  |
| Job `<name>-spec`                   | the spec to the config topic (what `streamtune apply` publishes) |  |
| Deployment + Service `<name>-serve` | `streamtune serve` for the pipeline's adapter-versions topic      |  |

Topics, job names, the capture's arguments and the mapping are those of the control plane
(streamtune/api/pipelines.py, streamtune/api/gateway.py, streamtune/pipeline.py), so a
rendered pipeline and an applied one use the same names. Flink's settings come from
flink-conf/config.yaml, as for the local stack and the image.

>>> p = Pipeline.model_validate({"model_id": "Support-Bot", "stream_source": "kafka://topic=clicks",
...     "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
...     "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 2}})
>>> resource_name("Support-Bot")
'st-support-bot-4e29d8b7'
>>> [(o["kind"], o["metadata"]["name"]) for o in render(p)]  # doctest: +NORMALIZE_WHITESPACE
[('ConfigMap', 'st-support-bot-4e29d8b7-pipeline'), ('FlinkDeployment', 'st-support-bot-4e29d8b7'),
 ('Job', 'st-support-bot-4e29d8b7-spec'), ('Deployment', 'st-support-bot-4e29d8b7-serve'),
 ('Service', 'st-support-bot-4e29d8b7-serve')]
>>> args = job_args(p, resource_name("Support-Bot"))
>>> args[:6]
['-py', '/opt/streamtune/jobs/stream_finetune.py', '--bootstrap-server', 'streamtune-kafka-bootstrap:9092', '--feedback-topic', 'clicks']
>>> args[args.index("--jobmanager-url") + 1]
'http://st-support-bot-4e29d8b7-rest:8081'
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Optional

import yaml

from core import defaults
from core.errors import ConfigError
from core.sources.postgres import PostgresSource
from streamtune.pipeline import Pipeline, connector_name
from streamtune.stack.flink import REPO_FLINK_CONF, flatten

NAMESPACE = "streamtune"
IMAGE = "streamtune-flink:latest"
# Inside the image (docker/flink.Dockerfile): the project at /opt/streamtune, its venv, and
# /opt/flink linked to the Flink distribution of the apache-flink wheel.
APP_DIR = "/opt/streamtune"
PYTHON = f"{APP_DIR}/venv/bin/python"
STREAMTUNE = f"{APP_DIR}/venv/bin/streamtune"
PYTHON_JAR = "local:///opt/flink/opt/flink-python-2.0.2.jar"
PYTHON_JAR_HTTPS = "https://repo1.maven.org/maven2/org/apache/flink/flink-python/2.0.2/flink-python-2.0.2.jar"
PYTHON_DRIVER = "org.apache.flink.client.python.PythonDriver"
FLINK_VERSION = "v2_0"
# The shared services of deploy/k8s/base (tests/test_k8s.py checks they agree).
KAFKA_BOOTSTRAP = "streamtune-kafka-bootstrap:9092"
MLFLOW_URI = "http://mlflow:5000"
ARTIFACT_STORE = "mlflow-artifacts://mlflow:5000/streamtune-adapters"
BASE_MODEL = "/flink-data/models/base"
SERVICE_ACCOUNT = "streamtune-flink"
DATA_PVC = "streamtune-flink-data"
ENV_CONFIGMAP = "streamtune-env"
SESSION_CLUSTER = "streamtune-session"
POSTGRES_SECRET = "streamtune-postgres"   # keys PGUSER, PGPASSWORD; created outside git
API_TOKEN_SECRET = "streamtune-api-token"  # key token (older single admin token; no manifest uses it)
TOKENS_SECRET = "streamtune-tokens"        # keys admin, read, feedback, inference (streamtune.auth)
TOKENS_DIR = "/etc/streamtune/tokens"      # where it is mounted: STREAMTUNE_TOKENS_DIR
RESPONSE_KEY_SECRET = "streamtune-response-key"  # key `key`: signs response ids (core.response_ids)
RESPONSE_KEY_DIR = "/etc/streamtune/response-key"
PIPELINE_DIR = "/etc/streamtune/pipeline"
LABELS = {"app.kubernetes.io/part-of": "streamtune"}

# Flink settings on Kubernetes, over flink-conf/config.yaml: HA and durable storage on the
# streamtune-flink-data PVC, logs, slots, the image's Python.
K8S_FLINK_CONF = {
    "high-availability.type": "kubernetes",
    "high-availability.storageDir": "file:///flink-data/ha",
    "execution.checkpointing.dir": "file:///flink-data/checkpoints",
    "execution.checkpointing.savepoint-dir": "file:///flink-data/savepoints",
    "kubernetes.flink.log.dir": "/var/log/flink",
    "taskmanager.numberOfTaskSlots": "2",
    "python.executable": PYTHON,
    "python.client.executable": PYTHON,
}
# Keys of flink-conf/config.yaml that Kubernetes sets otherwise: memory from the resource blocks.
NOT_ON_K8S = {"jobmanager.memory.process.size", "taskmanager.memory.process.size"}
# Flink's external resource framework: one GPU per TaskManager, requested from Kubernetes as
# nvidia.com/gpu; the discovery script ships with Flink (plugins/external-resource-gpu).
GPU_FLINK_CONF = {
    "external-resources": "gpu",
    "external-resource.gpu.amount": "1",
    "external-resource.gpu.driver-factory.class": "org.apache.flink.externalresource.gpu.GPUDriverFactory",
    "external-resource.gpu.param.discovery-script.path":
        "/opt/flink/plugins/external-resource-gpu/nvidia-gpu-discovery.sh",
    "external-resource.gpu.kubernetes.config-key": "nvidia.com/gpu",
}
GPU_RESOURCES = {"requests": {"nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
OVERLAYS = ("cpu", "gpu")


def resource_name(model_id: str) -> str:
    """A DNS-1123 name for the pipeline's objects, unique per model and at most 44 characters
    (Flink's cluster id, the FlinkDeployment's name, allows 45)."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_id.lower()).strip("-")[:32].strip("-")
    return f"st-{slug}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}" if slug else \
        f"st-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


def flink_configuration(gpu: bool = False) -> dict[str, str]:
    """flink-conf/config.yaml (less what Kubernetes sets), then K8S_FLINK_CONF, then the GPU
    settings; every value a string, as Flink's configuration map holds them."""
    source = REPO_FLINK_CONF / "config.yaml"
    if not source.exists():
        raise ConfigError(f"{source} is missing: run `streamtune render` from a streamtune checkout")
    conf = {k: v for k, v in flatten(yaml.safe_load(source.read_text()) or {}).items() if k not in NOT_ON_K8S}
    conf.update(K8S_FLINK_CONF)
    if gpu:
        conf.update(GPU_FLINK_CONF)
    return {k: _flink_str(v) for k, v in conf.items()}


def _flink_str(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def topics(pipeline: Pipeline) -> dict[str, str]:
    """The job's topics, named as the control plane names them."""
    # Imported here, not above: they pull in Kafka and FastAPI, which `streamtune render --help` does without.
    from streamtune.api.gateway import job_topics
    from streamtune.api.pipelines import pipeline_topics

    return pipeline_topics(pipeline.name) if pipeline.is_cdc else job_topics(pipeline.source.topic)


def flink_job_name(pipeline: Pipeline) -> str:
    from streamtune.api.gateway import job_name
    from streamtune.api.pipelines import pipeline_key

    return job_name(pipeline_key(pipeline.name) if pipeline.is_cdc else pipeline.source.topic)


def rest_url(cluster: str) -> str:
    """The REST API of a FlinkDeployment, as its TaskManagers reach it: the operator's
    `<name>-rest` Service (the trainer's --checkpoint-on-version requests go there)."""
    return f"http://{cluster}-rest:8081"


def job_args(pipeline: Pipeline, cluster: str, bootstrap: str = KAFKA_BOOTSTRAP) -> list[str]:
    """PythonDriver's arguments: -py and the job's options (gateway._submit's, in its order),
    for a job on the FlinkDeployment `cluster`."""
    t = topics(pipeline)
    if pipeline.is_cdc:
        script = "cdc_retrain.py"
        source_args = ["--cdc-topic", t["cdc"], "--mapping", f"{PIPELINE_DIR}/mapping.json"]
    else:
        script = "stream_finetune.py"
        source_args = ["--feedback-topic", t["feedback"]]
    return ["-py", f"{APP_DIR}/jobs/{script}", "--bootstrap-server", bootstrap, *source_args,
            "--config-topic", t["configs"], "--versions-topic", t["versions"], "--dlq-topic", t["dlq"],
            "--broadcast-topic", t["adapter-versions"], "--base-model", BASE_MODEL, "--tracking-uri", MLFLOW_URI,
            "--artifact-store", ARTIFACT_STORE, "--jobmanager-url", rest_url(cluster),
            "--job-name", flink_job_name(pipeline)]


def _meta(name: str, **labels: str) -> dict:
    return {"name": name, "namespace": NAMESPACE, "labels": {**LABELS, **labels}}


def _env_from() -> list[dict]:
    return [{"configMapRef": {"name": ENV_CONFIGMAP}}]


def _data_volume() -> dict:
    return {"name": "flink-data", "persistentVolumeClaim": {"claimName": DATA_PVC}}


def config_map(pipeline: Pipeline) -> dict:
    """The spec (spec.json) and, for CDC, the mapping file of jobs/cdc_retrain.py (mapping.json)."""
    data = {"spec.json": pipeline.finetune_spec().model_dump_json(indent=1, exclude_none=True)}
    if pipeline.is_cdc:
        data["mapping.json"] = pipeline.mapping().model_dump_json(indent=1, exclude_none=True)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _meta(f"{resource_name(pipeline.model_id)}-pipeline"), "data": data}


def flink_deployment(pipeline: Pipeline, gpu: bool = False, image: str = IMAGE) -> dict:
    """The job in application mode: a Flink cluster of its own, managed by the operator."""
    main: dict = {"name": "flink-main-container", "envFrom": _env_from(),
                  "volumeMounts": [{"name": "flink-data", "mountPath": "/flink-data"}]}
    volumes = [_data_volume()]
    if pipeline.is_cdc:  # the mapping file, read by the driver on the JobManager
        main["volumeMounts"].append({"name": "pipeline", "mountPath": PIPELINE_DIR, "readOnly": True})
        volumes.append({"name": "pipeline", "configMap": {"name": f"{resource_name(pipeline.model_id)}-pipeline"}})
    tm_main: dict = {"name": "flink-main-container",
                     "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}
    tm_spec: dict = {"containers": [tm_main],
                     "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}]}
    if gpu:
        tm_main["resources"] = GPU_RESOURCES
        tm_spec["tolerations"] = GPU_TOLERATIONS
    return {"apiVersion": "flink.apache.org/v1beta1", "kind": "FlinkDeployment",
            "metadata": _meta(resource_name(pipeline.model_id)),
            "spec": {"image": image, "imagePullPolicy": "IfNotPresent", "flinkVersion": FLINK_VERSION,
                     "mode": "native", "serviceAccount": SERVICE_ACCOUNT,
                     "flinkConfiguration": flink_configuration(gpu),
                     "podTemplate": {"spec": {"containers": [main], "volumes": volumes}},
                     "jobManager": {"replicas": 1, "resource": {"memory": "1024m", "cpu": 1}},
                     "taskManager": {"resource": {"memory": "3584m", "cpu": 2}, "podTemplate": {"spec": tm_spec}},
                     "job": _job(PYTHON_JAR, pipeline, resource_name(pipeline.model_id))}}


def flink_session_job(pipeline: Pipeline) -> dict:
    """The job submitted into the session cluster streamtune-session (kafka:// sources only:
    a CDC job reads its mapping file on the JobManager, which a session cluster does not mount)."""
    if pipeline.is_cdc:
        raise ConfigError(f"a {pipeline.source.scheme}:// pipeline runs as a FlinkDeployment of its own "
                          "(its mapping file is mounted into the JobManager); render it without --session")
    return {"apiVersion": "flink.apache.org/v1beta1", "kind": "FlinkSessionJob",
            "metadata": _meta(resource_name(pipeline.model_id)),
            "spec": {"deploymentName": SESSION_CLUSTER, "job": _job(PYTHON_JAR_HTTPS, pipeline, SESSION_CLUSTER)}}


def _job(jar: str, pipeline: Pipeline, cluster: str) -> dict:
    return {"jarURI": jar, "entryClass": PYTHON_DRIVER, "args": job_args(pipeline, cluster), "parallelism": 1,
            "upgradeMode": "last-state", "state": "running"}


def capture_deployment(pipeline: Pipeline, image: str = IMAGE) -> dict:
    """`streamtune cdc` with the arguments the control plane gives it (api/pipelines.py
    start_capture); one replica, replaced not rolled (two captures would share a slot)."""
    connector = connector_name(pipeline.name)
    args = ["--source", pipeline.capture_source(connector), "--name", connector, "--topic", topics(pipeline)["cdc"],
            "--bootstrap-server", KAFKA_BOOTSTRAP, "--offsets-topic", defaults.CDC_OFFSETS_TOPIC,
            *(["--snapshot"] if pipeline.cdc.snapshot else [])]
    env, mounts, volumes = [], [], []
    source, secret = pipeline.source, source_secret_name(pipeline)
    if source.password_env is not None:  # the source's own secret: key VAR of Secret <name>-source
        env = [{"name": source.password_env, "valueFrom": {"secretKeyRef": {"name": secret,
                                                                            "key": source.password_env}}}]
    elif source.password_file is not None:  # the same Secret, mounted where password_file points
        folder, file = source.password_file.rsplit("/", 1)
        folder = folder or "/"
        env = [{"name": "STREAMTUNE_SECRET_DIRS", "value": folder}]
        mounts = [{"name": "source-secret", "mountPath": folder, "readOnly": True}]
        volumes = [{"name": "source-secret", "secret": {"secretName": secret, "items": [{"key": file, "path": file}]}}]
    elif isinstance(source, PostgresSource):  # credentials stay out of the spec
        env = [{"name": key, "valueFrom": {"secretKeyRef": {"name": POSTGRES_SECRET, "key": key}}}
               for key in ("PGUSER", "PGPASSWORD")]
    name = f"{resource_name(pipeline.model_id)}-capture"
    container = {"name": "capture", "image": image, "imagePullPolicy": "IfNotPresent",
                 "command": [STREAMTUNE, "cdc"], "args": args, "envFrom": _env_from(), "env": env,
                 "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}}}
    if mounts:
        container["volumeMounts"] = mounts
    return _deployment(name, container, strategy={"type": "Recreate"}, **({"volumes": volumes} if volumes else {}))


def source_secret_name(pipeline: Pipeline) -> str:
    """The Secret a source's secret reference reads on Kubernetes (created outside git):
    key VAR for `password_env=VAR`, key FILE for `password_file=/dir/FILE`.

    >>> p = Pipeline.model_validate({"model_id": "bot", "cdc": {"prompt": "q", "completion": "a"},
    ...     "stream_source": "postgres://bot@db/app?table=answers&password_env=BOT_PG_PASSWORD",
    ...     "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
    ...     "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 2}})
    >>> source_secret_name(p), capture_deployment(p)["spec"]["template"]["spec"]["containers"][0]["env"]
    ('st-bot-9d74932b-source', [{'name': 'BOT_PG_PASSWORD', 'valueFrom': {'secretKeyRef': {'name': 'st-bot-9d74932b-source', 'key': 'BOT_PG_PASSWORD'}}}])
    """
    return f"{resource_name(pipeline.model_id)}-source"


def spec_job(pipeline: Pipeline, image: str = IMAGE) -> dict:
    """Publishes the spec to the job's config topic, as `streamtune apply` does (a CDC spec
    dated a minute back, so no change waits for a config from later)."""
    back_ms = 60_000 if pipeline.is_cdc else 0
    code = ("import os, time; from core.messages import FinetuneSpec; from streamtune.feedback import send_config; "
            f"spec = FinetuneSpec.model_validate_json(open('{PIPELINE_DIR}/spec.json').read()); "
            f"send_config(os.environ['STREAMTUNE_KAFKA_BOOTSTRAP'], {topics(pipeline)['configs']!r}, spec, "
            f"int(time.time() * 1000) - {back_ms})")
    name = resource_name(pipeline.model_id)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(f"{name}-spec"),
            "spec": {"backoffLimit": 10, "template": {"metadata": {"labels": {"app.kubernetes.io/name": f"{name}-spec"}},
                     "spec": {"restartPolicy": "OnFailure",
                              "containers": [{"name": "publish", "image": image, "imagePullPolicy": "IfNotPresent",
                                              "command": [PYTHON, "-c", code], "envFrom": _env_from(),
                                              "volumeMounts": [{"name": "pipeline", "mountPath": PIPELINE_DIR,
                                                                "readOnly": True}]}],
                              "volumes": [{"name": "pipeline", "configMap": {"name": f"{name}-pipeline"}}]}}}}


def serve_deployment(pipeline: Pipeline, gpu: bool = False, image: str = IMAGE) -> dict:
    """`streamtune serve` following this pipeline's adapter-versions topic (and its feedback
    topic, for a kafka:// source, for the rollback guard)."""
    t = topics(pipeline)
    args = ["--host", "0.0.0.0", "--port", "8100", "--base-model", BASE_MODEL,
            "--bootstrap-server", KAFKA_BOOTSTRAP, "--tracking-uri", MLFLOW_URI, "--artifact-store", ARTIFACT_STORE,
            "--broadcast-topics", re.escape(t["adapter-versions"]),
            *(["--feedback-topics", re.escape(t["feedback"])] if "feedback" in t else []),
            "--promotion-log", f"/flink-data/promotions-{resource_name(pipeline.model_id)}.jsonl"]
    container = {"name": "serve", "image": image, "imagePullPolicy": "IfNotPresent",
                 "command": [STREAMTUNE, "serve"], "args": args, "envFrom": _env_from(),
                 # Bound on 0.0.0.0: tokens per scope from the mounted Secret, re-read on change.
                 "env": [{"name": "STREAMTUNE_TOKENS_DIR", "value": TOKENS_DIR},
                         {"name": "STREAMTUNE_RESPONSE_SIGNING_KEY_FILE", "value": f"{RESPONSE_KEY_DIR}/key"}],
                 "ports": [{"name": "http", "containerPort": 8100}],
                 "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 10,
                                    "failureThreshold": 30},
                 "volumeMounts": [{"name": "flink-data", "mountPath": "/flink-data"},
                                  {"name": "tokens", "mountPath": TOKENS_DIR, "readOnly": True},
                                  {"name": "response-key", "mountPath": RESPONSE_KEY_DIR, "readOnly": True}],
                 "resources": {"requests": {"cpu": "1", "memory": "4Gi"}}}
    extra: dict = {}
    if gpu:
        container["resources"] = {"requests": {**container["resources"]["requests"], "nvidia.com/gpu": 1},
                                  "limits": {"nvidia.com/gpu": 1}}
        extra["tolerations"] = GPU_TOLERATIONS
    return _deployment(f"{resource_name(pipeline.model_id)}-serve", container,
                       volumes=[_data_volume(), {"name": "tokens", "secret": {"secretName": TOKENS_SECRET}},
                                {"name": "response-key", "secret": {"secretName": RESPONSE_KEY_SECRET}}],
                       securityContext={"fsGroup": 9999}, **extra)


def serve_service(pipeline: Pipeline) -> dict:
    name = f"{resource_name(pipeline.model_id)}-serve"
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(name),
            "spec": {"selector": {"app.kubernetes.io/name": name},
                     "ports": [{"name": "http", "port": 8100, "targetPort": "http"}]}}


def _deployment(name: str, container: dict, strategy: Optional[dict] = None, **pod_spec: Any) -> dict:
    spec: dict = {"replicas": 1, "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                  "template": {"metadata": {"labels": {"app.kubernetes.io/name": name}},
                               "spec": {"containers": [container], **pod_spec}}}
    if strategy:
        spec["strategy"] = strategy
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(name), "spec": spec}


def render(pipeline: Pipeline, overlay: str = "cpu", session: bool = False, image: str = IMAGE) -> list[dict]:
    """Every object of the pipeline, in the order they can be applied."""
    if overlay not in OVERLAYS:
        raise ConfigError(f"unknown overlay {overlay!r}: one of {', '.join(OVERLAYS)}")
    gpu = overlay == "gpu"
    objects = [config_map(pipeline)]
    if pipeline.is_cdc:
        objects.append(capture_deployment(pipeline, image))
    objects.append(flink_session_job(pipeline) if session else flink_deployment(pipeline, gpu, image))
    objects += [spec_job(pipeline, image), serve_deployment(pipeline, gpu, image), serve_service(pipeline)]
    return objects


def to_yaml(objects: list[dict]) -> str:
    return yaml.safe_dump_all(objects, sort_keys=False, width=1 << 16)


# ------------------------------------------------------------------ command line

def cmd_render(args) -> int:
    from pathlib import Path

    from pydantic import ValidationError

    from streamtune.api.cli import read_pipeline

    try:
        pipeline = Pipeline.model_validate(read_pipeline(args.file))
    except ValidationError as e:
        raise ConfigError(f"{args.file}: " + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'pipeline'}: {err['msg']}"
                                                        for err in e.errors())) from None
    objects = render(pipeline, args.overlay, args.session, args.image)
    if args.output is None:
        print(to_yaml(objects), end="")
        return 0
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for i, obj in enumerate(objects):
        path = out / f"{i:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(obj, sort_keys=False, width=1 << 16))
        print(path)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("render", help="Kubernetes manifests for one pipeline spec (deploy/k8s)")
    p.add_argument("-f", "--file", required=True, help="pipeline file (YAML or JSON), as for `streamtune apply`")
    p.add_argument("--overlay", choices=OVERLAYS, default="cpu", help="gpu: a GPU for TaskManagers and serve")
    p.add_argument("--session", action="store_true",
                   help="a FlinkSessionJob into streamtune-session instead of a FlinkDeployment (kafka:// only)")
    p.add_argument("--image", default=IMAGE, help="the streamtune-flink image (docker/flink.Dockerfile)")
    p.add_argument("-o", "--output", default=None, help="write one file per object into this directory")
    p.set_defaults(func=cmd_render)
