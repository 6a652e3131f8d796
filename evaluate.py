"""
Batched rollouts in the dataset's own env, --gif, --target-sweep (DT's Fig. 4), the run record
and `report`: the only code besides data.py that the model files share (main() and train() call
it; nothing here calls back).

    res = evaluate(act, d, episodes=10, target_return=3600, seed=0, context=20)
    python evaluate.py report [RUNS_DIR]     # a folder of runs -> seed-aggregated table and figure

Atari's eval env (data.atari_env_spec) makes its frames as Dopamine made DQN-replay's: the last two
of 4 max-pooled, then resized with INTER_AREA (Dopamine's atari_lib.py#L385, #L390); each reset
adds 1-30 no-ops, gymnasium's default, which Dopamine does not do (#L282-L292): it used sticky
actions (p = 0.25; #L51, #L75), as did DQN-replay's data. The papers' evaluation (kzl's, also
without sticky actions: trainer_atari.py#L231) departs: it resizes each frame with INTER_LINEAR
(#L244), then max-pools (#L271-L283), after 0-29 no-ops (#L259-L263).
  kzl (atari/mingpt/): https://github.com/kzl/decision-transformer/tree/e2d82e68f330c00f763507b3b01d774740bee53f
  Dopamine (dopamine/discrete_domains/): https://github.com/google/dopamine/tree/00a5b3208d0fc4390e0b27dbde774409894bd64c
"""
import argparse
import contextlib
import copy
import csv
import dataclasses
import errno
import hashlib
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict

import numpy as np
import torch
import torch.nn as nn

import data as data_lib
from data import DataError, FlagParser, duration, gb, is_maze, resolve

# ---- rollouts ----


def evaluate(act, d, episodes, target_return, seed, context, device="cpu", progress=True,
             render_every=0, greedy=False, until_goal=False):
    """`episodes` episodes in parallel (env i reset with seed + i), each to its end, prompted with
    `target_return` (raw; None: rtg 0). act(batch, live) gets the live envs' last `context` steps,
    as data.OfflineData.sample gives them (the current action and reward 0), and their env indices
    (timesteps[:, -1] == 0: a fresh episode, where a recurrent model resets) -> (len(live),
    act_dim); on Atari logits, from which choose() draws (env i's draws seeded seed + i).
    -> per-episode arrays: returns, lengths, normalized; goal tasks add success, steps_to_goal (the
    first info['success'], else the horizon), positions ((length + 1, 2): x, y); seconds;
    render_every > 0 adds frames (step, return, RGB) of episode 0 at reset, every render_every
    steps and at its end (at most GIF_FRAMES). until_goal: episodes also end at their first success.

    The DT paper's Algorithm 1 (evaluation), for n envs at once (timesteps from 0):
        R, s, a, t, done = [target_return], [env.reset()], [], [0], False
        while not done:
            action = DecisionTransformer(R, s, a, t)[-1]  # one act() call for all live envs
            new_s, r, done, _ = env.step(action)
            R = R + [R[-1] - r]  # RTG_{t+1} = RTG_t - r_t
            s, a, t = s + [new_s], a + [action], t + [t[-1] + 1]
            R, s, a, t = R[-K:], s[-K:], a[-K:], t[-K:]  # the context: the last K steps
    """
    n, H = episodes, d.horizon

    # reset: s_0 and R_0 (the prompt, scaled); a list of envs (vector envs auto-reset)
    envs = [d.make_env(render=render_every > 0 and i == 0) for i in range(n)]
    samplers = [np.random.default_rng(seed + i) for i in range(n)]  # env i's draws (discrete)
    contexts = Contexts(d, n, context)
    R = np.full(n, (target_return or 0.0) * d.return_scale, np.float32)  # (n,)
    positions = [[] for _ in range(n)]
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=seed + i)
        contexts.begin(i, 0, obs, R[i])
        positions[i] += [_position(obs)] if d.goal_reaching else []
    frames = [(0, 0.0, envs[0].render())] if render_every else []

    # Alg. 1's loop, each env to its own end
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    t0 = time.time()
    for t in range(H):
        live = np.flatnonzero(~done)  # (L,) envs still running
        if len(live) == 0:
            break

        # Alg. 1's action of every live env, in one call
        batch = contexts.window(live, t)  # (L, K, ...) steps t-K+1 .. t
        with torch.no_grad():
            out = _as_numpy(act({k: v.to(device) for k, v in batch.items()}, live))

        # a NaN action would make the env's state and every later return NaN
        if not np.isfinite(out).all():
            j = int(np.flatnonzero(~np.isfinite(out).all(axis=1))[0])
            raise DataError(
                f"the policy gave a non-finite action at step {t} of evaluation episode {live[j]} "
                f"(target {target_return}); the run's weights or its return-to-go prompt are out "
                f"of range")

        # Atari: choose() from the logits; else clipped
        actions = (np.array([choose(o, samplers[i], greedy) for o, i in zip(out, live)])
                   if d.discrete else
                   np.clip(out, envs[0].action_space.low, envs[0].action_space.high))

        # each live env steps; its context gets a_t, r_t, s_{t+1}, R_{t+1}
        for j, i in enumerate(live):
            obs, r, terminated, truncated, info = envs[i].step(actions[j])
            returns[i] += r  # the env's own return, as reported
            done[i] = terminated or truncated or until_goal and info.get("success", False)
            if d.delayed_reward:  # as the data had them: all at the end
                r = returns[i] if done[i] else 0.0
            # R_{t+1} = R_t - r_t (DT Sec. 3) with the game's raw reward, as kzl's does
            # (trainer_atari.py#L211), while DQN-replay's returns-to-go count rewards clipped to
            # +-1 (Dopamine's run_experiment.py#L291)
            R[i] -= r * d.return_scale
            contexts.append(i, t, actions[j], r, obs, R[i])

            # the mazes' measures, episode 0's frames for --gif
            positions[i] += [_position(obs)] if d.goal_reaching else []
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            if (render_every and i == 0 and ((t + 1) % render_every == 0 or done[i])
                    and len(frames) < GIF_FRAMES):
                frames.append((t + 1, returns[0], envs[0].render()))

        if progress and sys.stderr.isatty():
            print(f"\r  eval target {target_return}: step {t + 1}/{H}, {int((~done).sum())} of {n} "
                  f"running, {time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)

    if progress and sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    for env in envs:
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal, positions) | dict(
        seconds=time.time() - t0) | (dict(frames=frames) if render_every else {})


class Contexts:
    """The contexts of n envs, as data.gather_windows reads them: env i keeps its last W steps (the
    window, the step before it, on Atari the frames a state stacks) in a ring, rows i*W + t % W, so
    a 27k-step Atari episode costs what a 1k-step MuJoCo one does."""

    def __init__(self, d, n, K):
        atari = d.family == "atari"
        self.d, self.K, self.W = d, K, K + 1 + (data_lib.FRAME_STACK - 1 if atari else 0)
        rows, self.key = n * self.W, "frames" if atari else "states"
        self.flat = dict(actions=np.zeros(rows, np.int64) if d.discrete else
                         np.zeros((rows, d.act_dim), np.float32),
                         rewards=np.zeros(rows, np.float32), rtg=np.zeros(rows, np.float32),
                         timesteps=np.zeros(rows, np.int64))

        # the states: on Atari single uint8 frames
        self.flat[self.key] = (np.zeros((rows, *d.obs_shape[1:]), np.uint8) if atari else
                               np.zeros((rows, d.obs_dim), np.float32))

    def window(self, live, t):
        """Steps t-K+1 .. t of the live envs (left-padded) -> (L, K, ...) each."""
        return data_lib.gather_windows(self.flat, live * self.W, live * self.W + t, self.K,
                                       ring=self.W)

    def begin(self, i, t, obs, rtg):
        """Step t of env i begins: s_t, R_t, t; a_t and r_t are not known yet (0)."""
        f, row = self.flat, i * self.W + t % self.W
        f[self.key][row], f["rtg"][row] = self.d.observe(obs), rtg
        f["timesteps"][row] = min(t, self.d.max_ep_len - 1)  # beyond the data's longest: its last
        f["actions"][row], f["rewards"][row] = 0, 0.0

    def append(self, i, t, action, reward, obs, rtg):
        """Step t of env i ended with a_t, r_t; step t + 1 begins with obs and R_{t+1}."""
        row = i * self.W + t % self.W
        self.flat["actions"][row], self.flat["rewards"][row] = action, reward
        self.begin(i, t + 1, obs, rtg)


def _as_numpy(a):
    return (a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else
            np.asarray(a, dtype=np.float32))


def choose(logits, rng, greedy):
    """One env's action: a draw from the logits' softmax (float64, one rng draw) as kzl's
    evaluation (utils.py#L52-L55, temperature 1), or greedy the likeliest."""
    if greedy:
        return int(np.argmax(logits))
    p = np.exp(logits.astype(np.float64) - logits.max())
    return int(min(np.searchsorted(np.cumsum(p / p.sum()), rng.random(), side="right"), len(p) - 1))


def _position(obs):
    """The agent's x, y: a maze's achieved_goal, else the first two entries."""
    return np.asarray(obs["achieved_goal"] if isinstance(obs, dict) else obs, dtype=np.float64)[:2]


