"""Sliding-window layer groups (core/kv_groups.py) and the block manager that frees what a window has
passed (core/block_manager.py): the grouping of real models' layers, the pages a long request keeps,
prefix-cache hits that need only the window's last blocks, and, end to end on tiny Gemma 2 and 3
checkpoints, greedy outputs equal to transformers' while pages are freed, under swap and recompute
preemption and with prefix caching."""

from __future__ import annotations

import dataclasses

import pytest
import tiny

from jaxsched.core.block_manager import NULL_BLOCK, BlockManager, cdiv
from jaxsched.core.kv_groups import kv_groups
from jaxsched.core.request import Request, SamplingParams
from jaxsched.models.registry import model_config_from_hf
from jaxsched.sizing import kv_bytes_per_block


def gemma3_shaped(layers: int = 26, window: int = 1024, sliding: bool = True):
    """A Gemma 3-shaped config (five sliding layers to one global), or the same with every layer global."""
    hf = {"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": layers, "hidden_size": 1152,
          "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
          "vocab_size": 262144, "sliding_window": window, "max_position_embeddings": 32768}
    cfg = model_config_from_hf(hf)
    return cfg if sliding else dataclasses.replace(cfg, sliding_window=None, sliding_layers=None)


def test_groups_of_real_layouts():
    g3 = kv_groups(gemma3_shaped())  # 26 layers: global 5, 11, 17, 23
    assert g3.size == 4 and g3.num_groups == 7 and g3.layers[0] == (5, 11, 17, 23)
    assert g3.windows == (None, *[1024] * 6) and g3.layers[-1] == (24, 25)  # 22 sliding: 5 groups of 4, one of 2
    assert sorted(sum(g3.layers, ())) == list(range(26))
    group, slot = g3.group_of(), g3.slot_of()
    assert (group[5], slot[5], group[0], slot[0], group[25], slot[25]) == (0, 0, 1, 0, 6, 1)
    gemma2 = model_config_from_hf({**tiny.hf_config("gemma2", 96).to_dict(), "architectures": ["Gemma2ForCausalLM"],
                                   "num_hidden_layers": 6, "layer_types": None})
    assert kv_groups(gemma2).layers == ((1, 3, 5), (0, 2, 4)) and kv_groups(gemma2).size == 3
    mistral = model_config_from_hf({**tiny.hf_config("mistral", 96).to_dict(), "architectures": ["MistralForCausalLM"],
                                    "sliding_window": 12})
    assert kv_groups(mistral).layers == ((0, 1),) and kv_groups(mistral).windows == (12,)
    plain = kv_groups(dataclasses.replace(mistral, sliding_window=None))
    assert plain.layers == ((0, 1),) and plain.windows == (None,) and plain.sliding == ()


def held_bytes(cfg, context: int, block_size: int = 16, chunk: int = 2048) -> int:
    """The KV bytes one request holds, across all layers, after prefilling `context` tokens in
    chunks and decoding one more: its live pages times a page's bytes."""
    groups = kv_groups(cfg)
    bm = BlockManager(4096, block_size, groups=groups)
    r = Request("a", list(range(context)), SamplingParams())
    while r.num_computed_tokens < context:
        n = min(chunk, context - r.num_computed_tokens)
        assert bm.allocate_slots(r, n)
        r.num_computed_tokens += n
    assert bm.allocate_slots(r, 1)
    bm.check_invariants()
    pages = sum(b != NULL_BLOCK for b in bm.block_ids("a"))
    return pages * kv_bytes_per_block(cfg, block_size, "bfloat16")


def test_a_long_gemma3_context_holds_under_a_third_of_its_full_attention_kv():
    """The issue's figure: 8,192 tokens, window 1,024, 16-token blocks. The sliding groups keep
    ceil(1024 / 16) + 1 = 65 pages each; the global group all 513."""
    windowed, full = held_bytes(gemma3_shaped(), 8192), held_bytes(gemma3_shaped(sliding=False), 8192)
    groups = kv_groups(gemma3_shaped())
    page = kv_bytes_per_block(gemma3_shaped(), 16, "bfloat16")
    assert windowed == (513 + 6 * 65) * page  # the global group, and six sliding groups of 65 pages
    assert full == 513 * 2 * 26 * 16 * 256 * 2  # 513 blocks of every layer's K and V
    assert windowed / full <= 0.3, windowed / full
    assert groups.size * page // (2 * 4 * 16 * 256 * 2) == groups.size  # a page holds Lg = 4 layers


