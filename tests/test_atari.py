"""Atari: image states (the last 4 of the 84x84 frames, uint8) and discrete actions, from data.py's windows to
evaluate.py's rollouts in ALE, and DT's Atari model in dt.py. Every dataset here is the tiny one conftest.py writes
from real Breakout frames; nothing reads ../shared or the network."""
import os
import sys

import numpy as np
import pytest
import torch

import data
import dt
import evaluate as ev
from test_harness import interrupt_resume_equals_straight, one_sentence_exit_1, snapshot

TINY_DT = ["--n-embd", "16", "--n-layer", "1", "--n-head", "2", "--context", "4", "--batch-size", "8",
           "--warmup-steps", "2", "--eval-episodes", "1"]


def expected_stack(frames, u):
    """The state at step u of an episode, written out from the rule: frames u-3 .. u, 0 for those before step 0."""
    return np.stack([frames[v] if v >= 0 else np.zeros_like(frames[0]) for v in range(u - 3, u + 1)])


@pytest.mark.slow
def test_frames_are_stacked_when_a_batch_is_drawn_with_zeros_before_the_episode(tiny_breakout):
    d = data.load_data(tiny_breakout)
    assert d.family == "atari" and d.discrete and d.n_actions == 4 and d.obs_shape == (4, 84, 84)
    assert d.flat["frames"].shape == (sum(len(e["actions"]) for e in d.episodes), 84, 84)   # one frame a step
    assert d.flat["frames"].dtype == np.uint8 and d.flat["actions"].dtype == np.int64
    e, start, K = d.episodes[2], d.ep_start[2], 6
    frames = e["observations"]
    for t in (0, 1, 2, 3, 4, 9):          # windows ending at the episode's first steps and past them
        b = data.gather_windows(d.flat, np.array([start]), np.array([start + t]), K)
        assert b["states"].dtype == torch.uint8 and b["states"].shape == (1, K, 4, 84, 84)
        for k in range(K):
            u = t - (K - 1) + k                                                 # the step at position k
            want = expected_stack(frames, u) if u >= 0 else np.zeros((4, 84, 84), np.uint8)
            assert np.array_equal(b["states"][0, k].numpy(), want), (t, k)
            assert b["actions"][0, k].item() == (e["actions"][u] if u >= 0 else 0)
        assert b["prev_action"].dtype == torch.int64
        assert b["prev_action"].item() == (e["actions"][t - K] if t >= K else 0)     # null action 0 at t0 = 0
    assert (frames[:4] != frames[0]).any(), "the test needs frames that differ"


@pytest.mark.slow
def test_evaluation_feeds_the_windows_training_cuts_from_the_same_episode(tiny_breakout):
    """evaluate() keeps only a ring of recent steps per env; the contexts it hands the policy at every step must equal
    the windows gather_windows cuts from a dataset made of that very episode (frames, actions, timesteps, mask)."""
    d = data.load_data(tiny_breakout)
    K, seen = 5, []
    gen = torch.Generator().manual_seed(0)

    def act(batch, live):
        seen.append({k: v[0].clone() for k, v in batch.items()})
        return torch.randn(len(live), d.act_dim, generator=gen) * 3

    res = ev.evaluate(act, d, 1, 90, seed=3, context=K, progress=False)
    T = int(res["lengths"][0])
    assert T == len(seen) and T > 3 * (K + 4), "the episode must outlast the ring several times over"
    frames = np.stack([s["states"][-1, -1].numpy() for s in seen])            # s_t: the newest frame at step t
    actions = np.array([s["actions"][-2].item() for s in seen[1:]])           # a_t, seen one step later
    ep = dict(observations=frames[:-1], actions=actions, rewards=np.zeros(T - 1, np.float32), terminated=False)
    replay = data.OfflineData(dataset_id="replay", family="atari", episodes=[ep], env_spec=None, n_actions=4,
                              max_ep_len=d.max_ep_len)
    for t in range(T - 1):
        b = data.gather_windows(replay.flat, np.array([0]), np.array([t]), K)
        b["timesteps"] = b["timesteps"].clamp(max=d.max_ep_len - 1)   # evaluation's timesteps stop at the data's last
        for key in ("states", "timesteps", "mask", "prev_action"):
            assert torch.equal(b[key][0], seen[t][key]), (t, key)
        assert torch.equal(b["actions"][0, :-1], seen[t]["actions"][:-1]), t     # a_t is not known yet at step t
        assert seen[t]["actions"][-1].item() == 0


