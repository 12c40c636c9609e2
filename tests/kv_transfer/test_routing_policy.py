"""The router's choices, in one process: replicas, kv_aware costs and ties (new prefixes spread
by recent work), P/D by each side's own cached prefix, and conditional disaggregation. The KV
index is fed real wire events and the prompts are tokenized and hashed by the proxy's real
tokenizer path."""

from __future__ import annotations

import logging
import random
import time
from collections import Counter

import pytest

from pagedkv.entrypoints.proxy.kv_index import KVIndex
from pagedkv.entrypoints.proxy.prompt_blocks import PromptTokenizer
from pagedkv.entrypoints.proxy.recent_work import RecentWork
from pagedkv.entrypoints.proxy.registry import Instance
from pagedkv.entrypoints.proxy.router import Prompt, Router
from pagedkv.entrypoints.serving.registration import Register
from pagedkv.kv_cache.block_hash import BlockHasher
from pagedkv.kv_events.wire import AllBlocksCleared, BlockRemoved, BlockStored
from pagedkv.transport.peer_addr import PeerAddr
from tests.kv_transfer.test_proxy_units import FakeRegistry

BS = 16


def instance(name: str, role: str = "plain", running: int = 0, fingerprint: str = "fp"):
    info = Register(
        role, "http://127.0.0.1:1", "m", fingerprint, num_running=running,
        hash_algo="xxh3_128", block_size=BS,
    )  # fmt: skip
    return Instance(PeerAddr(name, "127.0.0.1", 1), info, time.monotonic())


def store(index: KVIndex, name: str, token_ids: list[int], medium: str = "GPU") -> None:
    """``name`` caches every full block of ``token_ids`` in ``medium``, as its pool's (or its
    connector's tier's) event would say."""
    hashes = BlockHasher(BS).hash_token_ids(token_ids)
    stored = BlockStored(hashes, None, token_ids[: len(hashes) * BS], BS, None, medium, None, 0)
    index.apply(name, [stored])


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> PromptTokenizer:
    return PromptTokenizer(tiny_model)


PROMPT = list(range(10, 110))  # 100 tokens: 6 full blocks, at most 96 tokens hit


def kv_router(instances, tokenizer, **kw) -> tuple[Router, KVIndex]:
    index = KVIndex()
    router = Router(FakeRegistry(instances), "kv_aware", kv_index=index, tokenizer=tokenizer, **kw)  # type: ignore[arg-type]
    return router, index


def test_kv_aware_picks_the_cached_prefix_until_load_outweighs_it(tokenizer) -> None:
    a, b = instance("a"), instance("b", running=1)
    router, index = kv_router([a, b], tokenizer, load_weight=40.0)
    store(index, "b", PROMPT[:64])  # b holds 4 blocks: 64 tokens
    route = router.route(Prompt(PROMPT))
    # a: 100 uncached + 0; b: 36 uncached + 40 x 1 = 76, more than NEAR_TIE_TOKENS below a
    assert (route.d.engine_id, route.p, route.predicted_hit_tokens) == ("b", None, 64)
    # The prompt is on its way into b's cache: the same prefix goes there before its event.
    again = PROMPT[:80] + [7] * 20
    assert router.route(Prompt(again)).predicted_hit_tokens == 80
    router.acquire(b)
    router.acquire(b)  # b: 100 - 64 + 40 x 3 = 156 > a's 100 + NEAR_TIE_TOKENS
    other = PROMPT[:64] + [9] * 36
    route = router.route(Prompt(other))
    assert (route.d.engine_id, route.predicted_hit_tokens) == ("a", 0)
    # The last prompt token is never a hit: a whole cached prompt predicts 96, not 100.
    store(index, "a", PROMPT)
    assert router.route(Prompt(PROMPT)).predicted_hit_tokens == 96


LONG = list(range(10, 410))  # 400 tokens: 384 can hit, a tier's cost well past a near-tie


