"""`mini_sequence_chunk` on the four families: the flag, exactness against the unsplit path, memory.

Every comparison builds the same model twice from one seed, flag off (upstream path) and
flag on, feeds both fresh random inputs, and compares the loss, the gradient of every
parameter and the gradient of `inputs_embeds`.
"""

import logging
import zlib

import pytest
import torch
import transformers
from tiny_models import COMMON, FAMILIES, make_config, make_model
from transformers.mini_sequence import lm_head_chunk_size
from transformers.mst_core.memory import LiveTensorTracker

SEQ = 40
RTOL = 1e-5


def batch(seed, bsz=3, seq=SEQ):
    """Random tokens with left padding on one row, ignored labels, and one row fully ignored."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, COMMON["vocab_size"], (bsz, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :6] = 0
    labels = input_ids.clone()
    labels[attention_mask == 0] = -100
    labels[0, torch.randperm(seq, generator=gen)[: seq // 4]] = -100
    labels[2] = -100
    return input_ids, attention_mask, labels


def train_step(model, input_ids, attention_mask, labels, **kwargs):
    """Loss, grads of all parameters and of inputs_embeds, for one forward/backward."""
    model.train()
    embeds = model.get_input_embeddings()(input_ids).detach().requires_grad_()
    out = model(inputs_embeds=embeds, attention_mask=attention_mask, labels=labels, **kwargs)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads, embeds.grad


def assert_close(actual, expected, rtol=RTOL, what=""):
    """Relative to the tensor's own scale, so a near-zero entry does not make the check vacuous."""
    scale = expected.abs().max().clamp_min(1e-12)
    err = ((actual.float() - expected.float()).abs().max() / scale).item()
    assert err <= rtol, f"{what}: relative error {err:.2e} > {rtol:.0e}"


def compare(family, chunk, seed, model_kwargs=None, step_kwargs=None, rtol=RTOL, **data):
    model_kwargs, step_kwargs = model_kwargs or {}, step_kwargs or {}
    inputs = batch(seed, **data)
    ref_out, ref_grads, ref_embed_grad = train_step(make_model(family, **model_kwargs), *inputs, **step_kwargs)
    out, grads, embed_grad = train_step(
        make_model(family, mini_sequence_chunk=chunk, **model_kwargs), *inputs, **step_kwargs
    )
    config = make_config(family, **model_kwargs)
    num_tokens = inputs[2].numel()
    lm_chunk = lm_head_chunk_size(chunk, config.hidden_size, config.vocab_size, num_tokens)
    # The chunked loss never builds the logits; a batch that is one LM-head chunk takes upstream's path.
    assert (out.logits is None) == (lm_chunk < num_tokens)
    assert_close(out.loss, ref_out.loss, rtol, "loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], rtol, name)
    assert_close(embed_grad, ref_embed_grad, rtol, "inputs_embeds")
    return out.loss


# ----------------------------------------------------------------------------- the flag


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flag_saved_and_overridable(family, tmp_path):
    assert make_config(family).mini_sequence_chunk is None
    model = make_model(family, mini_sequence_chunk=16)
    model.save_pretrained(tmp_path)
    model_class = type(model)
    assert model_class.from_pretrained(tmp_path).config.mini_sequence_chunk == 16
    assert model_class.from_pretrained(tmp_path, mini_sequence_chunk="auto").config.mini_sequence_chunk == "auto"
    assert transformers.AutoConfig.from_pretrained(tmp_path, mini_sequence_chunk=None).mini_sequence_chunk is None
    with pytest.raises(ValueError, match="mini_sequence_chunk"):
        model_class.from_pretrained(tmp_path, mini_sequence_chunk=0)


def test_flag_on_unsupported_model_warns(caplog):
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, mini_sequence_chunk=8)
    with caplog.at_level(logging.WARNING):
        transformers.GPT2LMHeadModel(config)
    assert "model_type='gpt2' has no mini_sequence_chunk path: mini_sequence_chunk=8 is ignored" in caplog.text


