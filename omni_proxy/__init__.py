"""omni-proxy: a prefill/decode-aware request scheduler for LLM inference fleets."""

__version__ = "0.1.0"