def test_kv_aware_credits_a_hit_by_its_tier(tokenizer) -> None:
    """A host-tier hit beats no hit, a pool hit beats a host hit, a host hit beats a disk hit;
    the cost of each prompt token is where it is (pool 0, CPU 0.1, DISK 0.3, none 1)."""
    a, b, c = instance("a"), instance("b"), instance("c")
    router, index = kv_router([a, b, c], tokenizer, load_weight=0.0)
    store(index, "b", LONG, "CPU")
    store(index, "c", LONG[:192])  # c: the first 12 blocks in its pool, the rest in its tier
    store(index, "c", LONG, "CPU")
    hits = router.policy.hit_tokens(Prompt(LONG), [a, b, c])
    assert hits == {"a": {}, "b": {"CPU": 384}, "c": {"GPU": 192, "CPU": 192}}
    costs = [router.policy.cost(i, len(LONG), hits) for i in (a, b, c)]
    assert costs == pytest.approx([400, 16 + 38.4, 16 + 19.2])
    route = router.route(Prompt(LONG))
    assert (route.d.engine_id, route.predicted_hit_tokens) == ("c", 384)

    router, index = kv_router([a, b], tokenizer, load_weight=0.0)
    store(index, "b", LONG, "CPU")
    assert router.route(Prompt(LONG)).d.engine_id == "b"  # a host hit over nothing
    router, index = kv_router([a, b], tokenizer, load_weight=0.0)
    store(index, "a", LONG)
    store(index, "b", LONG, "CPU")
    router.recent_work.add("a", 10_000)  # no tie: lately's work does not decide
    assert router.route(Prompt(LONG)).d.engine_id == "a"  # a pool hit over a host hit
    router, index = kv_router([a, b], tokenizer, load_weight=0.0)
    store(index, "a", LONG, "DISK")
    store(index, "b", LONG, "CPU")
    assert router.route(Prompt(LONG)).d.engine_id == "b"  # host over disk


def test_kv_tier_costs_are_configurable(tokenizer) -> None:
    """``--kv-tier-cost CPU=1``: a host hit saves nothing, so it ties with no hit (recent work
    decides), yet it is still predicted as a hit."""
    a, b = instance("a"), instance("b")
    costs = {"GPU": 0.0, "CPU": 1.0}
    router, index = kv_router([a, b], tokenizer, load_weight=0.0, tier_costs=costs)
    store(index, "b", LONG, "CPU")
    router.recent_work.add("b", 1000)
    route = router.route(Prompt(LONG))
    assert (route.d.engine_id, route.predicted_hit_tokens) == ("a", 0)
    router, index = kv_router([a, b], tokenizer, load_weight=0.0, tier_costs=costs)
    store(index, "b", LONG, "CPU")
    router.recent_work.add("a", 1000)
    route = router.route(Prompt(LONG))
    assert (route.d.engine_id, route.predicted_hit_tokens) == ("b", 384)


def test_ties_go_to_the_least_recent_work_then_at_random(tokenizer) -> None:
    firsts = set()
    for seed in range(20):  # nothing sent yet: every cost and every recent work is equal
        router, _ = kv_router([instance(n) for n in "abc"], tokenizer, seed=seed)
        firsts.add(router.route(Prompt(PROMPT)).d.engine_id)
    assert firsts == {"a", "b", "c"}
    router, index = kv_router([instance(n) for n in "abc"], tokenizer, seed=0)
    prompts = [[i, *PROMPT] for i in range(6)]  # nothing shared, equal lengths
    chosen = [router.route(Prompt(p)).d.engine_id for p in prompts]
    assert sorted(chosen[:3]) == sorted(chosen[3:]) == ["a", "b", "c"]
    assert router.recent_work.get("a") == pytest.approx(2 * 101, rel=1e-3)
    # A near-tie: one block more cached at a (NEAR_TIE_TOKENS) does not outweigh the work a
    # was sent lately; a longer hit does.
    store(index, "a", [1] * 16 + PROMPT)
    router.recent_work.add("a", 1000)
    assert router.route(Prompt([1] * 16 + [2] * 50)).d.engine_id != "a"
    assert router.route(Prompt([1] * 16 + PROMPT)).d.engine_id == "a"
    # P is chosen the same way: two Ps of one D take new prompts in turn.
    ps = [instance(n, "kv_producer") for n in ("p0", "p1")]
    router, _ = kv_router([*ps, instance("d", "kv_consumer")], tokenizer, seed=0)
    chosen = [router.route(Prompt([i, *PROMPT])).p.engine_id for i in range(4)]
    assert sorted(chosen[:2]) == sorted(chosen[2:]) == ["p0", "p1"]


def test_recent_work_halves_every_half_life() -> None:
    now = [100.0]
    work = RecentWork(half_life_s=10.0, clock=lambda: now[0])
    work.add("a", 400)
    now[0] += 10.0
    assert work.get("a") == pytest.approx(200.0) and work.get("b") == 0.0
    work.add("a", 100)  # 200 decayed + 100
    now[0] += 20.0
    assert work.get("a") == pytest.approx(75.0)
    with pytest.raises(ValueError, match="half_life_s"):
        RecentWork(half_life_s=0.0)


