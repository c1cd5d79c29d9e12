"""Per-rank script (torchrun, 2 processes, gloo): HF Trainer steps under one wrapper, flag off vs on.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/distributed/trainer_run.py WRAPPER OUT_FILE

WRAPPER: one of WRAPPERS below (FSDP: see fsdp_run.py). For each family (tiny Llama with tied embeddings; tiny Mistral with
a sliding window shorter than the sequence; tiny Qwen3; Mixtral, Qwen3-MoE and GPT-OSS with the router's auxiliary loss) it
trains three times from the same weights and data (VARIANTS): flags unset, `mini_sequence_chunk` set (chunks that do not divide the sequence), and
`streaming_backward_chunk` set (Llama, Qwen3, Qwen3-MoE: alone, with the Trainer's gradient checkpointing on too, which
streaming must replace; Mistral, Mixtral, GPT-OSS: with `mini_sequence_chunk`; DeepSeek-V3 and Llama-4 text: both, under checkpointing; Mistral's query chunks longer than its
window; Gemma-4 text: both, under checkpointing; Qwen3-Next: both, under checkpointing, its Gated DeltaNet layer through its
state; DeepSeek-V3.2 and GLM-5, which do not stream: mini-sequences under checkpointing).
SGD, gradient accumulation 2, right padding and ignored labels. Rank 0 saves every micro-batch loss,
the initial and the full final weights of each run, and how often the streamed layers recomputed a
chunk and the Trainer's checkpointing ran, to OUT_FILE; tests/test_distributed.py compares each
variant with flags unset.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import transformers.modeling_utils  # noqa: E402
from tiny_models import make_model  # noqa: E402
from leave import leave_process_group  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402
from transformers import streaming_backward as streaming  # noqa: E402
from transformers.streaming_backward import layer as streamed_layer  # noqa: E402
from transformers.streaming_backward import recurrent  # noqa: E402

SEQ = 48
# Per family, on top of tests/tiny_models.py: Llama with tied embeddings; Mistral with a sliding
# window shorter than the sequence; Qwen3 (q/k norms) as it is there; Mixtral and Qwen3-MoE (MoE blocks; Qwen3-MoE's
# first layer dense) and GPT-OSS (MoE, alternating sliding windows, attention sinks; eager attention, its default) with
# the router's auxiliary loss (`output_router_logits=True`, coefficient 1.0 there) added; DeepSeek-V3 (latent attention,
# a dense first layer, routed and shared experts) with its router logits recorded (its head adds no aux loss); Llama-4
# text (layer 0 dense with chunked attention, layer 1 a MoE block whose experts see every token, NoPE) likewise; Qwen3-Next
# (Gated DeltaNet and gated attention layers, MoE with a shared expert) with the aux loss; DeepSeek-V3.2 and GLM-5
# (DeepSeek-V3's layers with the sparse-attention indexer, which upstream does not train) with their router logits;
# Gemma-4 text (a sliding-window and a full-attention layer, each with its per-layer input).
FAMILIES = {"llama": dict(tie_word_embeddings=True), "mistral": dict(sliding_window=8), "qwen3": {},
            "mixtral": dict(output_router_logits=True), "qwen3_moe": dict(output_router_logits=True),
            "gpt_oss": dict(output_router_logits=True), "deepseek_v3": dict(output_router_logits=True),
            "llama4_text": dict(output_router_logits=True), "qwen3_next": dict(output_router_logits=True),
            "deepseek_v32": dict(output_router_logits=True), "glm_moe_dsa": dict(output_router_logits=True),
            "gemma4_text": {}}
# Not streamed (the sparse-attention indexer's keys): their second variant is mini-sequences under the Trainer's
# checkpointing.
NOT_STREAMED = ("deepseek_v32", "glm_moe_dsa")
# Decoder layers that stream through their recurrent state (streaming_backward/recurrent.py): Qwen3-Next's layer 0.
RECURRENT_LAYERS = {"qwen3_next": 1}
CHUNK = 7  # mini-sequences of 7 tokens: does not divide the 2 x 48 tokens of a micro-batch
STREAM = 10  # streamed query chunks of 10 tokens: 5 per layer call (the last one 8), longer than Mistral's window
# Per variant and family: (config overrides, TrainingArguments overrides); "off" is the reference.
VARIANTS = {
    "off": {family: ({}, {}) for family in FAMILIES},
    "mini_sequence": {family: (dict(mini_sequence_chunk=CHUNK), {}) for family in FAMILIES},
    "streaming": {
        "llama": (dict(streaming_backward_chunk=STREAM), dict(gradient_checkpointing=True)),
        "mistral": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK), {}),
        "qwen3": (dict(streaming_backward_chunk=STREAM), dict(gradient_checkpointing=True)),
        "mixtral": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK), {}),
        "qwen3_moe": (dict(streaming_backward_chunk=STREAM), dict(gradient_checkpointing=True)),
        "gpt_oss": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK), {}),
        "deepseek_v3": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK),
                        dict(gradient_checkpointing=True)),
        "llama4_text": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK),
                        dict(gradient_checkpointing=True)),
        "gemma4_text": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK), dict(gradient_checkpointing=True)),
        "qwen3_next": (dict(streaming_backward_chunk=STREAM, mini_sequence_chunk=CHUNK), dict(gradient_checkpointing=True)),
        **{family: (dict(mini_sequence_chunk=CHUNK), dict(gradient_checkpointing=True)) for family in NOT_STREAMED},
    },
}
# DDP refuses a step that leaves a parameter without a gradient unless told: the DSA indexer's weights get none
# (upstream's top-k), and the Trainer tells DDP to look for such parameters only without gradient checkpointing.
DDP_ARGS = {family: dict(ddp_find_unused_parameters=True) for family in ("deepseek_v32", "glm_moe_dsa")}


def zero(stage, **extra):
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": stage, **extra},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    if stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                           stage3_gather_16bit_weights_on_model_save=True)
    return {"deepspeed": config}


WRAPPERS = {
    "ddp": {},
    "zero2": zero(2),
    "zero3": zero(3),
    "zero3_offload": zero(3, offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"}),
}
# accelerate 1.15 on a machine without an accelerator turns a Trainer's FSDP request into plain DDP
# (its FSDP branch covers accelerator devices only), so FSDP is tested without the Trainer, in
# fsdp_run.py. This check keeps a wrapper from silently being replaced here too.
EXPECTED_WRAPPER = {"ddp": "DistributedDataParallel", "zero2": "DeepSpeedEngine", "zero3": "DeepSpeedEngine",
                    "zero3_offload": "DeepSpeedEngine"}


class RecordingTrainer(Trainer):
    """Keeps every micro-batch loss (unrounded; the logged loss is rounded to 4 digits)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.losses.append((loss[0] if return_outputs else loss).detach().item())
        return loss


