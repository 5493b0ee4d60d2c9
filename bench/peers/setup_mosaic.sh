#!/usr/bin/env bash
# The venv of the MosaicML Streaming peer in `elastic bench data` (elastic/bench/data_peers.py runs
# bench/peers/mosaic_read.py with its python). A venv of its own: mosaicml-streaming 0.13 pins numpy<2.2 and
# transformers<5, which the project's venv does not hold. Re-running it upgrades nothing already satisfied.
#   bench/peers/setup_mosaic.sh            (or: make peers)
#   TORCH_SPEC='torch==2.13.0' PYTHON=python3.11 bench/peers/setup_mosaic.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${MOSAIC_VENV:-$here/.venv-mosaic}"
python="${PYTHON:-python3}"
# The project's torch pin (Makefile's TORCH_SPEC); a machine with a CPU wheel on its find-links gets that one.
torch_spec="${TORCH_SPEC:-torch==2.13.0}"

test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "$torch_spec"
# torch first, then streaming with the same spec, so pip keeps that torch for streaming's torchvision dependency
# (PyPI's torchvision pins its torch release) instead of swapping it for another build.
"$venv/bin/python" -m pip install --quiet 'mosaicml-streaming==0.13.*' pyarrow "$torch_spec"
# The runner's own import of streaming (it stubs a torchvision that fails beside a CPU torch: see mosaic_read.py).
"$venv/bin/python" - "$here" <<'PY'
import sys
sys.path.insert(0, sys.argv[1])
import mosaic_read, numpy, pyarrow, torch
streaming = mosaic_read._import_streaming()
print("mosaic venv ready: streaming", streaming.__version__, "torch", torch.__version__,
      "pyarrow", pyarrow.__version__, "numpy", numpy.__version__)
PY
