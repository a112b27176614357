"""The chunked linear + cross-entropy against the plain one: loss and gradients, fp32 and under bf16 autocast,
with ignored targets, a chunk that does not divide the rows, and the memory it keeps for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from saturate.workloads.chunked_loss import linear_cross_entropy


def _both(rows: int = 37, width: int = 16, vocab: int = 50, chunk: int = 8, ignored: int = 5,
          autocast: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    torch.manual_seed(0)
    h0, w0 = torch.randn(rows, width), torch.randn(vocab, width) * 0.3
    targets = torch.randint(0, vocab, (rows,))
    targets[torch.randperm(rows)[:ignored]] = -100
    out = []
    for chunked in (False, True):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = (linear_cross_entropy(h, w, targets, chunk) if chunked else
                    F.cross_entropy(h @ w.t(), targets))
        loss.backward()
        out.append([loss.detach(), h.grad, w.grad])
    return out[0], out[1]


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_the_chunked_loss_and_its_gradients_equal_the_plain_ones_in_fp32(chunk):
    plain, chunked = _both(chunk=chunk)
    for a, b in zip(plain, chunked, strict=True):
        assert a.dtype == b.dtype and torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a, b)


def test_under_bf16_autocast_it_agrees_as_closely_as_bf16_allows():
    plain, chunked = _both(autocast=True)
    assert abs(plain[0].item() - chunked[0].item()) < 1e-2 * abs(plain[0].item())
    for a, b in zip(plain[1:], chunked[1:], strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert (a - b).norm() < 2e-2 * a.norm(), ((a - b).norm(), a.norm())


def test_every_target_ignored_gives_zero_loss_and_zero_gradients_not_nan():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(10, 8, requires_grad=True)
    loss = linear_cross_entropy(h, w, torch.full((4,), -100), chunk=3)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().sum() == 0 and w.grad.abs().sum() == 0


def test_leading_dimensions_are_flattened_like_a_language_models_batch():
    torch.manual_seed(1)
    h, w, y = torch.randn(2, 5, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 5))
    plain = F.cross_entropy((h @ w.t()).view(-1, 11), y.view(-1))
    assert torch.allclose(linear_cross_entropy(h, w, y, chunk=4), plain, rtol=1e-5)


def test_a_chunk_below_one_is_refused():
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        linear_cross_entropy(torch.randn(2, 3), torch.randn(4, 3), torch.zeros(2, dtype=torch.long), chunk=0)


def test_what_backward_keeps_is_the_hidden_and_weight_gradients_not_the_logits():
    """Saved for backward: the plain path keeps the (rows x vocabulary) logits' graph; the chunked one only
    (rows x width) + (vocabulary x width) gradients, counted with saved-tensor hooks."""
    rows, width, vocab = 512, 32, 4096

    def saved_bytes(chunked: bool) -> int:
        h = torch.randn(rows, width, requires_grad=True)
        w = torch.randn(vocab, width, requires_grad=True)
        y = torch.randint(0, vocab, (rows,))
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[id(t)] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = linear_cross_entropy(h, w, y, chunk=64) if chunked else F.cross_entropy(h @ w.t(), y)
        held = sum(seen.values())
        if chunked:
            fn = loss.grad_fn
            held += sum(g.numel() * g.element_size() for g in fn.grads if g is not None)
        return held

    logits = rows * vocab * 4
    assert saved_bytes(False) >= logits
    assert saved_bytes(True) <= (rows * width + vocab * width) * 4 + 1024 < logits // 10


def test_a_chunk_holds_256_mib_of_fp32_logits_as_a_power_of_two_rows():
    from saturate.workloads.chunked_loss import chunk_rows

    assert chunk_rows(50304) == 1024  # GPT-2's padded vocabulary: 1334 rows fit, 1024 taken
    assert chunk_rows(320) == 131072 and chunk_rows(10**9) == 64


def test_without_grad_validation_makes_only_the_loss_not_the_gradients():
    """Under no_grad (a validation pass) the weight still requires grad; the gradients' two extra matmuls per
    chunk must not run then: counted, the pass costs the logits' matmul alone."""
    from torch.utils.flop_counter import FlopCounterMode

    h, w, y = torch.randn(64, 16), torch.randn(100, 16, requires_grad=True), torch.randint(0, 100, (64,))
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss = linear_cross_entropy(h, w, y, chunk=16)
    assert counter.get_total_flops() == 2 * 64 * 16 * 100
    assert torch.allclose(loss, F.cross_entropy(h @ w.detach().t(), y), rtol=1e-5)
