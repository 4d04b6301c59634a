"""formcast.engine: the inference engine (paged KV cache, continuous batching)."""
