"""Structured outputs (JSON Schema, json_object, regex, choice, Lark and GBNF grammars), logit_bias and
allowed_token_ids on a tiny random model: outputs parse and validate, bad definitions are refused naming
the field, n > 1 samples follow their own matchers, and the outputs do not depend on preemption (swap
or recompute), overlapped scheduling, prefix caching or the other requests of the batch."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from compiles import no_compilation

from jaxsched import LLM, SamplingParams
from jaxsched.core.limits import MAX_LOGIT_BIAS
from jaxsched.errors import InvalidRequestError
from jaxsched.structured.params import StructuredOutputsParams as SO

# max_model_len leaves room for JSON with the default whitespace (up to 16 characters between two
# tokens, which a greedy random model uses to the last one). The step-cost model is off: it sizes
# steps from measured times, so batches would differ from run to run.
ENGINE = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 32, "block_size": 8,
          "step_cost_model": False}
# a KV pool far too small for the preemption workload: 8 requests of up to 10 blocks each
PRESSURE = {"num_gpu_blocks_override": 16}
MAX_TOKENS = 400  # JSON with default whitespace: enough for every schema below, greedy or sampled

TEXTS = [
    "what is a cat ?",
    "the capital of france is",
    "hello world , how are you today ?",
    "numbers 12345 67890",
    "jax runs on gpus and cpus",
    # longer than max_num_batched_tokens: prefilled in chunks that sample nothing
    ("one two three four five six seven eight nine ten . the capital of france is paris . dogs and cats "
     "like to play in the sun . language models predict the next token"),
]

SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False},
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "XL"]}},
        "required": ["color", "size"], "additionalProperties": False},
    "nested": {
        "type": "object",
        "properties": {"user": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}, "ok": {"type": "boolean"},
                           "tag": {"type": "string", "maxLength": 3}},
            "required": ["id", "ok", "tag"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array_max_items": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                       "nums": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                                "minItems": 1, "maxItems": 2}},
        "required": ["tags", "nums"], "additionalProperties": False},
    "string_max_length": {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 5}, "b": {"type": "string", "minLength": 2,
                                                                      "maxLength": 3}},
        "required": ["a", "b"], "additionalProperties": False},
    "integer_bounds": {
        "type": "object",
        "properties": {"x": {"type": "integer", "minimum": -20, "maximum": 20},
                       "y": {"type": "integer", "minimum": 100, "maximum": 999}},
        "required": ["x", "y"], "additionalProperties": False},
}

REGEXES = [r"[a-z]{3}-[0-9]{2}", r"(0|[1-9][0-9]{0,2})\.[0-9]{2}", r"[A-Z][a-z]{1,6}( [a-z]{1,6}){1,3}\."]
CHOICES = ["yes", "no", "maybe so", 'say "hi"', "back\\slash"]
LARK = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[a-z]{2,8}/\n'
LARK_RE = r"(hello|hi) [a-z]{2,8}!"
GBNF = 'root ::= answer " " num\nanswer ::= "yes" | "no"\nnum ::= [0-9] [0-9]?\n'
GBNF_RE = r"(yes|no) [0-9]{1,2}"


@pytest.fixture(scope="module")
def llm(llama_dir):
    """Overlapped scheduling on (the default), a pool that never preempts."""
    return LLM(llama_dir, **ENGINE)


@pytest.fixture(scope="module")
def llm_sync(llama_dir):
    return LLM(llama_dir, **ENGINE, async_scheduling=False)


@pytest.fixture(scope="module")
def llm_recompute(llama_dir):
    return LLM(llama_dir, **ENGINE, **PRESSURE, preemption_mode="recompute")


@pytest.fixture(scope="module")
def llm_swap(llama_dir):
    return LLM(llama_dir, **ENGINE, **PRESSURE, preemption_mode="swap")


def ids(llm, text):
    return {"prompt_token_ids": llm.get_tokenizer().encode(text)}


def generate(llm, prompts, params):
    """Each request's outputs (a list of CompletionOutput, one per sample), in input order."""
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == len(prompts) and all(o.finished and o.error is None for o in outs), \
        [(o.request_id, o.error) for o in outs]
    assert not llm.llm_engine.has_unfinished_requests()
    return [o.outputs for o in outs]


