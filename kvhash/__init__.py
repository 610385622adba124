"""vLLM's prefix-cache block hashes, computed exactly as the engines do.

Neutral ground: the data plane hashes prompts with it, the control plane matches the
hashes against the engines' KV events, and the simulator caches blocks under them. It
imports nothing from any plane.
"""
