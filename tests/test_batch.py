"""`lmserve batch`: datasets in LLaMA-Factory's formats -> generated_predictions.jsonl on Ray Data."""

import json
import subprocess
import sys

import pytest

from deployments.batch import DatasetError, read_dataset

LMSERVE = [sys.executable, "-m", "deployments.cli"]
ALPACA = [{"instruction": "What is the capital of France?", "input": "", "output": "Paris"},
          {"instruction": "Translate to French:", "input": "cat", "output": "chat", "system": "Be brief.",
           "history": [["Hi", "Hello!"]]},
          {"instruction": "What is 2+2?", "output": "4"}]
SHAREGPT = [{"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}], "system": "S"},
            {"messages": [{"role": "user", "content": "Name a colour."}]}]


def test_alpaca_rows(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ALPACA))
    examples = read_dataset(str(path))
    assert examples[0] == {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                           "label": "Paris"}
    assert examples[1]["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                       {"role": "assistant", "content": "Hello!"},
                                       {"role": "user", "content": "Translate to French:\ncat"}]


def test_sharegpt_jsonl(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in SHAREGPT) + "\n")
    examples = read_dataset(str(path))
    assert examples[0] == {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
                           "label": "Hello!"}
    assert examples[1] == {"messages": [{"role": "user", "content": "Name a colour."}], "label": ""}


def test_bad_datasets_name_file_and_row(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"instruction": "x"}, {"foo": 1}]))
    with pytest.raises(DatasetError, match=r"bad.json: row 1 is neither alpaca"):
        read_dataset(str(path))
    path.write_text("{not json")
    with pytest.raises(DatasetError, match="not JSON"):
        read_dataset(str(path))


@pytest.mark.slow
def test_batch_generates_resumes_and_refuses(tmp_path, model_dir):
    data, config, out = tmp_path / "data.json", tmp_path / "infer.yaml", tmp_path / "generated_predictions.jsonl"
    data.write_text(json.dumps(ALPACA))
    config.write_text("model_name_or_path: smollm2\n")
    cmd = LMSERVE + ["batch", str(config), "do_sample=false", "max_new_tokens=16", "--dataset", str(data),
                     "--output", str(out), "--num-cpus", "1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["label"] for line in lines] == ["Paris", "chat", "4"]  # dataset order
    assert "Paris" in lines[0]["predict"] and "What is the capital of France?" in lines[0]["prompt"]

    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    out.write_text("\n".join(json.dumps(line) for line in lines[:1]) + "\n")  # as if interrupted
    subprocess.run(cmd + ["--resume"], check=True, capture_output=True, timeout=600)
    assert [json.loads(line) for line in out.read_text().splitlines()] == lines
