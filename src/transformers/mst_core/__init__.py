"""What every method of transformers-mst shares, imported by them and never importing them (import arrows point
down: mst_core <- mini_sequence, streaming_backward, adjoint_sharding, ulysses <- their integration modules <-
patches; the planner, mst_planner/, on top):

- ``fields``: validation of every config field of ours (no torch);
- ``families``: the registry of model families, read by the model checks, the methods, the planner, the bench,
  the tests and the README's support matrix (no torch);
- ``model_checks``: what ``post_init`` and ``from_pretrained`` check (patches 0005, 0014; no torch at import);
- ``replay``: autocast and RNG capture and replay for recomputations;
- ``grads``: parameter gradients summed chunk by chunk (fp32 sums);
- ``wrappers``: which parameters a chunked Function may take under DDP, FSDP, ZeRO-3, PEFT, and the checks that
  no gradient goes missing;
- ``memory``: the live-tensor tracker that measures memory on any device;
- ``sharded_sequence``: the seam between sequence parallelism (``ulysses``) and a streamed layer
  (``streaming_backward``), neither importing the other.
- ``custom_ops``, ``host_mask``, ``recompute_fusion``: what our ``torch.compile`` operators share, the causal mask
  decided on the host under compile, and inductor's choices that keep a checkpointed layer's recompute in its turn.
"""