def key(outputs):
    """What must not change with the engine's configuration: tokens, text and why it ended."""
    return [(c.token_ids, c.text, c.finish_reason) for c in outputs]


def check_json(c, schema):
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    value = json.loads(c.text)
    jsonschema.validate(value, schema)
    return value


def check_text(c, pattern):
    assert c.finish_reason == "stop", (c.finish_reason, c.text)
    assert re.fullmatch(pattern, c.text), c.text


def greedy(so=None, **kw):
    return SamplingParams(temperature=0.0, structured_outputs=so, **{"max_tokens": MAX_TOKENS, **kw})


def seeded(seed, so=None, **kw):
    return SamplingParams(temperature=1.0, seed=seed, structured_outputs=so, **{"max_tokens": MAX_TOKENS, **kw})


# -- compilation (first: the engine has run nothing yet) --------------------------------------------


def test_zero_compilations_after_warm_up_with_constraints_mixed_in(llm):
    """Constrained, logit_bias, allowed_token_ids and plain requests, greedy and sampled, n > 1,
    logprobs and chunked prefills, in steps with and without masked rows: nothing compiles (the
    grammars themselves compile in llguidance, not in jax)."""
    eng = llm.llm_engine
    texts = [TEXTS[i % len(TEXTS)] for i in range(16)]
    params = [
        greedy(SO(json=SCHEMAS["nested"])), seeded(1, SO(regex=REGEXES[0])), greedy(max_tokens=12),
        seeded(2, logit_bias={40: 5.0, 41: -5.0}, max_tokens=10), greedy(allowed_token_ids=[30, 31, 32], max_tokens=6),
        seeded(3, SO(choice=CHOICES), n=3), greedy(SO(grammar=GBNF), logprobs=2), seeded(4, max_tokens=20),
        greedy(SO(json_object=True), logit_bias={50: 2.0}), seeded(5, allowed_token_ids=list(range(3, 200)),
                                                                   max_tokens=9, n=2),
        greedy(SO(grammar=LARK)), greedy(logit_bias={60: 100.0}, max_tokens=5, logprobs=1),
        seeded(6, SO(json=SCHEMAS["array_max_items"], disable_any_whitespace=True)), greedy(max_tokens=30),
        seeded(7, SO(regex=REGEXES[2]), top_k=5, top_p=0.9), greedy(max_tokens=3),
    ]
    with no_compilation():
        eng.grammars.compile(SO(json=SCHEMAS["nested"]))  # the tokenizer converted for llguidance: no jax
        outs = generate(llm, [ids(llm, t) for t in texts], params)
    assert check_json(outs[0][0], SCHEMAS["nested"]) is not None
    check_text(outs[1][0], REGEXES[0])
    assert all(t == 60 for t in outs[11][0].token_ids)
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


# -- every kind of definition ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(llm, name):
    schema = SCHEMAS[name]
    so = SO(json=schema)
    texts = TEXTS[:2] + TEXTS[5:]
    params = [greedy(so)] * len(texts) + [seeded(s, so) for s in (1, 2, 3)]
    outs = generate(llm, [ids(llm, t) for t in texts + TEXTS[2:5]], params)
    values = [check_json(o[0], schema) for o in outs]
    assert all(isinstance(v, dict) for v in values)
    # the seeded samples are not all the same object (the grammar leaves the model a choice)
    if name != "enum":
        assert len({json.dumps(v, sort_keys=True) for v in values}) > 1, values


def test_json_schema_given_as_text_and_compact(llm):
    schema = SCHEMAS["required_fields"]
    texts = TEXTS[:3]
    as_text = generate(llm, [ids(llm, t) for t in texts], greedy(SO(json=json.dumps(schema))))
    as_dict = generate(llm, [ids(llm, t) for t in texts], greedy(SO(json=schema)))
    assert [key(o) for o in as_text] == [key(o) for o in as_dict]
    compact = generate(llm, [ids(llm, t) for t in texts],
                       [greedy(SO(json=schema, disable_any_whitespace=True))] * 2 + [seeded(9, SO(
                           json=schema, disable_any_whitespace=True))])
    for o in compact:
        value = check_json(o[0], schema)
        assert o[0].text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), o[0].text