def _result(d, returns, lengths, success, steps_to_goal, positions):
    res = dict(returns=returns, lengths=lengths, normalized=d.normalize_score(returns))
    if d.goal_reaching:
        res.update(success=success, steps_to_goal=steps_to_goal,
                   positions=[np.array(p) for p in positions])
    return res


def summarize(res):
    """One line: mean +- std of the normalised score and return (mazes: success, steps)."""
    s = (f"normalized_score={res['normalized'].mean():.1f}±{res['normalized'].std():.1f} "
         f"return={res['returns'].mean():.1f}±{res['returns'].std():.1f} "
         f"length={res['lengths'].mean():.0f}")
    if "success" in res:
        s += (f" success={100 * res['success'].mean():.0f}% "
              f"steps_to_goal={res['steps_to_goal'].mean():.0f}")
    return s


def evaluate_sequential(act, d, episodes, target_return, seed, context, greedy=False):
    """evaluate() one episode at a time, the windows from plain lists: the tests' reference."""
    n, H, K = episodes, d.horizon, context
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)

    # the padding and each key's dtype, as data.OfflineData.sample's
    atari = d.family == "atari"
    zero_a = 0 if d.discrete else np.zeros(d.act_dim, np.float32)
    zero_s = np.zeros(d.obs_shape, np.uint8) if atari else np.zeros(d.obs_dim, np.float32)
    dtypes = dict(timesteps=torch.int64, states=torch.uint8 if atari else torch.float32,
                  actions=torch.int64 if d.discrete else torch.float32)
    dtypes["prev_action"] = dtypes["actions"]

    positions = []
    for i in range(n):
        env, rng = d.make_env(), np.random.default_rng(seed + i)
        obs, _ = env.reset(seed=seed + i)
        S, A, R, G = [d.observe(obs)], [], [], [(target_return or 0.0) * d.return_scale]
        positions.append([_position(obs)])

        def state(u):  # Atari: frames u-3 .. u, zeros before the episode's first
            return (np.stack([S[v] if v >= 0 else np.zeros_like(S[0]) for v in range(u - 3, u + 1)])
                    if atari else S[u])

        for t in range(H):
            # the window: steps lo..t, left-padded to K; a_t and r_t not known yet (0)
            lo = max(0, t + 1 - K)
            pad = K - (t + 1 - lo)

            # as data.OfflineData.sample's keys, a batch of one
            batch = dict(
                states=[zero_s] * pad + [state(u) for u in range(lo, t + 1)],
                actions=[zero_a] * pad + A[lo:t] + [zero_a],
                rewards=[[0.0]] * pad + [[r] for r in R[lo:t] + [0.0]],
                rtg=[[0.0]] * pad + [[g] for g in G[lo:t + 1]],
                timesteps=[0] * pad + [min(u, d.max_ep_len - 1) for u in range(lo, t + 1)],
                mask=[0.0] * pad + [1.0] * (t + 1 - lo),
                prev_action=A[lo - 1] if lo > 0 else zero_a,
                prev_reward=[R[lo - 1] if lo > 0 else 0.0],
            )
            batch = {k: torch.tensor(np.array([v]), dtype=dtypes.get(k, torch.float32))
                     for k, v in batch.items()}
            with torch.no_grad():
                out = _as_numpy(act(batch, np.array([i])))[0]

            # the env steps; the lists get a_t, r_t, R_{t+1}, s_{t+1}
            a = (choose(out, rng, greedy) if d.discrete else
                 np.clip(out, env.action_space.low, env.action_space.high))
            obs, r, terminated, truncated, info = env.step(a)
            returns[i] += r
            r = (returns[i] if terminated or truncated else 0.0) if d.delayed_reward else r

            A.append(a if d.discrete else a.astype(np.float32))
            R.append(float(np.float32(r)))
            G.append(np.float32(G[-1] - r * d.return_scale))
            S.append(d.observe(obs))
            positions[i].append(_position(obs))
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            if terminated or truncated:
                break
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal, positions)


def compare_with_sequential(act, d, episodes, target_return, seed, context):
    """--bench-eval: the batched and sequential times, and if the returns agree."""
    rb = evaluate(act, d, episodes, target_return, seed, context, progress=False)
    t0 = time.time()
    rs = evaluate_sequential(act, d, episodes, target_return, seed, context)
    ts = time.time() - t0
    print(f"{episodes} episodes, {rb['lengths'].sum()} env steps (lengths "
          f"{rb['lengths'].tolist()}): batched {rb['seconds']:.2f}s, sequential {ts:.2f}s, "
          f"speed-up {ts / rb['seconds']:.1f}x; same returns: "
          f"{np.allclose(rb['returns'], rs['returns'])}")

# ---- analyses of a finished run: --gif, --target-sweep ----

GIF_FRAMES = 1500  # --gif's most frames (a stalled Atari episode would fill memory)


@contextlib.contextmanager
def analysis(flag):
    """main()'s with-block around --bench and each analysis (--gif, --target-sweep, a file's
    ANALYSES): Ctrl-C or SIGTERM anywhere in it is one sentence and exit 130 or 143. An analysis
    writes each file whole or not at all (write_atomic); a bench writes nothing that it keeps."""
    stops = []  # (signal, whether it came inside an import)

    def stop(signum, frame):
        stops.append((signum, any(f.f_code.co_filename.startswith("<frozen importlib")
                                  for f, _ in traceback.walk_stack(frame))))
        if len(stops) == 1:  # (a second lets the first's clean-up finish)
            raise KeyboardInterrupt

    previous = {s: signal.signal(s, stop) for s in STOPS}
    try:
        yield
    except BaseException as e:
        if not (stops or isinstance(e, KeyboardInterrupt)):
            raise
        stops.append((signal.SIGINT, False))  # (a KeyboardInterrupt raised without a signal: Ctrl-C's)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

    # a stop, wherever it came: a library may have turned it into its own error, or caught it
    if stops:
        signum = stops[0][0]
        print(f"\n{signal.Signals(signum).name}: " + (
            "the bench stops; a bench saves nothing" if flag == "bench" else
            f"--{flag.replace('_', '-')} stops; an analysis writes nothing half-made (each file "
            f"whole, or its previous copy kept)"), file=sys.stderr, flush=True)

        # a stop inside an extension's import can leave it half made, and the interpreter then
        # aborts as it exits: the files are closed by now, so exit without its clean-up
        if any(importing for _, importing in stops):
            sys.stdout.flush()
            os._exit(128 + signum)
        raise SystemExit(128 + signum)


def episode_gif(act, d, target_return, seed, context, device, out, title, greedy=False):
    """--gif: one evaluation episode -> <out>/episode.gif, the title, step and return on each frame:
    MuJoCo at most 152 frames of 240 x 240, Atari the colour screen every second step, at most
    GIF_FRAMES; at the env's own speed. -> evaluate()'s result."""
    from PIL import Image, ImageDraw, ImageFont
    atari, path = d.family == "atari", os.path.join(out, "episode.gif")
    backend, every = (None, 2) if atari else (pick_gl(), math.ceil(d.max_ep_len / 150))

    try:
        res = evaluate(act, d, 1, target_return, seed, context, device, progress=False,
                       render_every=every, greedy=greedy)
    except Exception as e:  # GL errors differ by backend and library
        if isinstance(e, DataError) or atari:
            raise
        raise DataError(
            f"MuJoCo could not render with MUJOCO_GL={backend} ({type(e).__name__}); unset "
            f"MUJOCO_GL to let the script find a backend, or set it to egl or osmesa with that "
            f"library installed (Debian's libegl1 or libosmesa6)") from None

    # the words on each frame
    font = ImageFont.load_default(size=13)
    images = []
    for step, ret, rgb in res["frames"]:
        img = Image.fromarray(rgb)
        lines = wrap_text(
            f"{title}{'' if target_return is None else f', target {target_return:g}'}", font,
            (2 * img.width if atari else img.width) - 12) + [f"step {step}   return {ret:.1f}"]

        # Atari: the 210 x 160 screen doubled, kept sharp, under a band for the words
        if atari:
            game = img.resize((2 * img.width, 2 * img.height), Image.Resampling.NEAREST)
            img = Image.new("RGB", (game.width, game.height + 16 * len(lines) + 8))
            img.paste(game, (0, img.height - game.height))
        ImageDraw.Draw(img).text((6, 4), "\n".join(lines), font=font, fill="white",
                                 stroke_width=2, stroke_fill="black")
        images.append(img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64))

    # at the env's speed: a step's seconds of play (Atari) or simulated time
    if atari:
        dt = data_lib.atari_frame_skip(d.env_spec) / 60
    else:
        env = d.make_env()
        dt = getattr(env.unwrapped, "dt", 0.01)
        env.close()

    write_atomic(path, lambda tmp: images[0].save(
        tmp, format="GIF", save_all=True, append_images=images[1:], loop=0, optimize=True,
        duration=max(20, int(round(every * dt * 100)) * 10)))
    cut = f", the first {len(images)} frames" if atari and len(images) >= GIF_FRAMES else ""
    print(f"episode.gif: {summarize(res)}, {len(images)} frames{cut}, "
          f"{os.path.getsize(path) / 2 ** 20:.1f} MB -> {path}")
    return res


