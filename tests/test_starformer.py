"""Tests for starformer.py. Each checks the model against something independent of its own code path:
hand-computed values, perturbation of future inputs, the unpadded/truncated window, overfitting, a replayed env,
a CLI run. The harness (flags, run folders, resume after a signal, --compile, --amp) is tested for every script in
tests/test_harness.py."""
import csv
import json
import os
import sys

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import data  # noqa: E402
import evaluate  # noqa: E402
import starformer as sf  # noqa: E402


def tiny_cfg(**kw):
    return sf.Config(**dict(dict(context=6, n_layer=2, n_embd=16, n_head=2, step_embd=8, step_head=2, dropout=0.0), **kw))


def window(B=3, T=6, C=5, A=2, t0=10, seed=0):
    """A data.py-style window of T real steps starting at episode step t0 (t0 = 0: the episode's first step)."""
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randn(B, T, C, generator=g), actions=torch.randn(B, T, A, generator=g).tanh(),
                rewards=torch.randn(B, T, 1, generator=g), rtg=torch.randn(B, T, 1, generator=g),
                timesteps=torch.arange(t0, t0 + T).repeat(B, 1), mask=torch.ones(B, T),
                prev_action=torch.randn(B, A, generator=g).tanh(), prev_reward=torch.randn(B, 1, generator=g))


def changed(w, key, index, by=1.0):
    w = {k: v.clone() for k, v in w.items()}
    w[key][index] += by
    return w


def moved_steps(model, w, w2):
    """The positions whose prediction differs between two windows (> 1e-5), and the largest change elsewhere."""
    d = (model(**w) - model(**w2)).abs().amax(dim=(0, 2))     # (T,)
    return [t for t in range(len(d)) if d[t] > 1e-5], d


# ---------------------------------------------------------------------------------------------------------------
# sizes

def count_by_hand(C, A, L, D, d, reward=True, T=20):
    """Parameter count written out from the paper's description (independent of the module code)."""
    block = lambda w: 2 * (2 * w) + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    n = C + 1 + reward                                                      # a, (r), C state tokens
    layer = block(d) + 2 * d + (n * d * D + D) + 2 * D + block(D)         # F_step, LN, FC_l, LN, F_seq
    embed = (1 * d + d) + (C * D + D) + (A * d + d) + reward * (1 * d + d) + C * d  # FC_scalar, h^0 FC, a, r, e_spatial
    return embed + T * D + L * layer + 2 * D + (D * A + A)                  # e_temporal, ln_f, head


@pytest.mark.parametrize("sizes", [(6, 192, 8, 64, 4), (3, 128, 1, 16, 4)])
def test_parameter_count_matches_hand_count(sizes):
    L, D, hq, d, hs = sizes
    cfg = sf.Config(n_layer=L, n_embd=D, n_head=hq, step_embd=d, step_head=hs)
    n = sum(p.numel() for p in sf.StARformer(cfg, 11, 3).parameters())
    assert n == count_by_hand(11, 3, L, D, d)
    if L == 6:
        assert 3.8e6 < n < 4.0e6   # Table-6 sizes at Hopper's 11 state dims: about 3.9M
    cfg = sf.Config(n_layer=L, n_embd=D, n_head=hq, step_embd=d, step_head=hs, reward_token=False)
    assert sum(p.numel() for p in sf.StARformer(cfg, 11, 3).parameters()) == count_by_hand(11, 3, L, D, d, reward=False)


def test_paper_atari_size_is_about_14M():
    n = sum(p.numel() for p in sf.StARformer(sf.Config(context=30), (4, 84, 84), 4, discrete=True).parameters())
    assert 14.3e6 < n < 14.6e6     # Sec. 5.4: "about 14M" (14.45M for |A| = 4 with reward tokens)
    imitation = sf.StARformer(sf.Config(context=30, reward_token=False), (4, 84, 84), 4, discrete=True)
    # one token fewer per group: L x d x D fewer FC_l weights, and no reward embedding (d + d)
    assert n - sum(p.numel() for p in imitation.parameters()) == 6 * 64 * 192 + 2 * 64


# ---------------------------------------------------------------------------------------------------------------
# (a_{t-1}, r_{t-1}) group inputs

def test_step_inputs_hand_values():
    # window K=4; row 0 is a mid-episode window (t = 5..8), row 1 starts at the episode start with 2 padded slots
    actions = torch.tensor([[[1.], [2.], [3.], [4.]], [[0.], [0.], [7.], [8.]]])
    rewards = torch.tensor([[[10.], [20.], [30.], [40.]], [[0.], [0.], [70.], [80.]]])
    timesteps = torch.tensor([[5, 6, 7, 8], [0, 0, 0, 1]])
    prev_action = torch.tensor([[0.5], [0.0]])
    prev_reward = torch.tensor([[5.], [0.]])
    pa, pr = sf.step_inputs(actions, rewards, timesteps, prev_action, prev_reward)
    N = sf.NULL_ACTION
    assert pa[0, :, 0].tolist() == [0.5, 1., 2., 3.]      # a_{t-1}: the step before the window, then shifted
    assert pr[0, :, 0].tolist() == [5., 10., 20., 30.]    # r_{t-1}, never r_t
    assert pa[1, 2:, 0].tolist() == [N, 7.]               # null action -10 at the episode's first step (A.2)
    assert pr[1, 2:, 0].tolist() == [0., 70.]             # zero reward r_0 (fn. 1)


