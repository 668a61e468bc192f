#!/usr/bin/env bash
# Chromium from the Debian packages, for tests/unit/test_report.py (it renders report.html headless and counts the
# points each plot drew). Idempotent: an installed chromium is left as it is.
#
# Needs root and apt-get; without them it says so and exits 0, so a developer's `make test` still runs (the
# browser test then skips, naming why). ZEROTUNE_NO_CHROMIUM=1 skips it too.
set -euo pipefail

say() { echo "chromium_up: $*" >&2; }

if [[ -n "${ZEROTUNE_NO_CHROMIUM:-}" ]]; then
    say "ZEROTUNE_NO_CHROMIUM is set: not installing Chromium (the browser test skips)"; exit 0
fi
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
    say "Chromium is installed"; exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    say "not root: not installing Chromium (the browser test skips); run 'sudo $0' for it"; exit 0
fi
if ! command -v apt-get >/dev/null; then
    say "no apt-get: not installing Chromium (the browser test skips)"; exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends chromium >/dev/null \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends chromium >/dev/null; }
command -v chromium >/dev/null || { say "apt-get ran but no chromium on PATH"; exit 1; }
say "installed $(chromium --version 2>/dev/null | head -1)"
