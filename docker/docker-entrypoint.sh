#!/usr/bin/env bash
# /docker-entrypoint.sh of the streamtune-flink image, where Flink's native Kubernetes mode
# (and so the Flink Kubernetes Operator) expects the official flink image's entrypoint
# (kubernetes.entry.path). Flink starts its pods as
#
#   /docker-entrypoint.sh bash -c "kubernetes-jobmanager.sh kubernetes-application"   (or kubernetes-session)
#   /docker-entrypoint.sh bash -c "kubernetes-taskmanager.sh -D... "
#
# with the cluster's config.yaml and log4j files mounted at kubernetes.flink.conf.dir
# (/opt/flink/conf; /opt/flink links to the pyflink tree). Those commands run as given, with
# FLINK_CONF_DIR pointed at the mounted directory: the image's own FLINK_CONF_DIR
# (/opt/flink-conf, what docker-compose uses) would hide the operator's configuration.
# Anything else (jobmanager, taskmanager, a command) goes to flink-entrypoint.sh, as in compose.
set -euo pipefail

case "$*" in
    *kubernetes-jobmanager.sh*|*kubernetes-taskmanager.sh*)
        export FLINK_CONF_DIR="${STREAMTUNE_K8S_CONF_DIR:-/opt/flink/conf}"
        exec "$@"
        ;;
    *)
        exec "${STREAMTUNE_FLINK_ENTRYPOINT:-/usr/local/bin/flink-entrypoint.sh}" "$@"
        ;;
esac
