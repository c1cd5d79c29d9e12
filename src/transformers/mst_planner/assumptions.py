"""What the planner's figures assume and leave out: printed with every result (and in --json)."""

ASSUMPTIONS = """
- batch 1; pure bf16 training: bf16 weights, activations and gradients, no fp32 master copy;
- optimizer states: `adamw` 2 fp32 tensors per parameter, `adamw-bf16` 2 bf16, `none` nothing;
  the optimizer step itself is in place (no foreach temporaries);
- `--optimizer-in-backward`: each gradient is applied and freed as soon as it is accumulated
  (paper App. D), so gradients never all live at once;
- attention is FlashAttention-style: only its output and a [B, H, S] fp32 log-sum-exp are kept
  for backward, no [S, S] tensor, no K/V expanded to all heads (upstream's own attention is
  replaced during planning by a stand-in that allocates just that, for every family; Gemma-2's
  softcapped attention is assumed to have such a kernel too). Checked on fake CPU: torch's SDPA
  itself takes its flash CPU kernel (no [S, S] scores) and its step peak equals the stand-in's,
  but HF's mask code, given fake tensors under gradient checkpointing, builds an [S, S] bool mask
  that a real run does not; the stand-in avoids that artefact;
- "mini_sequence" is `mini_sequence_chunk="auto"`; gradient checkpointing is upstream's
  `activation_checkpointing_enable()` (5.x name of `gradient_checkpointing_enable`; non-reentrant);
- "streaming" is `streaming_backward_chunk` = --streaming-chunk (default "auto"), without
  checkpointing (it replaces it): each decoder layer keeps its input, and its backward recomputes
  K/V and then one query chunk at a time; the stand-in attention runs each chunk against its causal
  key prefix with no mask tensor, as FlashAttention does: with attn_implementation="sdpa" on CUDA a
  plainly causal batch (no padding, packing or window shorter than it) takes torch's lower-right
  causal bias, which dispatches to that kernel (not run on a GPU here); a batch with a mask builds a
  [chunk, prefix] mask per chunk and repeats K/V to all heads (HF's SDPA path), not counted here;
- MoE layers (Mixtral, Qwen3-MoE, GPT-OSS) run upstream's default `grouped_mm` experts path: each
  token's top-k copies are gathered, sorted by expert and multiplied, so the memory does not depend
  on the routing; GPT-OSS's attention sinks are assumed to be in the FlashAttention-style kernel too;
  a method whose path a family lacks (streaming on GPT-OSS) is listed as not planned, with the reason;
- recurrent layers run the GPU kernels upstream takes where their packages are installed, each
  replaced during planning by a stand-in that allocates what the kernel's forward keeps and its
  backward allocates (standins.py), for every family with such layers:
  Gated DeltaNet (Qwen3.5, Qwen3-Next, OLMo-Hybrid): flash-linear-attention's chunked kernel (read at
  fla commit bc3b101): it keeps the normalized q/k, the gates' chunk sums and the solved
  [B, S, H_v, 64] intra-chunk matrices, and its backward recomputes every 64-token chunk's start
  state [B, S/64, H_v, K, V] and writes their gradients beside them (Hopper tiling);
  Mamba2 mixers (Granite-4.0-H, Nemotron-H, Falcon-H1, Bamba, Zamba2, Mamba2): mamba_ssm's kernels
  (read at mamba commit e9594ce): unstreamed layers its fused mixer (convolution, scan, gated norm,
  output projection: it keeps the projected input and the scan's output), streamed chunks its
  chunked scan from the carried state; the backward recomputes every chunk's state
  [B, S/L, H, P, N] in fp32 (L: the config's chunk size) beside their gradients (132 SMs, as an
  H100 / H200 has, where a kernel splits its sums over heads by it); workspaces of [B, H, S/L]
  and smaller are left out. Streamed Mamba2 chunks and Gated DeltaNet layers run their short
  convolution by upstream's torch path (causal_conv1d not stood in for). Mamba (v1) mixers (Mamba,
  FalconMamba, Jamba, Zamba): mamba_ssm's selective scan (read at mamba commit 01887ed: it keeps
  its inputs and one fp32 state [B, D, 2N] per 2048 tokens; its backward writes the B/C/A/D
  gradients in fp32) and causal-conv1d's convolution (commit 17f4f2f); unstreamed Mamba and
  FalconMamba layers its fused mixer (`mamba_inner_fn`: it keeps the projected input, x's
  projection, B, C, the chunk states and the scan's output, and recomputes the convolution and
  delta in its backward); streamed chunks scan by our torch scan from the carried state (the
  kernel takes none), in 128-token shards, each holding [shard, B, D, N] fp32 terms (stood in
  for too: one shard's working set);
Left out: the CUDA context and library workspaces (cuBLAS, NCCL: typically 0.5-2 GiB),
allocator fragmentation and caching, kernels' scratch memory (e.g. FlashAttention-2's backward
allocates an fp32 dq accumulator and, with GQA, K/V gradients expanded to all heads: up to about
4x the bytes of one layer's query), and other processes. Keep a margin.
"""

