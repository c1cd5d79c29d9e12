"""`mini_sequence_chunk` the way users run it with TRL (SFT, DPO), PEFT LoRA and QLoRA, on CPU.

Every case trains (or backpropagates) the same tiny model from the same weights on the same random
data twice, flag unset and `mini_sequence_chunk=7` (divides none of the sequence lengths here), and
requires the two to agree in fp32 within 1e-5 (relative): each micro-batch loss, TRL's logged
metrics, every final weight. Spies check that the mini-sequence MLP really ran split, and which LM
head computed the loss, so a comparison can never be the unsplit model against itself.

What TRL 1.16 does (read from its source, checked here): SFTTrainer and DPOTrainer always patch
`model.forward` with their own chunked LM head (`trl.trainer.utils.add_fused_lm_head`, called as
`model(..., fused_lm_head=True)`): it runs the backbone (`model.model`), then projects
`lm_head.weight` tile by tile into per-token log-probs, entropy and top-1 flags, from which the
trainers compute the loss and the `entropy` / `mean_token_accuracy` metrics. `outputs.logits` is
never read in training. So under TRL our flag splits the MLPs and TRL's head computes the loss: one
chunked head, never two, and never `logits=None` where TRL wants logits.
"""

import importlib.util
import tempfile

import pytest
import torch
import transformers
import transformers.mini_sequence.integration as integration
from transformers import streaming_backward as streaming
from tiny_models import make_model

from integration_helpers import chat_rows, make_tokenizer, preference_rows, prompt_completion_rows, text_rows

CHUNK = 7
RTOL = 1e-5


def require(package):
    if importlib.util.find_spec(package) is None:
        pytest.fail(f"{package} is not installed (pinned in requirements-test.txt; `make install` installs it)")


@pytest.fixture
def spies(monkeypatch):
    """Counts of mini-sequence MLP calls that really split, and of our chunked LM-head loss."""
    counts = {"mlp_split": 0, "our_lm_loss": 0}
    mlp, loss = integration.mini_sequence_mlp, integration.causal_lm_output

    def mlp_spy(module, hidden, chunk_size, *args, **kwargs):
        counts["mlp_split"] += hidden.shape[-2] > chunk_size
        return mlp(module, hidden, chunk_size, *args, **kwargs)

    def loss_spy(*args, **kwargs):
        counts["our_lm_loss"] += 1
        return loss(*args, **kwargs)

    monkeypatch.setattr(integration, "mini_sequence_mlp", mlp_spy)
    monkeypatch.setattr(integration, "causal_lm_output", loss_spy)
    return counts


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def assert_same_weights(off, on):
    assert off.keys() == on.keys()
    worst = max(off, key=lambda k: rel_err(on[k], off[k]))
    assert rel_err(on[worst], off[worst]) < RTOL, worst


def record_losses(trainer):
    """Each micro-batch loss as `compute_loss` returns it (the logged loss is a rounded average),
    and the batches it saw."""
    losses, batches = [], []
    compute_loss = trainer.compute_loss

    def wrapped(model, inputs, *args, **kwargs):
        batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        result = compute_loss(model, inputs, *args, **kwargs)
        losses.append((result[0] if isinstance(result, tuple) else result).item())
        return result

    trainer.compute_loss = wrapped
    return losses, batches


def common_args(tmp_path, name):
    # bf16=False: TRL's configs default to bf16 mixed precision (autocast, also on CPU), whose own
    # rounding (measured 5e-3 relative on the first gradients) would hide a real error at 1e-5.
    return dict(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2,
        learning_rate=0.05, optim="sgd", logging_steps=1, report_to=[], seed=0, save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, bf16=False,
    )


