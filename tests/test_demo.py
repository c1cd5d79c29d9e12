"""scripts/demo.py end to end on tiny settings, and its argument checks."""

import re
import subprocess

import pytest

from conftest import REPO
from conftest import run_py as _run_py

DEMO = str(REPO / "scripts" / "demo.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_py(args):
    # One intra-op thread: these steps are tiny, and on a shared 2-core machine OpenMP threads
    # waiting on each other make them many times slower.
    return _run_py(args, env_extra={"OMP_NUM_THREADS": "1"})


def step_losses(stdout, runs=3):
    """(loss flags off, loss of each other run) per line of the per-step table."""
    rows = [ln.split() for ln in stdout.splitlines() if re.match(r"^\s*\d+\s+\d", ln)]
    return [(float(row[1]), [float(x) for x in row[2:1 + runs]]) for row in rows]


def test_demo_runs_and_losses_agree(tmp_path):
    plot = tmp_path / "out" / "demo.png"
    cache = tmp_path / "cache"
    args = [DEMO, "--seq-len", "256", "--steps", "2", "--vocab-size", "300", "--max-chars", "100000",
            "--chunk", "64", "--cache-dir", str(cache), "--plot", str(plot), "--device", "cpu"]
    result = run_py(args)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    losses = step_losses(result.stdout)
    assert len(losses) == 2
    # flags off, mini_sequence_chunk=64, and both flags (--streaming-chunk "auto" by default): same losses
    assert all(len(on) == 2 and all(abs(off - x) <= 1e-4 * abs(off) for x in on) for off, on in losses), losses
    assert "OK" in result.stdout and "peak ratio chunk=64/off" in result.stdout
    assert "peak ratio chunk=64 + streaming/off" in result.stdout
    assert "training a 300-token" in result.stdout
    assert plot.read_bytes()[:8] == PNG_MAGIC
    assert len(list(cache.glob("bpe-v300-*.json"))) == 1  # the tokenizer is cached ...

    # Second run, same text: the cached tokenizer is reused; 100K characters are too few tokens -> exit 2.
    short = run_py([*args[:2], "100000", *args[3:]])
    assert short.returncode == 2, short.stdout + short.stderr[-2000:]
    assert "tokenizer: cached" in short.stdout and "raise --max-chars" in short.stderr


def test_demo_bad_arguments_exit_2(tmp_path, capsys):
    import demo  # scripts/ is on sys.path (conftest)

    bad_args = (["--seq-len", "1"], ["--steps", "0"], ["--chunk", "0"], ["--chunk", "-3"], ["--chunk", "x"],
                ["--chunk", "2.5"], ["--chunk", "True"], ["--streaming-chunk", "0"], ["--streaming-chunk", "none"],
                ["--streaming-chunk", "-4"], ["--hidden-size", "100"], ["--model", str(tmp_path / "missing")])
    for bad in bad_args:
        with pytest.raises(SystemExit) as exc:
            demo.parse_args([*bad, "--cache-dir", str(tmp_path)])
        assert exc.value.code == 2, bad
        assert "error:" in capsys.readouterr().err
    assert demo.parse_args(["--cache-dir", str(tmp_path)]).streaming_chunk == "auto"
    assert demo.parse_args(["--streaming-chunk", "off", "--cache-dir", str(tmp_path)]).streaming_chunk is None
    assert demo.parse_args(["--streaming-chunk", "96", "--cache-dir", str(tmp_path)]).streaming_chunk == 96
    # End to end: the process exits 2 with a message naming the option, before loading data.
    result = run_py([DEMO, "--model", str(tmp_path / "missing"), "--cache-dir", str(tmp_path / "c"),
                     "--plot", str(tmp_path / "p.png")])
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "error: --model" in result.stderr and "does not exist" in result.stderr
    assert "tokenizer" not in result.stdout and "model:" not in result.stdout
    assert not list(tmp_path.iterdir())  # nothing written


def git(*args):
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True)


def test_run_outputs_default_to_an_ignored_folder():
    """`make demo` / `make bench` must leave a fresh clone clean: by default they write under the
    ignored out/, and only OUT=docs (or an explicit --plot / --out) writes the committed docs/."""
    import bench
    import demo

    defaults = {"demo": demo.parse_args([]).plot, "bench": bench.build_parser().parse_args(["methods"]).out}
    for name, path in defaults.items():
        relative = path.relative_to(REPO)
        assert relative.parts[0] == "out", (name, path)
        # Ignored by git (check-ignore exits 0 for an ignored path, 1 otherwise).
        assert git("check-ignore", "-q", str(relative)).returncode == 0, (name, relative)
    # The committed results are tracked, and not ignored: they are what OUT=docs writes.
    assert git("ls-files", "--error-unmatch", "docs/demo.png", "docs/bench/blocks.csv").returncode == 0
    assert git("check-ignore", "-q", "docs/demo.png").returncode == 1

    def make_commands(*extra):
        dry = subprocess.run(["make", "-n", "-C", str(REPO), *extra], capture_output=True, text=True)
        assert dry.returncode == 0, dry.stderr
        return dry.stdout

    assert "scripts/demo.py --plot out/demo.png" in make_commands("demo")
    assert "scripts/demo.py --plot docs/demo.png" in make_commands("demo", "OUT=docs")
    assert "--out out/bench" in make_commands("bench", "SWEEPS=blocks")
    assert "--out docs/bench" in make_commands("bench", "SWEEPS=blocks", "OUT=docs")


def test_demo_trains_a_local_checkpoint(tmp_path):
    import sys

    sys.path.insert(0, str(REPO / "tests"))
    from tiny_models import make_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # A byte-level tokenizer of 256 tokens and a tiny Llama with that vocabulary, saved as a checkpoint.
    byte_vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    raw = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path / "ckpt")
    make_model("llama", vocab_size=256).save_pretrained(tmp_path / "ckpt")
    result = run_py([DEMO, "--model", str(tmp_path / "ckpt"), "--seq-len", "64", "--steps", "2", "--chunk", "7",
                     "--max-chars", "20000", "--plot", str(tmp_path / "p.png"), "--device", "cpu"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "LlamaForCausalLM" in result.stdout and "peak ratio chunk=7/off" in result.stdout
    assert len(step_losses(result.stdout)) == 2
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG_MAGIC
