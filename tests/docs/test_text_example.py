"""examples/text.toml, as the README runs it, on a shortened budget: the corpus found and tokenised, a
tokenizer trained, the run recorded, sampled, scored and exported to a model transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.docs.readme_figures import REPO

SHORT = "training.tokens=[16384,8192]"  # 16 + 8 steps of the example's 1,024 tokens


def rewind(cwd, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rewind.tools.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_text_example_trains_samples_scores_and_exports(tmp_path):
    config = str(REPO / "examples/text.toml")
    done = rewind(tmp_path, "train", config, "--run-dir", "run", "--no-progress", "--set", SHORT)
    assert done.returncode == 0, done.stderr
    assert "held-out text: bits per byte" in done.stdout and "answer-token accuracy" in done.stdout
    run = tmp_path / "run"
    assert (run / "data/tokenizer.json").is_file() and len(list(run.glob("data/stdlib-*/manifest.json"))) == 1

    from rewind.stores.runs import read_seq_events

    started = read_seq_events(str(run))[0][1]
    assert started.tokenizer and set(started.data) == {"stdlib"}
    corpus = started.data["stdlib"]
    assert len(corpus.sources) > 100 and all(f.sha256 for f in corpus.sources)  # the stdlib's *.py, hashed

    sampled = rewind(tmp_path, "sample", "run", "--prompt", "def main(", "--max-tokens", "8", "--temperature", "0", "--json")
    assert sampled.returncode == 0, sampled.stderr
    assert json.loads(sampled.stdout)["step"] == 24
    scored = rewind(tmp_path, "eval", "run", "--dataset", "stdlib", "--json")
    assert scored.returncode == 0, scored.stderr
    figures = json.loads(scored.stdout)
    assert 0 < figures["bits_per_byte"] < 8 and figures.get("accuracy") is None  # running text: no answers
    assert rewind(tmp_path, "verify", "run", "--data").returncode == 0

    exported = rewind(tmp_path, "export", "run", "--hf", "hf")
    assert exported.returncode == 0, exported.stderr
    check = (
        "import sys, json\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained('hf'); tokenizer = AutoTokenizer.from_pretrained('hf')\n"
        "ids = tokenizer('def main(', return_tensors='pt').input_ids\n"
        "out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.eos_token_id)\n"
        "tokens = out[0, ids.shape[1]:].tolist()\n"
        "print(json.dumps(tokens[:-1] if tokens and tokens[-1] == tokenizer.eos_token_id else tokens))\n"
    )
    loaded = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout) == json.loads(sampled.stdout)["tokens"]  # greedy: the same continuation
