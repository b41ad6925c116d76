"""Post-training rows out of a user's JSONL / Parquet files (rewind.engine.data.documents reads them), tokenised by
the run's tokenizer. (Their identity goes on record as the dataset's: rewind.engine.data.userdata.)

Every field read must be a string, in every row; a row that breaks that, or whose prompt is empty, or whose
chosen and rejected responses are the same tokens, is a DocumentError of one line naming its file and line
(jsonl, from 1) or row (parquet, from 0). Rows come in the order of `paths` (the sorted matches of a glob:
rewind.engine.data.documents.expand_inputs), then of the rows in each file.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import MappingProxyType

from rewind.engine.data.documents import DocumentError, iter_rows
from rewind.engine.data.rows import PreferenceRow, PromptRow, SftRow, Tokens, encode_text
from rewind.engine.data.tasks import Encoder
from rewind.engine.data.tokenizer import TokenizerError


def _encoded(place: str, field: str, text: str, encode: Encoder | None, end_id: int | None = None) -> Tokens:
    """`text`'s tokens; a response (`end_id` given) must not hold the token that ends one: with the
    byte-level tokenizer that is "\n", so a response is one line (training would teach the model to stop
    mid-response, and an answer with a line break could never be matched)."""
    try:
        tokens = encode_text(text, encode)
    except TokenizerError as exc:
        raise DocumentError(f"{place}: field {field!r}: {exc}") from None
    if end_id is not None and end_id in tokens:
        raise DocumentError(
            f"{place}: field {field!r} holds the token that ends a response (id {end_id}; with byte-level "
            "tokens, a line break): a response is one line"
        )
    return tokens


def _prompted_rows(
    paths: Sequence[str], kind: str, fields: tuple[str, ...], encode: Encoder | None
) -> Iterator[tuple[str, Tokens, tuple[str, ...]]]:
    """(place, prompt tokens, the texts of every field) of each row; fields[0] is the prompt."""
    for place, texts in iter_rows(paths, kind, fields):
        if not texts[0]:
            raise DocumentError(f"{place}: field {fields[0]!r} is empty")
        prompt = _encoded(place, fields[0], texts[0], encode)
        if not prompt:
            raise DocumentError(f"{place}: field {fields[0]!r} encodes to no token")
        yield place, prompt, texts


def read_sft_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    response_field: str = "response",
    end_id: int | None = None,
) -> list[SftRow]:
    """The prompt/response rows of `paths` (kind "jsonl" or "parquet"). An empty response is a row (it
    teaches the end token after the prompt). `end_id`: the token that ends a response, refused inside one."""
    return [
        SftRow(prompt, _encoded(place, response_field, texts[1], encode, end_id))
        for place, prompt, texts in _prompted_rows(paths, kind, (prompt_field, response_field), encode)
    ]


def read_preference_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
    end_id: int | None = None,
) -> list[PreferenceRow]:
    """The prompt/chosen/rejected rows of `paths` (kind "jsonl" or "parquet"); `end_id` as for sft rows."""
    rows = []
    for place, prompt, texts in _prompted_rows(
        paths, kind, (prompt_field, chosen_field, rejected_field), encode
    ):
        chosen = _encoded(place, chosen_field, texts[1], encode, end_id)
        rejected = _encoded(place, rejected_field, texts[2], encode, end_id)
        if chosen == rejected:  # (a preference between two equal responses says nothing)
            raise DocumentError(f"{place}: fields {chosen_field!r} and {rejected_field!r} are the same")
        rows.append(PreferenceRow(prompt, chosen, rejected))
    return rows


def read_prompt_rows(
    paths: Sequence[str],
    kind: str,
    encode: Encoder | None = None,
    *,
    prompt_field: str = "prompt",
    fields: Sequence[str] = (),
    end_id: int | None = None,
) -> list[PromptRow]:
    """The prompts of `paths` (kind "jsonl" or "parquet"), each with the string `fields` its reward functions
    take (the built-in exact match reads "answer": rewind.engine.data.task_rows.ANSWER_FIELD). prompt_id: the
    row's index among all the rows of `paths`, from 0. `end_id`: refused inside the first field (the answer:
    a completion ends at that token, so an answer holding it could never be matched)."""
    names = (prompt_field, *fields)
    rows = []
    for index, (place, prompt, texts) in enumerate(_prompted_rows(paths, kind, names, encode)):
        if fields:
            _encoded(place, fields[0], texts[1], encode, end_id)
        rows.append(PromptRow(index, prompt, texts[0], MappingProxyType(dict(zip(fields, texts[1:], strict=True)))))
    return rows
