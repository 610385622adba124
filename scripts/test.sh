#!/usr/bin/env bash
# Install omni-proxy with its test and lint dependencies (once), check lint and types, and run
# the whole test suite.
source "$(dirname "$0")/bootstrap.sh" test,dev
# Lint and types first (seconds; configured in pyproject.toml): a finding fails the run.
ruff check .
mypy
source "$ROOT/scripts/install_services.sh"  # redis-server for the state-store tests (OS packages)
source "$ROOT/scripts/install_vllm.sh"   # real vLLM for tests/test_vllm_pd_nixl.py (cached)
# A shared 2-core machine can take minutes to start two vLLM engines: be patient.
export OMNI_VLLM_START_TIMEOUT="${OMNI_VLLM_START_TIMEOUT:-600}"
exec python -m pytest "$@"
