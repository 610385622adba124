"""Helpers that run a real vLLM (CPU build) next to omni-proxy in the tests.

``scripts/install_vllm.sh`` installs it; ``vllm_server`` starts and stops servers;
``vllm_entry`` is the command-line launcher; ``make_tiny_model`` builds the model.
"""
