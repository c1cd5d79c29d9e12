r"""How long a sequence fits on a GPU? Estimated on a CPU, without weights.

    python -m transformers.mst_planner --model llama3-8b --gpu-memory-gib 80 [--json]
    python -m transformers.mst_planner --model llama3-8b --gpu-memory-gib 80 \
        --gpus 8 --zero 3 --sp 8 --offload optimizer inputs   # per GPU of 8 (ZeRO-3, Ulysses)
    python -m transformers.mst_planner --model llama3-8b --gpu-memory-gib 80 \
        --methods mini_sequence+streaming --seq-len 1048576     # does this length fit? (no search)
    ... --jobs 1                       # the methods' searches in one process (default: one per CPU core)

For each method (vanilla, checkpointing, mini_sequence, mini_sequence+checkpointing, streaming,
mini_sequence+streaming) it runs one training step (forward + backward) of the full-size model under `FakeTensorMode` on the
CPU device (tensors have shapes and dtypes but no memory; a fake `cuda` device crashes the
CPU build of torch, so fake CPU stands in for the GPU), measures the peak of live tensor bytes
with `LiveTensorTracker`, adds the resident weights and optimizer states, and searches the
largest sequence length (a multiple of --granularity) whose peak fits in the GPU memory. The step runs a
shallow stack of the model's decoder layers, from whose phases the full depth's peak follows to the byte
(layer_phases.py).
With several GPUs it runs the step of one rank (its share of the tokens and heads, ZeRO's
sharded states and gathered parameters, offloaded tensors moved out) and reports that GPU's
peak and the host memory the rank's offloaded tensors take.

The assumptions every result states: assumptions.py. The stand-ins for the GPU-only parts of a step: standins.py;
the search: search.py; the command line: cli.py.
"""

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tqdm import tqdm

import transformers

from ..mst_core.chunks import chunk_policy_for
from ..streaming_backward import layer as streamed_layer
from ..streaming_backward import offload as streamed_offload
from ..mst_core.families import CHECKPOINTS, FAMILIES, streaming_model_types, streaming_refusal
from ..mst_core.fields import validate_streaming_backward_chunk
from ..mst_core.memory import LiveTensorTracker
from ..mst_core.model_checks import MINI_SEQUENCE_MODEL_TYPES, TEXT_CONFIG_LM_HEAD_MODEL_TYPES
from . import layer_phases
from .assumptions import ASSUMPTIONS, MULTI_GPU_ASSUMPTIONS
from .search import ForkedCall, search_in_processes, search_max_fitting
from .standins import StepHooks, attention_name, offloaded_checkpoint, recurrent_kernels_like


GIB = 2**30


class PlanError(ValueError):
    """Bad input to the planner; the message says what is wrong and what is allowed."""




class Method(NamedTuple):
    """The settings a planned (or benchmarked) method trains with."""

    mini_sequence_chunk: object  # None or "auto"
    checkpointing: bool  # upstream's activation_checkpointing_enable()
    streaming_backward_chunk: object = None  # None or "auto" (StreamBP; replaces checkpointing for its layers)


METHODS = {
    "vanilla": Method(None, False),
    "checkpointing": Method(None, True),
    "mini_sequence": Method("auto", False),
    "mini_sequence+checkpointing": Method("auto", True),
    "streaming": Method(None, False, "auto"),
    "mini_sequence+streaming": Method("auto", False, "auto"),
}
# per parameter; "adamw-fp32-master": DeepSpeed/Trainer bf16 mixed precision (fp32 master weights + 2 fp32 states)
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw-bf16": 4, "adamw-fp32-master": 12, "none": 0}
ZERO_STAGES = (0, 1, 2, 3)
OFFLOAD_CHOICES = ("optimizer", "inputs")  # optimizer states / checkpointed layer inputs in host memory
@dataclass(frozen=True)
class Parallel:
    """How one training step is spread over GPUs (see MULTI_GPU_ASSUMPTIONS)."""

    gpus: int = 1
    zero: int = 0
    sp: int = 1
    offload: tuple = ()  # subset of OFFLOAD_CHOICES

    @property
    def single(self):
        return self == Parallel()


