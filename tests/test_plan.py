"""The max-sequence planner: its fake-tensor peak equals a real run's, its search and its errors."""

import json
import random

import pytest
import torch
import transformers
from conftest import run_py
from transformers.mini_sequence import LiveTensorTracker, plan

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


def test_config_dtype_does_not_change_the_plan():
    """A config.json naming float32 is still planned in bf16 (weights and activations)."""
    fp32 = plan.Planner(transformers.LlamaConfig(**TINY, dtype="float32"))
    default = plan.Planner(transformers.LlamaConfig(**TINY))
    assert fp32.step_peak_bytes("vanilla", 256) == default.step_peak_bytes("vanilla", 256)


def test_standin_attention_equals_real_sdpa():
    """The planner's flash-style stand-in (fake tensors) against upstream's SDPA attention run for
    real on the CPU (flash CPU kernel, enable_gqa): same step peak, every method, with GQA."""
    config = transformers.LlamaConfig(**TINY, num_key_value_heads=2)
    planner = plan.Planner(config)
    for method, (chunk, checkpointing) in plan.METHODS.items():
        model_config = transformers.LlamaConfig(**TINY, num_key_value_heads=2, mini_sequence_chunk=chunk,
                                                    use_cache=False)
        model_config._attn_implementation = "sdpa"
        model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.bfloat16).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        ids = torch.randint(0, TINY["vocab_size"], (1, 512))
        with LiveTensorTracker(keep_largest=0) as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        fake = planner.step_peak_bytes(method, 512)
        assert abs(fake - tracker.peak_bytes) <= 0.02 * tracker.peak_bytes, (method, fake, tracker.peak_bytes)


@pytest.mark.parametrize("granularity", [256, 1024])
def test_search_is_exact_on_piecewise_linear_peaks(granularity):
    """The secant search returns what a scan over every multiple would, in few evaluations."""
    rng = random.Random(granularity)
    for _ in range(300):
        kink = rng.randint(1, 100) * granularity
        base, slope1 = rng.uniform(0, 50), rng.uniform(1e-3, 1)
        slope2 = slope1 * rng.uniform(1, 3)
        peak_fn = lambda s: base + slope1 * min(s, kink) + slope2 * max(0, s - kink)  # noqa: E731
        budget, limit = rng.uniform(0, 200), rng.choice([1 << 22, 64 * granularity])
        calls = set()
        got = plan.search_max_fitting(lambda s: calls.add(s) or peak_fn(s), budget, granularity, limit)
        want, s = 0, granularity
        while s <= limit and peak_fn(s) <= budget:
            want, s = s, s + granularity
        assert got == want and len(calls) <= 12, (got, want, len(calls))


def run_main(capsys, *args):
    """`plan.main(args)` in-process (a subprocess per call would spend seconds importing): exit code, stdout, stderr."""
    try:
        plan.main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_output(capsys, tiny_config):
    code, out, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "0.12", "--granularity", "256",
                              "--optimizer", "none", "--optimizer-in-backward", "--json")
    assert code == 0, err[-2000:]
    result = json.loads(out)
    max_s, peaks = result["max_seq_len"], result["peak_gib_at_max"]
    assert set(max_s) == set(peaks) == set(plan.METHODS)
    assert all(isinstance(v, int) and v > 0 and v % 256 == 0 for v in max_s.values())
    assert max_s["mini_sequence+checkpointing"] > max_s["checkpointing"]
    assert max_s["mini_sequence"] > max_s["vanilla"]
    assert all(p <= 0.12 for p in peaks.values())
    assert "FlashAttention-style" in result["assumptions"] and "fragmentation" in result["assumptions"]


def test_max_seq_len_monotonic_in_memory():
    planner = plan.Planner(transformers.LlamaConfig(**TINY), optimizer="none", optimizer_in_backward=True)
    found = [{m: planner.max_seq_len(m, int(gib * 2**30), 256) for m in plan.METHODS} for gib in (0.06, 0.09, 0.12)]
    for smaller, larger in zip(found, found[1:]):
        assert all(larger[m] >= smaller[m] for m in plan.METHODS), found
    for result in found:
        assert result["mini_sequence+checkpointing"] >= result["checkpointing"] > 0, found


def test_table_output(capsys, tiny_config):
    code, out, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "0.12", "--granularity", "512",
                              "--optimizer", "none")
    assert code == 0, err[-2000:]
    assert "max seq len" in out and "mini_sequence+checkpointing" in out and "Left out" in out


def test_bad_inputs(capsys, tmp_path, tiny_config):
    # The real command line once: exit code 2, message on stderr, naming the built-in models.
    out = run_py(["-m", "transformers.mini_sequence.plan", "--model", "llama9-1t", "--gpu-memory-gib", "80"])
    assert out.returncode == 2 and "llama3-8b" in out.stderr and "gemma2-9b" in out.stderr and not out.stdout
    code, _, err = run_main(capsys, "--model", str(tmp_path / "nope.json"), "--gpu-memory-gib", "80")
    assert code == 2 and "nor an existing config.json path" in err
    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path / "gpt2")
    code, _, err = run_main(capsys, "--model", str(tmp_path / "gpt2" / "config.json"), "--gpu-memory-gib", "80")
    assert code == 2 and "'gpt2' is not supported" in err
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    code, _, err = run_main(capsys, "--model", str(tmp_path / "broken" / "config.json"), "--gpu-memory-gib", "80")
    assert code == 2 and "cannot read a config.json" in err
    code, _, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "0")
    assert code == 2 and "must be positive" in err
    code, _, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "0.01")
    assert code == 2 and "cannot hold even the weights" in err
    # Weights fit (about 0.012 GiB with --optimizer none), but not one 512-token step.
    code, _, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "0.02", "--optimizer", "none",
                            "--optimizer-in-backward", "--granularity", "512")
    assert code == 2 and "no method fits even 512 tokens" in err
    code, _, err = run_main(capsys, "--model", str(tiny_config), "--gpu-memory-gib", "80", "--granularity", "0")
    assert code == 2 and "--granularity must be" in err
    code, _, err = run_main(capsys, "--model", "llama3-8b", "--gpu-memory-gib", "16")
    assert code == 2 and "8.03B parameters" in err
