"""Continue a prompt greedily with a `rewind export --hf` directory, loaded by transformers alone (and its
`--adapters` directory by peft):

    python examples/load_hf.py HF_DIR PROMPT [ADAPTERS_DIR]

Prints the continuation (16 new tokens at most) as `rewind sample RUN --prompt PROMPT --max-tokens 16
--temperature 0` prints it, and the same text while the prompt and the new tokens fit in the run's
block_size (transformers does not crop to it). A run without a tokenizer reads UTF-8 bytes: token id =
byte value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_NEW_TOKENS = 16


def main(hf_dir: str, prompt: str, adapters_dir: str | None = None) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    if adapters_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapters_dir)
    if (Path(hf_dir) / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        eos, decode = tokenizer.eos_token_id, tokenizer.decode
    else:
        ids = torch.tensor([list(prompt.encode())])
        eos, decode = None, lambda tokens: bytes(tokens).decode("utf-8", errors="replace")
    with torch.no_grad():
        out = model.eval().generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    tokens = out[0, ids.shape[1] :].tolist()
    if tokens and tokens[-1] == eos:  # generate keeps the end-of-text token it stopped at; rewind sample does not
        tokens.pop()
    print(decode(tokens))

if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python examples/load_hf.py HF_DIR PROMPT [ADAPTERS_DIR]")
    main(*sys.argv[1:])