def test_step_inputs_discrete_null_index():
    actions = torch.tensor([[0, 0, 2, 1]])
    timesteps = torch.tensor([[0, 0, 0, 1]])
    pa, _ = sf.step_inputs(actions, torch.zeros(1, 4, 1), timesteps, torch.tensor([3]), torch.zeros(1, 1), 4)
    assert pa[0, 2:].tolist() == [4, 2] and pa.dtype == torch.long


def test_padding_only_precedes_an_episode_start(tiny_hopper):
    # step_inputs relies on this (data.py's invariant): the first real step after left padding is an episode's first
    # step, so it gets the null action and r_0 = 0, never a padded slot's values
    d = data.load_data(tiny_hopper)
    b = d.sample(512, 8, np.random.default_rng(0))
    padded = b["mask"][:, 0] == 0
    assert padded.sum() > 20
    first_real = b["mask"].argmax(1)                                         # (B,) index of the first real step
    assert (b["timesteps"][padded, first_real[padded]] == 0).all()


# ---------------------------------------------------------------------------------------------------------------
# causality and padding

def test_causality_by_perturbing_the_future():
    torch.manual_seed(0)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    w = window()
    for t0 in range(5):   # s_{>t0} and a_{>=t0}, r_{>=t0} (they enter group t0 + 1 and later) must not reach <= t0
        w2 = changed(changed(changed(w, "states", (slice(None), slice(t0 + 1, None)), 3.0),
                             "actions", (slice(None), slice(t0, None)), -0.5), "rewards", (slice(None), slice(t0, None)), -5.0)
        moved, d = moved_steps(model, w, w2)
        assert d[:t0 + 1].max() < 1e-6 and d[t0 + 1] > 1e-4, f"step <= {t0} sees the future"
    # each input kind alone: s_3 reaches step 3; a_2, r_2 reach step 3 (group 3 holds a_2, r_2, s_3), not step 2
    for key, t in (("states", 3), ("actions", 2), ("rewards", 2)):
        moved, _ = moved_steps(model, w, changed(w, key, (slice(None), t)))
        assert moved[0] == 3, (key, moved)


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
    w = window(T=4, t0=0)                                                   # an episode's first 4 steps
    ref = model(**w)
    pad, g = 2, torch.Generator().manual_seed(5)
    wp = {k: torch.cat([torch.randn(3, pad, *v.shape[2:], generator=g) * 9, v], 1)   # garbage in the padded slots
          for k, v in w.items() if k in ("states", "actions", "rewards", "rtg")}
    wp.update(timesteps=torch.cat([torch.zeros(3, pad, dtype=torch.long), w["timesteps"]], 1),
              mask=torch.cat([torch.zeros(3, pad), w["mask"]], 1),
              prev_action=torch.randn(3, 2, generator=g), prev_reward=torch.randn(3, 1, generator=g))
    out = model(**wp)
    assert torch.allclose(out[:, pad:], ref, atol=1e-5)
    assert torch.isfinite(out).all()


def test_truncated_window_is_a_sequential_reference():
    # a_t predicted from the whole window must equal a_t predicted from the window cut right after step t
    torch.manual_seed(2)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    w = window()
    full = model(**w)
    seq = torch.stack([model(**{k: v if k.startswith("prev") else v[:, :t + 1] for k, v in w.items()})[:, -1]
                       for t in range(6)], 1)
    assert torch.allclose(full, seq, atol=1e-5)


def test_reward_at_step_t_is_not_seen_by_the_prediction_of_a_t():
    # r_t is a consequence of the target a_t: it must not move the prediction of a_t (the official gym code feeds
    # r_t at step t in training, which leaks it), but it moves a_{t+1}
    torch.manual_seed(3)
    model = sf.StARformer(tiny_cfg(), 5, 2).eval()
    w = window(B=2)
    moved, d = moved_steps(model, w, changed(w, "rewards", (slice(None), 2), 4.0))
    assert d[:3].max() < 1e-6 and d[3] > 1e-4


# ---------------------------------------------------------------------------------------------------------------
# the paper's settings

def test_no_reward_token_is_table_1_imitation():
    """Table 1, imitation: the Step group is (a_{t-1}, s_t), n_state + 1 tokens, and rewards change nothing."""
    torch.manual_seed(4)
    model = sf.StARformer(tiny_cfg(reward_token=False), 5, 2).eval()
    seen = []
    model.blocks[0].step.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    w = window()
    out = model(**w)
    assert seen == [(3 * 6, 5 + 1, 8)]                   # (B*T, n_state + 1, d) inside the Step Transformer
    assert model.blocks[0].fc.in_features == (5 + 1) * 8 and not hasattr(model, "embed_reward")
    for key in ("rewards", "prev_reward", "rtg"):
        assert torch.equal(model(**changed(w, key, ..., 7.0)), out), key
    assert moved_steps(model, w, changed(w, "actions", (slice(None), 2)))[0][0] == 3   # actions still count


