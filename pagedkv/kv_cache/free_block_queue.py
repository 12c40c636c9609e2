"""FreeKVCacheBlockQueue: the free blocks in eviction order, as an intrusive doubly linked list.

The links live in the blocks themselves, so no Python object is allocated per operation, and a
block can leave from the middle in O(1) when a prefix hit revives it (why not ``deque``).
Front = evicted (reused) first. Two sentinels bound the list, so no operation branches on
emptiness::

    head ⇄ b7 ⇄ b3 ⇄ b9 ⇄ tail        popleft() -> b7, append(b) puts b before tail
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedkv.kv_cache.kv_cache_block import KVCacheBlock


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        chain = [self._head, *blocks, self._tail]
        for prev, nxt in zip(chain, chain[1:]):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks available")
        block = self._head.next_free_block
        assert block is not None
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} are free")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        prev.next_free_block = nxt  # type: ignore[union-attr]
        nxt.prev_free_block = prev  # type: ignore[union-attr]
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the back, in order: they are reused last."""
        tail = self._tail
        last = tail.prev_free_block
        n = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block  # type: ignore[union-attr]
            last = block
            n += 1
        last.next_free_block = tail  # type: ignore[union-attr]
        tail.prev_free_block = last
        self.num_free_blocks += n

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put ``blocks`` at the front, in order: ``blocks[0]`` is reused first."""
        if not blocks:
            return
        first = self._head.next_free_block
        prev = self._head
        for block in blocks:
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev  # type: ignore[union-attr]
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queue front to back (for tests and integrity checks)."""
        out = []
        block = self._head.next_free_block
        while block is not self._tail:
            assert block is not None
            out.append(block)
            block = block.next_free_block
        return out
