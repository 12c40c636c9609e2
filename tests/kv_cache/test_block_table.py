"""Worker-side block tables: the slot mapping against a plain loop, row operations against a
list model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kv_cache import BlockTable, MultiGroupBlockTable


def slots_by_loop(rows: list[list[int]], block_size: int, req_indices, positions) -> list[int]:
    out = []
    for req, pos in zip(req_indices, positions):
        out.append(rows[req][pos // block_size] * block_size + pos % block_size)
    return out


def test_slot_mapping_example():
    table = BlockTable(block_size=4, max_num_reqs=2, max_num_blocks_per_req=3)
    table.add_row([7, 2], 0)
    table.add_row([5], 1)
    slots = table.compute_slot_mapping(
        np.array([0] * 6 + [1, 1]), np.array([0, 1, 2, 3, 4, 5, 0, 3])
    )
    assert slots.tolist() == [28, 29, 30, 31, 8, 9, 20, 23]
    assert slots.dtype == np.int64


@st.composite
def filled_tables(draw, block_size=None):
    block_size = block_size or draw(st.sampled_from([1, 2, 4, 16]))
    max_num_reqs = draw(st.integers(1, 6))
    max_blocks = draw(st.integers(1, 8))
    num_blocks = max_num_reqs * max_blocks + 1
    # Physical ids in shuffled order, as a long-running pool hands them out.
    ids = draw(st.permutations(list(range(1, num_blocks))))
    rows = []
    for r in range(max_num_reqs):
        n = draw(st.integers(0, max_blocks))
        rows.append(ids[r * max_blocks : r * max_blocks + n])
    return block_size, max_num_reqs, max_blocks, rows


@settings(max_examples=60, deadline=None)
@given(data=st.data(), spec=filled_tables())
def test_slot_mapping_matches_loop(data, spec):
    block_size, max_num_reqs, max_blocks, rows = spec
    table = BlockTable(block_size, max_num_reqs, max_blocks)
    for r, row in enumerate(rows):
        table.add_row(row, r)
    tokens = [
        (r, p) for r, row in enumerate(rows) for p in range(len(row) * block_size)
    ]  # every valid (request, position)
    picked = data.draw(st.lists(st.sampled_from(tokens), max_size=40)) if tokens else []
    req_indices = np.array([r for r, _ in picked], dtype=np.int32)
    positions = np.array([p for _, p in picked], dtype=np.int64)
    slots = table.compute_slot_mapping(req_indices, positions)
    assert slots.dtype == np.int64
    assert slots.tolist() == slots_by_loop(rows, block_size, req_indices, positions)


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_multi_group_slot_mapping(data):
    """One table per group, each with its own block size and ids; same tokens."""
    block_sizes = data.draw(st.lists(st.sampled_from([2, 4, 16]), min_size=1, max_size=3))
    num_reqs = data.draw(st.integers(1, 4))
    max_tokens = data.draw(st.integers(1, 40))
    max_blocks = [-(-max_tokens // bs) for bs in block_sizes]
    tables = MultiGroupBlockTable(block_sizes, num_reqs, max_blocks)
    assert len(tables) == len(block_sizes)
    rows = [
        [data.draw(st.permutations(range(1, 1 + num_reqs * mb)))[:mb] for _ in range(num_reqs)]
        for mb in max_blocks
    ]
    for r in range(num_reqs):
        tables.add_row(tuple(rows[g][r] for g in range(len(block_sizes))), r)
    picked = data.draw(
        st.lists(st.tuples(st.integers(0, num_reqs - 1), st.integers(0, max_tokens - 1)))
    )
    req_indices = np.array([r for r, _ in picked], dtype=np.int64)
    positions = np.array([p for _, p in picked], dtype=np.int64)
    slots = tables.compute_slot_mapping(req_indices, positions)
    for g, bs in enumerate(block_sizes):
        assert tables[g].block_size == bs
        assert slots[g].tolist() == slots_by_loop(rows[g], bs, req_indices, positions)


ROW_OPS = st.one_of(
    st.tuples(st.just("append"), st.integers(0, 3), st.lists(st.integers(1, 99), max_size=4)),
    st.tuples(st.just("add"), st.integers(0, 3), st.lists(st.integers(1, 99), max_size=8)),
    st.tuples(st.just("clear"), st.integers(0, 3)),
    st.tuples(st.just("move"), st.integers(0, 3), st.integers(0, 3)),
    st.tuples(st.just("swap"), st.integers(0, 3), st.integers(0, 3)),
)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(ROW_OPS, max_size=25))
def test_row_ops_match_list_model(ops):
    max_blocks = 6
    table = BlockTable(block_size=4, max_num_reqs=4, max_num_blocks_per_req=max_blocks)
    multi = MultiGroupBlockTable([4, 8], max_num_reqs=4, max_num_blocks=[max_blocks, max_blocks])
    model: list[list[int]] = [[] for _ in range(4)]
    for op, *args in ops:
        if op in ("append", "add"):
            row, ids = args
            new = (model[row] if op == "append" else []) + ids
            if len(new) > max_blocks:
                with pytest.raises(ValueError, match="max_num_blocks_per_req"):
                    getattr(table, f"{op}_row")(ids, row)
                with pytest.raises(ValueError, match="max_num_blocks_per_req"):
                    getattr(multi, f"{op}_row")((ids, ids), row)
                # Rejected writes leave the row as it was.
            else:
                getattr(table, f"{op}_row")(ids, row)
                getattr(multi, f"{op}_row")((ids, [i + 100 for i in ids]), row)
                model[row] = new
        elif op == "clear":
            table.clear_row(args[0])
            multi.clear_row(args[0])
            model[args[0]] = []
        elif op == "move":
            src, tgt = args
            table.move_row(src, tgt)
            multi.move_row(src, tgt)
            model[tgt] = list(model[src])
            if src != tgt:
                model[src] = []
        else:
            a, b = args
            table.swap_row(a, b)
            multi.swap_row(a, b)
            model[a], model[b] = model[b], model[a]
        for row in range(4):
            assert table.get_row(row).tolist() == model[row]
            assert int(table.num_blocks_per_row[row]) == len(model[row])
            assert multi[0].get_row(row).tolist() == model[row]
            assert multi[1].get_row(row).tolist() == [i + 100 for i in model[row]]
