#!/usr/bin/env bash
# Install omni-proxy with its test dependencies (once) and run the whole test suite.
source "$(dirname "$0")/bootstrap.sh" test
source "$ROOT/scripts/install_services.sh"  # redis-server for the state-store tests (OS packages)
source "$ROOT/scripts/install_vllm.sh"   # real vLLM for tests/test_vllm_pd_nixl.py (cached)
# A shared 2-core machine can take minutes to start two vLLM engines: be patient.
export OMNI_VLLM_START_TIMEOUT="${OMNI_VLLM_START_TIMEOUT:-600}"
exec python -m pytest "$@"
