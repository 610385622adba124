#!/usr/bin/env bash
# Install omni-proxy with its test dependencies (once) and run the whole test suite.
source "$(dirname "$0")/bootstrap.sh" test
exec python -m pytest "$@"