def wrap_text(text, font, width):
    """`text` in lines `width` pixels wide in `font`, broken at spaces and underscores."""
    lines, line = [], ""
    for word in re.split(r"(?<=[ _])", text):
        if line and font.getlength(line + word) > width:
            lines.append(line.rstrip())
            line = ""
        line += word
    return lines + [line.rstrip()]


def pick_gl():
    """MuJoCo's offscreen OpenGL: MUJOCO_GL where set, else the first of (glfw,) egl and osmesa that
    makes a context in a child process (a failing one can kill its process)."""
    if os.environ.get("MUJOCO_GL"):
        return os.environ["MUJOCO_GL"]

    display = (sys.platform != "linux" or os.environ.get("DISPLAY")
               or os.environ.get("WAYLAND_DISPLAY"))
    for backend in (["glfw"] if display else []) + ["egl", "osmesa"]:
        probe = "import mujoco; c = mujoco.GLContext(8, 8); c.make_current(); c.free()"
        if subprocess.run([sys.executable, "-c", probe], env=os.environ | {"MUJOCO_GL": backend},
                          capture_output=True, timeout=120).returncode == 0:
            os.environ["MUJOCO_GL"] = backend
            return backend

    raise DataError(
        "MuJoCo finds no offscreen OpenGL here: set MUJOCO_GL=egl (with the EGL library, e.g. "
        "Debian's libegl1) or MUJOCO_GL=osmesa (with OSMesa, e.g. Debian's libosmesa6)")


SWEEP_TARGETS = 8  # --target-sweep's targets


