"""Batches with nothing or little to learn from, on every method: the flags must give upstream's loss (NaN where
upstream's is NaN) and upstream's gradients, which are finite (zero when nothing is predicted).

A batch whose labels are all ignored, passed with `num_items_in_batch=0` (the HF Trainer does that when no
micro-batch of an accumulation window has a label), made every gradient NaN with a chunked loss: one such batch
destroyed a training run. Each case builds the model twice from one seed, flags unset and set, runs one
forward/backward on the same batch and compares.
"""

import math

import pytest
import torch
import transformers
from test_mini_sequence_models import assert_close
from tiny_models import COMMON, make_model

METHODS = {  # name: (family, flags); chunk sizes are filled in per batch (see `flags_for`)
    "llama mini_sequence": ("llama", {"mini_sequence_chunk": "C"}),  # fp32 plain head: F.linear_cross_entropy
    "gemma2 mini_sequence": ("gemma2", {"mini_sequence_chunk": "C"}),  # soft-capped head: our Function
    "llama mini_sequence, hooked head": ("llama", {"mini_sequence_chunk": "C", "hook_head": True}),  # wrapper path
    "llama mini_sequence, no grad to the head": ("llama", {"mini_sequence_chunk": "C", "freeze_head": True}),
    "llama streaming": ("llama", {"streaming_backward_chunk": "C"}),
    "gemma2 mini_sequence+streaming": ("gemma2", {"mini_sequence_chunk": "C", "streaming_backward_chunk": "C"}),
    "mamba mini_sequence": ("mamba", {"mini_sequence_chunk": "C"}),
    "mamba adjoint": ("mamba", {"adjoint_sharding_chunk": "C"}),
    "falcon_mamba mini_sequence+adjoint": ("falcon_mamba", {"mini_sequence_chunk": "C", "adjoint_sharding_chunk": "C"}),
}


def make_batch(kind, seed=0):
    """(input_ids, attention_mask, labels, forward kwargs) for one kind of batch."""
    batch_size, seq = {"S=1": (2, 1), "S=2": (2, 2)}.get(kind, (3, 12))
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, COMMON["vocab_size"], (batch_size, seq), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    labels = input_ids.clone()
    kwargs = {}
    if kind.startswith("all ignored"):
        labels[:] = -100
        kwargs["num_items_in_batch"] = {
            "all ignored": None,
            "all ignored, num_items_in_batch=0": 0,
            "all ignored, num_items_in_batch=tensor(0)": torch.tensor(0),
            # Other micro-batches of the accumulation window have labels: upstream's loss is 0, not NaN.
            "all ignored, num_items_in_batch=9": 9,
        }[kind]
    elif kind == "one supervised token":
        labels[:] = -100
        labels[1, 5] = input_ids[1, 5]
    elif kind == "one supervised token, num_items_in_batch=1":
        labels[:] = -100
        labels[2, -1] = input_ids[2, -1]
        kwargs["num_items_in_batch"] = torch.tensor(1)
    elif kind == "a row of padding only":
        attention_mask[0, :] = 0
        attention_mask[2, :4] = 0  # and left padding on another row
        labels[attention_mask == 0] = -100
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    return input_ids, attention_mask, labels, kwargs


KINDS = [
    "all ignored",
    "all ignored, num_items_in_batch=0",
    "all ignored, num_items_in_batch=tensor(0)",
    "all ignored, num_items_in_batch=9",
    "one supervised token",
    "one supervised token, num_items_in_batch=1",
    "a row of padding only",
    "S=1",
    "S=2",
]


def flags_for(flags, input_ids):
    """Chunks small enough that a short batch is still split (the LM head needs chunk < B * S to be chunked)."""
    chunk = 1 if input_ids.shape[1] <= 2 else 5
    return {k: chunk if v == "C" else v for k, v in flags.items() if k not in ("hook_head", "freeze_head")}