def test_json_object_gives_an_object(llm):
    """Any object: a random model may run to max_tokens inside an unbounded key or string, but every
    output opens an object and every one that ends is one."""
    prompts = [ids(llm, t) for t in TEXTS] * 2
    outs = generate(llm, prompts, [greedy(SO(json_object=True), max_tokens=200)] * len(TEXTS)
                    + [seeded(s, SO(json_object=True), max_tokens=200) for s in range(len(TEXTS))])
    ended = 0
    for o in outs:
        assert o[0].text.lstrip(" \t\r\n").startswith("{"), o[0].text
        if o[0].finish_reason == "stop":
            assert isinstance(json.loads(o[0].text), dict), o[0].text
            ended += 1
        else:
            assert o[0].finish_reason == "length" and len(o[0].token_ids) == 200
    assert ended >= 2, [o[0].text[:40] for o in outs]


def test_json_additional_properties_disabled(llm):
    """disable_additional_properties: every object schema without its own additionalProperties is
    closed, so the output has exactly the schema's keys (open, a greedy random model adds its own)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    outs = generate(llm, [ids(llm, t) for t in TEXTS[:3]],
                    [greedy(SO(json=schema, disable_additional_properties=True))] * 2
                    + [seeded(4, SO(json=schema, disable_additional_properties=True))])
    for o in outs:
        assert set(check_json(o[0], schema)) == {"a"}


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_output_fullmatches(llm, pattern):
    texts = TEXTS[:4]
    params = [greedy(SO(regex=pattern))] * 2 + [seeded(s, SO(regex=pattern)) for s in (1, 2)]
    for o in generate(llm, [ids(llm, t) for t in texts], params):
        check_text(o[0], pattern)


def test_choice_output_is_one_of_the_choices(llm):
    """Choices with spaces, quotes and backslashes come out verbatim."""
    texts = TEXTS[:5]
    params = [greedy(SO(choice=CHOICES))] * 2 + [seeded(s, SO(choice=CHOICES)) for s in range(3)]
    outs = generate(llm, [ids(llm, t) for t in texts], params)
    for o in outs:
        assert o[0].finish_reason == "stop" and o[0].text in CHOICES, o[0].text
    many = generate(llm, [ids(llm, TEXTS[0])] * 8, [seeded(s, SO(choice=CHOICES)) for s in range(8)])
    assert len({o[0].text for o in many}) > 1  # sampling picks among them


@pytest.mark.parametrize("grammar,pattern", [(LARK, LARK_RE), (GBNF, GBNF_RE), ('root ::= "yes" | "no"', "yes|no")],
                         ids=["lark", "gbnf", "gbnf-yes-no"])
def test_grammar_output_matches(llm, grammar, pattern):
    texts = TEXTS[:4]
    params = [greedy(SO(grammar=grammar))] * 2 + [seeded(s, SO(grammar=grammar)) for s in (1, 2)]
    for o in generate(llm, [ids(llm, t) for t in texts], params):
        check_text(o[0], pattern)


def test_max_tokens_cuts_a_constrained_output(llm):
    """A grammar that is not finished at max_tokens ends by length, with a prefix of a valid output."""
    o = generate(llm, [ids(llm, TEXTS[0])], greedy(SO(json=SCHEMAS["nested"]), max_tokens=6))[0][0]
    assert o.finish_reason == "length" and len(o.token_ids) == 6 and o.text.startswith("{")


# -- bad definitions -------------------------------------------------------------------------------


@pytest.mark.parametrize("make,param", [
    (lambda: SO(), "structured_outputs"),
    (lambda: SO(regex="a+", choice=["a"]), "structured_outputs"),
    (lambda: SO(json={"type": "object"}, json_object=True), "structured_outputs"),
    (lambda: SO(choice=[]), "structured_outputs.choice"),
    (lambda: SO(choice=["a", ""]), "structured_outputs.choice"),
    (lambda: SO(regex=""), "structured_outputs.regex"),
    (lambda: SO(json="{not json"), "structured_outputs.json"),
    (lambda: SO(json="[1, 2]"), "structured_outputs.json"),
], ids=["none", "regex+choice", "json+json_object", "choice-empty", "choice-empty-string", "regex-empty",
        "json-not-json", "json-not-a-schema"])
def test_malformed_params_are_refused(make, param):
    with pytest.raises(InvalidRequestError) as e:
        make()
    assert e.value.param == param


@pytest.mark.parametrize("so,param", [
    (SO(regex="(ab"), "structured_outputs.regex"),
    (SO(regex="[z-a]"), "structured_outputs.regex"),
    (SO(json={"type": "nosuchtype"}), "structured_outputs.json"),
    (SO(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "structured_outputs.json"),
    (SO(grammar='start: "a" ('), "structured_outputs.grammar"),
    (SO(grammar="start: /[/"), "structured_outputs.grammar"),
    (SO(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (SO(grammar='root ::= "yes'), "structured_outputs.grammar"),
    (SO(grammar='root ::= ( "yes" | "no"'), "structured_outputs.grammar"),
    (SO(grammar="root ::= undefined"), "structured_outputs.grammar"),
], ids=["regex-paren", "regex-range", "schema-type", "schema-nested-type", "lark-syntax", "lark-regex",
        "lark-undefined", "gbnf-string", "gbnf-paren", "gbnf-undefined"])
def test_definitions_that_do_not_compile_are_refused(llm, so, param):
    """Refused when the request is made, naming the field; a batch holding one adds nothing, and the
    engine goes on."""
    good = ids(llm, TEXTS[0])
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([good, good], [greedy(SO(regex=REGEXES[0])), greedy(so)], use_tqdm=False)
    assert e.value.param == param, (e.value.param, str(e.value))
    assert not llm.llm_engine.has_unfinished_requests()
    check_text(generate(llm, [good], greedy(SO(regex=REGEXES[0])))[0][0], REGEXES[0])


# -- n > 1 -------------------------------------------------------------------------------------------


def test_every_sample_of_n_follows_its_own_matcher(llm):
    """The matcher is forked per sample: each sample is valid on its own (a shared matcher would be
    fed the other samples' tokens and refuse them), and the samples differ."""
    schema = SCHEMAS["nested"]
    outs = generate(llm, [ids(llm, TEXTS[0]), ids(llm, TEXTS[5]), ids(llm, TEXTS[1])],
                    [seeded(11, SO(json=schema), n=4), seeded(12, SO(regex=REGEXES[2]), n=3),
                     seeded(13, n=2, max_tokens=8)])
    assert [len(o) for o in outs] == [4, 3, 2]
    values = [check_json(c, schema) for c in outs[0]]
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1, values
    for c in outs[1]:
        check_text(c, REGEXES[2])
    assert len({c.text for c in outs[1]}) > 1
    # greedy samples of a grammar are all the greedy output
    alone = generate(llm, [ids(llm, TEXTS[1])], greedy(SO(grammar=GBNF)))[0][0]
    both = generate(llm, [ids(llm, TEXTS[1])], greedy(SO(grammar=GBNF), n=2))[0]
    assert [key([c]) for c in both] == [key([alone])] * 2


# -- preemption, overlap, prefix caching: the same outputs -------------------------------------------


LONG_JSON = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 24},
                                              "n": {"type": "array", "maxItems": 4,
                                                    "items": {"type": "integer", "minimum": 0, "maximum": 999}}},
             "required": ["s", "n"], "additionalProperties": False}
