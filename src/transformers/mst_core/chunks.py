"""Chunk state shared by the methods: whether this thread is running a decoder layer on one streamed query chunk
(streaming_backward/layer.py), the states a streamed recurrent chunk carries in (`carrying_states`), and which device's
"auto" chunk policies apply (`policy_device_type`).

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
def _thread_value(name, value):
    """`_state.<name>` set to `value` inside the block, its previous value (or None) restored after."""
    previous = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


@contextlib.contextmanager
def carrying_states(seam):
    """While a streamed recurrent chunk runs its layer's forward (streaming_backward/recurrent.py), the cache it hands
    the layer (`StateSeam`): a mixer whose upstream scan starts every call from a zero state (Mamba's, FalconMamba's,
    Jamba's selective scan reads the cache's state only in its one-token decode step) takes ours from the seam's state
    instead (adjoint_sharding/integration.py `selective_scan_for`)."""
    with _thread_value("seam", seam):
        yield


def carried_states():
    """The `StateSeam` of the streamed recurrent chunk running in this thread, or None."""
    return getattr(_state, "seam", None)


@contextlib.contextmanager
def chunk_policy_for(device_type: str):
    """The "auto" chunk policies of `device_type` inside the block (mini_sequence/config.py, streaming_backward/
    config.py: an accelerator takes longer chunks than the CPU), whatever device the tensors are on: the planner
    stands in for a GPU with (fake) CPU tensors (mst_planner/plan.py)."""
    with _thread_value("policy_device_type", device_type):
        yield


def policy_device_type(tensor) -> str:
    """The device type whose "auto" chunk policies apply to `tensor`: its own, or `chunk_policy_for`'s."""
    return getattr(_state, "policy_device_type", None) or tensor.device.type