def test_flag_assigned_after_construction_is_checked_at_use():
    model = make_model("llama", mini_sequence_chunk=8)
    model.config.mini_sequence_chunk = 0
    with pytest.raises(ValueError, match="mini_sequence_chunk"):
        model(input_ids=torch.ones(1, 12, dtype=torch.long), labels=torch.ones(1, 12, dtype=torch.long))


# ----------------------------------------------------------------------------- exactness, fp32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_exact_with_num_items_in_batch(family):
    # The Trainer's gradient-accumulation path: sum over the micro-batch, divide by the global count.
    compare(family, 7, seed=11, step_kwargs={"num_items_in_batch": torch.tensor(173)})
    compare(family, "auto", seed=12, step_kwargs={"num_items_in_batch": 57})


def tokens_per_projection(model, inputs, monkeypatch):
    """Tokens each Linear of the first decoder layer sees in one training step, per token of the batch (counted in
    `nn.Linear.forward`, class level: a module hook would send the layer to the wrapper path). MoE experts and
    routers are left out. Also used by test_streaming_families.py."""
    rows = {}
    original = torch.nn.Linear.forward

    def counted(linear, x):
        rows[linear] = rows.get(linear, 0) + x.shape[:-1].numel()
        return original(linear, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counted)
    train_step(model, *inputs)
    monkeypatch.setattr(torch.nn.Linear, "forward", original)
    layer = model.model.layers[0]
    return {name: rows.get(linear, 0) / inputs[0].numel() for name, linear in layer.named_modules()
            if isinstance(linear, torch.nn.Linear) and "experts" not in name and "gate" != name.rsplit(".", 1)[-1]}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpointing_recomputes_the_mlp_once(family, monkeypatch):
    """With checkpointing each projection sees each token twice (forward, recompute), flag set or not: the layer's
    recompute stops before the mini-sequence MLP, whose backward rebuilds its chunks (it ran the MLP a third
    time). Gemma-2's post-feedforward norm would save the MLP's output: it runs by mini-sequences with the MLP."""
    for chunk in (None, 7):
        model = make_model(family, mini_sequence_chunk=chunk)
        model.gradient_checkpointing_enable()
        counts = tokens_per_projection(model, batch(4), monkeypatch)
        assert len(counts) == 7 and set(counts.values()) == {2.0}, (chunk, counts)  # q, k, v, o, gate, up, down


@pytest.mark.parametrize("hooked", [None, "mlp", "post_feedforward_layernorm"])
def test_gemma2_post_norm_runs_with_the_mlp_unless_hooked(hooked, monkeypatch):
    """Gemma-2's post-feedforward norm runs inside the MLP's chunks (it sees at most a chunk of tokens per call); a
    forward hook on the MLP or the norm (a wrapper's, or a user's) sends the layer to upstream's two calls, where
    the norm sees the whole sequence and the MLP still splits itself. Exact either way, with checkpointing."""
    norm_class = type(make_model("gemma2").model.layers[0].post_feedforward_layernorm)
    original, seen, post_norms = norm_class.forward, [], set()

    def recorded(norm, x):
        if norm in post_norms:
            seen.append(x.shape[-2])
        return original(norm, x)

    monkeypatch.setattr(norm_class, "forward", recorded)
    inputs = batch(13)
    results = []
    for chunk in (None, 7):
        model = make_model("gemma2", mini_sequence_chunk=chunk)
        model.gradient_checkpointing_enable()
        post_norms.clear()
        for layer in model.model.layers:
            post_norms.add(layer.post_feedforward_layernorm)
            if hooked:
                getattr(layer, hooked).register_forward_hook(lambda module, args, output: None)
        seen.clear()
        results.append(train_step(model, *inputs))
    assert max(seen) == (SEQ if hooked else 7)
    (ref, ref_grads, ref_eg), (out, grads, eg) = results
    assert_close(out.loss, ref.loss, what="loss")
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)
    assert_close(eg, ref_eg, what="inputs_embeds")


