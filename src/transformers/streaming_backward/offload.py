"""Where a streamed layer keeps its input for backward: on the accelerator, as checkpointing keeps it, or in host
memory when checkpointing was enabled with offload=True (`activation_checkpointing_enable(offload=True)`, which
streaming replaces for the layers it streams); the backward reads it back one chunk of rows at a time."""

import contextlib

import torch


class HostStorage:
    """An offloaded streamed layer's input: a host copy (pinned when the input is on an accelerator, as upstream's
    `save_on_cpu(pin_memory=True)` does), read back by row ranges. The copies run on the current stream, like
    upstream's offload."""

    def save(self, x: torch.Tensor):
        pinnable = x.device.type != "cpu" and torch.get_device_module(x.device).is_available()
        host = torch.empty(x.shape, dtype=x.dtype, pin_memory=pinnable)
        host.copy_(x, non_blocking=pinnable)
        return host

    def load(self, saved, start: int, end: int, device: torch.device) -> torch.Tensor:
        """Rows [start, end) of the saved input, on `device`."""
        return saved[:, start:end].to(device, non_blocking=saved.is_pinned())


class SavedInput:
    """A streamed layer's input in host memory, read back rows [start, end) at a time."""

    def __init__(self, x: torch.Tensor, storage):
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.storage = storage
        self.saved = storage.save(x)

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.storage.load(self.saved, start, end, self.device)


class KeptInput:
    """A streamed layer's input kept on its device (as checkpointing keeps it), read like `SavedInput`."""

    def __init__(self, x: torch.Tensor):
        self.saved, self.dtype = x, x.dtype

    def rows(self, start: int, end: int) -> torch.Tensor:
        return self.saved[:, start:end]


def keep_input(ctx, x: torch.Tensor, storage) -> None:
    """Keep a streamed layer's input for its backward (both streamed Functions): in `storage` where offload was
    requested (`input_storage`), else saved for backward on its device, as checkpointing saves it."""
    if storage is not None:
        ctx.saved_input = SavedInput(x, storage)
    else:
        ctx.save_for_backward(x)
        ctx.saved_input = None


def kept_input(ctx):
    """The input `keep_input` kept, read by row ranges (`rows`)."""
    return ctx.saved_input if ctx.saved_input is not None else KeptInput(ctx.saved_tensors[0])


def offload_requested(layer) -> bool:
    """Whether the layer's checkpointing, which streaming replaces, was enabled with offload=True (upstream's
    `activation_checkpointing_enable` tags the function it installs; patch 0013)."""
    return bool(layer.gradient_checkpointing and getattr(layer._gradient_checkpointing_func, "offload", False))


def input_storage(layer):
    """Where the streamed layer keeps its input for backward: None (on its device) unless offload was requested;
    then a `HostStorage`, or the tag itself when it is an object with `save` and `load` like HostStorage's. That is
    an extension point: the planner tags the function with a stand-in that holds no bytes and counts them."""
    if not offload_requested(layer):
        return None
    tag = layer._gradient_checkpointing_func.offload
    return tag if hasattr(tag, "save") and hasattr(tag, "load") else HostStorage()


def saved_tensors_offloaded(storage, device: torch.device):
    """For the wrappers' fallback (checkpointed chunks): where the input is offloaded (`storage` set), every tensor
    autograd saves goes to host memory too, as upstream's offloaded checkpointing puts them; else nothing changes.
    A storage with a `saved_tensors_hooks()` method gives those hooks instead (an extension point: the planner's
    stand-in counts the host bytes)."""
    if storage is None:
        return contextlib.nullcontext()
    if hasattr(storage, "saved_tensors_hooks"):
        return storage.saved_tensors_hooks()
    return torch.autograd.graph.save_on_cpu(pin_memory=device.type != "cpu", device_type=device.type)
