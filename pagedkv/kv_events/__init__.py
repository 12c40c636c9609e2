"""KV events on the wire: what an instance's prefix cache stored and evicted, published over
ZMQ in vLLM's shape (``--kv-events-config``), for routers that mirror each instance's cache."""
