"""Role: prefill worker (chunked prefill with hidden-state taps, KV + draft-state export)."""