def test_no_prev_action_gives_every_group_the_null_action():
    """--no-prev-action: group t holds the episode-start null action whatever a_{t-1} was, so no action changes any
    prediction, and the output equals the method's fed null actions; with a_{t-1} (the method) actions count."""
    torch.manual_seed(4)
    model = sf.StARformer(tiny_cfg(prev_action=False), 5, 2).eval()
    w = window()
    out = model(**w)
    for key in ("actions", "prev_action"):
        assert torch.equal(model(**changed(w, key, ..., 0.5)), out), key
    model.prev_action = True                                                   # the same weights, fed null actions
    null = dict(w, actions=torch.full_like(w["actions"], sf.NULL_ACTION),
                prev_action=torch.full_like(w["prev_action"], sf.NULL_ACTION))
    assert torch.allclose(model(**null), out, atol=1e-6)
    assert moved_steps(model, w, changed(w, "actions", (slice(None), 2)))[0][0] == 3   # a_2 is group 3's a_{t-1}


def test_reward_input_rtg_is_table_2():
    """Table 2, SF RTG: R_t fills the reward slot of group t; rewards change nothing (and the default ignores rtg)."""
    torch.manual_seed(5)
    model = sf.StARformer(tiny_cfg(reward_input="rtg"), 5, 2).eval()
    w = window()
    out = model(**w)
    for key in ("rewards", "prev_reward"):
        assert torch.equal(model(**changed(w, key, ..., 7.0)), out), key
    moved, d = moved_steps(model, w, changed(w, "rtg", (slice(None), 3), 0.5))
    assert d[:3].max() < 1e-6 and moved[0] == 3          # R_t is known at step t: it reaches a_t, not a_{<t}
    default = sf.StARformer(tiny_cfg(), 5, 2).eval()
    assert torch.equal(default(**changed(w, "rtg", ..., 7.0)), default(**w))


def test_reward_input_rtg_evaluates_with_the_target(tiny_hopper):
    d = data.load_data(tiny_hopper)
    cfg = tiny_cfg(context=5, reward_input="rtg", target_return=1234.0)
    assert sf.targets(cfg, d) == [1234.0]
    assert sf.targets(tiny_cfg(reward_input="rtg"), d) == d.target_returns
    torch.manual_seed(0)
    model = sf.StARformer(cfg, d.obs_dim, d.act_dim).eval()
    act, first = sf.policy(model, cfg), {}

    def recording_act(batch, live):
        a = act(batch, live)
        first.setdefault("rtg", float(batch["rtg"][0, -1, 0]))
        first.setdefault("action", a[0].clone())
        first.setdefault("batch", batch)
        return a

    evaluate.evaluate(recording_act, d, 1, sf.targets(cfg, d)[0], seed=7, context=5, progress=False)
    assert first["rtg"] == pytest.approx(1234.0 * d.return_scale)
    other = dict(first["batch"], rtg=torch.zeros_like(first["batch"]["rtg"]))   # the model reads the target
    assert (act(other, None)[0] - first["action"]).abs().max() > 1e-5


# ---------------------------------------------------------------------------------------------------------------
# image (Atari) variant: random frames, shapes and causality

def test_image_variant_shapes_and_causality():
    torch.manual_seed(4)
    cfg = tiny_cfg(context=3, patch_size=7)
    n_actions, B, T = 4, 2, 3
    model = sf.StARformer(cfg, (4, 84, 84), n_actions, discrete=True).eval()
    w = dict(states=torch.randint(0, 256, (B, T, 4, 84, 84), dtype=torch.uint8),
             actions=torch.randint(0, n_actions, (B, T)),
             rewards=torch.zeros(B, T, 1), rtg=torch.zeros(B, T, 1), timesteps=torch.arange(T).repeat(B, 1),
             mask=torch.ones(B, T), prev_action=torch.zeros(B, dtype=torch.long), prev_reward=torch.zeros(B, 1))
    logits = model(**w)
    assert logits.shape == (B, T, n_actions)
    assert model.e_spatial.shape == (144, cfg.step_embd)                 # (84/7)^2 patch tokens
    assert model.blocks[0].fc.in_features == (144 + 2) * cfg.step_embd
    w2 = dict(w, states=w["states"].clone())
    w2["states"][:, 2] = 255 - w2["states"][:, 2]
    logits2 = model(**w2)
    assert torch.allclose(logits[:, :2], logits2[:, :2], atol=1e-6)
    assert (logits[:, 2] - logits2[:, 2]).abs().max() > 1e-5
    # the null action is the extra index |A| at the episode's first step: a_{-1} given there changes nothing
    assert torch.equal(model(**dict(w, prev_action=torch.full((B,), 3))), logits)
    # a frame change reaches both token paths: patch tokens (Step) and the conv token (Sequence)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, n_actions), w["actions"].reshape(-1))
    loss.backward()
    assert model.embed_patch.weight.grad.abs().sum() > 0 and model.embed_state.fc[0].weight.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------------
# learning