def one_at_a_time(tokenizer, seed: int, header: list[int]) -> tuple[float, list[int], int]:
    """6 prefixes of 150 tokens (``header`` first) x 6 questions of 20-60 tokens, shuffled,
    routed one at a time over 3 replicas; each answer's blocks reach the index as events before
    the next request. (largest share of prompt tokens, hits of every prefix's repeats, the
    hit a repeat can take)."""
    rng = random.Random(seed)
    prefixes = [
        header + [rng.randrange(10, 4000) for _ in range(150 - len(header))] for _ in range(6)
    ]
    requests = [
        (p, prefix + [rng.randrange(10, 4000) for _ in range(rng.randrange(20, 60))])
        for p, prefix in enumerate(prefixes)
        for _ in range(6)
    ]  # fmt: skip
    rng.shuffle(requests)
    router, index = kv_router([instance(n) for n in "abc"], tokenizer, seed=seed)
    tokens: Counter[str] = Counter()
    repeat_hits, seen = [], set()
    for p, token_ids in requests:
        route = router.route(Prompt(token_ids))
        if p in seen:
            repeat_hits.append(route.predicted_hit_tokens)
        seen.add(p)
        tokens[route.d.engine_id] += len(token_ids)
        store(index, route.d.engine_id, token_ids)
    return max(tokens.values()) / sum(tokens.values()), repeat_hits, 150 // BS * BS


@pytest.mark.parametrize("header", [0, BS], ids=["distinct", "shared-first-block"])
def test_new_prefixes_spread_when_requests_come_one_at_a_time(tokenizer, header) -> None:
    """Every load is 0 at each decision, and a new prefix costs the same everywhere (or a block
    less where the shared header is): the prefixes still spread, no replica takes
    more than half the prompt tokens, and every repeat of a prefix hits it whole."""
    shared = list(range(4000, 4000 + header))
    piled = {}
    for seed in range(40):
        share, repeat_hits, whole = one_at_a_time(tokenizer, seed, shared)
        assert repeat_hits == [whole] * 30, seed
        if share > 0.5:
            piled[seed] = round(share, 2)
    assert not piled, f"seeds whose largest replica took over half the prompt tokens: {piled}"


def test_a_prefix_is_held_only_from_its_first_block_and_removed_blocks_are_gone(
    tokenizer,
) -> None:
    router, index = kv_router([instance("a")], tokenizer)
    router.load_weight = 0.0
    hashes = BlockHasher(BS).hash_token_ids(PROMPT)
    store(index, "a", PROMPT)
    index.apply("a", [BlockRemoved([hashes[2]], "GPU", 0)])
    assert router.route(Prompt(PROMPT)).predicted_hit_tokens == 32  # blocks 3.. useless now
    index.apply("a", [AllBlocksCleared()])
    assert router.route(Prompt(PROMPT)).predicted_hit_tokens == 0
    assert index.num_cached_blocks("a") == 0
    # A salted prompt's hashes differ from the first block on.
    store(index, "a", PROMPT)
    assert router.route(Prompt(PROMPT, cache_salt="tenant")).predicted_hit_tokens == 0


def test_pd_chooses_d_by_its_own_overlap_and_p_by_its_own(tokenizer) -> None:
    ps = [instance(n, "kv_producer") for n in ("p0", "p1")]
    ds = [instance(n, "kv_consumer") for n in ("d0", "d1")]
    router, index = kv_router(ps + ds, tokenizer)
    store(index, "d1", PROMPT[:48])
    store(index, "p1", PROMPT)
    route = router.route(Prompt(PROMPT))
    assert (route.d.engine_id, route.p.engine_id, route.predicted_hit_tokens) == ("d1", "p1", 48)