def dataset(vocab_size):
    generator = torch.Generator().manual_seed(1234)
    rows = []
    for i in range(24):
        ids = torch.randint(0, vocab_size, (SEQ,), generator=generator)
        length = SEQ - (i % 4) * 5  # some rows right-padded
        mask = torch.zeros(SEQ, dtype=torch.long)
        mask[:length] = 1
        labels = ids.clone()
        labels[length:] = -100
        labels[: i % 3] = -100  # a few ignored prompt tokens
        rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return rows


def build_model(family, variant):
    return make_model(family, seed=0, use_cache=False, **FAMILIES[family], **VARIANTS[variant][family][0])


COUNTS = {"layer_calls": 0, "chunk_calls": 0, "blind_chunks": 0, "checkpoint_calls": 0, "recurrent_chunk_calls": 0}


def count_recomputation():
    """Count streamed decoder-layer calls, streamed chunk computations (forward and every recomputation; those of
    recurrent layers apart), chunks holding a query row that sees no key (they run twice more), and calls of the checkpoint function that gradient checkpointing uses (transformers.modeling_utils
    binds `checkpoint` when checkpointing is enabled, so this must run before). Class and module
    attributes, no module hooks: a hook would change which path the layer takes."""
    layer_forward, chunk_output = streaming.decoder_layer_forward, streamed_layer.StreamedCall.call
    checkpoint = transformers.modeling_utils.checkpoint

    def counted(key, function):
        def wrapper(*args, **kwargs):
            COUNTS[key] += 1
            return function(*args, **kwargs)

        return wrapper

    streaming.decoder_layer_forward = counted("layer_calls", layer_forward)
    streamed_layer.StreamedCall.call = counted("chunk_calls", chunk_output)
    recurrent.RecurrentCall.call = counted("recurrent_chunk_calls", recurrent.RecurrentCall.call)
    planned = streamed_layer.StreamedCall.__init__

    def counting_blind(self, *args, **kwargs):
        planned(self, *args, **kwargs)
        COUNTS["blind_chunks"] += len(self.blind)

    streamed_layer.StreamedCall.__init__ = counting_blind
    transformers.modeling_utils.checkpoint = counted("checkpoint_calls", checkpoint)


def buffer_names(model):
    """The state dict's buffers (DeepSeek-V3's routing bias): not trained, so not expected to move."""
    return {name for name, _ in model.named_buffers()}


def train(family, variant, wrapper_name, workdir):
    wrapper_args = {**WRAPPERS[wrapper_name], **VARIANTS[variant][family][1]}
    if wrapper_name == "ddp":
        wrapper_args.update(DDP_ARGS.get(family, {}))
    model = build_model(family, variant)
    COUNTS.update(dict.fromkeys(COUNTS, 0))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    args = TrainingArguments(
        output_dir=workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1, report_to=[],
        save_strategy="no", seed=0, data_seed=0, dataloader_num_workers=0, use_cpu=True,
        **wrapper_args,
    )
    trainer = RecordingTrainer(model=model, args=args, train_dataset=dataset(model.config.vocab_size))
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    if wrapped != EXPECTED_WRAPPER[wrapper_name]:
        raise RuntimeError(f"asked for {wrapper_name}, the Trainer wrapped the model in {wrapped}")
    model_for_state = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model
    state = trainer.accelerator.get_state_dict(model_for_state)
    state = {k: v.detach().float().cpu().clone() for k, v in (state or {}).items()}
    result = {"losses": trainer.losses, "initial": initial, "state": state, **COUNTS,
              "gradient_checkpointing": model.is_gradient_checkpointing, "buffers": buffer_names(model)}
    trainer.accelerator.free_memory()
    del trainer, model
    return result


def main():
    wrapper, out_file = sys.argv[1], sys.argv[2]
    if wrapper not in WRAPPERS:
        raise SystemExit(f"unknown wrapper {wrapper!r}; choose one of {sorted(WRAPPERS)}")
    count_recomputation()
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for family in FAMILIES:
            for variant in VARIANTS:
                results[(family, variant)] = train(family, variant, wrapper, workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)
    leave_process_group()


if __name__ == "__main__":
    main()