def target_sweep(act, d, episodes, seed, context, device, out, title, greedy=False):
    """--target-sweep, the DT paper's Fig. 4: the return got (mean +-1 std, mazes' success rate)
    against the target at SWEEP_TARGETS targets, `episodes` episodes each (the same seeds), in
    target_sweep.csv and .png in `out`. DQN-replay's returns count rewards clipped to +-1, the
    env's do not. -> [(target, evaluate()'s result)]"""
    check_envs(d, episodes)

    # the targets (raw returns) and the figure's units
    worst, best = float(d.episode_returns.min()), float(d.episode_returns.max())
    targets = np.linspace(worst, best + 0.25 * abs(best), SWEEP_TARGETS)  # (8,)
    # where the data's episodes end at a goal (PointMaze's) so do these: raw returns (the
    # reference returns are the horizon's)
    to_goal = d.goal_reaching and np.median([len(e["actions"]) for e in d.episodes]) < d.horizon
    if to_goal:
        d = copy.copy(d)
        d.ref_min = d.ref_max = math.nan

    scored = math.isfinite(d.ref_min) and math.isfinite(d.ref_max)
    norm = d.normalize_score if scored else lambda r: np.asarray(r, dtype=np.float64)

    # the checkpoint's step, for the title (memory-mapped: only it is read)
    step = int(torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True,
                          mmap=True)["step"])
    print(f"target sweep of {title} at step {step}: {len(targets)} targets from {worst:.1f} "
          f"(the data's lowest episode return) to {targets[-1]:.1f} (its best, {best:.1f}, "
          f"and a quarter more), {episodes} episodes each", flush=True)

    # each target: a line and a csv row
    results, rows = [], []
    for g in targets:
        res = evaluate(act, d, episodes, float(g), seed, context, device, greedy=greedy,
                       until_goal=to_goal)
        results.append((float(g), res))
        print(f"  target {g:.1f}" + (f" (normalised {norm(g):.1f})" if scored else "")
              + f": {summarize(res)}", flush=True)
        rows.append(dict(target=f"{g:.2f}", target_normalized=score(d.normalize_score(g)),
                         eval_return=f"{res['returns'].mean():.2f}",
                         eval_return_std=f"{res['returns'].std():.2f}",
                         normalized_score=score(res["normalized"].mean()),
                         normalized_score_std=score(res["normalized"].std()),
                         success_rate=(f"{res['success'].mean():.3f}" if "success" in res
                                       else ""),
                         episodes=episodes))

    # the figure: the return got against the target
    from matplotlib.figure import Figure
    x = norm(targets)  # (8,)
    y = np.array([norm(res["returns"]).mean() for _, res in results])  # (8,) mean over episodes
    sd = np.array([norm(res["returns"]).std() for _, res in results])  # (8,)
    hundred = "a human gamer" if d.family == "atari" else "expert"
    unit = (f"normalised: 0 = random, 100 = {hundred}" if scored
            else "raw, until the goal" if to_goal else "raw: no reference returns")

    # both axes alike: the diagonal at 45 degrees
    lo, hi = min(x[0], (y - sd).min()), max(x[-1], (y + sd).max(), norm(best))
    lim = (lo - 0.05 * (hi - lo or 1.0), hi + 0.05 * (hi - lo or 1.0))

    # the return got (mean, band +-1 std), the return asked for, the data's best
    fig = Figure(figsize=(5.6, 5.6))
    ax = fig.subplots()
    ax.fill_between(x, y - sd, y + sd, color="tab:blue", alpha=0.2, lw=0)
    ax.plot(x, y, "o-", color="tab:blue", ms=4,
            label=f"achieved: mean of {episodes} episodes, band ±1 std"
                  + ("; under each, the % that reached the goal" if d.goal_reaching else ""))
    if d.goal_reaching:
        for xi, yi, (_, res) in zip(x, y, results):
            ax.annotate(f"{100 * res['success'].mean():.0f}%", (xi, yi), xytext=(0, -12),
                        textcoords="offset points", ha="center", fontsize=7, color="tab:blue")
    ax.plot(lim, lim, "--", color="gray", label="y = x: the return asked for")
    ax.axhline(norm(best), ls=":", color="tab:red",
               label=f"best episode in the data (return {best:.4g})")

    ax.set(xlim=lim, ylim=lim, aspect="equal",
           xlabel=f"target return-to-go ({unit})", ylabel=f"achieved return ({unit})")
    ax.set_title(f"{title}: the return achieved against the return asked for\n{d.dataset_id}, "
                 f"checkpoint at step {step}", fontsize=9)
    # the legend under the axes (bbox_inches: kept whole)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)

    path = os.path.join(out, "target_sweep")  # .csv and .png, renamed into place together
    write_atomic(path + ".csv", lambda tmp: write_csv(tmp, list(rows[0]), rows), path + ".png",
                 lambda tmp: fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight"))

    print(f"target_sweep.png and target_sweep.csv -> {out}")
    return results

# ---- the run record ----

RUN_FILES = ("config.json", "log.csv", "ckpt.pt")  # a folder holding one of these holds a run
CKPT_KEYS = {"script", "model", "optimizer", "scheduler", "step", "wall_time", "config",
             "dataset_id", "info", "rows", "pending_losses", "numpy_rng", "torch_rng"}
# greedy: 1 where Atari's actions were argmax (per row)
EVAL_FIELDS = ["target", "eval_return", "eval_return_std", "normalized_score",
               "normalized_score_std", "success_rate", "steps_to_goal", "greedy", "wall_time"]
MAX_SEED, MAX_EVAL_EPISODES = 2 ** 31 - 1, 10_000  # valid numpy / gymnasium seeds; envs at once
PROBE_STEPS = 10  # steps timed (after the first) for the run's expected length
STOPS = (signal.SIGINT, signal.SIGTERM)
BENCH_MODES = [("eager", False, False), ("compiled", True, False), ("compiled + amp", True, True)]
FAMILIES = ("mazes", "atari")  # a preset's entries for one family of datasets


class Given(set):
    """parse_flags' fields that the flags or a named --preset set (not the paper's rows,
    presets[""], which a model file's paper_settings may replace); .typed: the flags' alone, the
    only settings that may differ from a run's own (load_run)."""

    def __init__(self, fields, typed):
        super().__init__(fields)
        self.typed = set(typed)


def parse_flags(Config, presets, argv, prog, description):
    """Config's fields as flags (--batch-size: batch_size) over --preset's settings -> (cfg, Given:
    the fields the flags or a named --preset set)."""
    argv = None if argv is None else [str(a) for a in argv]

    # --help's defaults: those of the data and preset on the command line (Atari: the paper's row)
    pre = FlagParser(prog=prog, add_help=False)
    for flag in ("--env", "--dataset", "--preset"):
        pre.add_argument(flag, default="")
    seen = pre.parse_known_args(argv)[0]
    data_name = seen.dataset or seen.env or Config.env
    here = preset_values(presets, seen.preset, data_name)
    row = (f"--preset {seen.preset} on {data_name}" if seen.preset else
           f"the paper's {'maze' if is_maze(data_name) else 'Atari'} row for {data_name}")

    p = FlagParser(prog=prog, description=description,
                   formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Config):
        # (argparse %-formats the help)
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"].replace("%", "%%")
        default = (f"{here[f.name]} here, {row}; else {f.default}"
                   if here.get(f.name, f.default) != f.default else f.default)
        if f.type is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=text + (f" (default: {default})" if f.name in here else ""))
        else:
            p.add_argument(flag, type=f.type, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{text} (default: {default})")

    # a bad flag or preset: one sentence, exit 1
    given = vars(p.parse_args(argv))
    if given.get("preset", "") not in ("", *presets):
        p.error(f"unknown preset '{given['preset']}'; known: {', '.join(k for k in presets if k)}")

    # the flags over the preset over the paper's rows; the preset's family row printed
    name, preset = given.get("dataset") or given.get("env") or Config.env, given.get("preset", "")
    chosen = {f.name: f.default for f in dataclasses.fields(Config)} | given
    values = {**preset_values(presets, preset, name, chosen), **given}
    family = family_setting(presets, preset, name, chosen)
    family = {k.replace("_", "-"): v for k, v in family.items() if k not in given}
    if family:
        kind = "a maze" if is_maze(name) else "Atari"
        print((f"--preset {preset} on {kind}: " if preset else f"the paper's row for {kind}: ")
              + ", ".join(f"--{k}" if v is True else f"--no-{k}" if v is False else f"--{k} {v}"
                          for k, v in family.items()))
    if values.get("dataset"):
        values["env"] = ""  # config.json must not record --env beside --dataset

    named = preset_values({k: v for k, v in presets.items() if k}, preset, name, chosen)
    cfg = Config(**values)
    check_values(cfg)  # before a model file's paper_settings reads them
    typed = set(given) | ({"env"} if values.get("dataset") else set())
    return cfg, Given(typed | set(named), typed)


def family_setting(presets, preset, dataset, chosen=None):
    """A preset's entry for the data's family ("mazes", "atari"), else {}, with its rows that apply
    over it: a game's ("pong"), or a flag value's ("mode=rnn") where `chosen` holds that value."""
    family = "mazes" if is_maze(dataset) else "atari" if data_lib.is_atari(dataset) else None
    entry = presets.get(preset, {}).get(family, {}) if family else {}

    def applies(key):
        field, _, value = key.partition("=")
        return str((chosen or {}).get(field)) == value if value else key in resolve(dataset).lower()
    rows = [v for k, v in entry.items() if isinstance(v, dict) and applies(k)]
    return {k: v for k, v in entry.items() if not isinstance(v, dict)} | dict(
        kv for row in rows for kv in row.items())


def preset_values(presets, preset, dataset, chosen=None):
    """The settings under the flags, over Config's defaults: the paper's for the family, the
    preset's own, the preset's for the family."""
    own = {k: v for k, v in presets.get(preset, {}).items() if k not in FAMILIES}
    return (family_setting(presets, "", dataset, chosen) | own
            | family_setting(presets, preset, dataset, chosen))


def check_values(cfg):
    """Each flag alone, the checks every script shares (NaN, infinities, ranges): a DataError at
    the first bad value."""
    for f in dataclasses.fields(cfg):
        v, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if isinstance(v, float) and not math.isfinite(v):
            raise DataError(f"{flag} must be a finite number, got {v}")
        if f.name.endswith("dropout") and not 0 <= v < 1:
            raise DataError(f"{flag} must lie in [0, 1), got {v}")

        if f.name in ("steps", "batch_size", "context", "eval_every", "eval_episodes", "log_every",
                      "n_layer", "n_embd", "n_head") and v is not None and v <= 0:
            raise DataError(f"{flag} must be a positive whole number, got {v}")
        if (f.name in ("lr", "grad_clip") and v <= 0
                or f.name in ("weight_decay", "warmup_steps") and v < 0):
            raise DataError(
                f"{flag} must be {'> 0' if f.name in ('lr', 'grad_clip') else '>= 0'}, got {v}")


def check_flags(cfg, *one_of):
    """The checks every script shares of the flags together and of the machine, before any work
    (each flag alone: check_values, in parse_flags): a DataError at the first bad value. one_of:
    fields of which a command sets one at most (--bench, the analyses)."""
    # the fields together
    if getattr(cfg, "n_head", None) and getattr(cfg, "n_embd", None) and cfg.n_embd % cfg.n_head:
        raise DataError(f"--n-head {cfg.n_head} does not divide --n-embd {cfg.n_embd}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise DataError(f"--seed must be a whole number from 0 to {MAX_SEED}, got {cfg.seed}")
    if cfg.eval_episodes > MAX_EVAL_EPISODES:
        raise DataError(f"--eval-episodes {cfg.eval_episodes} would run that many environments at "
                        f"once; use at most {MAX_EVAL_EPISODES}")
    if len(chosen := [name for name in one_of if getattr(cfg, name)]) > 1:
        raise DataError(
            f"choose one of {', '.join('--' + c.replace('_', '-') for c in chosen)} per command")
    if cfg.bench and (run := [f for f in ("resume", "out") if getattr(cfg, f)]):
        raise DataError(f"--bench times training on synthetic data in a temporary folder, so it "
                        f"takes no {' or '.join('--' + f for f in run)}; drop "
                        f"{'them' if len(run) > 1 else 'it'}")

    # the machine: the device, the data's name, the output folder
    kind, _, index = cfg.device.partition(":")
    cuda = torch.cuda.is_available() and (
        not index or index.isdigit() and int(index) < torch.cuda.device_count())
    if not {"auto": True, "cpu": True, "mps": torch.backends.mps.is_available(), "cuda": cuda}.get(
            "cuda" if kind == "cuda" else cfg.device):
        raise DataError(
            f"--device {cfg.device} is not available here (torch {torch.__version__} sees "
            f"{torch.cuda.device_count()} CUDA devices); use auto, cpu, cuda, cuda:N or mps")
    resolve(cfg.dataset or cfg.env)  # an unknown --env: said before any folder is made
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise DataError(f"--out {cfg.out} is a file, not a folder")


def rss():
    """Bytes this process holds in memory, malloc's free pages given back first (Linux; else 0)."""
    import ctypes
    with contextlib.suppress(OSError, AttributeError), open("/proc/self/statm") as f:
        ctypes.CDLL(None).malloc_trim(0)
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def check_envs(d, episodes):
    """Before any work: a DataError if evaluate()'s `episodes` envs cannot fit in the memory free
    (an env's: the third's, the first two load what all share)."""
    if d.env_spec is None:  # (synthetic data)
        return
    envs, before = [d.make_env(), d.make_env()], rss()
    envs.append(d.make_env())
    each = rss() - before
    for env in envs:
        env.close()

    if (free := data_lib.available_memory()) and episodes * each > free:
        raise DataError(f"--eval-episodes {episodes} would need about {gb(episodes * each)} for "
                        f"its environments ({gb(each)} each), more than the {gb(free)} free; use "
                        f"--eval-episodes {max(1, free // each)} or fewer")


def pick_device(name):
    if name == "auto":
        name = ("cuda" if torch.cuda.is_available() else
                "mps" if torch.backends.mps.is_available() else "cpu")
    return torch.device(name)


def check_data(cfg, d, atari=False):
    """A DataError, before the run folder is touched, at settings that mean nothing for this data
    or cannot fit. atari: the model file reads Atari data."""
    if d.family == "atari" and not atari:
        raise DataError(
            f"{d.dataset_id} is Atari data (image states, discrete actions), which this model file "
            f"does not read (its paper has no Atari rows); dt.py, starformer.py and dema.py do")

    # a window never leaves its episode
    longest = max(len(e["actions"]) for e in d.episodes)
    if cfg.context > longest:
        raise DataError(
            f"--context {cfg.context} is longer than the longest episode of {d.dataset_id} "
            f"({longest} steps), so a window would never fill; use at most {longest}")

    # a target far out of the data's range (1e30 would also overflow float32 in the model)
    target, top = getattr(cfg, "target_return", None), float(np.abs(d.episode_returns).max())
    if target is not None and abs(target) > 100 * max(top, 1.0):
        raise DataError(
            f"--target-return {target:g} is more than 100 times the largest episode return in "
            f"{d.dataset_id} ({top:.4g}), far outside what the model saw; give a target near the "
            f"data's")

    # the evaluation's envs (on Atari: ale-py and OpenCV, said now, not at an evaluation)
    check_envs(d, cfg.eval_episodes)


def free_memory(device):
    """Bytes free on `device` (CPU: the OS's available memory)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return data_lib.available_memory()


def check_memory(build, loss, template, batch_size, device):
    """A training step's bytes (`loss(build(), batch)` on `batch_size` rows shaped like `template`),
    counted on the meta device before anything is allocated; a DataError if the device has less
    free."""
    with torch.device("meta"):
        model = build()
        batch = {k: torch.empty((batch_size, *v.shape[1:]), dtype=v.dtype)
                 for k, v in template.items()}

        # what autograd keeps (a parameter counts once, in params)
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.append(
                    0 if isinstance(t, nn.Parameter) else t.numel() * t.element_size()) or t,
                lambda t: t):
            loss(model, batch)

    # the parameters 4 times (gradients, AdamW's moments), the batch twice (host, device)
    params = sum(p.numel() * p.element_size() * (4 if p.requires_grad else 1)
                 for p in model.parameters())
    need = params + sum(kept) + 2 * sum(v.numel() * v.element_size() for v in batch.values())
    if (free := free_memory(device)) is not None and need > free:
        raise DataError(
            f"a training step needs about {gb(need)} (parameters, gradients and AdamW state "
            f"{gb(params)}; activations of {batch_size:,} windows {gb(sum(kept))}), more than the "
            f"{gb(free)} free on {device}; lower --batch-size, --context or the model's size")
    return need


def variant_name(cfg, presets):
    """The run folder's variant: the preset, then each flag that changes what is trained and
    differs from its default or preset ('default', 'cpu_context5', ...)."""
    base = ({f.name: f.default for f in dataclasses.fields(cfg)}
            | preset_values(presets, cfg.preset, cfg.dataset or cfg.env, dataclasses.asdict(cfg)))

    parts = [cfg.preset] if cfg.preset else []
    for f in dataclasses.fields(cfg):
        v, flag = getattr(cfg, f.name), f.name.replace("_", "-")
        if f.metadata["in_name"] and f.name != "preset" and v != base[f.name]:
            parts.append(flag if v is True else f"no-{flag}" if v is False else f"{flag}{v:g}"
                         if isinstance(v, float) else f"{flag}{v}")
    return "_".join(parts).replace("/", "-").replace(" ", "") or "default"


def run_folder(script, cfg, presets):
    return cfg.out or os.path.join("runs", script, (cfg.dataset or cfg.env).replace("/", "-"),
                                   variant_name(cfg, presets), f"seed{cfg.seed}")


def read_checkpoint(path, script):
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, empty file, ...
        raise DataError(f"{path} cannot be read as a checkpoint ({type(e).__name__}; truncated, or "
                        f"not a torch file); move it away or pass another --out") from None

    if not isinstance(ck, dict) or ck.get("script") != script or not CKPT_KEYS <= set(ck):
        raise DataError(
            f"{path} is not a checkpoint of {script}.py; move it away or pass another --out")
    return ck


def load_run(script, cfg, given, presets):
    """cfg's run, read only (--resume, the analyses) -> (its settings under the flags typed, its
    checkpoint); a DataError at a flag typed that changes what is trained (the preset too), the
    data or the seed, or that shortens the run. A restated preset's values are not typed: the
    run keeps its own (given: parse_flags' Given; a plain set, all typed)."""
    path = os.path.join(run_folder(script, cfg, presets), "ckpt.pt")
    if not os.path.exists(path):
        raise DataError(f"no checkpoint at {path}; train the run first, or pass --out <run folder>")
    ck = read_checkpoint(path, script)

    # the flags typed now against the run's own
    given = getattr(given, "typed", given)
    names = {f.name: f for f in dataclasses.fields(cfg)}
    saved = {k: v for k, v in ck["config"].items() if k in names}
    differ = []
    for k in sorted(given & set(saved)):
        there, here = saved[k], getattr(cfg, k)
        if (names[k].metadata["in_name"] or k == "seed") and here != there:
            # ("": no --preset)
            differ.append(f"--{k.replace('_', '-')} {there if there != '' else 'none'} there, "
                          f"{here if here != '' else 'none'} here")

    # the data, where --env or --dataset is given
    if given & {"env", "dataset"} and resolve(cfg.dataset or cfg.env) != ck["dataset_id"]:
        differ.append(f"dataset {ck['dataset_id']} there, {resolve(cfg.dataset or cfg.env)} here")
    if differ:
        raise DataError(f"{path} was written with other settings ({'; '.join(differ)}); drop those "
                        f"flags to use the run's own, or pass a fresh --out")

    if "steps" in given and cfg.steps < ck["step"]:
        raise DataError(
            f"--steps {cfg.steps} is below the step this run has reached ({ck['step']}) and a run "
            f"cannot be shortened; give --steps {ck['step']} or more, or drop --steps")
    return type(cfg)(**(saved | {k: getattr(cfg, k) for k in given if k != "preset"})), ck


def lock_folder(out):
    """Hold <out>/.lock for this process's life (the OS frees it, even at kill -9)."""
    try:
        f = open(os.path.join(out, ".lock"), "a+")
    except OSError as e:
        raise DataError(f"cannot write to the output folder {out} ({e.strerror})") from None

    # the lock, or a DataError naming its holder
    try:
        if os.name == "nt":
            import msvcrt
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise DataError(f"{out} is in use by another run (process {pid}); wait for it, or pass "
                        f"another --out") from None

    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def refuse_occupied(out, script):
    """A DataError unless `out` is new or empty (a run there needs --resume)."""
    files = sorted(set(os.listdir(out)) - {".lock"}) if os.path.isdir(out) else []
    if set(files) & set(RUN_FILES):
        owner = script if {"ckpt.pt", "log.csv"} & set(files) else None
        with contextlib.suppress(OSError, ValueError, AttributeError), open(
                os.path.join(out, "config.json")) as f:
            owner = json.load(f).get("script", owner)

        # a run of this script: --resume, unless killed before its first checkpoint
        if owner == script and "ckpt.pt" not in files:
            raise DataError(
                f"{out} holds a run that stopped before its first checkpoint (no ckpt.pt), so it "
                f"cannot be continued; delete that folder to start again there, or pass a fresh "
                f"--out")
        if owner == script:
            raise DataError(
                f"{out} already holds a run; continue it with --resume, or pass a fresh --out")

    # any other folder with files is never written to
    if files:
        raise DataError(
            f"{out} already holds files that are not a run of {script}.py ({', '.join(files[:3])}"
            f"{', ...' * (len(files) > 3)}); nothing there is overwritten, so pass a new or empty "
            f"--out")


@contextlib.contextmanager
def stops_held():
    """Ctrl-C and SIGTERM wait while the block runs (in the main thread), then are passed on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    held = {s: signal.signal(s, lambda signum, frame: caught.append(signum)) for s in STOPS}
    try:
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler or signal.SIG_DFL)
        for s in caught:
            signal.raise_signal(s)


def write_atomic(path, write, *more):
    """write(tmp), then rename it over `path` (more: path, write, ..., renamed with it): a crash, a
    stop or a full disk leaves the old files whole and no .tmp."""
    pairs, folder = [(path, write), *zip(more[::2], more[1::2])], os.path.dirname(path) or "."
    try:
        for path, write in pairs:
            write(path + ".tmp")

        # renamed together, Ctrl-C and SIGTERM held meanwhile, then passed on
        with stops_held():
            for p, _ in pairs:
                os.replace(p + ".tmp", p)

    except BaseException as e:
        tmp = path + ".tmp"
        partial = os.path.getsize(tmp) if os.path.exists(tmp) else 0
        for p, _ in pairs:
            with contextlib.suppress(OSError):
                os.remove(p + ".tmp")
        if not isinstance(e, (OSError, RuntimeError)):  # torch.save's failed write: a RuntimeError
            raise

        # the reason: a full disk, else the OS's or torch's words (less its C++ location)
        previous = os.path.getsize(path) if os.path.exists(path) else 0
        if (getattr(e, "errno", None) == errno.ENOSPC
                or shutil.disk_usage(folder).free <= max(partial, previous)):
            reason = f"no space left on the device holding {folder}"
        else:
            reason = (getattr(e, "strerror", None)
                      or str(e).strip().splitlines()[-1].split("] ")[-1][:100])
        raise DataError(f"could not write {path} ({reason}); the previous copy is kept") from None


def write_csv(path, fields, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fields, restval="")
        w.writeheader()
        w.writerows(rows)


def save_figure(fig, path, **savefig):
    """fig.savefig(path, **savefig) through write_atomic."""
    write_atomic(path, lambda tmp: fig.savefig(tmp, format=path.rsplit(".", 1)[-1], **savefig))


class StopSignal:
    """Ctrl-C or SIGTERM in training: the step (and evaluation) ends, the run saves, exit() exits
    128 + the signal; a second signal quits at once. saves=False (--bench's runs, which keep
    nothing): the signals stay the caller's (analysis("bench") quits at the first)."""

    def __init__(self, saves=True):
        self.saves, self.signum, self.previous = saves, 0, {}

    def __enter__(self):
        if self.saves and threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in STOPS}
        return self

    def handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step (and evaluation) to "
              f"save; again to quit without saving", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def exit(self, step, out):
        print(f"stopped at step {step}; checkpoint saved in {out}; continue with --resume",
              flush=True)
        raise SystemExit(128 + self.signum)


class Run:
    """A run's folder (run_folder): config.json, log.csv (a row per log step and per evaluated
    target), ckpt.pt, curve.png. Run(...) writes nothing: it names the folder, refuses what must
    not happen there and with --resume takes the run's settings from its checkpoint (self.cfg).
    saves=False: a bench's run, whose folder is thrown away (a stop does not save it)."""

    def __init__(self, script, cfg, given, presets, columns=(), saves=True):
        self.script, self.ck, self.lock, self.made, self.saves = script, None, None, False, saves
        self.fields = ["step", "loss", "lr", *columns, *EVAL_FIELDS]
        self.out = out = run_folder(script, cfg, presets)
        if os.path.exists(os.path.join(out, ".lock")):
            lock_folder(out).close()  # another process using it: said first

        # --resume: a folder with a checkpoint, read under the lock; else one that holds nothing
        if cfg.resume and not os.path.exists(os.path.join(out, "ckpt.pt")):
            if os.path.isdir(out) and set(os.listdir(out)) & {"log.csv", "config.json"}:
                raise DataError(
                    f"{out} has no ckpt.pt to resume from (its run stopped before its first "
                    f"checkpoint, or the file was moved); put ckpt.pt back, or start again in a "
                    f"fresh --out")
            raise DataError(
                f"{out} holds no run to resume (no ckpt.pt there); drop --resume to start one")

        if cfg.resume:
            self.lock = lock_folder(out)
            try:
                cfg, self.ck = load_run(script, cfg, given, presets)
            except BaseException:
                self.lock.close()
                raise
        else:
            refuse_occupied(out, script)
        self.cfg, self.variant = cfg, self.ck["variant"] if self.ck else variant_name(cfg, presets)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.close()
            if self.made and os.listdir(self.out) == [".lock"]:  # new, and never logged
                shutil.rmtree(self.out, ignore_errors=True)

    def start(self, cfg, model, opt, sched, rng, d, info, need):
        """Make and lock a new run's folder (checked again under the lock), or restore a resumed
        run's state. -> its step."""
        self.cfg, self.d, self.info, self.model = cfg, d, info, model
        self.device = next(model.parameters()).device
        if self.lock is None:
            self.made = not os.path.isdir(self.out)
            try:
                os.makedirs(self.out, exist_ok=True)
            except OSError as e:
                raise DataError(
                    f"cannot create the output folder {self.out} ({e.strerror})") from None
            self.lock = lock_folder(self.out)
            refuse_occupied(self.out, self.script)

        # --resume: all of it as the checkpoint left it
        step, self.wall0, self.rows, self.pending, self.logged = 0, 0.0, [], [], False
        if ck := self.ck:
            try:
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["optimizer"])
            except (RuntimeError, ValueError, KeyError):
                raise DataError(f"{self.out}/ckpt.pt does not fit this model and data; pass "
                                f"another --out") from None
            sched.load_state_dict(ck["scheduler"])
            step, self.wall0, self.rows = ck["step"], ck["wall_time"], list(ck["rows"])
            self.pending = [torch.tensor(v) for v in ck["pending_losses"]]  # float32, as saved

            # the RNGs: the next windows and dropout masks as if it had never stopped
            rng.bit_generator.state = json.loads(ck["numpy_rng"])
            torch.set_rng_state(ck["torch_rng"])
            if ck.get("cuda_rng") is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state_all(ck["cuda_rng"])
            print(f"resumed from {self.out}/ckpt.pt at step {step} of {cfg.steps}" + (
                "; the run is finished, so its checkpoint is evaluated and nothing is written"
                if step >= cfg.steps else ""))

        # the run's first lines
        print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} "
              f"steps; normalised with {d.ref_source}\n{self.script} {self.variant}: "
              f"{sum(p.numel() for p in model.parameters()):,} parameters; a training step needs "
              f"about {gb(need)} on {self.device}; run folder {self.out}", flush=True)

        # the clocks: the run's, the log interval's, the probe's (length())
        self.first, self.t_start, self.t_log, self.n_log = step, time.time(), time.time(), 0
        self.t_probe, self.step_s, self.eval_s = None, None, None
        return step

    def wall(self):
        return self.wall0 + time.time() - self.t_start

    def length(self, step):
        """Print the rest of the run's time, from the measured step and evaluation."""
        cfg, timed = self.cfg, self.eval_s is not None

        # the steps and evaluations left
        evals = (cfg.steps // cfg.eval_every - step // cfg.eval_every
                 + bool(cfg.steps % cfg.eval_every))
        train = (cfg.steps - step) * self.step_s
        total = train + evals * (self.eval_s or 0.0)
        each = (f"{duration(self.eval_s)} each" if timed else
                f"{cfg.eval_episodes} episodes (timed at the first)")

        print(f"run length: {cfg.steps - step:,} steps at {1e3 * self.step_s:.0f} ms/step = "
              f"{duration(train)}, plus {evals} evaluation{'s' * (evals != 1)} of {each}: about "
              f"{duration(total)} in all on {self.device}" + (
                  "; more than a few hours on a CPU: --preset cpu is the configuration for a CPU "
                  "(minutes), and the paper's needs a GPU (--device cuda)"
                  if total > 3 * 3600 and self.device.type == "cpu" else ""), flush=True)

    def add_row(self, **values):
        self.rows.append(dict.fromkeys(self.fields, "") | values)

    def log(self, step, loss, lr, **extra):
        """Every step: keep the loss, on its device. Every --log-every steps and at the last: check
        the losses finite, print a line and write their mean (and `extra`) to log.csv."""
        self.pending.append(loss.detach())
        self.n_log += 1

        # a sign of life at the first step; the PROBE_STEPS after it timed (a sync at each end)
        if step == self.first + 1 and step % self.cfg.log_every:
            print(f"step {step:6d} | loss {loss.item():.5f} | first step "
                  f"{time.time() - self.t_log:.1f} s", flush=True)
        if step == self.first + 1:
            loss.item()
            self.t_probe = time.time()
        elif step == self.first + PROBE_STEPS + 1 and step < self.cfg.steps:
            loss.item()
            self.step_s = (time.time() - self.t_probe) / PROBE_STEPS
            self.length(step)

        if step % self.cfg.log_every and step != self.cfg.steps:
            return

        # the log row
        mean = float(np.mean(self.finite_losses(step)))
        self.add_row(step=step, loss=f"{mean:.6f}", lr=f"{lr:.3e}", wall_time=f"{self.wall():.1f}",
                     **extra)

        # the line, with the last evaluation's first target (on Atari 100 is a gamer's return)
        evals, last = [r for r in self.rows if r["eval_return"] != ""], ""
        if evals:
            e = next(r for r in evals if r["step"] == evals[-1]["step"])
            kind = "gamer-normalised" if self.d.family == "atari" else "normalised"
            last = (f" | last eval {e['normalized_score']} ({kind}; return {e['eval_return']})"
                    if e["normalized_score"] else f" | last eval return {e['eval_return']}"
                    ) + f" (step {e['step']})"
        print(f"step {step:6d} | loss {mean:.5f} | lr {lr:.2e} | "
              f"{1e3 * (time.time() - self.t_log) / self.n_log:.1f} ms/step"
              + "".join(f" | {k} {v}" for k, v in extra.items() if v != "") + last, flush=True)
        self.pending, self.t_log, self.n_log = [], time.time(), 0
        self.write_log()

    def finite_losses(self, step):
        """The losses since the last log line (one sync); a DataError at a non-finite one."""
        values = torch.stack(self.pending).float().tolist() if self.pending else []
        if bad := [i for i, v in enumerate(values) if not math.isfinite(v)]:
            raise DataError(
                f"the training loss is {values[bad[0]]} at step {step - len(values) + bad[0] + 1}, "
                f"so the run stops there (its last checkpoint is kept); lower --lr or check the "
                f"data")
        return values

    def write_log(self):
        """log.csv (the first time, config.json too), always before the ckpt.pt it covers."""
        if not self.logged:
            config = dataclasses.asdict(self.cfg) | dict(
                script=self.script, variant=self.variant, info=self.info,
                dataset_id=self.d.dataset_id, device=str(self.device))
            write_atomic(os.path.join(self.out, "config.json"),
                         lambda tmp: pathlib.Path(tmp).write_text(json.dumps(config, indent=2)))
            self.logged = True
        write_atomic(os.path.join(self.out, "log.csv"),
                     lambda tmp: write_csv(tmp, self.fields, self.rows))

    def save(self, step, model, opt, sched, rng, results=()):
        """After an evaluation (results: [(target, evaluate()'s dict)]) or a stop: a log row and
        line per target, log.csv, then ckpt.pt, each atomic; curve.png."""
        for g, res in results:
            self.add_row(step=step, target="" if g is None else f"{g:g}",
                         wall_time=f"{self.wall():.1f}",
                         eval_return=f"{res['returns'].mean():.2f}",
                         eval_return_std=f"{res['returns'].std():.2f}",
                         normalized_score=score(res["normalized"].mean()),
                         normalized_score_std=score(res["normalized"].std()),
                         success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                         steps_to_goal=(f"{res['steps_to_goal'].mean():.1f}" if "success" in res
                                        else ""),
                         greedy=int(self.cfg.greedy) if self.d.discrete else "")
            print(f"eval step {step}{'' if g is None else f' target {g:g}'}: {summarize(res)} "
                  f"({res['seconds']:.0f}s)", flush=True)

        # the first evaluation, timed: the run's length again
        if results and self.eval_s is None and self.step_s is not None:
            self.eval_s = sum(res["seconds"] for _, res in results)
            if step < self.cfg.steps:
                self.length(step)

        # log.csv, then the checkpoint: all an exact resume needs
        self.write_log()
        d, cuda = self.d, self.device.type == "cuda"
        state = dict(script=self.script, model=model.state_dict(), optimizer=opt.state_dict(),
                     scheduler=sched.state_dict(), step=step, wall_time=self.wall(), rows=self.rows,
                     config=dataclasses.asdict(self.cfg), variant=self.variant,
                     dataset_id=d.dataset_id, info=self.info,
                     pending_losses=self.finite_losses(step),
                     numpy_rng=json.dumps(rng.bit_generator.state),
                     torch_rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state_all() if cuda else None,
                     state_mean=torch.from_numpy(d.state_mean),
                     state_std=torch.from_numpy(d.state_std), return_scale=d.return_scale)
        write_atomic(os.path.join(self.out, "ckpt.pt"), lambda tmp: torch.save(state, tmp))

        if results:
            plot_curve(self.rows, os.path.join(self.out, "curve.png"),
                       "a gamer" if d.family == "atari" else "expert",
                       f"{self.script} {self.variant} {d.dataset_id} seed {self.cfg.seed}")

        # the next log interval starts now: the evaluation's time is not in its ms/step
        self.t_log, self.n_log = time.time(), 0

    def finish(self, results):
        """The last line: the first target's final evaluation and its best in log.csv (by score,
        else return; the first of equals). -> the final one's dict."""
        (g, res), best = results[0], ""
        if "success" in res:  # goal-reaching data: steps to the goal (the horizon when missed)
            print(f"maze: steps_to_goal={res['steps_to_goal'].mean():.1f} "
                  f"success_rate={res['success'].mean():.3f}")

        if evals := [r for r in self.rows
                     if r["eval_return"] != "" and r["target"] == ("" if g is None else f"{g:g}")]:
            key = ("normalized_score" if all(r["normalized_score"] != "" for r in evals) else
                   "eval_return")
            b = max(evals, key=lambda r: float(r[key]))
            best = f"best_{key.removeprefix('eval_')}={b[key]} best_step={b['step']} "
        print(f"final: normalized_score={score(res['normalized'].mean()) or 'none'} "
              f"return={res['returns'].mean():.2f} {best}episodes={len(res['returns'])}")
        return res