@pytest.mark.slow
def test_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = sf.StARformer(tiny_cfg(n_embd=32, step_embd=8), 5, 2)
    w = window(B=4)
    w["mask"][0, :2] = 0
    w["timesteps"][0] = torch.tensor([0, 0, 0, 1, 2, 3])
    opt = torch.optim.AdamW(model.optim_groups(0.0), lr=3e-3)
    first = None
    for i in range(300):
        loss = sf.loss_fn(model, w, None)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02 * first, (first, loss.item())


def test_weight_decay_only_on_linear_and_conv_weights():
    model = sf.StARformer(tiny_cfg(), (4, 84, 84), 4, discrete=True)
    decay, no_decay = model.optim_groups(0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(names[id(p)].endswith("weight") and "ln" not in names[id(p)] for p in decay["params"])
    assert {"e_spatial", "e_temporal", "embed_action.weight", "ln_f.weight"} <= {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


# ---------------------------------------------------------------------------------------------------------------
# training and evaluation feed r_{t-1} the same way (checked against the dataset and a replayed env)

def test_training_windows_feed_previous_reward_and_action(tiny_hopper):
    d = data.load_data(tiny_hopper)
    K = 8
    ep = int(np.argmax([len(e["rewards"]) for e in d.episodes]))      # the longest episode
    start = int(d.ep_start[ep])
    T = len(d.episodes[ep]["rewards"])
    assert T > K + 6
    ends = np.array([start + 2, start + K + 5, start + T - 1])       # padded, mid-episode, last step
    b = data.gather_windows(d.flat, np.full(3, start), ends, K)
    pa, pr = sf.step_inputs(b["actions"], b["rewards"], b["timesteps"], b["prev_action"], b["prev_reward"])
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
    d = data.load_data(tiny_hopper)
    torch.manual_seed(0)
    cfg = tiny_cfg(context=5)
    act = sf.policy(sf.StARformer(cfg, d.obs_dim, d.act_dim).eval(), cfg)
    fed, taken = [], []

    def recording_act(batch, live):
        pa, pr = sf.step_inputs(batch["actions"], batch["rewards"], batch["timesteps"], batch["prev_action"],
                                batch["prev_reward"])
        fed.append((pa[0, -1].clone(), float(pr[0, -1, 0])))
        a = act(batch, live)
        taken.append(a[0].numpy().copy())
        return a

    res = evaluate.evaluate(recording_act, d, 1, sf.targets(cfg, d)[0], seed=7, context=5, progress=False)
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

TINY = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--step-embd", "8", "--step-head", "2", "--context", "4",
        "--batch-size", "8", "--eval-episodes", "2", "--log-every", "5", "--warmup-steps", "5"]


def run_cli(args, out):
    sf.main([*TINY, "--out", str(out), *args])


def final_line(capsys):
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final:")]
    assert len(lines) == 1
    return lines[0]


def log_rows(out):
    with open(os.path.join(out, "log.csv")) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_cli_run_writes_outputs(tiny_hopper, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--steps", "10", "--eval-every", "5"], tmp_path)
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=2")
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png"):
        assert os.path.getsize(tmp_path / f) > 0
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["dataset_id"] == tiny_hopper and ck["state_mean"].shape == (11,)
    rows = log_rows(tmp_path)
    assert len([r for r in rows if r["eval_return"]]) == 2 and len([r for r in rows if r["loss"]]) == 2
    cfg = json.load(open(tmp_path / "config.json"))
    assert cfg["steps"] == 10 and cfg["target_return"] is None and cfg["reward_input"] == "reward"


@pytest.mark.slow
def test_cli_rtg_run_evaluates_its_target(tiny_hopper, tmp_path, capsys):
    """Table 2 through the command line: the evaluation rows carry --target-return."""
    run_cli(["--dataset", tiny_hopper, "--steps", "5", "--eval-every", "5", "--reward-input", "rtg",
             "--target-return", "1234"], tmp_path)
    final_line(capsys)
    assert [r["target"] for r in log_rows(tmp_path) if r["eval_return"]] == ["1234"]


@pytest.mark.slow
def test_cli_maze_reports_success(tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_maze, "--steps", "5", "--eval-every", "5"], tmp_path)
    final_line(capsys)
    rows = [r for r in log_rows(tmp_path) if r["eval_return"]]
    assert rows and rows[0]["success_rate"] != "" and float(rows[0]["steps_to_goal"]) <= 40


@pytest.mark.slow
def test_resume_gives_identical_weights(tiny_hopper, tmp_path, capsys):
    common = ["--dataset", tiny_hopper, "--eval-every", "1000", "--eval-episodes", "1", "--seed", "3",
              "--dropout", "0.1"]           # dropout on: the torch RNG state must be restored too
    run_cli(common + ["--steps", "12"], tmp_path / "straight")
    run_cli(common + ["--steps", "6"], tmp_path / "split")
    sf.main(["--out", str(tmp_path / "split"), "--resume", "--steps", "12"])   # the run's settings from its checkpoint
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 12
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_flags_presets_and_bad_input(tiny_hopper, tmp_path, capsys):
    cfg = sf.parse_flags(["--preset", "cpu", "--n-embd", "48"])[0]
    assert cfg.n_embd == 48 and cfg.n_layer == sf.PRESETS["cpu"]["n_layer"] and cfg.steps == 6000 and cfg.lr_decay
    assert sf.parse_flags([])[0].n_embd == 192 and sf.parse_flags(["--preset", "code"])[0].n_embd == 128
    assert evaluate.variant_name(sf.parse_flags(["--no-reward-token"])[0], sf.PRESETS) == "no-reward-token"
    for bad, word in ((["--context", "0"], "--context"), (["--n-embd", "20", "--n-head", "3"], "--n-head"),
                      (["--step-embd", "8", "--step-head", "3"], "--step-head"), (["--step-embd", "0"], "--step-embd"),
                      (["--patch-size", "0"], "--patch-size"), (["--reward-scale", "0"], "--reward-scale"),
                      (["--reward-input", "returns"], "--reward-input"),
                      (["--target-return", "3600"], "--target-return"),   # r_{t-1} input: there is no target to set
                      (["--no-reward-token", "--reward-input", "rtg"], "--no-reward-token"),
                      (["--state-token", "vit"], "--state-token"), (["--connection", "tower"], "--connection"),
                      (["--state-mlp", "--state-token", "none"], "--state-mlp"),
                      (["--env", "no-such-env"], "no-such-env")):
        with pytest.raises(SystemExit) as e:
            run_cli(["--steps", "1", *bad] if "--env" in bad else ["--dataset", tiny_hopper, *bad], tmp_path / "x")
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("error:") and len(err.splitlines()) == 1 and word in err, err


# ---------------------------------------------------------------------------------------------------------------
# Atari: the image model on real Breakout frames (tiny_breakout) and on random uint8 frames

VARIANTS = [("conv", "layerwise"), ("none", "layerwise"), ("patch", "layerwise"), ("conv", "fusion"),
            ("none", "fusion"), ("patch", "fusion"), ("conv", "stack"), ("none", "stack"), ("patch", "stack")]


def atari_window(B=2, T=5, t0=7, n_actions=4, seed=0):
    """A data.py-style Atari window of T real steps from episode step t0: uint8 frame stacks, int64 actions."""
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randint(0, 256, (B, T, 4, 84, 84), generator=g, dtype=torch.uint8),
                actions=torch.randint(0, n_actions, (B, T), generator=g),
                rewards=torch.randint(0, 2, (B, T, 1), generator=g).float(), rtg=torch.randn(B, T, 1, generator=g) * 5,
                timesteps=torch.arange(t0, t0 + T).repeat(B, 1), mask=torch.ones(B, T),
                prev_action=torch.randint(0, n_actions, (B,), generator=g), prev_reward=torch.ones(B, 1))


