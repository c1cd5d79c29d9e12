"""scripts/cuda_check.py and scripts/cuda_session.sh stay runnable where there is no GPU: a CPU smoke run of the
checks a GPU session runs (exactness, the bf16 MLP, streaming's error, training steps, the planner's estimates)."""

import json
import os
import subprocess
import sys

from conftest import REPO, run_py

CUDA_CHECK = str(REPO / "scripts" / "cuda_check.py")


def test_cuda_check_runs_on_cpu(tmp_path):
    result = run_py([CUDA_CHECK, "--model", "tiny", "--seq", "256", "--repeats", "1", "--methods", "checkpointing",
                     "mini_sequence+checkpointing", "streaming", "--streaming-chunk", "64", "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "cuda_check_256.json").read_text())
    assert report["streaming_chunk"] == 64 and report["head"] == "auto"
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
    env = dict(os.environ, OUT=str(tmp_path / "out"), SITE_DIR=str(tmp_path), MODEL="tiny", PARTS="steps_old",
               SEQS="128",
               OLD=str(wheels[0]), NEW=str(wheels[0]), PYTHON=sys.executable, PLAN=str(tmp_path / "no_plan.json"))
    result = subprocess.run(["bash", str(REPO / "scripts" / "cuda_ab.sh")], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all((tmp_path / f"mst_ab_{side}" / "transformers" / "__init__.py").is_file() for side in ("old", "new"))
    assert "=== steps_old: exit 0" in result.stdout, result.stdout + (tmp_path / "out" / "steps_old.txt").read_text()
    report = json.loads((tmp_path / "out" / "steps_old" / "cuda_check_128.json").read_text())
    assert report["transformers"] == wheels[0].name.split("-")[1]
    assert [row["method"] for row in report["steps"]] == ["checkpointing", "mini_sequence+checkpointing"]
