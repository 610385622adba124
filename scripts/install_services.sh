#!/usr/bin/env bash
# Install the OS services the tests start themselves (redis-server, nginx; add more to SERVICES).
# Only what is missing is installed, with apt-get, quietly and without questions; when
# everything is present this returns at once. Run it directly, or source it (scripts/test.sh
# does). Without root, it uses `sudo -n` when that works, else it says what to install.

_omni_install_services() {
    # command to look for -> Debian/Ubuntu package that provides it
    local SERVICES="redis-server:redis-server nginx:nginx"
    local missing="" entry cmd pkg
    for entry in $SERVICES; do
        cmd="${entry%%:*}"; pkg="${entry#*:}"
        command -v "$cmd" >/dev/null 2>&1 || [ -x "/usr/bin/$cmd" ] || [ -x "/usr/sbin/$cmd" ] || missing="$missing $pkg"
    done
    [ -z "$missing" ] && return 0

    local sudo=""
    if [ "$(id -u)" != "0" ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            sudo="sudo -n"
        else
            echo "install_services: please install:$missing (needs root)" >&2
            return 1
        fi
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "install_services: no apt-get here; please install:$missing" >&2
        return 1
    fi
    echo "install_services: installing$missing" >&2
    export DEBIAN_FRONTEND=noninteractive
    # The package lists may be missing or stale on a fresh machine: update once, then install.
    $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null 2>&1 || {
        $sudo apt-get update -qq >/dev/null 2>&1 || true
        $sudo apt-get install -y -qq --no-install-recommends $missing >/dev/null || {
            echo "install_services: apt-get install$missing FAILED" >&2
            return 1
        }
    }
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    _omni_install_services || echo "install_services: continuing; tests that need these services will fail" >&2
    unset -f _omni_install_services
else
    set -euo pipefail
    _omni_install_services
fi
