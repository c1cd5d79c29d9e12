"""What the patched Mamba / FalconMamba mixers call (two lines each).

`selective_scan_for(mixer, upstream_scan)` returns the scan the mixer's full-sequence path should
call: upstream's `mamba_selective_scan` unless `config.adjoint_sharding_chunk` is set and the mixer
is training with gradients, then the adjoint-sharded scan (same arguments and results); in a chunk of a
layer streamed through its state (`streaming_backward_chunk`, also Jamba's mixer), ours from that state.
`causal_conv_for(mixer, upstream_conv)` likewise for the causal conv (only differs when the sequence
is split across processes, see `sequence.py`).
`uses_fused_kernel(mixer)` tells the mixer whether it may take its fused CUDA kernel shortcut.
"""

import functools

import torch

from ..mst_core.chunks import carried_states
from .config import shard_tokens
from .scan import selective_scan


def enabled(config) -> bool:
    """Whether `config` asks for adjoint sharding (`getattr`: configs without the field run upstream's path)."""
    return getattr(config, "adjoint_sharding_chunk", None) is not None


def applies(mixer) -> bool:
    """Adjoint sharding runs where a backward will follow: training mode with gradients enabled."""
    return enabled(mixer.config) and mixer.training and torch.is_grad_enabled()


def selective_scan_for(mixer, upstream_scan):
    seam = carried_states()
    if seam is not None:
        # A chunk of a layer streamed through its state (streaming_backward/recurrent.py): upstream's scan would start
        # from zero, ours starts from the state the previous chunk ended with (a leaf in the chunk's recompute, whose
        # gradient the scan returns). In adjoint sharding's shards (the field's, else its "auto" size): the scan's
        # [shard, B, D, N] fp32 working set, not the chunk's (since mst.41; measured in config.py).
        chunk = getattr(mixer.config, "adjoint_sharding_chunk", None)
        initial_state = seam.get_recurrent_state(mixer.layer_idx)  # as the mixer reads it (None: the first chunk)
        return functools.partial(_scan_from, initial_state, shard_tokens("auto" if chunk is None else chunk))
    if not applies(mixer):
        return upstream_scan
    config = mixer.config
    return functools.partial(
        selective_scan,
        shard=shard_tokens(config.adjoint_sharding_chunk),
        truncation=getattr(config, "adjoint_truncation", None),
        link=getattr(mixer, "_mst_sequence_link", None),
    )


def _scan_from(initial_state, shard, hidden_states, *args, **kwargs):
    """Our selective scan from `initial_state` (None: zeros) over one streamed chunk's tokens ([B, D, T])."""
    return selective_scan(hidden_states, *args, shard=shard, initial_state=initial_state, **kwargs)


def causal_conv_for(mixer, upstream_conv):
    """The mixer's causal conv: upstream's, unless the sequence is split across processes
    (`sequence.shard_sequence`), where a part's first outputs read the previous part's last inputs."""
    link = getattr(mixer, "_mst_sequence_link", None)
    if link is None or not applies(mixer):
        return upstream_conv
    from .sequence import causal_conv

    return functools.partial(causal_conv, upstream_conv, link)


def uses_fused_kernel(mixer) -> bool:
    """False when adjoint sharding applies: upstream's fused `mamba_inner_fn` (CUDA, `mamba_ssm`) would
    otherwise run instead and the flag would be silently ignored. With the flag on, the mixer takes
    its unfused path (conv, projections, our scan), whatever kernels are installed."""
    return not applies(mixer)
