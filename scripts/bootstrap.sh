# Sourced by demo.sh and test.sh: make (or reuse) the virtualenv and install omni-proxy.
# The venv lives outside the repository so fresh clones and CI reruns reuse it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${OMNI_PROXY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/omni-proxy}"
VENV="$CACHE/venv"
PY="${PYTHON:-python3}"
EXTRAS="${1:-}"

mkdir -p "$CACHE"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
fi
# Reinstall only when the dependency list changed (pip is slow even when nothing is to do).
STAMP="$VENV/.omni-proxy-$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c "import omni_proxy, sys; sys.exit(0 if omni_proxy.__file__.startswith('$ROOT/') else 1)" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q -e "$ROOT${EXTRAS:+[$EXTRAS]}" 2>&1 | grep -v -i "warning" || true
    "$VENV/bin/python" -c "import omni_proxy" || { echo "install failed" >&2; exit 1; }
    touch "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