def atari_model(T=5, **kw):
    torch.manual_seed(0)
    return sf.StARformer(tiny_cfg(context=T, **kw), (4, 84, 84), 4, discrete=True).eval()


def image_count_by_hand(A, L, D, d, T, state_token="conv", connection="layerwise", reward=True, p=7):
    """The image model's parameters written out from the paper's description (and the official code's modules for
    the ablations), independent of the module code. 4x84x84 frames, p x p patches."""
    block = lambda w: 2 * (2 * w) + (3 * w * w + 3 * w) + (w * w + w) + (4 * w * w + 4 * w) + (4 * w * w + w)
    n_state, patch_dim = (84 // p) ** 2, 4 * p * p
    n = n_state + 1 + reward                                                # a, (r), the patches
    embed = (patch_dim * d + d) + n_state * d + (A + 1) * d + reward * (d + d)  # FC_patch, e_spatial, a (+ null), r
    conv = (4 * 32 * 8 * 8 + 32) + (32 * 64 * 4 * 4 + 64) + (64 * 64 * 3 * 3 + 64) + (64 * 7 * 7 * D + D)  # DQN torso
    vit = (patch_dim * d + d) + (n_state * d * D + D)                       # a second patch FC, flatten, FC to D
    h0 = dict(conv=conv, none=0, patch=vit)[state_token]
    star = 2 * d + (n * d * D + D) + 2 * D                                  # LN, FC_l, LN
    projections = 1 if connection == "stack" else L                         # Stack: g^L only
    return embed + h0 + T * D + L * (block(d) + block(D)) + projections * star + 2 * D + (D * A + A)


@pytest.mark.parametrize("state_token,connection", VARIANTS)
def test_image_parameter_count_matches_hand_count(state_token, connection):
    for reward in (True, False):
        cfg = sf.Config(context=30, state_token=state_token, connection=connection, reward_token=reward)
        n = sum(p.numel() for p in sf.StARformer(cfg, (4, 84, 84), 4, discrete=True).parameters())
        assert n == image_count_by_hand(4, 6, 192, 64, 30, state_token, connection, reward), (reward, n)
    if (state_token, connection) == ("conv", "layerwise"):
        assert n + 6 * 64 * 192 + 2 * 64 == 14_447_076                     # Sec. 5.4: "~14M" (offline RL, |A| = 4)


def test_vector_ablation_parameter_counts():
    """On vectors: 'none' drops FC(s_t) (C D + D), 'patch' trades it for a per-dimension FC and FC(C d -> D), 'stack'
    keeps one StAR projection of L."""
    C, A, L, D, d = 11, 3, 3, 32, 8
    count = lambda **kw: sum(p.numel() for p in sf.StARformer(sf.Config(n_layer=L, n_embd=D, n_head=2, step_embd=d,
                                                                          step_head=2, **kw), C, A).parameters())
    base = count()
    assert base == count_by_hand(C, A, L, D, d)
    assert base - count(state_token="none") == C * D + D
    assert count(state_token="patch") - base == (1 * d + d) + (C * d * D + D) - (C * D + D)
    assert count(connection="fusion") == base
    assert base - count(connection="stack") == (L - 1) * (2 * d + (C + 2) * d * D + D + 2 * D)


@pytest.mark.parametrize("state_token,connection", VARIANTS)
@pytest.mark.parametrize("reward_input", ["reward", "rtg"])
def test_image_model_is_causal(state_token, connection, reward_input):
    """Frames s_{>=j}, actions and rewards a_{>=j-1}, r_{>=j-1} (group j holds a_{j-1}, r_{j-1}) and R_{>=j} (Table 2)
    changed: the logits before step j stay put, and the change reaches step j."""
    T = 5
    model = atari_model(T, state_token=state_token, connection=connection, reward_input=reward_input)
    w = atari_window(T=T)
    with torch.no_grad():
        base = model(**w)
        assert base.shape == (2, T, 4)
        for j in range(1, T):
            c = {k: v.clone() for k, v in w.items()}
            c["states"][:, j:] = 255 - c["states"][:, j:]
            c["actions"][:, j - 1:] = (c["actions"][:, j - 1:] + 1) % 4
            c["rewards"][:, j - 1:] += 30.0
            c["rtg"][:, j:] -= 30.0
            out = model(**c)
            assert (out[:, :j] - base[:, :j]).abs().max() < 1e-6, j
            assert (out[:, j] - base[:, j]).abs().max() > 1e-5, j
        # each kind alone: s_2 reaches step 2 and a_2 (and r_2) step 3 first
        for key, t, first in (("states", 2, 2), ("actions", 2, 3), ("rewards" if reward_input == "reward" else "rtg",
                                                                      2, 3 if reward_input == "reward" else 2)):
            c = {k: v.clone() for k, v in w.items()}
            c[key][:, t] = 255 - c[key][:, t] if key == "states" else (c[key][:, t] + 1) % 4 if key == "actions" \
                else c[key][:, t] + 30.0
            d = (model(**c) - base).abs().amax(dim=(0, 2))
            assert d[:first].max() < 1e-6 and d[first] > 1e-5, (key, d)
        c = {k: v.clone() for k, v in w.items()}
        c["actions"][:, -1] = (c["actions"][:, -1] + 2) % 4       # a_t never informs its own prediction
        assert torch.allclose(model(**c), base, atol=1e-6)


@pytest.mark.parametrize("state_token,connection", VARIANTS)
def test_image_model_left_padding_equals_the_unpadded_window(state_token, connection):
    model = atari_model(6, state_token=state_token, connection=connection)
    w = atari_window(T=4, t0=0)                                           # an episode's first 4 steps
    ref = model(**w)
    g = torch.Generator().manual_seed(3)
    wp = {k: torch.cat([torch.randint(0, 200, (2, 2, *v.shape[2:]), generator=g).to(v.dtype), v], 1)   # garbage
          for k, v in w.items() if k in ("states", "actions", "rewards", "rtg")}
    wp.update(timesteps=torch.cat([torch.zeros(2, 2, dtype=torch.long), w["timesteps"]], 1),
              mask=torch.cat([torch.zeros(2, 2), w["mask"]], 1), prev_action=torch.tensor([1, 3]),
              prev_reward=torch.ones(2, 1))
    assert torch.allclose(model(**wp)[:, 2:], ref, atol=1e-5)


@pytest.mark.parametrize("state_token,connection", VARIANTS)
def test_ablations_wire_the_sequence_transformer_as_named(state_token, connection):
    """Each Sequence layer's input, recorded by hooks, against what the flag names: layer-wise (Eq. 2) g^l interleaved
    with h^{l-1}; Fusion h^{l-1} + g^l; Stack g^L (beside h^0) into the first layer, the previous layer's output into
    the others; 'none' no h^0 (0); 'patch' h^0 from the second patch embedding. g^l = star(Z^l) from the recorded
    Step outputs Z^l; h^0 computed here from the frames."""
    T, B = 4, 2
    model = atari_model(T, state_token=state_token, connection=connection, n_layer=3)
    w = atari_window(B=B, T=T)
    Zs, seq_in, seq_out = [], [], []
    for blk in model.blocks:
        blk.step.register_forward_hook(lambda m, a, out: Zs.append(out.reshape(B, T, *out.shape[1:])))
        blk.seq.register_forward_pre_hook(lambda m, a: seq_in.append(a[0]))
        blk.seq.register_forward_hook(lambda m, a, out: seq_out.append(out))
    with torch.no_grad():
        model(**w)
        x = w["states"].float() / 255
        e = model.e_temporal[:T].expand(B, T, -1)
        h0 = {"none": lambda: torch.zeros(B, T, 16),
              "conv": lambda: model.embed_state(x) + e,
              "patch": lambda: model.embed_state(model.patches(x)) + e}[state_token]()
        interleave = lambda g, h: torch.stack([g, h], 2).flatten(1, 2)
        L = 3
        for l in range(L):
            if connection == "stack":
                g = model.blocks[-1].star(Zs[-1], e)                          # the last Step layer only
                want = (interleave(g, h0) if state_token != "none" else g) if l == 0 else seq_out[l - 1]
            else:
                g = model.blocks[l].star(Zs[l], e)
                h = h0 if l == 0 else seq_out[l - 1] if seq_out[l - 1].shape[1] == T else seq_out[l - 1][:, 1::2]
                want = h + g if connection == "fusion" or state_token == "none" else interleave(g, h)
            assert torch.allclose(seq_in[l], want, atol=1e-5), l
        assert not hasattr(model, "embed_state") if state_token == "none" else True
        projecting = [hasattr(b, "fc") for b in model.blocks]
        assert projecting == ([False, False, True] if connection == "stack" else [True] * 3)


def test_null_action_at_an_episode_start_is_the_extra_index(tiny_breakout):
    """data.py gives a_{-1} = 0 at an episode's first step, which on Atari is NOOP, a real action. Group 1 must hold
    the null action |A| instead (A.2): step_inputs makes it so, and the model's output at an episode start equals the
    output mid-episode with a_{t-1} = NOOP once the embedding row of NOOP is set to the null row."""
    d = data.load_data(tiny_breakout)
    start = int(d.ep_start[1])
    b = data.gather_windows(d.flat, np.array([start, start]), np.array([start + 1, start + 9]), 4)   # padded, inside
    assert b["prev_action"].tolist() == [0, int(d.flat["actions"][start + 5])] and b["mask"][0].tolist() == [0, 0, 1, 1]
    pa, pr = sf.step_inputs(b["actions"], b["rewards"], b["timesteps"], b["prev_action"], b["prev_reward"], 4)
    assert pa[0, 2:].tolist() == [4, int(d.flat["actions"][start])] and pr[0, 2, 0] == 0    # null index |A| = 4
    assert pa[1].tolist() == d.flat["actions"][start + 5:start + 9].tolist()               # real a_{t-1} elsewhere
    model = atari_model(4)
    w = atari_window(B=2, T=4, t0=0, seed=4)                     # an episode's first 4 steps
    w["prev_action"] = torch.zeros(2, dtype=torch.long)          # data.py's null value, NOOP's index
    w["prev_reward"] = torch.zeros(2, 1)                         # (r_0 = 0 either way)
    at_start = model(**w)
    mid = dict(w, timesteps=w["timesteps"] + 10)                 # the same inputs, labelled mid-episode
    assert (model(**mid)[:, 0] - at_start[:, 0]).abs().max() > 1e-4   # a_0 is not NOOP...
    with torch.no_grad():
        model.embed_action.weight[0] = model.embed_action.weight[4]
    assert torch.allclose(model(**mid)[:, 0], at_start[:, 0], atol=1e-6)   # ...it is row |A| of the action table


def test_cross_entropy_on_the_logits_over_real_steps_only():
    """sf.loss_fn on int64 actions: the mean of -log softmax(logits)[a] over the unpadded steps, by hand (Sec. 3.4)."""
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]], [[0.0, 3.0, 0.0], [1.0, -2.0, 4.0]]])   # (2, 2, 3)

    class Fixed(torch.nn.Module):
        def forward(self, *args):
            return logits

    batch = dict(states=None, actions=torch.tensor([[0, 2], [1, 1]]), rewards=None, rtg=None, timesteps=None,
                 mask=torch.tensor([[0.0, 1.0], [1.0, 1.0]]), prev_action=None, prev_reward=None)  # row 0: 1 padded

    def nll(z, a):
        z = np.array(z, np.float64)
        return np.log(np.exp(z).sum()) - z[a]
    want = (nll([0.5, 0.5, 0.5], 2) + nll([0.0, 3.0, 0.0], 1) + nll([1.0, -2.0, 4.0], 1)) / 3
    assert abs(sf.loss_fn(Fixed(), batch, None).item() - want) < 1e-6


