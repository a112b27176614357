"""The GPT model: shapes, tied embeddings, the FLOPs formula, activation checkpointing, causality."""

from __future__ import annotations

import pytest
import torch

from saturate.errors import ConfigError
from saturate.workloads.gpt import GPT, GPTConfig, flops_per_token, lm_loss

TINY = dict(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=257)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SATURATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)


def _model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def _tokens(cfg: GPTConfig, batch: int = 3, length: int | None = None, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, length or cfg.seq_len), generator=g)


@pytest.mark.parametrize(("vocab", "padded"), [(257, 320), (1, 64), (64, 64), (65, 128), (50257, 50304)])
def test_vocab_is_padded_to_a_multiple_of_64(vocab, padded):
    cfg = GPTConfig(**{**TINY, "vocab_size": vocab})
    assert cfg.padded_vocab == padded


def test_model_embedding_and_head_use_the_padded_vocab():
    model = _model()
    assert model.wte.weight.shape == (320, 32)
    assert model.lm_head.weight.shape == (320, 32)


def test_embeddings_are_tied():
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    # The shared matrix is one parameter, not two, to the optimizer and to num_params.
    params = list(model.parameters())
    assert sum(p is model.wte.weight for p in params) == 1
    assert model.num_params(non_embedding=False) == sum(p.numel() for p in params)
    # Still tied after a training step moved it.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _tokens(model.cfg)
    lm_loss(model, (x, x)).backward()
    opt.step()
    assert torch.equal(model.lm_head.weight, model.wte.weight)


def test_output_shape_is_batch_time_padded_vocab():
    model = _model()
    for batch, length in ((3, 16), (1, 5)):
        logits = model(_tokens(model.cfg, batch, length))
        assert logits.shape == (batch, length, model.cfg.padded_vocab)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()


def test_initial_loss_is_near_uniform():
    # GPT-2 initialisation: the untrained model predicts close to uniformly over the padded vocab.
    model = _model()
    x = _tokens(model.cfg)
    loss = lm_loss(model, (x, _tokens(model.cfg, seed=2))).item()
    assert abs(loss - torch.log(torch.tensor(320.0)).item()) < 0.5


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [TINY, dict(n_layer=3, n_head=4, n_embd=64, seq_len=48, vocab_size=1000)])
def test_flops_per_token_matches_the_real_parameter_count(shape, bias):
    cfg = GPTConfig(**{**shape, "bias": bias})
    model = GPT(cfg)
    L, C, T = cfg.n_layer, cfg.n_embd, cfg.seq_len
    assert flops_per_token(cfg) == 6 * model.num_params() + 12 * L * C * T
    # num_params leaves out exactly the position embedding.
    assert model.num_params(non_embedding=False) - model.num_params() == T * C


def test_bias_adds_parameters():
    assert _model(bias=True).num_params() > _model(bias=False).num_params()
    assert flops_per_token(GPTConfig(**TINY, bias=True)) > flops_per_token(GPTConfig(**TINY))


def _loss_and_grads(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model, (x, y))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    model = _model()
    model.train()
    x, y = _tokens(model.cfg, seed=3), _tokens(model.cfg, seed=4)
    loss_plain, grads_plain = _loss_and_grads(model, x, y)

    block_calls = []
    # A pre-hook: the recomputation may stop early, before a block's own forward hook would run.
    hooks = [b.register_forward_pre_hook(lambda *_: block_calls.append(1)) for b in model.blocks]
    model.set_activation_checkpointing(True)
    loss_ckpt, grads_ckpt = _loss_and_grads(model, x, y)
    for h in hooks:
        h.remove()

    # The blocks really were recomputed in backward: each ran twice.
    assert len(block_calls) == 2 * model.cfg.n_layer
    torch.testing.assert_close(loss_ckpt, loss_plain)
    assert grads_ckpt.keys() == grads_plain.keys()
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads_plain.values())


def test_activation_checkpointing_is_skipped_in_eval():
    model = _model()
    model.set_activation_checkpointing(True)
    model.eval()
    calls = []
    hooks = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in model.blocks]
    with torch.no_grad():
        model(_tokens(model.cfg))
    for h in hooks:
        h.remove()
    assert len(calls) == model.cfg.n_layer