def score(x):
    """log.csv's normalised score: empty without reference returns (not NaN)."""
    return f"{x:.2f}" if math.isfinite(x) else ""


def plot_curve(rows, path, hundred, title):
    """curve.png: the loss, and per target the normalised score (else the return), success rate
    and steps to the goal."""
    from matplotlib.figure import Figure
    evals = [r for r in rows if r["eval_return"] != ""]
    scored = any(r["normalized_score"] != "" for r in evals)
    panels = [("loss", "training loss", "mean over the log interval"),
              ("normalized_score", "normalised score", f"100 = {hundred}") if scored else
              ("eval_return", "evaluation return", "no reference returns, so no normalised score")]
    if any(r["success_rate"] != "" for r in evals):
        panels += [("success_rate", "success rate (%)", ""),
                   ("steps_to_goal", "steps to the goal", "the horizon if missed")]

    # a panel per column, a line per target
    fig = Figure(figsize=(4.4 * len(panels), 3.6))
    axes = fig.subplots(1, len(panels), squeeze=False)
    for ax, (col, name, note) in zip(axes[0], panels):
        series = defaultdict(list)  # target -> (step, value)
        for r in rows:
            if r[col] != "":
                series[r["target"]].append((int(r["step"]),
                                            float(r[col]) * (100 if col == "success_rate" else 1)))

        for target, pts in series.items():
            ax.plot(*zip(*pts), "o-" if len(pts) < 40 else "-", ms=3,
                    label=f"target {target}" if target else None)
        if not ax.lines:  # the first evaluation came before the first log line
            ax.text(0.5, 0.5, "no logged loss yet", ha="center", va="center",
                    transform=ax.transAxes, color="gray")

        # the loss log-scaled
        ax.set(xlabel="gradient step", ylabel=name,
               yscale="log" if col == "loss" and ax.lines else "linear")
        ax.set_title(name + (f"\n({note})" if note else ""), fontsize=9)
        if any(line.get_label()[:1] != "_" for line in ax.lines):
            ax.legend(fontsize=8)

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def bench_runs(script, cfg, given, presets, tokens, columns=()):
    """--bench: yields a short real run per mode (eager, compiled, on CUDA compiled with bf16
    autocast) in a temporary folder, (its settings, its Run), to train(); a line per mode here."""
    device, eager_ms = pick_device(cfg.device), None
    print(f"bench {script} {variant_name(cfg, presets)} on {device} (torch {torch.__version__}): "
          f"batch {cfg.batch_size}, K={cfg.context}, {tokens:,} tokens per batch, {PROBE_STEPS} "
          f"timed steps", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        for label, compiled, amp in BENCH_MODES[:3 if device.type == "cuda" else 2]:
            # the mode's run, logged and evaluated (1 episode) at its end only
            c = dataclasses.replace(cfg, device=str(device), compile=compiled, amp=amp,
                                    steps=PROBE_STEPS + 2, log_every=10 ** 9, eval_every=10 ** 9,
                                    eval_episodes=1, resume=False,
                                    out=os.path.join(tmp, label.replace(" + ", "_")))

            # the peak memory counted from here; the run's own lines silenced
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            quiet = contextlib.redirect_stdout(io.StringIO())
            with Run(script, c, given, presets, columns, saves=False) as run, quiet:
                yield c, run

            # its line; the peak memory (DeMa's Table 7 "GPU memory usage")
            ms = 1e3 * run.step_s
            eager_ms = eager_ms or ms
            first = run.t_probe - run.t_start
            params = sum(p.numel() for p in run.model.parameters())
            memory = (f", peak GPU memory {torch.cuda.max_memory_allocated() / 2 ** 30:.2f} GiB"
                      if device.type == "cuda" else "")
            print(f"  {label:15s} {ms:9.2f} ms/step {1e3 * tokens / ms:12,.0f} tokens/s   "
                  f"{eager_ms / ms:5.2f}x eager   "
                  + (f"(first step, with compilation: {first:.1f} s)" if compiled
                     else f"({params:,} parameters)")
                  + memory, flush=True)


@contextlib.contextmanager
def one_sentence_errors():
    """main()'s frame: what a user can fix is one sentence on stderr and exit 1; a second Ctrl-C
    exits 130."""
    try:
        yield
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)

    # out of memory (torch's words or the OS's): how much was asked for
    except (MemoryError, RuntimeError) as e:
        words = str(e).lower()
        if not (isinstance(e, MemoryError)
                or re.search(r"out of memory|not enough memory|can't allocate", words)):
            raise
        size = re.search(r"allocate (\d+) bytes|allocate ([\d.]+ \w)ib", words)
        size = (f" (it asked for {gb(int(size[1])) if size[1] else size[2].upper() + 'B'} at once)"
                if size else "")
        print(f"error: out of memory{size}; lower --batch-size, --context or the model's size",
              file=sys.stderr)
        raise SystemExit(1)

    # a figure or GIF into a folder that cannot be written (read-only, full)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC):
            raise
        print(f"error: could not write {e.filename or 'the output'} ({e.strerror}); run the "
              f"analysis on a copy of the run folder that you can write to", file=sys.stderr)
        raise SystemExit(1)

    # a second Ctrl-C in training (StopSignal), or one outside it
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was saved since the last checkpoint", file=sys.stderr)
        raise SystemExit(130)

