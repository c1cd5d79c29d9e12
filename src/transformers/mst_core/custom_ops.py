"""What our `torch.library` custom operators share: a chunked computation that torch.compile must not trace (its
backward takes `torch.autograd.grad` per chunk) runs as an operator of the compiled graph whose kernels are our eager
code (streaming_backward/compiled.py: a streamed decoder layer; mini_sequence/compiled.py: the mini-sequence MLP, MoE
block and norms).

- A compiled graph cannot hold a module: modules get integer keys at model construction (`name_modules`), which the
  operators take as arguments and the kernels resolve (`named_module`).
- A custom operator's kernel runs below autograd and autocast (their dispatch keys excluded in thread-local state):
  `autocast_in_kernel` re-enters the autocast the traced call was under, `autograd_in_kernel` lets a backward kernel
  take `torch.autograd.grad`, by torch's dispatch-key guard (`torch._C._ForceDispatchKeyGuard`).
"""

import contextlib
import itertools
import weakref

import torch

from .._mst_version import LOCAL_VERSION

def op_name(name: str) -> str:
    """The qualified name of our operator `name`, with this release in it: torch.compile's caches (AOTAutograd's and
    inductor's, on disk) key a compiled graph on its operators' names, not on their Python autograd formulas, which are
    traced into the compiled backward; one name per release keeps a graph compiled by an older release from running
    with this one's kernels."""
    return f"transformers_mst::{name}_{LOCAL_VERSION.replace('.', '')}"


_KEYS = itertools.count()
_MODULES = {}  # key -> weak reference to the module


def name_modules(modules) -> None:
    """Give each of `modules` a key (`module._mst_op_key`) the operators can name it by, once."""
    for module in modules:
        if getattr(module, "_mst_op_key", None) is None:
            key = next(_KEYS)
            module._mst_op_key = key
            _MODULES[key] = weakref.ref(module)


def module_key(module) -> int | None:
    """`module`'s key, or None where it has none of its own (never named, or a deep copy of a named module, which
    copies the attribute)."""
    key = getattr(module, "_mst_op_key", None)
    if key is None or _MODULES[key]() is not module:
        return None
    return key


def named_module(key: int):
    return _MODULES[key]()


def can_run_eager_kernels() -> bool:
    """Whether this torch has the private guard the kernels need (torch 2.13 does)."""
    return hasattr(torch._C, "_ForceDispatchKeyGuard")


def autocast_text(device_type: str) -> str:
    """The autocast contexts in force, as text an operator can take (`autocast_entry` reads each entry back)."""
    parts = []
    for dev in dict.fromkeys([device_type, "cpu"]):
        if torch.is_autocast_enabled(dev):
            parts.append(f"@autocast={dev},{str(torch.get_autocast_dtype(dev)).removeprefix('torch.')}")
    return ";".join(parts)


def autocast_entry(spec: str):
    """(device type, dtype) from one `@autocast=` entry's value, as `autocast_text` wrote it."""
    dev, dtype = spec.split(",")
    return dev, getattr(torch, dtype)


_AUTOCAST_KEYS = [
    key for key in ("AutocastCPU", "AutocastCUDA", "AutocastXPU", "AutocastMPS") if hasattr(torch._C.DispatchKey, key)
]


@contextlib.contextmanager
def autocast_in_kernel(autocast):
    """The autocast contexts [(device type, dtype)] the traced call was under, inside a custom operator's kernel,
    which runs with the autocast dispatch keys excluded in thread-local state (nothing changes where there were
    none). Without autocast's cache of casts: it keys on the tensor and lives until the user's outermost autocast
    context exits, so a cast made here without graph would be handed to a backward kernel's recompute (and a chunk's
    leaf's cast to the next chunk's leaf at the same address), which then got no gradient (measured: a compiled step
    whose backward ran inside the user's autocast raised for a missing gradient)."""
    if not autocast:
        yield
        return
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in _AUTOCAST_KEYS:
        exclude = exclude.remove(getattr(torch._C.DispatchKey, name))
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude))
        for dev, dtype in autocast:
            stack.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=False))
        yield


def kernel_autocast_state(autocast, device_type: str):
    """`autocast` [(device type, dtype)] as `replay.restore_autocast_state` takes it in a backward kernel, every device
    type's state explicit: `autograd_in_kernel` lifts the exclusion of the autocast dispatch keys, which is what keeps
    autocast off. Without autocast's cache of casts (`autocast_in_kernel` says why)."""
    enabled = dict(autocast)
    states = [(dev, dev in enabled, enabled.get(dev, torch.get_autocast_dtype(dev)))
              for dev in dict.fromkeys([device_type, "cpu"])]
    return states, False


@contextlib.contextmanager
def autograd_in_kernel():
    """Autograd inside a backward operator's kernel: it runs below autograd, with the autograd and autocast dispatch
    keys excluded and ADInplaceOrView included in thread-local state, as a custom operator's kernel does; our chunked
    backwards need `torch.autograd.grad`. Autocast's keys are no longer excluded either, and their exclusion is what
    keeps autocast off: the backward must set every device type's autocast state itself (`restore_autocast_state`
    with each one's `enabled`; measured: without it a fp32 MLP's backward ran in CPU autocast's bf16)."""
    keys = torch._C.DispatchKey
    include = torch._C._dispatch_tls_local_include_set()
    if include.has(keys.ADInplaceOrView):
        include = include.remove(keys.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(include, torch._C.DispatchKeySet(keys.Undefined)):
        yield
