"""Engine simulator: a vLLM-compatible HTTP server whose timings come from a cost model.

Stands in for GPU vLLM engines in tests, demos and capacity planning. Layout:
``config`` (SimConfig), ``tokens`` (toy tokenizer/text), ``engine`` (continuous-batching
cost model), ``block_pool`` (KV blocks with vLLM's prefix caching and LRU eviction),
``kv_events`` (vLLM's ZMQ KV-event publisher and replay), ``parsing`` and ``protocol``
(OpenAI request/response shapes), ``kv_transfer``
(prefill/decode roles: which KV flow a request takes, and the NIXL pull flow), ``bootstrap``
(parallel P+D: SGLang rooms, vLLM MooncakeConnector), ``layerwise`` (D-first push through a
metaserver), ``faults``, ``request_log``, ``metrics``, ``context`` (per-app state, the tokenization cost),
``generate`` (generation handlers), ``server`` (app + ops routes) and ``cli``.
"""
