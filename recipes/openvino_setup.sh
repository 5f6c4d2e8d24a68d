#!/usr/bin/env bash
# OpenVINO GenAI for the kit (docs/CONFORMANCE.md, "OpenVINO GenAI"): a virtual environment of its own,
# since optimum-intel pins its own transformers (<5.6) and pulls torch and torchvision.
#
#   bash recipes/openvino_setup.sh [VENV]       # default /work/ov-venv
#   SPEC_OPENVINO_PYTHON=VENV/bin/python pytest tests/test_openvino.py
#   SPEC_OPENVINO_PYTHON=VENV/bin/python python recipes/openvino_check.py
#
# Measured here (2026-12-05, a loaded 2-core box): 67 to 134 s with the registry mirror and the CPU torch
# wheel on disk; 1.6 GB.
set -euo pipefail
VENV="${1:-/work/ov-venv}"
PY="${PYTHON:-python3}"

"$PY" -m venv "$VENV"
# torch first, pinned to the CPU build (2.13.0 is on this machine's disk; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu): optimum-intel needs torch>=2.1, and an unpinned
# resolve upgrades it to PyPI's CUDA build (torch 2.14.1 with the nvidia-* wheels: 6.1 GB instead of 1.6).
"$VENV/bin/pip" install torch==2.13.0
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==2.13.0" > "$CONSTRAINTS"
"$VENV/bin/pip" install -c "$CONSTRAINTS" "openvino-genai==2026.4.1.0" "optimum-intel[openvino]==2.2.0"
# optimum-intel requires torchvision, and PyPI's torchvision 0.28.0 is built against CUDA torch: with the
# CPU torch its C ops do not load ("RuntimeError: operator torchvision::nms does not exist"), which breaks
# `import transformers.PreTrainedModel` and so the export. Nothing the LLM export uses needs it.
"$VENV/bin/pip" uninstall -y torchvision
"$VENV/bin/python" -c "import openvino_genai, optimum.intel; from transformers import PreTrainedModel; \
print('openvino-genai', openvino_genai.__version__)"
echo "SPEC_OPENVINO_PYTHON=$VENV/bin/python"