MULTI_GPU_ASSUMPTIONS = """
Multi-GPU (--gpus/--zero/--sp/--offload), per GPU (rank); every figure is an estimate:
- the rank's step is measured like the one-GPU step, on its own work: with Ulysses sp it runs S/sp
  tokens through embedding, norms, MLPs and the LM-head loss, and its attention stand-in does the
  all-to-alls: it keeps q/k/v for H/sp heads (key/value: H_kv/sp, or one replicated head when
  H_kv < sp) over all S tokens, their output and log-sum-exp, plus one transient send buffer per
  all-to-all, and in backward the same for the gradients. A streamed layer (ulysses/streamed.py)
  gathers its shard's K/V into the whole sequence's for H_kv/sp heads once per pass (H_kv must be
  divisible by sp there) and sends one query chunk at a time through the all-to-alls;
- states: bf16 weights, optimizer states per --optimizer. ZeRO shards over all --gpus ranks:
  ZeRO-1 keeps ceil(P/N) parameters' optimizer states, ZeRO-2 also reduce-scatters each gradient
  as soon as it is accumulated (measured in the step: the full gradient is freed and a 1/N bf16
  partition kept), ZeRO-3 also keeps only 1/N of the weights and, measured in the step, gathers
  the full parameters of one module at a time (each module with parameters of its own, like
  DeepSpeed) for its forward, its recomputation and its backward. Its hooks make the
  mini-sequence Functions take their checkpointed-chunk path, as under real ZeRO-3;
- --offload optimizer: the optimizer states (fp32 master weights included with
  adamw-fp32-master) live in host memory and the step runs there; gradients stay on the GPU as
  the ZeRO stage shards them;
- --offload inputs (with checkpointing or streaming): `activation_checkpointing_enable(offload=True)`:
  each decoder layer's checkpointed (streamed: saved) input [S/sp, d] goes to host memory in forward.
  Checkpointed layers: in backward one is on the GPU in use (whole, for the layer's whole backward)
  and one more in flight (prefetch). Streamed layers bring theirs back one query chunk at a time, as
  the library does (streaming_backward/offload.py HostStorage: the planner counts its host copies, the chunks it loads
  are allocated on the GPU). Under ZeRO-3 the streamed layers run nested checkpoints under torch's
  `save_on_cpu` (every tensor their forward saves goes to the host: counted as host memory, brought
  back as a new GPU tensor when the backward unpacks it);
- left out as well: DeepSpeed's communication buckets (reduce_bucket_size, stage3 prefetch and
  max-live-parameters buffers: set them small), NCCL buffers, parameter prefetching beyond one
  module, pinned-memory staging; host memory counts only offloaded tensors (per GPU: multiply by
  the GPUs of a node for the node's total), not the processes themselves.
"""