def check_parallel(parallel: Parallel, config, granularity: int, optimizer_in_backward: bool):
    """Raise PlanError naming the setting and what is allowed; called before any measurement."""
    gpus, zero, sp = parallel.gpus, parallel.zero, parallel.sp
    if not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"--gpus {gpus!r}: must be a positive integer")
    if zero not in ZERO_STAGES:
        raise PlanError(f"--zero {zero!r}: allowed {', '.join(map(str, ZERO_STAGES))}")
    if not isinstance(sp, int) or sp < 1 or gpus % sp:
        raise PlanError(f"--sp {sp!r}: must be a positive integer dividing --gpus {gpus} "
                        f"(allowed: {', '.join(str(n) for n in range(1, gpus + 1) if gpus % n == 0)})")
    unknown = [o for o in parallel.offload if o not in OFFLOAD_CHOICES]
    if unknown:
        raise PlanError(f"--offload {' '.join(map(str, unknown))}: allowed {', '.join(OFFLOAD_CHOICES)} (or both)")
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:  # a state-space model (Mamba, Mamba2)
        if sp > 1:
            raise PlanError(f"--sp {sp}: Ulysses splits the attention heads over the sp ranks, and "
                            f"{config.model_type!r} has no attention layers (allowed: --sp 1)")
        heads = 1
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if heads % sp:
        raise PlanError(f"--sp {sp}: Ulysses splits the attention heads over the sp ranks, and {heads} query heads "
                        f"are not divisible by {sp} (allowed sp: divisors of {heads} that divide --gpus {gpus})")
    if kv_heads % sp and sp % kv_heads:
        raise PlanError(f"--sp {sp}: {kv_heads} key/value heads can neither be split over {sp} ranks nor "
                        f"replicated evenly (sp must divide, or be a multiple of, the key/value heads)")
    if granularity % sp:
        raise PlanError(f"--granularity {granularity}: must be a multiple of --sp {sp} (each rank holds S/sp tokens)")
    if optimizer_in_backward and zero:
        raise PlanError(f"--optimizer-in-backward with --zero {zero}: ZeRO applies the optimizer to its shards "
                        f"after the step; allowed only with --zero 0")


def _streaming_refusal(parallel: Parallel, config) -> str | None:
    """Why the streamed methods cannot be planned with these parallel settings (a sentence), or None. Under Ulysses
    a streamed layer splits the key/value heads over the ranks (ulysses/masks.py: check_streamable)."""
    if parallel.sp == 1:
        return None
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv_heads % parallel.sp:
        return (f"streamed layers under Ulysses split the {kv_heads} key/value heads over the --sp {parallel.sp} "
                f"ranks (no replication on that path); allowed --sp: divisors of {kv_heads}")
    return None


def _plannable(method: str, parallel: Parallel, config) -> bool:
    """Whether the parallel settings can plan `method` (streaming: `_streaming_refusal`)."""
    return METHODS[method].streaming_backward_chunk is None or _streaming_refusal(parallel, config) is None


# Model types with a streaming_backward_chunk path (families.py); on any other the field is ignored, so a
# streamed plan would silently be a plain one: the planner refuses those methods for that family instead.
STREAMING_MODEL_TYPES = streaming_model_types()


def family_refusal(method: str, config):
    """Why `method` cannot be planned for `config` (its family, or a config its family does not stream: a sentence), or
    None if it can."""
    settings, model_type = METHODS[method], config.model_type
    if settings.streaming_backward_chunk is not None and model_type not in STREAMING_MODEL_TYPES:
        return (f"model_type {model_type!r} has no streaming_backward_chunk path (not implemented yet; "
                f"streamed families: {', '.join(STREAMING_MODEL_TYPES)})")
    if settings.streaming_backward_chunk is not None and (refusal := streaming_refusal(config)) is not None:
        return f"streaming_backward_chunk is ignored with {refusal}"
    if settings.mini_sequence_chunk is not None and model_type not in MINI_SEQUENCE_MODEL_TYPES:
        return f"model_type {model_type!r} has no mini_sequence_chunk path (families: {', '.join(MINI_SEQUENCE_MODEL_TYPES)})"
    return None