@pytest.mark.slow
def test_batched_atari_evaluation_equals_the_sequential_reference(tiny_breakout):
    """Sampled actions from a policy that reads the stacked frames and the last action: the batched, ring-buffered
    path and the one-episode-at-a-time reference (its own stacking, from lists) play the same games."""
    d = data.load_data(tiny_breakout)
    d.horizon = 400   # a greedy policy that never presses FIRE would wait out the 27k steps of the frame limit
    w = torch.tensor([[0.9, -0.4, 0.2, 0.0], [0.1, 0.5, -0.7, 0.3], [-0.2, 0.1, 0.4, -0.6], [0.3, 0.0, -0.1, 0.2]])

    def act(batch, live):
        s = batch["states"][:, -1].float().mean((-1, -2)) / 8                   # (L, 4) brightness of the 4 frames
        return s @ w + torch.nn.functional.one_hot(batch["actions"][:, -2], 4) * 0.5

    for greedy in (False, True):
        a = ev.evaluate(act, d, 2, 90, seed=5, context=3, progress=False, greedy=greedy)
        b = ev.evaluate_sequential(act, d, 2, 90, seed=5, context=3, greedy=greedy)
        assert np.array_equal(a["returns"], b["returns"]) and np.array_equal(a["lengths"], b["lengths"]), greedy
        assert a["lengths"].min() > 3 * (3 + 4), "the episodes must outlast the ring several times over"


def test_actions_are_drawn_from_the_softmax_or_taken_greedily():
    logits = np.array([1.0, 0.0, -1.0, 2.0], np.float32)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    rng = np.random.default_rng(0)
    counts = np.bincount([ev.choose(logits, rng, False) for _ in range(20_000)], minlength=4) / 20_000
    assert np.abs(counts - p).max() < 0.015, (counts, p)
    assert ev.choose(logits, rng, True) == 3


def test_cross_entropy_on_the_logits_over_real_steps_only():
    """dt.loss_fn on discrete actions: the mean of -log softmax(logits)[a] over the unpadded steps, by hand."""
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.5, 0.5]], [[0.0, 3.0, 0.0], [1.0, -2.0, 4.0]]])   # (2, 2, 3)

    class Fixed(torch.nn.Module):
        def forward(self, states, actions, rtg, timesteps, mask):
            return logits

    batch = dict(states=None, actions=torch.tensor([[0, 2], [1, 1]]), rtg=None, timesteps=None,
                 mask=torch.tensor([[0.0, 1.0], [1.0, 1.0]]))                  # the first step of row 0 is padding
    loss = dt.loss_fn(Fixed(), batch, None)

    def nll(z, a):
        z = np.array(z, np.float64)
        return np.log(np.exp(z).sum()) - z[a]
    want = (nll([0.5, 0.5, 0.5], 2) + nll([0.0, 3.0, 0.0], 1) + nll([1.0, -2.0, 4.0], 1)) / 3
    assert abs(loss.item() - want) < 1e-6


def tiny_atari_model(return_token=True):
    torch.manual_seed(0)
    cfg = dt.DTConfig(n_embd=16, n_layer=2, n_head=2, context=4, dropout=0.0, return_token=return_token)
    return dt.AtariDecisionTransformer(cfg, n_actions=4, max_ep_len=50).eval()


@pytest.mark.parametrize("return_token", [True, False])
def test_atari_model_is_causal_and_blind_to_padding(return_token):
    model = tiny_atari_model(return_token)
    g = torch.Generator().manual_seed(1)
    B, K = 2, 4
    b = dict(states=torch.randint(0, 256, (B, K, 4, 84, 84), generator=g, dtype=torch.uint8),
             actions=torch.randint(0, 4, (B, K), generator=g), rtg=torch.randn(B, K, 1, generator=g),
             timesteps=torch.arange(K).repeat(B, 1) + 7, mask=torch.ones(B, K))
    with torch.no_grad():
        base = model(**b)
        assert base.shape == (B, K, 4)
        for j in range(1, K):             # change everything from step j on: the logits before j stay put
            c = {k: v.clone() for k, v in b.items()}
            c["states"][:, j:] = 255 - c["states"][:, j:]
            c["actions"][:, j:] = (c["actions"][:, j:] + 1) % 4
            c["rtg"][:, j:] += 5.0
            out = model(**c)
            assert torch.allclose(out[:, :j], base[:, :j], atol=1e-6), j
            assert not torch.allclose(out[:, j], base[:, j], atol=1e-4), j   # and the change does reach step j
        c = {k: v.clone() for k, v in b.items()}
        c["actions"][:, -1] = (c["actions"][:, -1] + 2) % 4   # a_t itself never informs its own prediction
        assert torch.allclose(model(**c), base, atol=1e-6)
        pad = {k: v.clone() for k, v in b.items()}             # left padding: 2 padded steps, then changed
        pad["mask"][:, :2] = 0
        ref = model(**pad)
        pad["states"][:, :2] = 17
        pad["actions"][:, :2] = 3
        pad["rtg"][:, :2] = -9.0
        assert torch.allclose(model(**pad)[:, 2:], ref[:, 2:], atol=1e-6)


