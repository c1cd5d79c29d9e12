"""Chunk state shared by the methods: whether this thread is running a decoder layer on one streamed query chunk
(streaming_backward/layer.py), and which device's "auto" chunk policies apply (`policy_device_type`).

Inside a streamed chunk the mini-sequence MLP / MoE blocks run unsplit (mini_sequence/integration.py): the streamed
chunk already bounds their working set to its own tokens, and a chunked Function inside the chunk's recompute would
run the MLP a third time in the step (its backward recomputes every mini-sequence once more), where checkpointing runs
it twice."""

import contextlib
import threading

_state = threading.local()


@contextlib.contextmanager
def one_streamed_chunk():
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def inside_streamed_chunk() -> bool:
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def chunk_policy_for(device_type: str):
    """The "auto" chunk policies of `device_type` inside the block (mini_sequence/config.py, streaming_backward/
    config.py: an accelerator takes longer chunks than the CPU), whatever device the tensors are on: the planner
    stands in for a GPU with (fake) CPU tensors (mst_planner/plan.py)."""
    previous = getattr(_state, "policy_device_type", None)
    _state.policy_device_type = device_type
    try:
        yield
    finally:
        _state.policy_device_type = previous


def policy_device_type(tensor) -> str:
    """The device type whose "auto" chunk policies apply to `tensor`: its own, or `chunk_policy_for`'s."""
    return getattr(_state, "policy_device_type", None) or tensor.device.type