SFT_CASES = {
    # name: (family, dataset rows, SFTConfig overrides)
    "padded": ("llama", text_rows(12, seed=1), {}),
    "packing_padding_free": ("qwen2", text_rows(30, seed=2, low=6, high=20), {"packing": True, "max_length": 24}),
    "padding_free": ("llama", text_rows(12, seed=3), {"padding_free": True, "max_length": None}),
    "completion_only_loss": ("llama", prompt_completion_rows(12, seed=4), {"completion_only_loss": True}),
    "assistant_only_loss": ("qwen2", chat_rows(12, seed=5), {"assistant_only_loss": True}),
    # Label smoothing makes TRL call the model without labels and smooth over its logits.
    "label_smoothing": ("llama", text_rows(12, seed=6), {"label_smoothing_factor": 0.1}),
}


def run_sft(tmp_path, chunk, family, rows, overrides, stream=None, **flags):
    import datasets
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(**{**common_args(tmp_path, f"sft-{chunk}-{stream}-{len(flags)}"), **overrides})
    if stream is not None:
        flags["streaming_backward_chunk"] = stream
    trainer = SFTTrainer(
        model=make_model(family, mini_sequence_chunk=chunk, **flags),
        args=args,
        train_dataset=datasets.Dataset.from_dict(rows),
        processing_class=make_tokenizer(),
    )
    losses, batches = record_losses(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return losses, logs, weights, batches


# Flags-off runs, shared by the tests that compare a flag with them (deterministic: same seeds, data).
_FLAGS_OFF = {}


def flags_off(key, run):
    if key not in _FLAGS_OFF:
        _FLAGS_OFF[key] = run()
    return _FLAGS_OFF[key]


def sft_flags_off(tmp_path, case):
    family, rows, overrides = SFT_CASES[case]
    return flags_off(("sft", case), lambda: run_sft(tmp_path, None, family, rows, overrides))


@pytest.mark.parametrize("case", list(SFT_CASES))
def test_sft_trainer_flag_on_equals_off(case, tmp_path, spies):
    require("trl")
    family, rows, overrides = SFT_CASES[case]
    off = sft_flags_off(tmp_path, case)
    assert spies == {"mlp_split": 0, "our_lm_loss": 0}
    on = run_sft(tmp_path, CHUNK, family, rows, overrides)
    # The MLPs ran split (2 layers x 6 micro-batches), TRL's fused head computed the loss: ours never ran.
    assert spies["mlp_split"] >= 12 and spies["our_lm_loss"] == 0, spies

    losses_off, logs_off, weights_off, batches = off
    losses_on, logs_on, weights_on, _ = on
    assert len(losses_off) == 6
    assert losses_on == pytest.approx(losses_off, rel=RTOL)
    # TRL's own metrics come from its fused head's outputs, not from `outputs.logits`: present and equal.
    assert len(logs_on) == len(logs_off) == 3
    for log_off, log_on in zip(logs_off, logs_on):
        for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
            assert log_on[key] == pytest.approx(log_off[key], rel=RTOL), key
    assert_same_weights(weights_off, weights_on)

    # The variant really is what its name says.
    batch = batches[0]
    if case in ("packing_padding_free", "padding_free"):
        assert "attention_mask" not in batch and batch["input_ids"].shape[0] == 1
        restarts = (batch["position_ids"][0, 1:] == 0).sum().item()
        assert restarts >= 1, "several sequences packed in one row, positions restarting"
    if case in ("completion_only_loss", "assistant_only_loss"):
        real = batch["attention_mask"].bool()
        assert (batch["labels"][real] == -100).sum() > 0, "prompt / user tokens masked out of the loss"


def test_sft_eval_logits_with_flag(tmp_path, spies):
    """Evaluation with metrics wants logits: TRL recomputes them without labels, so they are there."""
    require("trl")
    import datasets
    from trl import SFTConfig, SFTTrainer

    seen = {}

    def metrics(pred):
        seen[len(seen)] = pred.predictions
        return {}

    results = []
    for chunk in (None, CHUNK):
        args = SFTConfig(**common_args(tmp_path, f"eval-{chunk}"), per_device_eval_batch_size=2)
        trainer = SFTTrainer(
            model=make_model("llama", mini_sequence_chunk=chunk), args=args,
            train_dataset=datasets.Dataset.from_dict(text_rows(4, seed=7)),
            eval_dataset=datasets.Dataset.from_dict(text_rows(4, seed=7)), processing_class=make_tokenizer(),
            compute_metrics=metrics,
        )
        results.append(trainer.evaluate())
    assert spies["mlp_split"] >= 2
    assert seen[1].shape == seen[0].shape and seen[0].shape[-1] == 128
    assert results[1]["eval_loss"] == pytest.approx(results[0]["eval_loss"], rel=RTOL)


def run_dpo(tmp_path, chunk, stream=None):
    import datasets
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**common_args(tmp_path, f"dpo-{chunk}-{stream}"))
    trainer = DPOTrainer(
        model=make_model("llama", mini_sequence_chunk=chunk, streaming_backward_chunk=stream),
        ref_model=make_model("llama", mini_sequence_chunk=chunk),
        args=args,
        train_dataset=datasets.Dataset.from_dict(preference_rows(12, seed=8)),
        processing_class=make_tokenizer(),
    )
    losses, _ = record_losses(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return losses, logs, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def test_dpo_trainer_flag_on_equals_off(tmp_path, spies):
    require("trl")
    losses_off, logs_off, weights_off = flags_off("dpo", lambda: run_dpo(tmp_path, None))
    losses_on, logs_on, weights_on = run_dpo(tmp_path, CHUNK)
    assert spies["mlp_split"] >= 12 and spies["our_lm_loss"] == 0, spies
    assert len(losses_off) == 6
    assert losses_on == pytest.approx(losses_off, rel=RTOL)
    for log_off, log_on in zip(logs_off, logs_on):
        for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            assert log_on[key] == pytest.approx(log_off[key], rel=RTOL, abs=1e-6), key
    assert_same_weights(weights_off, weights_on)


def test_no_labels_in_training_returns_logits(spies):
    """Code that computes log-probs from logits itself (older TRL, custom DPO/GRPO losses) calls the
    model in training mode without labels: the flag must leave the LM head alone there."""
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, 23))
    logits = []
    for chunk in (None, CHUNK):
        model = make_model("llama", mini_sequence_chunk=chunk).train()
        out = model(input_ids=ids)
        out.logits.float().logsumexp(-1).sum().backward()
        logits.append((out.logits.detach(), model.model.layers[0].mlp.up_proj.weight.grad))
    assert spies["mlp_split"] == 2 and spies["our_lm_loss"] == 0
    assert rel_err(logits[1][0], logits[0][0]) < RTOL
    assert rel_err(logits[1][1], logits[0][1]) < RTOL
    # With labels it is our chunked loss, and logits is None (documented in docs/mini-sequence.md).
    model = make_model("llama", mini_sequence_chunk=CHUNK).train()
    assert model(input_ids=ids, labels=ids).logits is None and spies["our_lm_loss"] == 1


