"""dema.py: the two selective scans against each other and an einsum oracle, a hand-computed scan, the scan in fp32
under bf16 autocast, chunked (checkpointed) backprop = plain backprop and the memory it saves, the recurrent step
against the full forward, inert left padding, causality by perturbation (B3LD and BL3D), hidden attention against
explicit materialisation, parameter counts against the official model's (Tables 7 and 17), the official init, the
RTG alignment, the S6 ablation of Fig. 5, overfitting, and the CLI and analyses on tiny Minari datasets."""
import csv
import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import dema

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
                                dict(timestep_embedding=True)])
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
    x, z, delta, A, B, C = mixer.ssm_inputs(h, mask)
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


def test_overfits_one_batch():
    cfg = tiny_cfg()
    model = tiny_model(dtype=torch.float32).train()
    b = random_window(B=4, seed=1, dtype=torch.float32)
    b["mask"][0, :2] = 0
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(150):
        loss = dema.loss_fn(model, b, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 5e-3, loss.item()


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
def test_short_contexts_draw_the_attention_figure(extra, tiny_hopper, tmp_path, capsys):
    """--context <= 2 used to crash the end-of-run figure (distance 6 of a 6-token window)."""
    run_cli(["--dataset", tiny_hopper, "--steps", 2, "--eval-every", 2, "--eval-episodes", 1, *extra], tmp_path)
    assert os.path.getsize(tmp_path / "attention.png") > 0 and "hidden attention ->" in capsys.readouterr().out


def test_cli_rnn_mode_and_maze(tiny_hopper, tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--mode", "rnn", "--rnn-max-len", 50, "--batch-size", 2, "--scan-chunk", 16,
             "--steps", 3, "--eval-every", 1000, "--target-return", 500], tmp_path / "rnn")
    assert final_line(capsys).endswith("episodes=2")
    run_cli(["--dataset", tiny_maze, "--steps", 3, "--eval-every", 1000], tmp_path / "maze")
    final_line(capsys)
    rows = [r for r in csv.DictReader(open(tmp_path / "maze" / "log.csv")) if r["target"]]
    assert rows and rows[0]["success_rate"] != ""


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
                        (["--bench-scan", "--attention"], "choose one"), (["--dropout", 2], "--dropout")):
        out = tmp_path / "x"
        err = one_sentence(capsys, ["--dataset", tiny_hopper, *TINY, "--out", out, "--steps", 1, *args])
        assert words in err, (args, err)
        assert not out.exists()
    assert "unknown environment" in one_sentence(capsys, [*TINY, "--env", "no-such-env", "--out", tmp_path / "y"])


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
    assert "174,723" in out and "430,723" in out and "726,019" in out
    assert math.isfinite(dema.time_scan(dema.selective_scan_sequential, 1, 4, 5, 2, reps=1))