def test_atari_presets_are_table_6_and_the_classroom_model(tiny_breakout):
    cfg, _ = sf.parse_flags(["--dataset", tiny_breakout])
    assert (cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.step_embd, cfg.step_head, cfg.dropout, cfg.lr, cfg.weight_decay,
            cfg.grad_clip, cfg.context, cfg.batch_size, cfg.patch_size) == (6, 192, 8, 64, 4, 0.1, 6e-4, 0.1, 1.0, 30,
                                                                            64, 7)
    assert (cfg.steps, cfg.eval_every, cfg.eval_episodes, cfg.lr_decay, cfg.warmup_steps) == (78_130, 7_813, 10, True,
                                                                                              6)
    assert evaluate.variant_name(cfg, sf.PRESETS) == "default"
    cfg, _ = sf.parse_flags(["--dataset", tiny_breakout, "--preset", "cpu"])
    assert all(getattr(cfg, k) == v for k, v in sf.PRESETS["cpu"]["atari"].items())
    assert cfg.weight_decay == 0.1 and cfg.grad_clip == 1.0                          # the paper's, under the preset
    assert evaluate.variant_name(cfg, sf.PRESETS) == "cpu"
    cfg, _ = sf.parse_flags(["--dataset", tiny_breakout, "--preset", "cpu", "--connection", "fusion",
                             "--state-token", "none"])
    assert evaluate.variant_name(cfg, sf.PRESETS) == "cpu_state-tokennone_connectionfusion"
    # the classroom model reads R_t (Table 2's variant) and is prompted with DT's target; its imitation run has no
    # reward slot, so the preset's rtg is no error there and no target is logged, while an explicit rtg still is one
    d = data.load_data(tiny_breakout)
    cfg, _ = sf.parse_flags(["--dataset", tiny_breakout, "--preset", "cpu"])
    assert cfg.reward_input == "rtg" and sf.targets(cfg, d) == d.target_returns != [None]
    cfg, given = sf.parse_flags(["--dataset", tiny_breakout, "--preset", "cpu", "--no-reward-token"])
    sf.paper_settings(cfg, given)
    assert sf.targets(cfg, d) == [None] and evaluate.variant_name(cfg, sf.PRESETS) == "cpu_no-reward-token"
    for bad in (["--no-reward-token", "--reward-input", "rtg"], ["--preset", "cpu", "--no-reward-token",
                                                                "--target-return", "50"]):
        with pytest.raises(data.DataError, match="reward token"):
            sf.paper_settings(*sf.parse_flags(["--dataset", tiny_breakout, *bad]))
    hopper = sf.parse_flags(["--env", "hopper-medium"])[0]                           # vectors keep the gym setting
    assert (hopper.lr, hopper.context, hopper.weight_decay) == (1e-4, 20, 1e-4)