WORDS = r"[a-z]{2,7}( [a-z]{2,7}){6,9}\."


def pressure_workload(llm):
    """8 constrained (and 2 free) requests of up to ~10 blocks each, greedy and seeded; compact JSON
    and long regexes, so that each runs long enough to be preempted mid-output."""
    long_json, words = LONG_JSON, WORDS
    params = [
        greedy(SO(json=long_json, disable_any_whitespace=True), max_tokens=48),
        greedy(SO(regex=words), max_tokens=48),
        greedy(SO(json=SCHEMAS["nested"]), max_tokens=48),  # default whitespace: may end by length
        greedy(max_tokens=40, ignore_eos=True),
        seeded(21, SO(json=long_json, disable_any_whitespace=True), max_tokens=48),
        seeded(22, SO(regex=words), max_tokens=48),
        greedy(SO(grammar=GBNF), max_tokens=48),
        greedy(SO(choice=CHOICES), max_tokens=48),
        seeded(23, SO(regex=words), max_tokens=48, n=2),
        seeded(24, max_tokens=40, ignore_eos=True),
    ]
    texts = [TEXTS[i % 5] for i in range(len(params))]  # at most 24 tokens: 9 blocks with the output
    return [ids(llm, t) for t in texts], params


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_constrained_outputs(llm, mode, request):
    """With a KV pool that forces preemption, every output is the unpressured engine's (each
    request's matcher lives on the host and is untouched by its KV being dropped or parked)."""
    pressed = request.getfixturevalue(f"llm_{mode}")
    prompts, params = pressure_workload(llm)
    ref = generate(llm, prompts, params)
    before = pressed.llm_engine.stats()
    outs = pressed.generate(prompts, params, use_tqdm=False)
    got = [o.outputs for o in outs]
    stats = pressed.llm_engine.stats()
    assert stats.num_preemptions > before.num_preemptions, "the small pool must force preemptions"
    # constrained requests among those preempted (every request here but 3 and 9 is constrained)
    assert any(o.metrics.num_preemptions for i, o in enumerate(outs) if i not in (3, 9))
    if mode == "swap":
        assert stats.num_swap_outs > before.num_swap_outs
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        assert key(b) == key(a), i
    check_json(ref[0][0], LONG_JSON)
    for c in ref[1][0], ref[5][0], *ref[8]:
        check_text(c, WORDS)
    eng = pressed.llm_engine
    eng.core.scheduler.check_invariants()
    assert eng.core.block_manager.num_free_blocks == eng.core.block_manager.num_usable_blocks