def sliding_manager(window: int = 16, num_blocks: int = 64, caching: bool = False) -> BlockManager:
    """Two groups (one global, one sliding), 8-token blocks."""
    cfg = gemma3_shaped(layers=2, window=window)
    cfg = dataclasses.replace(cfg, sliding_layers=(0,))
    groups = kv_groups(cfg)
    assert groups.layers == ((1,), (0,)) and groups.windows == (None, window)
    return BlockManager(num_blocks, 8, enable_prefix_caching=caching, groups=groups)


def test_decoding_past_the_window_frees_the_sliding_pages_it_passed():
    bm = sliding_manager(window=16)
    r = Request("a", list(range(40)), SamplingParams())
    assert bm.allocate_slots(r, 40)
    assert len(bm.block_ids("a")) == 10 and NULL_BLOCK not in bm.block_ids("a")  # 5 blocks, 2 groups
    free = bm.num_free_blocks
    for _ in range(20):  # decode: position 40 on
        r.num_computed_tokens += 1 if r.num_computed_tokens else 40
        assert bm.allocate_slots(r, 1)
        bm.check_invariants()
    blocks = bm.block_ids("a")  # position 59 next: a query there reads 44..59, blocks 5 to 7
    assert r.num_computed_tokens == 59 and bm.trimmed("a") == bm.first_needed(59) == 5
    assert blocks[1::2][:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in blocks[1::2][5:]
    assert NULL_BLOCK not in blocks[0::2]  # the global group keeps every page
    assert bm.num_free_blocks == free - 6 + 5  # 3 more blocks in both groups, 5 sliding pages back
    assert bm.num_trimmed_pages == 5
    bm.free("a")
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def test_a_prefix_hit_needs_only_the_windows_last_blocks():
    bm = sliding_manager(window=16, caching=True)
    a = Request("a", list(range(60)), SamplingParams())
    assert bm.allocate_slots(a, 60)
    a.num_computed_tokens = 60
    bm.register(a)
    assert bm.allocate_slots(a, 1)  # trims: position 60 reads from 45 on, block 5
    assert bm.trimmed("a") == 5
    b = Request("b", list(range(60)) + [99], SamplingParams())
    hits = bm.lookup(b)  # 7 full blocks: a query at 56 reads 41.., so the sliding pages of blocks 5, 6
    assert len(hits) == 14 and hits[0::2] == bm.block_ids("a")[0:14:2]
    assert hits[1::2] == [NULL_BLOCK] * 5 + bm.block_ids("a")[11:14:2]
    # the sliding pages the window passed were freed, but kept their hashes: a shorter prefix whose
    # window reads them still hits them
    c = Request("c", list(range(33)), SamplingParams())
    hits_c = bm.lookup(c)  # 4 blocks: a query at 32 reads 17.., blocks 2, 3
    assert len(hits_c) == 8 and hits_c[1::2][2:] != [NULL_BLOCK] * 2 and hits_c[1::2][:2] == [NULL_BLOCK] * 2
    assert bm.allocate_slots(b, 61 - 56, hits)
    assert bm.trimmed("b") == 5 and bm.block_ids("b")[:14] == hits
    bm.check_invariants()
    # a sliding page the window needs, evicted: the hit is cut back to where the window has them all
    bm.free("a")
    bm.free("b")
    cached_sliding = [k for k in bm.cached if len(k) == 17]  # group 1's keys
    victim = bm.cached.pop(cached_sliding[-1])  # the last block's sliding page, forgotten
    bm.block_hash[victim] = None
    hits = bm.lookup(Request("d", list(range(60)) + [7], SamplingParams()))
    assert len(hits) // 2 < 7
    bm.check_invariants()


def test_swap_out_copies_only_the_live_pages_and_swap_in_restores_them():
    from jaxsched.config import SchedulerConfig
    from jaxsched.core.buckets import seq_buckets, token_buckets
    from jaxsched.core.scheduler import Scheduler

    bm = sliding_manager(window=16, num_blocks=22)  # 21 usable pages
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=True,
                          token_buckets=token_buckets(64), seq_buckets=seq_buckets(2), preemption_mode="swap",
                          num_host_blocks=32)
    sched = Scheduler(cfg, bm, policy="priority")  # a request that ranks higher preempts
    a = Request("a", list(range(40)), SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add_request(a)
    out = sched.schedule()
    sched.update(out, [5])
    for _ in range(12):  # decode to position 52: the sliding group keeps blocks 4.. only
        out = sched.schedule()
        sched.update(out, [5])
    assert bm.trimmed("a") > 0
    c = a.num_computed_tokens
    blocks = list(bm.block_ids("a"))
    b = Request("b", list(range(64)), SamplingParams(max_tokens=2, ignore_eos=True), priority=-1)
    sched.add_request(b)
    out = sched.schedule()  # b needs 16 pages, a holds 10 of the 21: a is swapped out
    swapped = [d for d, _ in out.blocks_to_swap_out]
    # every global page of the computed blocks, the sliding ones from the window's first block on
    n, lo = cdiv(c, 8), bm.first_needed(c)
    assert "a" in out.swapped_out and "b" in out.scheduled
    assert swapped == [x for i, x in enumerate(blocks[: 2 * n]) if i % 2 == 0 or i // 2 >= lo]
    assert NULL_BLOCK not in swapped and lo > 0
    host = [h for _, h in out.blocks_to_swap_out]
    sched.update(out, [5] * len(out.scheduled))
    while "a" not in (out := sched.schedule()).swapped_in:
        sched.update(out, [5] * len(out.scheduled))
    assert [h for h, _ in out.blocks_to_swap_in] == host
    back = [d for _, d in out.blocks_to_swap_in]
    assert back == [x for x in bm.block_ids("a") if x != NULL_BLOCK][: len(back)]
    assert bm.trimmed("a") == bm.first_needed(a.num_computed_tokens - out.scheduled["a"].num_new_tokens)
    bm.check_invariants()
    sched.check_invariants()


@pytest.fixture(scope="module")
def long_prompts(tokenizer_dir):
    from test_parity import SENTENCES
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shared = tok.encode(" ".join(SENTENCES[2:4]))  # a prefix several windows long, shared by all
    return [shared + tok.encode(s) for s in SENTENCES[:6]]


@tiny.needs_torch
@pytest.mark.parametrize("kind,extra", [
    ("gemma3", {"preemption_mode": "recompute", "enable_prefix_caching": True}),
    ("gemma3", {"preemption_mode": "swap", "swap_space": 0.001, "enable_prefix_caching": True}),
    ("gemma2", {"preemption_mode": "swap", "swap_space": 0.001, "enable_prefix_caching": False}),
], ids=["gemma3-recompute-cached", "gemma3-swap-cached", "gemma2-swap"])
def test_outputs_are_transformers_while_windows_free_pages(kind, extra, model_dirs, long_prompts):
    """Prompts sharing a prefix several windows (8 tokens) long, in a pool small enough to preempt:
    the windows free pages, preemption swaps or recomputes, prefix caching hits the shared prefix,
    and every greedy output equals transformers'."""
    from test_parity import hf_greedy, hf_model

    from jaxsched import LLM

    llm = LLM(model_dirs[kind], max_model_len=160, max_num_seqs=4, block_size=8, max_num_batched_tokens=32,
              num_gpu_blocks_override=34, **extra)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts], params, use_tqdm=False)
    ref = hf_model(model_dirs[kind])
    for p, o in zip(long_prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(ref, p, 20)
    core = llm.llm_engine.core
    bm, stats = core.block_manager, core.scheduler.stats()
    assert bm.num_trimmed_pages > 0 and stats.num_preemptions > 0
    if extra["preemption_mode"] == "swap":
        assert stats.num_swap_outs > 0
    if extra["enable_prefix_caching"]:
        assert stats.prefix_cache_hits > 0
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_invariants()


def test_windows_no_shorter_than_the_context_keep_one_group(model_dirs):
    """A window config.resolve drops (max_model_len <= window) leaves one group: the plain pool."""
    from jaxsched import LLM

    llm = LLM(model_dirs["gemma3"], max_model_len=8, max_num_seqs=2, max_num_batched_tokens=8, block_size=8)
    runner = llm.llm_engine.core.runner
    assert runner.kv_groups.num_groups == 1 and runner.kv[1].shape[0] == 3  # [L, NB, ...]
    assert cdiv(8, 8) == runner.max_blocks_per_seq


@tiny.needs_torch
def test_samples_of_one_request_share_and_copy_pages_in_every_group(model_dirs, long_prompts):
    """n = 3 greedy samples: the siblings take the prompt's full blocks from the first one (a hit
    on its global pages and its window's sliding ones) and copy the prompt's partial last block in
    every group (copy-on-write); each sample is transformers' greedy output."""
    from test_parity import hf_greedy, hf_model

    from jaxsched import LLM

    llm = LLM(model_dirs["gemma3"], max_model_len=160, max_num_seqs=4, block_size=8, max_num_batched_tokens=128,
              num_gpu_blocks_override=80, enable_prefix_caching=False)
    prompts = [p for p in long_prompts if len(p) % 8][:2]  # a partial last block to copy
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = hf_model(model_dirs["gemma3"])
    for p, o in zip(prompts, outs):
        want = hf_greedy(ref, p, 12)
        assert [c.token_ids for c in o.outputs] == [want] * 3
    core = llm.llm_engine.core
    assert core.scheduler.num_block_copies > 0 and core.block_manager.num_trimmed_pages > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_usable_blocks


def test_usage_and_waste_count_pages_in_every_group():
    """The pool's figures with layer groups: allocated slots are the used pages' (each group's page
    of a block counts), the waste is the unfilled tail of the last block in each group."""
    bm = sliding_manager(window=16)
    r = Request("a", list(range(41)), SamplingParams())
    assert bm.allocate_slots(r, 41)  # 6 blocks in both groups
    s = bm.stats()
    assert (s.num_used_blocks, s.allocated_slots, s.internal_waste) == (12, 96, 2 * (48 - 41))
    assert s.used_slots == 2 * 41 and bm.usage == pytest.approx(12 / 63)
    r.num_computed_tokens = 41
    for _ in range(8):
        assert bm.allocate_slots(r, 1)
        r.num_computed_tokens += 1
    s = bm.stats()  # position 49 next: blocks 0-3 of the sliding group freed, 7 blocks in all
    assert bm.trimmed("a") == 4 and s.num_used_blocks == 7 + 3
    assert s.internal_waste == 2 * (56 - 49)


@tiny.needs_torch
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_the_pallas_kernels_run_the_layer_groups(kind, model_dirs):
    """The GPU's backend (interpreted here) on each group's tables and metadata (its prepare()
    mapped over the groups), Gemma 2's soft-capped scores included: transformers' greedy tokens
    while the windows free pages."""
    from test_parity import hf_greedy, hf_model

    from jaxsched import LLM

    llm = LLM(model_dirs[kind], max_model_len=64, max_num_seqs=2, block_size=8, max_num_batched_tokens=16,
              attention_backend="pallas", num_gpu_blocks_override=40, warm_up_runs=False)
    prompts = [[5, 17, 42, 9, 33, 8, 61, 12, 90, 4, 7, 3, 19, 23], [4, 8, 15, 16, 23, 42, 11, 13, 17, 19, 29]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    ref = hf_model(model_dirs[kind])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p, 8) for p in prompts]
    assert llm.llm_engine.core.block_manager.num_trimmed_pages > 0
    assert llm.llm_engine.config.attention_backend == "pallas"
