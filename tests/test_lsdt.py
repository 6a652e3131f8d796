"""Tests for lsdt.py. Every check compares against something computed independently: explicit loops over taps,
torch's own conv1d / scaled_dot_product_attention, dt.py's block, hand-computed values and parameter counts,
perturbation of future inputs, overfitting, and short CLI runs on the tiny datasets from conftest.py."""
import dataclasses
import json
import math
import os
import signal

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import lsdt

torch.set_num_threads(1)

S, A, T_MAX = 5, 2, 64
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_cfg(**kw):
    base = dict(n_embd=32, n_head=2, conv_ratio=0.5, kernel=3, context=6, paper_table=False)
    if kw.get("arch") in lsdt.ARCH_DEFAULTS:
        base.update(lsdt.ARCH_DEFAULTS[kw["arch"]])
        base.update(n_embd=32, kernel=3, context=6)
    base.update(kw)
    return lsdt.Config(**base)


def check_model(cfg):
    """paper_settings' checks alone: every field given, so no paper row is laid under them."""
    return lsdt.paper_settings(cfg, set(lsdt.Config.__dataclass_fields__))


def build(cfg, obs_dim=S):
    return lsdt.LSDT(cfg, obs_dim, A, T_MAX)


VARIANTS = {
    "lsdt": {}, "lsdt_pre_concat": dict(norm="pre", fusion="concat"), "xi0": dict(conv_ratio=0.0),
    "cdt": dict(conv_ratio=1.0), "lsdc": dict(conv="dc"), "no_action_tokens": dict(action_tokens=False),
    "dc": dict(arch="dc"), "dc_h": dict(arch="dc_h"), "res": dict(routing="res"), "weight": dict(routing="weight"),
}


def rand_inputs(B, K, g):
    x = dict(states=torch.randn(B, K, S, generator=g), actions=torch.rand(B, K, A, generator=g) * 2 - 1,
             rtg=torch.randn(B, K, 1, generator=g), timesteps=torch.randint(0, T_MAX - K, (B, 1), generator=g)
             + torch.arange(K), mask=torch.ones(B, K))
    return x


def run(model, x):
    return model(x["states"], x["actions"], x["rtg"], x["timesteps"], x["mask"])


def causal_mask(B, L):
    return torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)


# ---------------------------------------------------------------------------------------------------- branches

def loop_dynamic_conv(conv, x, real):
    """Eq. 1 token by token: logits of token i from U_i alone, softmax over the causal taps that exist."""
    B, L, C = x.shape
    k, H = conv.k, conv.heads
    u = F.glu(conv.glu_in(x), dim=-1)
    out = torch.zeros(B, L, C)
    for b in range(B):
        for i in range(L):
            logits = conv.w_gen(u[b, i]).view(k, H).T          # tap-major layout of W_w's output
            src = [i - k + 1 + j for j in range(k)]
            ok = [s >= 0 and (bool(real[b, s]) or s == i) for s in src]
            for h in range(H):
                w = torch.stack([logits[h, j] for j in range(k) if ok[j]]).softmax(0)
                taps = [src[j] for j in range(k) if ok[j]]
                for c in range(h * 4, h * 4 + 4):
                    out[b, i, c] = sum(w[n] * u[b, s, c] for n, s in enumerate(taps)) + conv.bias[c]
    return conv.out(out)


def test_dynamic_conv_matches_tap_loop():
    torch.manual_seed(0)
    conv = lsdt.DynamicConv(8, 3, 0.2).eval()
    x = torch.randn(2, 7, 8)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, :3] = False                                  # left padding in the second sequence
    torch.testing.assert_close(conv(x, real)[0], loop_dynamic_conv(conv, x, real)[0])
    torch.testing.assert_close(conv(x, real)[1, 3:], loop_dynamic_conv(conv, x, real)[1, 3:])


def test_dynamic_kernels_normalised_and_causal():
    torch.manual_seed(1)
    k = 4
    conv = lsdt.DynamicConv(8, k, 0.2).eval()
    conv.keep = True
    L = 9
    real = torch.ones(2, L, dtype=torch.bool)
    real[1, :2] = False
    conv(torch.randn(2, L, 8), real)
    alpha = conv.alpha                                   # (B, L, H, k)
    torch.testing.assert_close(alpha.sum(-1), torch.ones(2, L, 2))
    # expand to an L x L matrix per head: row i has weight only on max(0, i-k+1) .. i
    i = torch.arange(L)[:, None]
    src = i - k + 1 + torch.arange(k)[None, :]           # (L, k)
    dense = torch.zeros(2, 2, L, L)
    for b in range(2):
        for h in range(2):
            for r in range(L):
                for j in range(k):
                    if src[r, j] >= 0:
                        dense[b, h, r, src[r, j]] += alpha[b, r, h, j]
                    else:
                        assert alpha[b, r, h, j] == 0    # taps before the sequence carry no weight
    assert torch.all(dense.triu(1) == 0)                 # nothing from the future
    assert torch.all(dense.tril(-k) == 0)                # nothing beyond k_m taps back
    assert torch.all(dense[1, :, 2:, :2] == 0)           # nothing from left padding
    assert torch.all(dense[0].diagonal(dim1=-2, dim2=-1) > 0)


def test_dc_conv_matches_torch_conv1d():
    torch.manual_seed(2)
    C, w, L = 6, 4, 9
    conv = lsdt.DCConv(C, w, n_types=3)
    x = torch.randn(2, L, C)
    got = conv(x, torch.ones(2, L, dtype=torch.bool))
    xp = F.pad(x.transpose(1, 2), (w - 1, 0))            # DC code: left-pad L_w - 1 zeros, depthwise Conv1d
    for typ in range(3):
        ref = F.conv1d(xp, conv.weight[typ][:, None, :], conv.bias[typ], groups=C).transpose(1, 2)
        torch.testing.assert_close(got[:, typ::3], ref[:, typ::3])


