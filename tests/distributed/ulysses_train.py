"""Ranks of short Trainer runs under DeepSpeed (CPU, gloo), optionally with Ulysses sequence parallelism.

Run by tests/test_ulysses.py through `torchrun --nproc_per_node N` with DS_ACCELERATOR=cpu:
`--sp 1` under one process is the reference, `--sp 2` under two processes the Ulysses run. Each
`--spec NAME:KEY=VALUE,...` is one Trainer run (keys: family, case, zero, chunk (mini_sequence_chunk), stream
(streaming_backward_chunk), offload (1: layer inputs in host memory), kv (num_key_value_heads), batch (rows per
step), attn, seq, steps, aux, optim (the Trainer's `optim`; AdamW by default), plant (an error
planted in the Ulysses path, which the tests must see: "keys", "mask", "offset")),
run one after the other in the same processes to save start-up time. A run that raises records
its error message instead of losses. Rank 0 writes {NAME: {"loss": [...], "grad_norm": [...]} or
{"error": "..."}} as JSON to --out.
"""

import argparse
import contextlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from leave import leave_process_group  # noqa: E402

# aux=1: the MoE head adds the router's auxiliary loss (output_router_logits=True).
DEFAULTS = dict(family="mistral", case="window", zero=2, chunk=None, stream=None, offload=0, attn="sdpa", seq=32,
                steps=3, aux=0, plant="", kv=None, batch=1, optim="adamw_torch")