def mixed_workload(llm):
    """(constrained, free) requests interleaved in one batch: (prompt, params) pairs of each."""
    constrained = [
        greedy(SO(json=SCHEMAS["required_fields"])), seeded(31, SO(json=SCHEMAS["enum"])),
        greedy(SO(regex=REGEXES[2])), seeded(32, SO(choice=CHOICES)), greedy(SO(grammar=LARK)),
        seeded(33, SO(json=SCHEMAS["array_max_items"]), n=2),
    ]
    free = [
        greedy(max_tokens=24, ignore_eos=True), seeded(41, max_tokens=24, ignore_eos=True),
        greedy(max_tokens=30), seeded(42, max_tokens=16, top_k=20, logprobs=1),
        greedy(max_tokens=20, ignore_eos=True, logit_bias={7: 3.0, 8: -3.0}),
        seeded(43, max_tokens=20, allowed_token_ids=list(range(40, 140))),
    ]
    c = [(ids(llm, TEXTS[i % len(TEXTS)]), p) for i, p in enumerate(constrained)]
    f = [(ids(llm, TEXTS[(i + 3) % len(TEXTS)]), p) for i, p in enumerate(free)]
    return c, f


def test_overlap_on_and_off_give_the_same_outputs(llm, llm_sync):
    """Constrained and free requests in one batch: overlapped scheduling changes nothing, and the
    free requests' outputs are those of a run without the constrained ones."""
    assert llm.llm_engine.core.async_scheduling and not llm_sync.llm_engine.core.async_scheduling
    c, f = mixed_workload(llm)
    mixed = [x for pair in zip(c, f) for x in pair]
    prompts, params = [p for p, _ in mixed], [sp for _, sp in mixed]
    on = generate(llm, prompts, params)
    off = generate(llm_sync, prompts, params)
    for i, (a, b) in enumerate(zip(on, off, strict=True)):
        assert key(a) == key(b), i
    alone = generate(llm, [p for p, _ in f], [sp for _, sp in f])
    alone_sync = generate(llm_sync, [p for p, _ in f], [sp for _, sp in f])
    assert [key(o) for o in alone] == [key(o) for o in alone_sync] == [key(o) for o in on[1::2]]
    # and the constrained ones are valid
    check_json(on[0][0], SCHEMAS["required_fields"])
    check_json(on[2][0], SCHEMAS["enum"])
    check_text(on[4][0], REGEXES[2])
    assert on[6][0].text in CHOICES
    check_text(on[8][0], LARK_RE)
    for c2 in on[10]:
        check_json(c2, SCHEMAS["array_max_items"])
    assert all(40 <= t < 140 for t in on[11][0].token_ids)


