"""MoE router logits and the token-major outputs of MoE blocks, for the chunked paths (mini_sequence/moe.py and mlp.py,
streaming_backward/router.py and layer.py).

The blocks flatten their input to tokens in (batch, position) order, so their per-token outputs (router logits and
scores) are token-major [batch * positions, *]: `positions` views them per position, `token_major` joins the chunks'.
Upstream records router logits with an output-capturing forward hook on the router (utils/output_capturing.py);
a chunked caller gives each chunk a collector of its own (`own_router_collector`) and records the whole once.
"""

import contextlib

import torch


ROUTER_LOGITS = "router_logits"  # the output-capturing key of MoE routers' logits (output_router_logits=True)


def is_output_capturing_hook(hook, key: str) -> bool:
    """Whether `hook` is upstream's output-capturing forward hook for `key` (utils/output_capturing.py's
    `install_output_capuring_hook(module, key, ...)`). It only appends the module's output to the running forward's
    collector, which a chunked caller that handles `key` sets itself (mini_sequence/moe.py,
    streaming_backward/router.py); it swaps no weight."""
    code = getattr(hook, "__code__", None)
    if code is None or code.co_name != "output_capturing_hook":
        return False
    if not (getattr(hook, "__module__", None) or "").endswith("utils.output_capturing"):
        return False
    cells = dict(zip(code.co_freevars, (cell.cell_contents for cell in hook.__closure__ or ())))
    return cells.get("key") == key


@contextlib.contextmanager
def own_router_collector():
    """Upstream's output collector (utils/output_capturing.py) set to one of ours, recording router logits only,
    while a chunked caller runs one chunk of an MoE block or layer (mini_sequence/moe.py,
    streaming_backward/router.py); yields its dict. Where the model's collector was set while dynamo traced, upstream's
    `CompileableContextVar` is a plain global until the model resets it, also in code that runs eagerly inside the
    compiled model (a streamed layer, `torch.compiler.disable`d): ours is then set, and the model's put back, by value
    (its `set` outside a trace would go to the context variable, which `get` no longer reads; its `reset` would
    drop the model's)."""
    from ..utils import output_capturing

    variable = output_capturing._active_collector
    model_collector = variable.get()
    collected = {ROUTER_LOGITS: []}
    if variable.compiling:
        variable.global_var, token = collected, None
    else:
        token = variable.set(collected)  # None while dynamo traces: a plain global from here on
    try:
        yield collected
    finally:
        if token is None:
            variable.global_var = model_collector
        else:
            variable.reset(token)


def positions(output: torch.Tensor, batch_shape) -> torch.Tensor:
    """A token-major output [batch * positions, *] viewed as [*batch, positions, *] (no copy: `output` is contiguous)."""
    return output.view(*batch_shape, -1, *output.shape[1:])


def token_major(per_chunk: list, batch_shape) -> torch.Tensor:
    """[tokens of the whole sequence, ...] in (batch, position) order, from one [batch * chunk, ...] per chunk (a
    chunk's rows are its rows of each batch)."""
    tail = per_chunk[0].shape[1:]
    # each [batch * c, *tail] -> [*batch, c, *tail]; joined along positions; -> [batch * S, *tail]
    return torch.cat([t.reshape(*batch_shape, -1, *tail) for t in per_chunk], dim=len(batch_shape)).reshape(-1, *tail)
