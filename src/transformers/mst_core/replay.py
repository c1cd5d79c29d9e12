"""Autocast and RNG state capture and replay, so that a recomputation in backward sees exactly what the forward
saw (the same idea as torch.utils.checkpoint): used by every Function that recomputes (mini_sequence/mlp.py,
streaming_backward/layer.py)."""

import contextlib

import torch


def capture_autocast_state(device_type: str):
    """Autocast settings for ``device_type`` and for ``cpu`` (checkpoint records both too)."""
    states = []
    for dev in dict.fromkeys([device_type, "cpu"]):  # ordered, deduplicated
        try:
            states.append((dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)))
        except RuntimeError:  # device type without autocast support
            continue
    return states, torch.is_autocast_cache_enabled()


@contextlib.contextmanager
def restore_autocast_state(captured):
    states, cache_enabled = captured
    with contextlib.ExitStack() as stack:
        for dev, enabled, dtype in states:
            stack.enter_context(torch.autocast(dev, enabled=enabled, dtype=dtype, cache_enabled=cache_enabled))
        yield


def capture_rng_state(device: torch.device):
    """CPU generator state, plus the CUDA generator of ``device`` when it is a CUDA tensor."""
    cpu_state = torch.get_rng_state()
    device_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return cpu_state, device_state


@contextlib.contextmanager
def restore_rng_state(states, device: torch.device):
    """Run the block with the captured RNG state, then put the current state back, so that a
    recomputation draws the same dropout masks as the forward and leaves no trace."""
    cpu_state, device_state = states
    devices = [device] if device_state is not None else []
    with torch.random.fork_rng(devices=devices, enabled=True, device_type="cuda"):
        torch.set_rng_state(cpu_state)
        if device_state is not None:
            torch.cuda.set_rng_state(device_state, device)
        yield
