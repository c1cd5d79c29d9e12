"""Whether this thread is running a decoder layer on one streamed query chunk (streaming_backward/layer.py).

There the mini-sequence MLP / MoE blocks run unsplit (mini_sequence/integration.py): the streamed chunk already
bounds their working set to its own tokens, and a chunked Function inside the chunk's recompute would run the MLP a
third time in the step (its backward recomputes every mini-sequence once more), where checkpointing runs it twice."""

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
