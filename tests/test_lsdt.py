"""Tests for lsdt.py. Every check compares against something computed independently: explicit loops over taps,
torch's own conv1d / scaled_dot_product_attention, hand-computed values, perturbation of future inputs, overfitting,
and short CLI runs on the tiny datasets from conftest.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import lsdt

torch.set_num_threads(1)

S, A, T_MAX = 5, 2, 64


def make_cfg(**kw):
    base = dict(state_dim=S, act_dim=A, max_ep_len=T_MAX, n_embd=32, n_head=2, conv_ratio=0.5, kernel=3,
                context=6)
    if kw.get("arch") in lsdt.ARCH_DEFAULTS:
        base.update(lsdt.ARCH_DEFAULTS[kw["arch"]])
        base.update(n_embd=32, kernel=3, context=6)
    base.update(kw)
    return lsdt.Config(**base)


VARIANTS = {
    "lsdt": {}, "lsdt_pre_concat": dict(norm="pre", fusion="concat"), "xi0": dict(conv_ratio=0.0),
    "cdt": dict(conv_ratio=1.0), "lsdc": dict(conv="dc"), "no_action_tokens": dict(action_tokens=False),
    "dc": dict(arch="dc"), "dc_h": dict(arch="dc_h"),
}


def rand_inputs(B, K, g):
    x = dict(states=torch.randn(B, K, S, generator=g), actions=torch.rand(B, K, A, generator=g) * 2 - 1,
             rtg=torch.randn(B, K, 1, generator=g), timesteps=torch.randint(0, T_MAX - K, (B, 1), generator=g)
             + torch.arange(K), mask=torch.ones(B, K))
    return x


def run(model, x):
    return model(x["states"], x["actions"], x["rtg"], x["timesteps"], x["mask"])


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
    m = lsdt.LSDT(make_cfg(conv_ratio=0.25)).blocks[0].mixer
    assert (m.da, m.dc) == (24, 8) and m.attn.c_attn.in_features == 24 and m.conv.glu_in.in_features == 8
    m0 = lsdt.LSDT(make_cfg(conv_ratio=0.0)).blocks[0].mixer
    assert m0.conv is None and m0.fuse is None and m0.attn is not None
    m1 = lsdt.LSDT(make_cfg(conv_ratio=1.0)).blocks[0].mixer
    assert m1.attn is None and m1.fuse is None and m1.conv is not None
    assert lsdt.LSDT(make_cfg(fusion="concat")).blocks[0].mixer.fuse is None
    assert lsdt.check_config(make_cfg(conv_ratio=0.3)) is not None   # 9.6 -> 10 conv channels, not a multiple of 4
    assert lsdt.check_config(make_cfg(conv_ratio=1.5)) is not None


def test_xi0_mixer_is_dt_attention():
    """xi = 0: the mixer is plain causal multi-head attention + W_O, computed here with torch's SDPA."""
    torch.manual_seed(3)
    cfg = make_cfg(conv_ratio=0.0, n_head=4)
    mixer = lsdt.LongShortMixer(cfg, 0).eval()
    B, L, D = 2, 9, cfg.n_embd
    x = torch.randn(B, L, D)
    allowed = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L)
    got = mixer(x, allowed, torch.ones(B, L, dtype=torch.bool))
    q, k, v = F.linear(x, mixer.attn.c_attn.weight, mixer.attn.c_attn.bias).split(D, -1)
    heads = lambda z: z.view(B, L, 4, D // 4).transpose(1, 2)
    y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
    ref = F.linear(y.transpose(1, 2).reshape(B, L, D), mixer.proj.weight, mixer.proj.bias)
    torch.testing.assert_close(got, ref)


# ---------------------------------------------------------------------------------------------------- model

@pytest.mark.parametrize("name", list(VARIANTS))
def test_future_does_not_leak(name):
    torch.manual_seed(4)
    cfg = make_cfg(**VARIANTS[name])
    model = lsdt.LSDT(cfg).eval()
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


@pytest.mark.parametrize("name", ["lsdt", "lsdc", "dc", "no_action_tokens"])
def test_left_padding_is_the_shorter_window(name):
    torch.manual_seed(5)
    cfg = make_cfg(**VARIANTS[name])
    model = lsdt.LSDT(cfg).eval()
    g = torch.Generator().manual_seed(1)
    K, pad = cfg.context, 2
    short = rand_inputs(2, K - pad, g)
    padded = {k: F.pad(v, (0, 0, pad, 0)) if v.dim() == 3 else F.pad(v, (pad, 0)) for k, v in short.items()}
    padded["states"][:, :pad] = 7.0                                  # garbage under the mask must not matter
    torch.testing.assert_close(run(model, padded)[:, pad:], run(model, short), rtol=0, atol=1e-5)


def test_overfits_a_tiny_batch():
    torch.manual_seed(6)
    cfg = make_cfg(dropout=0.0, attn_dropout=0.0, conv_dropout=0.0)
    model = lsdt.LSDT(cfg)
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


def test_paper_rows():
    assert lsdt.paper_row("replica/hopper/medium-v0") == "hopper-medium"
    assert lsdt.paper_row("mujoco/hopper/medium-v0") == "hopper-medium"
    assert lsdt.paper_row("replica/pointmaze/medium-dense-v0") == "pointmaze-medium"
    assert lsdt.paper_row("D4RL/antmaze/medium-play-v1") == "antmaze-medium-play"
    assert lsdt.paper_row("walker2d-expert") is None
    row = lsdt.PAPER_TABLE["hopper-medium"]
    assert (row["conv_ratio"], row["n_embd"], row["context"], row["action_tokens"]) == (1.0, 256, 10, False)


def test_xi0_block_matches_dt_block():
    """xi = 0 with pre-LN is DT's GPT-2 block given the same weights (DT's MLP uses ReLU, kzl's choice; LSDT GELU)."""
    import dt
    torch.manual_seed(7)
    cfg = make_cfg(conv_ratio=0.0, norm="pre", n_head=4)
    ours = lsdt.Block(cfg, 0).eval()
    ours.mlp[1] = torch.nn.ReLU()
    ref = dt.Block(dt.Config(n_embd=cfg.n_embd, n_head=4)).eval()
    names = {"mixer.attn.c_attn": "attn.c_attn", "mixer.proj": "attn.c_proj"}
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


# ---------------------------------------------------------------------------------------------------- CLI

SMALL = ["--n-embd", "32", "--n-layer", "2", "--batch-size", "16", "--context", "5", "--log-every", "10",
         "--warmup-steps", "10"]


def test_cli_hopper(tiny_hopper, tmp_path):
    """The real command line in a subprocess: files, checkpoint, the final line."""
    import json
    import os
    import subprocess
    import sys
    out = tmp_path / "run"
    cmd = [sys.executable, "lsdt.py", "--dataset", tiny_hopper, "--steps", "20", "--eval-every", "20",
           "--eval-episodes", "2", "--out", str(out), "--plot-mixing", *SMALL]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-2000:]
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("final: normalized_score=") and last.endswith("episodes=2"), last
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png", "mixing.png"):
        assert (out / f).exists(), f
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 20
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["state_dim"] == 11 and cfg["conv_ratio"] == 0.5 and cfg["paper_row"] is None


