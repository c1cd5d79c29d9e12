"""The planner's command line: `python -m transformers.mst_planner --help`."""

import argparse
import json
import os

from ..mst_core.families import CHECKPOINTS
from . import plan as plan_module
from .assumptions import ASSUMPTIONS
from .plan import METHODS, OFFLOAD_CHOICES, OPTIMIZER_STATE_BYTES, POLICY_DEVICES, ZERO_STAGES, PlanError, plan


def _streaming_chunk_arg(value):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f'{value!r}: allowed "auto" or a positive int') from None


def main(argv=None):
    description = plan_module.__doc__ + "\nAssumptions (printed with every result):" + ASSUMPTIONS
    parser = argparse.ArgumentParser(prog="python -m transformers.mst_planner", description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help=f"{', '.join(CHECKPOINTS)}, or a local config.json path")
    parser.add_argument("--gpu-memory-gib", type=float, required=True, help="memory of each GPU")
    parser.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--optimizer-in-backward", action="store_true")
    parser.add_argument("--granularity", type=int, default=1024, help="sequence lengths searched are multiples of this")
    parser.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) in the run; ZeRO shards over all of them")
    parser.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES,
                        help="ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence-parallel degree (divides --gpus and the heads)")
    parser.add_argument("--offload", nargs="+", default=[], choices=OFFLOAD_CHOICES,
                        help="keep in host memory: optimizer states, checkpointed layer inputs, or both")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="plan only these methods (default: all; each long search costs minutes)")
    parser.add_argument("--streaming-chunk", default="auto", type=_streaming_chunk_arg,
                        help='streaming_backward_chunk of the streamed methods: "auto" (default) or query tokens per chunk')
    parser.add_argument("--policy-device", default="cuda", choices=POLICY_DEVICES,
                        help='whose "auto" chunk policies to plan: a GPU\'s (default; at least 4096 tokens per MLP '
                             "mini-sequence and streamed chunk) or the CPU's (hidden_size)")
    parser.add_argument("--seq-len", nargs="+", type=int, default=None, metavar="TOKENS",
                        help="evaluate these whole-sequence lengths (peak, host memory, fits?) instead of searching")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="search the methods in this many processes (default: the CPU cores this process may "
                             "use); the same results with any number")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        result = plan(args.model, args.gpu_memory_gib, args.optimizer, args.optimizer_in_backward, args.granularity,
                      args.gpus, args.zero, args.sp, args.offload, args.methods, args.streaming_chunk, args.seq_len,
                      progress=True, jobs=args.jobs, policy_device=args.policy_device)
    except PlanError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if args.json:
        print(json.dumps(result))
        return
    multi = "gpus" in result
    print(f"{args.model}: {result['parameters'] / 1e9:.2f}B parameters, {args.gpu_memory_gib} GiB"
          f"{' per GPU' if multi else ''}, optimizer "
          f"{args.optimizer}{' in backward' if args.optimizer_in_backward else ''}; weights + optimizer states "
          f"{result['resident_gib']} GiB{' per GPU' if multi else ''} (fake-tensor estimate on CPU)")
    if multi:
        print(f"{args.gpus} GPUs, ZeRO-{args.zero}, Ulysses sp={args.sp}, offload: "
              f"{' + '.join(result['offload']) or 'none'}; host memory per GPU holds {result['host_state_gib']} GiB "
              f"of optimizer states before layer inputs; sequence lengths are the whole sequence "
              f"(each GPU of an sp group runs 1/{args.sp} of it)")
    print()
    if args.seq_len:
        _print_points(result["points"])
    else:
        _print_maxima(result, args.granularity, multi)
    for method, why in result["not_planned"].items():
        print(f"{method:<30}not planned: {why}")
    print("\nAssumptions:\n" + result["assumptions"])


def _print_points(points):
    print(f"{'method':<30}{'seq len':>12}{'peak/GPU (GiB)':>16}{'host/GPU (GiB)':>16}{'fits':>6}")
    for point in points:
        print(f"{point['method']:<30}{point['seq_len']:>12}{point['peak_gib']:>16}{point['host_gib']:>16}"
              f"{'yes' if point['fits'] else 'no':>6}")


def _print_maxima(result, granularity, multi):
    host_header = f"{'host/GPU (GiB)':>16}" if multi else ""
    print(f"{'method':<30}{'max seq len':>12}{'peak/GPU (GiB)' if multi else 'peak (GiB)':>{16 if multi else 12}}{host_header}")
    for method, seq in result["max_seq_len"].items():
        peak = result["peak_gib_at_max"][method]
        shown = seq if seq else f"< {granularity}"  # 0: not even one granule fits
        line = f"{method:<30}{shown:>12}{peak if peak is not None else '-':>{16 if multi else 12}}"
        if multi:
            host = result["host_gib_at_max"][method]
            line += f"{host if host is not None else '-':>16}"
        print(line)
