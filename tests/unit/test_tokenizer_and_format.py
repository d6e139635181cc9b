"""Tokenizer round trips and the chat / tool-call text format."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_rl.models.chat_format import (
    assistant_ids,
    format_tool_call,
    parse_completion,
    render_messages,
    render_with_mask,
    tool_output_text,
    validate_messages,
)
from nemo_rl.models.tokenizer import NUM_BYTES, SPECIAL_TOKENS, Tokenizer, pieces_of

CORPUS = [
    "Use the tools to do the task, then say Done.",
    "Invite bo to a meeting called sync on 2023-12-04 at 10:00",
    'directory_find_email {"name": "bo"}',
    "bo@corp.com",
    "Created event E2.",
]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_corpus(CORPUS)


@pytest.mark.parametrize(
    "text",
    ["", "Done.", "  two  spaces\n\ttab", "bo@corp.com", "naïve café ☕ 日本語", "<|user|> not special",
     "</call><call>", "\x00\x7f", "unknownword zzz_qq"],
)
def test_round_trip_examples(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_round_trip_any_text(text):
    tok = Tokenizer.from_corpus(CORPUS)
    assert tok.decode(tok.encode(text)) == text


def test_known_words_are_one_token_unknown_fall_back_to_bytes(tok):
    assert len(tok.encode("directory_find_email")) == 1
    assert len(tok.encode("calendar")) == len("calendar")  # not in corpus: one byte token per char
    assert all(len(SPECIAL_TOKENS) <= i < len(SPECIAL_TOKENS) + NUM_BYTES for i in tok.encode("calendar"))
    # a name is the same token inside a sentence and inside JSON arguments
    a, b = tok.encode("bo"), tok.encode('"bo"')
    assert len(a) == 1 and a[0] in b


def test_plain_text_never_produces_special_ids_unless_allowed(tok):
    ids = tok.encode("<|user|><call>")
    assert not any(tok.is_special(i) for i in ids)
    ids = tok.encode("<|user|>hi<call>", allow_special=True)
    assert ids[0] == tok.special_id("<|user|>") and ids[-1] == tok.call_open_id
    assert tok.decode(ids) == "<|user|>hi<call>"


def test_from_corpus_is_deterministic():
    shuffled = CORPUS[:]
    random.Random(3).shuffle(shuffled)
    assert Tokenizer.from_corpus(CORPUS).to_dict() == Tokenizer.from_corpus(shuffled).to_dict()


def test_pieces_partition_text():
    s = "Book Lunch with Bo on 2024-03-06 11:00!"
    assert "".join(pieces_of(s)) == s
    assert "Lunch" in pieces_of(s) and "2" in pieces_of(s)


def test_save_load_json(tok, tmp_path):
    p = tmp_path / "tokenizer.json"
    tok.save(p)
    again = Tokenizer.load(p)
    assert again.to_dict() == tok.to_dict()
    assert again.encode("Invite bo") == tok.encode("Invite bo")
    assert json.loads(p.read_text())["pieces"] == tok.to_dict()["pieces"]


def test_bad_tokenizer_json_names_the_field(tok):
    d = tok.to_dict()
    with pytest.raises(ValueError, match="format"):
        Tokenizer.from_dict({**d, "format": "other"})
    with pytest.raises(ValueError, match="pieces"):
        Tokenizer.from_dict({**d, "pieces": "abc"})
    with pytest.raises(ValueError, match="twice"):
        Tokenizer.from_dict({**d, "pieces": ["ab", "ab"]})


def test_decode_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


# ----- chat template ------------------------------------------------------
HISTORY = [
    {"role": "system", "content": "You are an office assistant."},
    {"role": "user", "content": "Invite bo to a meeting called sync on 2023-12-04 at 10:00"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "directory_find_email", "arguments": '{"name": "bo"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "bo@corp.com"},
]


def test_render_layout(tok):
    ids = render_messages(tok, HISTORY)
    assert ids[0] == tok.bos_id and ids[-1] == tok.special_id("<|assistant|>")
    text = tok.decode(ids)
    assert text == (
        "<|bos|><|system|>You are an office assistant.<|end|>"
        "<|user|>Invite bo to a meeting called sync on 2023-12-04 at 10:00<|end|>"
        '<|assistant|><call>directory_find_email {"name": "bo"}</call><|end|>'
        "<|tool|>bo@corp.com<|end|><|assistant|>"
    )
    assert render_messages(tok, HISTORY, add_generation_prompt=False) == ids[:-1]


def test_mask_covers_exactly_the_assistant_tokens(tok):
    ids, mask = render_with_mask(tok, HISTORY, add_generation_prompt=False)
    assert len(ids) == len(mask)
    written = [i for i, m in zip(ids, mask) if m]
    assert written == assistant_ids(tok, None, HISTORY[2]["tool_calls"])
    assert written[0] == tok.call_open_id and written[-1] == tok.end_id


def test_tool_reply_envelope_is_unwrapped(tok):
    wrapped = [*HISTORY[:3], {"role": "tool", "tool_call_id": "c1", "content": '{"output": "bo@corp.com"}'}]
    assert render_messages(tok, wrapped) == render_messages(tok, HISTORY)
    assert tool_output_text('{"output": 3}') == '{"output": 3}'
    assert tool_output_text('{"output": "x", "more": 1}') == '{"output": "x", "more": 1}'


def test_content_parts_and_developer_role(tok):
    a = render_messages(tok, [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}])
    b = render_messages(tok, [{"role": "system", "content": "Be brief."}])
    assert a == b


def test_bad_messages_name_index_and_field():
    with pytest.raises(ValueError, match=r"messages\[1\]\.role"):
        validate_messages([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls"):
        validate_messages([{"role": "assistant", "tool_calls": [{"type": "function"}]}])
    with pytest.raises(ValueError, match="non-empty"):
        validate_messages([])


# ----- tool-call text format ---------------------------------------------
def test_parse_single_call():
    content, calls = parse_completion('<call>directory_find_email {"name": "bo"}</call>')
    assert content is None
    assert len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "directory_find_email", "arguments": '{"name": "bo"}'}


def test_parse_text_and_several_calls():
    text = 'Looking up. <call>a {"x": 1}</call><call>b {"y": "z</call>"}</call>'
    content, calls = parse_completion(text)
    # the second block ends at the first </call>, so its JSON is cut: it stays text
    assert [c["function"]["name"] for c in calls] == ["a"]
    assert content == 'Looking up. <call>b {"y": "z</call>"}</call>'
    content, calls = parse_completion('<call>a {"x": 1}</call> <call>b.c-d {"y": [1, {"k": "}"}]}</call>')
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b.c-d"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"y": [1, {"k": "}"}]}


@pytest.mark.parametrize(
    "bad",
    [
        '<call>directory_find_email {"name": "bo"</call>',  # broken JSON
        "<call>directory_find_email [1, 2]</call>",  # not an object
        '<call>1bad {"a": 1}</call>',  # bad name
        '<call> {"a": 1}</call>',  # no name
        '<call>foo {"a": 1}',  # never closed
        '<call>foo"x" {"a": 1}</call>',  # junk after the name
    ],
)
def test_malformed_calls_stay_content(bad):
    content, calls = parse_completion("Sure. " + bad)
    assert calls == []
    assert content == ("Sure. " + bad).strip()


def test_plain_reply():
    assert parse_completion("  Done.  ") == ("Done.", [])
    assert parse_completion("") == (None, [])


@settings(max_examples=100, deadline=None)
@given(
    name=st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    args=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=12), st.booleans()), max_size=4),
)
def test_format_parse_round_trip(name, args):
    content, calls = parse_completion(format_tool_call(name, args))
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == name
    assert json.loads(calls[0]["function"]["arguments"]) == args


def test_generated_ids_decode_to_the_same_calls(tok):
    calls = [{"id": "x", "type": "function", "function": {"name": "email_send", "arguments": '{"to": "bo@corp.com"}'}}]
    ids = assistant_ids(tok, "ok", calls)
    assert ids[-1] == tok.end_id
    content, parsed = parse_completion(tok.decode(ids[:-1]))
    assert content == "ok"
    assert parsed[0]["function"] == calls[0]["function"]
