#!/usr/bin/env bash
# Entrypoint of the streamtune-flink image (docker/flink.Dockerfile).
#
#   jobmanager [args]   Flink JobManager (standalone session) in the foreground
#   taskmanager [args]  Flink TaskManager in the foreground
#   anything else       run as is, e.g. `flink run -d -py jobs/<job>.py` against the cluster
#
# Every mode first renders $FLINK_CONF_DIR/config.yaml from the image's config.image.yaml,
# then jobmanager.rpc.address and rest.address (FLINK_PROPERTIES' jobmanager.rpc.address,
# else $JOB_MANAGER_RPC_ADDRESS, else "jobmanager"), then FLINK_PROPERTIES: "key: value"
# lines as with the official flink image. The keys are merged, not appended: Flink 2 reads
# config.yaml as standard YAML, where a key must not appear twice.
set -euo pipefail

: "${FLINK_HOME:?FLINK_HOME is not set}"
: "${FLINK_CONF_DIR:?FLINK_CONF_DIR is not set}"
PYTHON=/opt/streamtune/venv/bin/python

render_conf() {
    "$PYTHON" - <<'PY'
import os
import sys

import yaml

from streamtune.stack.flink import flatten

conf_dir = os.environ["FLINK_CONF_DIR"]
with open(os.path.join(conf_dir, "config.image.yaml")) as f:
    conf = flatten(yaml.safe_load(f) or {})

props = os.environ.get("FLINK_PROPERTIES", "")
try:
    extra = yaml.safe_load(props) if props.strip() else {}
except yaml.YAMLError as e:
    sys.exit(f"flink-entrypoint: FLINK_PROPERTIES must be 'key: value' lines: {e}")
if not isinstance(extra, dict):
    sys.exit(f"flink-entrypoint: FLINK_PROPERTIES must be 'key: value' lines, got {props!r}")
extra = flatten(extra)

rpc = extra.get("jobmanager.rpc.address") or os.environ.get("JOB_MANAGER_RPC_ADDRESS") or "jobmanager"
conf["jobmanager.rpc.address"] = rpc
conf["rest.address"] = rpc  # where clients (flink run) reach the REST API
conf.update(extra)

target = os.path.join(conf_dir, "config.yaml")
with open(target + ".tmp", "w") as f:
    f.write(yaml.safe_dump(conf, sort_keys=True, width=1 << 20))
os.replace(target + ".tmp", target)
print(f"flink-entrypoint: {target}: jobmanager.rpc.address={conf['jobmanager.rpc.address']} "
      f"rest.address={conf['rest.address']}" + (f", FLINK_PROPERTIES: {', '.join(extra)}" if extra else ""),
      file=sys.stderr)
PY
}

case "${1:-}" in
    jobmanager)
        shift
        render_conf
        exec "$FLINK_HOME/bin/jobmanager.sh" start-foreground "$@"
        ;;
    taskmanager)
        shift
        render_conf
        exec "$FLINK_HOME/bin/taskmanager.sh" start-foreground "$@"
        ;;
    "")
        sed -n '2,7p' "$0" >&2
        exit 2
        ;;
    *)
        # A shell or client command still gets the cluster's addresses, but is not blocked
        # by a configuration it may be there to debug.
        render_conf || echo "flink-entrypoint: config.yaml not rendered, running $1 anyway" >&2
        exec "$@"
        ;;
esac
