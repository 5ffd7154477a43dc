"""Role: decode worker (scheduler, native and DFlash steps, KV import)."""
