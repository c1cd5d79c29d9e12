"""Chunk-policy overrides for one run of scripts/cuda_check.py or scripts/lm_head_anchors.py, so that a GPU session
can time one build under several policies in one device call (scripts/cuda_ab.sh's `policy_*` parts) instead of
building a wheel per policy. They set, for this process only, what `"auto"` means in the distribution; the runs
record them in their reports. None is set unless asked for.

  --mlp-chunk N           tokens per MLP (and final-norm) mini-sequence where mini_sequence_chunk is "auto" (the
                          distribution: hidden_size, MsT arXiv 2407.15892 §3.4, on CUDA at least 4096 since
                          5.24.0+mst.29; --mlp-chunk 2048 is the earlier policy at d = 2048); the LM head keeps its own
                          "auto".
                          Fewer, longer chunks: less host work per step (one module forward and one autograd.grad per
                          chunk), more activation memory (one chunk's [C, intermediate_size] tensors).
  --lm-head-min-tokens N  mini_sequence/config.py's AUTO_MIN_LM_HEAD_TOKENS (the distribution: 1024).
  --row-blocks N          mini_sequence/loss.py's _ROW_BLOCKS_PER_CHUNK (the distribution: 8): fewer, taller fp32
                          row blocks in the LM-head loss, for more memory.
  --fused-loss off        the LM-head loss's fp32 passes as eager row blocks (mini_sequence/fused_loss.py), as
                          before 5.24.0+mst.29, instead of its compiled kernels (on CUDA).
  --head accumulating     never the vocabulary-sliced LM head (mini_sequence/loss.py), for a speed comparison where
                          the planner says slicing lowers no peak (docs/cuda/README.md); "auto" (default): the
                          distribution's rule.

The planner runs the same code (fake tensors), so `cuda_check.py --planner-only` with the same overrides gives the
matching estimates for `--merge-planner`."""

import argparse


def positive_int(value):
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: allowed a positive int")
    return int(value)


def add_arguments(parser):
    group = parser.add_argument_group("chunk-policy overrides (scripts/policy_overrides.py), for GPU A/B runs")
    group.add_argument("--mlp-chunk", type=positive_int, help='tokens per MLP mini-sequence where the field is "auto"')
    group.add_argument("--lm-head-min-tokens", type=positive_int, help="AUTO_MIN_LM_HEAD_TOKENS for this run")
    group.add_argument("--row-blocks", type=positive_int, help="fp32 row blocks per LM-head chunk for this run")
    group.add_argument("--fused-loss", choices=["auto", "off"], default="auto",
                       help="off: the LM-head loss's eager row blocks, not its compiled kernels (fused_loss.py)")
    group.add_argument("--head", choices=["auto", "accumulating"], default="auto",
                       help="accumulating: never the vocabulary-sliced LM head")


def apply(args) -> dict:
    """Set the overrides `args` asks for; return them ({} if none), for the run's report."""
    from transformers.mini_sequence import config, integration, loss

    applied = {}
    if args.mlp_chunk is not None:
        distribution_policy = config.mlp_chunk_size

        def mlp_chunk_size(value, hidden_size, device_type="cpu"):
            return args.mlp_chunk if value == "auto" else distribution_policy(value, hidden_size, device_type)

        integration.mlp_chunk_size = mlp_chunk_size  # the one caller (mini_sequence/integration.py)
        applied["mlp_chunk"] = args.mlp_chunk
    if args.lm_head_min_tokens is not None:
        config.AUTO_MIN_LM_HEAD_TOKENS = args.lm_head_min_tokens  # read at each call of lm_head_chunk_size
        applied["lm_head_min_tokens"] = args.lm_head_min_tokens
    if args.row_blocks is not None:
        loss._ROW_BLOCKS_PER_CHUNK = args.row_blocks  # read at each call of the loss
        applied["row_blocks"] = args.row_blocks
    if args.fused_loss == "off":
        from transformers.mini_sequence import fused_loss  # since 5.24.0+mst.29 (an older build has none to turn off)

        fused_loss.DEVICES.clear()  # read at each call of the loss
        applied["fused_loss"] = args.fused_loss
    if args.head == "accumulating":
        loss._vocab_sliced_backward_pays = lambda *args: False  # the rule's one caller reads it at each call
        applied["head"] = args.head
    if applied:
        print(f"chunk-policy overrides for this run: {applied}", flush=True)
    return applied
