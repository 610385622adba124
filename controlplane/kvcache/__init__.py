"""KV-cache awareness: reproduce vLLM block hashes, decode its KV events, index who holds what.

Modules (each does one thing):
  hashing    -- vLLM v1 prefix-cache block hashes for a prompt (bytes and 64-bit event form)
  events     -- decode msgpack ``KVEventBatch`` payloads into typed dataclasses
  subscriber -- asyncio ZMQ SUB per engine with sequence-gap detection and replay
  index      -- global prefix index: per-worker match depth for a prompt's hash chain
"""
