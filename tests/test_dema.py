"""dema.py: the two selective scans against each other and an einsum oracle, a hand-computed scan, the scan in fp32
under bf16 autocast, chunked (checkpointed) backprop = plain backprop and the memory it saves, the recurrent step
against the full forward, inert left padding, causality by perturbation (B3LD and BL3D), hidden attention against
explicit materialisation, parameter counts against the official model's (Tables 7 and 17), the official init, the
RTG alignment, the S6 ablation of Fig. 5, overfitting, and the CLI and analyses on tiny Minari datasets. Atari (image
states, discrete actions): causality with frames, the recurrent step against the full forward, "DeMa with post."
counted by hand, cross-entropy by hand, the paper's settings, the schedule, and CLI runs and exact resume on the tiny
Breakout set."""
import csv
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import dema
import evaluate as ev

SCANS = {"sequential": dema.selective_scan_sequential, "parallel": dema.selective_scan_parallel}


def scan_reference(u, delta, A, B, C, D, z, delta_bias):
    """Independent oracle, written as mamba's selective_scan_ref (einsum-precomputed deltaA / deltaB_u, indexing),
    with delta_softplus=True. Differentiated by autograd."""
    delta = F.softplus(delta + delta_bias[:, None])
    deltaA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    deltaB_u = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = torch.zeros(u.shape[0], u.shape[1], A.shape[1], dtype=u.dtype)
    ys = []
    for i in range(u.shape[2]):
        x = deltaA[:, :, i] * x + deltaB_u[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    y = torch.stack(ys, dim=2) + u * D[:, None]
    return y * F.silu(z)


def scan_inputs(L, dtype, seed=0, b=2, d=4, n=3, extreme=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    A = -torch.exp(r(d, n))                                           # negative, like -exp(A_log)
    delta = r(b, d, L)
    if extreme:                                                       # A * Delta down to about -1e6: exp -> 0
        A[0] *= 1e4
        delta[:, :2] = delta[:, :2].abs() * 40 + 30                   # above softplus's threshold 20 as well
    xs = dict(u=r(b, d, L), delta=delta, A=A, B=r(b, n, L), C=r(b, n, L), D=r(d), z=r(b, d, L), delta_bias=r(d) * 0.5)
    return {k: v.to(dtype).requires_grad_() for k, v in xs.items()}


def values_and_grads(fn, xs, **kw):
    y = fn(**xs) if fn is scan_reference else fn(**xs, delta_softplus=True, **kw)
    w = torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape)  # a generic upstream gradient
    grads = torch.autograd.grad((y * w).sum(), list(xs.values()))
    return [y] + list(grads)


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("L", [1, 7, 60, 300])
@pytest.mark.parametrize("extreme", [False, True])
def test_scans_agree_with_each_other_and_the_reference(L, extreme):
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 2e-4)):
        xs = scan_inputs(L, dtype, seed=L, extreme=extreme)
        out = {name: values_and_grads(fn, xs) for name, fn in SCANS.items()}
        for name, vals in out.items():
            assert all(torch.isfinite(v).all() for v in vals), (name, dtype)
            assert vals[0].dtype == dtype
        names = ["y"] + list(xs)
        for a, b, what in zip(out["sequential"], out["parallel"], names):
            assert rel_err(a, b) <= tol, (dtype, what, rel_err(a, b))
        if dtype == torch.float64:   # both against the independent oracle
            ref = values_and_grads(scan_reference, xs)
            for name in SCANS:
                for a, b, what in zip(out[name], ref, names):
                    assert rel_err(a, b) <= 1e-9, (name, what, rel_err(a, b))


@pytest.mark.parametrize("scan", list(SCANS))
def test_scan_hand_computed(scan):
    # one channel, one state, two steps; delta given directly (no softplus)
    u = torch.tensor([[[2.0, -1.0]]], dtype=torch.float64)
    delta = torch.tensor([[[0.5, 0.25]]], dtype=torch.float64)
    A = torch.tensor([[-2.0]], dtype=torch.float64)
    B = torch.tensor([[[3.0, 1.0]]], dtype=torch.float64)
    C = torch.tensor([[[1.0, -2.0]]], dtype=torch.float64)
    D = torch.tensor([0.5], dtype=torch.float64)
    h1 = 0.5 * 3.0 * 2.0                                  # exp(.)*0 + Delta_1 B_1 u_1 = 3
    h2 = np.exp(0.25 * -2.0) * h1 + 0.25 * 1.0 * -1.0    # = 3 e^{-0.5} - 0.25
    want = torch.tensor([1.0 * h1 + 0.5 * 2.0, -2.0 * h2 + 0.5 * -1.0], dtype=torch.float64)
    y = SCANS[scan](u, delta, A, B, C, D=D)
    assert torch.allclose(y[0, 0], want, atol=1e-12)
    z = torch.tensor([[[0.3, -1.2]]], dtype=torch.float64)
    yz = SCANS[scan](u, delta, A, B, C, D=D, z=z)
    assert torch.allclose(yz[0, 0], want * z[0, 0] * torch.sigmoid(z[0, 0]), atol=1e-12)


def test_auto_is_the_loop_on_cpu(monkeypatch):
    called = []
    for name, fn in SCANS.items():
        monkeypatch.setattr(dema, f"selective_scan_{name}", lambda *a, _n=name, _f=fn, **k: called.append(_n) or _f(*a, **k))
    xs = {k: v.detach().float() for k, v in scan_inputs(5, torch.float32).items()}
    dema.selective_scan(**xs, delta_softplus=True)
    assert called == ["sequential"]


@pytest.mark.parametrize("scan", list(SCANS))
def test_scan_stays_fp32_under_bf16_autocast(scan):
    """The state update must not run in bf16: under autocast the scan gives exactly its fp32 result (the parallel
    path's readout would otherwise be a bf16 matmul, off by ~1e-2)."""
    xs = {k: v.detach().float() for k, v in scan_inputs(60, torch.float32, seed=3).items()}
    want = dema.selective_scan(**xs, delta_softplus=True, scan=scan)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = dema.selective_scan(**xs, delta_softplus=True, scan=scan)
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_model_under_bf16_autocast_matches_fp32():
    model, b = tiny_model(dtype=torch.float32), random_window(dtype=torch.float32)
    with torch.no_grad():
        want = model(*window_args(b))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = model(*window_args(b))
            step, _ = model.step(b["states"][:, 0], b["prev_action"], b["rtg"][:, 0], b["timesteps"][:, 0],
                                 model.init_cache(3))
    assert rel_err(got.float(), want) < 3e-2, rel_err(got.float(), want)
    assert rel_err(step.float(), want[:, 0]) < 3e-2