def samples(case, seq, n, vocab, seed=1):
    """n samples of seq tokens: input_ids, labels, position_ids (+ attention_mask for padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(1, vocab, (seq,), generator=g)
        sample = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.arange(seq)}
        if case == "packed":  # three documents per row; positions restart at each boundary
            cuts = [0, seq // 3 + i % 8, 2 * seq // 3, seq]
            sample["position_ids"] = torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])])
        elif case == "padding":  # right padding, a different length per row
            keep = seq - 5 - 2 * (i % 8)
            mask = (torch.arange(seq) < keep).long()
            sample["attention_mask"] = mask
            sample["labels"] = ids.masked_fill(mask == 0, -100)
        elif case == "left_padding":  # left padding: the first rows of a shard see no key
            keep = seq - 3 - 2 * (i % 8)
            mask = (torch.arange(seq) >= seq - keep).long()
            sample["attention_mask"] = mask
            sample["labels"] = ids.masked_fill(mask == 0, -100)
            sample["position_ids"] = (torch.cumsum(mask, 0) - 1).clamp(min=0)
        elif case != "window":
            raise ValueError(f"case={case!r}")
        out.append(sample)
    return out


def parse_run(text):
    name, _, rest = text.partition(":")
    spec = dict(DEFAULTS)
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in spec:
            raise ValueError(f"unknown key {key!r} in --spec {text!r}")
        spec[key] = value if key in ("family", "case", "attn", "plant", "optim") else int(value)
    return name, spec


def train(spec, sp, workdir):
    import transformers
    from tiny_models import make_model

    overrides = {
        "mini_sequence_chunk": spec["chunk"], "streaming_backward_chunk": spec["stream"],
        "attn_implementation": spec["attn"],
    }
    if spec["family"] in ("mistral", "gemma2", "mixtral"):  # gemma2: every other layer slides
        overrides["sliding_window"] = 8  # smaller than the sequence and than each rank's shard
    if spec["family"] == "mixtral":
        # DeepSpeed 0.19.8 reads config.head_dim, which MixtralConfig leaves None (its TypeError, before any step,
        # is what a user sees without it); the attention computes the same hidden_size // num_attention_heads.
        overrides["head_dim"] = 8
    if spec["kv"]:
        overrides["num_key_value_heads"] = spec["kv"]
    if spec["aux"]:
        overrides["output_router_logits"] = True
    if spec["family"] == "qwen2":  # sliding layers from layer 1 on
        overrides.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if spec["family"] == "qwen3":  # sliding layers from layer 1 on
        overrides.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    if spec["family"] == "gemma4_text":  # layer 1 (full attention): heads of 16 and keys as values, unlike layer 0's
        overrides.update(global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=2)
    if spec["family"] == "llama4_text":  # layer 0 chunked (8), layer 1 NoPE: queries scaled by 1 + 16 log1p(floor((p+1)/4))
        overrides["attn_scale"] = 16.0  # (0.1 by default: a shard numbered from 0 moved the loss by only 7e-7)
    if spec["family"] == "gemma3_text":  # layer 0 slides (8), layer 1 full
        overrides.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if spec["family"] == "gemma":  # a model type outside the registry: Ulysses must refuse it
        torch.manual_seed(0)
        config = transformers.GemmaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, attn_implementation=spec["attn"],
        )
        model = transformers.GemmaForCausalLM(config)
    elif spec["family"] in ("qwen3_vl", "qwen3_vl_moe"):  # the composite, text-only batches (its text layers' fields)
        from test_new_families import qwen3_vl

        text = {"attn_implementation": spec["attn"], "mini_sequence_chunk": spec["chunk"],
                "streaming_backward_chunk": spec["stream"], "router_aux_loss_coef": 0.0}
        model = qwen3_vl(seed=0, moe=spec["family"] == "qwen3_vl_moe", **text)
    else:
        model = make_model(spec["family"], seed=0, **overrides)
    model.config.use_cache = False
    # A composite's text model reads its own config's: with it set, its training forward fills a cache, and upstream's
    # create_causal_mask then does not detect packed sequences (docs/limits.md).
    model.config.get_text_config().use_cache = False
    if spec["family"] == "gemma4_text":
        # DeepSpeed 0.19.8 reads config.head_dim, which Gemma-4 keeps per layer (transformers raises on the global
        # read unless allowed): it then gets the sliding layers' size, and the full-attention layers' heads are
        # exchanged by transformers-mst (ulysses/exchange.py).
        model.config.allow_global_per_layer_attribute_access = True
    if spec["offload"]:  # streamed layers keep their inputs in host memory (docs/streaming.md)
        model.activation_checkpointing_enable(offload=True)

    ds_config = {
        "zero_optimization": {"stage": spec["zero"]},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    extra = {}
    if sp > 1:
        from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

        extra["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed",
            sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length_is_variable=True, sp_attn_implementation=spec["attn"]
            ),
        )
    args = transformers.TrainingArguments(
        output_dir=workdir,
        per_device_train_batch_size=spec["batch"],
        max_steps=spec["steps"],
        learning_rate=1e-2,
        optim=spec["optim"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        deepspeed=ds_config,
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    vocab = model.config.get_text_config().vocab_size
    if spec["family"] in ("qwen3_vl", "qwen3_vl_moe"):
        vocab -= 4  # text only: none of the image and video tokens (test_new_families.py: the last four ids)
    data = samples(spec["case"], spec["seq"], 8 * spec["batch"], vocab)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data, data_collator=transformers.default_data_collator
    )
    # How many query chunks a streamed layer ran through the Ulysses attention (0 where nothing streams).
    from transformers.ulysses.streamed import StreamedQueryChunk

    attend, calls = StreamedQueryChunk.attend, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return attend(*args, **kwargs)

    StreamedQueryChunk.attend = counted
    try:
        with planted(spec["plant"]):
            trainer.train()
    finally:
        StreamedQueryChunk.attend = attend
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h.get("grad_norm") for h in logs], "streamed_chunks": calls[0]}


@contextlib.contextmanager
def planted(plant):
    """An error planted in the streamed Ulysses path: "keys" hands every query the first shard's first 4 keys and
    values where the second shard's are (as if one chunk's K/V were not exchanged); "mask" lets the second shard's first
    4 query rows see every key, later ones included; "offset" numbers every shard's queries from 0."""
    from transformers.ulysses.masks import UlyssesMask

    if not plant:
        yield
        return
    if plant == "offset":  # every shard numbered from 0 (Llama-4's NoPE query scaling: patch 0006)
        init = UlyssesMask.__init__

        def numbered_from_zero(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.first_token = 0

        UlyssesMask.__init__ = numbered_from_zero
        try:
            yield
        finally:
            UlyssesMask.__init__ = init
        return
    original = {"keys": UlyssesMask.gather_keys_values, "mask": UlyssesMask.build}[plant]

    def wrong_keys(self, keys, values):
        keys, values = original(self, keys, values)
        length = self.q_length
        keys, values = keys.clone(), values.clone()
        keys[:, :, length : length + 4], values[:, :, length : length + 4] = keys[:, :, :4], values[:, :, :4]
        return keys, values

    def wrong_mask(self, module, query, kwargs, uattn):
        mask = original(self, module, query, kwargs, uattn)
        if mask is None or mask.shape[-2] == self.q_length:
            raise AssertionError("plant=mask needs a whole-sequence mask tensor (a padding or window case)")
        mask = mask.clone()
        mask[:, :, self.q_length : self.q_length + 4] = True if mask.dtype == torch.bool else 0
        return mask

    setattr(UlyssesMask, original.__name__, {"keys": wrong_keys, "mask": wrong_mask}[plant])
    try:
        yield
    finally:
        setattr(UlyssesMask, original.__name__, original)


def reset_between_runs():
    """Let the next Trainer set up accelerate and DeepSpeed's sequence-parallel groups afresh."""
    from accelerate.state import AcceleratorState
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    AcceleratorState._reset_state(True)
    parallel_state_sp._release_sequence_parallel_groups()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=1)
    p.add_argument("--spec", action="append", required=True, help="NAME:key=value,...")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # accelerate leaves DeepSpeed's comm uninitialized on CPU
    results = {}
    for text in args.spec:
        name, spec = parse_run(text)
        try:
            results[name] = train(spec, args.sp, os.path.join(os.path.dirname(os.path.abspath(args.out)), name))
        except Exception as e:  # recorded: the error cases are expected to raise before any step
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"}
        reset_between_runs()
        print(f"RESULT {name} {json.dumps(results[name])}", flush=True)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    leave_process_group()


if __name__ == "__main__":
    main()