def test_prefix_caching_with_a_constrained_and_a_free_request(llm):
    """Same prompt, one constrained and one not: a prefix-cache hit changes neither output."""
    eng = llm.llm_engine
    prompt = ids(llm, TEXTS[5])  # several full blocks
    so_params = greedy(SO(json=SCHEMAS["string_max_length"]))
    free_params = greedy(max_tokens=20, ignore_eos=True)
    eng.core.block_manager.reset_prefix_cache()
    cold_c = generate(llm, [prompt], so_params)[0]
    eng.core.block_manager.reset_prefix_cache()
    cold_f = generate(llm, [prompt], free_params)[0]
    hits = eng.stats().prefix_cache_hits
    warm_c = generate(llm, [prompt], so_params)[0]  # the free request's blocks
    assert eng.stats().prefix_cache_hits > hits
    both = generate(llm, [prompt, prompt], [so_params, free_params])
    rev = generate(llm, [prompt, prompt], [free_params, so_params])
    assert key(warm_c) == key(both[0]) == key(rev[1]) == key(cold_c)
    assert key(both[1]) == key(rev[0]) == key(cold_f)
    check_json(cold_c[0], SCHEMAS["string_max_length"])


# -- logit_bias and allowed_token_ids --------------------------------------------------------------


def test_logit_bias(llm):
    prompts = [ids(llm, t) for t in TEXTS[:3]]
    plain = generate(llm, prompts, greedy(max_tokens=10, ignore_eos=True))
    # +100 on one token: greedy takes it every time (sampled too), the other rows are untouched
    target = 57
    assert any(target not in o[0].token_ids for o in plain)
    biased = generate(llm, prompts, [greedy(max_tokens=10, ignore_eos=True, logit_bias={target: 100.0}),
                                     seeded(5, max_tokens=10, ignore_eos=True, logit_bias={target: 100.0}),
                                     greedy(max_tokens=10, ignore_eos=True)])
    assert biased[0][0].token_ids == [target] * 10 and biased[1][0].token_ids == [target] * 10
    assert key(biased[2]) == key(plain[2])
    # -100 on the greedy token: never taken
    first = plain[0][0].token_ids[0]
    away = generate(llm, prompts[:1], greedy(max_tokens=10, ignore_eos=True, logit_bias={first: -100.0}))[0][0]
    assert away.token_ids[0] != first and first not in away.token_ids
    # a small bias moves nothing it cannot move: 0.0 everywhere is the plain output
    zero = generate(llm, prompts[:1], greedy(max_tokens=10, ignore_eos=True, logit_bias={first: 0.0, 9: 0.0}))
    assert key(zero[0]) == key(plain[0])


def test_logit_bias_applies_before_the_grammar_mask(llm):
    """A bias steers among the grammar's choices but cannot take the output outside them."""
    tok = llm.get_tokenizer()
    choices = ["cat", "dog"]
    for word in choices:
        t = tok.encode(word)[0]
        o = generate(llm, [ids(llm, TEXTS[0])], greedy(SO(choice=choices), logit_bias={t: 100.0}))[0][0]
        assert o.text == word and o.finish_reason == "stop"
    z = tok.encode("z")[0]
    o = generate(llm, [ids(llm, TEXTS[0])], greedy(SO(regex=r"[0-9]{3}"), logit_bias={z: 100.0}))[0][0]
    check_text(o, r"[0-9]{3}")


def test_allowed_token_ids(llm):
    allowed = [5, 17, 33, 90, 91, 150, 299]
    outs = generate(llm, [ids(llm, t) for t in TEXTS[:4]],
                    [seeded(s, max_tokens=16, allowed_token_ids=allowed) for s in range(3)]
                    + [greedy(max_tokens=16, allowed_token_ids=allowed, n=2)])
    seen = set()
    for o in outs:
        for c in o:
            assert set(c.token_ids) <= set(allowed), c.token_ids
            assert len(c.token_ids) == 16 and c.finish_reason == "length"  # EOS is not allowed
            seen |= set(c.token_ids)
    assert len(seen) > 2  # sampled among the set, not stuck on one token
    # a single allowed token, even under temperature
    one = generate(llm, [ids(llm, TEXTS[0])], seeded(1, max_tokens=5, allowed_token_ids=[77]))[0][0]
    assert one.token_ids == [77] * 5


