"""The P2P KV connector: ZMQ control plane + a 2-rank gloo group per P/D pair (see worker.py)."""