def run_main(argv, capsys):
    lsdt.main(argv)
    return capsys.readouterr().out


def test_cli_maze_goal_state_and_ablation(tiny_maze, tmp_path, capsys):
    import json
    base = ["--dataset", tiny_maze, "--steps", "10", "--eval-every", "10", "--eval-episodes", "2",
            "--conv-ratio", "0.25", "--kernel", "3", *SMALL]
    out = run_main(base + ["--out", str(tmp_path / "gs")], capsys)
    assert "success=" in out and "steps_to_goal=" in out and out.strip().splitlines()[-1].startswith("final:")
    assert json.loads((tmp_path / "gs" / "config.json").read_text())["state_dim"] == 6      # 4 + desired_goal (2)
    run_main(base + ["--out", str(tmp_path / "nogs"), "--no-goal-state"], capsys)
    cfg = json.loads((tmp_path / "nogs" / "config.json").read_text())
    assert cfg["state_dim"] == 4 and cfg["goal_state"] is False
    w = torch.load(tmp_path / "nogs" / "ckpt.pt", weights_only=True)["model"]["embed_s.weight"]
    assert w.shape == (32, 4)


def test_cli_resume_matches_uninterrupted(tiny_maze, tmp_path, capsys, monkeypatch):
    import data
    base = ["--dataset", tiny_maze, "--steps", "30", "--eval-every", "15", "--eval-episodes", "1",
            "--arch", "dc_h", *SMALL]
    run_main(base + ["--out", str(tmp_path / "a")], capsys)
    calls, sample = [0], data.OfflineData.sample

    def interrupting(self, *a, **kw):
        calls[0] += 1
        if calls[0] == 21:
            raise KeyboardInterrupt
        return sample(self, *a, **kw)

    monkeypatch.setattr(data.OfflineData, "sample", interrupting)
    with pytest.raises(SystemExit):
        run_main(base + ["--out", str(tmp_path / "b")], capsys)
    monkeypatch.setattr(data.OfflineData, "sample", sample)
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["step"] == 20
    run_main(base + ["--out", str(tmp_path / "b"), "--resume"], capsys)
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("argv, words", [
    (["--env", "no-such-env"], "unknown environment"),
    (["--env", "hopper-medium", "--conv-ratio", "0.3", "--n-embd", "32"], "multiple of 4"),
])
def test_cli_bad_input_is_one_sentence(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        lsdt.main(argv)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and words in err and "Traceback" not in err and len(err.splitlines()) == 1


def test_explicit_attention_path_equals_fused():
    """The analysis path (explicit probabilities, kept for plots) and the training path (fused SDPA) agree, and
    the kept probabilities are causal, skip padding and sum to 1."""
    torch.manual_seed(8)
    model = lsdt.LSDT(make_cfg(n_head=2)).eval()
    x = rand_inputs(2, 6, torch.Generator().manual_seed(3))
    x["mask"][1, :2] = 0
    fused = run(model, x)
    model.keep_maps(True)
    explicit = run(model, x)
    torch.testing.assert_close(explicit, fused)
    P = model.blocks[0].mixer.attn.probs                              # (B, h, L, L)
    torch.testing.assert_close(P.sum(-1), torch.ones_like(P[..., 0]))
    assert torch.all(P.triu(1) == 0) and torch.all(P[1, :, 6:, :6] == 0)


@pytest.mark.parametrize("dc, millions", [(0, 1.126), (16, 1.146), (32, 1.129), (64, 1.136), (96, 1.197),
                                          (128, 1.263)])
def test_parameter_count_matches_official_code(dc, millions):
    """Walker2d sizes (D=128, 3 blocks, 4096 timesteps): the notes' analytic count of the official code, which also
    holds the k - k_m = 5 masked future taps of each dynamic kernel and unused RTG / state heads we leave out."""
    cfg = lsdt.Config(state_dim=17, act_dim=6, max_ep_len=4096, n_embd=128, n_head=1, conv_ratio=dc / 128)
    ours = sum(p.numel() for p in lsdt.LSDT(cfg).parameters())
    dead_taps = 3 * 5 * (dc // 4) * (dc + 1)
    unused_heads = (128 + 1) + (128 * 17 + 17)
    assert round((ours + dead_taps + unused_heads) / 1e6, 3) == millions
