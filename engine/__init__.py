"""flashpd's compact inference engine: Qwen3 target, paged KV cache, sampling, loaders."""