def lora_grads(model, batch, lora_config):
    from peft import get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(model, lora_config).train()
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.detach(), out.logits, grads


def lora_config(target_modules=("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"), dropout=0.0):
    from peft import LoraConfig

    # init_lora_weights=False: B is random too, so A gets a non-zero gradient to compare.
    return LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False, target_modules=list(target_modules),
    )


def padded_batch(seq_len=40):
    torch.manual_seed(2)
    ids = torch.randint(1, 128, (2, seq_len))
    mask = torch.ones_like(ids)
    mask[1, seq_len - 9 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def assert_lora_grads_close(off, on, rtol):
    loss_off, _, grads_off = off
    loss_on, logits_on, grads_on = on
    assert logits_on is None  # our chunked LM-head loss ran
    assert len(grads_off) == 20 and grads_off.keys() == grads_on.keys()
    assert all(g.abs().max() > 0 for g in grads_off.values())
    assert loss_on.item() == pytest.approx(loss_off.item(), rel=rtol)
    worst = max(grads_off, key=lambda k: rel_err(grads_on[k], grads_off[k]))
    assert rel_err(grads_on[worst], grads_off[worst]) < rtol, worst


def test_peft_lora_adapter_grads_equal(spies):
    require("peft")
    batch = padded_batch()
    off = lora_grads(make_model("llama"), batch, lora_config())
    on = lora_grads(make_model("llama", mini_sequence_chunk=CHUNK), batch, lora_config())
    assert spies["mlp_split"] == 2 and spies["our_lm_loss"] == 1
    assert_lora_grads_close(off, on, RTOL)


def load_4bit(path, chunk, compute_dtype, stream=None):
    from peft import prepare_model_for_kbit_training

    quantization = transformers.BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, mini_sequence_chunk=chunk, dtype=torch.float32,
        streaming_backward_chunk=stream,
    )
    # Freezes the base, casts norms to fp32, turns on gradient checkpointing (input grads enabled).
    return prepare_model_for_kbit_training(model)


