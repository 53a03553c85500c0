#!/bin/sh
# Headless Chromium for the dashboard's browser test (tests/e2e/frontend/test_dashboard.py):
# from the distribution's packages (Debian/Ubuntu), only when it is missing. Without root or apt
# it says so and exits 0: the browser test then skips, naming this script.
set -eu
for bin in chromium chromium-browser google-chrome; do
    if command -v "$bin" >/dev/null 2>&1; then
        echo "chromium: $(command -v "$bin")"
        exit 0
    fi
done
if ! command -v apt-get >/dev/null 2>&1; then
    echo "chromium: no apt-get here; install Chromium by hand to run the dashboard test" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
        echo "chromium: not root and no sudo; install Chromium by hand" >&2
        exit 0
    fi
fi
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium \
    || { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
         apt-get install -y -q --no-install-recommends chromium; }
