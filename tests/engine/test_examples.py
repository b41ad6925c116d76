"""Post-training examples: the three kinds and the end token; the embedded tasks' (right answers, corrupted
ones that never equal them, the same example for the same index in every process, and the exact-match
reward); and examples from files (prompt and response tokenised apart, malformed records named by file and
line)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.engine.data.documents import iter_rows
from rewind.engine.data.examples import (
    ANSWER_FIELD,
    POSTTRAIN_TASKS,
    PreferenceRow,
    PromptRow,
    SftRow,
    encode_text,
    end_token,
    exact_match_reward,
    exact_match_rewards,
    read_preference_rows,
    read_prompt_rows,
    read_sft_rows,
    task_preference_row,
    task_prompt_row,
    task_sft_row,
    task_texts,
)
from rewind.engine.data.tasks import SPLITS, num_task_samples
from rewind.engine.data.tokenizer import ByteTokenizer, Tokenizer, TokenizerError, train_bpe
from tests.engine.test_documents import one_line_error


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    # "then" is one token, "the" + "n" two: a prompt ending "the" and a response starting "n" would merge.
    return train_bpe(["then there then the then n " * 20, "rev abc=cba " * 10], 300)


def jsonl(path, rows: list, blank_first: bool = False) -> str:
    lines = ([""] if blank_first else []) + [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


# --- the three kinds and the end token ---------------------------------------------------------------


def test_rows_are_frozen_and_refuse_what_cannot_train():
    row = SftRow((1, 2), (3,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.prompt = (4,)  # type: ignore[misc]
    with pytest.raises(ValueError, match="prompt holds no token"):
        SftRow((), (3,))
    with pytest.raises(ValueError, match="the same"):
        PreferenceRow((1,), (2, 3), (2, 3))
    assert PreferenceRow((1,), (2,), (2, 3)).rejected == (2, 3)


def test_the_end_token_is_eos_else_the_newline(bpe):
    assert end_token(ByteTokenizer()) == 10
    assert bpe.eos_id is not None and end_token(bpe) == bpe.eos_id
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hi": 1}, "unk_token": "[UNK]"},
    }  # fmt: skip
    with pytest.raises(TokenizerError) as info:
        end_token(Tokenizer(json.dumps(spec)))
    assert "no <|endoftext|> token and encodes '\\n' as 0 tokens" in str(info.value)


def test_prompt_and_response_are_tokenised_apart(tmp_path, bpe):
    assert bpe.encode("then") != bpe.encode("the") + bpe.encode("n")  # (the merge the test is about)
    path = jsonl(tmp_path / "a.jsonl", [{"prompt": "the", "response": "n"}])
    (row,) = read_sft_rows([path], "jsonl", bpe.encode)
    assert row == SftRow(tuple(bpe.encode("the")), tuple(bpe.encode("n")))
    (row,) = read_sft_rows([path], "jsonl")  # no tokenizer: UTF-8 bytes
    assert row == SftRow(tuple(b"the"), tuple(b"n")) and encode_text("é", None) == (0xC3, 0xA9)


# --- the embedded tasks' examples --------------------------------------------------------------------


def solved(prompt: str) -> str:
    """The right answer to a task prompt, worked out here."""
    verb, given_input = prompt.removesuffix("=").split(" ", 1)
    if verb == "add":
        a, b = given_input.split("+")
        return str(int(a) + int(b))
    return given_input[::-1] if verb == "rev" else "".join(sorted(given_input))


indices = st.tuples(st.sampled_from(POSTTRAIN_TASKS), st.sampled_from(SPLITS), st.integers(0, 255))


@settings(max_examples=300, deadline=None)
@given(indices)
def test_answers_are_right_and_corrupted_ones_wrong(where):
    name, split, index = where
    texts = task_texts(name, split, index)
    assert texts.answer == solved(texts.prompt)
    assert texts.wrong != texts.answer
    if name == "add":
        assert texts.wrong.isdigit() and 1 <= abs(int(texts.wrong) - int(texts.answer)) <= 10
    else:  # one letter replaced by another
        assert len(texts.wrong) == len(texts.answer) and texts.wrong.isalpha() and texts.wrong.islower()
        assert sum(a != b for a, b in zip(texts.wrong, texts.answer, strict=True)) == 1
    pair = task_preference_row(name, split, index)
    assert pair.chosen == tuple(texts.answer.encode()) and pair.rejected == tuple(texts.wrong.encode())


def test_byte_level_rows_are_the_tasks_text_with_the_newline_as_end_token():
    row = task_sft_row("add", "train", 7)
    texts = task_texts("add", "train", 7)
    # The end token of UTF-8 bytes is "\n" (rewind.engine.data.examples.end_token): prompt + response + end is the task's line.
    assert bytes([*row.prompt, *row.response, 10]).decode() == f"{texts.prompt}{texts.answer}\n"
    prompt = task_prompt_row("sort", "validation", 3)
    assert prompt == PromptRow(3, tuple(task_texts("sort", "validation", 3).prompt.encode()),
                               task_texts("sort", "validation", 3).prompt,
                               {ANSWER_FIELD: task_texts("sort", "validation", 3).answer})  # fmt: skip


def test_a_tokenizer_encodes_prompt_and_answer_apart():
    bpe = train_bpe([" ".join(f"rev {w}={w[::-1]}" for w in ("abc", "xyz", "then")) * 30], 300)
    texts = task_texts("reverse", "train", 0)
    row = task_sft_row("reverse", "train", 0, bpe.encode)
    assert row == SftRow(tuple(bpe.encode(texts.prompt)), tuple(bpe.encode(texts.answer)))


def test_train_and_validation_prompts_differ_and_indices_are_checked():
    train = {task_texts("add", "train", i).prompt for i in range(300)}
    validation = {
        task_texts("add", "validation", i).prompt for i in range(num_task_samples("add", "validation"))
    }
    assert not train & validation
    with pytest.raises(IndexError, match="out of range"):
        task_texts("add", "validation", num_task_samples("add", "validation"))
    with pytest.raises(ValueError, match="no answers"):
        task_texts("grammar", "train", 0)
    with pytest.raises(ValueError, match="unknown split"):
        task_texts("add", "test", 0)


def test_the_same_index_gives_the_same_row_in_another_process():
    code = (
        "from rewind.engine.data.examples import task_texts\n"
        "print([tuple(task_texts(n, s, i)) for n in ('reverse', 'sort', 'add') for s in ('train', 'validation')"
        " for i in (0, 5, 99)])"
    )
    here = [tuple(task_texts(n, s, i)) for n in POSTTRAIN_TASKS for s in SPLITS for i in (0, 5, 99)]
    assert [tuple(task_texts(n, s, i)) for n in POSTTRAIN_TASKS for s in SPLITS for i in (0, 5, 99)] == here
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert there.strip() == repr(here)


def test_exact_match_compares_the_first_line_with_the_answer():
    assert exact_match_reward("15", "15") == 1.0
    assert exact_match_reward("15\nadd 1+2=3\n", "15") == 1.0  # the first line only
    assert exact_match_reward("15", "15\n") == 1.0  # an answer's final newline is not part of it
    assert exact_match_reward("15\n", "15\n") == 1.0
    assert exact_match_reward(" 15", "15") == 0.0 and exact_match_reward("15 ", "15") == 0.0
    assert exact_match_reward("1", "15") == 0.0 and exact_match_reward("", "15") == 0.0
    assert exact_match_reward("ABC", "abc") == 0.0
    rewards = exact_match_rewards(["p", "p"], ["ba\n", "ab"], [[1], [2]], answer=["ba", "ba"], hint=["", ""])
    assert rewards == [1.0, 0.0]
    with pytest.raises(ValueError):
        exact_match_rewards(["p"], ["ba"], [[1]], answer=["ba", "ab"])


# --- reading files ------------------------------------------------------------------------------------


def test_rows_come_in_file_then_row_order_with_configured_fields(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [{"q": "1", "a": "x", "b": "y", "n": 3}, {"q": "2", "a": "", "b": "z"}])
    b = jsonl(tmp_path / "b.jsonl", [{"q": "3", "a": "w", "b": "v"}])
    sft = read_sft_rows([a, b], "jsonl", prompt_field="q", response_field="a")
    assert sft == [
        SftRow((49,), (120,)),
        SftRow((50,), ()),
        SftRow((51,), (119,)),
    ]  # an empty response is a row
    pairs = read_preference_rows([b, a], "jsonl", prompt_field="q", chosen_field="a", rejected_field="b")
    assert [(r.prompt, r.chosen, r.rejected) for r in pairs] == [
        ((51,), (119,), (118,)), ((49,), (120,), (121,)), ((50,), (), (122,))
    ]  # fmt: skip
    assert read_sft_rows([a, b], "jsonl", prompt_field="q", response_field="a") == sft  # the same every time


def test_prompt_rows_keep_their_text_and_fields(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", [{"prompt": "add 1+2=", "answer": "3", "hint": "sum"}])
    b = jsonl(tmp_path / "b.jsonl", [{"prompt": "rev ab=", "answer": "ba", "hint": ""}])
    rows = read_prompt_rows([a, b], "jsonl", fields=("answer", "hint"))
    assert [r.prompt_id for r in rows] == [0, 1]
    assert rows[1] == PromptRow(1, tuple(b"rev ab="), "rev ab=", {"answer": "ba", "hint": ""})
    assert dict(rows[0].fields) == {"answer": "3", "hint": "sum"}
    with pytest.raises(TypeError):
        rows[0].fields["answer"] = "4"  # type: ignore[index]
    assert read_prompt_rows([a], "jsonl")[0].fields == {}


def test_parquet_rows_read_like_jsonl_ones(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["c", "d"], "rejected": ["e", "f"]}), path)
    rows = read_preference_rows([str(path)], "parquet")
    assert rows == [PreferenceRow((97,), (99,), (101,)), PreferenceRow((98,), (100,), (102,))]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"prompt": "p"}', "no 'response' field"),
        ('{"prompt": "p", "response": 3}', "field 'response' is int, not a string"),
        ('{"prompt": "p", "response": ', "not valid JSON"),
        ('["p", "r"]', "a JSON list, not an object"),
        ('{"prompt": "", "response": "r"}', "field 'prompt' is empty"),
    ],
)
def test_a_malformed_sft_row_names_its_file_and_line(tmp_path, line, needle):
    # Line 3: a blank line and a good row come first, so the number is the file's line, not the row's.
    path = jsonl(tmp_path / "bad.jsonl", ['{"prompt": "p", "response": "r"}', line], blank_first=True)
    one_line_error(lambda: read_sft_rows([path], "jsonl"), f"{path}:3: ", needle)


def test_malformed_preference_and_prompt_rows_name_their_file_and_line(tmp_path):
    good = {"prompt": "p", "chosen": "c", "rejected": "r", "answer": "a"}
    path = jsonl(tmp_path / "same.jsonl", [good, {**good, "rejected": "c"}])
    one_line_error(
        lambda: read_preference_rows([path], "jsonl"),
        f"{path}:2: fields 'chosen' and 'rejected' are the same",
    )
    path = jsonl(tmp_path / "noanswer.jsonl", [good, good, {"prompt": "p"}])
    one_line_error(lambda: read_prompt_rows([path], "jsonl", fields=("answer",)), f"{path}:3: no 'answer' field")
    path = jsonl(tmp_path / "number.jsonl", [{**good, "answer": 7}])
    one_line_error(lambda: read_prompt_rows([path], "jsonl", fields=("answer",)), f"{path}:1: field 'answer' is int")
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", ""], "response": ["c", "d", "e"]}), parquet)
    one_line_error(lambda: read_sft_rows([str(parquet)], "parquet"), f"{parquet}: row 2: field 'prompt' is empty")
    one_line_error(lambda: read_sft_rows([path], "text"), "need jsonl or parquet")


def test_a_prompt_that_encodes_to_nothing_is_one_line_error(tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"prompt": "x", "response": "r"}])
    one_line_error(
        lambda: read_sft_rows([path], "jsonl", lambda text: []),
        f"{path}:1: field 'prompt' encodes to no token",
    )


def test_iter_rows_says_where_each_row_is(tmp_path):
    path = jsonl(tmp_path / "a.jsonl", [{"x": "1"}, {"x": "2"}], blank_first=True)
    assert list(iter_rows([path], "jsonl", ("x",))) == [(f"{path}:2", ("1",)), (f"{path}:3", ("2",))]
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"x": ["1", "2"]}), parquet)
    assert [place for place, _ in iter_rows([str(parquet)], "parquet", ("x",))] == [
        f"{parquet}: row 0", f"{parquet}: row 1"
    ]  # fmt: skip
