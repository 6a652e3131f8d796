"""Batched evaluation against the one-episode-at-a-time reference (which builds its windows from plain lists), and
--target-sweep (DT's Figure 4) from a run's checkpoint."""
import importlib
import inspect
import os
import re

import numpy as np
import pytest
import torch

import data
import evaluate


def probe_policy(act_dim, seed=0):
    """A deterministic policy that reads every field of the window, row by row in float64, and the env index, so
    a wrong window, RTG update, previous action, mask or row order changes the episode."""
    rng = np.random.default_rng(seed)
    w = {k: rng.standard_normal(64) for k in ("states", "actions", "rewards", "rtg", "timesteps", "mask",
                                              "prev_action", "prev_reward")}

    def feat(x, k):
        x = x.reshape(-1).astype(np.float64)
        return np.resize(w[k], x.shape) @ x

    def act(batch, live):
        b = {k: v.cpu().numpy() for k, v in batch.items()}
        out = []
        for j, i in enumerate(live):
            z = sum(feat(b[k][j], k) * 0.3 for k in w if k != "timesteps") + 1e-3 * feat(b["timesteps"][j], "timesteps")
            out.append(np.tanh(z + 0.1 * i + np.arange(act_dim)))
        return np.array(out)
    return act


def test_batched_equals_sequential_hopper(tiny_hopper):
    d = data.load_data(tiny_hopper)
    act = probe_policy(d.act_dim)
    b = evaluate.evaluate(act, d, 4, 3600.0, seed=3, context=5, progress=False)
    s = evaluate.evaluate_sequential(act, d, 4, 3600.0, seed=3, context=5)
    assert len(set(b["lengths"].tolist())) > 1          # episodes end at different steps
    assert np.array_equal(b["lengths"], s["lengths"])
    assert np.allclose(b["returns"], s["returns"], rtol=0, atol=1e-9)
    assert np.allclose(b["normalized"], d.normalize_score(b["returns"]))
    assert "success" not in b and "positions" not in b                # goal-reaching data only


@pytest.mark.slow
def test_batched_equals_sequential_maze(tiny_maze):
    d = data.load_data(tiny_maze)
    act = probe_policy(d.act_dim, seed=1)
    b = evaluate.evaluate(act, d, 3, d.target_returns[0], seed=0, context=4, progress=False)
    s = evaluate.evaluate_sequential(act, d, 3, d.target_returns[0], seed=0, context=4)
    assert np.array_equal(b["lengths"], s["lengths"]) and (b["lengths"] == 40).all()  # maze: runs to the horizon
    assert np.allclose(b["returns"], s["returns"], atol=1e-9)
    assert np.array_equal(b["success"], s["success"]) and np.array_equal(b["steps_to_goal"], s["steps_to_goal"])
    # positions: x, y after reset and after each step (achieved_goal), for drawing paths
    assert [p.shape for p in b["positions"]] == [(n + 1, 2) for n in b["lengths"]]
    assert all(np.array_equal(p, q) for p, q in zip(b["positions"], s["positions"]))
    obs, _ = d.make_env().reset(seed=0)
    assert np.allclose(b["positions"][0][0], obs["achieved_goal"]) and np.ptp(b["positions"][0], axis=0).max() > 0


def test_compare_with_sequential_says_both_times_and_that_the_returns_agree(tiny_hopper, capsys):
    """dt.py's --bench-eval line: the episodes' steps and lengths, both times, the speed-up, and the returns' check."""
    d = data.load_data(tiny_hopper)
    evaluate.compare_with_sequential(probe_policy(d.act_dim), d, 3, 3600.0, seed=3, context=5)
    said = capsys.readouterr().out
    assert said.startswith("3 episodes, ") and "(lengths [" in said and "s, sequential " in said
    assert "speed-up" in said and said.rstrip().endswith("same returns: True") and len(said.splitlines()) == 1


