"""The centralized KV store connector: blocks' KV under their chained hashes in Redis, a shared
directory or Mooncake Store, for PD hand-off and cross-instance prefix reuse.

connector.py (scheduler half), worker.py (worker half), writer.py / loader.py (its threads),
block_layout.py (cache <-> payload), block_codec.py (keys and value format), backends/.
"""