def test_tied_embeddings_exact():
    compare("llama", 7, seed=3, model_kwargs={"tie_word_embeddings": True})


def test_shift_labels_exact():
    ids, mask, labels = batch(8)
    shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    compare("qwen2", 7, seed=8, step_kwargs={"shift_labels": shift})


def test_all_labels_ignored_matches_upstream():
    ids, mask, _ = batch(9)
    labels = torch.full_like(ids, -100)
    ref = make_model("llama").train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    out = make_model("llama", mini_sequence_chunk=7).train()(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert torch.isnan(ref) and torch.isnan(out)


def test_generate_unchanged():
    ids = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = make_model("mistral").generate(ids, max_new_tokens=6, do_sample=False)
    out = make_model("mistral", mini_sequence_chunk=4).generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(ref, out)


def test_custom_loss_function_keeps_upstream_path(caplog):
    def my_loss(logits, labels, vocab_size, **kwargs):
        return logits.float().square().mean()

    model = make_model("llama", mini_sequence_chunk=7).train()
    model.loss_function = my_loss
    with caplog.at_level(logging.WARNING):
        out = model(input_ids=torch.ones(1, 12, dtype=torch.long), labels=torch.ones(1, 12, dtype=torch.long))
    assert out.logits is not None and "not ForCausalLMLoss" in caplog.text


def test_peft_lora_on_mlp_exact():
    import peft  # pinned in requirements-test.txt: a missing install fails, it does not skip
    inputs = batch(13)
    results = []
    for chunk in (None, 7):
        model = make_model("llama", mini_sequence_chunk=chunk)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
        torch.manual_seed(99)  # same adapter init in both runs
        model = peft.get_peft_model(model, lora)
        results.append(train_step(model, *inputs))
    (ref, ref_grads, _), (out, grads, _) = results
    assert ref_grads and all("lora_" in n for n in ref_grads)
    assert_close(out.loss, ref.loss, what="loss")
    for name in ref_grads:
        assert_close(grads[name], ref_grads[name], what=name)


def grad_groups(model, grads, embeds_grad):
    """The gradients as three flat vectors: the MLPs' weights, the LM head's weight (tied: the
    embedding), everything else with the inputs_embeds gradient."""
    head = next(n for n, p in model.named_parameters() if p is model.get_output_embeddings().weight)
    groups = {"mlp": [], "lm_head": [], "rest": [embeds_grad]}
    for name, grad in grads.items():
        groups["mlp" if ".mlp." in name else "lm_head" if name == head else "rest"].append(grad)
    return {k: torch.cat([g.double().flatten() for g in v]) for k, v in groups.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_as_accurate_as_upstream(family):
    """bf16 with the flag (chunk 2: 64 MLP and 192 LM-head mini-sequences) is as accurate as
    upstream bf16, both against fp32 from the same bf16 weights and inputs.

    Measured (ours / upstream relative-norm error, per group): 1.00-1.09 for the four families;
    with the parameter gradients summed over the mini-sequences in bf16 instead of fp32, the MLP
    group is 1.44-1.79x and the LM head 2.33-3.33x. (fp32, not fp64: Gemma-2's eager attention
    gives NaN for fully padded rows in fp64.)
    """
    inputs = batch(14, seq=128)
    model16 = make_model(family).to(torch.bfloat16)
    model32 = make_model(family)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    _, ref_grads, ref_embeds_grad = train_step(model32, *inputs)
    reference = grad_groups(model32, ref_grads, ref_embeds_grad)
    runs = {}
    for chunk in (None, 2):
        model = make_model(family, mini_sequence_chunk=chunk).to(torch.bfloat16)
        out, grads, embeds_grad = train_step(model, *inputs)
        assert out.logits is None or chunk is None
        runs[chunk] = out.loss, grad_groups(model, grads, embeds_grad)
    (up_loss, up), (loss, ours) = runs[None], runs[2]
    assert_close(loss, up_loss, 1e-5, "loss")  # fp32 sums of the same bf16 logits
    for group, ref in reference.items():
        err, err_up = [((g[group] - ref).norm() / ref.norm()).item() for g in (ours, up)]
        assert err <= 1.25 * err_up, f"{group}: error {err:.2e} vs fp32, upstream bf16 {err_up:.2e}"


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["qwen3", "gemma3_text", "qwen3_5_text", "olmo3", "smollm3",
                                                    "ministral3", "deepseek_v3", "glm4_moe"])
def test_bf16_vocab_sliced_head_as_accurate_as_upstream(family, monkeypatch):
    """A trained bf16 head with more vocabulary rows than tokens (1024 rows, 2 x 100 tokens: N + 128-row slices <
    V) takes the vocabulary-sliced backward (mini_sequence/loss.py), as accurate as upstream bf16 against fp32 from
    the same weights and inputs, with padding, ignored labels and a fully ignored row."""
    from transformers.mini_sequence import loss as ms_loss

    calls = []
    real_apply = ms_loss._VocabSlicedLMLossFunction.apply
    monkeypatch.setattr(ms_loss._VocabSlicedLMLossFunction, "apply",
                        staticmethod(lambda *args: calls.append(1) or real_apply(*args)))
    inputs = batch(15, bsz=3, seq=70)
    kwargs = {"vocab_size": 1024}
    model16 = make_model(family, **kwargs).to(torch.bfloat16)
    with torch.no_grad():  # logits of a few units: a peaked softmax, whose part of the head's gradient then shows
        model16.get_output_embeddings().weight.mul_(16)
    model32 = make_model(family, **kwargs)
    model32.load_state_dict({k: v.float() for k, v in model16.state_dict().items()})
    _, ref_grads, ref_embeds_grad = train_step(model32, *inputs)
    reference = grad_groups(model32, ref_grads, ref_embeds_grad)
    runs = {}
    for chunk in (None, 16):
        model = make_model(family, mini_sequence_chunk=chunk, **kwargs).to(torch.bfloat16)
        model.load_state_dict(model16.state_dict())
        out, grads, embeds_grad = train_step(model, *inputs)
        runs[chunk] = out.loss, grad_groups(model, grads, embeds_grad)
    assert calls == [1]  # the flagged run's loss, once
    (up_loss, up), (loss, ours) = runs[None], runs[16]
    assert_close(loss, up_loss, 1e-5, "loss")
    for group, ref in reference.items():
        err, err_up = [((g[group] - ref).norm() / ref.norm()).item() for g in (ours, up)]
        assert err <= 1.25 * err_up, f"{group}: error {err:.2e} vs fp32, upstream bf16 {err_up:.2e}"


# ----------------------------------------------------------------------------- memory


@pytest.mark.parametrize("family", sorted(FAMILIES) + ["qwen3_5_text", "olmo3", "smollm3", "ministral3", "gemma4_text",
                                                    "deepseek_v3", "glm4_moe"])
def test_no_sequence_sized_intermediate_allocated(family):
    """During a training step with the flag on, no [S, I] or [S, V] tensor is ever allocated.

    Odd sizes (prime I and V) so that a shape holding I or V is one of ours, never attention's.
    """
    seq, vocab, inter = 2048, 2053, 263  # S > AUTO_MIN_LM_HEAD_TOKENS, so "auto" splits the LM head too
    ids = torch.randint(1, vocab, (1, seq), generator=torch.Generator().manual_seed(0))
    peaks = {}
    for chunk in (None, "auto"):
        model = make_model(family, mini_sequence_chunk=chunk, vocab_size=vocab, intermediate_size=inter).train()
        with LiveTensorTracker(keep_largest=10_000) as tracker:
            model(input_ids=ids, labels=ids).loss.backward()
        peaks[chunk] = tracker.peak_bytes
        big = [(numel, shape, op) for numel, shape, op in tracker.largest_shapes
               if (inter in shape and numel >= seq * inter) or (vocab in shape and numel >= seq * vocab)]
        if chunk is None:
            assert big, "the tracker must see upstream's [S, I] and [S, V] tensors"
        else:
            assert big == [], big[:3]
    print(f"{family}: live-tensor peak of a training step, flag off {peaks[None] / 2**20:.2f} MiB, "
          f"auto {peaks['auto'] / 2**20:.2f} MiB")
    # The ratio target (<= 0.5 at d=256, S=4096) is checked by `make bench`; here eager
    # attention's [heads, S, S] scores weigh as much as the tiny model's MLP and LM head.
    assert peaks["auto"] < peaks[None]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_final_norm_by_mini_sequences(family):
    """The model's final norm with the flag set: exact in fp32 (random weight, so Gemma-2's (1 + w) is
    exercised), through the chunked Function; in bf16 its backward upcasts one chunk at a time, not the
    whole sequence; with the flag unset it is the norm's own output."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from transformers.mini_sequence import integration
    from transformers.mini_sequence.mlp import _MiniSequenceMLPFunction

    class LargestFp32(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
            return out

    gen = torch.Generator().manual_seed(zlib.crc32(family.encode()) % 1000)
    model = make_model(family, mini_sequence_chunk=7).model
    with torch.no_grad():
        model.norm.weight.copy_(torch.randn(model.norm.weight.shape, generator=gen) * 0.5)
    x = torch.randn(3, SEQ, COMMON["hidden_size"], generator=gen, requires_grad=True)
    grad_out = torch.randn(x.shape, generator=gen)
    results = []
    for chunked in (True, False):
        x.grad = model.norm.weight.grad = None
        out = integration.final_norm(model, x) if chunked else model.norm(x)
        assert (type(out.grad_fn) is _MiniSequenceMLPFunction._backward_cls) == chunked
        out.backward(grad_out)
        results.append((out.detach(), x.grad, model.norm.weight.grad))
    for got, want, what in zip(results[0], results[1], ("output", "input grad", "weight grad")):
        assert_close(got, want, RTOL, what)

    off = make_model(family).model
    assert torch.equal(integration.final_norm(off, x), off.norm(x))

    seq = 256  # "auto": chunks of hidden_size = 32 tokens
    for chunk in ("auto", None):
        model = make_model(family, mini_sequence_chunk=chunk).model.to(torch.bfloat16)
        x16 = torch.randn(2, seq, COMMON["hidden_size"], dtype=torch.bfloat16, requires_grad=True)
        with LargestFp32() as mode:
            integration.final_norm(model, x16).sum().backward()
        if chunk is None:
            assert mode.largest == x16.numel()  # upstream: the whole sequence upcast
        else:
            assert mode.largest <= 2 * COMMON["hidden_size"] * COMMON["hidden_size"], mode.largest


# ----------------------------------------------------------------------------- Trainer


def test_trainer_gradient_accumulation_same_losses(tmp_path):
    from torch.utils.data import Dataset

    class Random(Dataset):
        def __init__(self):
            gen = torch.Generator().manual_seed(21)
            self.rows = [torch.randint(1, 128, (int(n),), generator=gen) for n in torch.randint(12, 30, (8,), generator=gen)]

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return {"input_ids": self.rows[i]}

    def collate(rows):
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            mask[i, : len(r["input_ids"])] = 1
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    losses = {}
    for chunk in (None, 5):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(chunk)), per_device_train_batch_size=2, gradient_accumulation_steps=2,
            max_steps=2, learning_rate=1e-2, logging_steps=1, report_to=[], seed=0, save_strategy="no",
            use_cpu=True, dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(
            model=make_model("llama", mini_sequence_chunk=chunk), args=args, train_dataset=Random(), data_collator=collate
        )
        trainer.train()
        losses[chunk] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses[None]) == 2
    assert losses[5] == pytest.approx(losses[None], rel=1e-5)