@pytest.mark.slow
def test_dt_picks_its_atari_model_from_the_data_and_its_paper_settings(tiny_breakout, tmp_path, capsys):
    """On Atari data dt.py builds AtariDecisionTransformer with the official code's settings under the flags, trains
    with cross-entropy, evaluates in ALE and names the run 'default' when no flag changes them."""
    cfg, given = dt.parse_flags(["--dataset", tiny_breakout])
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.context, cfg.batch_size, cfg.lr, cfg.beta2, cfg.weight_decay,
            cfg.grad_clip, cfg.eval_episodes) == (6, 8, 128, 30, 128, 6e-4, 0.95, 0.1, 1.0, 10)
    assert ev.variant_name(cfg, dt.PRESETS) == "default"
    cfg, _ = dt.parse_flags(["--dataset", tiny_breakout, "--preset", "cpu", "--context", "3"])
    assert cfg.context == 3 and cfg.weight_decay == 0.1 and cfg.beta2 == 0.95            # flags > preset > paper
    assert ev.variant_name(cfg, dt.PRESETS) == "cpu_context3"
    model = dt.build_model(cfg, dict(discrete=True, act_dim=4, max_ep_len=30, obs_dim=4 * 84 * 84))
    decay, rest = dt.param_groups(model, cfg)
    assert {id(p) for p in rest["params"]} == {id(model.pos_emb), id(model.global_pos_emb)} | {
        id(p) for n, p in model.named_parameters() if n.endswith("bias") or "ln" in n or "embed_action.0" in n}
    assert rest["weight_decay"] == 0.0 and len(decay["params"]) + len(rest["params"]) == len(list(model.parameters()))
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_breakout, *TINY_DT, "--steps", "6", "--eval-every", "6", "--out", str(out)])
    text = capsys.readouterr().out
    assert "final: normalized_score=" in text and "episodes=1" in text
    ck = torch.load(out / "ckpt.pt", weights_only=True)
    assert ck["info"]["discrete"] and ck["info"]["act_dim"] == 4 and "embed_state.0.weight" in ck["model"]


@pytest.mark.slow
def test_atari_interrupt_then_resume_is_bit_identical(tiny_breakout, tmp_path):
    interrupt_resume_equals_straight("dt", ["--dataset", tiny_breakout, *TINY_DT, "--steps", 60, "--eval-every", 30,
                                            "--log-every", 10, "--seed", 2], 60, tmp_path)


@pytest.mark.slow
def test_gif_films_the_game_in_colour(tiny_breakout, tmp_path, capsys):
    from PIL import Image
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_breakout, *TINY_DT, "--steps", "2", "--eval-every", "2", "--out", str(out)])
    before = snapshot(out)
    dt.main(["--out", str(out), "--gif"])
    assert "episode.gif:" in capsys.readouterr().out
    gif = Image.open(out / "episode.gif")
    assert gif.size[0] == 320 and gif.size[1] > 420 and gif.n_frames > 10    # the 210 x 160 screen doubled, words above
    rgb = np.asarray(gif.convert("RGB")).astype(int)
    assert (np.abs(rgb[..., 0] - rgb[..., 1]) > 30).any()                  # colour, not the 84 x 84 grayscale input
    assert {k: v for k, v in snapshot(out).items() if k != "episode.gif"} == before


@pytest.mark.parametrize("script", ["lsdt", "gpt2_dtma"])
def test_model_files_without_an_atari_model_say_so(script, tiny_breakout, tmp_path, capsys):
    import importlib
    from test_harness import TINY
    out = tmp_path / "run"
    err = one_sentence_exit_1(capsys, importlib.import_module(script).main,
                              ["--dataset", tiny_breakout, *TINY[script], "--steps", "2", "--out", str(out)])
    assert "Atari data" in err and "dt.py" in err
    assert not out.exists()