@pytest.fixture(scope="module")
def saved_llama():
    with tempfile.TemporaryDirectory() as path:
        make_model("llama", hidden_size=64, intermediate_size=128).save_pretrained(path)
        yield path


def test_qlora_4bit_adapter_grads_equal(saved_llama, spies):
    """QLoRA: bitsandbytes 4-bit (NF4) base weights, dequantized to fp32 for compute. The base weights
    are the same on both sides, so flag on vs unset differ only by summation order: fp32's 1e-5.
    (A dropped or doubled chunk changes a gradient by O(1/M) of it, far above 1e-5.)"""
    require("peft")
    require("bitsandbytes")
    import bitsandbytes

    batch = padded_batch()
    off = lora_grads(load_4bit(saved_llama, None, torch.float32), batch, lora_config())
    model_on = load_4bit(saved_llama, CHUNK, torch.float32)
    assert isinstance(model_on.model.layers[0].mlp.gate_proj, bitsandbytes.nn.Linear4bit)
    assert model_on.is_gradient_checkpointing
    on = lora_grads(model_on, batch, lora_config())
    assert spies["mlp_split"] >= 2 and spies["our_lm_loss"] == 1
    assert_lora_grads_close(off, on, RTOL)


def test_qlora_bf16_compute_within_bf16_error(saved_llama, spies):
    """bf16 compute dtype (the usual QLoRA setting): flag on and unset round differently, so they are
    compared against the fp32-compute run of the same 4-bit weights: the flag's error must not be
    more than 1.5x the unsplit path's own bf16 error (plus a floor of 1e-3 relative). A wrong chunk
    boundary gives an error of the order of the gradient itself, which fails this."""
    require("peft")
    require("bitsandbytes")
    batch = padded_batch()
    reference = lora_grads(load_4bit(saved_llama, None, torch.float32), batch, lora_config())[2]
    off = lora_grads(load_4bit(saved_llama, None, torch.bfloat16), batch, lora_config())[2]
    on = lora_grads(load_4bit(saved_llama, CHUNK, torch.bfloat16), batch, lora_config())[2]
    assert spies["our_lm_loss"] == 1
    for name, ref in reference.items():
        err_off, err_on = rel_err(off[name].float(), ref), rel_err(on[name].float(), ref)
        assert err_on <= 1.5 * err_off + 1e-3, (name, err_on, err_off)


