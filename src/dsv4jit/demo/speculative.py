"""``python -m dsv4jit demo --speculative``: online c128 layers under speculative decoding.

Requests are prefilled, then decoded by verify steps: each feeds ``verify_tokens`` draft tokens per
request through every layer's compressor (``compress_and_store(is_online=True)``, its states stored
in bank 1) and stages the draft states (``online_c128_mtp_write_prefix_states``); a random prefix of
the drafts is accepted, and the next step commits it (``online_c128_mtp_commit_pending``) after
marking its own batch pending. The main states and caches at the end are compared with the same
flow on the torch reference backend. The flow is docs/serving.md's "Speculative decoding with online
c128".
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from .. import ops
from ..geometry import page_bytes
from ..plan import CompressorPrefillPlan
from ..reference.store import yarn_freq_cis
from .check import Check, compare_cache
from .engine import Timer
from .layer import C128_CORE, NORM_EPS
from .pool import PagedPool, out_loc, schedule
from .run import check_sizes

HEAD_DIM = C128_CORE.head_dim
PAGE_SIZE = C128_CORE.page_size
FORMAT = C128_CORE.store
#: Main states of the two backends differ by the kernels' fast exponential (contract §9.6).
STATE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class SpeculativeConfig:
    requests: int = 8
    min_prompt: int = 64
    max_prompt: int = 1024
    layers: int = 4              # online c128 layers
    verify_tokens: int = 4       # draft tokens per request and verify step (1..8)
    rounds: int = 64             # verify steps
    seed: int = 0
    check: bool = True

    def validate(self) -> None:
        check_sizes(self, ("requests", "min_prompt", "layers", "rounds"))


GPU_SPECULATIVE = SpeculativeConfig()
CPU_SPECULATIVE = SpeculativeConfig(requests=3, min_prompt=100, max_prompt=300, layers=2, rounds=40)


class OnlineLayer:
    """One online c128 compressor: its banked state pool, cache and weights."""

    def __init__(self, pool: PagedPool, banks: int, gen: torch.Generator, device: torch.device):
        self.state = torch.zeros(banks * pool.num_slots, 1, 3 * HEAD_DIM, device=device)
        self.cache = torch.zeros(pool.num_full_pages, page_bytes(FORMAT, PAGE_SIZE), dtype=torch.uint8, device=device)
        self.ape = (0.5 * torch.randn(128, HEAD_DIM, generator=gen)).to(device)
        self.norm_weight = (0.5 + torch.rand(HEAD_DIM, generator=gen)).to(device)


class SpeculativeEngine:
    """One backend's layers; the pending lengths are shared by the layers, as in a serving stack."""

    def __init__(self, device: torch.device, pool: PagedPool, config: SpeculativeConfig, seed: int):
        self.device, self.verify = device, config.verify_tokens
        self.stride = pool.num_slots  # one main row per request slot; bank k at rows [k·stride, (k+1)·stride)
        self.req_to_token = pool.req_to_token.to(device)
        self.freq_cis = yarn_freq_cis(pool.max_ctx).to(device)
        gen = torch.Generator().manual_seed(seed)
        self.layers = [OnlineLayer(pool, self.verify + 1, gen, device) for _ in range(config.layers)]
        self.pending = torch.full((pool.num_slots,), -1, dtype=torch.int64, device=device)
        self.committed = True

    def _compress(self, layer: OnlineLayer, plan, x: torch.Tensor, locs: torch.Tensor) -> None:
        ops.compress_and_store(layer.state, x, layer.ape, plan, head_dim=HEAD_DIM, compress_ratio=128,
                               norm_weight=layer.norm_weight, norm_eps=NORM_EPS, freq_cis=self.freq_cis,
                               out_loc=locs, kvcache=layer.cache, page_size=PAGE_SIZE, is_online=True)

    def prefill(self, slots, seq_lens, extend_lens, inputs, locs) -> None:
        plan = CompressorPrefillPlan.generate_online(torch.tensor(seq_lens), torch.tensor(extend_lens),
                                                     torch.tensor(slots, device=self.device), self.req_to_token,
                                                     sum(extend_lens))
        for layer, x in zip(self.layers, inputs):
            self._compress(layer, plan, x.to(self.device), locs.to(self.device))

    def commit(self, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """The accepted prefixes of the pending verify, in every layer (lengths after acceptance)."""
        for layer in self.layers:
            ops.online_c128_mtp_commit_pending(seq_lens, slots, self.req_to_token, self.pending, layer.state,
                                               len(slots), self.verify, self.stride, self.stride, head_dim=HEAD_DIM)
        self.committed = True

    def verify_step(self, slots_list, seq_lens_list, inputs, locs) -> None:
        """Commit the previous verify, mark this one pending, then every layer's compressor step on the
        draft tokens (states to bank 1) and its draft states."""
        slots = torch.tensor(slots_list, device=self.device)
        seq = torch.tensor(seq_lens_list, device=self.device)
        batch = len(slots_list)
        if not self.committed:
            self.commit(slots, seq)
        ops.online_c128_mtp_mark_pending(seq, slots, self.pending, batch, self.stride, head_dim=HEAD_DIM,
                                         state_dtype=torch.float32)
        plan = CompressorPrefillPlan.generate_online(seq + self.verify, torch.full_like(seq, self.verify), slots,
                                                     self.req_to_token, batch * self.verify,
                                                     state_slot_offset=self.stride)
        locs = locs.to(self.device)
        for layer, x in zip(self.layers, inputs):
            x = x.to(self.device)
            self._compress(layer, plan, x, locs)
            ops.online_c128_mtp_write_prefix_states(x, seq, slots, self.req_to_token, layer.ape, layer.state, batch,
                                                    self.verify, self.stride, head_dim=HEAD_DIM)
        self.committed = False


@dataclass
class SpeculativeResult:
    ok: bool
    device: str
    config: dict
    prompt_lens: list[int]
    accepted_tokens: int
    verify_us_per_step: float
    checks: list[Check] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def _inputs(tokens: int, layers: int, gen: torch.Generator) -> list[torch.Tensor]:
    """kv ~ N(0, 1) | scores ~ N(0, 4), one [tokens, 2·hd] block per layer."""
    xs = [torch.randn(tokens, 2 * HEAD_DIM, generator=gen) for _ in range(layers)]
    for x in xs:
        x[:, HEAD_DIM:] *= 2.0
    return xs


def run_speculative(config: SpeculativeConfig, device: torch.device) -> SpeculativeResult:
    config.validate()
    gen = torch.Generator().manual_seed(config.seed)
    prompt_lens = torch.randint(config.min_prompt, config.max_prompt + 1, (config.requests,), generator=gen).tolist()
    pool = PagedPool(config.requests + 2, max(prompt_lens) + (config.rounds + 1) * config.verify_tokens, gen)
    slots = torch.randperm(pool.num_slots, generator=gen)[:config.requests].tolist()
    engines = [SpeculativeEngine(device, pool, config, config.seed + 1)]
    if config.check:
        engines.append(SpeculativeEngine(torch.device("cpu"), pool, config, config.seed + 1))
    stored = []
    for s in schedule(prompt_lens, slots, 2048, 0):
        token_slots, positions = s.token_positions()
        locs = out_loc(pool.req_to_token, token_slots, positions, 128)
        stored.append(locs[locs > 0])
        inputs = _inputs(s.num_tokens, config.layers, gen)
        for e in engines:
            e.prefill(list(s.slots), list(s.seq_lens), list(s.extend_lens), inputs, locs)
    lens, accepted_total, timer = list(prompt_lens), 0, Timer(device)
    verify = config.verify_tokens
    for _ in range(config.rounds):
        token_slots = torch.tensor(slots).repeat_interleave(verify)
        positions = (torch.tensor(lens)[:, None] + torch.arange(verify)).reshape(-1)
        locs = out_loc(pool.req_to_token, token_slots, positions, 128)
        stored.append(locs[locs > 0])
        inputs = _inputs(len(slots) * verify, config.layers, gen)
        start = timer.mark()
        engines[0].verify_step(slots, lens, inputs, locs)
        timer.add("verify", start, timer.mark())
        for e in engines[1:]:
            e.verify_step(slots, lens, inputs, locs)
        accepted = torch.randint(1, verify + 1, (len(slots),), generator=gen).tolist()
        accepted_total += sum(accepted)
        lens = [n + a for n, a in zip(lens, accepted)]
    for e in engines:
        e.commit(torch.tensor(slots, device=e.device), torch.tensor(lens, device=e.device))
    steps, total_us, _ = timer.totals("verify")
    checks = _compare(engines, slots, lens, torch.cat(stored)) if config.check else []
    return SpeculativeResult(all(c.ok for c in checks), str(device), asdict(config), prompt_lens, accepted_total,
                             total_us / steps, checks)


def _compare(engines, slots, lens, stored) -> list[Check]:
    """Main rows of the requests whose state is live (length not a multiple of 128), and the caches."""
    live = [s for s, n in zip(slots, lens) if n % 128]
    checks = []
    for i, (got, want) in enumerate(zip(engines[0].layers, engines[1].layers)):
        a = got.state.cpu().view(-1, 3 * HEAD_DIM)[live].double()
        b = want.state.cpu().view(-1, 3 * HEAD_DIM)[live].double()
        err = float(((a - b).abs() / (1 + b.abs())).max()) if live else 0.0
        ok = err <= STATE_TOLERANCE
        checks.append(Check(i, "online c128", "state", ok,
                            f"{len(live)} main states, largest error {err:.2g} (at most {STATE_TOLERANCE:g})"))
        checks.append(Check(i, "online c128", "cache", *compare_cache(FORMAT, PAGE_SIZE, got.cache, want.cache, stored)))
    return checks


def format_speculative(result: SpeculativeResult) -> list[str]:
    cfg = result.config
    backend = "CUDA kernels" if result.device.startswith("cuda") else "the torch reference backend (CPU)"
    lines = [f"dsv4jit speculative-decoding demo on {result.device}: {backend}",
             f"requests {cfg['requests']} (prompts {min(result.prompt_lens)}-{max(result.prompt_lens)}), "
             f"{cfg['layers']} online c128 layers, {cfg['rounds']} verify steps of {cfg['verify_tokens']} draft "
             f"tokens, {result.accepted_tokens} accepted, seed {cfg['seed']}",
             f"verify step (eager, every layer): {result.verify_us_per_step:.1f} µs", ""]
    if not result.checks:
        return lines + ["not checked against the reference backend (--no-check)"]
    lines.append("final main states and caches against the reference backend (CPU):")
    for c in result.checks:
        lines.append(f"  layer {c.layer:<3d} {c.compressor:11s} {c.part:5s} {'ok ' if c.ok else 'MISMATCH'}  {c.detail}")
    failed = sum(not c.ok for c in result.checks)
    lines.append("every state and cache matched" if not failed else f"{failed} of {len(result.checks)} checks FAILED")
    return lines