def test_an_atari_env_that_cannot_be_made_is_one_sentence_before_any_folder(tiny_breakout, tmp_path, capsys,
                                                                            monkeypatch):
    monkeypatch.setitem(sys.modules, "ale_py", None)          # as if ale-py were not installed
    out = tmp_path / "run"
    err = one_sentence_exit_1(capsys, dt.main, ["--dataset", tiny_breakout, *TINY_DT, "--steps", "2", "--out",
                                                str(out)])
    assert "pip install ale-py" in err and not out.exists()


@pytest.mark.slow
def test_raw_rgb_frames_get_the_eval_envs_transform(make_dataset):
    """Minari's atari/* layout: 210x160 RGB screens of ALE/<Game>-v5. Loading makes them 84x84 grayscale with the
    same wrappers the eval env gets, so a dataset frame equals the eval env's observation of the same screen."""
    import gymnasium as gym
    import ale_py
    gym.register_envs(ale_py)
    env = gym.make("ALE/Breakout-v5", repeat_action_probability=0.0)
    obs, _ = env.reset(seed=0)
    frames, acts = [obs], []
    for t in range(12):
        obs, *_ = env.step(t % 4)
        frames.append(obs), acts.append(t % 4)
    ep = dict(observations=np.stack(frames), actions=np.array(acts, np.int64), rewards=np.zeros(12),
              terminations=np.zeros(12, bool), truncations=np.arange(12) == 11)
    dataset_id = make_dataset("test/breakout/raw-v0", [ep], env=env, jpeg_encoding=False)
    d = data.load_data(dataset_id)
    assert d.raw_frames and d.flat["frames"].shape == (12, 84, 84) and d.flat["frames"].dtype == np.uint8
    eval_env = d.make_env()
    first, _ = eval_env.reset(seed=0)
    assert first.shape == (84, 84) and np.array_equal(first, d.flat["frames"][0])


def test_patch_state_encoder_is_starformers_patch_embedding_by_hand(capsys):
    """--state-encoder patch (StARformer Table 5): 144 patches of 7x7x4, one shared linear map to 64, a spatial
    table, flattened, linear to the width, tanh; written out here with plain slicing and matrix products."""
    torch.manual_seed(0)
    enc = dt.PatchEncoder(32)
    torch.nn.init.normal_(enc.e_spatial)
    x = torch.rand(2, 4, 84, 84)
    patches = torch.stack([x[:, :, 7 * i:7 * i + 7, 7 * j:7 * j + 7].reshape(2, -1)
                           for i in range(12) for j in range(12)], dim=1)               # (2, 144, 196) row-major
    z = patches @ enc.embed_patch.weight.T + enc.embed_patch.bias + enc.e_spatial      # (2, 144, 64)
    want = torch.tanh(z.reshape(2, -1) @ enc.proj[0].weight.T + enc.proj[0].bias)       # (2, 32)
    assert torch.allclose(enc(x), want, atol=1e-5)
    assert sum(p.numel() for p in enc.parameters()) == (196 * 64 + 64) + 144 * 64 + (144 * 64 * 32 + 32)
    cfg = dt.DTConfig(n_embd=32, n_layer=1, n_head=2, context=3, dropout=0.0, state_encoder="patch")
    model = dt.AtariDecisionTransformer(cfg, n_actions=4, max_ep_len=10).eval()
    b = dict(states=torch.randint(0, 256, (1, 3, 4, 84, 84), dtype=torch.uint8), actions=torch.zeros(1, 3, dtype=torch.long),
             rtg=torch.zeros(1, 3, 1), timesteps=torch.arange(3)[None], mask=torch.ones(1, 3))
    c = {k: v.clone() for k, v in b.items()}
    c["states"][:, 2] = 0
    with torch.no_grad():
        assert torch.allclose(model(**b)[:, :2], model(**c)[:, :2], atol=1e-6)           # causal with patches too
    err = one_sentence_exit_1(capsys, dt.main, ["--state-encoder", "vit", "--steps", "1"])
    assert "--state-encoder" in err


