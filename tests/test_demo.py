"""scripts/demo.py end to end on tiny settings, and its argument checks."""

from conftest import REPO, run_py

DEMO = str(REPO / "scripts" / "demo.py")


def test_demo_runs_and_losses_agree(tmp_path):
    plot = tmp_path / "demo.png"
    result = run_py([DEMO, "--seq-len", "128", "--steps", "2", "--vocab-size", "300", "--max-chars", "100000",
                     "--chunk", "16", "--cache-dir", str(tmp_path), "--plot", str(plot), "--device", "cpu"])
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]
    assert "peak ratio chunk=16/off" in result.stdout
    lines = [ln.split() for ln in result.stdout.splitlines() if ln.strip()[:1].isdigit()]
    assert len(lines) == 2 and all(float(off) == float(on) or abs(float(off) - float(on)) < 1e-4 * float(off)
                                   for _, off, on, _ in lines)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.glob("bpe-v300-*.json"))  # the tokenizer is cached


def test_demo_bad_arguments_exit_2(tmp_path):
    for bad in (["--seq-len", "1"], ["--chunk", "0"], ["--chunk", "x"], ["--model", str(tmp_path / "missing")]):
        result = run_py([DEMO, *bad, "--cache-dir", str(tmp_path)])
        assert result.returncode == 2, (bad, result.stderr)
        assert "error:" in result.stderr


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
