"""Run one training step of a tiny model and save loss, logits and every gradient.

Used by test_distribution.py in two processes: once importing our installed
distribution, once importing pristine upstream (PYTHONPATH=<unpacked upstream wheel>).
Usage: python flag_off_probe.py FAMILY OUT.pt
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import transformers  # noqa: E402
from tiny_models import make_model  # noqa: E402

family, out = sys.argv[1], sys.argv[2]
torch.use_deterministic_algorithms(True)
model = make_model(family, seed=0)
model.train()
gen = torch.Generator().manual_seed(1)
input_ids = torch.randint(1, 128, (2, 24), generator=gen)
attention_mask = torch.ones_like(input_ids)
attention_mask[1, :5] = 0  # left padding on one row
labels = input_ids.clone()
labels[attention_mask == 0] = -100
labels[0, :3] = -100
out_model = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
out_model.loss.backward()
# Again with gradient checkpointing: the series also patches GradientCheckpointingLayer (StreamBP).
checkpointed = make_model(family, seed=0)
checkpointed.train()
checkpointed.gradient_checkpointing_enable()
checkpointed(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss.backward()
torch.save(
    {
        "file": transformers.__file__,
        "version": transformers.__version__,
        "loss": out_model.loss.detach(),
        "logits": out_model.logits.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "checkpointed_grads": {n: p.grad for n, p in checkpointed.named_parameters()},
    },
    out,
)
