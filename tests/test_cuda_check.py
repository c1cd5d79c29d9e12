"""scripts/cuda_check.py and scripts/cuda_session.sh stay runnable where there is no GPU: a CPU smoke run of the
checks a GPU session runs (exactness, the bf16 MLP, streaming's error, training steps, the planner's estimates)."""

import json
import os
import subprocess
import sys

import torch
import transformers
from conftest import REPO, run_py

CUDA_CHECK = str(REPO / "scripts" / "cuda_check.py")


def test_cuda_check_runs_on_cpu(tmp_path):
    result = run_py([CUDA_CHECK, "--model", "tiny", "--seq", "256", "--repeats", "1", "--methods", "checkpointing",
                     "mini_sequence+checkpointing", "streaming", "--streaming-chunk", "64", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "cuda_check_256.json").read_text())
    assert report["streaming_chunk"] == 64 and report["head"] == "auto" and report["overrides"] == {}
    assert report["exactness"] and all(
        row["loss_rel_err"] <= 1e-5 and row["max_grad_rel_err"] <= 1e-5 and not row["missing_grads"]
        for row in report["exactness"].values()
    )
    assert report["mlp_bf16"] and all(row["ok"] for row in report["mlp_bf16"].values())
    assert report["streaming"] and all(row["ok"] for row in report["streaming"].values())
    steps = report["steps"]
    assert [row["method"] for row in steps] == ["checkpointing", "mini_sequence+checkpointing", "streaming"]
    assert all(row["planner_peak_bytes"] > 0 and row["step_seconds"] > 0 for row in steps)
    losses = [row["first_loss"] for row in steps]
    assert max(losses) - min(losses) < 1e-4 * losses[0]  # same model and batch, first step before any update


