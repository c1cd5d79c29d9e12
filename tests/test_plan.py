"""The max-sequence planner: its fake-tensor peak equals a real run's, its search and its errors."""

import json

import pytest
import transformers
from conftest import run_py
from transformers.mini_sequence import plan

TINY = dict(vocab_size=8000, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    transformers.LlamaConfig(**TINY).save_pretrained(path)
    return path / "config.json"


@pytest.mark.parametrize("method", list(plan.METHODS))
def test_fake_peak_equals_real_peak(method):
    planner = plan.Planner(transformers.LlamaConfig(**TINY), optimizer_in_backward=(method == "vanilla"))
    fake = planner.step_peak_bytes(method, 512)
    real = planner.step_peak_bytes(method, 512, fake=False)
    assert abs(fake - real) <= 0.02 * real, (fake, real)


def run_plan(*args):
    return run_py(["-m", "transformers.mini_sequence.plan", *args])


def test_json_search_and_monotonic(tiny_config):
    results = []
    for gib in ("0.2", "0.3"):
        out = run_plan("--model", str(tiny_config), "--gpu-memory-gib", gib, "--granularity", "256",
                       "--optimizer", "none", "--optimizer-in-backward", "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        results.append(json.loads(out.stdout))
    small, large = (r["max_seq_len"] for r in results)
    assert set(small) == set(plan.METHODS) and all(isinstance(v, int) and v % 256 == 0 for v in small.values())
    assert all(large[m] >= small[m] for m in plan.METHODS)
    assert small["mini_sequence+checkpointing"] >= small["checkpointing"] > 0
    assert small["mini_sequence"] > small["vanilla"] > 0
    budget = 0.2 * 2**30
    assert all(p is None or p * 2**30 <= budget * 1.01 for p in results[0]["peak_gib_at_max"].values())
    assert "FlashAttention-style" in results[0]["assumptions"]


def test_bad_inputs(tmp_path, tiny_config):
    out = run_plan("--model", "llama9-1t", "--gpu-memory-gib", "80")
    assert out.returncode == 2 and "llama3-8b" in out.stderr and "gemma2-9b" in out.stderr
    out = run_plan("--model", str(tmp_path / "nope.json"), "--gpu-memory-gib", "80")
    assert out.returncode == 2 and "nor an existing config.json path" in out.stderr
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    out = run_plan("--model", str(tmp_path / "gpt2" / "config.json"), "--gpu-memory-gib", "80")
    assert out.returncode == 2 and "'gpt2' is not supported" in out.stderr
    out = run_plan("--model", str(tiny_config), "--gpu-memory-gib", "0.01")
    assert out.returncode == 2 and "cannot hold even the weights" in out.stderr
    out = run_plan("--model", "llama3-8b", "--gpu-memory-gib", "16")
    assert out.returncode == 2 and "8.03B parameters" in out.stderr