def test_hfm_hand_values():
    fuse = lsdt.HybridFusion(4)
    for p in fuse.parameters():
        torch.nn.init.zeros_(p)
    y = torch.tensor([[[1.0, -2.0, 3.0, 4.0]]])
    torch.testing.assert_close(fuse(y), y / 4)           # zero logits -> uniform softmax over the 4 channels
    torch.nn.init.constant_(fuse.expand.bias, 0.0)
    fuse.expand.bias.data[0] = math.log(3.0)             # weights (3, 1, 1, 1) / 6
    torch.testing.assert_close(fuse(y), y * torch.tensor([0.5, 1 / 6, 1 / 6, 1 / 6]))


def test_branch_channel_split_and_xi_extremes():
    m = build(make_cfg(conv_ratio=0.25)).blocks[0].mixer
    assert (m.da, m.dc) == (24, 8) and m.attn.c_attn.in_features == 24 and m.conv.glu_in.in_features == 8
    m0 = build(make_cfg(conv_ratio=0.0)).blocks[0].mixer
    none, plain = lsdt.NoBranch, torch.nn.Identity
    assert isinstance(m0.conv, none) and isinstance(m0.fuse, plain) and m0.da == 32
    m1 = build(make_cfg(conv_ratio=1.0)).blocks[0].mixer
    assert isinstance(m1.attn, none) and isinstance(m1.fuse, plain) and m1.dc == 32
    assert isinstance(build(make_cfg(fusion="concat")).blocks[0].mixer.fuse, plain)
    with pytest.raises(lsdt.data_lib.DataError, match="multiple of 4"):
        check_model(make_cfg(conv_ratio=0.3))                   # 9.6 -> 10 conv channels
    with pytest.raises(lsdt.data_lib.DataError, match=r"\[0, 1\]"):
        check_model(make_cfg(conv_ratio=1.5))
    check_model(make_cfg())