def test_chunked_backprop_is_exact_and_saves_memory():
    """--scan-chunk: the same values and gradients; the tensors kept for the backward (counted with saved-tensor
    hooks) fall from ~2 (b, d_inner, N) states per token, the docstring's figure, to a fraction."""
    def saved(fn):
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: seen.setdefault((t.untyped_storage().data_ptr(), t.storage_offset(), t.shape),
                                          t.numel() * t.element_size()) and t, lambda t: t):
            out = fn()
        return sum(seen.values()), out
    b, di, N, L = 2, 32, 32, 60
    xs = scan_inputs(L, torch.float64, seed=4, b=b, d=di, n=N)
    plain = values_and_grads(dema.selective_scan_sequential, xs)
    chunked = values_and_grads(dema.selective_scan_sequential, xs, chunk=8)     # 8 does not divide 60
    for a, c in zip(plain, chunked):
        assert torch.allclose(a, c, rtol=1e-12, atol=1e-14)
    state = b * di * N * 8                                                       # bytes of one fp64 state
    n_plain, _ = saved(lambda: dema.selective_scan_sequential(**xs, delta_softplus=True))
    n_chunk, _ = saved(lambda: dema.selective_scan_sequential(**xs, delta_softplus=True, chunk=8))
    assert 2.0 * L * state < n_plain < 2.5 * L * state                          # ~2 states per token, + inputs
    assert n_chunk < 0.25 * n_plain


# ---------------------------------------------------------------------------------------------------------------
# the model

def tiny_cfg(**kw):
    base = dict(n_embd=16, d_model=8, n_layer=2, d_state=4, context=6, dropout=0.0)
    return dema.Config(**{**base, **kw})


def tiny_model(obs=5, act=2, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return dema.DeMa(tiny_cfg(**kw), obs, act, 100).to(dtype).eval()


def random_window(B=3, K=6, obs=5, act=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randn(B, K, obs, generator=g, dtype=dtype),
                actions=torch.rand(B, K, act, generator=g, dtype=dtype) * 2 - 1,
                prev_action=torch.rand(B, act, generator=g, dtype=dtype) * 2 - 1,
                rtg=torch.randn(B, K, 1, generator=g, dtype=dtype),
                timesteps=torch.arange(K).repeat(B, 1) + 4, mask=torch.ones(B, K, dtype=dtype))


def window_args(b):
    return b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"], b["prev_action"]


@pytest.mark.parametrize("kw", [dict(scan="sequential"), dict(scan="parallel"), dict(token_layout="bl3d"),
                                dict(timestep_embedding=True), dict(residual="post"),
                                dict(residual="post", token_layout="bl3d")])
def test_recurrent_step_equals_full_forward(kw):
    model, b = tiny_model(**kw), random_window()
    full = model(*window_args(b))                                              # (B, K, act)
    prev = dema.previous_actions(b["actions"], b["prev_action"])
    cache = model.init_cache(3, dtype=torch.float64)
    steps = []
    for t in range(b["states"].shape[1]):
        a, cache = model.step(b["states"][:, t], prev[:, t], b["rtg"][:, t], b["timesteps"][:, t], cache)
        steps.append(a)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-12, rtol=0)


def test_left_padding_is_inert():
    model, b = tiny_model(), random_window()
    mask = b["mask"].clone()
    mask[:, :2] = 0
    pad = (1 - mask)[..., None]
    short = model(b["states"][:, 2:], b["actions"][:, 2:], b["rtg"][:, 2:], b["timesteps"][:, 2:], mask[:, 2:],
                  b["actions"][:, 1])                                          # the unpadded 4-step window
    padded = model(b["states"], b["actions"], b["rtg"], b["timesteps"], mask, b["prev_action"])
    assert torch.allclose(padded[:, 2:], short, atol=1e-12, rtol=0)
    junk_actions = b["actions"].clone()
    junk_actions[:, 0] -= 3                        # a_0 is only the previous action of position 1, a pad
    junk = model(b["states"] + 9 * pad, junk_actions, b["rtg"] + 50 * pad, b["timesteps"], mask, b["prev_action"] + 1)
    assert torch.allclose(junk[:, 2:], short, atol=1e-12, rtol=0)             # pad contents do not matter ...
    moved = model(b["states"] + 9, b["actions"], b["rtg"], b["timesteps"], mask, b["prev_action"])
    assert not torch.allclose(moved[:, 2:], short, atol=1e-6)                 # ... real ones do
    model.pad_mask = False                                                     # --no-pad-mask: pads enter the state
    unmasked = model(b["states"], b["actions"], b["rtg"] + 50 * pad, b["timesteps"], mask, b["prev_action"])
    assert not torch.allclose(unmasked[:, 2:], short, atol=1e-6)


@pytest.mark.parametrize("layout", ["b3ld", "bl3d"])
def test_no_prev_action_means_no_action_reaches_the_output(layout):
    """--no-prev-action: every step's a_{t-1} slot holds the null a_{-1} = 0, so no action (in the window or before
    it) changes a prediction, in the full forward and step by step; with a_{t-1} (the method) they do."""
    b = random_window()
    other = dict(b, actions=-b["actions"], prev_action=-b["prev_action"])
    model = tiny_model(token_layout=layout, prev_action=False)
    out = model(*window_args(b))
    assert torch.allclose(model(*window_args(other)), out, atol=1e-12, rtol=0)
    zero = dict(b, actions=torch.zeros_like(b["actions"]), prev_action=torch.zeros_like(b["prev_action"]))
    model.prev_action = True                                                   # the same weights, fed zeros
    assert torch.allclose(model(*window_args(zero)), out, atol=1e-12, rtol=0)
    assert not torch.allclose(model(*window_args(b)), out, atol=1e-6)          # a_{t-1} matters in the method
    model.prev_action = False
    cache, steps = model.init_cache(3, dtype=torch.float64), []
    for t in range(b["states"].shape[1]):
        a, cache = model.step(b["states"][:, t], b["actions"][:, t], b["rtg"][:, t], b["timesteps"][:, t], cache)
        steps.append(a)
    assert torch.allclose(torch.stack(steps, 1), out, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["b3ld", "bl3d"])
def test_causal_future_does_not_change_the_past(layout):
    cfg = tiny_cfg(token_layout=layout)
    model, b = tiny_model(token_layout=layout), random_window()
    base = dema.predict(model, b, cfg)[0]
    K = b["states"].shape[1]
    assert base.shape == (3, K, 2)
    for t in range(K):
        p = {k: v.clone() for k, v in b.items()}
        p["states"][:, t + 1:] += 5.0
        p["rtg"][:, t + 1:] -= 3.0
        p["actions"][:, t:] = -p["actions"][:, t:]       # a_t itself must not influence the prediction of a_t
        out = dema.predict(model, p, cfg)[0]
        assert torch.allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-12)
        if t < K - 1:
            assert not torch.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-6)


