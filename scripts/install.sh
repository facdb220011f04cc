#!/usr/bin/env bash
# Installs what streamtune needs on a fresh Debian 12 machine: Java 17, PostgreSQL with
# wal2json, docker-compose (to validate the compose file) and chromium (the console's tests)
# from Debian; the project and
# its Python dependencies into a virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

need=()
command -v java >/dev/null || need+=(openjdk-17-jre-headless)
ls /usr/lib/postgresql/*/lib/wal2json.so >/dev/null 2>&1 || need+=(postgresql postgresql-15-wal2json)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v chromium >/dev/null && command -v chromedriver >/dev/null || need+=(chromium chromium-driver)  # console tests
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "install.sh: missing system packages; as root run: apt-get install -y ${need[*]}" >&2
    exit 1
  fi
  echo "installing Debian packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

PYTHON=$(command -v python3.11 || command -v python3)
"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "streamtune needs Python 3.11"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
# torch first and exactly pinned: the CPU build on this machine's disk, never a CUDA download.
"$VENV/bin/pip" install -q torch==2.13.0
"$VENV/bin/pip" install -q -e ".[test]"
"$VENV/bin/python" -c "from streamtune.stack.flink import prune_duplicate_jars; prune_duplicate_jars()"
echo "installed into $VENV"
