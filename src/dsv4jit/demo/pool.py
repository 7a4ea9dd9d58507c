"""The serving stack's side of the demo: a paged KV pool, requests and the step schedule.

Everything here is CPU truth that both engines (kernels and reference) copy: the token-slot
mappings a pool allocator hands the planner, and the batches a scheduler runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SWA_PAGE = 256  # page_size = swa_page_size of DeepSeek-V4 (the compressed pages hold 256 / R tokens)


class PagedPool:
    """Full KV pool pages (256 tokens), one SWA page per full page, and request slots.

    ``req_to_token[slot][pos]`` is a token's slot in the full pool; ``full_to_state[full_slot]`` its
    slot in the SWA pool (page aligned: same offset in the page), ending with the -1 sentinel.
    Full page 0 is the padding page and belongs to no request, so an ``out_loc`` of 0 (a token
    that closes no window) names a slot nobody reads. Pages are shuffled, as after a while of
    serving.
    """

    def __init__(self, num_slots: int, max_ctx: int, gen: torch.Generator):
        pages_per_req = -(-max_ctx // SWA_PAGE)
        owned = num_slots * pages_per_req
        self.num_slots, self.max_ctx = num_slots, max_ctx
        self.num_full_pages = owned + 1
        self.num_swa_pages = owned
        full_page = (torch.randperm(owned, generator=gen) + 1).reshape(num_slots, pages_per_req)
        pos = torch.arange(max_ctx)
        self.req_to_token = (full_page[:, pos // SWA_PAGE] * SWA_PAGE + pos % SWA_PAGE).to(torch.int32)
        swa_of_full = torch.full((self.num_full_pages,), -1, dtype=torch.int64)
        swa_of_full[1:] = torch.randperm(owned, generator=gen)
        offsets = torch.arange(SWA_PAGE)
        slots = swa_of_full[:, None] * SWA_PAGE + offsets
        slots[0] = -1
        self.full_to_state = torch.cat([slots.reshape(-1), torch.tensor([-1])])


@dataclass(frozen=True)
class Step:
    """One forward step: requests (their pool slots, batch order) and their lengths after the step."""

    kind: str  # "prefill" or "decode"
    slots: tuple[int, ...]
    seq_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def token_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pool slot, position) of every token of the step, in ragged order."""
        slots = torch.repeat_interleave(torch.tensor(self.slots, dtype=torch.int64),
                                        torch.tensor(self.extend_lens, dtype=torch.int64))
        pos = torch.cat([torch.arange(s - e, s, dtype=torch.int64) for s, e in zip(self.seq_lens, self.extend_lens)])
        return slots, pos


def out_loc(req_to_token: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Per token: its compressed-cache location if it closes a window (full slot // R), else 0.

    This is what the serving stack's metadata builder computes (contract §6.1); plain tensor ops, so it
    runs on the device and inside a CUDA graph too.
    """
    raw = req_to_token[slots, positions].to(torch.int64)
    return torch.where((positions + 1) % ratio == 0, raw // ratio, torch.zeros_like(raw))


def schedule(prompt_lens: list[int], slots: list[int], chunk: int, decode_steps: int) -> list[Step]:
    """Chunked prefill with a token budget of ``chunk`` per step (the last request of a step may be
    cut and continue in the next one), then ``decode_steps`` steps that decode every request."""
    done = [0] * len(prompt_lens)
    steps = []
    while any(d < n for d, n in zip(done, prompt_lens)):
        budget, batch = chunk, []
        for i, n in enumerate(prompt_lens):
            take = min(n - done[i], budget)
            if take > 0:
                done[i] += take
                budget -= take
                batch.append((slots[i], done[i], take))
            if budget == 0:
                break
        steps.append(Step("prefill", *(tuple(col) for col in zip(*batch))))
    lens = list(prompt_lens)
    for _ in range(decode_steps):
        lens = [n + 1 for n in lens]
        steps.append(Step("decode", tuple(slots), tuple(lens), (1,) * len(lens)))
    return steps
