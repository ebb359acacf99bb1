"""--reasoning-parser (serving/reasoning.py): the two formats on their own, every way of cutting a
stream, and end to end through the openai client against a tiny model whose tokenizer has the
think tokens (its output forced by a regex, as a random model writes no tags of its own)."""

from __future__ import annotations

import itertools

import openai
import pytest
import tiny
from hypothesis import given
from hypothesis import strategies as st
from servers import uvicorn_thread

from jaxsched import LLM
from serving.app import build_app
from serving.async_engine import AsyncEngine
from serving.reasoning import REASONING_PARSERS, reasoning_parser

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


@pytest.mark.parametrize("parser,text,want", [
    (QWEN3, "<think>\nlet me see</think>\n\nParis.", ("let me see", "Paris.")),
    (QWEN3, "  <think>a</think>b", ("a", "b")),
    (QWEN3, "Paris.", (None, "Paris.")),  # thinking off: no tags
    (QWEN3, "<think>\n\n</think>\n\nParis.", (None, "Paris.")),  # an empty thought
    (QWEN3, "<think>still thinking", ("still thinking", None)),  # cut short
    (QWEN3, "Paris.</think>x", (None, "Paris.</think>x")),  # a stray end tag, no thought opened
    (QWEN3, "<thin", (None, "<thin")),
    (R1, "let me see</think>\n\nParis.", ("let me see", "Paris.")),
    (R1, "<think>let me see</think>Paris.", ("let me see", "Paris.")),  # the tag repeated
    (R1, "still thinking", ("still thinking", None)),
    (R1, "</think>Paris.", (None, "Paris.")),
])
def test_whole_outputs(parser, text, want):
    assert parser.parse(text) == want


@given(st.sampled_from(["qwen3", "deepseek_r1"]),
       st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", " ", "\n", "a", "b c"]),
                max_size=12),
       st.lists(st.integers(0, 60), max_size=6))
def test_streamed_pieces_add_up_to_the_whole(name, parts, cuts):
    text = "".join(parts)
    whole = REASONING_PARSERS[name].parse(text)
    p = REASONING_PARSERS[name]()
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    got = {"r": "", "c": ""}
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        r, c = p.feed(text[a:b], finished=i == len(bounds) - 2)
        got["r"] += r or ""
        got["c"] += c or ""
    if len(bounds) == 1:  # an empty text: one call
        r, c = p.feed("", finished=True)
        got = {"r": r or "", "c": c or ""}
    assert (got["r"] or None, got["c"] or None) == whole


def test_a_tag_split_over_pieces_is_held_back_not_sent():
    p = QWEN3()
    assert p.feed("<th") == (None, None)
    assert p.feed("ink>deep") == ("deep", None)
    assert p.feed(" thought</thi") == (" thought", None)
    assert p.feed("nk>\n") == (None, None)
    assert p.feed("answer", finished=True) == (None, "answer")


def test_an_unknown_parser_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown --reasoning-parser 'r2': one of deepseek_r1, qwen3"):
        reasoning_parser("r2")


# the think tokens by name (Lark's special-token syntax): llguidance's regexes match a token's bytes in
# the mask but refuse an added token when it is consumed
THINK = "start: <think> WORDS </think> WORDS\nWORDS: /[a-z]{2,8}( [a-z]{2,8}){1,3}/"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The same tiny model served with --reasoning-parser qwen3 and with none."""
    tok = str(tmp_path_factory.mktemp("tok"))
    fast = tiny.build_tokenizer(tok, added_tokens=("<think>", "</think>"))
    assert len(fast.encode("<think>", add_special_tokens=False)) == 1
    folder = tiny.build_model(str(tmp_path_factory.mktemp("m")), "llama", tok, max_position_embeddings=512)
    engine = AsyncEngine(LLM(folder, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64,
                             block_size=16, step_cost_model=False).llm_engine)
    try:
        with uvicorn_thread(build_app(engine, served_model_name="tiny", reasoning_parser="qwen3")) as url, \
                uvicorn_thread(build_app(engine, served_model_name="tiny")) as plain:
            yield (openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0),
                   openai.OpenAI(base_url=plain + "/v1", api_key="x", max_retries=0))
    finally:
        engine.shutdown()


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "why ?"}],
                                          max_tokens=80, temperature=0, **kw)


def test_the_server_separates_reasoning_whole_and_streamed(servers):
    reasoning, plain = servers
    forced = {"structured_outputs": {"grammar": THINK}}
    raw = chat(plain, extra_body=forced).choices[0].message
    thought, answer = raw.content.removeprefix("<think>").split("</think>")
    assert raw.content.startswith("<think>") and not getattr(raw, "reasoning_content", None)
    msg = chat(reasoning, extra_body=forced).choices[0].message
    assert (msg.reasoning_content, msg.content) == (thought, answer)
    parts = {"reasoning_content": "", "content": ""}
    for chunk in chat(reasoning, extra_body=forced, stream=True):
        delta = chunk.choices[0].delta
        for k in parts:
            parts[k] += getattr(delta, k, None) or ""
    assert (parts["reasoning_content"], parts["content"]) == (thought, answer)
    hidden = chat(reasoning, extra_body={**forced, "include_reasoning": False}).choices[0].message
    assert hidden.content == answer and getattr(hidden, "reasoning_content", None) is None


def test_without_think_tags_it_is_all_content_and_include_reasoning_needs_a_parser(servers):
    reasoning, plain = servers
    msg = chat(reasoning, extra_body={"structured_outputs": {"regex": "[a-z]{3,8} [a-z]{3,8}"}}).choices[0].message
    assert msg.content and getattr(msg, "reasoning_content", None) is None
    with pytest.raises(openai.BadRequestError) as e:
        chat(plain, extra_body={"include_reasoning": False})
    assert e.value.body["param"] == "include_reasoning" and "--reasoning-parser" in e.value.body["message"]