# ---- report (python evaluate.py report) ----


def _number(v):
    """A log.csv cell: None if empty; a ValueError if not a finite number."""
    if v == "":
        return None
    x = float(v)
    if not math.isfinite(x):
        raise ValueError(v)
    return x


def read_run(folder):
    """-> dict(folder, key=(dataset_id, script, variant), steps, seed, status, evals, last, best):
    evals, the headline target's (log.csv's first) evaluations; last, the final one; best, the best
    score (None if one is missing); status, None if finished, else why it is left out."""
    run = dict(folder=folder, key=None, steps=None, evals=[], status=None, seed=None)
    if missing := [f for f in ("config.json", "log.csv")
                   if not os.path.exists(os.path.join(folder, f))]:
        return run | dict(status=f"no {' or '.join(missing)} (not a run's folder, or one whose "
                                 f"files were moved)")

    # config.json and log.csv (ValueError: bad JSON or bytes)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        run.update(key=(str(cfg["dataset_id"]), str(cfg["script"]), str(cfg["variant"])),
                   steps=int(cfg["steps"]), seed=cfg.get("seed"))
        with open(os.path.join(folder, "log.csv"), newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, ValueError, KeyError, TypeError, csv.Error) as e:
        return run | dict(status=f"unreadable ({type(e).__name__})")

    # its rows, each cell a finite number or empty
    header = rows[0] if rows else []
    if not {"step", "target", "normalized_score", "success_rate", "steps_to_goal"} <= set(header):
        return run | dict(status="unreadable (log.csv lacks the step, target and evaluation "
                                 "columns)")

    parsed = []
    for line, r in enumerate(rows[1:], start=2):
        if len(r) != len(header):
            continue  # a killed process's half-written last line
        row, cells = dict(zip(header, r)), {}
        for k in ("step", "normalized_score", "eval_return", "success_rate", "steps_to_goal"):
            try:
                cells[k] = int(row[k]) if k == "step" else _number(row.get(k, ""))
            except ValueError:
                return run | dict(status=f"unreadable (log.csv line {line}: {k} '{row[k]}' is not "
                                         f"a finite number)")
        parsed.append(cells | dict(target=row["target"], greedy=row.get("greedy", "")))

    # the evaluations (rows with a return; no score without reference returns)
    evals = [r for r in parsed if r["normalized_score"] is not None or r["eval_return"] is not None]
    if not evals:
        return run | dict(status="no evaluation yet")

    # the headline target's: the first in log.csv
    run["evals"] = [r for r in evals if r["target"] == evals[0]["target"]]
    scores = [e["normalized_score"] for e in run["evals"]]
    run.update(last=max(run["evals"], key=lambda e: e["step"]),
               best=None if None in scores else max(scores))
    if run["last"]["greedy"] == "1":  # Atari's argmax (--greedy): grouped apart
        run["key"] = (*run["key"][:2], run["key"][2] + " (greedy)")

    # a run short of its --steps: in progress
    if run["last"]["step"] < run["steps"]:
        step = max(r["step"] for r in parsed)
        # a stopped run saved between log lines: its checkpoint's step (memory-mapped)
        with contextlib.suppress(Exception):
            ck = torch.load(os.path.join(folder, "ckpt.pt"), map_location="cpu",
                            weights_only=True, mmap=True)
            step = int(ck["step"]) or step
        run["status"] = f"in progress at step {step} of {run['steps']}"
    return run


