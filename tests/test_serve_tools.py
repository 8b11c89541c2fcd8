"""Serve for agents: reasoning apart from the answer, tool calls, and structured output by
constrained decoding. The loop's constrained decoding against itself (the drafter changes no
token, on random schemas and prompts; every output validates), the parsers of each model family
(streamed in random pieces == whole), and a real server driven by the unmodified openai client
(tools, response_format, beta.chat.completions.parse with a pydantic model) and by an agent
framework (openai-agents, its chat-completions model), speculative and --no-draft."""

from __future__ import annotations

import json
import random
import re
import shutil
from typing import Annotated

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from pydantic import BaseModel, Field
from runtime_cases import CASES, artifact, prompts
from test_runtime_cli import char_tokenizer
from test_serve import running
from tokenizers import Tokenizer

from dflash_export.runtime import manifest as M
from dflash_export.runtime.loop import Request, generate_batch
from dflash_export.runtime.ort.backend import OrtBackend
from dflash_export.runtime.sampling import Sampling
from dflash_export.serve.formats import THINK, Format, assemble, detect
from dflash_export.serve.grammar import Grammars, grammar

# A Hermes-style template (as Qwen3's) small enough for the test pair's 256-token context: the tools by
# name, the calls and tool results of earlier turns, a think block opened on request (chat_template_kwargs)
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<a>{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}\n"
    "{% elif m.role == 'tool' %}<r>{{ m.content }}\n"
    "{% else %}<{{ m.role[0] }}>{{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<a>{% if enable_thinking %}<think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    """The qwen3 test pair (real acceptance) with a character tokenizer and the tools template above."""
    d = tmp_path_factory.mktemp("tools") / "tiny-agent"
    shutil.copytree(artifact(CASES["qwen3"])[2], d)
    char_tokenizer(d / "tokenizer.json")
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_special_tokens(["<mask>", "<eos>"])  # as a real tokenizer's: not in the decoded text
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    m = M.load_manifest(d, verify=False)
    m.tokenizer = True
    M.write_manifest(d, m)
    return d


# -- the loop: constrained greedy with the drafter == without it ----------------------------------------

def schemas(depth: int = 2):
    """Random JSON schemas whose every value is bounded (so a constrained output always completes)."""
    leaf = st.one_of(
        st.just({"type": "boolean"}),
        st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n},
                  st.integers(-50, 50), st.integers(0, 200)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda vs: {"enum": vs}, st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1,
                                                    max_size=3, unique=True)),
        st.just({"type": "null"}))
    if depth == 0:
        return leaf
    inner = schemas(depth - 1)
    obj = st.builds(lambda props: {"type": "object", "properties": props, "required": sorted(props),
                                   "additionalProperties": False},
                    st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), inner, min_size=1, max_size=3))
    arr = st.builds(lambda it, n: {"type": "array", "items": it, "maxItems": n}, inner, st.integers(0, 3))
    return st.one_of(leaf, obj, arr)


@pytest.fixture(scope="module")
def loop(art):
    backend = OrtBackend(art, threads=1)
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    m = backend.manifest
    return backend, tok, Grammars(tok, m.vocab_size, tuple(m.eos_token_ids)), tuple(m.eos_token_ids)


def constrained(loop, prompt, schema, draft: bool, sampling=Sampling(), fmt=Format("none"), n=120):
    backend, tok, grammars, eos = loop
    g = grammars.compile(grammar(fmt, False, None, False, schema))
    q = Request(prompt, n, sampling, eos, constraint=grammars.constraint(g, eos))
    (gen,), _ = generate_batch(backend, [q], draft=draft)
    return gen, tok.decode(gen.tokens[:-1] if gen.stopped else gen.tokens)  # without the stop token


accepted = []  # drafts accepted across the examples (the comparison is only worth something if some are)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(schema=schemas(), seed=st.integers(0, 10_000))
def test_constrained_greedy_is_the_same_with_and_without_the_drafter(loop, schema, seed):
    prompt = prompts(1, loop[0].manifest.vocab_size, seed)[0]
    spec, text = constrained(loop, prompt, schema, draft=True)
    plain, text_plain = constrained(loop, prompt, schema, draft=False)
    assert spec.tokens == plain.tokens, (schema, text, text_plain)
    assert spec.stopped, (schema, text)  # the grammar completed and the model stopped
    jsonschema.validate(json.loads(text), schema)
    accepted.append(sum(a - 1 for a, d in zip(spec.acceptance_lengths, spec.drafted) if d))


def test_the_drafter_was_accepted_under_the_constraint():
    """The comparison above ran with drafts accepted (not plain rounds only)."""
    assert sum(a > 0 for a in accepted) >= 3, accepted


def test_drafting_under_the_mask_accepts_more_and_changes_no_token(loop, monkeypatch):
    """The drafter's proposals masked by the grammar (runtime/loop.py `_masked_drafts`): more tokens per
    round than its unmasked argmax, the same output."""
    from dflash_export.runtime import loop as loop_module

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "tags": {
        "type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3}},
        "required": ["name", "tags"], "additionalProperties": False}

    def run():
        gens = [constrained(loop, [5 + p, 6, 7], schema, True)[0] for p in range(6)]
        return [g.tokens for g in gens], sum(map(len, (g.tokens for g in gens))) / sum(len(g.acceptance_lengths)
                                                                                      for g in gens)

    masked, per_round = run()
    monkeypatch.setattr(loop_module, "_masked_drafts", lambda backend, rows, drafts, scored: drafts)
    unmasked, per_round_unmasked = run()
    assert masked == unmasked and per_round > 2 * per_round_unmasked, (per_round, per_round_unmasked)


def test_constrained_rows_in_a_batch_equal_their_own_runs(loop, art):
    """Constrained and free rows in one batched loop: each row's tokens are its batch-1 output."""
    backend, tok, grammars, eos = loop
    schemas_ = [{"type": "array", "items": {"enum": ["ab", "xyz"]}, "maxItems": 4},
                {"type": "object", "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 999}},
                 "required": ["k"], "additionalProperties": False}, None]

    def requests():
        return [Request([9 + i, 4, 2], 60, stop_token_ids=eos, constraint=None if sc is None else grammars.constraint(
            grammars.compile(grammar(Format("none"), False, None, False, sc)), eos)) for i, sc in enumerate(schemas_)]

    alone = [generate_batch(backend, [q], draft=True)[0][0].tokens for q in requests()]
    batched, _ = generate_batch(OrtBackend(art, threads=1, max_batch=3), requests(), draft=True)
    assert [g.tokens for g in batched] == alone
    for g, sc in zip(batched[:2], schemas_):  # the constrained rows were constrained in the batch
        jsonschema.validate(json.loads(tok.decode(g.tokens[:-1] if g.stopped else g.tokens)), sc)