def test_bias_and_allowed_ids_out_of_range_are_refused(llm):
    V = llm.llm_engine.model_config.vocab_size
    p = ids(llm, TEXTS[0])
    for params, param in [(SamplingParams(logit_bias={V: 1.0}), "logit_bias"),
                          (SamplingParams(logit_bias={3: 1.0, V + 100: -1.0}), "logit_bias"),
                          (SamplingParams(allowed_token_ids=[1, V]), "allowed_token_ids")]:
        with pytest.raises(InvalidRequestError) as e:
            llm.generate([p], params, use_tqdm=False)
        assert e.value.param == param
        assert not llm.llm_engine.has_unfinished_requests()
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)})
    assert e.value.param == "logit_bias" and MAX_LOGIT_BIAS == 300
    SamplingParams(logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS)})  # 300 is fine
    for bad in ({1: 100.5}, {1: float("nan")}, {-1: 1.0}, {"a": 1.0}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias"
    for bad in ([], [-1], "abc"):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(allowed_token_ids=bad)
        assert e.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(allowed_token_ids=[1], structured_outputs=SO(regex="a"))
    assert e.value.param == "allowed_token_ids"


def test_a_full_logit_bias_table(llm):
    """300 entries (the table's width): every one applies."""
    bias = {t: -100.0 for t in range(MAX_LOGIT_BIAS - 1)}
    bias[299] = 100.0  # the last column of the table
    o = generate(llm, [ids(llm, TEXTS[0])], greedy(max_tokens=4, ignore_eos=True, logit_bias=bias))[0][0]
    assert o.token_ids == [299] * 4


# -- the compile cache --------------------------------------------------------------------------


def test_grammar_compile_cache(llm):
    grammars = llm.llm_engine.grammars
    so = SO(json=SCHEMAS["enum"])
    first = grammars.compile(so)
    assert grammars.compile(so) is first
    assert grammars.compile(SO(json=json.dumps(SCHEMAS["enum"]))) is first  # equal definition, new params
    assert grammars.compile(SO(json=SCHEMAS["enum"], disable_any_whitespace=True)) is not first
    assert grammars.compile(SO(regex=REGEXES[0])) is grammars.compile(SO(regex=REGEXES[0]))
    assert grammars.compile(SO(regex=REGEXES[0])) is not grammars.compile(SO(regex=REGEXES[1]))
    # each request gets its own matcher from the cached grammar
    a, b = first.constraint(), first.constraint()
    assert a.matcher is not b.matcher


# -- known bugs ----------------------------------------------------------------------------------


def test_a_boolean_schema_is_refused_with_what_to_send_instead():
    # a valid JSON Schema, but llguidance compiles objects only: refused up front, saying what works
    with pytest.raises(InvalidRequestError, match="JSON Schema object") as e:
        SO(json="true")
    assert e.value.param == "structured_outputs.json"


def test_a_constrained_request_goes_to_the_other_hosts(llm):
    """The leader of a multi-host engine sends each request its core takes to the followers as a
    msgspec message (distributed.StepInputs); here the leader's side runs on this process's core
    (no other host needed): what a follower decodes has the same params, and its core builds its
    own matcher from them (matchers do not cross processes)."""
    import msgspec

    from jaxsched.engine.core_messages import encoder
    from jaxsched.parallel.multihost import StepInputs

    eng = llm.llm_engine
    sent = []
    eng.core.on_input = sent.append
    try:
        req = eng.make_request("multihost", ids(llm, TEXTS[0]), greedy(SO(regex=REGEXES[0])))
        eng.add_request_obj(req)
    finally:
        eng.core.on_input = None
    assert [s.request_id for s in sent] == ["multihost"]
    wire = encoder().encode(StepInputs(sent))
    got = msgspec.msgpack.Decoder(StepInputs).decode(wire).ops[0]
    assert got.sampling_params == req.core.sampling_params and got.prompt_token_ids == req.core.prompt_token_ids
    assert got.sampling_params.structured_outputs.__dict__.get("_compiled") is None  # no matcher on the wire
    assert eng.core.constraint(got.sampling_params) is not None
    done = []
    while eng.has_unfinished_requests():
        done += [o for o in eng.step() if o.finished]
    check_text(done[0].outputs[0], REGEXES[0])