# ---- streaming_backward_chunk (StreamBP) under TRL, PEFT and QLoRA ----
# Query chunks of 9 tokens: every sequence here (11-40 tokens) streams in 2 chunks or more (checked).
# Mostly together with mini_sequence_chunk=7 (the recommended long-sequence setting): 7 < 9, yet the MLP runs
# unsplit inside each streamed chunk (mst_core/chunks.py: the chunk bounds it; no third MLP pass).
STREAM = 9
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def streamed_layers(monkeypatch):
    """How many decoder-layer calls took the streamed path (so flag on is never flag off again)."""
    counts = {"layers": 0}
    forward = streaming.decoder_layer_forward

    def spy(*args, **kwargs):
        counts["layers"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(streaming, "decoder_layer_forward", spy)
    return counts


@pytest.mark.parametrize("case", ["padded", "packing_padding_free", "padding_free"])
def test_sft_trainer_streaming_equals_off(case, tmp_path, spies, streamed_layers):
    """TRL SFT (padded, packed with restarting position_ids, padding-free), gradient accumulation 2:
    both flags on train like both off, micro-batch by micro-batch."""
    require("trl")
    family, rows, overrides = SFT_CASES[case]
    losses_off, logs_off, weights_off, _ = sft_flags_off(tmp_path, case)
    assert streamed_layers["layers"] == 0
    losses_on, logs_on, weights_on, batches = run_sft(tmp_path, CHUNK, family, rows, overrides, stream=STREAM)
    # 2 layers x 6 micro-batches streamed, each in several chunks, the MLP unsplit inside them.
    assert streamed_layers["layers"] == 12 and spies["mlp_split"] == 0, (streamed_layers, spies)
    assert all(batch["input_ids"].shape[1] > STREAM for batch in batches)
    assert len(losses_off) == 6
    assert losses_on == pytest.approx(losses_off, rel=RTOL)
    for log_off, log_on in zip(logs_off, logs_on):
        for key in ("loss", "entropy", "mean_token_accuracy"):
            assert log_on[key] == pytest.approx(log_off[key], rel=RTOL), key
    assert_same_weights(weights_off, weights_on)


def test_sft_trainer_streaming_with_trl_default_bf16(tmp_path, streamed_layers):
    """TRL's own default, bf16 mixed precision (autocast over fp32 weights, on the CPU too), as users run it: a batch
    without padding has no attention mask, and each chunk's causal bias must cast SDPA's inputs as autocast does
    (streaming_backward/masks.OwnKeysCausalBias). Until mst.21 this case raised a dtype error. Both sides compute in
    bf16, so the losses agree to bf16 rounding, not to 1e-5 (exactness under autocast: test_streaming.py)."""
    require("trl")
    family, rows, overrides = SFT_CASES["assistant_only_loss"]
    runs = [run_sft(tmp_path, chunk, family, rows, {**overrides, "bf16": True}, stream=stream)
            for chunk, stream in ((None, None), (CHUNK, STREAM))]
    (losses_off, *_), (losses_on, _, _, batches) = runs
    assert streamed_layers["layers"] == 12
    assert any("attention_mask" not in batch or bool(batch["attention_mask"].all()) for batch in batches)
    assert len(losses_off) == 6 and losses_on == pytest.approx(losses_off, rel=1e-3)


def test_dpo_trainer_streaming_equals_off(tmp_path, streamed_layers):
    """DPO: policy streamed (the reference model runs without grad: upstream path), equal to flags off."""
    require("trl")
    losses_off, logs_off, weights_off = flags_off("dpo", lambda: run_dpo(tmp_path, None))
    losses_on, logs_on, weights_on = run_dpo(tmp_path, CHUNK, stream=STREAM)
    assert streamed_layers["layers"] == 12, streamed_layers
    assert losses_on == pytest.approx(losses_off, rel=RTOL)
    for log_off, log_on in zip(logs_off, logs_on):
        for key in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            assert log_on[key] == pytest.approx(log_off[key], rel=RTOL, abs=1e-6), key
    assert_same_weights(weights_off, weights_on)


def assert_streamed_lora_grads_close(off, on, expected_count, rtol=RTOL):
    (loss_off, _, grads_off), (loss_on, _, grads_on) = off, on
    assert len(grads_off) == expected_count and grads_off.keys() == grads_on.keys()
    assert all(g.abs().max() > 0 for g in grads_off.values())
    assert loss_on.item() == pytest.approx(loss_off.item(), rel=rtol)
    worst = max(grads_off, key=lambda k: rel_err(grads_on[k], grads_off[k]))
    assert rel_err(grads_on[worst], grads_off[worst]) < rtol, (worst, rel_err(grads_on[worst], grads_off[worst]))


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("chunk", [None, CHUNK], ids=["streaming", "streaming+mini_sequence"])
def test_peft_lora_all_projections_streaming_equals_off(family, chunk, streamed_layers):
    """LoRA (dropout 0) on q, k, v, o, gate, up, down: adapter gradients equal flags off (Mistral with a
    window of 8 < the 40-token sequence; right padding, ignored labels)."""
    require("peft")
    batch = padded_batch()
    extra = {"sliding_window": 8} if family == "mistral" else {}
    off = lora_grads(make_model(family, **extra), batch, lora_config(ALL_PROJECTIONS))
    on = lora_grads(make_model(family, mini_sequence_chunk=chunk, streaming_backward_chunk=STREAM, **extra), batch,
                    lora_config(ALL_PROJECTIONS))
    assert streamed_layers["layers"] == 2
    # 7 projections x (A, B) x 2 layers.
    assert_streamed_lora_grads_close(off, on, expected_count=28)


class _PlainAutogradStreaming:
    """Stands in for the streamed layer's Function: the same chunk calls in the same order (so the same dropout
    draws, K/V-only passes of blind chunks included), recorded by ordinary autograd instead of the streamed
    backward: each chunk's K/V are kept with their graph and concatenated for the chunks that read them."""

    @staticmethod
    def apply(x, streamed, offload, *params):
        from transformers.streaming_backward.cache import StopAfterKeysValues, _ChunkCache

        written = {}  # chunk start -> (keys, values) with graph

        class GraphCache(_ChunkCache):
            def __init__(self, start, kv_start, kv_end, stop=False, write=True):
                super().__init__()
                self.start, self.kv_start, self.kv_end, self.stop, self.write = start, kv_start, kv_end, stop, write

            def _update(self, keys, values):
                if self.write:
                    written[self.start] = (keys, values)
                if self.stop:
                    raise StopAfterKeysValues
                parts = [written[start] for start in sorted(written)]  # contiguous from 0 when read
                keys, values = (torch.cat([part[i] for part in parts], dim=2) for i in (0, 1))
                return keys[:, :, self.kv_start : self.kv_end], values[:, :, self.kv_start : self.kv_end]

        outputs = {}
        for index in sorted(streamed.blind):
            start, end = streamed.chunks[index]
            streamed.call(x[:, start:end], index, GraphCache(start, start, end, stop=True))
        for index in streamed.forward_order():
            start, end = streamed.chunks[index]
            cache = GraphCache(start, *streamed.key_ranges[index], write=index not in streamed.blind)
            outputs[index] = streamed.call(x[:, start:end], index, cache)[0]  # (out,): no router here
        return torch.cat([outputs[index] for index in range(len(streamed.chunks))], dim=1)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_peft_lora_dropout_streamed_backward_is_exact(padding, monkeypatch, streamed_layers):
    """LoRA with dropout 0.3 on every projection: flag on and off draw different dropout masks (the
    chunks draw in another order), so they cannot be compared. What must hold is that the streamed
    backward is the exact gradient of the streamed forward, i.e. it replays the forward's dropout masks
    in every recomputation (the backward's K/V pass, each chunk's recompute, a blind chunk's own K/V). Reference: the same chunked
    forward, from the same RNG state, under plain autograd. A mask drawn afresh in backward changes the
    gradients by O(1) (checked: the dropout-free gradients differ by more than 10%). Left padding: the first
    chunk holds rows that see no key, so it runs a K/V-only pass first, whose draws its K/V keep."""
    require("peft")
    batch = padded_batch()
    if padding == "left":
        mask = torch.ones_like(batch["attention_mask"])
        mask[1, :9] = 0
        batch.update(attention_mask=mask, labels=batch["input_ids"].masked_fill(mask == 0, -100))

    def run(dropout):
        model = make_model("llama", streaming_backward_chunk=STREAM)
        torch.manual_seed(1)
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(ALL_PROJECTIONS, dropout=dropout)).train()
        torch.manual_seed(3)  # the dropout draws
        out = model(**batch)
        out.loss.backward()
        return out.loss.detach(), None, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    streamed = run(0.3)
    no_dropout = run(0.0)
    assert streamed_layers["layers"] == 4
    from transformers.streaming_backward import layer as streamed_layer

    monkeypatch.setattr(streamed_layer, "StreamedLayerFunction", _PlainAutogradStreaming)
    reference = run(0.3)
    assert_streamed_lora_grads_close(reference, streamed, expected_count=28)
    # Dropout really was active in both: far from the dropout-free gradients.
    assert max(rel_err(streamed[2][k], no_dropout[2][k]) for k in streamed[2]) > 0.1