def test_xi0_mixer_is_dt_attention():
    """xi = 0: the mixer is plain causal multi-head attention + W_O, computed here with torch's SDPA."""
    torch.manual_seed(3)
    cfg = make_cfg(conv_ratio=0.0, n_head=4)
    mixer = lsdt.LongShortMixer(cfg, 0).eval()
    B, L, D = 2, 9, cfg.n_embd
    x = torch.randn(B, L, D)
    got = mixer(x, causal_mask(B, L), torch.ones(B, L, dtype=torch.bool))
    q, k, v = F.linear(x, mixer.attn.c_attn.weight, mixer.attn.c_attn.bias).split(D, -1)
    heads = lambda z: z.view(B, L, 4, D // 4).transpose(1, 2)  # noqa: E731
    y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    ref = F.linear(y.transpose(1, 2).reshape(B, L, D), mixer.c_proj.weight, mixer.c_proj.bias)
    torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------------------------------------------- DropKey (B.8)

def test_dropkey_masks_logits_with_probability_p_and_never_a_whole_row():
    torch.manual_seed(9)
    B, L, p = 16, 24, 0.3
    attn = lsdt.DropKeyAttention(16, 2, p)
    assert attn.drop.p == 0.0                            # B.8: DropKey replaces the dropout on P V
    attn.keep = True
    x = torch.randn(B, L, 16)
    attn.train()(x, causal_mask(B, L))
    P = attn.probs                                       # (B, h, L, L)
    off_diag = torch.ones(L, L, dtype=torch.bool).tril(-1).expand_as(P)
    dropped = (P == 0) & off_diag                        # a kept key gets exp(logit) > 0
    frac = dropped.sum().item() / off_diag.sum().item()
    assert abs(frac - p) < 0.03, frac                    # ~ B * h * L(L-1)/2 = 8832 Bernoulli draws
    assert torch.all(P.diagonal(dim1=-2, dim2=-1) > 0)   # a token's own key is never dropped: no empty row
    torch.testing.assert_close(P.sum(-1), torch.ones(B, 2, L))
    assert torch.all(P.triu(1) == 0)                     # still causal


def test_dropkey_zero_and_eval_mode_change_nothing():
    torch.manual_seed(10)
    x = rand_inputs(3, 6, torch.Generator().manual_seed(4))
    zero = dict(dropout=0.0, attn_dropout=0.0, conv_dropout=0.0)
    plain = build(make_cfg(**zero))
    with_dk = build(make_cfg(**zero, dropkey=0.5))
    with_dk.load_state_dict(plain.state_dict())          # DropKey adds no parameters
    torch.testing.assert_close(run(with_dk.eval(), x), run(plain.eval(), x), rtol=0, atol=0)  # eval: no effect
    p0 = build(make_cfg(**zero, dropkey=0.0)).train()
    p0.load_state_dict(plain.state_dict())
    explicit = build(make_cfg(**zero)).train()           # the explicit-probability path, no DropKey
    explicit.load_state_dict(plain.state_dict())
    explicit.keep_maps(True)
    torch.testing.assert_close(run(p0, x), run(explicit, x))   # P = 0 in training: plain attention
    assert not torch.allclose(run(with_dk.train(), x), run(p0, x))  # and P > 0 does drop something


# ---------------------------------------------------------------------------------------------------- model

@pytest.mark.parametrize("name", list(VARIANTS))
def test_future_does_not_leak(name):
    torch.manual_seed(4)
    cfg = make_cfg(**VARIANTS[name])
    model = build(cfg).eval()
    g = torch.Generator().manual_seed(0)
    K = cfg.context
    x = rand_inputs(3, K, g)
    base = run(model, x)
    t0 = 3
    y = {k: v.clone() for k, v in x.items()}
    y["states"][:, t0:] += 5 * torch.randn(3, K - t0, S, generator=g)
    y["rtg"][:, t0:] += 5
    y["actions"][:, t0 - 1:] = -y["actions"][:, t0 - 1:]  # a_{t0-1} too: the prediction at t0-1 must not see it
    pert = run(model, y)
    torch.testing.assert_close(pert[:, :t0], base[:, :t0], rtol=0, atol=1e-6)
    assert (pert[:, t0:] - base[:, t0:]).abs().max() > 1e-3          # the control: the future itself does move
    if cfg.action_tokens:                                            # ...and a_{t0-1} reaches step t0
        z = {k: v.clone() for k, v in x.items()}
        z["actions"][:, t0 - 1] = -z["actions"][:, t0 - 1]
        assert (run(model, z)[:, t0] - base[:, t0]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["lsdt", "lsdc", "dc", "no_action_tokens", "res", "weight"])
def test_left_padding_is_the_shorter_window(name):
    torch.manual_seed(5)
    cfg = make_cfg(**VARIANTS[name])
    model = build(cfg).eval()
    g = torch.Generator().manual_seed(1)
    K, pad = cfg.context, 2
    short = rand_inputs(2, K - pad, g)
    padded = {k: F.pad(v, (0, 0, pad, 0)) if v.dim() == 3 else F.pad(v, (pad, 0)) for k, v in short.items()}
    padded["states"][:, :pad] = 7.0                                  # garbage under the mask must not matter
    torch.testing.assert_close(run(model, padded)[:, pad:], run(model, short), rtol=0, atol=1e-5)


@pytest.mark.parametrize("routing", ["split", "res", "weight"])
@pytest.mark.slow
def test_overfits_a_tiny_batch(routing):
    torch.manual_seed(6)
    cfg = make_cfg(dropout=0.0, attn_dropout=0.0, conv_dropout=0.0, routing=routing)
    model = build(cfg)
    g = torch.Generator().manual_seed(2)
    x = rand_inputs(4, cfg.context, g)
    target = torch.tanh(x["states"][..., :A] * 2)                     # a function of s_t the model can fit
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = F.mse_loss(run(model, x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])


def test_xi0_block_matches_dt_block():
    """xi = 0 with pre-LN is DT's GPT-2 block given the same weights (DT's MLP uses ReLU, kzl's choice; LSDT GELU)."""
    import dt
    torch.manual_seed(7)
    cfg = make_cfg(conv_ratio=0.0, norm="pre", n_head=4)
    ours = lsdt.PreLNBlock(cfg, 0).eval()
    ours.mlp[1] = torch.nn.ReLU()
    ref = dt.Block(dt.Config(n_embd=cfg.n_embd, n_head=4)).eval()
    names = {"mixer.attn.c_attn": "attn.c_attn", "mixer.c_proj": "attn.c_proj"}
    state = {}
    for k, v in ref.state_dict().items():
        for ours_name, ref_name in names.items():
            k = k.replace(ref_name, ours_name)
        state[k] = v
    ours.load_state_dict(state)                                       # strict: every weight maps one to one
    B, L = 2, 12
    x = torch.randn(B, L, cfg.n_embd)
    real = torch.ones(B, L, dtype=torch.bool)
    real[1, :3] = False
    allowed = (torch.ones(L, L, dtype=torch.bool).tril() & (real[:, None, :] | torch.eye(L, dtype=torch.bool)))[:, None]
    torch.testing.assert_close(ours(x, allowed, real)[real], ref(x, allowed)[real])


def test_explicit_attention_path_equals_fused():
    """The analysis path (explicit probabilities, kept for plots) and the training path (fused SDPA) agree, and
    the kept probabilities are causal, skip padding and sum to 1."""
    torch.manual_seed(8)
    model = build(make_cfg(n_head=2)).eval()
    x = rand_inputs(2, 6, torch.Generator().manual_seed(3))
    x["mask"][1, :2] = 0
    fused = run(model, x)
    model.keep_maps(True)
    explicit = run(model, x)
    torch.testing.assert_close(explicit, fused)
    P = model.blocks[0].mixer.attn.probs                              # (B, h, L, L)
    torch.testing.assert_close(P.sum(-1), torch.ones_like(P[..., 0]))
    assert torch.all(P.triu(1) == 0) and torch.all(P[1, :, 6:, :6] == 0)


def test_mixing_maps_are_the_branches_weights():
    torch.manual_seed(11)
    model = build(make_cfg(n_head=2))
    x = rand_inputs(2, 6, torch.Generator().manual_seed(5))
    maps = lsdt.mixing_maps(model, x, index=1)
    L = 3 * 6
    assert set(maps) == {"attention", "kernel", "hfm"} and model.training        # mode restored
    assert maps["attention"].shape == maps["kernel"].shape == (L, L) and maps["hfm"].shape == (L, 32)
    alpha = model.blocks[0].mixer.conv.alpha[1].mean(1)                          # (L, k) heads averaged
    for i in range(L):                                                           # row i: taps on i-2 .. i
        for j in range(3):
            if i - 2 + j >= 0:
                assert maps["kernel"][i, i - 2 + j] == alpha[i, j]
    torch.testing.assert_close(maps["kernel"].sum(-1), torch.ones(L))
    assert torch.all(maps["kernel"].tril(-3) == 0) and torch.all(maps["attention"].triu(1) == 0)
    torch.testing.assert_close(maps["hfm"].sum(-1), torch.ones(L))


@pytest.mark.parametrize("dc, millions", [(0, 1.126), (16, 1.146), (32, 1.129), (64, 1.136), (96, 1.197),
                                          (128, 1.263)])
def test_parameter_count_matches_official_code(dc, millions):
    """Walker2d sizes (D=128, 3 blocks, 4096 timesteps): the analytic count of the official code, which also holds the
    k - k_m = 5 masked future taps of each dynamic kernel and unused RTG / state heads we leave out."""
    cfg = lsdt.Config(n_embd=128, n_head=1, conv_ratio=dc / 128)
    ours = sum(p.numel() for p in lsdt.LSDT(cfg, 17, 6, 4096).parameters())
    dead_taps = 3 * 5 * (dc // 4) * (dc + 1)
    unused_heads = (128 + 1) + (128 * 17 + 17)
    assert round((ours + dead_taps + unused_heads) / 1e6, 3) == millions


def test_model_config_defaults_are_the_papers_config():
    """LSDTConfig (the model block's own) starts from Config's defaults, field for field."""
    model_cfg = lsdt.LSDTConfig()
    for f in dataclasses.fields(lsdt.LSDTConfig):
        assert getattr(model_cfg, f.name) == getattr(lsdt.Config(), f.name), f.name


# ---------------------------------------------------------------------------------------------------- routing (B.10)

def hand_count(routing, D, dc, n_layer=3, k=6, obs=17, act=6, T=4096):
    """LSDT's parameters counted from the dimensions alone: lin(i, o) = an i -> o Linear's weights and biases."""
    lin = lambda i, o: i * o + o                                          # noqa: E731
    da = D - dc
    if routing == "weight":                                               # both branches on all D channels
        da = dc = D
    attn = lin(da, 3 * da) if da else 0                                   # W_Q || W_K || W_V
    conv = lin(dc, 2 * dc) + lin(dc, k * dc // 4) + dc + lin(dc, dc) if dc else 0   # W_1, W_w, bias, W_2
    if routing == "weight":
        join = lin(2 * D, D) + lin(D, 2 * D)                              # modified HFM: 2D -> D -> 2D
    else:
        join = lin(D, D // 2) + lin(D // 2, D) if da and dc else 0        # HFM: D -> D/2 -> D
    res = lin(da, da) + lin(dc, dc) if routing == "res" else 0            # zero where a part has no channel
    mixer = attn + conv + join + res + lin(D, D)                          # ... + W_O
    block = mixer + 2 * (2 * D) + lin(D, 4 * D) + lin(4 * D, D)           # two LayerNorms and the MLP
    embed = T * D + lin(1, D) + lin(obs, D) + lin(act, D) + 2 * D         # t, R, s, a embeddings, embed LayerNorm
    return embed + n_layer * block + lin(D, act)                          # + the action head


@pytest.mark.parametrize("routing", ["split", "res", "weight"])
@pytest.mark.parametrize("dc", [0, 32, 64, 128])
def test_parameter_count_of_each_routing(routing, dc):
    cfg = lsdt.Config(n_embd=128, n_head=1, conv_ratio=dc / 128, routing=routing)
    assert sum(p.numel() for p in lsdt.LSDT(cfg, 17, 6, 4096).parameters()) == hand_count(routing, 128, dc)


def test_parameter_count_hand_values():
    """D = 128, xi = 0.5, 3 blocks, by hand: LSDT-res adds 2 (64 * 64 + 64) per block; LSDT-weight's mixer grows from
    64,352 (attention 12,480, conv 18,784, HFM 16,576, W_O 16,512) to 206,400 (49,536 + 74,432, its join 65,920,
    W_O 16,512) per block."""
    count = lambda r: sum(p.numel() for p in lsdt.LSDT(lsdt.Config(routing=r), 17, 6, 4096).parameters())  # noqa
    assert count("split") == 1_118_502
    assert count("res") == 1_118_502 + 3 * 2 * (64 * 64 + 64)
    assert count("weight") == 1_118_502 + 3 * (206_400 - 64_352)


def block_inputs(B=2, L=12, D=32):
    x = torch.randn(B, L, D)
    real = torch.ones(B, L, dtype=torch.bool)
    real[1, :3] = False                                                   # left padding in the second sequence
    allowed = (torch.ones(L, L, dtype=torch.bool).tril() & (real[:, None, :] | torch.eye(L, dtype=torch.bool)))[:, None]
    return x, allowed, real


def test_weight_routing_set_to_one_branch_is_that_branch_alone():
    """LSDT-weight with its weights forced to one branch is that branch on all D channels followed by W_O (the mixer
    of xi = 0 for attention, xi = 1 for the conv), given the same weights; with zero logits it is their mean."""
    torch.manual_seed(13)
    cfg = make_cfg(routing="weight")
    D = cfg.n_embd
    mixer = lsdt.LongShortMixer(cfg, lsdt.conv_dims(cfg)[0]).eval()
    assert (mixer.da, mixer.dc) == (D, D) and mixer.attn.c_attn.in_features == D and mixer.conv.glu_in.in_features == D
    x, allowed, real = block_inputs(D=D)
    fuse = mixer.fuse
    for branch, xi, other in (("attn", 0.0, "conv."), ("conv", 1.0, "attn.")):
        alone = lsdt.LongShortMixer(make_cfg(conv_ratio=xi), int(xi * D)).eval()
        alone.load_state_dict({k: v for k, v in mixer.state_dict().items() if not k.startswith(("fuse.", other))})
        torch.nn.init.zeros_(fuse.expand.weight)
        logits = torch.full((2, D), -1e4)
        logits[0 if branch == "attn" else 1] = 1e4                        # softmax over the branches: exactly (1, 0)
        fuse.expand.bias.data.copy_(logits.flatten())
        torch.testing.assert_close(mixer(x, allowed, real), alone(x, allowed, real), rtol=0, atol=0)
    torch.nn.init.zeros_(fuse.expand.bias)                                # zero logits: weights (1/2, 1/2)
    mean = (mixer.attn(x, allowed) + mixer.conv(x, real)) / 2
    torch.testing.assert_close(mixer(x, allowed, real), mixer.c_proj(mean))


def test_weight_routing_weights_are_a_per_channel_split_between_the_branches():
    torch.manual_seed(15)
    model = build(make_cfg(routing="weight", n_layer=1))
    x = rand_inputs(2, 6, torch.Generator().manual_seed(6))
    maps = lsdt.mixing_maps(model, x, index=0)
    assert set(maps) == {"attention", "kernel", "hfm"} and maps["hfm"].shape == (18, 32)
    a = maps["hfm"]                                                       # A_att; the conv branch gets 1 - A_att
    assert torch.all((a > 0) & (a < 1)) and not torch.allclose(a, a[:1].expand_as(a))   # input-dependent
    fuse = model.blocks[0].mixer.fuse                                     # recompute A from the branch outputs
    model.eval()
    ys = {}
    hooks = [getattr(model.blocks[0].mixer, n).register_forward_hook(lambda m, i, o, n=n: ys.__setitem__(n, o))
             for n in ("attn", "conv")]
    with torch.no_grad():
        run(model, x)
    for h in hooks:
        h.remove()
    z = fuse.expand(F.relu(fuse.reduce(torch.cat([ys["attn"], ys["conv"]], -1))))[0]   # (L, 2D)
    torch.testing.assert_close(a, torch.sigmoid(z[:, :32] - z[:, 32:]))   # 2-way softmax = sigmoid of the difference


def test_res_routing_is_the_split_on_projected_parts():
    """LSDT-res: each branch gets X_i + W_ri X_i, computed here by hand and fed to the split mixer with the same
    weights; with the projections zeroed the whole model is the default (split) model."""
    torch.manual_seed(14)
    cfg = make_cfg(routing="res")
    res = lsdt.LongShortMixer(cfg, 16).eval()
    split = lsdt.LongShortMixer(make_cfg(), 16).eval()
    missing, unexpected = split.load_state_dict(res.state_dict(), strict=False)
    assert not missing and sorted(unexpected) == [f"route.res_{b}.{p}" for b in ("attn", "conv")
                                                  for p in ("bias", "weight")]
    r = res.route
    assert r.res_attn.weight.shape == (16, 16) and r.res_conv.weight.shape == (16, 16)
    x, allowed, real = block_inputs()
    for p in (r.res_attn.bias, r.res_conv.bias):
        torch.nn.init.normal_(p)                                          # the model zeroes biases at init
    x1, x2 = x.split([16, 16], -1)
    moved = torch.cat([x1 + F.linear(x1, r.res_attn.weight, r.res_attn.bias),
                       x2 + F.linear(x2, r.res_conv.weight, r.res_conv.bias)], -1)
    torch.testing.assert_close(res(x, allowed, real), split(moved, allowed, real))

    plain = build(make_cfg()).eval()
    model = build(cfg).eval()
    missing, unexpected = model.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and len(missing) == 2 * 2 * cfg.n_layer        # W_r1, b_r1, W_r2, b_r2 per block
    inp = rand_inputs(3, cfg.context, torch.Generator().manual_seed(7))
    assert (run(model, inp) - run(plain, inp)).abs().max() > 1e-3        # Xavier-initialised projections act
    for name in missing:
        torch.nn.init.zeros_(model.get_parameter(name))
    torch.testing.assert_close(run(model, inp), run(plain, inp), rtol=0, atol=0)


def test_res_routing_has_one_projection_per_branch():
    m1 = build(make_cfg(routing="res", conv_ratio=1.0)).blocks[0].mixer.route
    assert isinstance(m1.res_attn, lsdt.NoBranch) and m1.res_conv.in_features == 32
    m0 = build(make_cfg(routing="res", conv_ratio=0.0)).blocks[0].mixer.route
    assert isinstance(m0.res_conv, lsdt.NoBranch) and m0.res_attn.in_features == 32
    m = build(make_cfg(routing="res", conv_ratio=0.25)).blocks[0].mixer.route
    assert (m.res_attn.in_features, m.res_conv.in_features) == (24, 8)
    plain = build(make_cfg()).blocks[0].mixer
    assert type(plain.route) is lsdt.Split and isinstance(plain.fuse, lsdt.HybridFusion)


def test_routing_checks():
    """LSDT-weight needs D itself to split into heads and into groups of 4 conv channels, whatever xi; it always has an
    attention branch; the routings are LSDT's, not DC's."""
    ok = dict(n_embd=40, n_head=3, conv_ratio=0.1, paper_table=False)    # split: 36 attention | 4 conv channels
    check_model(lsdt.Config(**ok))
    check_model(lsdt.Config(**ok, routing="res"))
    with pytest.raises(lsdt.data_lib.DataError, match="--n-head 3 does not divide the 40 attention channels"):
        check_model(lsdt.Config(**ok, routing="weight"))
    check_model(lsdt.Config(n_embd=34, n_head=1, conv_ratio=0.0))  # split: attention only, on 34 channels
    with pytest.raises(lsdt.data_lib.DataError, match="dynamic-conv branch gets 34 channels"):
        check_model(lsdt.Config(n_embd=34, n_head=1, conv_ratio=0.0, routing="weight"))
    check_model(lsdt.Config(n_embd=32, conv_ratio=1.0, dropkey=0.1, routing="weight"))


# ---------------------------------------------------------------------------------------------------- DC as DC runs

def test_lr_schedule_hand_values():
    """LSDT (official code): (s+1)/warmup, then a cosine to 0 at --steps; DC / DC_h (DC's code): warmup, then 1."""
    cfg = lsdt.Config(warmup_steps=10, steps=110)
    f = lambda s, **kw: lsdt.lr_factor(s, lsdt.Config(warmup_steps=10, steps=110, **kw))  # noqa: E731
    assert [f(s) for s in (0, 4, 9, 10)] == pytest.approx([0.1, 0.5, 1.0, 1.0])
    c = 2 ** -0.5                                                    # cos(pi / 4)
    assert [f(s) for s in (35, 60, 85, 110, 200)] == pytest.approx([(1 + c) / 2, 0.5, (1 - c) / 2, 0, 0])
    for arch in ("dc", "dc_h"):
        assert [f(s, arch=arch) for s in (0, 4, 9, 10, 60, 110, 200)] == pytest.approx([0.1, 0.5, 1, 1, 1, 1, 1])
    model = build(make_cfg())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)          # as train() builds them
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lsdt.lr_factor(s, cfg))
    for _ in range(60):
        opt.step()
        sched.step()
    assert sched.get_last_lr()[0] == pytest.approx(cfg.lr * 0.5)


def test_dc_init_keeps_pytorch_defaults_outside_the_blocks():
    """DC's code: N(0, 0.02) and zero biases in the blocks, PyTorch's defaults for the embeddings and the head
    (nn.Embedding N(0, 1); nn.Linear U(+-1/sqrt(fan_in)) weights and biases). LSDT's code: Xavier, zero biases."""
    torch.manual_seed(12)
    obs = 200
    dc = lsdt.LSDT(lsdt.Config(arch="dc", conv="dc", conv_ratio=1.0, norm="pre"), obs, A, 4096)
    ls = lsdt.LSDT(lsdt.Config(), obs, A, 4096)
    assert abs(dc.embed_timestep.weight.std().item() - 1.0) < 0.02           # N(0, 1): 4096 x 128 draws
    w, b = dc.embed_state.weight, dc.embed_state.bias
    assert w.abs().max() <= 1 / math.sqrt(obs) and abs(w.std().item() - 1 / math.sqrt(3 * obs)) < 0.003
    assert b.abs().max() <= 1 / math.sqrt(obs) and b.abs().min() > 0         # the default bias is not zeroed
    assert dc.predict_action[0].bias.abs().min() > 0
    mlp = dc.blocks[0].mlp[0]
    assert abs(mlp.weight.std().item() - 0.02) < 0.001 and torch.all(mlp.bias == 0)
    bound = math.sqrt(6 / (128 + 4096))                                       # Xavier: fan_in 4096, fan_out 128
    w = ls.embed_timestep.weight
    assert w.abs().max() <= bound and abs(w.std().item() - bound / 3 ** 0.5) < 3e-4
    assert all(torch.all(m.bias == 0) for m in ls.modules() if isinstance(m, torch.nn.Linear))


# ---------------------------------------------------------------------------------------------------- paper rows

def test_paper_rows():
    assert lsdt.paper_row("replica/hopper/medium-v0") == "hopper-medium"
    assert lsdt.paper_row("mujoco/hopper/medium-v0") == "hopper-medium"
    assert lsdt.paper_row("replica/pointmaze/medium-dense-v0") == "pointmaze-medium"
    assert lsdt.paper_row("D4RL/antmaze/medium-play-v1") == "antmaze-medium-play"
    assert lsdt.paper_row("walker2d-expert") is None
    row = lsdt.PAPER_TABLE["hopper-medium"]
    assert (row["conv_ratio"], row["n_embd"], row["context"], row["action_tokens"]) == (1.0, 256, 10, False)


def test_paper_settings_layers_row_arch_preset_flags():
    """Config < row < --arch < --preset < flags: the preset wins for width, batch and lr; the row still sets K, xi,
    k_m, heads and the target; a flag given on the command line wins even where it equals the Config default."""
    cfg, given = lsdt.parse_flags(["--dataset", "D4RL/pointmaze/medium-v2", "--preset", "cpu"])
    c, changes = lsdt.paper_settings(cfg, given), lsdt.paper_values(cfg, given)
    assert (c.n_embd, c.batch_size, c.lr, c.n_layer) == (64, 64, 1e-3, 2)          # the preset's
    assert (c.conv_ratio, c.n_head, c.kernel, c.target_return) == (0.125, 2, 3, None)   # the row's
    assert c.context == 1 and "n_embd" not in changes and "context" not in changes    # the preset's maze K wins
    args = lsdt.parse_flags(["--dataset", "D4RL/mujoco/hopper/medium-replay-v0", "--preset", "cpu"])
    c, changes = lsdt.paper_settings(*args), lsdt.paper_values(*args)
    assert c.context == 20 and changes["context"] == 20 and c.n_embd == 64             # off mazes: the row's K
    cfg, given = lsdt.parse_flags(["--dataset", "D4RL/pointmaze/medium-v2", "--context", "10", "--lr", "1e-4"])
    c = lsdt.paper_settings(cfg, given)
    assert (c.context, c.lr, c.batch_size, c.n_embd) == (10, 1e-4, 256, 128)        # flags (10 = Config default)
    c = lsdt.paper_settings(*lsdt.parse_flags(["--env", "pointmaze-medium", "--conv", "dc"]))
    assert c.kernel == 6 and c.conv_ratio == 0.125            # LSDC keeps DC's window 6 (official LSDC code)
    c = lsdt.paper_settings(*lsdt.parse_flags(["--env", "hopper-medium", "--arch", "dc"]))
    assert (c.conv, c.norm, c.context, c.n_embd, c.action_tokens) == ("dc", "pre", 8, 128, False)
    args = lsdt.parse_flags(["--env", "hopper-medium", "--no-paper-table"])
    c, changes = lsdt.paper_settings(*args), lsdt.paper_values(*args)
    assert changes == {} and c == lsdt.Config(paper_table=False)
    cfg, given = lsdt.parse_flags(["--env", "antmaze-umaze"])
    assert lsdt.paper_settings(cfg, given).target_return == 100.0


def test_evaluation_defaults_follow_the_paper():
    """Table 1: 20 evaluation episodes on locomotion, 100 on mazes (the row's); the official code evaluates every 500
    updates. The preset's and the command line's counts win over the row's."""
    episodes = lambda *argv: lsdt.paper_settings(*lsdt.parse_flags(list(argv))).eval_episodes
    assert lsdt.Config().eval_every == 500 and episodes("--env", "hopper-medium-replay") == 20
    assert episodes("--env", "pointmaze-large") == 100 and episodes("--env", "antmaze-medium-play") == 100
    assert episodes("--env", "hopper-medium-replay", "--preset", "cpu") == lsdt.PRESETS["cpu"]["eval_episodes"]
    assert episodes("--env", "pointmaze-large", "--preset", "cpu") == lsdt.PRESETS["cpu"]["mazes"]["eval_episodes"]
    assert episodes("--env", "pointmaze-large", "--eval-episodes", "7") == 7


# ---------------------------------------------------------------------------------------------------- CLI

SMALL = ["--n-embd", "32", "--n-layer", "2", "--batch-size", "16", "--context", "5", "--log-every", "10",
         "--warmup-steps", "10"]


def run_main(argv, capsys):
    lsdt.main(argv)
    return capsys.readouterr().out


@pytest.mark.slow
def test_cli_hopper_then_plot_mixing_reads_the_checkpoint(tiny_hopper, tmp_path, capsys):
    """The real command line in a subprocess: files, checkpoint, the final line; then --plot-mixing on the run."""
    import subprocess
    import sys
    out = tmp_path / "run"
    cmd = [sys.executable, "lsdt.py", "--dataset", tiny_hopper, "--steps", "20", "--eval-every", "20",
           "--eval-episodes", "2", "--out", str(out), *SMALL]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=120,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("final: normalized_score=") and last.endswith("episodes=2"), last
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png"):
        assert (out / f).exists(), f
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 20 and ck["info"]["obs_dim"] == 11 and ck["model"]["embed_state.weight"].shape == (32, 11)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["conv_ratio"] == 0.5 and cfg["variant"] == "batch-size16_context5_warmup-steps10_n-layer2_n-embd32"
    before = (out / "ckpt.pt").read_bytes()
    assert "mixing maps:" in run_main(["--out", str(out), "--plot-mixing"], capsys)
    assert (out / "mixing.png").exists() and (out / "ckpt.pt").read_bytes() == before
    with pytest.raises(SystemExit) as e:
        lsdt.main(["--out", str(tmp_path / "none"), "--plot-mixing"])
    assert e.value.code == 1 and "no checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_maze_goal_state_and_ablation(tiny_maze, tmp_path, capsys):
    base = ["--dataset", tiny_maze, "--steps", "10", "--eval-every", "10", "--eval-episodes", "2",
            "--conv-ratio", "0.25", "--kernel", "3", *SMALL]
    out = run_main(base + ["--out", str(tmp_path / "gs")], capsys)
    assert "success=" in out and "steps_to_goal=" in out and out.strip().splitlines()[-1].startswith("final:")
    w = torch.load(tmp_path / "gs" / "ckpt.pt", weights_only=True)["model"]["embed_state.weight"]
    assert w.shape == (32, 6)                                                     # 4 + desired_goal (2)
    run_main(base + ["--out", str(tmp_path / "nogs"), "--no-goal-state"], capsys)
    cfg = json.loads((tmp_path / "nogs" / "config.json").read_text())
    assert cfg["goal_state"] is False and cfg["info"]["goal_dim"] == 2
    w = torch.load(tmp_path / "nogs" / "ckpt.pt", weights_only=True)["model"]["embed_state.weight"]
    assert w.shape == (32, 4)


@pytest.mark.slow
def test_plot_paths_reads_the_checkpoint(tiny_maze, tiny_hopper, tmp_path, capsys):
    """--plot-paths (Fig. 8): rollouts of the trained run drawn over the goals; the checkpoint stays as it was."""
    run_main(["--dataset", tiny_maze, "--steps", "2", "--eval-every", "2", "--eval-episodes", "1", *SMALL,
              "--out", str(tmp_path / "maze")], capsys)
    before = (tmp_path / "maze" / "ckpt.pt").read_bytes()
    out = run_main(["--out", str(tmp_path / "maze"), "--plot-paths", "--eval-episodes", "3"], capsys)
    assert "paths:" in out and "success=" in out and (tmp_path / "maze" / "paths.png").exists()
    assert (tmp_path / "maze" / "ckpt.pt").read_bytes() == before
    run_main(["--dataset", tiny_hopper, "--steps", "2", "--eval-every", "2", "--eval-episodes", "1", *SMALL,
              "--out", str(tmp_path / "hopper")], capsys)
    with pytest.raises(SystemExit) as e:
        lsdt.main(["--out", str(tmp_path / "hopper"), "--plot-paths"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "not a goal-reaching maze dataset" in err and len(err.splitlines()) == 1


@pytest.mark.slow
def test_paper_row_under_flags_and_resume_keeps_it(make_dataset, tmp_path, capsys):
    """A dataset with a paper row (pointmaze umaze: K=20, 2 heads, k_m 3, batch 256, lr 2e-4): the flags given win,
    even --context 10 (the Config default); the row fills the rest; --resume does not lay the row again."""
    import gymnasium as gym
    import gymnasium_robotics
    from conftest import rollout
    gym.register_envs(gymnasium_robotics)
    env = gym.make("PointMaze_UMazeDense-v3", continuing_task=True, max_episode_steps=30)
    name = make_dataset("test/pointmaze/umaze-dense-v0", rollout(env, 4, 30, seed=2), env=env, eval_env=env.spec,
                        ref_min_score=0.0, ref_max_score=30.0)
    args = ["--dataset", name, "--n-embd", "32", "--n-layer", "1", "--batch-size", "8", "--context", "10",
            "--steps", "4", "--eval-every", "4", "--eval-episodes", "1", "--out", str(tmp_path)]
    run_main(args, capsys)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert (cfg["context"], cfg["batch_size"], cfg["n_embd"]) == (10, 8, 32)                  # given
    assert (cfg["n_head"], cfg["kernel"], cfg["lr"], cfg["conv_ratio"]) == (2, 3, 2e-4, 0.5)   # the row
    run_main(["--out", str(tmp_path), "--resume", "--steps", "6", "--eval-every", "6"], capsys)
    again = json.loads((tmp_path / "config.json").read_text())
    assert {k: again[k] for k in cfg if k not in ("steps", "eval_every", "resume", "env", "dataset")} == \
           {k: cfg[k] for k in cfg if k not in ("steps", "eval_every", "resume", "env", "dataset")}
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 6


@pytest.mark.slow
def test_cli_resume_after_sigint_matches_uninterrupted(tiny_maze, tmp_path, capsys, monkeypatch):
    """DC_h on a maze: Ctrl-C inside a step (the harness finishes the step, saves, exits 130), then --resume."""
    import data
    base = ["--dataset", tiny_maze, "--steps", "30", "--eval-every", "15", "--eval-episodes", "1",
            "--arch", "dc_h", *SMALL]
    run_main(base + ["--out", str(tmp_path / "a")], capsys)
    calls, sample = [0], data.OfflineData.sample

    def interrupting(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 21:
            os.kill(os.getpid(), signal.SIGINT)
        return sample(self, *a, **kw)

    monkeypatch.setattr(data.OfflineData, "sample", interrupting)
    with pytest.raises(SystemExit) as e:
        run_main(base + ["--out", str(tmp_path / "b")], capsys)
    assert e.value.code == 130
    monkeypatch.setattr(data.OfflineData, "sample", sample)
    assert 0 < torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["step"] < 30
    run_main(["--out", str(tmp_path / "b"), "--resume"], capsys)
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("argv, words", [
    (["--env", "no-such-env"], "unknown environment"),
    (["--env", "hopper-medium", "--conv-ratio", "0.3", "--n-embd", "32"], "multiple of 4"),
    (["--env", "pointmaze-medium", "--n-embd", "40"], "row for pointmaze-medium"),   # xi 0.125 of 40: 5 channels
    (["--arch", "transformer"], "unknown --arch"),
    (["--conv", "lite"], "unknown --conv"),
    (["--fusion", "sum"], "unknown --fusion"),
    (["--norm", "mid"], "unknown --norm"),
    (["--kernel", "0"], "--kernel"),
    (["--conv-ratio", "1.5"], "--conv-ratio"),
    (["--dropkey", "1"], "--dropkey"),
    (["--dropkey", "0.1", "--conv-ratio", "1", "--no-paper-table"], "attention branch"),
    (["--n-head", "3", "--n-embd", "48", "--conv-ratio", "0.3333", "--no-paper-table"], "--n-head 3"),  # 32 of 48
    (["--conv-dropout", "1"], "--conv-dropout"),
    (["--routing", "mix"], "unknown --routing 'mix'; use split, res or weight"),
    (["--routing", "res", "--arch", "dc"], "use --routing res with --arch lsdt"),
    (["--routing", "weight", "--fusion", "concat"], "--fusion concat has nothing to join"),
    (["--routing", "weight", "--n-embd", "34", "--conv-ratio", "0", "--no-paper-table"],
     "conv branch gets 34 channels (all of --n-embd 34, --routing weight)"),    # split: attention only, fine
])
def test_cli_bad_input_is_one_sentence_before_any_work(argv, words, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        lsdt.main(argv + ["--out", str(tmp_path / "run")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_variant_names_the_configuration_trained():
    """Two commands that train different models never share a run folder: main() names it after the paper's row."""
    import evaluate

    def name(*argv):
        return evaluate.variant_name(lsdt.paper_settings(*lsdt.parse_flags(list(argv))), lsdt.PRESETS)
    mr = ["--dataset", "replica/hopper/medium-replay-v0", "--preset", "cpu"]
    assert name(*mr) == "cpu_context20_conv-ratio1"                          # the row's K=20, xi=1
    assert name(*mr, "--context", "10", "--conv-ratio", "0.5") == "cpu"        # Config's defaults, given as flags
    assert name(*mr, "--context", "10", "--conv-ratio", "1") == "cpu_conv-ratio1"
    assert name(*mr, "--no-paper-table") == "cpu_no-paper-table"
    assert name(*mr, "--routing", "res") == "cpu_context20_conv-ratio1_routingres"     # Table 8's LSDT-res
    assert name(*mr, "--routing", "weight") == "cpu_context20_conv-ratio1_routingweight"
    assert name(*mr, "--routing", "split") == "cpu_context20_conv-ratio1"              # the default, given


@pytest.mark.slow
def test_cli_routing_res_run_and_resume_refuses_another_routing(tiny_hopper, tmp_path, capsys):
    """--routing res trains on the tiny dataset into its own variant; --resume keeps it, and refuses another routing
    in one sentence that names the flag."""
    out = run_main(["--dataset", tiny_hopper, "--steps", "4", "--eval-every", "4", "--eval-episodes", "1", *SMALL,
                    "--routing", "res", "--out", str(tmp_path)], capsys)
    assert "routing res" in out and out.strip().splitlines()[-1].startswith("final:")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["routing"] == "res"
    assert cfg["variant"] == "batch-size16_context5_warmup-steps10_n-layer2_n-embd32_routingres"
    model = torch.load(tmp_path / "ckpt.pt", weights_only=True)["model"]
    res = "blocks.1.mixer.route.res_"
    assert model[res + "attn.weight"].shape == model[res + "conv.weight"].shape == (16, 16)
    with pytest.raises(SystemExit) as e:
        lsdt.main(["--out", str(tmp_path), "--resume", "--steps", "6", "--routing", "weight"])
    err = capsys.readouterr().err
    assert e.value.code == 1 and "--routing res there, weight here" in err and len(err.splitlines()) == 1, err
    run_main(["--out", str(tmp_path), "--resume", "--steps", "6"], capsys)   # no --routing: the run's own
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 6
    assert json.loads((tmp_path / "config.json").read_text())["routing"] == "res"


def test_adroit_paper_rows():
    """Table 9's eight Adroit sets (human, cloned) take Table 13's Adroit column, by short name and by Minari id; the
    paper gives no K, xi or RTG target for them, so the row leaves those to Config and data.py."""
    for task in ("pen", "hammer", "door", "relocate"):
        for level in ("human", "cloned"):
            assert lsdt.paper_row(f"{task}-{level}") == lsdt.paper_row(f"D4RL/{task}/{level}-v2") == f"{task}-{level}"
        assert lsdt.paper_row(f"D4RL/{task}/expert-v2") is None                       # not in the paper
    row = lsdt.PAPER_TABLE["door-cloned"]
    assert (row["n_embd"], row["n_head"], row["batch_size"], row["lr"], row["kernel"]) == (128, 2, 256, 2e-4, 6)
    assert not {"context", "conv_ratio", "target_return"} & set(row)
    c = lsdt.paper_settings(*lsdt.parse_flags(["--env", "relocate-human"]))
    assert (c.context, c.conv_ratio, c.target_return, c.eval_episodes) == (10, 0.5, None, 20)
