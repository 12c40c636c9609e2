"""What travels between processes: the codec, peer addresses, the control-plane socket and
the rate-limited log of what failed on the way. Shared by P2P, the registry, the server and KV
events."""