def test_qlora_4bit_streaming_equals_off(saved_llama, streamed_layers):
    """QLoRA (NF4 base weights, fp32 compute; prepare_model_for_kbit_training turns gradient
    checkpointing on, which streaming replaces): adapter gradients equal flags off."""
    require("peft")
    require("bitsandbytes")
    batch = padded_batch()
    off = lora_grads(load_4bit(saved_llama, None, torch.float32), batch, lora_config(ALL_PROJECTIONS))
    model_on = load_4bit(saved_llama, CHUNK, torch.float32, stream=STREAM)
    assert model_on.is_gradient_checkpointing
    on = lora_grads(model_on, batch, lora_config(ALL_PROJECTIONS))
    assert streamed_layers["layers"] == 2
    assert_streamed_lora_grads_close(off, on, expected_count=28)


# ----------------------------------------------------------------------------- Mamba: adjoint sharding


@pytest.fixture
def adjoint_scans(monkeypatch):
    """Counts forwards of the adjoint-sharded scan (so a comparison cannot be upstream against itself)."""
    from transformers.adjoint_sharding import scan

    calls = []
    forward = scan.AdjointSelectiveScan.forward
    monkeypatch.setattr(scan.AdjointSelectiveScan, "forward",
                        staticmethod(lambda *a, **k: calls.append(1) or forward(*a, **k)))
    return calls