def check_methods(methods, parallel: Parallel, config):
    """Raise PlanError for an unknown method or one the parallel settings cannot plan."""
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise PlanError(f"--methods {' '.join(unknown)}: allowed {', '.join(METHODS)}")
    streamed = [m for m in methods if METHODS[m].streaming_backward_chunk is not None]
    if streamed and (refusal := _streaming_refusal(parallel, config)):
        raise PlanError(f"--methods {' '.join(streamed)}: not planned: {refusal} (other methods: "
                        f"{', '.join(m for m in METHODS if m not in streamed)})")


def load_config(model: str):
    """A built-in name or a local config.json (file or checkpoint folder) of a supported family."""
    if model in CHECKPOINTS:
        model_type, values = CHECKPOINTS[model]
        return getattr(transformers, FAMILIES[model_type].config_class)(**values)
    path = Path(model)
    if not path.exists():
        raise PlanError(f"--model {model!r} is neither a built-in name ({', '.join(CHECKPOINTS)}) nor an existing config.json path")
    try:
        config = transformers.AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    except (OSError, ValueError) as err:
        raise PlanError(f"--model {model}: cannot read a config.json there ({err})") from None
    if config.model_type in TEXT_CONFIG_LM_HEAD_MODEL_TYPES:  # Gemma-3: the planner plans the text stack
        composite, config = config, config.get_text_config()
        if config.model_type in PLANNED_AS:
            config = _planned_as(config, composite)
    if config.model_type not in MINI_SEQUENCE_MODEL_TYPES:
        raise PlanError(f"--model {model}: model_type {config.model_type!r} is not supported; "
                        f"supported: {', '.join(MINI_SEQUENCE_MODEL_TYPES + TEXT_CONFIG_LM_HEAD_MODEL_TYPES)}")
    return config


# Text stacks that train inside their composite only, with no causal-LM class upstream that builds them alone: planned
# as the family whose layers they are, with the same sizes. Qwen3-VL's layers are Qwen3's (its multimodal rotary
# sections split the same rotary dimensions: no tensor changes size), Qwen3-VL-MoE's Qwen3-MoE's; the vision tower is
# not planned, as Gemma-3's is not.
PLANNED_AS = {"qwen3_vl_text": "qwen3", "qwen3_vl_moe_text": "qwen3_moe"}


def _planned_as(text_config, composite):
    """`text_config` as a config of its `PLANNED_AS` family: the same values, a plain rotary embedding of the same
    dimensions, and the composite's tied or untied head."""
    values = {k: v for k, v in text_config.to_dict().items()
              if k not in ("_name_or_path", "model_type", "output_attentions")}
    rope = values.get("rope_parameters") or {}
    values["rope_parameters"] = {k: rope[k] for k in ("rope_type", "rope_theta") if k in rope} or None
    values["tie_word_embeddings"] = getattr(composite, "tie_word_embeddings", False)
    return getattr(transformers, FAMILIES[PLANNED_AS[text_config.model_type]].config_class)(**values)


# the devices whose "auto" chunk policies can be planned (mst_core/chunks.py: chunk_policy_for)
POLICY_DEVICES = ("cuda", "cpu")


