#!/usr/bin/env bash
# Builds .venv-nemo-gym at the repository root: NeMo Gym 0.4.0 on Python 3.12, with uv (which Gym's
# `ng_run` calls) and what Polar's generated stubs (polar/v1) need at run time: grpcio, protobuf and
# zstandard. No torch and no Polar install: the polar_agent server (integrations/gym) imports only
# polar.v1 and polar.gym_items, found through PYTHONPATH. The NeMo Gym test tier
# (tests/integration/test_nemo_gym.py, marked `nemo_gym`) runs Gym's commands from here.
#
# Gym lives in its own environment because it pulls in Ray, MLflow, wandb and Hydra, whose pins must
# not constrain the main one. nemo-gym 0.5 and later need Python >= 3.13.14; 0.4.0 has the same /run
# contract and needs >= 3.12. It is installed without --only-binary: one of its dependencies
# (antlr4-python3-runtime, through hydra-core) is a source distribution, and with binaries only pip
# settles on a broken old hydra-core instead.
#
# Idempotent: a stamp records what was installed, and a second run with the same inputs does nothing.
# Set PYTHON to choose the interpreter (default: pyenv's newest 3.12, else python3.12 on PATH).
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1

NEMO_GYM_VERSION=0.4.0
# What polar/v1's stubs import: their gencode checks protobuf's runtime against 7.35.1.
STUB_DEPS=("grpcio>=1.84" "protobuf>=7.35.1,<8" "zstandard>=0.22")

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-nemo-gym"
stamp="$venv/.polar-setup"
want="nemo-gym==$NEMO_GYM_VERSION uv ${STUB_DEPS[*]}"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c \
    "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('nemo_gym', 'grpc', 'zstandard')))" \
    2>/dev/null && [[ -x "$venv/bin/uv" ]]; then
  exit 0
fi

find_python() {
  if [[ -n "${PYTHON:-}" ]]; then
    echo "$PYTHON"
    return
  fi
  # pyenv's shims answer `command -v python3.12` even where 3.12 is not the selected version, so
  # pyenv's own 3.12 comes first, then a python3.12 that actually runs.
  local version
  if command -v pyenv > /dev/null; then
    version=$(pyenv versions --bare | grep -E '^3\.12\.[0-9]+$' | sort -t. -k3 -n | tail -1)
    if [[ -n "$version" ]]; then
      echo "$(pyenv root)/versions/$version/bin/python3.12"
      return
    fi
  fi
  if python3.12 -c "" 2> /dev/null; then
    command -v python3.12
    return
  fi
  echo "setup_nemo_gym.sh: no Python 3.12 found (nemo-gym $NEMO_GYM_VERSION needs it); set PYTHON" >&2
  exit 1
}

if [[ ! -x "$venv/bin/python" ]]; then
  python=$(find_python)
  "$python" -m venv "$venv"
fi
log="$venv/setup.log"
: > "$log"
# pip's output goes to a log that is shown only when a step fails, so a green run stays quiet.
pip() {
  if ! "$venv/bin/python" -m pip "$@" >> "$log" 2>&1; then
    echo "setup_nemo_gym.sh: pip $* failed; its output:" >&2
    cat "$log" >&2
    exit 1
  fi
}

pip install --progress-bar off "nemo-gym==$NEMO_GYM_VERSION" uv "${STUB_DEPS[@]}"

"$venv/bin/python" -c "import nemo_gym, grpc, zstandard, google.protobuf"
echo "$want" > "$stamp"
