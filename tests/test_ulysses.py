"""Ulysses sequence parallelism (DeepSpeed, through accelerate's ParallelismConfig) is exact with masks.

DeepSpeed's Ulysses wrapper drops the model's attention mask (it was built for one rank's shard);
transformers-mst rebuilds the whole-sequence mask after the all-to-all. Checked on 2 CPU processes
over gloo (`torchrun`, DS_ACCELERATOR=cpu): a few Trainer steps of tiny models, sp=2 with ZeRO-2 and
ZeRO-3, mini_sequence_chunk unset and set, give the per-step losses of the one-process run. Without
the rebuild, Mistral with sliding_window=8 < 32 tokens gives step-1 loss 4.8763 under sp=2 against
4.8745 in one process (measured), far outside the 1e-5 tolerance. With streaming_backward_chunk set
too, each rank's streamed layers run their query chunks against the gathered keys (ulysses/streamed.py)
and give the same losses; planted errors in that path are seen.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "distributed" / "ulysses_train.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"

# name -> spec; each case runs in one process (reference) and under sp=2 with both ZeRO stages.
CASES = {
    "window": "family=mistral,case=window",  # sliding_window=8, 32 tokens: 16 per rank
    "qwen2_window": "family=qwen2,case=window",  # use_sliding_window: layer 0 full, layer 1 sliding (8)
    "packed": "family=llama,case=packed",  # three documents per row, position_ids restarting
    "padding": "family=llama,case=padding",  # 2D attention_mask, right padding
    "qwen3_window": "family=qwen3,case=window",  # q/k norms; layer 0 full, layer 1 sliding (8)
    "gemma3_window": "family=gemma3_text,case=window",  # layer 0 sliding (8), layer 1 full; sandwich norms
    "phi3_packed": "family=phi3,case=packed",  # fused qkv_proj and gate_up_proj
    "olmo2_padding": "family=olmo2,case=padding",  # q/k norms over all heads (before the all-to-all)
    "olmo3_window": "family=olmo3,case=window",  # layer 0 sliding (8), layer 1 full; post-norms
    "smollm3_packed": "family=smollm3,case=packed",  # layer 1 without rotary embeddings (NoPE)
    "ministral3_padding": "family=ministral3,case=padding",  # queries scaled by their position
    # MoE blocks route each token alone, so they run on each rank's shard as on the whole sequence.
    "mixtral_window": "family=mixtral,case=window",  # sliding_window=8
    "qwen3_moe_packed": "family=qwen3_moe,case=packed",  # layer 0 dense, layer 1 sparse
    "olmoe_padding": "family=olmoe,case=padding",
    "glm4_moe_packed": "family=glm4_moe,case=packed",  # shared expert, group-limited sigmoid routing
    # Gemma-4 text: layer 0 slides (8, heads of 8), layer 1 full with heads of 16 and keys as values, which DeepSpeed's
    # module (built for heads of 8) cannot exchange: transformers-mst does (ulysses/exchange.py).
    "gemma4_window": "family=gemma4_text,case=window,optim=sgd",
    # Llama-4 text: layer 0 chunked attention (chunks of 8), layer 1 NoPE with queries scaled by their position in the
    # whole sequence (patch 0006 numbers a shard's from its first token); its decoder layer passes no position_ids to
    # its attention (patch 0006 hands them over under Ulysses). A MoE block in layer 1.
    "llama4_window": "family=llama4_text,case=window",
    # Multi-head Latent Attention: query/key heads of 12, value heads of 8, which DeepSpeed's module (built for one
    # head size) cannot exchange: transformers-mst does (ulysses/exchange.py). V2 without a query LoRA, V3 with one.
    "deepseek_v2_padding": "family=deepseek_v2,case=padding",
    "glm4_moe_lite_packed": "family=glm4_moe_lite,case=packed",
    # Qwen3-VL built as its checkpoints load (the composite), text-only batches: multimodal rotary positions from the
    # 2D position_ids (DeepSpeed's data adapter takes no other shape), packed.
    "qwen3_vl_packed": "family=qwen3_vl,case=packed",
    # streaming_backward_chunk under Ulysses (SP_RUNS): each rank's query chunks against the gathered keys.
    "stream_window": "family=mistral,case=window",
    "stream_padding": "family=llama,case=padding,batch=2",  # 2 rows, each padded to its own length
    "stream_left_padding": "family=llama,case=left_padding,batch=2",  # the first positions see no key
    "stream_packed": "family=qwen3,case=packed",
    "stream_qwen2_window": "family=qwen2,case=window",  # layer 0 full, layer 1 sliding (8)
    "stream_gemma3_window": "family=gemma3_text,case=window",
    "stream_moe": "family=mixtral,case=window",
    "stream_gemma4_padding": "family=gemma4_text,case=padding,optim=sgd",
    "stream_llama4_packed": "family=llama4_text,case=packed",
    # Latent attention streamed: every rank gathers the whole sequence's latents (one "head" for all query heads)
    # and its chunks attend their own rows with every head.
    "stream_mla_padding": "family=deepseek_v3,case=padding,batch=2",
    "stream_mla_left_padding": "family=glm4_moe_lite,case=left_padding,batch=2",
    "stream_mla_packed": "family=deepseek_v2,case=packed",
    "stream_qwen3_vl_moe_packed": "family=qwen3_vl_moe,case=packed",
}
# Gemma-4 text trains with SGD here: under AdamW (lr 1e-2) its third step's ZeRO-3 gradient norm moved 2.5e-6 from one
# process's with both fields unset and 4.4e-4 streamed (one process streamed: 2.5e-4), its first two steps within 2e-6:
# Adam's first updates are about lr times the sign of each gradient entry, so an entry near zero whose fp32 rounding
# differs moves its weight by lr either way. With SGD every case and step agrees within 5e-7 (measured).
# mini_sequence_chunk=4 (flag on) in one ZeRO stage, unset in the other, per case.
SP_RUNS = {
    2: {"window": "", "qwen2_window": ",chunk=4", "packed": ",chunk=4", "padding": "", "qwen3_window": ",chunk=4",
        "gemma3_window": "", "phi3_packed": "", "olmo2_padding": ",chunk=4", "olmo3_window": "",
        "smollm3_packed": ",chunk=4", "ministral3_padding": "", "mixtral_window": ",chunk=4", "qwen3_moe_packed": "",
        "olmoe_padding": ",chunk=4", "glm4_moe_packed": "",
        # chunks of 4 and uneven ones (5, 5, 5, 1 of each rank's 16 rows); ZeRO-2: the streamed Function
        "stream_window": ",stream=4", "stream_padding": ",stream=5,chunk=4", "stream_left_padding": ",stream=4",
        "stream_packed": ",stream=5,offload=1", "stream_qwen2_window": ",stream=4,chunk=4",
        "stream_gemma3_window": ",stream=5", "stream_moe": ",stream=4,chunk=4", "gemma4_window": "",
        "stream_gemma4_padding": ",stream=4,chunk=4", "llama4_window": ",chunk=4", "stream_llama4_packed": ",stream=5",
        "deepseek_v2_padding": ",chunk=4", "glm4_moe_lite_packed": "", "stream_mla_padding": ",stream=4,chunk=4",
        "stream_mla_left_padding": ",stream=5", "stream_mla_packed": ",stream=5,offload=1", "qwen3_vl_packed": "",
        "stream_qwen3_vl_moe_packed": ",stream=5,chunk=4"},
    3: {"window": ",chunk=4", "qwen2_window": "", "packed": "", "padding": ",chunk=4", "qwen3_window": "",
        "gemma3_window": ",chunk=4", "phi3_packed": ",chunk=4", "olmo2_padding": "", "olmo3_window": ",chunk=4",
        "smollm3_packed": "", "ministral3_padding": ",chunk=4", "mixtral_window": "", "qwen3_moe_packed": ",chunk=4",
        "olmoe_padding": "", "glm4_moe_packed": ",chunk=4",
        # ZeRO-3: the streamed layer's nested-checkpoint path (every gradient through autograd)
        "stream_window": ",stream=5,chunk=4", "stream_padding": ",stream=4", "stream_left_padding": ",stream=5",
        "stream_packed": ",stream=4,chunk=4,offload=1", "stream_qwen2_window": ",stream=5",
        "stream_gemma3_window": ",stream=4,chunk=4", "stream_moe": ",stream=5", "gemma4_window": ",chunk=4",
        "stream_gemma4_padding": ",stream=5", "llama4_window": "", "stream_llama4_packed": ",stream=4,chunk=4",
        "deepseek_v2_padding": "", "glm4_moe_lite_packed": ",chunk=4", "stream_mla_padding": ",stream=5",
        "stream_mla_left_padding": ",stream=4,chunk=4", "stream_mla_packed": ",stream=4,offload=1",
        "qwen3_vl_packed": ",chunk=4", "stream_qwen3_vl_moe_packed": ",stream=4"},
}


def torchrun(nproc, sp, specs, tmp_path, name):
    out = tmp_path / f"{name}.json"
    cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={nproc}", str(SCRIPT), f"--sp={sp}", f"--out={out}"]
    for spec in specs:
        cmd.append(f"--spec={spec}")
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ulysses_ref")
    return torchrun(1, 1, [f"{name}:{spec},zero=2" for name, spec in CASES.items()], tmp, "reference")


@pytest.fixture(scope="module", params=sorted(SP_RUNS))
def sp2(request, tmp_path_factory):
    zero = request.param
    tmp = tmp_path_factory.mktemp(f"ulysses_sp2_zero{zero}")
    specs = [f"{name}:{spec},zero={zero}{SP_RUNS[zero][name]}" for name, spec in CASES.items()]
    return zero, torchrun(2, 2, specs, tmp, "sp2")


@pytest.mark.parametrize("case", sorted(CASES))
def test_sp2_losses_equal_one_process(reference, sp2, case):
    zero, results = sp2
    ref, got = reference[case], results[case]
    assert "error" not in ref, ref
    assert "error" not in got, got
    assert len(got["loss"]) == len(ref["loss"]) == 3
    # Where the field is set, every layer streamed: 2 layers x chunks x (forward + recompute) x 3 steps.
    stream = [int(item.removeprefix("stream=")) for item in SP_RUNS[zero][case].split(",") if item.startswith("stream=")]
    chunks = -(-16 // stream[0]) if stream else 0
    assert got["streamed_chunks"] == 2 * chunks * 2 * 3, (case, zero, got["streamed_chunks"])
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=0), (case, zero)
    if zero == 3:
        # ZeRO-3 also gives the one-process gradient norm. Under ZeRO-2 DeepSpeed reports (and clips)
        # twice the one-process norm with sp=2 (measured, flag on and off alike: a DeepSpeed matter,
        # not a mask one); Adam's update is scale-free, so the losses above still agree.
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5, abs=0), case


def test_sp2_refuses_what_it_cannot_make_exact(tmp_path):
    specs = [
        "indivisible:family=mistral,seq=31",  # 31 tokens over sp=2
        "eager:family=mistral,attn=eager",  # Ulysses cannot run eager attention (accelerate refuses it)
        "other_family:family=gemma",  # a model type outside the registry: its masks are not rebuilt
        "aux_loss:family=olmoe,aux=1",  # tiny: weight 1.0; the aux loss of a shard is not the whole sequence's
        "stream_one_kv_head:family=llama,stream=4,kv=1",  # DeepSpeed would replicate it; the streamed path does not
    ]
    results = torchrun(2, 2, specs, tmp_path, "errors")
    assert "isn't divisible by sp-size=2" in results["indivisible"].get("error", ""), results["indivisible"]
    assert "Invalid sp_attn_implementation: eager" in results["eager"].get("error", ""), results["eager"]
    err = results["other_family"].get("error", "")
    assert err.startswith("ValueError") and "'gemma'" in err and "model_type in" in err, results["other_family"]
    err = results["aux_loss"].get("error", "")
    assert err.startswith("ValueError") and "router_aux_loss_coef=1.0" in err, results["aux_loss"]
    err = results["stream_one_kv_head"].get("error", "")
    assert err.startswith("ValueError") and "1 key/value heads must both be divisible by 2" in err, err


def test_sp2_streaming_planted_errors_are_seen(reference, tmp_path):
    """The Ulysses comparisons above can fail: a wrong exchange of keys and values, or a wrong mask row, moves the
    first step's loss past their tolerance, on both of the streamed layer's paths (ZeRO-2: the Function; ZeRO-3:
    nested checkpoints), and so does numbering Llama-4's NoPE queries from 0 on every shard (9e-5 measured) or a
    latent-attention chunk's own rows from the first shard's."""
    specs = {
        "keys_zero2": ("stream_window", "family=mistral,case=window,stream=4,zero=2,plant=keys,steps=1"),
        "keys_zero3": ("stream_window", "family=mistral,case=window,stream=5,zero=3,plant=keys,steps=1"),
        "mask_zero2": ("stream_padding", "family=llama,case=padding,batch=2,stream=4,zero=2,plant=mask,steps=1"),
        "mask_zero3": ("stream_left_padding", "family=llama,case=left_padding,batch=2,stream=5,zero=3,plant=mask,steps=1"),
        # Llama-4's NoPE queries numbered from 0 on every shard: unstreamed, and streamed (the chunk cache's count)
        "offset": ("llama4_window", "family=llama4_text,case=window,zero=2,plant=offset,steps=1"),
        "offset_streamed": ("stream_llama4_packed", "family=llama4_text,case=packed,stream=4,zero=3,plant=offset,steps=1"),
        # Latent attention: a wrong gather of the latents; each shard's own rows numbered from 0 (read as rank 0's)
        "keys_mla": ("stream_mla_padding", "family=deepseek_v3,case=padding,batch=2,stream=4,zero=2,plant=keys,steps=1"),
        "offset_mla": ("stream_mla_packed", "family=deepseek_v2,case=packed,stream=5,zero=3,plant=offset,steps=1"),
    }
    results = torchrun(2, 2, [f"{name}:{spec}" for name, (_, spec) in specs.items()], tmp_path, "planted")
    for name, (case, _) in specs.items():
        got, ref = results[name], reference[case]
        assert "error" not in got, (name, got)
        assert got["streamed_chunks"] > 0 or "stream=" not in specs[name][1], name
        assert got["loss"][0] != pytest.approx(ref["loss"][0], rel=1e-5, abs=0), (name, got["loss"], ref["loss"])


def test_streamed_chunks_refuse_what_they_cannot_run():
    """A streamed layer under Ulysses asks the mask before computing anything (ulysses/masks.py: check_streamable): an
    attention implementation other than sdpa, heads that sp does not divide and bidirectional attention are refused by
    name (one process: no collective is reached)."""
    from types import SimpleNamespace

    from transformers.ulysses.masks import UlyssesMask

    def module(heads=4, kv_heads=2, causal=True):
        config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        return SimpleNamespace(config=config, is_causal=causal, num_key_value_groups=heads // kv_heads)

    def mask(implementation="sdpa"):
        uattn = SimpleNamespace(world_size=2, sp_rank=0, core_attn_implementation=implementation, process_group=None)
        return UlyssesMask(None, 16, uattn)

    mask().check_streamable(module())
    with pytest.raises(ValueError, match="attn_implementation in \\('sdpa',\\); got 'flash_attention_2'"):
        mask("flash_attention_2").check_streamable(module())
    with pytest.raises(ValueError, match="4 query heads and 1 key/value heads must both be divisible by 2"):
        mask().check_streamable(module(kv_heads=1))
    with pytest.raises(ValueError, match="needs causal attention"):
        mask().check_streamable(module(causal=False))
    with pytest.raises(ValueError, match="got no position_ids"):
        mask().query_chunk(0, 4, None, None)
