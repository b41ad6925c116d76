"""The rows post-training stages read, as token ids: prompt/response (SFT), prompt/chosen/rejected (DPO) and
prompts with the string fields their reward functions take (GRPO).

Prompt and response are tokenised apart and concatenated, never as one text: a tokenizer would otherwise
merge across the boundary ("the" + "n" into "then"), and the response's first token would not be one the
model ever samples after that prompt.

A row holds its texts' tokens only. What ends a response is one token (`end_token`): the tokenizer's
<|endoftext|>, or, for a tokenizer without one (UTF-8 bytes), "\\n", so that a response is one line there and
the sampler stops at the end of it. The tensor forms (rewind.engine.data.row_batches) append it to every
response and put it in the loss.

Files: rewind.engine.data.rowfiles; the embedded tasks': rewind.engine.data.task_rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rewind.engine.data.tasks import Encoder
from rewind.engine.data.tokenizer import TextTokenizer, TokenizerError

Tokens = tuple[int, ...]


def _check_prompt(prompt: Tokens) -> None:
    # The first response token is predicted from the prompt's last one: without a prompt it has no context.
    if not prompt:
        raise ValueError("a row's prompt holds no token")


@dataclass(frozen=True)
class SftRow:
    """A prompt and the response the model learns to give (without the end token)."""

    prompt: Tokens
    response: Tokens

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)


@dataclass(frozen=True)
class PreferenceRow:
    """A prompt, the response preferred (`chosen`) and the one not (`rejected`); the two differ."""

    prompt: Tokens
    chosen: Tokens
    rejected: Tokens

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)
        if self.chosen == self.rejected:
            raise ValueError("a preference row's chosen and rejected responses are the same")


@dataclass(frozen=True)
class PromptRow:
    """A prompt to sample completions for: `prompt_id` (its index in its source: what the sampling randomness
    and the record name it by), its tokens, its text and the string fields reward functions take (an
    "answer", ...), read-only."""

    prompt_id: int
    prompt: Tokens
    text: str
    fields: Mapping[str, str]

    def __post_init__(self) -> None:
        _check_prompt(self.prompt)


def encode_text(text: str, encode: Encoder | None) -> Tokens:
    """The token ids of `text`: `encode` (the run's tokenizer), or its UTF-8 bytes when None."""
    return tuple(text.encode("utf-8")) if encode is None else tuple(encode(text))


def end_token(tokenizer: TextTokenizer) -> int:
    """The token that ends every response: <|endoftext|> when the tokenizer has it, else its "\\n" (the
    byte 10 of UTF-8 bytes). TokenizerError when it has neither as one token."""
    if tokenizer.eos_id is not None:
        return tokenizer.eos_id
    newline = tokenizer.encode("\n")
    if len(newline) != 1:
        raise TokenizerError(
            "the tokenizer has no <|endoftext|> token and encodes '\\n' as "
            f"{len(newline)} tokens: post-training needs one token that ends a response"
        )
    return newline[0]
