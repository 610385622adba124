"""Engine simulator: a vLLM-compatible HTTP server whose timings come from a cost model.

Stands in for GPU vLLM engines in tests, demos and capacity planning. Layout:
``config`` (SimConfig), ``tokens`` (toy tokenizer/text), ``engine`` (continuous-batching
cost model), ``parsing`` and ``protocol`` (OpenAI request/response shapes), ``kv_transfer``
(prefill/decode roles: which KV flow a request takes, and the NIXL pull flow), ``bootstrap``
(parallel P+D: SGLang rooms, vLLM MooncakeConnector), ``layerwise`` (D-first push through a
metaserver), ``faults``, ``request_log``, ``metrics``, ``context`` (per-app state),
``generate`` (generation handlers), ``server`` (app + ops routes) and ``cli``.
"""
