"""Tests for starformer.py. Each checks the model against something independent of its own code path:
hand-computed values, perturbation of future inputs, the unpadded/truncated window, overfitting, a CLI run."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import starformer as sf  # noqa: E402


def tiny_cfg(**kw):
    base = dict(context=6, n_layer=2, n_embd=16, n_head=2, step_embd=8, step_head=2, dropout=0.0)
    base.update(kw)
    return sf.Config(**base)


def vector_inputs(B=3, T=6, C=5, A=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, C, generator=g), torch.randn(B, T, A, generator=g).tanh(),
            torch.randn(B, T, 1, generator=g))


# ---------------------------------------------------------------------------------------------------------------
# sizes

def count_by_hand(C, A, L, D, hq, d, hs):
    """Parameter count written out from the paper's description (independent of the module code)."""
    block = lambda w: 2 * (2 * w) + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    n = C + 2
    layer = block(d) + 2 * d + (n * d * D + D) + 2 * D + block(D)
    embed = (1 * d + d) + (C * D + D) + (A * d + d) + (1 * d + d) + C * d  # FC_scalar, h^0 FC, a, r, e_spatial
    return embed + 20 * D + L * layer + 2 * D + (D * A + A)               # e_temporal (T=20), ln_head, head


@pytest.mark.parametrize("sizes", [(6, 192, 8, 64, 4), (3, 128, 1, 16, 4)])
def test_parameter_count_matches_hand_count(sizes):
    L, D, hq, d, hs = sizes
    cfg = sf.Config(n_layer=L, n_embd=D, n_head=hq, step_embd=d, step_head=hs)
    model = sf.StARformer(cfg, 11, 3)
    n = sum(p.numel() for p in model.parameters())
    assert n == count_by_hand(11, 3, L, D, hq, d, hs)
    if L == 6:
        assert 3.8e6 < n < 4.0e6   # notes 2.10: about 3.9M for Hopper at Table-6 sizes


# ---------------------------------------------------------------------------------------------------------------
# (a_{t-1}, r_{t-1}) group inputs

def test_step_inputs_hand_values():
    # window K=4; row 0 is a mid-episode window (t = 5..8), row 1 starts at the episode start with 2 padded slots
    actions = torch.tensor([[[1.], [2.], [3.], [4.]], [[0.], [0.], [7.], [8.]]])
    rewards = torch.tensor([[[10.], [20.], [30.], [40.]], [[0.], [0.], [70.], [80.]]])
    mask = torch.tensor([[1., 1., 1., 1.], [0., 0., 1., 1.]])
    timesteps = torch.tensor([[5, 6, 7, 8], [0, 0, 0, 1]])
    prev_action = torch.tensor([[0.5], [0.0]])
    prev_reward = torch.tensor([[5.], [0.]])
    pa, pr = sf.step_inputs(actions, rewards, mask, timesteps, prev_action, prev_reward)
    N = sf.NULL_ACTION
    assert pa[0, :, 0].tolist() == [0.5, 1., 2., 3.]      # a_{t-1}: the step before the window, then shifted
    assert pr[0, :, 0].tolist() == [5., 10., 20., 30.]    # r_{t-1}, never r_t
    assert pa[1, 2:, 0].tolist() == [N, 7.]               # null action -10 at the episode's first step (A.2)
    assert pr[1, 2:, 0].tolist() == [0., 70.]             # zero reward r_0 (paper fn. 1)


def test_step_inputs_discrete_null_index():
    actions = torch.tensor([[0, 0, 2, 1]])
    mask = torch.tensor([[0., 0., 1., 1.]])
    timesteps = torch.tensor([[0, 0, 0, 1]])
    pa, _ = sf.step_inputs(actions, torch.zeros(1, 4, 1), mask, timesteps, torch.tensor([0]),
                           torch.zeros(1, 1), n_actions=4)
    assert pa[0, 2:].tolist() == [4, 2]


# ---------------------------------------------------------------------------------------------------------------
# causality and padding