def test_rtg_and_previous_step_bookkeeping(tiny_hopper):
    """Record what act() sees and check it against the rewards the env returned."""
    d = data.load_data(tiny_hopper)
    seen = []

    def act(batch, live):
        seen.append({k: v.clone() for k, v in batch.items()} | {"live": live.copy()})
        return np.full((len(live), d.act_dim), 0.3)
    res = evaluate.evaluate(act, d, 2, 1000.0, seed=0, context=3, progress=False)
    env0 = [b for b in seen if 0 in b["live"]]
    rows = [b["live"].tolist().index(0) for b in env0]
    rtg = np.array([b["rtg"][r, -1, 0].item() for b, r in zip(env0, rows)])
    assert np.isclose(rtg[0], 1.0)                                   # 1000 * 1e-3
    rewards = np.array([env0[t + 1]["rewards"][r, -2, 0].item() for t, r in enumerate(rows[1:])])
    assert np.allclose(np.diff(rtg), -rewards * 1e-3, atol=1e-6)     # RTG_{t+1} = RTG_t - r_t (scaled)
    last_r = (res["returns"][0] - rewards.sum())                     # the final reward is never shown to act()
    assert abs(last_r) < 10
    first, later = env0[0], env0[3]
    assert first["mask"][rows[0]].tolist() == [0, 0, 1] and first["timesteps"][rows[0], -1] == 0
    assert torch.allclose(first["prev_action"][rows[0]], torch.zeros(d.act_dim))          # null previous action
    assert later["timesteps"][rows[3]].tolist() == [1, 2, 3]
    assert torch.allclose(later["prev_action"][rows[3]], torch.full((d.act_dim,), 0.3))    # a_0 before the window
    assert torch.allclose(later["actions"][rows[3], -1], torch.zeros(d.act_dim))           # a_t not known yet
    assert len(env0) == res["lengths"][0]                                                  # stops at its own end


def test_a_non_finite_action_stops_the_evaluation_in_one_sentence(tiny_hopper):
    """A NaN action would make the env's state, and every later return, NaN: evaluate() refuses it at that step."""
    import pytest
    d = data.load_data(tiny_hopper)

    def act(batch, live):
        a = torch.zeros(len(live), d.act_dim)
        a[0, 1] = float("nan") if batch["timesteps"][0, -1] == 3 else 0.0
        return a
    with pytest.raises(data.DataError, match="non-finite action at step 3"):
        evaluate.evaluate(act, d, 2, 3600.0, seed=0, context=4, progress=False)


def test_delayed_rewards_in_the_data_and_in_evaluation(tiny_hopper):
    """--delayed-reward: every reward of an episode at its last step, so every return-to-go is the episode's return;
    in evaluation the prompt stays put until the episode's end while the reported return is the env's own."""
    assert np.array_equal(data.delay_rewards(np.array([1.0, 2.0, 0.5], np.float32)), [0.0, 0.0, 3.5])
    dense, late = data.load_data(tiny_hopper), data.load_data(tiny_hopper, delayed_reward=True)
    assert late.delayed_reward and not dense.delayed_reward
    for e_dense, e_late, start in zip(dense.episodes, late.episodes, late.ep_start):
        T = len(e_late["rewards"])
        assert np.allclose(late.flat["rtg"][start:start + T], e_dense["rewards"].sum() * late.return_scale, atol=1e-6)
        assert np.count_nonzero(e_late["rewards"][:-1]) == 0
    assert np.allclose(dense.episode_returns, late.episode_returns, rtol=1e-6)
    assert dense.target_returns == late.target_returns
    seen = []

    def act(batch, live):      # reads only the states, so both settings play the same episodes
        seen.append(batch["rtg"][:, -1, 0].clone())
        return np.tanh(batch["states"][:, -1, :3].numpy())
    a = evaluate.evaluate(act, late, 2, 3600.0, seed=1, context=4, progress=False)
    prompts = torch.cat(seen)
    assert torch.allclose(prompts, torch.full_like(prompts, 3.6))          # never decremented before the end
    b = evaluate.evaluate(act, dense, 2, 3600.0, seed=1, context=4, progress=False)
    assert np.array_equal(a["returns"], b["returns"]) and np.array_equal(a["lengths"], b["lengths"])
    s = evaluate.evaluate_sequential(probe_policy(late.act_dim), late, 2, 3600.0, seed=1, context=4)
    p = evaluate.evaluate(probe_policy(late.act_dim), late, 2, 3600.0, seed=1, context=4, progress=False)
    assert np.array_equal(p["lengths"], s["lengths"]) and np.allclose(p["returns"], s["returns"], atol=1e-9)


