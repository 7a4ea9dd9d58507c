"""Checked mode's message: each status word a kernel set is told by the module that ran it
(runtime.raise_status; the texts themselves are tested in test_compile_serving_set.py)."""

from __future__ import annotations

import pytest
import torch

from dsv4jit import runtime

CPU = torch.device("cpu")
DESCRIBE = ("describe_compress_status", "describe_store_status")


@pytest.fixture
def lookups(monkeypatch):
    """The module functions raise_status looks up; each describes a word as its export name and value."""
    calls = []

    def function(kernel, export, device, **params):
        calls.append((kernel, export, params))
        return lambda word: f"{export}={word}"

    monkeypatch.setattr(runtime, "function", function)
    return calls


def test_the_words_set_are_told_by_their_exports_of_the_variant_that_ran(lookups):
    with pytest.raises(ValueError, match=r"^dsv4jit\.compress_and_store \(checked mode\): "
                                         r"describe_compress_status=3; describe_store_status=4$"):
        runtime.raise_status(torch.tensor([3, 4], dtype=torch.int32), "compress_and_store", "fused", CPU,
                             {"ratio": 4, "format": "v4_fp8"}, DESCRIBE)
    assert lookups == [("fused", e, {"ratio": 4, "format": "v4_fp8"}) for e in DESCRIBE]


def test_a_word_without_bits_is_not_told(lookups):
    with pytest.raises(ValueError, match=r"\(checked mode\): describe_store_status=1$"):
        runtime.raise_status(torch.tensor([0, 1], dtype=torch.int32), "op", "fused", CPU, {}, DESCRIBE)
    assert [export for _, export, _ in lookups] == ["describe_store_status"]


def test_nothing_reported_or_default_mode_raises_nothing(lookups):
    runtime.raise_status(torch.zeros(1, dtype=torch.int32), "compress_forward", "compress_c4", CPU, {})
    runtime.raise_status(None, "compress_forward", "compress_c4", CPU, {})
    assert lookups == []
