"""The rules for a config's data sources (`[data.NAME]`) and its tokenizer: names, paths, the
validation split, prompt/response fields, and what a trained tokenizer is trained on. Called by
`rewind.states.config_rules.check_config`."""

from __future__ import annotations

from rewind.states.config import BUILTIN_DATASETS, Config, DataSource

TEXT_KINDS = ("text", "jsonl", "parquet")  # documents the run tokenises (kind "tokens" is already token ids)
# In a data path, the Python standard library's directory (the engine substitutes it): a real corpus on
# every machine rewind runs on.
STDLIB_PLACEHOLDER = "{stdlib}"
# A byte-level BPE starts from the 256 byte symbols; a vocabulary of that size would learn no merge.
MIN_TRAINED_VOCAB = 257


def data_problems(config: Config) -> list[str]:
    """Each data source's problems, by name, then the tokenizer's."""
    problems = [p for name, source in config.data.items() for p in source_problems(name, source)]
    return problems + tokenizer_problems(config)


def source_problems(name: str, source: DataSource) -> list[str]:
    """The problems of `[data.NAME]` on its own."""
    where, problems = f"data.{name}", []
    add = problems.append
    if name in BUILTIN_DATASETS:
        add(f"{where}: the name is taken by a built-in dataset")
    if not source.path:
        add(f"{where}.path: must not be empty")
    if source.validation_path:
        if source.split:
            add(f"{where}.split: the validation split comes from validation_path; leave split unset")
    elif not 0.0 < source.validation_fraction < 1.0:
        add(f"{where}.validation_fraction: must be in (0, 1), got {source.validation_fraction}")
    names = ("prompt_field", "response_field", "chosen_field", "rejected_field", "answer_field")
    fields = {f: getattr(source, f) for f in names}
    if any(fields.values()):
        problems += _example_field_problems(where, source.kind, fields)
    elif source.kind in ("jsonl", "parquet") and not source.text_field:
        add(f"{where}.text_field: must not be empty")
    return problems


def _example_field_problems(where: str, kind: str, fields: dict[str, str]) -> list[str]:
    """Prompt/response pairs, prompt/chosen/rejected examples and prompt/answer rows: the fields that go
    together, apart."""
    if kind not in ("jsonl", "parquet"):
        return [f"{where}.prompt_field: prompt/response pairs need kind jsonl or parquet, not {kind!r}"]
    prompt, response = fields["prompt_field"], fields["response_field"]
    chosen, rejected = fields["chosen_field"], fields["rejected_field"]
    if not prompt or not (response or chosen or fields["answer_field"]):
        missing = "response_field" if prompt else "prompt_field"
        return [f"{where}.{missing}: prompt_field and response_field go together"]
    if bool(chosen) != bool(rejected):
        missing = "rejected_field" if chosen else "chosen_field"
        return [f"{where}.{missing}: chosen_field and rejected_field go together"]
    named = [(f, v) for f, v in fields.items() if v]
    for i, (field, value) in enumerate(named):
        if value in (v for _, v in named[:i]):
            return [f"{where}.{field}: must differ from the other fields ({value!r} is named twice)"]
    return []


def tokenizer_problems(config: Config) -> list[str]:
    """`tokenizer`: read or trained (not both), and what a trained one is trained on."""
    tok, problems = config.tokenizer, []
    add = problems.append
    text_datasets = [n for n, s in config.data.items() if s.kind in TEXT_KINDS and not s.prompt_field]
    if tok.train_vocab_size:
        if tok.path:
            add(
                "tokenizer.train_vocab_size: a tokenizer is either read from tokenizer.path or trained, not both"
            )
        if tok.train_vocab_size < MIN_TRAINED_VOCAB:
            add(
                f"tokenizer.train_vocab_size: must be >= {MIN_TRAINED_VOCAB} (256 bytes and at least one merge), "
                f"got {tok.train_vocab_size}"
            )
        if tok.train_vocab_size > config.architecture.vocab_size:
            add(
                f"tokenizer.train_vocab_size: {tok.train_vocab_size} exceeds architecture.vocab_size "
                f"{config.architecture.vocab_size}"
            )
        if not (tok.train_on or text_datasets):
            add(
                "tokenizer.train_vocab_size: no documents to train it on (declare a [data.NAME] of kind text, "
                "or jsonl / parquet without prompt_field)"
            )
    elif tok.train_on:
        add("tokenizer.train_on: only used with tokenizer.train_vocab_size")
    for i, name in enumerate(tok.train_on):
        if name not in config.data:
            add(f"tokenizer.train_on[{i}]: {name!r} is not a [data.NAME] dataset")
        elif config.data[name].kind not in TEXT_KINDS:
            add(f"tokenizer.train_on[{i}]: {name!r} is of kind {config.data[name].kind!r}, not text")
        elif config.data[name].prompt_field:
            add(
                f"tokenizer.train_on[{i}]: {name!r} holds prompt/response pairs; a tokenizer is trained on documents"
            )
    return problems