def test_sequence_longer_than_seq_len_raises():
    model = _model()
    model(_tokens(model.cfg, length=model.cfg.seq_len))  # exactly seq_len is fine
    with pytest.raises(ValueError, match="seq_len"):
        model(_tokens(model.cfg, length=model.cfg.seq_len + 1))


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"n_embd": 30, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": 0}, "n_head"),
        ({"seq_len": 0}, "seq_len"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
    ],
)
def test_config_validation_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**{**TINY, **changes})


def test_changing_a_future_token_leaves_earlier_logits_unchanged():
    model = _model()
    model.eval()
    x = _tokens(model.cfg, batch=2)
    t = 9
    changed = x.clone()
    changed[:, t] = (x[:, t] + 1) % model.cfg.vocab_size
    with torch.no_grad():
        before, after = model(x), model(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
    # The change is visible from position t on, so the comparison above is not vacuous.
    assert not torch.allclose(after[:, t:], before[:, t:])


def test_to_dict_round_trips_the_config():
    cfg = GPTConfig(**TINY, bias=True, dropout=0.1)
    assert GPTConfig(**cfg.to_dict()) == cfg


def test_gpt2_shapes_have_gpt2_parameter_counts():
    """gpt-small / gpt-medium with GPT-2's 50257 vocabulary are the 124M / 350M models (no biases)."""
    from saturate.workloads import PRESETS

    def count(preset: str) -> int:
        p = PRESETS[preset]
        cfg = GPTConfig(n_layer=p.n_layer, n_head=p.n_head, n_embd=p.n_embd, seq_len=p.seq_len, vocab_size=50257)
        with torch.device("meta"):
            return sum(x.numel() for x in GPT(cfg).parameters())

    assert 123e6 < count("gpt-small") < 125e6
    assert 353e6 < count("gpt-medium") < 356e6


def test_the_chunked_loss_trains_the_same_as_the_plain_one():
    """plan.loss_chunk through the Stepper's switch: the same loss and gradients as the whole logits (issue 32)."""
    from saturate.engine.wrap import enable_chunked_loss

    x, y = _tokens(_model().cfg, seed=3), _tokens(_model().cfg, seed=4)
    grads = []
    for chunk in (None, 7):
        model = _model()
        if chunk:
            enable_chunked_loss(model, chunk)
        loss = lm_loss(model, (x, y))
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (plain, g0), (chunked, g1) = grads
    assert torch.allclose(plain, chunked, rtol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(g0, g1, strict=True))
    assert _model()(x).shape == (3, 16, 320)  # without targets the model still gives its logits


def test_a_model_without_a_chunked_loss_refuses_the_knob_in_one_line():
    from saturate.engine.wrap import enable_chunked_loss

    with pytest.raises(ConfigError, match="plan.loss_chunk: Linear has no chunked loss"):
        enable_chunked_loss(torch.nn.Linear(2, 2), 64)


def test_the_attention_backend_of_the_plan_runs_every_forward():
    """plan.attention through the Stepper's precision (issue 32): on a CPU the math and flash kernels train the
    same model to within rounding; a backend this device has no kernel for fails the step, as a trial would."""
    import dataclasses

    from saturate.engine.step import Stepper
    from saturate.plan import Plan
    from saturate.workloads import build_workload

    w = dataclasses.replace(build_workload("gpt-tiny", seed=0), val_data=None)
    batch = tuple(torch.stack(t) for t in zip(*[w.train_data[i] for i in range(4)], strict=True))
    losses = []
    for backend in (None, "math", "flash"):
        torch.manual_seed(0)
        stepper = Stepper(w, Plan(micro_batch=4, attention=backend), torch.device("cpu"), 1e-3, compile=False)
        with stepper.precision.autocast():
            losses.append(w.loss_fn(stepper.model, batch).item())
    assert max(losses) - min(losses) < 1e-4 * abs(losses[0]), losses
    stepper = Stepper(w, Plan(micro_batch=4, attention="cudnn"), torch.device("cpu"), 1e-3, compile=False)
    with pytest.raises(RuntimeError), stepper.precision.autocast():
        w.loss_fn(stepper.model, batch)
    with pytest.raises(ConfigError, match="plan.attention must be one of flash, efficient, cudnn, math"):
        Plan(attention="fast")
