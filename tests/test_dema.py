"""dema.py: the two selective scans against each other and a hand-written reference, a hand-computed scan, the
recurrent step against the full forward, inert left padding, causality by perturbation, hidden attention against
explicit materialisation, parameter counts, the RTG alignment, overfitting, and the CLI on tiny Minari datasets."""
import csv
import json
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


def values_and_grads(fn, xs):
    y = fn(**xs) if fn is scan_reference else fn(**xs, delta_softplus=True)
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


@pytest.mark.parametrize("b,d_inner,L,N", [(16, 64, 60, 16), (1, 16, 60, 4)])
def test_auto_never_picks_the_slower_on_cpu(b, d_inner, L, N):
    """Timed, forward + backward: a training-like state (the loop should win) and a tiny one (the parallel scan)."""
    chosen = dema.choose_scan("cpu", L, b * d_inner * N)
    other = "parallel" if chosen == "sequential" else "sequential"
    t = {name: dema.time_scan(SCANS[name], b, d_inner, L, N, reps=3) for name in (chosen, other)}
    assert t[chosen] <= 1.2 * t[other], (chosen, t)


# ---------------------------------------------------------------------------------------------------------------
# the model

def tiny_cfg(**kw):
    base = dict(n_embd=16, d_model=8, n_layer=2, d_state=4, context=6, embd_dropout=0.0)
    return dema.Config(**{**base, **kw})


def tiny_model(obs=5, act=2, dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return dema.DeMa(tiny_cfg(**kw), obs, act).to(dtype).eval()


def random_window(B=3, K=6, obs=5, act=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randn(B, K, obs, generator=g, dtype=dtype),
                actions=torch.rand(B, K, act, generator=g, dtype=dtype) * 2 - 1,
                prev_action=torch.rand(B, act, generator=g, dtype=dtype) * 2 - 1,
                rtg=torch.randn(B, K, 1, generator=g, dtype=dtype),
                timesteps=torch.arange(K).repeat(B, 1) + 4, mask=torch.ones(B, K, dtype=dtype))


@pytest.mark.parametrize("scan", list(SCANS))
def test_recurrent_step_equals_full_forward(scan):
    model, b = tiny_model(), random_window()
    prev = dema.prev_actions(b)
    full = model(b["rtg"], prev, b["states"], scan=scan)                       # (B, K, act)
    state = [tuple(s.double() for s in st) for st in model.init_state(3)]
    steps = []
    for t in range(b["states"].shape[1]):
        a, state = model.step(b["rtg"][:, t], prev[:, t], b["states"][:, t], state)
        steps.append(a)
    assert torch.allclose(torch.stack(steps, 1), full, atol=1e-12, rtol=0)


def test_left_padding_is_inert():
    model, b = tiny_model(), random_window()
    prev = dema.prev_actions(b)
    mask = b["mask"].clone()
    mask[:, :2] = 0
    short = model(b["rtg"][:, 2:], prev[:, 2:], b["states"][:, 2:])            # the unpadded 4-step window
    padded = model(b["rtg"], prev, b["states"], mask)
    assert torch.allclose(padded[:, 2:], short, atol=1e-12, rtol=0)
    junk = model(b["rtg"] + 50 * (1 - mask[..., None]), prev - 3 * (1 - mask[..., None]), b["states"] + 9, mask)
    assert not torch.allclose(junk[:, 2:], short, atol=1e-6)                  # states of real steps moved (+9) ...
    junk = model(b["rtg"] + 50 * (1 - mask[..., None]), prev - 3 * (1 - mask[..., None]),
                 b["states"] + 9 * (1 - mask[..., None]), mask)
    assert torch.allclose(junk[:, 2:], short, atol=1e-12, rtol=0)             # ... pad contents do not matter
    unmasked = model(b["rtg"] + 50 * (1 - mask[..., None]), prev, b["states"], None)
    assert not torch.allclose(unmasked[:, 2:], short, atol=1e-6)              # the official (no mask) behaviour


def test_causal_future_does_not_change_the_past():
    cfg = tiny_cfg()
    model, b = tiny_model(), random_window()
    base = dema.predict(model, b, cfg)[0]
    K = b["states"].shape[1]
    for t in range(K):
        p = {k: v.clone() for k, v in b.items()}
        p["states"][:, t + 1:] += 5.0
        p["rtg"][:, t + 1:] -= 3.0
        p["actions"][:, t:] = -p["actions"][:, t:]       # a_t itself must not influence the prediction of a_t
        out = dema.predict(model, p, cfg)[0]
        assert torch.allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-12)
        if t < K - 1:
            assert not torch.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-6)


def test_rtg_alignment_default_and_official_shift():
    """Record what the model is fed: default (R_t, a_{t-1}, s_t) -> a_t over K steps; --rtg-shift (official code's
    training) (R_{t-1}, a_{t-1}, s_t) -> a_t over K-1 steps."""
    K = 5
    idx = torch.arange(K, dtype=torch.float32)[None, :, None]                  # value = step index t
    b = dict(rtg=100 + idx, states=200 + idx.expand(1, K, 3), actions=300 + idx.expand(1, K, 2),
             prev_action=torch.full((1, 2), 299.0), mask=torch.ones(1, K))
    seen = {}

    def fake(rtg, prev, states, mask, scan):
        seen.update(rtg=rtg[0, :, 0].tolist(), prev=prev[0, :, 0].tolist(), states=states[0, :, 0].tolist())
        return torch.zeros_like(prev)
    _, target, _ = dema.predict(fake, b, dema.Config(), training=True)
    assert seen == dict(rtg=[100, 101, 102, 103, 104], prev=[299, 300, 301, 302, 303], states=[200, 201, 202, 203, 204])
    assert target[0, :, 0].tolist() == [300, 301, 302, 303, 304]
    _, target, mask = dema.predict(fake, b, dema.Config(rtg_shift=True), training=True)
    assert seen == dict(rtg=[100, 101, 102, 103], prev=[300, 301, 302, 303], states=[201, 202, 203, 204])
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


