"""Under torch.compile with gradient checkpointing: a layer's recomputation stays where eager autograd runs it.

Eagerly a checkpointed layer recomputes its forward when its output's gradient arrives, after the layer above it
is done. In a compiled backward inductor may fuse the loops of one layer's recomputation with the next layer's
gradient work horizontally (the two share reads: a Llama layer's recomputed rotary embedding and the layer above
it's rotary backward read the same cos/sin). The fused kernel runs at the earlier of the two places, so the whole
recomputation of the layer below (its norm, projections, rotary embedding) moves ahead of the layer above's
weight-gradient products, whose inputs then stay live through it. Measured (CPU, fp32 Llama d=256, 2 layers,
V=32000, 16K tokens, `mini_sequence+checkpointing`, peak above the step's start): 322.4 MiB compiled against 266.8
eager; with this rule 260.6 (docs/limits.md).

`RecomputeStaysInItsRegion` is an `InductorChoices` (inductor's documented seam for its heuristics,
`torch._inductor.choices`) that refuses such a horizontal fusion: in a backward graph holding one of our operators,
two nodes fuse side by side only if they recompute the same checkpointed regions (`ac_graph_id` of their origins
whose checkpoint policy is to recompute; none for gradient work). Every other decision is inductor's. It is
installed through `torch._inductor.config.inductor_choices_class` when a model with a field of ours is built
(`install`), unless a choices class of the user's is there (then a warning says so); graphs without our operators
are left to inductor's own heuristics, so a model without our fields compiles as upstream's.
"""

import functools
import sys
import weakref

from .._mst_version import LOCAL_VERSION
from ..utils import logging
from .model_checks import CONSTRUCTION_HOOKS, text_config
from .fields import MINI_SEQUENCE_FIELD, STREAMING_FIELD


logger = logging.get_logger(__name__)

OUR_NAMESPACE = "transformers_mst"
_HOLDS_OUR_OPERATORS = weakref.WeakKeyDictionary()  # inductor's GraphLowering -> bool


def _holds_our_operators(graph) -> bool:
    """Whether the graph inductor lowers calls one of our custom operators (mst_core/custom_ops.py)."""
    held = _HOLDS_OUR_OPERATORS.get(graph)
    if held is None:
        held = any(getattr(node.target, "namespace", None) == OUR_NAMESPACE
                   for node in graph.orig_gm.graph.nodes if node.op == "call_function")
        _HOLDS_OUR_OPERATORS[graph] = held
    return held


def recomputed_regions(scheduler_node) -> frozenset:
    """The checkpointed regions (`ac_graph_id`) whose recomputation `scheduler_node` (fused or not) runs."""
    from torch.utils.checkpoint import CheckpointPolicy

    recompute = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)
    regions = set()
    for node in scheduler_node.get_nodes():
        for origin in (node.node.get_origins() if node.node is not None else ()):
            if origin.meta.get("recompute") in recompute:
                regions.add(origin.meta.get("ac_graph_id"))
    return frozenset(regions)


@functools.cache
def _choices_class():
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class RecomputeStaysInItsRegion(InductorChoices):
        """Inductor's choices, but no horizontal fusion of one checkpointed region's recomputation with other work
        in a backward graph holding our operators (module docstring)."""

        def uuid(self):  # inductor's caches key compiled graphs on it
            return f"{OUR_NAMESPACE}.recompute_stays_in_its_region.{LOCAL_VERSION}"

        @staticmethod
        def can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            if not InductorChoices.can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
                return False
            if not (V.graph.is_backward and _holds_our_operators(V.graph)):
                return True
            return recomputed_regions(node1) == recomputed_regions(node2)

    return RecomputeStaysInItsRegion


def recompute_choices():
    """The factory `torch._inductor.config.inductor_choices_class` takes."""
    return _choices_class()()


def install(model) -> None:
    """At model construction, with a field of ours set: `recompute_choices` as inductor's choices class, unless one
    is set already (ours: nothing to do; the user's: a warning, and theirs stays)."""
    config = text_config(model.config)
    if all(getattr(config, field, None) is None for field in (MINI_SEQUENCE_FIELD, STREAMING_FIELD)):
        return
    import torch._inductor.config as inductor_config

    current = getattr(inductor_config, "inductor_choices_class", None)
    if current is recompute_choices:
        return
    if current is not None:
        logger.warning_once(
            f"torch._inductor.config.inductor_choices_class is set ({current!r}): transformers-mst leaves it, so a "
            "compiled checkpointed step may run a layer's recomputation early and peak higher (docs/limits.md)."
        )
        return
    inductor_config.inductor_choices_class = recompute_choices
    _replace_default_handler()


def _replace_default_handler() -> None:
    """Inductor makes its choices handler once per thread, from the config, when it first needs one: a thread that
    compiled before this model was built keeps inductor's plain default. This thread gets ours in its place. (No
    handler exists before inductor's choices module is imported: then nothing is imported here, a second.)"""
    if "torch._inductor.choices" not in sys.modules:
        return
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    if type(V.choices) is InductorChoices:
        V.set_choices_handler(recompute_choices())


CONSTRUCTION_HOOKS.append(install)
