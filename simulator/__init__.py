"""Engine simulator: a vLLM-compatible HTTP server whose timings come from a cost model."""
