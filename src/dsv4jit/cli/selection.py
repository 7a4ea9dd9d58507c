"""Which variants and arches a command acts on: ``--arch``, ``--kernel``, ``--set`` and ``--param``,
as precompile and list take them (clean and info take some of them)."""

from __future__ import annotations

import sys

from .common import JSON_HELP, UsageError

#: The target of every subcommand when no GPU is visible and neither --arch nor DSV4JIT_CUDA_ARCH is
#: given: the kernels are written for Hopper.
NO_GPU_ARCH = "9.0a"
ARCH_DEFAULT = f"(default: DSV4JIT_CUDA_ARCH, else auto; with no GPU visible: {NO_GPU_ARCH}, said on stderr)"


def add_selection(sp, arch_default: str | None = None) -> None:
    """The options that select variants and arches, and --json; `arch_default`: a fixed --arch default
    instead of the environment's."""
    arch_help = "targets, e.g. 9.0a or 9.0a,10.0a; 'auto': the visible GPUs"
    sp.add_argument("--arch", default=arch_default, help=arch_help if arch_default else f"{arch_help} {ARCH_DEFAULT}")
    sp.add_argument("--kernel", action="append", help="restrict to this kernel (repeatable; default: every kernel)")
    sp.add_argument("--set", action="append",
                    help="'default' (the serving sets), 'all' (every combination), or a variant id such as "
                         "'plan[pdl=1]' (repeatable; default: default)")
    sp.add_argument("--param", action="append", metavar="NAME=VALUE",
                    help="keep the variants with this parameter value, e.g. head_dim=512 (repeatable; "
                         "default: no filter)")
    sp.add_argument("--json", action="store_true", help=JSON_HELP)


def archs(text: str | None) -> list:
    from ..jit.toolchain import Arch, device_target, forced_arch

    if text in (None, ""):
        if forced := forced_arch():
            return [forced]
        text = "auto"
    if text == "auto":
        import torch

        if not torch.cuda.is_available():
            arch = Arch.parse(NO_GPU_ARCH)
            print(f"dsv4jit: no GPU visible: targeting {arch} (pass --arch or set DSV4JIT_CUDA_ARCH for another)",
                  file=sys.stderr)
            return [arch]
        return sorted({device_target(i) for i in range(torch.cuda.device_count())}, key=str)
    try:
        return [Arch.parse(a) for a in text.split(",") if a.strip()]
    except ValueError as e:
        raise UsageError(str(e)) from None


def warn_of_arch_setting() -> None:
    """For a run that targets no GPU arch: an invalid DSV4JIT_CUDA_ARCH does not stop it, but is said on
    stderr rather than ignored (every command that targets an arch refuses it)."""
    from ..errors import DSV4JITSettingError
    from ..jit.toolchain import forced_arch

    try:
        forced_arch()
    except DSV4JITSettingError as e:
        print(f"dsv4jit: warning: {e} (this command targets no GPU; those that do refuse it)", file=sys.stderr)


def spec(kernel: str):
    """The spec of a kernel named on the command line (by --kernel or in a variant id)."""
    from ..jit.kernels import SPECS

    if kernel not in SPECS:
        raise UsageError(f"unknown kernel {kernel!r}; known: {', '.join(sorted(SPECS))}")
    return SPECS[kernel]


def variant_id(text: str):
    """Parse a variant id; errors show ids of that kernel to copy."""
    from ..jit.kernels import SPECS
    from ..jit.registry import parse_variant_id

    kernel = spec(text.partition("[")[0])
    try:
        return parse_variant_id(text, SPECS)
    except ValueError as e:
        from ..runtime import serving_variants

        examples = list(dict.fromkeys(v.id for v in serving_variants(kernel) + kernel.all_variants()))[:2]
        raise UsageError(f"{e}; variant ids look like {' or '.join(examples)} "
                         f"(all of them: python -m dsv4jit list --kernel {kernel.name} --set all)") from None


def variants(kernels: list[str] | None, sets: list[str] | None, filters: list[str] | None = None) -> list:
    from ..jit.kernels import SPECS
    from ..jit.registry import unique
    from ..runtime import serving_variants

    specs = [spec(k) for k in kernels] if kernels else list(SPECS.values())
    out = []
    for s in sets or ["default"]:
        if s == "default":
            out += [v for sp in specs for v in serving_variants(sp)]
        elif s == "all":
            out += [v for sp in specs for v in sp.all_variants()]
        else:
            out.append(variant_id(s))
    for f in filters or []:  # --param name=value keeps variants whose spec has no such param or matches it
        name, eq, value = f.partition("=")
        if not eq:
            raise UsageError(f"--param must look like name=value, got {f!r}")
        def keep(v, name=name, value=value) -> bool:
            param = v.spec.param(name)
            return param is None or v.params[name] == param.canonical(value)

        try:
            out = [v for v in out if keep(v)]
        except ValueError as e:
            raise UsageError(str(e)) from None
    return unique(out)


def targets(args) -> list[tuple]:
    """(variant, arch) pairs; host-only kernels build once for the host target."""
    from ..jit.toolchain import Arch

    selected = variants(args.kernel, args.set, args.param)
    needs_gpu_arch = any(v.spec.target == "cuda" for v in selected)
    gpu_archs = archs(args.arch) if needs_gpu_arch else []
    pairs = []
    for v in selected:
        for a in ([Arch.host()] if v.spec.target == "host" else gpu_archs):
            pairs.append((v, a))
    return pairs
