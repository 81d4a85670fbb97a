"""lm-evaluation-harness against the gateway: its `local-completions` model scores a small
multiple-choice task (a task YAML and a jsonl written here, nothing downloaded) through
/v1/completions with echo + logprobs, and gets the accuracy, and the loglikelihoods, that the
harness's own `hf` model gets on the same SmolLM2 weights (fp32, CPU)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tests.helpers.tiny_models import smollm2_path

QUESTIONS = [
    ("What is the capital of France?", ["Berlin", "Paris", "Madrid", "Rome"], 1),
    ("How many legs does a spider have?", ["six", "four", "eight", "ten"], 2),
    ("Which planet is known as the red planet?", ["Mars", "Venus", "Jupiter", "Saturn"], 0),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    ("What is 2 + 2?", ["3", "4", "5", "22"], 1),
    ("Which animal says moo?", ["a cat", "a dog", "a cow", "a duck"], 2),
]

TASK = """\
task: llmesh_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("lm-eval-task")
    data = root / "questions.jsonl"
    data.write_text(
        "".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS)
    )
    (root / "llmesh_mc.yaml").write_text(TASK.format(data=data))
    return root


def evaluate(model: str, model_args: dict, task_dir: pathlib.Path) -> tuple[float, list[float]]:
    """(accuracy, every choice's loglikelihood in order) of the task under `model`."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    out = simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=["llmesh_mc"],
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),  # not its 10k tasks
        batch_size=4,
        log_samples=True,
    )
    samples = sorted(out["samples"]["llmesh_mc"], key=lambda s: s["doc_id"])
    lls = [float(r[0][0]) for s in samples for r in s["resps"]]
    return out["results"]["llmesh_mc"]["acc,none"], lls


def test_local_completions_scores_as_the_hf_model(gateway_url, task_dir, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(task_dir / "cache"))
    path = smollm2_path()
    served = {
        "model": "SmolLM2-135M-Instruct",
        "base_url": f"{gateway_url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": path,
        "tokenized_requests": True,
        "num_concurrent": 1,
        "max_retries": 1,
    }
    acc, lls = evaluate("local-completions", served, task_dir)
    ref_acc, ref_lls = evaluate("hf", {"pretrained": path, "dtype": "float32", "device": "cpu"}, task_dir)
    assert len(lls) == len(ref_lls) == sum(len(c) for _, c, _ in QUESTIONS)
    assert lls == pytest.approx(ref_lls, abs=1e-3)
    assert acc == ref_acc