def test_causality_by_perturbing_the_future():
    torch.manual_seed(0)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    s, a, r = vector_inputs()
    out = model(s, a, r)
    for t0 in range(5):
        s2, a2, r2 = s.clone(), a.clone(), r.clone()
        s2[:, t0 + 1:] += 3.0
        a2[:, t0 + 1:] = -a2[:, t0 + 1:]
        r2[:, t0 + 1:] -= 5.0
        out2 = model(s2, a2, r2)
        assert torch.allclose(out[:, :t0 + 1], out2[:, :t0 + 1], atol=1e-6), f"step <= {t0} sees the future"
        assert (out[:, t0 + 1] - out2[:, t0 + 1]).abs().max() > 1e-4   # the perturbation does reach step t0+1
    # each input kind alone reaches the same step (a_{t-1}, r_{t-1} and s_t all live in group t)
    for k in range(3):
        x = [s.clone(), a.clone(), r.clone()]
        x[k][:, 3] += 1.0
        d = (model(*x) - out).abs().amax(dim=(0, 2))
        assert d[:3].max() < 1e-6 and d[3] > 1e-4


def test_official_mask_loop_reaches_the_future_ours_does_not():
    # official code: mask = tril(ones(2T, 2T)); for even i: mask[i, i-1] = 1 -> at i = 0 this is mask[0, -1],
    # the first g slot attending the LAST h token. It only touches a discarded g row; our mask has no such entry.
    T = 4
    official = torch.tril(torch.ones(2 * T, 2 * T))
    for i in range(0, 2 * T, 2):
        official[i, i - 1] = 1
    assert official.triu(1).sum() == 1 and official[0, 2 * T - 1] == 1
    ours = torch.tril(torch.ones(2 * T, 2 * T, dtype=torch.bool))
    assert not ours.triu(1).any()


def test_left_padding_equals_unpadded_window():
    torch.manual_seed(1)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    s, a, r = vector_inputs(T=4)
    ref = model(s, a, r)                                                    # 4 real steps, no padding
    pad = 2
    g = torch.Generator().manual_seed(5)
    sp = torch.cat([torch.randn(3, pad, 5, generator=g) * 9, s], 1)       # garbage in the padded slots
    ap = torch.cat([torch.randn(3, pad, 2, generator=g) * 9, a], 1)
    rp = torch.cat([torch.randn(3, pad, 1, generator=g) * 9, r], 1)
    mask = torch.cat([torch.zeros(3, pad), torch.ones(3, 4)], 1)
    out = model(sp, ap, rp, mask)
    assert torch.allclose(out[:, pad:], ref, atol=1e-5)
    assert torch.isfinite(out).all()


def test_truncated_window_is_a_sequential_reference():
    # a_t predicted from the whole window must equal a_t predicted from the window cut right after step t
    torch.manual_seed(2)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    s, a, r = vector_inputs()
    full = model(s, a, r)
    seq = torch.stack([model(s[:, :t + 1], a[:, :t + 1], r[:, :t + 1])[:, -1] for t in range(6)], 1)
    assert torch.allclose(full, seq, atol=1e-5)


def test_reward_at_step_t_is_previous_reward_through_data_pipeline():
    # Built from a data.py-style batch: changing r_t (consequence of the target a_t) must not move the prediction
    # of a_t -- the official gym code feeds r_t at step t in training, which leaks it -- but it moves a_{t+1}.
    torch.manual_seed(3)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    s, a, r = vector_inputs(B=2)
    mask, ts = torch.ones(2, 6), torch.arange(10, 16).repeat(2, 1)
    pa0, pr0 = torch.zeros(2, 2), torch.ones(2, 1)
    out = model(s, *sf.step_inputs(a, r, mask, ts, pa0, pr0), mask)
    r2 = r.clone()
    r2[:, 2] += 4.0
    out2 = model(s, *sf.step_inputs(a, r2, mask, ts, pa0, pr0), mask)
    assert torch.allclose(out[:, :3], out2[:, :3], atol=1e-6)
    assert (out[:, 3] - out2[:, 3]).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# image (Atari) variant: random frames, shapes and causality