def test_policy_overrides_change_what_auto_means(monkeypatch):
    """scripts/policy_overrides.py (a GPU A/B of chunk policies with one build): each override changes what the
    model runs, not only a recorded number."""
    import argparse

    from torch.utils._python_dispatch import TorchDispatchMode

    from transformers.mini_sequence import config, fused_loss, integration, lm_head_chunk_size, loss

    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import policy_overrides

    for module, name in ((integration, "mlp_chunk_size"), (config, "AUTO_MIN_LM_HEAD_TOKENS"),
                         (loss, "_ROW_BLOCKS_PER_CHUNK"), (loss, "_vocab_sliced_backward_pays")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    monkeypatch.setattr(fused_loss, "DEVICES", set(fused_loss.DEVICES))

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mini_sequence_chunk="auto"))
    rows_seen = []
    model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda module, args, out: rows_seen.append(args[0].shape[1]))
    ids = torch.randint(0, 1000, (1, 200), generator=torch.Generator().manual_seed(0))

    def mlp_chunks():
        rows_seen.clear()
        with torch.no_grad():
            model(input_ids=ids)
        return rows_seen[:]

    class CountLogSoftmax(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountLogSoftmax.calls += func is torch.ops.aten._log_softmax.default
            return func(*args, **(kwargs or {}))

    def loss_blocks():
        CountLogSoftmax.calls = 0
        with CountLogSoftmax():
            loss._CrossEntropySum.apply(torch.randn(48, 10), torch.randint(0, 10, (48,)), -100)
        return CountLogSoftmax.calls

    head = torch.nn.Linear(8, 100, bias=False).bfloat16()

    def sliced_head():  # the rule mini_sequence_causal_lm_loss asks (10 tokens, 100 vocabulary rows, bf16)
        return loss._vocab_sliced_backward_pays(head, torch.randn(10, 8).bfloat16(), [head.weight], 100)

    assert mlp_chunks() == [64, 64, 64, 8] and lm_head_chunk_size("auto", 64, 1000, 200) == 1024
    assert loss_blocks() == 8 and sliced_head()
    parser = argparse.ArgumentParser()
    policy_overrides.add_arguments(parser)
    assert policy_overrides.apply(parser.parse_args([])) == {}
    args = parser.parse_args(["--mlp-chunk", "90", "--lm-head-min-tokens", "64", "--row-blocks", "3", "--head",
                              "accumulating", "--fused-loss", "off"])
    fused_loss.DEVICES.add("cpu")  # as on CUDA: the loss's compiled kernels, until --fused-loss off
    assert fused_loss.applies(torch.randn(4, 10))
    assert policy_overrides.apply(args) == {"mlp_chunk": 90, "lm_head_min_tokens": 64, "row_blocks": 3,
                                            "fused_loss": "off", "head": "accumulating"}
    assert mlp_chunks() == [90, 90, 20] and lm_head_chunk_size("auto", 64, 1000, 200) == 64
    assert loss_blocks() == 3 and not sliced_head()
    # an int field is the user's choice: not overridden
    model.config.mini_sequence_chunk = 50
    assert mlp_chunks() == [50, 50, 50, 50]


def _host_cost_rows(stdout):
    """{case: (ms, launches)} of mlp_host_cost.py's table."""
    rows = {}
    for line in stdout.splitlines()[1:]:
        fields = line[40:].split()
        rows[line[:40].strip()] = (float(fields[0]), int(fields[2]))
    return rows


def test_mlp_host_cost_runs():
    result = run_py([str(REPO / "scripts" / "mlp_host_cost.py"), "--tokens", "64", "--chunks", "2", "4",
                     "--repeats", "4"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _host_cost_rows(result.stdout)
    assert list(rows) == ["mini-sequence Function, 2 chunks", "mini-sequence Function, 4 chunks",
                          "checkpointed, unsplit", "plain, unsplit"], result.stdout
    assert all(ms > 0 and count > 0 for ms, count in rows.values()), result.stdout
    # more chunks, more launches: each chunk's forward and backward run op by op
    assert rows["mini-sequence Function, 4 chunks"][1] > rows["mini-sequence Function, 2 chunks"][1], result.stdout


def test_mlp_host_cost_times_compiled_chunk_bodies():
    script = str(REPO / "scripts" / "mlp_host_cost.py")
    result = run_py([script, "--tokens", "64", "--chunks", "2", "--repeats", "4", "--dtype", "float32", "--compiled"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = _host_cost_rows(result.stdout)
    assert list(rows) == ["mini-sequence Function, 2 chunks", "compiled chunk bodies, 2 chunks",
                          "checkpointed, unsplit", "plain, unsplit"], result.stdout
    # inductor's fused kernels are counted: fewer launches than the chunks' aten operators, but not none
    assert 0 < rows["compiled chunk bodies, 2 chunks"][1] < rows["mini-sequence Function, 2 chunks"][1], result.stdout
    refused = run_py([script, "--compiled"])
    assert refused.returncode == 2 and "--dtype float32" in refused.stderr


def test_mlp_host_cost_counts_generated_kernels(monkeypatch):
    """A compiled function of one fused elementwise kernel: one launch, which the dispatcher never sees."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    import torch._inductor.config as inductor_config
    import mlp_host_cost

    monkeypatch.setattr(inductor_config.cpp, "enable_kernel_profile", True)
    fused = torch.compile(lambda t: (t.sin() * 2).cos(), fullgraph=True)
    t = torch.randn(100)
    fused(t)
    assert mlp_host_cost.launches(lambda: fused(t)) == 1


def test_cuda_check_refuses_a_bad_streaming_chunk(tmp_path):
    result = run_py([CUDA_CHECK, "--model", "tiny", "--streaming-chunk", "0", "--out", str(tmp_path)])
    assert result.returncode == 2
    assert "'0': allowed \"auto\" or a positive int" in result.stderr


def test_cuda_session_runs_only_the_parts_asked_for(tmp_path):
    """PARTS splits the session over device calls: a part not named is skipped, a named one runs."""
    env = dict(os.environ, OUT=str(tmp_path), MODEL="tiny", PARTS="lm_head_bf16_d4096",
               PYTHON=sys.executable)
    result = subprocess.run(["bash", str(REPO / "scripts" / "cuda_session.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    started = [line.split()[3].rstrip(":") for line in result.stdout.splitlines() if line.startswith("=== [")]
    assert started == ["lm_head_bf16_d4096"], result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lm_head_bf16_d4096.txt"]


def test_cuda_ab_imports_the_build_it_names(tmp_path):
    """scripts/cuda_ab.sh installs each wheel apart and runs a part with that build on its path (the wheel `make test`
    built stands for both sides here, so the version alone cannot tell them apart; on a GPU they are two commits'
    wheels)."""
    wheels = sorted((REPO / "dist").glob("transformers-*.whl"))
    assert len(wheels) == 1, f"expected the one wheel `make wheel` builds in dist/, found {wheels}"
    env = dict(os.environ, OUT=str(tmp_path / "out"), SITE_DIR=str(tmp_path), MODEL="tiny",
               PARTS="steps_old policy_mlp_chunk_4096",
               SEQS="128", SHORT_SEQS="",
               OLD=str(wheels[0]), NEW=str(wheels[0]), PYTHON=sys.executable, PLAN=str(tmp_path / "no_plan.json"))
    result = subprocess.run(["bash", str(REPO / "scripts" / "cuda_ab.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all((tmp_path / f"mst_ab_{side}" / "transformers" / "__init__.py").is_file() for side in ("old", "new"))
    assert "=== steps_old: exit 0" in result.stdout, result.stdout + (tmp_path / "out" / "steps_old.txt").read_text()
    report = json.loads((tmp_path / "out" / "steps_old" / "cuda_check_128.json").read_text())
    assert report["transformers"] == wheels[0].name.split("-")[1]
    assert [row["method"] for row in report["steps"]] == ["checkpointing", "mini_sequence+checkpointing"]
    # a policy part: the new build under an override, recorded in its report
    assert "=== policy_mlp_chunk_4096: exit 0" in result.stdout, result.stdout
    report = json.loads((tmp_path / "out" / "policy_mlp_chunk_4096" / "cuda_check_128.json").read_text())
    assert report["overrides"] == {"mlp_chunk": 4096}
    assert [row["method"] for row in report["steps"]] == ["mini_sequence+checkpointing"]


def test_hybrid_cuda_exactness_runs_on_cpu(tmp_path):
    """scripts/hybrid_cuda.py's part 1 (the hybrids' exactness on a GPU), narrower, on the CPU with upstream's
    reference scans: the streamed fp32 step against the unsplit one, bf16 as upstream's, no gradient missing."""
    out = tmp_path / "hybrid.json"
    result = run_py([str(REPO / "scripts" / "hybrid_cuda.py"), "--exactness", "--exactness-seq", "260", "--hidden",
                     "128", "--json", str(out)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["kernels"]["fla"] is None
    assert set(report["exactness"]) == {"qwen3_5_text", "kimi_linear"}
    for name, rows in report["exactness"].items():
        assert not any(row["parameters_without_gradient"] for row in rows.values()), name
        assert rows["ours_fp32"]["loss_relative_error"] < 1e-6 and rows["ours_fp32"]["gradient_error"] < 5e-4, name
        assert rows["ours_bf16"]["gradient_error"] < 1.5 * rows["upstream_bf16"]["gradient_error"], name


def test_chunk_attention_cuda_runs_on_cpu(tmp_path):
    """scripts/chunk_attention_cuda.py (the streamed chunks' attention kernels on a GPU), small, on the CPU: the
    three ways of attending are timed; the GPU-only backends are recorded as errors, not raised."""
    out = tmp_path / "attention.json"
    result = run_py([str(REPO / "scripts" / "chunk_attention_cuda.py"), "--seq", "256", "--chunk", "64", "--json",
                     str(out)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert {"unsplit", "chunks_lower_right", "chunks_split"} <= set(report["ms"]), report
    assert "unsplit[CUDNN_ATTENTION]" in report["errors"], report
