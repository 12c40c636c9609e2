"""The offloading connector: a tiered KV cache (host memory, local disk, remote store)."""