def test_image_variant_shapes_and_causality():
    torch.manual_seed(4)
    cfg = tiny_cfg(context=3, patch_size=7)
    n_actions = 4
    model = sf.StARformer(cfg, (4, 84, 84), n_actions, discrete=True).eval()
    B, T = 2, 3
    frames = torch.rand(B, T, 4, 84, 84)
    acts = torch.randint(0, n_actions, (B, T))
    pa, pr = sf.step_inputs(acts, torch.zeros(B, T, 1), torch.ones(B, T), torch.arange(T).repeat(B, 1),
                            torch.zeros(B, dtype=torch.long), torch.zeros(B, 1), n_actions=n_actions)
    assert pa[:, 0].tolist() == [n_actions] * B
    logits = model(frames, pa, pr)
    assert logits.shape == (B, T, n_actions)
    assert model.e_spatial.shape == (144, cfg.step_embd)                 # (84/7)^2 patch tokens
    assert model.layers[0].fc.in_features == (144 + 2) * cfg.step_embd
    f2 = frames.clone()
    f2[:, 2] = torch.rand(B, 4, 84, 84)
    logits2 = model(f2, pa, pr)
    assert torch.allclose(logits[:, :2], logits2[:, :2], atol=1e-6)
    assert (logits[:, 2] - logits2[:, 2]).abs().max() > 1e-5
    # a patch change reaches both token paths: patch tokens (Step) and the conv token (Sequence)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, n_actions), acts.reshape(-1))
    loss.backward()
    assert model.state_tok.weight.grad.abs().sum() > 0 and model.state_enc.fc[0].weight.grad.abs().sum() > 0


def test_paper_atari_size_is_about_14M():
    model = sf.StARformer(sf.Config(context=30), (4, 84, 84), 4, discrete=True)
    n = sum(p.numel() for p in model.parameters())
    assert 14.3e6 < n < 14.6e6     # paper Sec. 5.4 "about 14M"; notes 2.10 compute 14.45M for |A| = 4


# ---------------------------------------------------------------------------------------------------------------
# learning

def test_overfits_a_tiny_batch():
    torch.manual_seed(0)
    cfg = tiny_cfg(n_embd=32, step_embd=8)
    model = sf.StARformer(cfg, 5, 2)
    s, a, r = vector_inputs(B=4)
    mask = torch.ones(4, 6)
    mask[0, :2] = 0
    opt = torch.optim.AdamW(model.optim_groups(0.0), lr=3e-3)
    first = None
    for i in range(300):
        pred = model(s, a, r, mask)
        loss = (((pred - a) ** 2).mean(-1) * mask).sum() / mask.sum()
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02 * first, (first, loss.item())


# ---------------------------------------------------------------------------------------------------------------
# training and evaluation feed r_{t-1} the same way (checked against the dataset and a replayed env)

def test_training_windows_feed_previous_reward_and_action(tiny_hopper):
    import numpy as np
    import data
    d = data.load_data(tiny_hopper)
    K = 8
    ep = int(np.argmax([len(e["rewards"]) for e in d.episodes]))      # the longest episode (34 steps)
    start = int(d.ep_start[ep])
    T = len(d.episodes[ep]["rewards"])
    assert T > K + 6
    ends = np.array([start + 2, start + K + 5, start + T - 1])       # padded, mid-episode, last step
    b = data.gather_windows(d.flat, np.full(3, start), ends, K)
    pa, pr = sf.step_inputs(b["actions"], b["rewards"], b["mask"], b["timesteps"], b["prev_action"], b["prev_reward"])
    R, A = d.episodes[ep]["rewards"], d.episodes[ep]["actions"]
    for i in range(3):
        for k in range(K):
            if b["mask"][i, k] == 0:
                continue
            t = int(b["timesteps"][i, k])
            if t == 0:
                assert pr[i, k, 0] == 0 and (pa[i, k] == sf.NULL_ACTION).all()
            else:
                assert pr[i, k, 0] == pytest.approx(float(R[t - 1]))
                assert torch.allclose(pa[i, k], torch.from_numpy(A[t - 1]))