def test_bl3d_is_one_token_per_step_of_the_three_embeddings():
    """Table 2's BL3D: the S6 layers see K tokens (B3LD: 3K), whose embedding is Linear(3E -> D) of [e_R, e_a, e_s]."""
    b = random_window()
    seen = {}
    for layout in ("b3ld", "bl3d"):
        model = tiny_model(token_layout=layout)
        model.blocks[0].register_forward_hook(lambda m, i, o, _l=layout: seen.__setitem__(_l, o.shape))
        model(*window_args(b))
    assert seen == dict(b3ld=(3, 18, 8), bl3d=(3, 6, 8))
    model = tiny_model(token_layout="bl3d")
    prev = dema.previous_actions(b["actions"], b["prev_action"])
    e = torch.cat([model.embed_return(b["rtg"]), model.embed_action(prev), model.embed_state(b["states"])], -1)
    assert torch.allclose(model.tokens(b["states"], prev, b["rtg"], b["timesteps"]), model.embedding(e), atol=1e-14)


def test_timestep_embedding_is_added_to_every_token():
    b = random_window()
    later = dict(b, timesteps=b["timesteps"] + 7)
    assert torch.equal(tiny_model()(*window_args(b)), tiny_model()(*window_args(later)))   # the default ignores t
    model = tiny_model(timestep_embedding=True)
    assert not torch.allclose(model(*window_args(b)), model(*window_args(later)), atol=1e-6)
    prev = dema.previous_actions(b["actions"], b["prev_action"])
    time = model.embed_timestep(b["timesteps"])
    e = torch.stack([model.embed_return(b["rtg"]) + time, model.embed_action(prev) + time,
                     model.embed_state(b["states"]) + time], dim=2).reshape(3, 18, -1)
    assert torch.allclose(model.tokens(b["states"], prev, b["rtg"], b["timesteps"]), model.embedding(e), atol=1e-14)


def test_rtg_alignment_default_and_official_shift():
    """Record what the model is fed: default (R_t, a_{t-1}, s_t) -> a_t over K steps; --rtg-shift (official code's
    training) (R_{t-1}, a_{t-1}, s_t) -> a_t, timestep t-1, over K-1 steps, never on an episode's first state."""
    K = 5
    idx = torch.arange(K, dtype=torch.float32)[None, :, None]                  # value = step index t
    b = dict(rtg=100 + idx, states=200 + idx.expand(1, K, 3), actions=300 + idx.expand(1, K, 2),
             prev_action=torch.full((1, 2), 299.0), timesteps=torch.arange(K)[None] + 10,
             mask=torch.tensor([[0.0, 1, 1, 1, 1]]))
    seen = {}

    def fake(states, actions, rtg, timesteps, mask, prev_action):
        seen.update(rtg=rtg[0, :, 0].tolist(), prev=dema.previous_actions(actions, prev_action)[0, :, 0].tolist(),
                    states=states[0, :, 0].tolist(), t=timesteps[0].tolist(), mask=mask[0].tolist())
        return torch.zeros_like(actions)
    _, target, _ = dema.predict(fake, b, dema.Config(), training=True)
    assert seen == dict(rtg=[100, 101, 102, 103, 104], prev=[299, 300, 301, 302, 303], states=[200, 201, 202, 203, 204],
                        t=[10, 11, 12, 13, 14], mask=[0, 1, 1, 1, 1])
    assert target[0, :, 0].tolist() == [300, 301, 302, 303, 304]
    _, target, mask = dema.predict(fake, b, dema.Config(rtg_shift=True), training=True)
    assert seen == dict(rtg=[100, 101, 102, 103], prev=[300, 301, 302, 303], states=[201, 202, 203, 204],
                        t=[10, 11, 12, 13], mask=[0, 1, 1, 1])
    assert target[0, :, 0].tolist() == [301, 302, 303, 304] and mask.shape == (1, K - 1)
    dema.predict(fake, b, dema.Config(rtg_shift=True), training=False)         # evaluation: R_t in both modes
    assert seen["rtg"] == [100, 101, 102, 103, 104]


def test_hidden_attention_equals_explicit_materialisation():
    torch.manual_seed(1)
    mixer = dema.Mamba(d_model=6, d_state=3, n_layer=1).double()
    h = torch.randn(2, 9, 6, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.float64)
    mask[1, :3] = 0
    alpha = mixer.hidden_attention(h, mask)                                    # (b, di, T, T)
    x, delta, A, B, C = mixer.ssm_inputs(mixer.s6_input(h), mask)
    T = h.shape[1]
    # explicit: column j of alpha is the scan's response to a unit input at position j (alpha is linear in x)
    explicit = torch.stack([dema.selective_scan_sequential(F.one_hot(torch.tensor(j), T).double().expand_as(x),
                                                           delta, A, B, C) for j in range(T)], dim=-1)
    assert torch.allclose(alpha, explicit, atol=1e-12, rtol=0)
    assert torch.equal(alpha, alpha.tril())                                    # causal
    # and alpha @ x is the S6 output without the D skip and the gate
    y = dema.selective_scan_sequential(x, delta, A, B, C)
    assert torch.allclose(torch.einsum("bcij,bcj->bci", alpha, x), y, atol=1e-12, rtol=0)
    last = mixer.hidden_attention(h, mask, last_row=True)
    assert torch.allclose(last, alpha[:, :, -1], atol=1e-14, rtol=0)
    assert torch.equal(alpha[1, :, :, :3], torch.zeros_like(alpha[1, :, :, :3]))   # inert pads get no attention


@pytest.mark.parametrize("layout,T", [("b3ld", 18), ("bl3d", 6)])
def test_hidden_attention_per_layer_shapes(layout, T):
    model, b = tiny_model(token_layout=layout), random_window(K=6)
    attn = model.hidden_attention(*window_args(b))
    assert len(attn) == 2 and attn[0].shape == (3, 16, T, T)
    assert all(torch.isfinite(a).all() for a in attn)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def test_parameter_counts_match_the_official_model():
    # official (Table 7 / 17): 175,503 (hopper, E=256, D=64, N=64), 499,983 (D=128), 431,503 with the timestep
    # embedding; each with unused predict_state (D*11+11) and predict_return (D+1) heads that this file leaves out
    for d_model, kw, official in ((64, {}, 175_503), (128, {}, 499_983), (64, dict(timestep_embedding=True), 431_503)):
        n = n_params(dema.DeMa(dema.Config(n_embd=256, d_model=d_model, d_state=64, **kw), 11, 3, 1000))
        assert n + (11 * d_model + 11) + (d_model + 1) == official
    base = n_params(dema.DeMa(dema.Config(), 11, 3, 1000))
    assert base == 174_723
    # Table 17: the timestep embedding is max_ep_len x E = 1000 x 256 more; BL3D's input Linear is 3E x D (2 E D more)
    assert n_params(dema.DeMa(dema.Config(timestep_embedding=True), 11, 3, 1000)) - base == 256_000
    assert n_params(dema.DeMa(dema.Config(token_layout="bl3d"), 11, 3, 1000)) - base == 2 * 256 * 64