def _mean_std(values, scale=1.0):
    """'mean ± std' (ddof=0) over seeds; '-' if one is missing."""
    if any(v is None for v in values):
        return "-"
    v = scale * np.asarray(values, dtype=np.float64)
    return f"{v.mean():.1f} ± {v.std():.1f}"


REPORT_MARK = "written by python evaluate.py report, which replaces this file while it is unchanged"


def report_mark(text):
    """report.md's last line, after `text`: the mark and text's hash."""
    return f"<!-- {REPORT_MARK}: sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]} -->\n"


def replaceable(path):
    """Whether report() may write `path`: nothing there, or its own report.md (its last line the
    mark and the hash of the lines above) or report.png (the mark in its PNG text), unchanged."""
    if not os.path.lexists(path):
        return True
    try:
        if path.endswith(".png"):
            from PIL import Image
            with Image.open(path) as img:
                return img.format == "PNG" and img.text.get("Comment") == REPORT_MARK
        with open(path, encoding="utf-8", newline="") as f:
            *lines, last = f.read().splitlines(keepends=True)
        return last == report_mark("".join(lines))
    except (OSError, ValueError):  # a folder, not UTF-8 or a PNG, empty
        return False


def report(runs_dir="runs"):
    """The markdown table over the seeds of every run (a folder with config.json and log.csv)
    under runs_dir, grouped by (dataset_id, script, variant) whatever the folder names, printed and
    written to report.md, with report.png there, replacing only the report it wrote there before.
    -> the table's text."""
    if not os.path.isdir(runs_dir):
        raise DataError(
            f"{runs_dir} is not a folder; pass the folder that holds the runs (default: runs)")

    # a report.md or report.png it did not write (or that was changed since) is kept
    if foreign := [os.path.join(runs_dir, name) for name in ("report.md", "report.png")
                   if not replaceable(os.path.join(runs_dir, name))]:
        were, them = ("were", "them") if len(foreign) > 1 else ("was", "it")
        raise DataError(f"{' and '.join(foreign)} {were} not written by evaluate.py report, or "
                        f"{were} changed since, so the report keeps {them}; move or rename {them}, "
                        f"then run the report again")

    # each folder under runs_dir (itself too) with a run's file
    runs = [read_run(root) for root, _, files in sorted(os.walk(runs_dir))
            if set(RUN_FILES) & set(files)]
    if not runs:
        raise DataError(f"{runs_dir} holds no run folder (a folder with config.json and log.csv)")

    # the finished runs by key; a copy of a run: one seed counts once
    groups = defaultdict(list)
    for r in runs:
        if r["status"] is None:
            twin = next((o for o in groups[r["key"]] if o["seed"] == r["seed"]), None)
            if twin is not None:
                r["status"] = (f"seed {r['seed']} again (the table counts "
                               f"{os.path.relpath(twin['folder'], runs_dir)} for it)")
            else:
                groups[r["key"]].append(r)

    # goal-reaching data: the success and steps-to-goal columns
    goal = any(r["last"]["success_rate"] is not None for g in groups.values() for r in g)

    # the table: what its columns hold, then a row per group (last return: StARformer's tables
    # are raw returns)
    lines = ["Score: the normalised score 100 * (return - random) / (reference - random), the "
             "reference being D4RL's expert return (MuJoCo, Adroit, mazes) or, on Atari rows, a "
             "human gamer's (gamer-normalised), of each run's headline target (the first target in "
             "its log.csv): **last** = the final evaluation's, **best** = the best evaluation's "
             "during training, each taken per seed, then mean ± std over seeds (population std, "
             "ddof=0: 0.0 with one seed); **last return** = the final evaluation's raw episode "
             "return, the same way; **target** = the headline target's return-to-go prompt (none "
             "for a model without one)."
             + (" Success and steps to the goal: the final evaluation." if goal else ""), ""]
    columns = ["dataset", "script", "variant", "seeds", "steps", "target", "last score",
               "best score", "last return"]
    columns += ["success % (last)", "steps to goal (last)"] if goal else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]

    for key, g in sorted(groups.items()):
        steps, targets = (sorted({r["steps"] for r in g}),
                          sorted({r["evals"][0]["target"] or "none" for r in g}))
        cells = [*key, str(len(g)),
                 str(steps[0]) if len(steps) == 1 else "differ: " + ", ".join(map(str, steps)),
                 targets[0] if len(targets) == 1 else "differ: " + ", ".join(targets),
                 _mean_std([r["last"]["normalized_score"] for r in g]),
                 _mean_std([r["best"] for r in g]),
                 _mean_std([r["last"]["eval_return"] for r in g])]
        if goal:
            cells += [_mean_std([r["last"]["success_rate"] for r in g], 100.0),
                      _mean_std([r["last"]["steps_to_goal"] for r in g])]
        lines.append("| " + " | ".join(cells) + " |")

    # no finished run; the runs left out, and why
    if not groups:
        lines.append("(no finished run yet)")
    if left_out := [r for r in runs if r["status"] is not None]:
        lines += ["", "Not in the table:"]
        lines += [f"- {os.path.relpath(r['folder'], runs_dir)}: {r['status']}" for r in left_out]

    # printed first: an unwritable folder still gives the table
    text = "\n".join(lines)
    print(text, flush=True)
    try:
        with open(os.path.join(runs_dir, "report.md"), "w", encoding="utf-8", newline="") as f:
            f.write(text + "\n" + report_mark(text + "\n"))
        if groups:
            plot_report(groups, os.path.join(runs_dir, "report.png"))
    except OSError as e:
        raise DataError(
            f"the table above could not be saved in {runs_dir} ({e.strerror or type(e).__name__}); "
            f"pass a folder you can write to, or copy the runs to one") from None
    return text