@pytest.mark.slow
def test_delayed_reward_flag_names_the_run_and_trains(tiny_hopper, tmp_path, capsys):
    import dt
    out = tmp_path / "run"
    cfg, _ = dt.parse_flags(["--dataset", tiny_hopper, "--delayed-reward"])
    assert "delayed-reward" in evaluate.variant_name(cfg, dt.PRESETS)
    dt.main(["--dataset", tiny_hopper, "--delayed-reward", "--n-embd", "16", "--n-layer", "1", "--context", "4",
             "--batch-size", "8", "--steps", "4", "--eval-every", "4", "--eval-episodes", "1", "--out", str(out)])
    assert "final: normalized_score=" in capsys.readouterr().out
    assert torch.load(out / "ckpt.pt", weights_only=True)["config"]["delayed_reward"] is True


def test_gif_title_wraps_to_the_frame():
    """A long variant name (lsdt's on a maze) is broken into lines that each fit the 240-pixel frame, losing nothing."""
    from PIL import ImageFont
    font = ImageFont.load_default(size=13)
    title = "lsdt cpu_n-head2_conv-ratio0.125_kernel3_routingweight_no-goal-state_context20, target 20.5"
    lines = evaluate.wrap_text(title, font, 228)
    assert len(lines) > 1 and all(font.getlength(line) <= 228 for line in lines)
    assert "".join(lines).replace(" ", "") == title.replace(" ", "")


def test_final_line_gives_the_best_evaluation_of_the_first_target_beside_the_last(capsys):
    """The final line keeps its fields (normalized_score=, return=, ... episodes=N) and names the best evaluation of
    the first target in log.csv (the earliest of equals; another target's higher scores never count); without
    reference returns, the best return."""
    def row(step, target, ret, score):
        return dict(step=step, target=target, eval_return=ret, normalized_score=score)
    run = evaluate.Run.__new__(evaluate.Run)   # finish() reads only the log rows
    run.rows = [dict(step=1, eval_return="", normalized_score=""), row(2, "3600", "50.00", "40.00"),
                row(2, "1800", "90.00", "95.00"), row(4, "3600", "70.00", "61.50"), row(4, "1800", "99.00", "99.00"),
                row(6, "3600", "80.00", "61.50"), row(8, "3600", "30.00", "20.00")]
    res = dict(returns=np.array([30.0, 30.0]), normalized=np.array([20.0, 20.0]), lengths=np.array([5, 5]))
    assert run.finish([(3600.0, res), (1800.0, res)]) is res
    assert capsys.readouterr().out.strip() == ("final: normalized_score=20.00 return=30.00 best_normalized_score=61.50 "
                                               "best_step=4 episodes=2")
    run.rows = [row(2, "", "12.00", ""), row(4, "", "15.50", ""), row(6, "", "9.00", "")]    # no reference returns
    run.finish([(None, dict(returns=np.array([9.0]), normalized=np.array([np.nan]), lengths=np.array([5])))])
    assert capsys.readouterr().out.strip() == ("final: normalized_score=none return=9.00 best_return=15.50 "
                                               "best_step=4 episodes=1")


