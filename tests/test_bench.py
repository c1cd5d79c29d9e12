"""scripts/bench.py runs end to end on tiny sweeps and writes its tables and plots."""

import csv
import sys
from pathlib import Path

from conftest import REPO, run_py


def read_csv(path: Path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_methods_and_blocks_sweeps(tmp_path):
    bench = str(REPO / "scripts" / "bench.py")
    result = run_py([bench, "methods", "--seq", "96", "--repeats", "1", "--out", str(tmp_path), "--device", "cpu"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_csv(tmp_path / "methods_llama.csv")
    assert [r["method"] for r in rows] == ["vanilla", "checkpointing", "mini_sequence", "mini_sequence+checkpointing",
                                           "streaming", "mini_sequence+streaming"]
    losses = [float(r["first_loss"]) for r in rows]
    assert max(losses) - min(losses) < 1e-4 * losses[0]  # same model, same batch: same loss
    assert all(float(r["peak_MiB"]) > 0 and float(r["step_time_s"]) > 0 for r in rows)
    for name in ("methods_llama.md", "methods_llama_memory.png", "methods_llama_time.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "methods_llama_memory.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    result = run_py([bench, "blocks", "--seq", "1024", "--mini-sequences", "1", "4", "--repeats", "1",
                     "--out", str(tmp_path), "--device", "cpu"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_csv(tmp_path / "blocks.csv")
    assert {(r["block"], r["mini_sequences"]) for r in rows} == {("mlp", "1"), ("mlp", "4"), ("lm_head", "1"), ("lm_head", "4")}
    lm = {r["mini_sequences"]: float(r["peak_MiB"]) for r in rows if r["block"] == "lm_head"}
    assert lm["4"] < lm["1"]  # four mini-sequences never hold the whole logits


def test_streaming_sweep(tmp_path):
    """The StreamBP sweep on tiny sizes: every part's rows, same losses across settings (the streamed
    backward is exact, and the first loss is computed before any optimizer step), streaming below flag off."""
    bench = str(REPO / "scripts" / "bench.py")
    result = run_py([bench, "streaming", "--gemma2-seq", "512", "--activation-seq", "1024", "--chunk-seq", "512",
                     "--streaming-chunks", "100", "auto", "--repeats", "1", "--out", str(tmp_path), "--device", "cpu"])
    assert result.returncode == 0, result.stderr[-2000:]
    rows = read_csv(tmp_path / "streaming.csv")
    assert [(r["part"], r["dtype"], r["setting"]) for r in rows] == [
        ("gemma2", "float32", "flag off"), ("gemma2", "float32", "mini_sequence"),
        ("gemma2", "float32", "mini_sequence+streaming"),
        ("activation", "float32", "mini_sequence+checkpointing"), ("activation", "float32", "mini_sequence+streaming"),
        ("activation", "bfloat16", "mini_sequence+checkpointing"), ("activation", "bfloat16", "mini_sequence+streaming"),
        ("chunks", "float32", "mini_sequence+checkpointing"), ("chunks", "float32", "mini_sequence+streaming chunk=100"),
        ("chunks", "float32", "mini_sequence+streaming chunk=auto")]
    for part, dtype, tolerance in (("gemma2", "float32", 1e-5), ("activation", "float32", 1e-5),
                                   ("activation", "bfloat16", 1e-2), ("chunks", "float32", 1e-5)):
        losses = [float(r["first_loss"]) for r in rows if (r["part"], r["dtype"]) == (part, dtype)]
        assert max(losses) - min(losses) <= tolerance * losses[0], (part, dtype, losses)
    gemma2 = {r["setting"]: r for r in rows if r["part"] == "gemma2"}
    assert float(gemma2["mini_sequence+streaming"]["peak_vs_ref"]) < 1.0  # eager [heads, S, S] scores never all live
    assert all(float(r["activation_vs_ref"]) <= 1.0 for r in rows if r["part"] == "activation")
    assert all(float(r["step_time_s"]) > 0 for r in rows if r["part"] == "chunks")
    summary = (tmp_path / "streaming.md").read_text()
    assert "target <= 0.30" in summary and "target >= 0.8x" in summary and "target <= 0.5" in summary
    assert (tmp_path / "streaming_chunks_time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_arguments_exit_2(tmp_path):
    result = run_py([str(REPO / "scripts" / "bench.py"), "methods", "--seq", "1", "--out", str(tmp_path)])
    assert result.returncode == 2 and "--seq" in result.stderr
    result = run_py([str(REPO / "scripts" / "bench.py"), "streaming", "--streaming-chunks", "0", "--out", str(tmp_path)])
    assert result.returncode == 2 and "--streaming-chunks" in result.stderr