def plot_report(groups, path):
    """A subplot per dataset: each group's score against step, mean and min..max over seeds."""
    from matplotlib.figure import Figure
    datasets = sorted({key[0] for key in groups})
    cols, rows = min(3, len(datasets)), math.ceil(len(datasets) / 3)
    most = max(sum(k[0] == dataset for k in groups) for dataset in datasets)  # legend lines
    fig = Figure(figsize=(5 * cols, (3.6 + 0.2 * most) * rows))
    axes = fig.subplots(rows, cols, squeeze=False)

    # per group, the mean over seeds in a band from min to max
    for ax, dataset in zip(axes.flat, datasets):
        for key in sorted(k for k in groups if k[0] == dataset):
            by_step = defaultdict(list)
            for run in groups[key]:
                for e in run["evals"]:
                    if e["normalized_score"] is not None:
                        by_step[e["step"]].append(e["normalized_score"])

            steps = sorted(by_step)
            line, = ax.plot(steps, [np.mean(by_step[s]) for s in steps], marker="o", markersize=3,
                            label=f"{key[1]}/{key[2]} ({len(groups[key])} "
                                  f"seed{'s' * (len(groups[key]) > 1)})")
            ax.fill_between(steps, [min(by_step[s]) for s in steps],
                            [max(by_step[s]) for s in steps], color=line.get_color(), alpha=0.2)
        ax.set(title=dataset, xlabel="step", ylabel="normalised score")
        # the legend under the axes
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)

    for ax in axes.flat[len(datasets):]:
        ax.axis("off")
    fig.suptitle("mean over seeds; band: min..max over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, metadata={"Comment": REPORT_MARK})


def main(argv=None):
    p = FlagParser(prog="evaluate.py", description="Evaluation helpers for the model files; from "
                   "the command line: a seed-aggregated report of a folder of runs.")
    sub = p.add_subparsers(dest="command", required=True)
    p_report = sub.add_parser("report", help="one table (printed, RUNS_DIR/report.md) and figure "
                              "(RUNS_DIR/report.png) over every run folder under RUNS_DIR")
    p_report.add_argument("runs_dir", nargs="?", default="runs", metavar="RUNS_DIR",
                          help="default: %(default)s")

    args = p.parse_args(argv)
    try:
        report(args.runs_dir)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