def eval_rows(out):
    import csv
    with open(out / "log.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["eval_return"] != ""]


@pytest.mark.slow
def test_progress_line_names_its_score_and_log_says_which_evaluations_were_greedy(tiny_breakout, tiny_hopper,
                                                                                  tmp_path, capsys, monkeypatch):
    """Atari's "last eval" is gamer-normalised, with the return beside it; --resume with --greedy is recorded per
    evaluation row of log.csv (config.json says only the last setting). MuJoCo's is named normalised; no greedy."""
    import dt
    draw = evaluate.choose   # (greedy play of an untrained model stalls for 27k steps: the actions stay drawn here)
    monkeypatch.setattr(evaluate, "choose", lambda logits, rng, greedy: draw(logits, rng, False))
    tiny = ["--n-embd", "16", "--n-layer", "1", "--n-head", "2", "--context", "4", "--batch-size", "8",
            "--warmup-steps", "2", "--eval-episodes", "1", "--eval-every", "2", "--log-every", "1"]
    out = tmp_path / "atari"
    dt.main(["--dataset", tiny_breakout, *tiny, "--steps", "4", "--out", str(out)])
    e = eval_rows(out)[0]
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("step      3 |"))
    assert line.endswith(f"| last eval {e['normalized_score']} (gamer-normalised; return {e['eval_return']}) (step 2)")
    dt.main(["--out", str(out), "--resume", "--steps", "6", "--greedy"])
    assert [(r["step"], r["greedy"]) for r in eval_rows(out)] == [("2", "0"), ("4", "0"), ("6", "1")]
    out = tmp_path / "hopper"
    dt.main(["--dataset", tiny_hopper, *tiny, "--steps", "3", "--out", str(out)])
    e = eval_rows(out)[0]
    assert f"| last eval {e['normalized_score']} (normalised; return {e['eval_return']}) (step 2)" in \
        capsys.readouterr().out
    assert {r["greedy"] for r in eval_rows(out)} == {""}


# ---------------------------------------------------------------------------------------------------------------
# --target-sweep: DT's Figure 4 from a run's checkpoint

TINY_DT = ["--n-embd", "16", "--n-layer", "1", "--context", "4", "--batch-size", "8", "--warmup-steps", "2",
           "--steps", "2", "--eval-every", "2", "--eval-episodes", "1"]


def files(folder):
    return {f: (folder / f).read_bytes() for f in sorted(os.listdir(folder)) if f != ".lock"}


@pytest.mark.slow
def test_target_sweep_evaluates_eight_targets_from_the_checkpoint_and_never_trains(tiny_hopper, tmp_path, capsys):
    """8 targets evenly spaced from the tiny data's lowest episode return to 1.25 x its best (the returns summed here
    from Minari's own episodes), 2 episodes each, as evaluate() plays them with the run's seed + 10_000; the run's
    files (ckpt.pt, log.csv, ...) stay byte for byte; only target_sweep.png and .csv are added."""
    import csv
    import minari
    from PIL import Image
    import dt
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_hopper, *TINY_DT, "--seed", "3", "--out", str(out)])
    before = files(out)
    capsys.readouterr()
    dt.main(["--out", str(out), "--target-sweep", "--eval-episodes", "2"])
    said = capsys.readouterr().out
    assert not re.search(r"^step |^data: |^eval step|^final:", said, re.M)       # no training, no run record
    assert len(re.findall(r"^  target ", said, re.M)) == 8 and "at step 2:" in said
    after = files(out)
    assert after.pop("target_sweep.png") and after.pop("target_sweep.csv") and after == before
    returns = [float(np.sum(e.rewards)) for e in minari.load_dataset(tiny_hopper).iterate_episodes()]
    lo, hi = min(returns), 1.25 * max(returns)
    with open(out / "target_sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["target"]) for r in rows] == pytest.approx([lo + i * (hi - lo) / 7 for i in range(8)], abs=0.006)
    assert {r["episodes"] for r in rows} == {"2"}
    cfg, model, d, _ = dt.load_model(dt.parse_flags(["--out", str(out)])[0], {"out"})
    first = evaluate.evaluate(dt.policy(model, cfg), d, 2, float(rows[0]["target"]), 3 + 10_000, 4, progress=False)
    assert float(rows[0]["eval_return"]) == pytest.approx(first["returns"].mean(), abs=0.006)
    assert float(rows[0]["normalized_score"]) == pytest.approx(d.normalize_score(first["returns"]).mean(), abs=0.006)
    assert Image.open(out / "target_sweep.png").size[0] >= 600


@pytest.mark.slow
def test_target_sweep_needs_a_model_that_reads_a_return_to_go(tiny_hopper, tmp_path, capsys):
    """StARformer without --reward-input rtg, and DT's behaviour cloning, read no return-to-go: one sentence, exit 1,
    nothing written."""
    import dt
    import starformer
    runs = [(starformer, ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--step-embd", "8", "--step-head", "2",
                          *TINY_DT[4:]]),
            (dt, [*TINY_DT, "--no-return-token"])]
    for m, tiny in runs:
        out = tmp_path / m.SCRIPT
        m.main(["--dataset", tiny_hopper, *tiny, "--out", str(out)])
        before = files(out)
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            m.main(["--out", str(out), "--target-sweep"])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and err.startswith("error: ") and "\n" not in err, err
        assert "reads no return-to-go" in err and files(out) == before


