"""Per-rank script (torchrun, 2 processes, gloo): HF Trainer steps under one wrapper, flag off vs on.

    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 tests/distributed/trainer_run.py WRAPPER OUT_FILE

WRAPPER: one of WRAPPERS below (FSDP: see fsdp_run.py). For each family (tiny Llama with tied embeddings; tiny Mistral with
a sliding window shorter than the sequence) it trains twice from the same weights and data, with
`mini_sequence_chunk` unset and set (chunks that do not divide the sequence), SGD, gradient
accumulation 2, right padding and ignored labels. Rank 0 saves every micro-batch loss, the initial and the
full final weights of each run to OUT_FILE; tests/test_distributed.py compares flag on with flag off.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from tiny_models import make_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

SEQ = 48
# Per family, on top of tests/tiny_models.py: Llama with tied embeddings; Mistral with a sliding
# window shorter than the sequence.
FAMILIES = {"llama": dict(tie_word_embeddings=True), "mistral": dict(sliding_window=8)}
CHUNK = 7  # mini-sequences of 7 tokens: does not divide the 2 x 48 tokens of a micro-batch


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


def build_model(family, chunk):
    return make_model(family, seed=0, mini_sequence_chunk=chunk, use_cache=False, **FAMILIES[family])


def train(family, chunk, wrapper_name, workdir):
    wrapper_args = WRAPPERS[wrapper_name]
    model = build_model(family, chunk)
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
    result = {"losses": trainer.losses, "initial": initial, "state": state}
    trainer.accelerator.free_memory()
    del trainer, model
    return result


def main():
    wrapper, out_file = sys.argv[1], sys.argv[2]
    if wrapper not in WRAPPERS:
        raise SystemExit(f"unknown wrapper {wrapper!r}; choose one of {sorted(WRAPPERS)}")
    results = {}
    with tempfile.TemporaryDirectory() as workdir:
        for family in FAMILIES:
            for chunk in (None, CHUNK):
                results[(family, chunk)] = train(family, chunk, wrapper, workdir)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out_file)


if __name__ == "__main__":
    main()
