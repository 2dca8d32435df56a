#!/usr/bin/env bash
# The browser tier's machine: Debian's Chromium and its driver (/usr/bin/chromium,
# /usr/bin/chromedriver), which the `polar view` tests drive through selenium (the dev extra).
# No browser is downloaded by a test tool. Installs them with apt-get (needs root) when either is
# missing; does nothing otherwise.
set -euo pipefail

if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
  echo "setup_browser: installing chromium and chromium-driver needs root; run this script as root" >&2
  exit 1
fi
echo "setup_browser: installing chromium and chromium-driver"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -o DPkg::Lock::Timeout=600 chromium chromium-driver >/dev/null