@pytest.mark.parametrize("script, extra", [("dt", []), ("gpt2_dtma", []), ("lsdt", []),
                                           ("starformer", ["--reward-input", "rtg"]), ("dema", []),
                                           ("dema", ["--mode", "rnn"])])
@pytest.mark.slow
def test_every_return_conditioned_file_sweeps_its_run(script, extra, tiny_hopper, tmp_path, capsys, monkeypatch):
    """Each file's --target-sweep (an analysis: it names no trained setting, and excludes --gif) hands its run's
    policy, data, folder, --eval-episodes and evaluation seed (--seed + 10_000) to evaluate.target_sweep, with the
    context its evaluation uses (RNN-like DeMa: 1, its state holds the rest)."""
    from test_harness import TINY
    m = importlib.import_module(script)
    cfg = m.parse_flags(["--target-sweep"])[0]
    assert cfg.target_sweep and "--target-sweep" in m.__doc__
    assert evaluate.variant_name(cfg, m.PRESETS) == evaluate.variant_name(m.parse_flags([])[0], m.PRESETS)
    with pytest.raises(SystemExit) as e:
        m.main(["--out", str(tmp_path / "none"), "--gif", "--target-sweep"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err == "error: choose one of --gif, --target-sweep per command", err
    assert not (tmp_path / "none").exists()
    out = tmp_path / "run"
    m.main(["--dataset", tiny_hopper, *TINY[script], *extra, "--steps", "2", "--eval-every", "2", "--eval-episodes",
            "1", "--seed", "5", "--out", str(out)])
    calls = []
    signature = inspect.signature(evaluate.target_sweep)
    monkeypatch.setattr(evaluate, "target_sweep", lambda *a, **kw: calls.append(signature.bind(*a, **kw)))
    m.main(["--out", str(out), "--target-sweep", "--eval-episodes", "3"])
    given = calls[0].arguments
    act, d, episodes, seed, context, folder, title = (given[k] for k in ("act", "d", "episodes", "seed", "context",
                                                                        "out", "title"))
    K = int(TINY[script][TINY[script].index("--context") + 1])
    assert (d.dataset_id, episodes, seed, folder) == (tiny_hopper, 3, 10_005, str(out))
    assert context == (1 if "rnn" in extra else K) and title.startswith(script + " ")
    batch = d.sample(2, context, np.random.default_rng(0))
    assert tuple(act(batch, np.arange(2)).shape) == (2, d.act_dim)