class Planner:
    def __init__(self, config, optimizer="adamw", optimizer_in_backward=False, parallel=None, granularity=1024,
                 streaming_chunk="auto", policy_device="cuda"):
        if optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"--optimizer {optimizer!r}: allowed {', '.join(OPTIMIZER_STATE_BYTES)}")
        try:
            validate_streaming_backward_chunk(streaming_chunk)
        except ValueError as err:
            raise PlanError(f"--streaming-chunk {streaming_chunk!r}: {err}") from None
        if streaming_chunk is None:
            raise PlanError('--streaming-chunk None: allowed "auto" or a positive int (query tokens per chunk)')
        if policy_device not in POLICY_DEVICES:
            raise PlanError(f"--policy-device {policy_device!r}: allowed {', '.join(POLICY_DEVICES)}")
        self.streaming_chunk = streaming_chunk  # streaming_backward_chunk of the streamed methods
        # whose "auto" chunk policies the steps take (the fake CPU tensors stand in for this device's)
        self.policy_device = policy_device
        self.parallel = parallel = parallel or Parallel()
        check_parallel(parallel, config, granularity, optimizer_in_backward)
        self.config = config
        self._peaks = {}  # (method, seq_len) -> peak bytes per GPU, resident included
        self._host = {}  # (method, seq_len) -> host bytes per GPU (offloaded layer inputs at their peak)
        self._middle_blocks_equal = set()
        self._prefetched = {}  # (method, seq_len) -> ForkedCall of (peak bytes, host bytes) (search.py)  # methods whose shallow stack's two middle blocks did the same work
        self.progress = None  # a tqdm bar: one tick per fake step, its postfix names the step running
        self.optimizer = optimizer
        self.optimizer_in_backward = optimizer_in_backward
        with FakeTensorMode():
            model = self._build(METHODS["vanilla"])[0]
            self.num_params = sum(p.numel() for p in model.parameters())
            self.layer_period = self._layer_period(model)
        # Weights (bf16) and optimizer states exist before a step; gradients are counted in it.
        # Per GPU: ZeRO-1 keeps 1/N of the optimizer states, ZeRO-3 also 1/N of the weights (its
        # gathered working set is measured in the step, as are gradients: ZeRO-2/3 shard them there).
        n = parallel.gpus
        weights = 2 * (math.ceil(self.num_params / n) if parallel.zero >= 3 else self.num_params)
        states = OPTIMIZER_STATE_BYTES[optimizer] * (math.ceil(self.num_params / n) if parallel.zero >= 1 else self.num_params)
        self.host_state_bytes = states if "optimizer" in parallel.offload else 0
        self.resident_bytes = weights + states - self.host_state_bytes
        # Gradients per GPU when all exist at once (for the "cannot hold even the weights" check).
        self.gradient_bytes = 0 if optimizer_in_backward else 2 * (
            math.ceil(self.num_params / n) if parallel.zero >= 2 else self.num_params)

    def _layer_period(self, model):
        """The period of the stack's layer kinds, if a shallower stack of them can stand in for it (layer_phases.py:
        the same layers in the same order, the hooks' modules present); else None (every step runs every layer)."""
        stack = _decoder_stack(model)
        if stack is None:
            return None
        signatures = _layer_signatures(model.config, stack[0])
        period = layer_phases.layer_period(signatures)
        shallow = layer_phases.shallow_depth(len(signatures), period)
        if shallow is None:
            return None
        shallow_stack = _decoder_stack(self._build(METHODS["vanilla"], shallow)[0])
        if shallow_stack is None or _layer_signatures(model.config, shallow_stack[0]) != signatures[:shallow]:
            return None
        return period

    def _build(self, method: Method, depth=None):
        """The model `method` trains, with `depth` decoder layers instead of the config's if given (the same
        layer kinds in the same order: `layer_types` cut to it)."""
        # use_cache=False: training keeps no KV cache (checkpointing would turn it off with a warning).
        overrides = {"mini_sequence_chunk": method.mini_sequence_chunk, "use_cache": False,
                     "streaming_backward_chunk": None if method.streaming_backward_chunk is None else self.streaming_chunk}
        if depth is not None:
            overrides["num_hidden_layers"] = depth
            if getattr(self.config, "layer_types", None) is not None:
                overrides["layer_types"] = list(self.config.layer_types[:depth])
        config = self.config.__class__(**{**self.config.to_dict(), **overrides})
        config._attn_implementation = attention_name(self.parallel.sp, streamed=method.streaming_backward_chunk is not None)
        # bf16 whatever dtype the config.json names (from_config would otherwise follow config.dtype).
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        checkpointing = method.checkpointing
        if checkpointing:  # 5.x name of gradient_checkpointing_enable(); non-reentrant by default
            model.activation_checkpointing_enable()
        if self.optimizer_in_backward:
            for p in model.parameters():  # applied, then freed, as soon as it is accumulated
                p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
        hooks = StepHooks(self.parallel)
        if self.parallel.zero >= 2:
            for p in model.parameters():
                p.register_post_accumulate_grad_hook(hooks.shard_gradient)
        if self.parallel.zero >= 3:  # like DeepSpeed: every module with parameters of its own
            for module in model.modules():
                if next(module.parameters(recurse=False), None) is not None:
                    module.register_forward_pre_hook(hooks.gather_for_forward)
                    module.register_forward_hook(hooks.release_after_forward)
        if method.streaming_backward_chunk is not None and "inputs" in self.parallel.offload:
            # What a user does: checkpointing with offload, which streaming replaces and honours (HostStorage).
            model.activation_checkpointing_enable(offload=True)
            for layer in model.modules():  # the streamed layers keep their inputs in the stand-in (offload.py)
                if getattr(layer, "gradient_checkpointing", False):
                    layer._gradient_checkpointing_func.offload = hooks
            if not any(streamed_layer.applies(m) and streamed_offload.offload_requested(m) for m in model.modules()):
                raise PlanError(f"{type(model).__name__}: no streamed decoder layers found for --offload inputs")
        elif checkpointing and "inputs" in self.parallel.offload:
            layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
            if not layers:
                raise PlanError(f"{type(model).__name__}: no checkpointed decoder layers found for --offload inputs")
            for layer in layers:
                layer._gradient_checkpointing_func = functools.partial(offloaded_checkpoint, hooks)
        return model, hooks

    def step_peak_bytes(self, method, seq_len, fake=True, shallow=True):
        """Peak live bytes allocated on one GPU by one forward + backward at `seq_len` tokens (the
        rank runs seq_len / sp of them; fake tensors unless fake=False, which runs the same step
        for real: the tests compare the two). With `shallow` (fake steps only), a stack of a few
        layers is run and the full stack's phases are walked from its own (layer_phases.py: the
        same bytes; the tests compare the two); without, every layer runs."""
        check_methods([method], self.parallel, self.config)
        refusal = family_refusal(method, self.config)
        if refusal:
            raise PlanError(f"{method}: not planned: {refusal}")
        depth = self.config.num_hidden_layers
        if shallow and fake and self.layer_period is not None:
            period = self.layer_period
            # Two middle blocks until they were found equal once for this method, then one (layer_phases.py).
            checked = method in self._middle_blocks_equal
            shallow_depth = layer_phases.shallow_depth(depth, period, middle_blocks=1 if checked else 2)
            phases = self._step(method, seq_len, fake, shallow_depth)[2]
            deep = layer_phases.deepened(phases, period, (depth - shallow_depth) // period, check=not checked)
            if deep is not None:
                self._middle_blocks_equal.add(method)
                peak, self._host[(method, seq_len)] = layer_phases.walk(deep)
                return peak
        peak, self._host[(method, seq_len)], _ = self._step(method, seq_len, fake)
        return peak

    def _step(self, method, seq_len, fake, depth=None):
        """(peak bytes, peak host bytes, the phases when `depth` is given) of one step (step_peak_bytes)."""
        with FakeTensorMode() if fake else contextlib.nullcontext(), chunk_policy_for(self.policy_device):
            model, hooks = self._build(METHODS[method], depth)
            ids = torch.zeros(1, seq_len // self.parallel.sp, dtype=torch.long)
            with recurrent_kernels_like(model), LiveTensorTracker(keep_largest=0) as tracker:
                recorder = None if depth is None else layer_phases.PhaseRecorder(tracker, hooks, *_decoder_stack(model))
                model(input_ids=ids, labels=ids).loss.backward()
                phases = None if recorder is None else recorder.finish()
        if phases is not None and layer_phases.walk(phases) != (tracker.peak_bytes, hooks.host_peak_bytes):
            raise RuntimeError(f"planner: the phases of a {depth}-layer step do not add up to its peak "
                               f"({layer_phases.walk(phases)} != {(tracker.peak_bytes, hooks.host_peak_bytes)})")
        return tracker.peak_bytes, hooks.host_peak_bytes, phases

    def peak_bytes(self, method, seq_len):
        """Resident bytes + the step's peak at `seq_len` (memoized: each new value is a fake step)."""
        key = (method, seq_len)
        if key in self._prefetched:
            self._peaks[key], self._host[key] = self._prefetched.pop(key).result()
            if self.progress is not None:
                self.progress.update()
        if key not in self._peaks:
            if self.progress is not None:
                self.progress.set_postfix_str(f"{method} at {seq_len} tokens")
            self._peaks[key] = self.resident_bytes + self.step_peak_bytes(method, seq_len)
            if self.progress is not None:
                self.progress.update()
        return self._peaks[key]

    def host_bytes(self, method, seq_len):
        """Host memory per GPU: offloaded optimizer states + offloaded layer inputs at their peak."""
        self.peak_bytes(method, seq_len)
        return self.host_state_bytes + self._host[(method, seq_len)]

    def prefetch(self, method, seq_len):
        """Start the fake step of `peak_bytes(method, seq_len)` in a forked process; `peak_bytes` collects it."""
        key = (method, seq_len)

        def measure():  # in the child: its progress is the parent's to show, when it collects the result
            self.progress = None
            return self.peak_bytes(method, seq_len), self._host[key]

        if key not in self._peaks and key not in self._prefetched:
            self._prefetched[key] = ForkedCall(measure)

    def max_seq_len(self, method, budget_bytes, granularity=1024, limit=1 << 22):
        """Largest multiple of `granularity` (<= `limit` tokens per rank, i.e. limit * sp in all)
        whose peak fits; 0 if not even one fits."""
        try:
            return search_max_fitting(lambda s: self.peak_bytes(method, s), budget_bytes, granularity,
                                      limit * self.parallel.sp, prefetch=lambda s: self.prefetch(method, s))
        finally:  # a prefetch the search did not need
            for key in [k for k in self._prefetched if k[0] == method]:
                self._prefetched.pop(key).cancel()


def _decoder_stack(model):
    """(decoder layers, final norm) of a causal LM, or None where they are not where the families keep them."""
    decoder = getattr(model, "model", None)
    layers, norm = getattr(decoder, "layers", None), getattr(decoder, "norm", None)
    if not isinstance(layers, torch.nn.ModuleList) or not isinstance(norm, torch.nn.Module) or not len(layers):
        return None
    return layers, norm


def _layer_signatures(config, layers):
    """What makes two decoder layers alike for the planner: their class, their submodules' classes (a dense MLP or
    a MoE block), their entry in `layer_types` (sliding or full attention), their attention's window, their
    parameters' shapes, and whether they share K/V with other layers."""
    layer_types = getattr(config, "layer_types", None) or [None] * len(layers)
    # Gemma-4: the last layers read K/V that earlier ones stored (no K/V projections of their own, double-wide MLPs).
    kv_sharing = getattr(config, "kv_sharing_modes", None) or [None] * len(layers)
    return [(type(layer).__name__, tuple((name, type(child).__name__) for name, child in layer.named_children()),
             layer_types[index], getattr(getattr(layer, "self_attn", None), "sliding_window", None),
             tuple((name, tuple(p.shape)) for name, p in layer.named_parameters()), kv_sharing[index])
            for index, layer in enumerate(layers)]


def plan(model, gpu_memory_gib, optimizer="adamw", optimizer_in_backward=False, granularity=1024,
         gpus=1, zero=0, sp=1, offload=(), methods=None, streaming_chunk="auto", seq_lens=None, progress=False,
         jobs=1, policy_device="cuda"):
    """Search each method's longest fitting sequence, or with `seq_lens` evaluate those lengths only.
    `progress`: show a bar of the fake steps on stderr (the command line does). `jobs` > 1: the methods'
    searches run in that many forked processes (each search is independent: the same steps, the same numbers).
    `policy_device`: whose "auto" chunk policies the steps take (a GPU's: longer chunks than the CPU's)."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise PlanError(f"--jobs {jobs!r}: allowed a positive number of processes")
    parallel = Parallel(gpus, zero, sp, tuple(offload))
    for seq in seq_lens or ():
        if isinstance(seq, bool) or not isinstance(seq, int) or seq <= 0 or seq % sp:
            raise PlanError(f"--seq-len {seq!r}: allowed positive whole-sequence token counts divisible by --sp {sp}")
    config = load_config(model)
    if methods is None:  # every method these settings can plan
        methods = [m for m in METHODS if _plannable(m, parallel, config)]
    methods = list(methods)
    check_methods(methods, parallel, config)
    not_planned = {m: why for m in methods if (why := family_refusal(m, config))}
    if len(not_planned) == len(methods):
        raise PlanError(f"--model {model}: none of the methods can be planned for this family: "
                        + "; ".join(f"{m}: {why}" for m, why in not_planned.items()))
    methods = [m for m in methods if m not in not_planned]
    if gpu_memory_gib <= 0:
        raise PlanError(f"--gpu-memory-gib must be positive, got {gpu_memory_gib}")
    if granularity <= 0:
        raise PlanError(f"--granularity must be a positive number of tokens, got {granularity}")
    planner = Planner(config, optimizer, optimizer_in_backward, parallel, granularity, streaming_chunk, policy_device)
    budget = int(gpu_memory_gib * GIB)
    state = planner.resident_bytes + planner.gradient_bytes
    settings = f"--optimizer {optimizer}{' --optimizer-in-backward' if optimizer_in_backward else ''}"
    if not parallel.single:
        settings += (f" --gpus {gpus} --zero {zero} --sp {sp}"
                     + (f" --offload {' '.join(parallel.offload)}" if parallel.offload else ""))
    if state > budget:
        raise PlanError(
            f"{gpu_memory_gib} GiB cannot hold even the weights, gradients and optimizer states of {model} "
            f"({planner.num_params / 1e9:.2f}B parameters: {state / GIB:.1f} GiB{' per GPU' if gpus > 1 else ''} "
            f"with {settings})"
        )
    result = {"model": model, "parameters": planner.num_params, "gpu_memory_gib": gpu_memory_gib,
              "optimizer": optimizer, "optimizer_in_backward": optimizer_in_backward,
              "streaming_chunk": streaming_chunk, "policy_device": policy_device,
              "resident_gib": round(planner.resident_bytes / GIB, 2), "granularity": granularity,
              "measured_on": "FakeTensorMode on the CPU device, standing in for the GPU (a fake cuda device "
                             "crashes the CPU build of torch)",
              "max_seq_len": {}, "peak_gib_at_max": {},
              "not_planned": not_planned}  # method -> why this family cannot plan it (reported, not dropped)
    if not parallel.single:
        result.update(gpus=gpus, zero=zero, sp=sp, offload=list(parallel.offload),
                      host_state_gib=round(planner.host_state_bytes / GIB, 2), host_gib_at_max={})
    with tqdm(desc=f"{model}: fake training steps", unit="step", file=sys.stderr, disable=not progress,
              mininterval=0.5) as planner.progress:
        if jobs > 1 and not seq_lens and len(methods) > 1:
            search_in_processes(planner, methods, budget, granularity, jobs)
        return _measure(result, planner, methods, seq_lens, budget, granularity, parallel, gpu_memory_gib, model, state)


def _measure(result, planner, methods, seq_lens, budget, granularity, parallel, gpu_memory_gib, model, state):
    """plan()'s measurements: the given lengths, or each method's search."""
    if seq_lens:
        result.update(points=[], max_seq_len=None, peak_gib_at_max=None)
        for method in methods:
            for seq in seq_lens:
                peak = planner.peak_bytes(method, seq)
                result["points"].append({"method": method, "seq_len": seq, "peak_gib": round(peak / GIB, 2),
                                         "host_gib": round(planner.host_bytes(method, seq) / GIB, 2),
                                         "fits": peak <= budget})
        return _with_assumptions(result, parallel)
    for method in methods:
        seq = planner.max_seq_len(method, budget, granularity)
        result["max_seq_len"][method] = seq
        result["peak_gib_at_max"][method] = round(planner.peak_bytes(method, seq) / GIB, 2) if seq else None
        if not parallel.single:
            result["host_gib_at_max"][method] = round(planner.host_bytes(method, seq) / GIB, 2) if seq else None
    if not any(result["max_seq_len"].values()):
        raise PlanError(
            f"{gpu_memory_gib} GiB holds the weights, gradients and optimizer states of {model} "
            f"({state / GIB:.1f} GiB) but no method fits even {granularity} tokens"
        )
    return _with_assumptions(result, parallel)


def _with_assumptions(result, parallel):
    result["assumptions"] = ASSUMPTIONS.strip()
    if not parallel.single:
        result["assumptions"] += "\n" + MULTI_GPU_ASSUMPTIONS.strip()
    return result