def test_hidden_attention_per_layer_shapes_and_finite_at_long_range():
    model, b = tiny_model(), random_window(K=6)
    attn = model.hidden_attention(b["rtg"], dema.prev_actions(b), b["states"], b["mask"])
    assert len(attn) == 2 and attn[0].shape == (3, 16, 18, 18)
    assert all(torch.isfinite(a).all() for a in attn)


def test_parameter_counts_match_the_official_model():
    # official: 175,503 (hopper, E=256, D=64, N=64) and 499,983 (D=128), each with unused predict_state (D*11+11)
    # and predict_return (D+1) heads that this file leaves out
    for d_model, official in ((64, 175_503), (128, 499_983)):
        n = dema.count_params(dema.DeMa(dema.Config(n_embd=256, d_model=d_model, d_state=64), 11, 3))
        assert n + (11 * d_model + 11) + (d_model + 1) == official
    assert dema.count_params(dema.DeMa(dema.Config(), 11, 3)) == 174_723


def test_paper_settings_and_flag_order():
    assert dema.paper_settings("hopper-medium") == dict(n_embd=256, d_model=64, lr=1e-4)
    assert dema.paper_settings("mujoco/walker2d/expert-v0")["lr"] == 1e-3
    assert dema.paper_settings("replica/hopper/medium-replay-v0")["n_embd"] == 256
    cfg = dema.parse_args(["--env", "halfcheetah-medium"])
    assert (cfg.n_embd, cfg.d_model, cfg.lr) == (128, 64, 1e-3)
    cfg = dema.parse_args(["--env", "halfcheetah-medium", "--preset", "cpu", "--d-model", "24"])
    assert cfg.n_embd == dema.PRESETS["cpu"]["n_embd"] and cfg.d_model == 24 and cfg.lr == 1e-3


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
    """make_act in rnn mode over an interleaved pair of episodes (one finishing early, one restarting) equals the
    full forward over each episode's history."""
    cfg = tiny_cfg(mode="rnn")
    model = tiny_model(dtype=torch.float32)
    act = dema.make_act(model, cfg)
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
        prev = torch.cat([torch.zeros(1, 2), e["a"][:-1]])
        full = model(e["R"][None, :n], prev[None, :n], e["s"][None, :n])[0]
        assert torch.allclose(torch.stack(got[i]), full, atol=1e-5), i
    # a fresh episode in slot 0 (timesteps 0) starts from a zero state again
    batch = dict(states=eps[1]["s"][:1][None], actions=torch.zeros(1, 1, 2), rtg=eps[1]["R"][:1][None],
                 prev_action=torch.zeros(1, 2), timesteps=torch.zeros(1, 1, dtype=torch.long), mask=torch.ones(1, 1))
    assert torch.allclose(act(batch, np.array([0]))[0], torch.stack(got[1])[0], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the command line on tiny datasets

def run_cli(args, out):
    dema.main(["--n-embd", "16", "--d-model", "8", "--d-state", "4", "--n-layer", "1", "--context", "4",
               "--batch-size", "8", "--eval-episodes", "2", "--log-every", "5", "--warmup-steps", "5",
               "--out", str(out), *args])


def final_line(capsys):
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("final:")]
    assert len(lines) == 1
    return lines[0]


def test_cli_run_writes_outputs(tiny_hopper, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--steps", "10", "--eval-every", "5"], tmp_path)
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=2")
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png", "attention.png"):
        assert os.path.getsize(tmp_path / f) > 0
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["dataset_id"] == tiny_hopper
    evals = [r for r in csv.DictReader(open(tmp_path / "log.csv")) if r["target"]]
    assert sorted({float(r["target"]) for r in evals}) == [1800.0, 3600.0] and len(evals) == 4
    assert json.load(open(tmp_path / "config.json"))["mode"] == "transformer"


def test_cli_rnn_mode_and_maze(tiny_hopper, tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--mode", "rnn", "--rnn-max-len", "50", "--batch-size", "2",
             "--steps", "3", "--eval-every", "1000", "--target-return", "500"], tmp_path / "rnn")
    assert final_line(capsys).endswith("episodes=2")
    run_cli(["--dataset", tiny_maze, "--steps", "3", "--eval-every", "1000"], tmp_path / "maze")
    final_line(capsys)
    rows = [r for r in csv.DictReader(open(tmp_path / "maze" / "log.csv")) if r["target"]]
    assert rows and rows[0]["success_rate"] != ""


def test_resume_gives_identical_weights(tiny_hopper, tmp_path, capsys):
    common = ["--dataset", tiny_hopper, "--eval-every", "1000", "--eval-episodes", "1", "--seed", "3",
              "--target-return", "500"]
    run_cli(common + ["--steps", "8"], tmp_path / "straight")
    run_cli(common + ["--steps", "4"], tmp_path / "split")
    run_cli(common + ["--steps", "8", "--resume"], tmp_path / "split")
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 8
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_bad_input_is_one_sentence(tiny_hopper, tmp_path, capsys):
    for args in (["--dataset", tiny_hopper, "--mode", "lstm"], ["--env", "no-such-env"],
                 ["--dataset", tiny_hopper, "--mode", "rnn", "--no-pad-mask"]):
        with pytest.raises(SystemExit) as e:
            run_cli(args + ["--steps", "1"], tmp_path)
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("error:") and len(err.strip().splitlines()) == 1, err
