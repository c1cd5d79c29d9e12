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
    assert [r["method"] for r in rows] == ["vanilla", "checkpointing", "mini_sequence", "mini_sequence+checkpointing"]
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


def test_bad_arguments_exit_2(tmp_path):
    result = run_py([str(REPO / "scripts" / "bench.py"), "methods", "--seq", "1", "--out", str(tmp_path)])
    assert result.returncode == 2 and "--seq" in result.stderr