def test_table_7_counts_dt_py_beside_dema(capsys):
    """Table 7's comparison: dt.py's models at its paper settings against DeMa's (--params prints DeMa's rows only,
    so that no model file imports another)."""
    import dt
    dema.main(["--params"])
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("dema ") for line in out[1:])
    hopper = dt.Config(**ev.preset_values(dt.PRESETS, "", "hopper-medium"))
    atari = dt.Config(**ev.preset_values(dt.PRESETS, "", "breakout-expert"))
    assert n_params(dt.DecisionTransformer(hopper, 11, 3, 1000)) == 726_019          # Table 7's 726.2K
    assert n_params(dema.DeMa(dema.Config(), 11, 3, 1000)) == 174_723                # against DeMa's 175.5K
    assert n_params(dt.AtariDecisionTransformer(atari, 4, 1000)) == 1_810_208
    assert n_params(dema.DeMa(dema.Config(**dema.ATARI), 4 * 84 * 84, 4, 1000, discrete=True)) == 1_713_184


def test_init_follows_the_official_code():
    """apply(_init_weights) over the whole official model: every Linear bias zero but dt_proj's (softplus^-1 of
    dt in [1e-3, 1e-1]); the timestep embedding N(0, 0.02); A_log = log(1..N); D = 1."""
    torch.manual_seed(0)
    model = dema.DeMa(dema.Config(timestep_embedding=True), 11, 3, 1000)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m.bias is not None}
    assert {"embed_return", "embed_action", "embed_state", "embedding", "predict_action.0"} <= set(linears)
    for name, m in linears.items():
        if name.endswith("dt_proj"):
            dt = F.softplus(m.bias)
            assert dt.min() >= 1e-3 - 1e-9 and dt.max() <= 1e-1 + 1e-9
        else:
            assert torch.equal(m.bias, torch.zeros_like(m.bias)), name
    assert abs(model.embed_timestep.weight.std().item() - 0.02) < 1e-3
    mixer = model.blocks[0].mixer
    assert torch.allclose(mixer.A_log[5], torch.log(torch.arange(1, 65.0)))
    assert torch.equal(mixer.D, torch.ones_like(mixer.D))


def test_paper_settings_and_flag_order():
    assert dema.paper_values("hopper-medium") == dict(n_embd=256, d_model=64, lr=1e-4)
    assert dema.paper_values("mujoco/walker2d/expert-v0")["lr"] == 1e-3
    assert dema.paper_values("replica/hopper/medium-replay-v0")["n_embd"] == 256

    def parse(*argv):                                          # as main() reads a command line
        return dema.paper_settings(*dema.parse_flags(list(argv)))
    cfg = parse("--env", "halfcheetah-medium")
    assert (cfg.n_embd, cfg.d_model, cfg.lr) == (128, 64, 1e-3)
    cfg = parse("--env", "halfcheetah-medium", "--preset", "cpu", "--d-model", "24")
    assert cfg.n_embd == dema.PRESETS["cpu"]["n_embd"] and cfg.d_model == 24 and cfg.lr == 1e-3
    assert parse("--env", "pointmaze-medium").dropout == 0.1
    # evaluation episodes: 100 as in the official MuJoCo code, 50 on mazes (F.2); the preset and the flag win
    assert parse("--env", "hopper-medium").eval_episodes == 100 and parse("--env", "pointmaze-umaze").eval_episodes == 50
    assert parse("--env", "hopper-medium", "--preset", "cpu").eval_episodes == dema.PRESETS["cpu"]["eval_episodes"]
    assert parse("--env", "antmaze-umaze", "--preset", "cpu").eval_episodes == dema.PRESETS["cpu"]["mazes"]["eval_episodes"]
    assert parse("--env", "pointmaze-large", "--eval-episodes", "3").eval_episodes == 3
    assert parse() == dema.Config()                           # no dataset named: the defaults (hopper-medium's)


def fit_one_batch(model, b, cfg, lr, steps):
    """AdamW on the one batch b for `steps` updates -> the last loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = dema.loss_fn(model, b, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


@pytest.mark.slow
def test_overfits_one_batch():
    b = random_window(B=4, seed=1, dtype=torch.float32)
    b["mask"][0, :2] = 0
    loss = fit_one_batch(tiny_model(dtype=torch.float32).train(), b, tiny_cfg(), lr=1e-2, steps=150)
    assert loss < 5e-3, loss


def test_rnn_act_carries_state_like_the_full_history():
    """policy() in rnn mode over an interleaved pair of episodes (one finishing early, one restarting) equals the
    full forward over each episode's history."""
    cfg = tiny_cfg(mode="rnn")
    model = tiny_model(dtype=torch.float32)
    act = dema.policy(model, cfg)
    g = torch.Generator().manual_seed(2)
    T = 7
    eps = [dict(s=torch.randn(T, 5, generator=g), a=torch.rand(T, 2, generator=g) * 2 - 1,
                R=torch.randn(T, 1, generator=g)) for _ in range(2)]
    got = {0: [], 1: []}
    for t in range(T):
        live = np.array([0, 1]) if t < 4 else np.array([1])
        rows = [dict(states=eps[i]["s"][t:t + 1], actions=torch.zeros(1, 2), rtg=eps[i]["R"][t:t + 1],
                     prev_action=eps[i]["a"][t - 1] if t else torch.zeros(2), timesteps=torch.tensor([t]),
                     mask=torch.ones(1)) for i in live]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}       # a K=1 window per live env
        out = act(batch, live)
        for j, i in enumerate(live):
            got[i].append(out[j])
    for i, n in ((0, 4), (1, T)):
        e = eps[i]
        full = model(e["s"][None, :n], e["a"][None, :n], e["R"][None, :n], torch.arange(n)[None], torch.ones(1, n),
                     torch.zeros(1, 2))[0]
        assert torch.allclose(torch.stack(got[i]), full, atol=1e-5), i
    # a fresh episode in slot 0 (timesteps 0) starts from a zero state again
    batch = dict(states=eps[1]["s"][:1][None], actions=torch.zeros(1, 1, 2), rtg=eps[1]["R"][:1][None],
                 prev_action=torch.zeros(1, 2), timesteps=torch.zeros(1, 1, dtype=torch.long), mask=torch.ones(1, 1))
    assert torch.allclose(act(batch, np.array([0]))[0], torch.stack(got[1])[0], atol=1e-6)


@pytest.mark.parametrize("how", ["zero", "random", "swap"])
def test_s6_ablation_changes_only_the_chosen_layers_s6(how):
    """Fig. 5: the S6 parameters of the chosen layers become zero / a fresh init / the donor's; nothing else moves.
    Zeroed, the layer's mixer outputs exactly 0 (the block is its residual alone)."""
    model = tiny_model(n_layer=3)
    donor = tiny_model(n_layer=3)
    with torch.no_grad():
        for p in donor.parameters():
            p.add_(1.0)                                    # a donor that differs everywhere
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dema.ablate_s6(model, how, [0, 2], donor=donor, seed=5)
    after = model.state_dict()
    torch.manual_seed(5)
    fresh = dema.Mamba(8, 4, 4, 2, n_layer=3).double()   # the 'random' source of layer 0 (seed + layer)
    for k in before:
        layer, _, name = k.partition(".mixer.")
        chosen = name in dema.S6_PARAMETERS and layer in ("blocks.0", "blocks.2")
        if not chosen:
            assert torch.equal(after[k], before[k]), k
        elif how == "zero":
            assert torch.equal(after[k], torch.zeros_like(after[k])), k
        elif how == "swap":
            assert torch.equal(after[k], donor.state_dict()[k]), k
        else:
            assert not torch.equal(after[k], before[k]) or name == "A_log" or name == "D", k
            if layer == "blocks.0":
                assert torch.equal(after[k], fresh.get_parameter(name)), k
    if how == "zero":
        h = torch.randn(2, 9, 8, dtype=torch.float64)
        assert torch.equal(model.blocks[0].mixer(h), torch.zeros_like(h))


