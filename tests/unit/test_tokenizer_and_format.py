"""The embedded model's tokenizer (trained with ``tokenizers``), chat templates, and the hermes tool-call parser."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.models.chat import (
    format_tool_call,
    parse_reply,
    parse_tool_calls,
    render_prompt,
    render_text,
    render_with_mask,
    template_messages,
    tool_output_text,
    validate_messages,
)
from nemo_rl.models.tiny_model import IM_END, SPECIAL_TOKENS, train_tokenizer
from tests.model_fixtures import CORPUS

TOOLS = [{"type": "function", "function": {"name": "directory_find_email", "parameters": {"type": "object"}}}]
HISTORY = [
    {"role": "system", "content": "You are an office assistant."},
    {"role": "user", "content": "Invite bo to a meeting called sync on 2023-12-04 at 10:00"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "directory_find_email", "arguments": '{"name": "bo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "bo@corp.com"},
]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(CORPUS, 400)


@pytest.mark.parametrize(
    "text",
    ["", "Done.", "  two  spaces\n\ttab", "bo@corp.com", "naïve café ☕ 日本語", "\x00\x7f", "unknownword zzz_qq"],
)
def test_round_trip_examples(tok, text):
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60))
def test_round_trip_any_text(text):
    tok = train_tokenizer(CORPUS, 400)
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_special_tokens_are_single_ids_and_a_known_word_is_one_token(tok):
    for s in SPECIAL_TOKENS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == IM_END and tok.pad_token_id is not None
    # a word is the same single token in a sentence and inside JSON arguments
    a = tok(" bo ", add_special_tokens=False)["input_ids"]
    b = tok('"bo"', add_special_tokens=False)["input_ids"]
    assert len(a) == 3 and a[1] == b[1]


def test_tiny_template_layout_with_tools(tok):
    text = render_text(tok, HISTORY, TOOLS)
    assert text == (
        "<|im_start|>system\nYou are an office assistant.\n<tools>directory_find_email</tools><|im_end|>\n"
        "<|im_start|>user\nInvite bo to a meeting called sync on 2023-12-04 at 10:00<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "directory_find_email", "arguments": {"name": "bo"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>tool\nbo@corp.com<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_prompt(tok, HISTORY, TOOLS) == tok(text, add_special_tokens=False)["input_ids"]


def test_mask_covers_exactly_the_generated_tokens(tok):
    eos = tok.convert_tokens_to_ids(IM_END)
    conv = [*HISTORY, {"role": "assistant", "content": "Done."}]
    ids, mask = render_with_mask(tok, conv, TOOLS, {eos})
    assert len(ids) == len(mask)
    written = tok.decode([i for i, m in zip(ids, mask) if m])
    assert written == ('<tool_call>\n{"name": "directory_find_email", "arguments": {"name": "bo"}}\n</tool_call>'
                       "<|im_end|>Done.<|im_end|>")
    # each span is exactly what a model call after that prompt generates
    prompt = render_prompt(tok, conv[:4], TOOLS)
    assert ids[: len(prompt)] == prompt and mask[len(prompt)] == 1 and mask[len(prompt) - 1] == 0


def test_tool_reply_envelope_is_unwrapped(tok):
    wrapped = [*HISTORY[:3], {"role": "tool", "tool_call_id": "c1", "content": '{"output": "bo@corp.com"}'}]
    assert render_prompt(tok, wrapped) == render_prompt(tok, HISTORY)
    assert tool_output_text('{"output": 3}') == '{"output": 3}'
    assert tool_output_text('{"output": "x", "more": 1}') == '{"output": "x", "more": 1}'


def test_content_parts_developer_role_and_responses_style_tools(tok):
    a = render_prompt(tok, [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}])
    b = render_prompt(tok, [{"role": "system", "content": "Be brief."}])
    assert a == b
    flat = [{"type": "function", "name": "directory_find_email", "parameters": {"type": "object"}}]
    assert render_prompt(tok, HISTORY, flat) == render_prompt(tok, HISTORY, TOOLS)
    assert template_messages(HISTORY)[2]["tool_calls"][0]["function"]["arguments"] == {"name": "bo"}


def test_bad_messages_name_index_and_field(tok):
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        validate_messages([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls"):
        validate_messages([{"role": "assistant", "tool_calls": [{"type": "function"}]}])
    with pytest.raises(ValueError, match="non-empty"):
        validate_messages([])
    tok2 = train_tokenizer(CORPUS, 300)
    tok2.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render_prompt(tok2, HISTORY)


# ----- hermes tool-call parsing (vLLM's hermes parser semantics) ----------------
def test_parse_single_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "directory_find_email", "arguments": {"name": "bo"}}\n</tool_call>')
    assert content is None and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "directory_find_email", "arguments": '{"name": "bo"}'}


def test_parse_text_then_several_calls_and_an_unterminated_last_one():
    text = 'Looking up.\n<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}'
    content, calls = parse_tool_calls(text)
    assert content == "Looking up."
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {}]
    # arguments written as a JSON string are accepted too
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": "{\\"k\\": [1, \\"}\\"]}"}</tool_call>')
    assert json.loads(calls[0]["function"]["arguments"]) == {"k": [1, "}"]}


@pytest.mark.parametrize(
    "bad",
    [
        '<tool_call>{"name": "directory_find_email", "arguments": {"name": "bo"}</tool_call>',  # broken JSON
        "<tool_call>[1, 2]</tool_call>",  # not an object
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
        '<tool_call>{"name": "ok", "arguments": {}}</tool_call><tool_call>{"name": </tool_call>',  # one bad block
    ],
)
def test_malformed_calls_give_no_calls_and_keep_the_text(bad):
    content, calls = parse_tool_calls("Sure. " + bad)
    assert calls == []
    assert content == ("Sure. " + bad).strip()


def test_plain_reply():
    assert parse_tool_calls("  Done.  ") == ("Done.", [])
    assert parse_tool_calls("") == (None, [])


def test_reply_parsed_for_tool_calls_only_when_the_request_lists_tools():
    text = "Looking. " + format_tool_call("directory_find_email", {"name": "bo"})
    for no_tools in (None, []):
        assert parse_reply(text, no_tools) == (text, [])  # vLLM: no tools offered, no tool parser
        assert parse_reply("  Done.  ", no_tools) == ("Done.", [])
    content, calls = parse_reply(text, [{"type": "function", "function": {"name": "directory_find_email"}}])
    assert content == "Looking." and [c["function"]["name"] for c in calls] == ["directory_find_email"]


@settings(max_examples=100, deadline=None)
@given(
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    args=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=12), st.booleans()), max_size=4),
)
def test_format_parse_round_trip(name, args):
    content, calls = parse_tool_calls(format_tool_call(name, args))
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == name
    assert json.loads(calls[0]["function"]["arguments"]) == args


def test_rendered_call_decodes_back_to_the_same_call(tok):
    conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "email_send", "arguments": '{"to": "bo@corp.com"}'}}]}]
    eos = tok.convert_tokens_to_ids(IM_END)
    ids, mask = render_with_mask(tok, conv, None, {eos})
    gen = [i for i, m in zip(ids, mask) if m]
    assert gen[-1] == eos
    content, parsed = parse_tool_calls(tok.decode(gen[:-1]))
    assert content == "ok"
    assert json.loads(parsed[0]["function"]["arguments"]) == {"to": "bo@corp.com"}
    assert parsed[0]["function"]["name"] == "email_send"
