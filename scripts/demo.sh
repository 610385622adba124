#!/usr/bin/env bash
# Install omni-proxy (once) and run the demo on simulated engines.
source "$(dirname "$0")/bootstrap.sh" ""
exec omni-proxy demo "$@"
