"""Role: KV bridge (cache keys, method fingerprints, store tiers, gRPC transfer)."""
