# Flink 2.0.2 runtime + the streamtune PyFlink job library (build context: repo root).
#
# No Flink base image: the apache-flink==2.0.2 wheel carries a complete Flink distribution
# in site-packages/pyflink (bin/, lib/flink-dist-2.0.2.jar, opt/flink-python-2.0.2.jar,
# plugins/metrics-prometheus, conf/ with the Java 17 --add-opens flags). That tree is
# FLINK_HOME here, exactly as `streamtune stack up` uses it outside Docker.
FROM python:3.11-slim-bookworm

# Flink's scripts need a JRE and, besides the base system (bash, coreutils, findutils,
# util-linux for flock/rev, hostname), procps for ps (flink-daemon.sh, stop scripts).
# mkdir: openjdk's postinst registers man-page alternatives, which slim images strip.
# /opt/java: an architecture-independent JAVA_HOME (java-17-openjdk-amd64 / -arm64).
RUN set -eux; \
    mkdir -p /usr/share/man/man1; \
    apt-get update; \
    apt-get install -y --no-install-recommends openjdk-17-jre-headless procps; \
    rm -rf /var/lib/apt/lists/*; \
    ln -s "$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")" /opt/java; \
    /opt/java/bin/java -version

# uid/gid 9999 as in the official flink image, so a flink-data volume it created stays writable.
RUN set -eux; \
    groupadd --system --gid 9999 flink; \
    useradd --system --uid 9999 --gid flink --create-home --home-dir /home/flink --shell /bin/bash flink

# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA runtime mounts into the taskmanager, whose
# compose GPU reservation names no driver capabilities (the CUDA base images set the same).
ENV JAVA_HOME=/opt/java \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

RUN python -m venv /opt/streamtune/venv

# Own layer before the source copy: the CUDA build of torch is several GB and must not be
# re-downloaded on every code change. Exact pin: pyproject.toml pins torch==2.13.0 too.
RUN /opt/streamtune/venv/bin/pip install torch==2.13.0

COPY . /opt/streamtune
RUN /opt/streamtune/venv/bin/pip install /opt/streamtune

# The Flink distribution inside the installed apache-flink wheel (python:3.11 image: fixed path).
ENV FLINK_HOME=/opt/streamtune/venv/lib/python3.11/site-packages/pyflink \
    FLINK_CONF_DIR=/opt/flink-conf \
    FLINK_LOG_DIR=/var/log/flink
ENV PATH=/opt/streamtune/venv/bin:$FLINK_HOME/bin:$PATH

# shigawire-apache-flink-libraries drops its connector jars (Kafka, JDBC + their clients)
# into pyflink/lib together with Flink 2.0.0 core jars that clash with flink-dist-2.0.2.
# The same pruning `streamtune stack up` does; it fails if a connector jar is missing.
RUN set -eux; \
    test -x "$FLINK_HOME/bin/jobmanager.sh"; \
    test -f "$FLINK_HOME/lib/flink-dist-2.0.2.jar"; \
    test -f "$FLINK_HOME/plugins/metrics-prometheus/flink-metrics-prometheus-2.0.2.jar"; \
    /opt/streamtune/venv/bin/python -c "from streamtune.stack.flink import prune_duplicate_jars; print(prune_duplicate_jars())"; \
    ls -l "$FLINK_HOME/lib"

# Flink on Kubernetes (the Flink Kubernetes Operator, native mode) expects the official flink
# image's layout: /opt/flink (FLINK_HOME; here a link to the pyflink tree, so
# local:///opt/flink/opt/flink-python-2.0.2.jar and /opt/flink/conf exist) and
# /docker-entrypoint.sh (docker/docker-entrypoint.sh: Flink's kubernetes-*.sh commands with the
# mounted /opt/flink/conf, anything else through flink-entrypoint.sh). ENTRYPOINT stays
# flink-entrypoint.sh for docker-compose; Flink's pods name /docker-entrypoint.sh themselves.
#
# The image's Flink configuration: Flink's defaults (env.java.opts.all), then the project's
# flink-conf/config.yaml (checkpointing, state backend, restart strategy, Python worker mode,
# Prometheus reporter), then container paths and bind addresses. taskmanager.host (localhost
# in the defaults) is dropped so each TaskManager advertises its container's address.
# config.image.yaml is the template; flink-entrypoint.sh merges JOB_MANAGER_RPC_ADDRESS and
# FLINK_PROPERTIES over it into config.yaml at every start (config.yaml starts as a copy so
# the image is usable without the entrypoint too). `flink --version` parses it with Flink's
# own YAML reader, which rejects what PyYAML might let through.
RUN set -eux; \
    mkdir -p /opt/flink-conf; \
    cp "$FLINK_HOME"/conf/log4j*.properties "$FLINK_HOME"/conf/logback*.xml /opt/flink-conf/; \
    /opt/streamtune/venv/bin/python -c "\
import os, yaml; \
from streamtune.stack.flink import flatten; \
home = os.environ['FLINK_HOME']; \
py = '/opt/streamtune/venv/bin/python'; \
conf = flatten(yaml.safe_load(open(home + '/conf/config.yaml')) or {}); \
conf.update(flatten(yaml.safe_load(open('/opt/streamtune/flink-conf/config.yaml')) or {})); \
conf = {k: v for k, v in conf.items() if k != 'taskmanager.host'}; \
conf.update({'python.executable': py, 'python.client.executable': py, \
             'jobmanager.bind-host': '0.0.0.0', 'taskmanager.bind-host': '0.0.0.0', \
             'rest.bind-address': '0.0.0.0', \
             'execution.checkpointing.dir': 'file:///flink-data/checkpoints', \
             'execution.checkpointing.savepoint-dir': 'file:///flink-data/savepoints', \
             'env.log.dir': os.environ['FLINK_LOG_DIR']}); \
open('/opt/flink-conf/config.image.yaml', 'w').write(yaml.safe_dump(conf, sort_keys=True, width=1 << 20))"; \
    cp /opt/flink-conf/config.image.yaml /opt/flink-conf/config.yaml; \
    cat /opt/flink-conf/config.yaml; \
    FLINK_LOG_DIR=/tmp/flink-build-log flink --version; \
    rm -rf /tmp/flink-build-log; \
    install -m 0755 /opt/streamtune/docker/flink-entrypoint.sh /usr/local/bin/flink-entrypoint.sh; \
    install -m 0755 /opt/streamtune/docker/docker-entrypoint.sh /docker-entrypoint.sh; \
    ln -s "$FLINK_HOME" /opt/flink; \
    test -f /opt/flink/opt/flink-python-2.0.2.jar; \
    test -x /opt/flink/bin/kubernetes-jobmanager.sh; \
    test -x /opt/flink/plugins/external-resource-gpu/nvidia-gpu-discovery.sh; \
    mkdir -p /flink-data/checkpoints /flink-data/savepoints "$FLINK_LOG_DIR"; \
    chown flink:flink /opt/flink-conf /opt/flink-conf/config.yaml "$FLINK_LOG_DIR" "$FLINK_HOME/log"; \
    chown -R flink:flink /flink-data

USER flink
WORKDIR /opt/streamtune

EXPOSE 6123 8081 9249
ENTRYPOINT ["/usr/local/bin/flink-entrypoint.sh"]
CMD ["jobmanager"]