def test_sft_trainer_mamba_adjoint_equals_off(tmp_path, spies, adjoint_scans):
    """TRL SFT on Mamba, gradient accumulation 2: adjoint sharding + chunked LM head vs flags off."""
    require("trl")
    rows = text_rows(12, seed=7)
    off_losses, off_logs, off_weights, off_batches = run_sft(tmp_path, None, "mamba", rows, {})
    assert adjoint_scans == []
    on_losses, on_logs, on_weights, on_batches = run_sft(tmp_path, CHUNK, "mamba", rows, {}, adjoint_sharding_chunk=5)
    # 2 layers per micro-batch, each scanned twice: TRL's SFTConfig turns gradient checkpointing on by default.
    assert len(adjoint_scans) == 2 * 2 * len(on_losses)
    assert len(on_losses) == len(off_losses) == 6
    for a, b in zip(off_batches, on_batches):
        assert torch.equal(a["input_ids"], b["input_ids"])
    for off, on in zip(off_losses, on_losses):
        assert on == pytest.approx(off, rel=RTOL)
    assert_same_weights(off_weights, on_weights)


def test_peft_lora_mamba_adjoint_equals_off(adjoint_scans):
    """LoRA on the mixer's projections (in_proj, x_proj): adapter gradients equal. (PEFT refuses out_proj
    and conv1d on Mamba; a LoRA on dt_proj gets no gradient in upstream either: the mixer multiplies by
    dt_proj.weight directly, bypassing the adapter.)"""
    require("peft")
    batch = padded_batch()
    config = lora_config(("in_proj", "x_proj"))
    off = lora_grads(make_model("mamba"), batch, config)
    on = lora_grads(make_model("mamba", adjoint_sharding_chunk=6, mini_sequence_chunk=CHUNK), batch, config)
    assert len(adjoint_scans) == 2
    loss_off, _, grads_off = off
    loss_on, logits_on, grads_on = on
    assert logits_on is None and len(grads_off) == 8 and grads_off.keys() == grads_on.keys()
    assert all(g.abs().max() > 0 for g in grads_off.values())
    assert loss_on.item() == pytest.approx(loss_off.item(), rel=RTOL)
    worst = max(grads_off, key=lambda k: rel_err(grads_on[k], grads_off[k]))
    assert rel_err(grads_on[worst], grads_off[worst]) < RTOL, worst
