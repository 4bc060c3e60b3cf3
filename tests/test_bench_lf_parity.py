"""`python -m bench.lab.lf_parity`: the YAML both servers get, how answers are compared and the
table it prints (the run itself serves real models: a benchmark, not a test)."""

import argparse
import json
from pathlib import Path

import pytest
import yaml

from bench.lab.lf_parity import (PROMPTS, Answer, Run, compare_prompt_ids, inference_yaml, lf_conversations,
                                 lmserve_prompt_ids, load_runs, logged_errors, make_adapter, records, same_answer,
                                 table)
from engines.config import load_config_file

pytestmark = pytest.mark.bench  # a lab probe's test: run with --run-bench


def test_the_yaml_is_llamafactorys_greedy_float32_inference_config(tmp_path):
    model, adapter = tmp_path / "model", tmp_path / "lora"
    config = inference_yaml(model, "alpaca", adapter)
    assert config == {"model_name_or_path": str(model), "template": "alpaca", "adapter_name_or_path": str(adapter),
                      "infer_backend": "huggingface", "infer_dtype": "float32", "do_sample": False}
    assert "adapter_name_or_path" not in inference_yaml(model, "alpaca", None)
    path = tmp_path / "alpaca-lora.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    loaded = load_config_file(str(path))  # lmserve reads the very file LLaMA-Factory is given
    assert (loaded.template, loaded.infer_dtype, loaded.do_sample) == ("alpaca", "float32", False)
    assert loaded.adapter_name_or_path in (str(adapter), [str(adapter)])


def test_answers_are_the_same_only_when_both_answered_alike():
    assert same_answer(Answer("Paris.", "stop"), Answer("Paris.", "stop"))
    assert not same_answer(Answer("Paris.", "stop"), Answer("Paris.", "length"))
    assert not same_answer(Answer("Paris.", "stop"), Answer("Paris", "stop"))
    assert not same_answer(Answer(error="HTTP 500: x"), Answer(error="HTTP 500: x"))  # two failures are no parity


def _run(template: str, adapter: bool, same: int, lmserve_error: str | None = None) -> Run:
    lf = [Answer(f"answer {i}", "stop") for i in range(len(PROMPTS))]
    lm = [Answer(error=lmserve_error) if lmserve_error else Answer(a.text if i < same else "other", "stop")
          for i, a in enumerate(lf)]
    return Run(template, adapter, lf, lm, prompt_ids={"identical": same, "prompts": len(PROMPTS)})


def test_table_counts_identical_answers_per_template_and_adapter():
    runs = [_run("smollm2", False, 10), _run("smollm2", True, 7),
            _run("llama3", False, 0, lmserve_error="server did not start"), _run("alpaca", True, 9)]
    assert runs[1].identical == 7
    runs[1].llamafactory[0] = Answer("changed by the adapter", "stop")
    assert table(runs).splitlines() == [
        "| template | no adapter | LoRA adapter | answers the adapter changed | same prompt ids |",
        "|---|---|---|---|---|",
        "| `smollm2` | 10/10 | 6/10 | 1/10 | 10/10 |",
        "| `llama3` | 0/10 (lmserve: no answer) | - | - | 0/10 |",
        "| `alpaca` | - | 9/10 | - | 9/10 |",
    ]
    opts = argparse.Namespace(max_tokens=48)
    saved = json.loads(json.dumps(records(runs, opts, Path("/models/SmolLM2-135M-Instruct"))))
    assert table(load_runs(saved)) == table(runs)  # --report rebuilds the table from the results file


def test_prompts_reach_llamafactory_as_its_api_splits_them():
    conversations = lf_conversations()
    assert len(conversations) == len(PROMPTS) == 10
    system = next(c for p, c in zip(PROMPTS, conversations) if p["name"] == "system")
    assert system["system"] == "You are a pirate. Answer in one sentence."
    assert [m["role"] for m in system["messages"]] == ["user"]
    for conv in conversations:  # LLaMA-Factory's API refuses anything but u/a/u/.../u
        assert [m["role"] for m in conv["messages"]] == ["user", "assistant"] * (len(conv["messages"]) // 2) + ["user"]


def test_prompt_id_comparison_names_the_prompts_that_differ_and_either_side_s_refusal():
    lf = {"prompts": [[1, 2]] * len(PROMPTS), "stop_token_ids": [2], "added_tokens": ["<|eot_id|>"]}
    lm = {"prompts": [[1, 2]] * (len(PROMPTS) - 1) + [[1, 3]], "stop_token_ids": [2]}
    out = compare_prompt_ids(lf, lm)
    assert out["identical"] == len(PROMPTS) - 1
    assert out["differing"] == {PROMPTS[-1]["name"]: {"llamafactory": [1, 2], "lmserve": [1, 3]}}
    assert out["llamafactory_added_tokens"] == ["<|eot_id|>"]
    refused = compare_prompt_ids(lf, {"error": "TemplateError: no <|eot_id|>"})
    assert refused["lmserve_error"] == "TemplateError: no <|eot_id|>" and "identical" not in refused


def test_logged_errors_are_the_distinct_exception_lines_of_a_server_log(tmp_path):
    log = tmp_path / "llama3-llamafactory.log"
    log.write_text('INFO: "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error\n'
                   "Traceback (most recent call last):\n  File \"x.py\", line 1, in forward\n"
                   "IndexError: index out of range in self\n"
                   "[WARNING] New tokens have been added, make sure `resize_vocab` is True.\n"
                   "IndexError: index out of range in self\n"
                   "ValueError: second\n")
    assert logged_errors(log) == ["IndexError: index out of range in self", "ValueError: second"]
    assert logged_errors(tmp_path / "missing.log") == []


@pytest.mark.slow  # loads the real model and tokenizer
def test_adapter_is_made_once_with_nonzero_lora_b_and_lmserve_renders_as_the_run_compares(model_dir, tmp_path):
    from safetensors.torch import load_file

    adapter = make_adapter(model_dir, tmp_path / "lora")
    weights = load_file(adapter / "adapter_model.safetensors")
    lora_b = [w for name, w in weights.items() if "lora_B" in name]
    assert lora_b and all(w.abs().max() > 0 for w in lora_b)  # peft's zero init would change nothing
    made = (adapter / "adapter_model.safetensors").stat().st_mtime_ns
    assert make_adapter(model_dir, adapter) == adapter
    assert (adapter / "adapter_model.safetensors").stat().st_mtime_ns == made  # reused, not made again

    rendered = lmserve_prompt_ids(model_dir, "smollm2")
    assert len(rendered["prompts"]) == len(PROMPTS) and rendered["stop_token_ids"] == [2]  # <|im_end|>
    assert "<|eot_id|>" in lmserve_prompt_ids(model_dir, "llama3")["error"]  # refused, as at start-up