def test_constrained_sampling_is_the_same_with_and_without_the_drafter(loop):
    """Sampled under the mask with the row's own uniforms (sample-and-compare): the drafter changes no token,
    and the seed does change them."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 8},
                                               "b": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}, "maxItems": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    outs = set()
    for seed in range(4):
        s = Sampling(0.9, seed=seed)
        spec, text = constrained(loop, [5, 6, 7], schema, True, s)
        plain, _ = constrained(loop, [5, 6, 7], schema, False, s)
        assert spec.tokens == plain.tokens
        jsonschema.validate(json.loads(text), schema)
        outs.add(text)
    assert len(outs) > 1


def test_unconstrained_where_the_grammar_allows_it(loop):
    """The mask changes nothing where the target's own choice is allowed: a grammar that allows any
    text gives the unconstrained output."""
    backend, tok, grammars, eos = loop
    g = grammars.compile('start: /(.|\\n)*/\n')
    for draft in (True, False):
        free, _ = generate_batch(backend, [Request([3, 4, 5], 40, stop_token_ids=eos)], draft=draft)
        q = Request([3, 4, 5], 40, stop_token_ids=eos, constraint=grammars.constraint(g, eos))
        masked, _ = generate_batch(backend, [q], draft=draft)
        assert masked[0].tokens == free[0].tokens


# -- the parsers of each family: streamed in pieces == whole ------------------------------------------------

CASES_TEXT = [
    ("qwen3", "<think>\nlet me see</think>\n\nHello <b>", ("\nlet me see", "Hello <b>", [])),
    ("qwen3", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
              '{"name": "g", "arguments": {}}\n</tool_call>\n', (None, "Sure.", [("f", '{"x": 1}'), ("g", "{}")])),
    ("qwen3", "<tool_call>\nnot json\n</tool_call> x", (None, "<tool_call>\nnot json\n</tool_call> x", [])),
    ("qwen3_coder", "<think>hm</think><tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
     ("hm", "", [("get_weather", '{"city": "Paris", "days": 3}')])),
    ("llama3_json", '{"name": "f", "parameters": {"a": "b"}}', (None, "", [("f", '{"a": "b"}')])),
    ("llama3_json", "{not a call", (None, "{not a call", [])),
    ("harmony", "<|channel|>analysis<|message|>thinking...<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     ("thinking...", "", [("get_weather", '{"city": "Paris"}')])),
    ("harmony", "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>The answer.<|return|>",
     ("hm", "The answer.", [])),
    ("none", "  plain <tool_call> text\n", (None, "  plain <tool_call> text\n", [])),
]


@pytest.mark.parametrize("name,text,want", CASES_TEXT)
def test_parsers_streamed_in_pieces_assemble_to_the_whole(name, text, want):
    fmt = detect("", given=name)
    rng = random.Random(0)
    for trial in range(30):
        p, events, i = fmt.parser(), [], 0
        while i < len(text):
            j = len(text) if trial == 0 else i + rng.randint(1, 6)
            events += p.push(text[i:j])
            i = j
        reasoning, content, calls = assemble(events + p.finish())
        assert (reasoning, content, [(c.name, c.arguments) for c in calls]) == want


def test_reasoning_from_an_open_think_block_and_detection():
    assert detect("... <think> ... </think> ...").think == THINK
    assert detect("x <function=f> <parameter=p>").name == "qwen3_coder"
    assert detect("", "GptOssForCausalLM").name == "harmony"
    p = detect("<tool_call></think>").parser(thinking=True)
    assert assemble(p.push("I think</think>\n\nIt is 4.") + p.finish())[:2] == ("I think", "It is 4.")


HARMONY = ["<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>"]
WRITTEN = [  # (format, thinking, what the model writes for add(a=2, b=3), the call parsed back)
    ("qwen3", False, '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
    ("qwen3", True, 'so, 2 and 3</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'),
    ("qwen3_coder", False, "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
                           "</parameter>\n</function>\n</tool_call>"),
    ("llama3_json", False, '{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ("harmony", False, '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 2, "b": 3}'),
]


@pytest.mark.parametrize("name,thinking,text", WRITTEN)
def test_forced_call_grammars_take_the_model_s_own_call_and_parse_back(art, name, thinking, text):
    """Each family's forced-call grammar accepts the call as that family writes it (special tokens as
    tokens for harmony), refuses another function's, and the family's parser reads the call back."""
    tok = Tokenizer.from_file(str(art / "tokenizer.json"))
    tok.add_special_tokens(HARMONY)
    eos = (tok.token_to_id("<eos>"),)
    fmt = detect("", given=name)
    grammars = Grammars(tok, tok.get_vocab_size(), eos)
    c = grammars.constraint(grammars.compile(grammar(fmt, thinking, [ADD["function"], {"name": "noop"}], False, None)),
                            eos)
    ids = [tok.token_to_id(x) for x in re.findall(r"<\|[a-z]+\|>|.", text, re.S)]  # a char a token ("\n" too)
    for t in ids:
        assert c.accepts(t) and c.allowed()[t], (text, tok.id_to_token(t))
        c.consume(t)
    assert c.accepts(eos[0])  # complete: the model may stop here
    p = fmt.parser(thinking)
    _, _, calls = assemble(p.push(text + ("<|call|>" if name == "harmony" else "")) + p.finish())
    assert [(x.name, json.loads(x.arguments)) for x in calls] == [("add", {"a": 2, "b": 3})]
    wrong = grammars.constraint(grammars.compile(grammar(fmt, thinking, [{"name": "noop"}], False, None)), eos)
    assert wrong.m.try_consume_tokens(ids) < len(ids)


# -- a real server: the openai client, an agent framework --------------------------------------------------

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
Digit = Annotated[int, Field(ge=0, le=9)]  # the agent's tool's: bounded, or a random model's integer runs to max_tokens
NOOP = {"type": "function", "function": {"name": "noop"}}  # no parameters: no arguments


@pytest.fixture(scope="module", params=["speculative", "plain"])
def server(request, art, tmp_path_factory):
    extra = () if request.param == "speculative" else ("--no-draft",)
    yield from running(art, tmp_path_factory.mktemp("log") / "serve.log", "--tool-format", "qwen3", *extra)


def chat(client, **kw):
    return client.chat.completions.create(model="tiny-agent", messages=kw.pop("messages", [
        {"role": "user", "content": "add 2 and 3"}]), temperature=0, max_tokens=kw.pop("max_tokens", 90), **kw)


def test_tool_choice_required_and_named_give_tool_calls(server):
    c = server.client()
    for choice, names in (("required", {"add", "noop"}), ({"type": "function", "function": {"name": "add"}}, {"add"})):
        r = chat(c, tools=[ADD, NOOP], tool_choice=choice, parallel_tool_calls=False)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        call = ch.message.tool_calls[0]
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "add":
            jsonschema.validate(args, ADD["function"]["parameters"])


def test_streamed_tool_calls_assemble_to_the_message(server):
    c = server.client()
    kw = dict(tools=[ADD, NOOP], tool_choice="required")
    whole = chat(c, **kw).choices[0]
    calls, content, finish = {}, "", None
    for chunk in chat(c, stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                d = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                d["name"] += tc.function.name or ""
                d["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(d["name"], d["arguments"]) for _, d in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]  # ids: fresh per response
    assert all(d["id"].startswith("call_") for d in calls.values())
    assert content == (whole.message.content or "")


def test_a_tool_turn_goes_back_through_the_template(server):
    c = server.client()
    first = chat(c, tools=[ADD], tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    msgs = [{"role": "user", "content": "add 2 and 3"}, first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = chat(c, messages=msgs, tools=[ADD], tool_choice="none", max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length") and not r.choices[0].message.tool_calls
    text = server.raw("POST", "/tokenize", {"messages": msgs})[2]
    assert text["count"] > 0


def test_response_format_json_schema_and_parse_with_pydantic(server):
    c = server.client()

    class Point(BaseModel):  # bounded: a random model's integer would run to max_tokens
        x: int = Field(ge=0, le=99)
        label: bool

    r = c.beta.chat.completions.parse(model="tiny-agent", messages=[{"role": "user", "content": "a point"}],
                                      response_format=Point, temperature=0, max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Point), r.choices[0].message
    obj = chat(c, response_format={"type": "json_object"}, max_tokens=120)
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # an unbounded object from a random model may run out of tokens: it is then a prefix of one
        assert obj.choices[0].message.content.startswith("{")


def test_reasoning_content_and_chat_template_kwargs(server):
    c = server.client()
    thinking = chat(c, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    plain = chat(c, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    m, ids = thinking.choices[0].message, thinking.choices[0].model_extra["token_ids"]
    reasoning, text = m.model_extra.get("reasoning_content"), server.raw("POST", "/detokenize", {"tokens": ids})[2]
    assert "</think>" not in text["prompt"]  # the random model never closed the block: all of it is reasoning
    assert reasoning == text["prompt"] and reasoning and m.content == ""
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None and plain.choices[0].message.content
    # streamed: the reasoning arrives in delta.reasoning_content and assembles to the message's
    parts = [ch.delta.model_extra.get("reasoning_content") or "" for chunk in
             chat(c, max_tokens=12, stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
             for ch in chunk.choices]
    assert "".join(parts) == reasoning


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}]}, "cannot be enforced"),
    ({"tools": [ADD, ADD]}, "given twice"),
    ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1", "content": "5"}]},
     "matches no earlier"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}},
     "cannot be enforced"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 200} for i in range(400)}}}}},
     "this server compiles at most"),
]


@pytest.mark.parametrize("extra,words", BAD)
def test_bad_agent_requests_are_400_and_the_server_keeps_serving(server, extra, words):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **extra}
    status, _, j = server.raw("POST", "/v1/chat/completions", body)
    assert status == 400 and words in j["error"]["message"], j
    assert server.raw("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 2})[0] == 200


def test_an_openai_agents_run_with_a_function_tool_completes(server):
    """openai-agents, as its users run it against a local server: its chat-completions model, one function
    tool; tool_choice required on the first turn (the SDK resets it to auto once the tool was called)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def add(a: Digit, b: Digit) -> int:
        """Add two digits."""
        seen.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = agents.OpenAIChatCompletionsModel(model="tiny-agent", openai_client=client)
    agent = agents.Agent(name="adder", instructions="Add.", tools=[add], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=90))
    result = agents.Runner.run_sync(agent, "add 2 and 3", max_turns=4)
    assert len(seen) == 1 and isinstance(result.final_output, str)