def test_conditional_disaggregation_skips_p_when_d_lacks_few_tokens(tokenizer) -> None:
    p, d = instance("p", "kv_producer"), instance("d", "kv_consumer")
    router, index = kv_router([p, d], tokenizer, disagg_threshold=40)
    route = router.route(Prompt(PROMPT))
    assert route.p is not None  # d lacks all 100 tokens
    store(index, "d", PROMPT[:64])
    assert router.route(Prompt(PROMPT)).p is None  # d lacks 36 < 40: it prefills them
    assert router.route(Prompt(PROMPT[:30])).p is None  # a short prompt: no P either
    # Without the index (round robin), the threshold still applies to the prompt's length.
    rr = Router(FakeRegistry([p, d]), tokenizer=tokenizer, disagg_threshold=40)  # type: ignore[arg-type]
    assert rr.route(Prompt(PROMPT[:30])).p is None and rr.route(Prompt(PROMPT)).p is not None


def test_replicas_are_routed_whole_and_cycled(tokenizer) -> None:
    router = Router(FakeRegistry([instance(n) for n in "abc"]), "round_robin")  # type: ignore[arg-type]
    routes = [router.route() for _ in range(6)]
    assert [r.d.engine_id for r in routes] == list("abcabc")
    assert all(r.p is None and r.predicted_hit_tokens is None for r in routes)
    assert router.route(exclude={"a", "b", "c"}) is None
    assert "0 prefill, 0 decode and 3 replica" in router.why_no_pair()


def test_the_proxy_tokenizes_as_the_server_does(tokenizer) -> None:
    hf = tokenizer.tokenizer
    assert tokenizer.token_ids("/v1/completions", {"prompt": "w1 w2 w3"}) == hf.encode("w1 w2 w3")
    assert tokenizer.token_ids("/v1/completions", {"prompt": [[5, 6, 7]]}) == [5, 6, 7]
    assert tokenizer.token_ids("/v1/completions", {"prompt": ["a", "b"]}) is None  # a batch
    messages = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}]}]
    text = hf.apply_chat_template(
        [{"role": "user", "content": "w5 w6"}], tokenize=False, add_generation_prompt=True
    )
    expected = hf.encode(text, add_special_tokens=False)
    assert tokenizer.token_ids("/v1/chat/completions", {"messages": messages}) == expected
    assert tokenizer.token_ids("/v1/chat/completions", {"messages": "hi"}) is None
    with pytest.raises(ValueError, match="--tokenizer"):
        PromptTokenizer("/nonexistent/tokenizer")


def test_the_proxy_tokenizer_logs_no_length_warning(caplog) -> None:
    """The instance refuses an over-long prompt; the proxy's tokenizer must not log
    transformers' "Token indices sequence length is longer than ..." on the way (the
    built-in model's tokenizer says model_max_length 256, as real checkpoints' do)."""
    from pagedkv.engine.engine_args import DEFAULT_MODEL_PATH

    tokenizer = PromptTokenizer(DEFAULT_MODEL_PATH)
    transformers_logger = logging.getLogger("transformers")  # it does not propagate
    transformers_logger.addHandler(caplog.handler)
    try:
        ids = tokenizer.token_ids("/v1/completions", {"prompt": "hi " * 300})
    finally:
        transformers_logger.removeHandler(caplog.handler)
    assert ids is not None and len(ids) > 256
    assert "Token indices sequence length" not in caplog.text


def test_a_registration_with_a_bad_events_endpoint_hashing_or_tiers_is_refused() -> None:
    """The proxy connects to what an instance registers: only tcp://host:port is accepted;
    and it shows what it registers: a few KV tiers, each a short name and a capacity."""
    base = dict(role="plain", http_url="http://127.0.0.1:1", model="m", fingerprint="fp")
    for bad in ("tcp://*:5557", "ipc:///tmp/x", "tcp://host", "tcp://a b:1", "http://h:1"):
        with pytest.raises(ValueError, match="kv_events_endpoint"):
            Register(**base, kv_events_endpoint=bad)
    with pytest.raises(ValueError, match="hash_algo"):
        Register(**base, hash_algo="md5", block_size=16)
    with pytest.raises(ValueError, match="role"):
        Register(**{**base, "role": "replica"})
    assert Register(**base, kv_events_endpoint="tcp://127.0.0.1:5557").kv_events_endpoint
    tiers = {f"T{i}": 1 for i in range(9)}
    for bad in ({"CPU": -1}, {"": 1}, {"C" * 33: 1}, {"a\nb": 1}, tiers):
        with pytest.raises(ValueError, match="kv_tiers"):
            Register(**base, kv_tiers=bad)
    good = instance("a")
    good.info = Register(**base, kv_tiers={"CPU": 4096, "DISK": 1 << 20})
    assert good.describe()["kv_tiers"] == {"CPU": 4096, "DISK": 1 << 20}  # in /instances
