"""``dsv4jit demo``: the compressors run as a serving stack runs them, timed and checked."""

from __future__ import annotations

import sys

from .common import EXIT_FAILED, EXIT_OK, Help, UsageError, emit
from .selection import warn_of_arch_setting


class _DemoHelp(Help):
    """The demo's sizes depend on the device: their defaults come from its GPU and CPU configurations."""

    def _get_help_string(self, action):
        from ..demo.run import CPU_DEFAULTS, GPU_DEFAULTS

        if action.default is None and action.dest in GPU_DEFAULTS.__dataclass_fields__:
            gpu, cpu = getattr(GPU_DEFAULTS, action.dest), getattr(CPU_DEFAULTS, action.dest)
            return f"{action.help} (default: {gpu if gpu == cpu else f'{gpu} on a GPU, {cpu} on the CPU'})"
        return super()._get_help_string(action)


def add_parser(sub) -> None:
    pd = sub.add_parser("demo", help="run the compressors as a serving stack does and check the caches",
                        description="Run the compressors of DeepSeek-V4 layers as a serving stack does (paged pool, "
                                    "chunked prefill, decode steps in a CUDA graph), time the steps and check the final "
                                    "states and caches against the reference backend. Without a GPU it runs the "
                                    "reference backend at a small size.",
                        formatter_class=_DemoHelp)
    pd.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if visible, else cpu at a small size)")
    pd.add_argument("--model", choices=("v4", "v4.1"), default="v4",
                    help="v4.1: layers of ratios 4, 128, 1 and 2 storing V4.1 layouts, prefill, decode and a "
                    "speculative verify step; --layers cycles through the four ratios (default: v4)")
    pd.add_argument("--requests", type=int, help="number of requests")
    pd.add_argument("--min-prompt", type=int, help="shortest prompt (tokens)")
    pd.add_argument("--max-prompt", type=int, help="longest prompt (tokens)")
    pd.add_argument("--chunk", type=int, help="prefill token budget per step (chunked prefill)")
    pd.add_argument("--decode-steps", type=int, help="decode steps after the prefill")
    pd.add_argument("--layers", type=int, help="layers, alternating compress ratio 4 and 128")
    pd.add_argument("--seed", type=int, help="random seed")
    pd.add_argument("--indexer-fp8", action="store_true", help="indexer cache in fp8 instead of fp4")
    pd.add_argument("--eager", action="store_true", help="decode without a CUDA graph")
    pd.add_argument("--two-step", action="store_true",
                    help="run each compressor through compress_forward + compress_norm_rope_store instead of one op "
                    "per layer (compress_and_store_c4_layer, compress_and_store)")
    pd.add_argument("--decode-plans", choices=("in-graph", "copy"),
                    help="build decode plans inside the graph, or outside it and copy_ them in")
    pd.add_argument("--speculative", action="store_true",
                    help="online c128 layers decoded by verify steps of draft tokens (speculative decoding); "
                    "--decode-steps counts the verify steps, --layers the online c128 layers")
    pd.add_argument("--verify-tokens", type=int, help="with --speculative or --model v4.1: draft tokens per "
                    "request and verify step, 1-8 (default: 4 with --speculative, 3 with --model v4.1)")
    pd.add_argument("--no-check", action="store_true", help="skip the reference run and the comparison")
    pd.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    pd.add_argument("--json", action="store_true", help="machine-readable result")
    pd.set_defaults(func=cmd_demo)


def cmd_demo(args) -> int:
    from ..demo import run

    if args.speculative:
        return _speculative_demo(args)
    if args.model == "v4.1":
        return _v41_demo(args)
    try:  # the calls that validate the options: their ValueErrors name the option
        device = run.resolve_device(args.device)
        config = run.config_for(device, requests=args.requests, min_prompt=args.min_prompt,
                                max_prompt=args.max_prompt, chunk=args.chunk, decode_steps=args.decode_steps,
                                layers=args.layers, seed=args.seed, indexer_fp8=args.indexer_fp8 or None,
                                graph=False if args.eager else None, decode_plans=args.decode_plans,
                                check=False if args.no_check else None, fused=False if args.two_step else None)
        config.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if device.type == "cpu":
        warn_of_arch_setting()
    progress = not args.no_progress and sys.stderr.isatty()
    result = run.run_demo(config, str(device), progress=progress)
    emit(args, result.as_dict(), run.format_result(result))
    return EXIT_OK if result.ok else EXIT_FAILED


def _speculative_demo(args) -> int:
    """demo --speculative: online c128 layers decoded by verify steps (demo/speculative.py)."""
    from ..demo import speculative

    options = dict(requests=args.requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                   layers=args.layers, seed=args.seed, verify_tokens=args.verify_tokens, rounds=args.decode_steps,
                   check=False if args.no_check else None)
    return _flow(args, (speculative.GPU_SPECULATIVE, speculative.CPU_SPECULATIVE), options,
                 speculative.run_speculative, speculative.format_speculative)


def _v41_demo(args) -> int:
    """demo --model v4.1: the DeepSeek-V4.1 compressors (demo/v41.py)."""
    from ..demo import v41

    options = dict(requests=args.requests, min_prompt=args.min_prompt, max_prompt=args.max_prompt,
                   chunk=args.chunk, decode_steps=args.decode_steps, layers=args.layers, seed=args.seed,
                   verify_tokens=args.verify_tokens, check=False if args.no_check else None)
    progress = not args.no_progress and sys.stderr.isatty()
    return _flow(args, (v41.GPU_V41, v41.CPU_V41), options,
                 lambda config, device: v41.run_v41(config, device, progress=progress), v41.format_v41)


def _flow(args, defaults: tuple, options: dict, run_flow, format_flow) -> int:
    """A flow of its own: its (GPU, CPU) default configuration with the options given, run and reported."""
    from dataclasses import replace

    from ..demo import run

    try:
        device = run.resolve_device(args.device)
        base = defaults[0] if device.type == "cuda" else defaults[1]
        config = replace(base, **{k: v for k, v in options.items() if v is not None})
        config.validate()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if device.type == "cpu":
        warn_of_arch_setting()
    result = run_flow(config, device)
    emit(args, result.as_dict(), format_flow(result))
    return EXIT_OK if result.ok else EXIT_FAILED