# ---------------------------------------------------------------------------------------------------------------
# the command line and the analyses on tiny datasets

TINY = ["--n-embd", "16", "--d-model", "8", "--d-state", "4", "--n-layer", "2", "--context", "4", "--batch-size", "8",
        "--eval-episodes", "2", "--log-every", "5", "--warmup-steps", "5"]


def run_cli(args, out):
    dema.main([*TINY, "--out", str(out), *map(str, args)])


def final_line(capsys):
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.slow
def test_cli_run_writes_outputs(tiny_hopper, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--steps", 10, "--eval-every", 5], tmp_path)
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=2")
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png", "attention.png"):
        assert os.path.getsize(tmp_path / f) > 0
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["dataset_id"] == tiny_hopper and ck["script"] == "dema"
    evals = [r for r in csv.DictReader(open(tmp_path / "log.csv")) if r["target"]]
    assert sorted({float(r["target"]) for r in evals}) == [1800.0, 3600.0] and len(evals) == 4
    assert json.load(open(tmp_path / "config.json"))["mode"] == "transformer"


@pytest.mark.parametrize("extra", [["--context", 2], ["--context", 1], ["--token-layout", "bl3d", "--context", 2]])
@pytest.mark.slow
def test_short_contexts_draw_the_attention_figure(extra, tiny_hopper, tmp_path, capsys):
    """--context <= 2 used to crash the end-of-run figure (distance 6 of a 6-token window)."""
    run_cli(["--dataset", tiny_hopper, "--steps", 2, "--eval-every", 2, "--eval-episodes", 1, *extra], tmp_path)
    assert os.path.getsize(tmp_path / "attention.png") > 0 and "hidden attention ->" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_rnn_mode_and_maze(tiny_hopper, tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--mode", "rnn", "--rnn-max-len", 50, "--batch-size", 2, "--scan-chunk", 16,
             "--steps", 3, "--eval-every", 1000, "--target-return", 500], tmp_path / "rnn")
    assert final_line(capsys).endswith("episodes=2")
    run_cli(["--dataset", tiny_maze, "--steps", 3, "--eval-every", 1000], tmp_path / "maze")
    final_line(capsys)
    rows = [r for r in csv.DictReader(open(tmp_path / "maze" / "log.csv")) if r["target"]]
    assert rows and rows[0]["success_rate"] != ""