TINY_ATARI = [*TINY, "--eval-episodes", "1", "--dropout", "0.1"]


@pytest.mark.parametrize("extra", [[], ["--reward-input", "rtg"],
                                   ["--state-token", "patch", "--connection", "fusion"],
                                   ["--state-token", "none", "--connection", "stack", "--no-reward-token"]])
@pytest.mark.slow
def test_cli_atari_run(extra, tiny_breakout, tmp_path, capsys):
    """Train a few steps on real Breakout frames with cross-entropy, evaluate one episode in ALE, the final line."""
    out = tmp_path / "run"
    sf.main(["--dataset", tiny_breakout, *TINY_ATARI, "--steps", "6", "--eval-every", "6", "--out", str(out), *extra])
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=1")
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["step"] == 6 and ck["info"]["discrete"] and ck["info"]["obs_shape"] == [4, 84, 84]
    assert ck["model"]["embed_action.weight"].shape == (4 + 1, 8)                   # |A| actions + the null action
    assert ("embed_state.conv.0.weight" in ck["model"]) == ("--state-token" not in extra)
    rows = [r for r in log_rows(out) if r["eval_return"]]
    assert len(rows) == 1 and rows[0]["target"] == ("90" if "rtg" in extra else "")   # DT's Breakout target (Table 2)
    assert float(rows[0]["eval_return"]) >= 0


