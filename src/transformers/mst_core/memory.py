"""Exact live-tensor memory accounting without a GPU (what "memory saved" means: docs/measurements.md).

``LiveTensorTracker`` is a ``TorchDispatchMode``: every tensor an operator returns is looked
at, its untyped storage is counted once (storages are deduplicated by identity, so views and
in-place results add nothing), and a weakref callback subtracts the storage's bytes when
it is freed. This gives the exact peak of live tensor bytes created while the mode is active,
on any device, including CPU.

Baseline: storages that already existed when the tracker was entered (parameters, inputs)
are not counted; only allocations made inside the ``with`` block count, and the peak is
relative to that baseline of 0. Storages allocated inside and still alive at exit stay in
``current_bytes``.

Operators defined in Python with ``torch.library.custom_op`` run their body under the tracker, so that its
temporaries count. Limits: allocations made outside the dispatcher (e.g. by a C++ autograd kernel that
allocates without returning the tensor through an operator call) are invisible; gradient
tensors created by the autograd engine for accumulation go through operators and are seen.
"""

import weakref

import torch
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveTensorTracker(TorchDispatchMode):
    """Tracks live tensor storages created while active.

    Attributes:
        current_bytes: bytes of tracked storages alive now.
        peak_bytes: maximum of ``current_bytes`` seen.
        window_peak: maximum of ``current_bytes`` since a caller last set it (the planner's phases, layer_phases.py).
        largest_numel: element count of the largest newly allocated tensor.
        largest_shapes: up to ``keep_largest`` (numel, shape, op name) records, largest first.
    """

    def __init__(self, keep_largest: int = 5):
        super().__init__()
        self.keep_largest = keep_largest
        self.current_bytes = 0
        self.peak_bytes = 0
        self.window_peak = 0
        self.largest_numel = 0
        self.largest_shapes = []
        self._live = {}  # id(storage) -> (weakref to storage, nbytes)

    def _on_free(self, key, nbytes, _ref):
        if self._live.pop(key, None) is not None:
            self.current_bytes -= nbytes

    def _track(self, tensor: torch.Tensor, func):
        storage = tensor.untyped_storage()
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            return  # already counted (a view, an in-place result, or an out= argument)
        nbytes = storage.nbytes()
        numel = tensor.numel()
        self.largest_numel = max(self.largest_numel, numel)
        if self.keep_largest and (
            len(self.largest_shapes) < self.keep_largest or numel > self.largest_shapes[-1][0]
        ):
            self.largest_shapes.append((numel, tuple(tensor.shape), str(func)))
            self.largest_shapes.sort(key=lambda r: r[0], reverse=True)
            del self.largest_shapes[self.keep_largest :]
        # The callback runs when the storage's Python object dies, i.e. when the last tensor
        # using it is freed (storages keep their Python object alive as long as they live).
        ref = weakref.ref(storage, lambda r, k=key, n=nbytes: self._on_free(k, n, r))
        self._live[key] = (ref, nbytes)
        self.current_bytes += nbytes
        if self.current_bytes > self.window_peak:
            self.window_peak = self.current_bytes
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = _OP_KINDS.get(func)
        if kind is None:
            kind = _OP_KINDS[func] = _op_kind(func)
        if kind is _CUSTOM:
            # A `torch.library.custom_op` is one call to a dispatch mode: the temporaries of its Python body would
            # not be seen (torch's chunked F.linear_cross_entropy is one; its [chunk, V] logits went uncounted, the
            # LM-head anchors in docs/measurements.md). Run the body here, under this mode: every tensor it
            # allocates, the outputs included, is tracked.
            with self:
                return _maybe_get_opdef(func)._init_fn(*args, **kwargs)
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and kind is _FRESH:  # the common case, without flattening
            self._track(out, func)
            return out
        # In-place / out= ops return an existing tensor: it is only new if its storage is new.
        known_inputs = set()
        if kind is _ALIASING:
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, torch.Tensor):
                    known_inputs.add(id(a.untyped_storage()))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in known_inputs:
                self._track(t, func)
        return out


# What the tracker needs to know of an operator, looked up once per operator (the planner dispatches ~10^5 calls a step).
_CUSTOM, _ALIASING, _FRESH = "custom", "aliasing", "fresh"
_OP_KINDS = {}


def _op_kind(func):
    if _maybe_get_opdef(func) is not None:
        return _CUSTOM
    if func._schema.is_mutable or any(a.alias_info is not None for a in func._schema.returns):
        return _ALIASING  # in-place, out= or a view: its output may be an input's storage
    return _FRESH


def resident_training_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """Bytes of the weights and optimizer states: what is alive before a training step starts.

    Add it to a ``LiveTensorTracker`` peak of the step to get the quantity a GPU allocator's
    ``max_memory_allocated`` reports (weights + optimizer states + what the step allocates).
    """
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    return sum(t.numel() * t.element_size() for t in tensors)