@pytest.mark.slow
def test_resume_gives_identical_weights(tiny_hopper, tmp_path, capsys):
    common = ["--dataset", tiny_hopper, "--eval-every", 1000, "--eval-episodes", 1, "--seed", 3,
              "--target-return", 500, "--rtg-shift", "--timestep-embedding"]
    run_cli(common + ["--steps", 8], tmp_path / "straight")
    run_cli(common + ["--steps", 4], tmp_path / "split")
    dema.main(["--out", str(tmp_path / "split"), "--resume", "--steps", "8"])   # the run's settings from its checkpoint
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 8 and b["config"]["rtg_shift"] and b["config"]["timestep_embedding"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def one_sentence(capsys, args):
    with pytest.raises(SystemExit) as e:
        dema.main([str(a) for a in args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: ") and "\n" not in err, err
    return err


def test_bad_input_is_one_sentence(tiny_hopper, tmp_path, capsys):
    for args, words in ((["--mode", "lstm"], "--mode"),
                        (["--mode", "rnn", "--no-pad-mask"], "pad mask"), (["--token-layout", "bld"], "--token-layout"),
                        (["--scan", "fast"], "--scan"), (["--d-state", 0], "--d-state"), (["--expand", -1], "--expand"),
                        (["--s6-layers", "one"], "--s6-layers"), (["--s6-ablation", "swap"], "--s6-donor"),
                        (["--s6-ablation", "shuffle"], "--s6-ablation"), (["--mode", "rnn", "--compile"], "--compile"),
                        (["--rtg-shift", "--context", 1], "--rtg-shift"), (["--scan-chunk", -2], "--scan-chunk"),
                        (["--bench-scan", "--attention"], "choose one"), (["--dropout", 2], "--dropout"),
                        (["--residual", "mid"], "--residual"), (["--inner-it", 0], "--inner-it"),
                        (["--beta2", 1.5], "--beta2"), (["--lr-decay-steps", -1], "--lr-decay-steps")):
        out = tmp_path / "x"
        err = one_sentence(capsys, ["--dataset", tiny_hopper, *TINY, "--out", out, "--steps", 1, *args])
        assert words in err, (args, err)
        assert not out.exists()
    assert "unknown environment" in one_sentence(capsys, [*TINY, "--env", "no-such-env", "--out", tmp_path / "y"])


@pytest.mark.slow
def test_analyses_read_the_checkpoint(tiny_hopper, tmp_path, capsys):
    """--attention (Fig. 4) and --s6-ablation (Fig. 5) on a tiny run: they never train, and the episode's attention
    rows are the model's own: nothing on the window's padding, whose length shrinks step by step."""
    run = tmp_path / "run"
    run_cli(["--dataset", tiny_hopper, "--steps", 2, "--eval-every", 2, "--eval-episodes", 1], run)
    before = (run / "ckpt.pt").read_bytes()
    capsys.readouterr()
    dema.main(["--out", str(run), "--attention"])
    assert "hidden attention along one episode" in capsys.readouterr().out
    assert os.path.getsize(run / "attention_episode.png") > 0
    attn = np.load(run / "attention_episode.npz")["attention"]                   # (steps, n_layer, 3K)
    assert attn.shape[1:] == (2, 12) and len(attn) >= 2
    for t in range(min(len(attn), 4)):                                           # step t has t+1 real steps
        real = 3 * (t + 1)
        assert np.all(attn[t, :, :12 - real] == 0) and np.all(attn[t, :, 12 - real:].max(-1) > 0), t
    dema.main(["--out", str(run), "--s6-ablation", "zero", "--s6-layers", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("s6 ablation zero of layers 1")]
    assert len(lines) == 2 and "(original" in lines[0]                           # one per target return
    donor = tmp_path / "donor"
    run_cli(["--dataset", tiny_hopper, "--steps", 2, "--eval-every", 2, "--eval-episodes", 1, "--seed", 1], donor)
    dema.main(["--out", str(run), "--s6-ablation", "swap", "--s6-donor", str(donor), "--target-return", "500"])
    assert "s6 ablation swap of layers 0,1, target 500.0" in capsys.readouterr().out
    assert (run / "ckpt.pt").read_bytes() == before
    assert "this run has 2 layers" in one_sentence(capsys, ["--out", run, "--s6-ablation", "zero", "--s6-layers", "5"])
    assert "no checkpoint" in one_sentence(capsys, ["--out", run, "--s6-ablation", "swap", "--s6-donor", tmp_path / "x"])
    rnn = tmp_path / "rnn"
    run_cli(["--dataset", tiny_hopper, "--mode", "rnn", "--rnn-max-len", 20, "--steps", 1, "--eval-every", 1000,
             "--target-return", 500, "--eval-episodes", 1], rnn)
    assert "--mode rnn" in one_sentence(capsys, ["--out", rnn, "--attention"])


def test_no_run_flags(capsys, monkeypatch):
    monkeypatch.setattr(dema, "time_scan", lambda fn, *a, **k: 1.0 if fn is dema.selective_scan_sequential else 2.0)
    dema.main(["--bench-scan"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("selective scan") and all(line.endswith("sequential") for line in lines[2:])
    dema.main(["--params"])
    out = capsys.readouterr().out
    assert "174,723" in out and "430,723" in out and "726,019" not in out
    assert "1,713,184" in out and "1,836,960" in out      # Atari: the official code's sizes (Table 7) and Table 9's
    assert math.isfinite(dema.time_scan(dema.selective_scan_sequential, 1, 4, 5, 2, reps=1))


# ---------------------------------------------------------------------------------------------------------------
# Atari: image states (the last 4 of the 84x84 frames, uint8), discrete actions, logits and cross-entropy

def tiny_atari(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return dema.DeMa(tiny_cfg(**kw), 4 * 84 * 84, 4, 50, discrete=True).to(dtype).eval()


def atari_window(B=2, K=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randint(0, 256, (B, K, 4, 84, 84), generator=g, dtype=torch.uint8),
                actions=torch.randint(0, 4, (B, K), generator=g), prev_action=torch.randint(0, 4, (B,), generator=g),
                rtg=torch.randn(B, K, 1, generator=g, dtype=dtype) * 5, timesteps=torch.arange(K).repeat(B, 1) + 3,
                mask=torch.ones(B, K, dtype=dtype))


ATARI_VARIANTS = [{}, dict(residual="post"), dict(token_layout="bl3d"), dict(residual="post", token_layout="bl3d")]


@pytest.mark.parametrize("kw", ATARI_VARIANTS)
def test_atari_is_causal_with_frames(kw):
    """Changing the frames, returns-to-go and actions from step j on leaves the logits before j as they were and
    changes those at j; an action a_j first reaches step j + 1 (as a_{t-1}), never its own prediction."""
    cfg, model, b = tiny_cfg(**kw), tiny_atari(**kw), atari_window()
    base = dema.predict(model, b, cfg)[0]
    B, K = b["actions"].shape
    assert base.shape == (B, K, 4) and base.dtype == torch.float64
    for j in range(K):
        c = {k: v.clone() for k, v in b.items()}
        c["states"][:, j:] = 255 - c["states"][:, j:]
        c["rtg"][:, j:] += 3.0
        c["actions"][:, j:] = (c["actions"][:, j:] + 1) % 4
        out = dema.predict(model, c, cfg)[0]
        assert torch.allclose(out[:, :j], base[:, :j], atol=1e-12, rtol=0), j
        assert not torch.allclose(out[:, j], base[:, j], atol=1e-6), j
    for j in range(K):
        c = dict(b, actions=b["actions"].clone())
        c["actions"][:, j] = (c["actions"][:, j] + 2) % 4
        out = dema.predict(model, c, cfg)[0]
        assert torch.allclose(out[:, :j + 1], base[:, :j + 1], atol=1e-12, rtol=0), j
        if j < K - 1:
            assert not torch.allclose(out[:, j + 1], base[:, j + 1], atol=1e-6), j
    c = dict(b, prev_action=(b["prev_action"] + 1) % 4)          # a_{t0-1}, the action before the window
    assert not torch.allclose(dema.predict(model, c, cfg)[0][:, 0], base[:, 0], atol=1e-6)


def test_atari_tokens_are_the_official_order_and_embeddings():
    """[a_{t-1}, R_t, s_t] per step (the official Atari code), each embedding followed by tanh: frames / 255 through
    DQN's torso, R_t by Linear, a_{t-1} by a table; the logits are a bias-free Linear of the s_t token."""
    model, b = tiny_atari(), atari_window()
    B, K = b["actions"].shape
    prev = dema.previous_actions(b["actions"], b["prev_action"])
    e_s = torch.tanh(model.embed_state[:-1](b["states"].reshape(B * K, 4, 84, 84).double() / 255)).view(B, K, -1)
    e = torch.stack([torch.tanh(model.embed_action[0](prev)), torch.tanh(model.embed_return[0](b["rtg"])), e_s], 2)
    assert torch.allclose(model.tokens(b["states"], prev, b["rtg"], b["timesteps"]),
                          model.embedding(e.reshape(B, 3 * K, -1)), atol=1e-12, rtol=0)
    assert isinstance(model.predict_action, torch.nn.Linear) and model.predict_action.bias is None


@pytest.mark.parametrize("kw", ATARI_VARIANTS)
def test_atari_recurrent_step_equals_full_forward(kw):
    """RNN-like DeMa on frames: one triplet at a time with the carried state gives the transformer-mode logits."""
    model, b = tiny_atari(**kw), atari_window(K=6)
    full = model(*window_args(b))                                              # (B, K, |A|)
    prev = dema.previous_actions(b["actions"], b["prev_action"])
    cache, steps = model.init_cache(2, dtype=torch.float64), []
    for t in range(6):
        logits, cache = model.step(b["states"][:, t], prev[:, t], b["rtg"][:, t], b["timesteps"][:, t], cache)
        steps.append(logits)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-12, rtol=0)


@pytest.mark.slow
def test_atari_rnn_evaluation_plays_the_transformer_game(tiny_breakout):
    """In the env: RNN-like evaluation (the current step only, states carried) and transformer-like evaluation over a
    window holding the whole episode draw from the same logits at every step, so they play the same games."""
    d = data.load_data(tiny_breakout)
    d.horizon = 30
    model = tiny_atari(dtype=torch.float32)
    logits, results = {}, {}
    for mode, K in (("transformer", 30), ("rnn", 1)):
        act, logits[mode] = dema.policy(model, tiny_cfg(mode=mode)), []

        def record(batch, live, _act=act, _seen=logits[mode]):
            _seen.append(_act(batch, live))
            return _seen[-1]
        results[mode] = ev.evaluate(record, d, 2, 90, seed=1, context=K, progress=False)
    a, b = results["transformer"], results["rnn"]
    assert np.array_equal(a["returns"], b["returns"]) and np.array_equal(a["lengths"], b["lengths"])
    assert len(logits["rnn"]) == 30
    for x, y in zip(logits["transformer"], logits["rnn"]):
        assert torch.allclose(x, y, atol=1e-5, rtol=0)


@pytest.mark.parametrize("D,N,expand", [(128, 128, 2), (40, 8, 2), (24, 16, 3)])
def test_post_block_parameters_by_hand(D, N, expand):
    """Sec. 4.2's "DeMa with post.": the bare S6 layer at the block's width (no in_proj, gate or out_proj) and the
    transformer's 4x MLP, each behind a LayerNorm; against the pre block, Mamba's (3 D di + di (W + 3 + 2R + 3N)) and
    its RMSNorm."""
    cfg = dema.Config(d_model=D, d_state=N, expand=expand)
    W, R = cfg.d_conv, math.ceil((D // expand) / 16)                 # the official S6: dt_rank of width D / expand
    post = (2 * D + 2 * D                                            # two LayerNorms, weight and bias
            + D * W + D                                              # depthwise causal conv on the D channels
            + D * (R + 2 * N)                                        # x_proj -> Delta's rank-R input, B, C
            + R * D + D                                              # dt_proj
            + D * N + D                                              # A_log, the D skip
            + D * 4 * D + 4 * D + 4 * D * D + D)                     # MLP: D -> 4D -> D
    di, R_pre = expand * D, math.ceil(D / 16)
    pre = 3 * D * di + di * (W + 3 + 2 * R_pre + 3 * N) + D
    assert n_params(dema.PostBlock(cfg)) == post
    assert n_params(dema.Block(cfg)) == pre
    if (D, N) == (128, 128):
        assert (pre, post) == (202_624, 183_296)


def test_atari_parameter_count_matches_the_official_model():
    """Table 7's 1.7M: the official Atari code's sizes (E=128, D=128, N=128, 6 layers, 4 actions), counted by part."""
    sizes = {k: dema.ATARI[k] for k in ("n_embd", "d_model", "d_state", "n_layer")}
    n = n_params(dema.DeMa(dema.Config(**sizes), 4 * 84 * 84, 4, 1000, discrete=True))
    torso = (4 * 32 * 64 + 32) + (32 * 64 * 16 + 64) + (64 * 64 * 9 + 64) + (3136 * 128 + 128)
    rest = (128 + 128) + 4 * 128 + (128 * 128 + 128) + 6 * 202_624 + 128 + 128 * 4   # R, a, E->D, blocks, norm, head
    assert n == torso + rest == 1_713_184
    post = n_params(dema.DeMa(dema.Config(**sizes, residual="post"), 4 * 84 * 84, 4, 1000, discrete=True))
    assert n - post == 6 * (202_624 - 183_296)


def test_cross_entropy_by_hand():
    """loss_fn on discrete actions: the mean of -log softmax(logits)[a_t] over the unpadded steps; --rtg-shift trains
    on a window's last K-1 steps only."""
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]], [[0.0, 3.0, 0.0], [1.0, -2.0, 4.0]]])   # (2, 2, 3)

    class Fixed(torch.nn.Module):
        def forward(self, states, actions, rtg, timesteps, mask, prev_action):
            return logits[:, -actions.shape[1]:]

    batch = dict(states=torch.zeros(2, 2, 4, 84, 84, dtype=torch.uint8), actions=torch.tensor([[0, 2], [1, 1]]),
                 prev_action=torch.zeros(2, dtype=torch.long), rtg=torch.zeros(2, 2, 1),
                 timesteps=torch.zeros(2, 2, dtype=torch.long), mask=torch.tensor([[0.0, 1.0], [1.0, 1.0]]))

    def nll(z, a):
        z = np.array(z, np.float64)
        return np.log(np.exp(z).sum()) - z[a]
    want = (nll([0.5, 0.5, 0.5], 2) + nll([0.0, 3.0, 0.0], 1) + nll([1.0, -2.0, 4.0], 1)) / 3
    assert abs(dema.loss_fn(Fixed(), batch, dema.Config()).item() - want) < 1e-6
    shifted = dema.loss_fn(Fixed(), batch, dema.Config(rtg_shift=True)).item()   # row 0's pair holds a pad
    assert abs(shifted - nll([1.0, -2.0, 4.0], 1)) < 1e-6


@pytest.mark.slow
def test_atari_overfits_one_batch():
    b = atari_window(B=4, K=4, seed=3, dtype=torch.float32)
    loss = fit_one_batch(tiny_atari(dtype=torch.float32).train(), b, tiny_cfg(dropout=0.0), lr=3e-3, steps=200)
    assert loss < 0.05, loss


def test_atari_paper_settings_schedule_and_weight_decay(tiny_breakout):
    """Table 9 (the official code's sizes) under the flags and a run named 'default'; D.2's K=8 for Qbert and
    Frostbite; Table 10 for RNN-like DeMa; flags > preset > paper; Table 9's targets; the official cosine; and the
    official Atari decay groups."""
    def parse(*argv):
        return dema.paper_settings(*dema.parse_flags(list(argv)))
    cfg = parse("--dataset", tiny_breakout)
    assert (cfg.n_layer, cfg.n_embd, cfg.d_model, cfg.d_state, cfg.context, cfg.batch_size, cfg.lr, cfg.beta2,
            cfg.weight_decay, cfg.grad_clip, cfg.dropout, cfg.warmup_steps, cfg.lr_decay_steps, cfg.steps,
            cfg.eval_every, cfg.eval_episodes) == (6, 128, 128, 128, 30, 128, 6e-4, 0.95, 0.1, 1.0, 0.1, 3, 23_432,
                                                   39_060, 3906, 10)
    assert ev.variant_name(cfg, dema.PRESETS) == "default"
    assert parse("--env", "qbert-expert").context == parse("--env", "frostbite-expert").context == 8
    assert parse("--env", "qbert-expert", "--context", "30").context == 30
    rnn = parse("--dataset", tiny_breakout, "--mode", "rnn")
    assert (rnn.batch_size, rnn.lr, rnn.inner_it) == (8, 1e-4, 200)
    assert parse("--env", "frostbite-expert", "--mode", "rnn").batch_size == 1
    cfg = parse("--dataset", tiny_breakout, "--preset", "cpu", "--context", "3")
    assert cfg.context == 3 and cfg.weight_decay == 0.1 and cfg.beta2 == 0.95 and cfg.d_model == 64
    assert ev.variant_name(cfg, dema.PRESETS) == "cpu_context3"
    assert parse("--env", "hopper-medium").beta2 == 0.999 and parse("--env", "hopper-medium").lr_decay_steps == 0
    assert dema.targets(dema.Config(), data.load_data(tiny_breakout)) == [90.0]
    # schedule: warmup, then max(0.1, (1 + cos(pi p)) / 2), p unclamped; constant without --lr-decay-steps
    sched = dema.Config(warmup_steps=10, lr_decay_steps=110)
    assert dema.lr_factor(4, sched) == 0.5 and dema.lr_factor(10, sched) == 1.0
    assert abs(dema.lr_factor(60, sched) - 0.5) < 1e-12 and dema.lr_factor(110, sched) == 0.1
    assert abs(dema.lr_factor(160, sched) - 0.5) < 1e-12                       # rises again past the "final tokens"
    assert dema.lr_factor(10 ** 6, dema.Config(warmup_steps=10)) == 1.0
    # weight decay: matrices, A_log, D and the S6 conv; not biases, norms, or the official *emb* modules
    model = dema.build_model(cfg, dict(discrete=True, act_dim=4, max_ep_len=30, obs_dim=4 * 84 * 84))
    decay, rest = dema.param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    kept = {names[id(p)] for p in rest["params"]}
    assert rest["weight_decay"] == 0.0 and len(decay["params"]) + len(kept) == len(names)
    assert kept == {n for n in names.values() if n.endswith("bias") or ".norm." in n or n.startswith(
        ("embed_return", "embed_action", "embedding.", "ln_f"))}
    assert {"blocks.0.mixer.A_log", "blocks.0.mixer.D", "blocks.0.mixer.conv1d.weight", "embed_state.0.weight",
            "embed_state.7.weight", "predict_action.weight"} <= {names[id(p)] for p in decay["params"]}
    mujoco = dema.build_model(dema.Config(), dict(obs_dim=11, act_dim=3, max_ep_len=100))
    assert len(dema.param_groups(mujoco, dema.Config())) == 1                  # the gym code decays everything


@pytest.mark.slow
def test_cli_atari_both_modes(tiny_breakout, tmp_path, capsys):
    run_cli(["--dataset", tiny_breakout, "--steps", 6, "--eval-every", 6, "--eval-episodes", 1], tmp_path / "tr")
    assert final_line(capsys).endswith("episodes=1")
    ck = torch.load(tmp_path / "tr" / "ckpt.pt", weights_only=True)
    assert ck["info"]["discrete"] and ck["info"]["act_dim"] == 4 and ck["model"]["predict_action.weight"].shape == (4, 8)
    assert os.path.getsize(tmp_path / "tr" / "attention.png") > 0
    evals = [r for r in csv.DictReader(open(tmp_path / "tr" / "log.csv")) if r["target"]]
    assert [float(r["target"]) for r in evals] == [90.0] and evals[0]["normalized_score"] != ""
    run_cli(["--dataset", tiny_breakout, "--mode", "rnn", "--rnn-max-len", 30, "--batch-size", 2, "--inner-it", 2,
             "--residual", "post", "--steps", 4, "--eval-every", 4, "--eval-episodes", 1], tmp_path / "rnn")
    assert final_line(capsys).endswith("episodes=1")
    config = json.load(open(tmp_path / "rnn" / "config.json"))
    assert (config["mode"], config["inner_it"], config["residual"]) == ("rnn", 2, "post")


@pytest.mark.slow
def test_cpu_preset_rnn_on_atari_is_laptop_sized(tiny_breakout, tmp_path, capsys):
    """--preset cpu --mode rnn on Atari: 4 trajectories of at most 100 steps, said with the memory before the first
    step, a step in seconds (32 trajectories of up to 1000 steps needed 17.5 GB and minutes a step)."""
    dema.main(["--dataset", tiny_breakout, "--preset", "cpu", "--mode", "rnn", "--steps", "2", "--eval-every", "1000",
               "--eval-episodes", "1", "--out", str(tmp_path / "rnn")])
    out = capsys.readouterr().out
    said = next(line for line in out.splitlines() if line.startswith("--preset cpu on Atari: "))
    assert "--batch-size 4," in said and said.endswith("--rnn-max-len 100"), said
    need = re.search(r"a training step needs about ([\d.]+) (MB|GB)", out)
    assert need and need[2] == "MB" and float(need[1]) < 500, out
    assert out.index("needs about") < out.index("first step") and float(re.search(r"first step ([\d.]+) s", out)[1]) < 10
    config = json.load(open(tmp_path / "rnn" / "config.json"))
    assert (config["batch_size"], config["rnn_max_len"], config["inner_it"]) == (4, 100, 200)


@pytest.mark.slow
def test_atari_interrupt_then_resume_is_bit_identical(tiny_breakout, tmp_path):
    from test_harness import interrupt_resume_equals_straight
    interrupt_resume_equals_straight("dema", ["--dataset", tiny_breakout, *TINY, "--steps", 40, "--eval-every", 20,
                                              "--log-every", 10, "--seed", 2, "--eval-episodes", 1], 40, tmp_path)


@pytest.mark.slow
def test_rnn_resume_between_two_draws_is_exact(tiny_breakout, tmp_path, capsys):
    """--inner-it 3: steps 3..5 train on one batch; a run stopped at step 4 draws that batch again on resuming."""
    from test_harness import assert_same_weights
    common = ["--dataset", tiny_breakout, "--mode", "rnn", "--rnn-max-len", 20, "--batch-size", 2, "--inner-it", 3,
              "--eval-every", 1000, "--eval-episodes", 1, "--seed", 4, "--target-return", 3]
    run_cli(common + ["--steps", 8], tmp_path / "straight")
    run_cli(common + ["--steps", 4], tmp_path / "split")
    dema.main(["--out", str(tmp_path / "split"), "--resume", "--steps", "8"])
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 8
    assert_same_weights(a["model"], b["model"])


@pytest.mark.slow
def test_bench_on_atari_frames(tmp_path, capsys, monkeypatch):
    """--bench with an Atari name times train() on synthetic 84x84 frames (eager only here: compiling takes a
    minute) and writes nothing."""
    monkeypatch.setattr(ev, "BENCH_MODES", ev.BENCH_MODES[:1])
    monkeypatch.chdir(tmp_path)
    dema.main(["--bench", "--env", "breakout-expert", *TINY[:12], "--steps", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("the paper's row for Atari: ")                    # the row it applies
    assert lines[1].startswith("bench dema") and "96 tokens per batch" in lines[1]
    assert lines[2].split()[0] == "eager" and "ms/step" in lines[2]
    assert os.listdir(tmp_path) == []


def test_cpu_preset_rnn_row_on_atari_yields_to_the_flags():
    """--preset cpu --mode rnn on Atari lays its row (4 trajectories of 100 steps) under the flags: a flag given,
    even at the preset's own value, wins; without --mode rnn the row is not laid."""
    cfg, _ = dema.parse_flags(["--env", "breakout-expert", "--preset", "cpu", "--mode", "rnn"])
    assert (cfg.batch_size, cfg.rnn_max_len) == (4, 100)
    cfg, _ = dema.parse_flags(["--env", "breakout-expert", "--preset", "cpu", "--mode", "rnn", "--batch-size", "32"])
    assert (cfg.batch_size, cfg.rnn_max_len) == (32, 100)
    cfg, _ = dema.parse_flags(["--env", "breakout-expert", "--preset", "cpu"])
    assert (cfg.batch_size, cfg.rnn_max_len) == (32, dema.Config.rnn_max_len)
