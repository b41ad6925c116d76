"""examples/text.toml, as docs/own_text.md runs it, on a shortened budget: the corpus found and tokenised, a
tokenizer trained, the run recorded, sampled, scored and exported to a model transformers loads.

The commands run one after the other in one fresh process (`rewind.tools.cli.main`, as the `rewind`
entry point calls it, each with its own stdout and stderr), which then loads the export with
transformers: a new interpreter, torch and transformers once instead of once per command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.docs.readme_figures import REPO

SHORT = "training.tokens=[4096,2048]"  # 4 + 2 steps of the example's 1,024 tokens: both stages, a fade

# argv[1]: the commands (a JSON list of argument lists). Prints one JSON object: each command's exit
# code, stdout and stderr, then the greedy continuation of the export as transformers computes it.
DRIVER = """
import contextlib, io, json, sys
from rewind.tools.cpu_threads import prepare_threads
prepare_threads()  # as the entry point does, before torch is imported
from rewind.tools.cli import main
results = []
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:
            code = int(exc.code or 0)
    results.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
    if code != 0:
        break
tokens = None
if all(r["code"] == 0 for r in results):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("hf"); tokenizer = AutoTokenizer.from_pretrained("hf")
    ids = tokenizer("def main(", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    tokens = out[0, ids.shape[1]:].tolist()
    tokens = tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_token_id else tokens
print("RESULTS " + json.dumps({"commands": results, "transformers_tokens": tokens}))
"""


@pytest.mark.slow
def test_the_text_example_trains_samples_scores_and_exports(tmp_path):
    config = str(REPO / "examples/text.toml")
    commands = [
        ["train", config, "--run-dir", "run", "--no-progress", "--set", SHORT],
        ["sample", "run", "--prompt", "def main(", "--max-tokens", "8", "--temperature", "0", "--json"],
        ["eval", "run", "--dataset", "stdlib", "--json"],
        ["verify", "run", "--data"],
        ["export", "run", "--hf", "hf"],
    ]
    launched = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(commands)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert launched.returncode == 0, launched.stderr
    line = next(x for x in launched.stdout.splitlines() if x.startswith("RESULTS "))
    results = json.loads(line.removeprefix("RESULTS "))
    done, sampled, scored, verified, exported = results["commands"] + [None] * (5 - len(results["commands"]))

    assert done["code"] == 0, done["err"]
    assert "held-out text: bits per byte" in done["out"] and "answer-token accuracy" in done["out"]
    run = tmp_path / "run"
    assert (run / "data/tokenizer.json").is_file() and len(list(run.glob("data/stdlib-*/manifest.json"))) == 1

    from rewind.stores.runs import read_seq_events

    started = read_seq_events(str(run))[0][1]
    assert started.tokenizer and set(started.data) == {"stdlib"}
    corpus = started.data["stdlib"]
    assert len(corpus.sources) > 100 and all(f.sha256 for f in corpus.sources)  # the stdlib's *.py, hashed

    assert sampled["code"] == 0, sampled["err"]
    assert json.loads(sampled["out"])["step"] == 6
    assert scored["code"] == 0, scored["err"]
    figures = json.loads(scored["out"])
    assert 0 < figures["bits_per_byte"] < 8 and figures.get("accuracy") is None  # running text: no answers
    assert verified["code"] == 0, verified["out"] + verified["err"]
    assert exported["code"] == 0, exported["err"]
    # greedy: transformers continues the prompt as `rewind sample` did
    assert results["transformers_tokens"] == json.loads(sampled["out"])["tokens"]