def run(family, flags, method_flags, input_ids, attention_mask, labels, kwargs):
    model = make_model(family, **flags)
    model.train()
    if method_flags.get("hook_head"):
        model.lm_head.register_forward_pre_hook(lambda module, args: None)  # as accelerate / ZeRO-3 hooks do
    if method_flags.get("freeze_head"):
        model.lm_head.weight.requires_grad_(False)
    call = {"attention_mask": attention_mask} if family not in ("mamba", "falcon_mamba") else {}
    out = model(input_ids=input_ids, labels=labels, **call, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def assert_same_loss(actual, expected):
    if math.isnan(expected.item()):
        assert math.isnan(actual.item()), f"upstream's loss is NaN, ours {actual.item()}"
    else:
        assert_close(actual, expected, what="loss")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_same_loss_and_finite_gradients_as_upstream(method, kind):
    family, method_flags = METHODS[method]
    input_ids, attention_mask, labels, kwargs = make_batch(kind)
    flags = flags_for(method_flags, input_ids)
    ref_loss, ref_grads = run(family, {}, method_flags, input_ids, attention_mask, labels, kwargs)
    loss, grads = run(family, flags, method_flags, input_ids, attention_mask, labels, kwargs)
    assert_same_loss(loss, ref_loss)
    assert ref_grads.keys() == grads.keys()
    for name, ref in ref_grads.items():
        assert ref is not None and torch.isfinite(ref).all(), f"upstream's own gradient of {name} is not finite"
        assert grads[name] is not None, f"{name} got no gradient"
        assert torch.isfinite(grads[name]).all(), f"{name}: non-finite gradient (upstream's is finite)"
    # Nothing predicted: upstream's gradients are exactly 0, and so must ours be. Else each gradient within
    # 1e-5 of upstream's, relative to its own scale; one that is 0 in exact arithmetic while others are not
    # (S=2: the only predicting query attends to one key, so q_proj's gradient is 0) comes out as 0 or as rounding
    # (2e-10 against 0.59 on one machine, 0 on another): ours must then be rounding too, relative to the largest.
    largest = max(ref.abs().max() for ref in ref_grads.values())
    for name, ref in ref_grads.items():
        if ref.abs().max() > 1e-6 * largest:
            assert_close(grads[name], ref, what=name)
        else:
            assert grads[name].abs().max() <= 1e-6 * largest, f"{name}: upstream's gradient is 0, ours is not"


@pytest.mark.parametrize("shape", [(0, 12), (2, 0)], ids=["B=0", "S=0"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_empty_batch_fails_as_upstream_or_clearly(method, shape):
    """An empty batch: the same result as upstream if upstream gives one, else an error that says what is wrong."""
    family, method_flags = METHODS[method]
    input_ids = torch.ones(shape, dtype=torch.long)
    attention_mask, labels = torch.ones_like(input_ids), input_ids.clone()
    flags = flags_for(method_flags, torch.ones(3, 12))

    def outcome(flags):
        try:
            return run(family, flags, method_flags, input_ids, attention_mask, labels, {}), None
        except Exception as error:  # noqa: BLE001 -- the test compares what each side raises
            return None, error

    (ref, ref_error), (ours, error) = outcome({}), outcome(flags)
    if ref_error is None:
        assert error is None, f"upstream runs an empty batch, ours raises {error!r}"
        assert_same_loss(ours[0], ref[0])
        for name, grad in ours[1].items():
            assert grad is None or torch.isfinite(grad).all(), name
    else:
        assert error is not None, f"upstream raises {ref_error!r}, ours runs"
        same = type(error) is type(ref_error) and str(error) == str(ref_error)
        assert same or ("empty" in str(error) and isinstance(error, ValueError)), (
            f"upstream raises {ref_error!r}; ours {error!r} neither matches it nor says the batch is empty"
        )


# ----------------------------------------------------------------------------- through the Trainer


class _Rows(torch.utils.data.Dataset):
    """8 rows; rows 2 and 3 have no label (a completion truncated away), so with one row per micro-batch and
    2 accumulation steps the second optimizer step's window has nothing to predict: the Trainer passes
    `num_items_in_batch=0`."""

    def __init__(self):
        gen = torch.Generator().manual_seed(5)
        self.rows = [torch.randint(1, COMMON["vocab_size"], (16,), generator=gen) for _ in range(8)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        labels = self.rows[i].clone()
        labels[:8] = -100  # a prompt
        if i in (2, 3):
            labels[:] = -100
        return {"input_ids": self.rows[i], "labels": labels}


@pytest.mark.parametrize(
    "flags",
    [{"mini_sequence_chunk": 5}, {"streaming_backward_chunk": 5}, {"mini_sequence_chunk": 3, "streaming_backward_chunk": 5}],
    ids=["mini_sequence", "streaming", "both"],
)
def test_trainer_window_with_nothing_to_predict_leaves_weights_as_upstream(flags, tmp_path):
    results = {}
    for name, model_flags in (("upstream", {}), ("flags", flags)):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / name), per_device_train_batch_size=1, gradient_accumulation_steps=2,
            max_steps=4, learning_rate=0.1, logging_steps=1, report_to=[], seed=0, save_strategy="no",
            use_cpu=True, dataloader_num_workers=0, max_grad_norm=1.0, train_sampling_strategy="sequential", optim="sgd",
        )
        model = make_model("llama", **model_flags)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_Rows())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        results[name] = model, [h["loss"] for h in logs], [h["grad_norm"] for h in logs]
    (ref_model, ref_losses, ref_norms), (model, losses, norms) = results["upstream"], results["flags"]
    assert len(ref_losses) == 4 and ref_norms[1] == 0  # the empty window: upstream's gradients are all zero
    assert norms == pytest.approx(ref_norms, rel=1e-5, abs=1e-8)
    assert losses == pytest.approx(ref_losses, rel=1e-5, nan_ok=True)
    for (name, ref), param in zip(ref_model.named_parameters(), model.parameters()):
        assert torch.isfinite(param).all(), f"{name} is no longer finite"
        assert_close(param.detach(), ref.detach(), what=name)
