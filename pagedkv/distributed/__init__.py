"""Tensor parallelism's collectives and shard arithmetic (``TPGroup``, ``shard``)."""