def test_greedy_reaches_the_rollouts(tiny_breakout, monkeypatch):
    """--greedy: evaluate() takes the argmax of the logits (its own test in test_atari.py); the flag must reach it."""
    d = data.load_data(tiny_breakout)
    seen = []
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **kw: seen.append(kw["greedy"]) or {})
    for greedy in (False, True):
        sf.evaluate(atari_model(4), d, tiny_cfg(context=4, greedy=greedy), "cpu")
    assert seen == [False, True]


@pytest.mark.slow
def test_atari_resume_refuses_another_ablation(tiny_breakout, tmp_path, capsys):
    args = ["--dataset", tiny_breakout, *TINY_ATARI, "--steps", "2", "--eval-every", "2", "--out", str(tmp_path)]
    sf.main(args)
    capsys.readouterr()
    for flag, said in ((["--connection", "stack"], "--connection layerwise there, stack here"),
                       (["--state-token", "none"], "--state-token conv there, none here")):
        with pytest.raises(SystemExit) as e:
            sf.main(args + ["--resume", "--steps", "4", *flag])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("error:") and said in err, err
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 2
    sf.main(["--out", str(tmp_path), "--resume", "--steps", "4", "--eval-every", "4"])   # the run's own settings
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 4


@pytest.mark.slow
def test_atari_interrupt_then_resume_is_bit_identical(tiny_breakout, tmp_path):
    from test_harness import interrupt_resume_equals_straight
    interrupt_resume_equals_straight("starformer", ["--dataset", tiny_breakout, *TINY_ATARI, "--steps", 60,
                                                    "--eval-every", 30, "--log-every", 10, "--seed", 2,
                                                    "--connection", "fusion"], 60, tmp_path)


@pytest.mark.slow
def test_atari_gif_reads_the_run(tiny_breakout, tmp_path, capsys):
    from PIL import Image
    out = tmp_path / "run"
    sf.main(["--dataset", tiny_breakout, *TINY_ATARI, "--steps", "2", "--eval-every", "2", "--out", str(out)])
    sf.main(["--out", str(out), "--gif"])
    assert "episode.gif:" in capsys.readouterr().out
    assert Image.open(out / "episode.gif").n_frames > 10
