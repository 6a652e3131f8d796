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
    act, first = sf.policy(model), {}

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
    w = dict(states=torch.rand(B, T, 4, 84, 84), actions=torch.randint(0, n_actions, (B, T)),
             rewards=torch.zeros(B, T, 1), rtg=torch.zeros(B, T, 1), timesteps=torch.arange(T).repeat(B, 1),
             mask=torch.ones(B, T), prev_action=torch.zeros(B, dtype=torch.long), prev_reward=torch.zeros(B, 1))
    logits = model(**w)
    assert logits.shape == (B, T, n_actions)
    assert model.e_spatial.shape == (144, cfg.step_embd)                 # (84/7)^2 patch tokens
    assert model.blocks[0].fc.in_features == (144 + 2) * cfg.step_embd
    w2 = dict(w, states=w["states"].clone())
    w2["states"][:, 2] = torch.rand(B, 4, 84, 84)
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
    act = sf.policy(sf.StARformer(cfg, d.obs_dim, d.act_dim).eval())
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


def test_cli_rtg_run_evaluates_its_target(tiny_hopper, tmp_path, capsys):
    """Table 2 through the command line: the evaluation rows carry --target-return."""
    run_cli(["--dataset", tiny_hopper, "--steps", "5", "--eval-every", "5", "--reward-input", "rtg",
             "--target-return", "1234"], tmp_path)
    final_line(capsys)
    assert [r["target"] for r in log_rows(tmp_path) if r["eval_return"]] == ["1234"]


def test_cli_maze_reports_success(tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_maze, "--steps", "5", "--eval-every", "5"], tmp_path)
    final_line(capsys)
    rows = [r for r in log_rows(tmp_path) if r["eval_return"]]
    assert rows and rows[0]["success_rate"] != "" and float(rows[0]["steps_to_goal"]) <= 40


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
                      (["--env", "no-such-env"], "no-such-env")):
        with pytest.raises(SystemExit) as e:
            run_cli(["--steps", "1", *bad] if "--env" in bad else ["--dataset", tiny_hopper, *bad], tmp_path / "x")
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("error:") and len(err.splitlines()) == 1 and word in err, err
