"""One rank of a short Trainer run under DeepSpeed, optionally with Ulysses sequence parallelism.

Run by tests/test_ulysses.py through `torchrun --nproc_per_node N` (DS_ACCELERATOR=cpu, gloo):
N=1 without --sp is the one-process reference, N=2 with --sp 2 the Ulysses run. Rank 0 writes
the per-step losses and gradient norms as JSON to --out.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

SEQ = 32


def batches(case, n, vocab, seed=1):
    """n samples of SEQ tokens: input_ids, labels, position_ids (+ attention_mask for padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, vocab, (SEQ,), generator=g)
        sample = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(SEQ)}
        if case == "packed":  # three documents; positions restart at each boundary
            cuts = [0, 11 + i, 21, SEQ]
            sample["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])
        elif case == "padding":  # right padding of a different length per sample
            keep = SEQ - 5 - 2 * i
            mask = (torch.arange(SEQ) < keep).long()
            sample["attention_mask"] = mask
            sample["labels"] = ids.masked_fill(mask == 0, -100)
        out.append(sample)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--family", default="mistral")
    p.add_argument("--case", default="window", choices=["window", "packed", "padding"])
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--chunk", type=int, default=None, help="mini_sequence_chunk (unset when omitted)")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import deepspeed
    import transformers
    from tiny_models import make_model

    deepspeed.init_distributed(dist_backend="gloo")  # accelerate leaves DeepSpeed's comm uninitialized on CPU

    overrides = {"mini_sequence_chunk": args.chunk}
    if args.family == "mistral":
        overrides["sliding_window"] = 8
    model = make_model(args.family, seed=0, attn_implementation=args.attn, **overrides)
    model.config.use_cache = False

    ds_config = {
        "zero_optimization": {"stage": args.zero},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    extra = {}
    if args.sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=args.sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation=args.attn),
        )
    targs = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(args.out), "trainer"),
        per_device_train_batch_size=1,
        max_steps=args.steps,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_config,
        seed=0,
        data_seed=0,
        dataloader_drop_last=True,
        use_cpu=True,
        **extra,
    )
    data = batches(args.case, 8, model.config.vocab_size)
    trainer = transformers.Trainer(
        model=model, args=targs, train_dataset=data, data_collator=transformers.default_data_collator
    )
    trainer.train()
    if int(os.environ.get("RANK", "0")) == 0:
        logs = [h for h in trainer.state.log_history if "loss" in h]
        result = {"loss": [h["loss"] for h in logs], "grad_norm": [h.get("grad_norm") for h in logs]}
        with open(args.out, "w") as f:
            json.dump(result, f)
        print("RESULT", json.dumps(result))


if __name__ == "__main__":
    main()
