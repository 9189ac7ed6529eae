"""Prompt files: what load_prompts accepts, and one clear InputError, naming the file and line, for each mistake.

The model is a bare ModelArch (vocabulary 100, 16 positions); the tokenizer is a word-level `tokenizers` model
built in memory (ids 0-6, two of them special chat tokens) wrapped in hpcinfer's TextTokenizer.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from hpcinfer.arch import ModelArch
from hpcinfer.errors import HpcinferError, InputError
from hpcinfer.generate.prompts import load_prompts
from hpcinfer.generate.tokenizer import TextTokenizer

VOCAB, POSITIONS = 100, 16
WORDS = {"[UNK]": 0, "hello": 1, "world": 2, "the": 3, "cat": 4}        # then <|user|> = 5, <|assistant|> = 6
CHAT_TEMPLATE = ("{% for m in messages %}<|user|> {{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def arch():
    return ModelArch(family="test", vocab_size=VOCAB, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=4, intermediate_size=16, max_positions=POSITIONS)


def _tokenizer_json(vocab: dict) -> str:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|user|>", "<|assistant|>"])
    return tok.to_str()


@pytest.fixture(scope="module")
def tokenizer():
    return TextTokenizer(_tokenizer_json(WORDS), chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def plain_tokenizer():
    """A tokenizer with no chat template."""
    return TextTokenizer(_tokenizer_json(WORDS))


@pytest.fixture
def write(tmp_path):
    def write(lines, name="prompts.jsonl") -> str:
        path = tmp_path / name
        path.write_text("".join(line + "\n" for line in lines) if isinstance(lines, list) else lines)
        return str(path)

    return write


def input_error(path, arch, tokenizer=None) -> str:
    with pytest.raises(InputError) as info:
        load_prompts(path, arch, tokenizer)
    assert isinstance(info.value, HpcinferError) and info.value.exit_code == 2
    return str(info.value)


# ---------------------------------------------------------------------------------------------------- valid

def test_token_prompts_in_order_with_line_numbers(write, arch):
    path = write(['{"id": "a", "tokens": [1, 2, 3]}', "", "   ", '{"id": 7, "tokens": [0, 99]}',
                  json.dumps({"id": "long", "tokens": list(range(POSITIONS - 1))})])
    prompts = load_prompts(path, arch, None)
    assert [p.id for p in prompts] == ["a", "7", "long"]          # ids become strings
    assert [p.tokens for p in prompts] == [[1, 2, 3], [0, 99], list(range(POSITIONS - 1))]
    assert [p.line for p in prompts] == [1, 4, 5]                 # blank lines are skipped but counted


def test_text_and_chat_prompts(write, arch, tokenizer):
    path = write(['{"id": "t", "text": "hello world cat"}', '{"id": "c", "text": "the cat", "chat": true}',
                  '{"id": "f", "text": "hello", "chat": false}', '{"id": "k", "tokens": [42]}'])
    prompts = load_prompts(path, arch, tokenizer)
    assert [p.tokens for p in prompts] == [[1, 2, 4], [5, 3, 4, 6], [1], [42]]


def test_no_trailing_newline_and_crlf(write, arch):
    prompts = load_prompts(write('{"id": "a", "tokens": [1]}\r\n{"id": "b", "tokens": [2]}'), arch, None)
    assert [(p.id, p.tokens) for p in prompts] == [("a", [1]), ("b", [2])]


# ------------------------------------------------------------------------------------------- errors by line

GOOD = ['{"id": "first", "tokens": [1, 2]}', '{"id": "second", "tokens": [3]}']

# bad line 3 -> fragments its message must hold (besides "<path>:3")
LINE_ERRORS = {
    "invalid JSON": ('{"id": "x", "tokens": [1, 2', ["not valid JSON"]),
    "trailing garbage": ('{"id": "x", "tokens": [1]} x', ["not valid JSON"]),
    "not an object": ("[1, 2, 3]", ["expected a JSON object"]),
    "a bare string": ('"hello"', ["expected a JSON object"]),
    "unknown key": ('{"id": "x", "tokens": [1], "prompt": "hi"}',
                    ["unknown key 'prompt'", "allowed keys: id, tokens, text, chat"]),
    "neither tokens nor text": ('{"id": "x"}', ['exactly one of "tokens" and "text"']),
    "both tokens and text": ('{"id": "x", "tokens": [1], "text": "hello"}', ['exactly one of "tokens" and "text"']),
    "id missing": ('{"tokens": [1]}', ['"id" must be a string or an integer']),
    "id null": ('{"id": null, "tokens": [1]}', ['"id" must be a string or an integer']),
    "id float": ('{"id": 1.5, "tokens": [1]}', ['"id" must be a string or an integer']),
    "id bool": ('{"id": true, "tokens": [1]}', ['"id" must be a string or an integer']),
    "id list": ('{"id": ["x"], "tokens": [1]}', ['"id" must be a string or an integer']),
    "duplicate id": ('{"id": "first", "tokens": [4]}', ["id 'first' appears more than once"]),
    "tokens a string": ('{"id": "x", "tokens": "1 2"}', ['"tokens" must be a list of integers']),
    "tokens an int": ('{"id": "x", "tokens": 5}', ['"tokens" must be a list of integers']),
    "tokens with a float": ('{"id": "x", "tokens": [1, 2.0]}', ['"tokens" must be a list of integers']),
    "tokens with a bool": ('{"id": "x", "tokens": [1, true]}', ['"tokens" must be a list of integers']),
    "tokens nested": ('{"id": "x", "tokens": [[1]]}', ['"tokens" must be a list of integers']),
    "token id = vocab": ('{"id": "x", "tokens": [1, 100, 5]}',
                         ["token id 100", "outside the vocabulary [0, 100)"]),
    "token id negative": ('{"id": "x", "tokens": [-1]}', ["token id -1", "[0, 100)"]),
    "empty tokens": ('{"id": "x", "tokens": []}', ["the prompt is empty"]),
    "too long": (json.dumps({"id": "x", "tokens": [1] * POSITIONS}),
                 [f"{POSITIONS} tokens", f"at most {POSITIONS} positions", f"fewer than {POSITIONS}"]),
    "text with no tokenizer": ('{"id": "x", "text": "hello"}', ['"text" prompt needs a tokenizer', '"tokens"']),
    "chat on a tokens prompt": ('{"id": "x", "tokens": [1], "chat": true}',
                                ['"chat" applies to "text" prompts only']),
}


@pytest.mark.parametrize("bad, fragments", LINE_ERRORS.values(), ids=LINE_ERRORS.keys())
def test_errors_name_file_and_line(write, arch, bad, fragments):
    path = write(GOOD + [bad, '{"id": "after", "tokens": [1]}'])
    message = input_error(path, arch)
    assert message.startswith(f"{path}:3: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


TEXT_ERRORS = {
    "text not a string": ('{"id": "x", "text": 5}', ['"text" must be a string']),
    "chat not a bool": ('{"id": "x", "text": "hello", "chat": "yes"}', ['"chat" must be true or false']),
    "empty text": ('{"id": "x", "text": ""}', ["the prompt is empty"]),
    "text too long": (json.dumps({"id": "x", "text": " ".join(["cat"] * POSITIONS)}),
                      [f"{POSITIONS} tokens", f"at most {POSITIONS} positions"]),
}


@pytest.mark.parametrize("bad, fragments", TEXT_ERRORS.values(), ids=TEXT_ERRORS.keys())
def test_text_errors_name_file_and_line(write, arch, tokenizer, bad, fragments):
    path = write(GOOD + [bad])
    message = input_error(path, arch, tokenizer)
    assert message.startswith(f"{path}:3: "), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_chat_needs_a_template(write, arch, plain_tokenizer):
    path = write(GOOD + ['{"id": "x", "text": "hello", "chat": true}'])
    message = input_error(path, arch, plain_tokenizer)
    assert message.startswith(f"{path}:3: ") and "needs a chat template" in message


def test_the_line_number_counts_blank_lines(write, arch):
    path = write([GOOD[0], "", "", "{oops}"])
    assert input_error(path, arch).startswith(f"{path}:4: not valid JSON")


def test_text_tokens_outside_the_vocabulary(write):
    small = ModelArch(family="test", vocab_size=3, hidden_size=8, num_layers=1, num_heads=2, num_kv_heads=2,
                      head_dim=4, intermediate_size=16, max_positions=POSITIONS)   # "cat" is id 4 >= 3
    path = write(GOOD[:1] + ['{"id": "x", "text": "hello cat"}'])
    message = input_error(path, small, TextTokenizer(_tokenizer_json(WORDS)))
    assert message.startswith(f"{path}:2: ") and "token id 4" in message and "[0, 3)" in message


# ------------------------------------------------------------------------------------------ file-level errors

def test_missing_file(tmp_path, arch):
    path = str(tmp_path / "nope.jsonl")
    message = input_error(path, arch)
    assert path in message and "does not exist" in message


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "only blank lines"])
def test_empty_file(write, arch, text):
    path = write(text)
    message = input_error(path, arch)
    assert path in message and "holds no prompts" in message


def test_not_utf8(arch, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"id": "caf\xe9", "tokens": [1]}\n')
    message = input_error(str(path), arch)
    assert str(path) in message and "cannot be read" in message


def test_a_directory(tmp_path, arch):
    message = input_error(str(tmp_path), arch)
    assert str(tmp_path) in message and "cannot be read" in message
