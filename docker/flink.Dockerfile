# Flink 2.0.2 runtime + the streamtune PyFlink job library (build context: repo root).
FROM flink:2.0.2-java17

# The base is eclipse-temurin:17-jre-jammy (Ubuntu 22.04), whose apt python3 is
# 3.10, while pyproject.toml requires >=3.11,<3.12 (PyFlink 2.0.2 itself takes
# 3.9-3.12). uv installs a relocatable CPython 3.11 build under /opt/python,
# readable by the unprivileged flink user that runs the Python workers.
COPY --from=ghcr.io/astral-sh/uv:0.13.8 /uv /usr/local/bin/uv

ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYFLINK_CLIENT_EXECUTABLE=/opt/streamtune/venv/bin/python

# --seed puts pip into the venv; every install below goes through it.
RUN uv python install 3.11 \
    && uv venv --seed --python 3.11 /opt/streamtune/venv \
    && /opt/streamtune/venv/bin/pip install --upgrade pip

# Own layer before the source copy: the CUDA build of torch is several GB and
# must not be re-downloaded on every code change.
RUN /opt/streamtune/venv/bin/pip install torch==2.13.0

COPY . /opt/streamtune
RUN /opt/streamtune/venv/bin/pip install /opt/streamtune

# shigawire-apache-flink-libraries drops connector jars into pyflink/lib next to
# its own Flink 2.0.0 core jars. Only the connectors (and their clients/driver)
# go onto the 2.0.2 cluster classpath; the 2.0.0 core jars would clash with it.
# The wheel's jar names are unversioned (kafka-clients.jar), hence "*" not "-*".
# The container's PyFlink uses FLINK_HOME=/opt/flink, so pyflink/lib is never loaded here.
RUN set -eux; \
    lib="$(/opt/streamtune/venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/pyflink/lib"; \
    for pat in 'flink-connector-kafka*.jar' 'kafka-clients*.jar' 'flink-connector-jdbc*.jar' 'postgresql*.jar'; do \
        found=0; \
        for jar in "$lib"/$pat; do \
            [ -e "$jar" ] || continue; \
            install -m 0644 -o flink -g flink "$jar" /opt/flink/lib/; \
            found=1; \
        done; \
        [ "$found" = 1 ] || { echo "no $pat in $lib" >&2; exit 1; }; \
    done; \
    ls -l /opt/flink/lib

# The Flink distribution ships the Prometheus reporter in plugins/metrics-prometheus;
# fall back to opt/ in case an image variant only has it there.
RUN set -eux; \
    if ! ls /opt/flink/plugins/metrics-prometheus/flink-metrics-prometheus-*.jar >/dev/null 2>&1; then \
        mkdir -p /opt/flink/plugins/metrics-prometheus; \
        cp /opt/flink/opt/flink-metrics-prometheus-*.jar /opt/flink/plugins/metrics-prometheus/; \
    fi

# The project's Flink settings (checkpointing, state backend, restart strategy,
# Python worker mode) become the image's config.yaml; compose's FLINK_PROPERTIES
# is merged over it at start. Baked, not bind-mounted: the entrypoint rewrites
# config.yaml in place. The bind-host values restore what the base image set.
RUN set -eux; \
    cp /opt/streamtune/flink-conf/config.yaml /opt/flink/conf/config.yaml; \
    /bin/bash /opt/flink/bin/config-parser-utils.sh /opt/flink/conf /opt/flink/bin /opt/flink/lib \
        -Drest.address=0.0.0.0 -Drest.bind-address=0.0.0.0 \
        -Djobmanager.bind-host=0.0.0.0 -Dtaskmanager.bind-host=0.0.0.0; \
    chown flink:flink /opt/flink/conf/config.yaml; \
    cat /opt/flink/conf/config.yaml

# Created here so a fresh named volume at /flink-data is writable by the flink user.
RUN mkdir -p /flink-data/checkpoints /flink-data/savepoints \
    && chown -R flink:flink /flink-data

EXPOSE 8081 9249