def test_evaluation_feeds_the_env_reward_of_the_previous_action(tiny_hopper):
    import numpy as np
    import data
    import evaluate
    d = data.load_data(tiny_hopper)
    torch.manual_seed(0)
    model = sf.StARformer(tiny_cfg(context=5), d.obs_dim, d.act_dim).eval()
    act = sf.make_act(model)
    fed, taken = [], []

    def recording_act(batch, live):
        pa, pr = sf.step_inputs(batch["actions"], batch["rewards"], batch["mask"], batch["timesteps"],
                                batch["prev_action"], batch["prev_reward"])
        fed.append((pa[0, -1].clone(), float(pr[0, -1, 0])))
        a = act(batch, live)
        taken.append(a[0].numpy().copy())
        return a

    res = evaluate.evaluate(recording_act, d, 1, 0.0, seed=7, context=5, progress=False)
    env = d.make_env()                         # replay the same actions in a fresh env: the independent reference
    env.reset(seed=7)
    rewards = [env.step(a)[1] for a in taken]
    assert len(taken) == res["lengths"][0] >= 3
    assert fed[0][1] == 0.0 and (fed[0][0] == sf.NULL_ACTION).all()   # null action, zero reward at s_1
    for t in range(1, len(taken)):
        assert fed[t][1] == pytest.approx(rewards[t - 1], rel=1e-5)
        assert np.allclose(fed[t][0].numpy(), taken[t - 1], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# command line

def run_cli(args, out):
    sf.main(["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--step-embd", "8", "--step-head", "2",
             "--context", "4", "--batch-size", "8", "--eval-episodes", "2", "--log-every", "5", "--warmup-steps", "5",
             "--out", str(out), *args])


def final_line(capsys):
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("final:")]
    assert len(lines) == 1
    return lines[0]


def test_cli_run_writes_outputs(tiny_hopper, tmp_path, capsys):
    import csv
    import json
    run_cli(["--dataset", tiny_hopper, "--steps", "10", "--eval-every", "5"], tmp_path)
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=2")
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png"):
        assert os.path.getsize(tmp_path / f) > 0
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["dataset_id"] == tiny_hopper and ck["state_mean"].shape == (11,)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    assert len([r for r in rows if r["eval_return"]]) == 2 and len([r for r in rows if r["loss"]]) == 2
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["steps"] == 10 and "target_return" not in cfg


def test_cli_maze_reports_success(tiny_maze, tmp_path, capsys):
    import csv
    run_cli(["--dataset", tiny_maze, "--steps", "5", "--eval-every", "5"], tmp_path)
    final_line(capsys)
    rows = [r for r in csv.DictReader(open(tmp_path / "log.csv")) if r["eval_return"]]
    assert rows and rows[0]["success_rate"] != "" and float(rows[0]["steps_to_goal"]) <= 40


def test_resume_gives_identical_weights(tiny_hopper, tmp_path, capsys):
    common = ["--dataset", tiny_hopper, "--eval-every", "1000", "--eval-episodes", "1", "--seed", "3",
              "--dropout", "0.1"]           # dropout on: the torch RNG state must be restored too
    run_cli(common + ["--steps", "12"], tmp_path / "straight")
    run_cli(common + ["--steps", "6"], tmp_path / "split")
    run_cli(common + ["--steps", "12", "--resume"], tmp_path / "split")
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_flags_presets_and_bad_input(tiny_hopper, tmp_path, capsys):
    cfg = sf.parse_args(["--preset", "cpu", "--n-embd", "48"])
    assert cfg.n_embd == 48 and cfg.n_layer == sf.PRESETS["cpu"]["n_layer"] and cfg.steps == 6000 and cfg.lr_decay
    assert sf.parse_args([]).n_embd == 192 and sf.parse_args(["--preset", "code"]).n_embd == 128
    with pytest.raises(SystemExit) as e:            # rewards, not returns-to-go: there is no target to set
        sf.parse_args(["--target-return", "3600"])
    assert e.value.code == 2
    capsys.readouterr()
    for bad in (["--context", "0"], ["--n-embd", "20", "--n-head", "3"], ["--env", "no-such-env"]):
        with pytest.raises(SystemExit) as e:
            run_cli(["--steps", "1", *bad] if "--env" in bad else ["--dataset", tiny_hopper, *bad], tmp_path)
        assert e.value.code == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and len(err.splitlines()) == 1, err