@pytest.mark.slow
def test_analyses_into_a_folder_that_cannot_be_written_are_one_sentence(tiny_breakout, tiny_hopper, tmp_path,
                                                                        capsys, monkeypatch):
    """--gif, lsdt.py --plot-mixing and dema.py --attention into a read-only run folder: one sentence, exit 1, the run
    untouched (the tests run as root, whom chmod does not stop, so the write itself is made to fail as it would
    there)."""
    import matplotlib.figure
    from PIL import Image
    import lsdt
    from test_harness import TINY
    out, run = tmp_path / "run", tmp_path / "lsdt"
    dt.main(["--dataset", tiny_breakout, *TINY_DT, "--steps", "2", "--eval-every", "2", "--out", str(out)])
    lsdt.main(["--dataset", tiny_hopper, *TINY["lsdt"], "--steps", "2", "--eval-every", "2", "--eval-episodes", "1",
               "--out", str(run)])
    before = snapshot(out)

    def denied(self, path, *a, **k):
        raise PermissionError(13, "Read-only file system", str(path))
    monkeypatch.setattr(Image.Image, "save", denied)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", denied)
    err = one_sentence_exit_1(capsys, dt.main, ["--out", str(out), "--gif"])
    assert "could not write" in err and "episode.gif" in err and snapshot(out) == before
    err = one_sentence_exit_1(capsys, lsdt.main, ["--out", str(run), "--plot-mixing"])
    assert "could not write" in err and "mixing.png" in err
    import dema                                                   # dema.py --attention writes its .npz first
    monkeypatch.undo()
    dema_run = tmp_path / "dema"
    dema.main(["--dataset", tiny_hopper, *TINY["dema"], "--steps", "2", "--eval-every", "2", "--eval-episodes", "1",
               "--out", str(dema_run)])
    monkeypatch.setattr(np, "savez", lambda path, **k: denied(None, path))
    err = one_sentence_exit_1(capsys, dema.main, ["--out", str(dema_run), "--attention"])
    assert "could not write" in err and "attention_episode.npz" in err


@pytest.mark.slow
def test_dt_bench_on_atari_frames(tmp_path, capsys, monkeypatch):
    """--bench with an Atari name times DT's Atari model on synthetic 84x84 frames (DeMa's Table 7 compares the two
    there; eager only here: compiling takes a minute) and writes nothing."""
    monkeypatch.setattr(ev, "BENCH_MODES", ev.BENCH_MODES[:1])
    monkeypatch.chdir(tmp_path)
    dt.main(["--bench", "--env", "breakout-expert", *TINY_DT[:-2], "--steps", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("the paper's row for Atari: ")                    # the row it applies
    assert lines[1].startswith("bench dt") and f"{3 * 4 * 8} tokens per batch" in lines[1]
    assert lines[2].split()[0] == "eager" and "ms/step" in lines[2]
    assert os.listdir(tmp_path) == []


def test_dt_paper_preset_trains_pong_as_dts_script_does():
    """DT's official script trains Pong with K=50 and batch 512 (kzl atari/run.sh#L14), 5 epochs of
    ceil((500000 - 150) / 512) = 977 steps; the other games with K=30 and batch 128, 3906 steps an epoch. The
    paper preset applies Pong's row, the run is still the paper's ('default'), and flags still win."""
    cfg, given = dt.parse_flags(["--dataset", "atari/pong/expert-v0"])
    assert (cfg.context, cfg.batch_size, cfg.steps, cfg.eval_every, cfg.warmup_steps) == (50, 512, 4885, 977, 1)
    assert (cfg.n_layer, cfg.n_head, cfg.lr, cfg.beta2) == (6, 8, 6e-4, 0.95) and "context" not in given
    assert ev.variant_name(cfg, dt.PRESETS) == "default"
    cfg, _ = dt.parse_flags(["--dataset", "atari/breakout/expert-v0"])
    assert (cfg.context, cfg.batch_size, cfg.steps, cfg.eval_every, cfg.warmup_steps) == (30, 128, 19_530, 3906, 3)
    cfg, _ = dt.parse_flags(["--dataset", "atari/pong/expert-v0", "--context", "30"])
    assert (cfg.context, cfg.batch_size) == (30, 512) and ev.variant_name(cfg, dt.PRESETS) == "context30"
    cfg, _ = dt.parse_flags(["--dataset", "atari/pong/expert-v0", "--preset", "cpu"])
    assert (cfg.context, cfg.batch_size) == (8, 32)                 # --preset cpu's Atari row, Pong alike
