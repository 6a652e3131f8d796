"""
Batched rollouts in the dataset's own gymnasium env -> returns, lengths, normalised scores (and, for goal-reaching
mazes, success rate and steps to the goal). The only evaluation code the model files share.

    res = evaluate(act, d, episodes=10, target_return=3600, seed=0, context=20)

`act(batch, live)` is model-agnostic: `batch` holds, for the envs that are still running, the last `context` steps
ending at the current step t, in exactly the format of data.OfflineData.sample (states normalised, left padding,
rtg scaled, prev_action/prev_reward with the same null values). The current step's action and reward are not known
yet and are 0. `live` is the array of env indices the rows belong to (timesteps[:, -1] == 0 marks a fresh episode,
where a recurrent model resets its state). It returns (len(live), act_dim) actions.

The N episodes run in parallel: N plain envs stepped in a list (gymnasium's vector envs auto-reset, which would
start a new episode in a finished slot), one batched act() call per step, each env stopping at its own
termination or truncation. `evaluate_sequential` is the one-episode-at-a-time reference the tests compare against.
"""
import sys
import time

import numpy as np
import torch

from data import flatten_obs, gather_windows


def _as_numpy(a):
    return a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float32)


def evaluate(act, d, episodes, target_return, seed, context, device="cpu", progress=True):
    """Run `episodes` episodes in parallel (env i reset with seed + i) with return-to-go target `target_return`
    (raw units). Returns dict of per-episode arrays: returns, lengths, normalized; goal tasks add success and
    steps_to_goal (first step with info['success'], the horizon when never reached)."""
    n, H, K = episodes, d.max_ep_len, context
    envs = [d.make_env() for _ in range(n)]
    # Per-env history, H + 1 rows each (a row for the step after the last), laid out flat so that
    # data.gather_windows cuts the windows exactly as it does for training batches.
    hist = dict(states=np.zeros((n, H + 1, d.obs_dim), np.float32), actions=np.zeros((n, H + 1, d.act_dim), np.float32),
                rewards=np.zeros((n, H + 1), np.float32), rtg=np.zeros((n, H + 1), np.float32),
                timesteps=np.broadcast_to(np.minimum(np.arange(H + 1), H - 1), (n, H + 1)).copy())
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=seed + i)
        hist["states"][i, 0] = d.normalize_states(flatten_obs(obs))
    hist["rtg"][:, 0] = target_return * d.return_scale
    flat = {k: v.reshape(n * (H + 1), *v.shape[2:]) for k, v in hist.items()}  # views: writes to hist show here
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    low, high = envs[0].action_space.low, envs[0].action_space.high
    t0 = time.time()
    for t in range(H):
        live = np.flatnonzero(~done)
        if len(live) == 0:
            break
        batch = gather_windows(flat, live * (H + 1), live * (H + 1) + t, K)
        with torch.no_grad():
            actions = np.clip(_as_numpy(act({k: v.to(device) for k, v in batch.items()}, live)), low, high)
        for j, i in enumerate(live):
            obs, r, terminated, truncated, info = envs[i].step(actions[j])
            hist["actions"][i, t] = actions[j]
            hist["rewards"][i, t] = r
            hist["rtg"][i, t + 1] = hist["rtg"][i, t] - r * d.return_scale  # RTG_{t+1} = RTG_t - r_t (DT Sec. 3)
            hist["states"][i, t + 1] = d.normalize_states(flatten_obs(obs))
            returns[i] += r
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            done[i] = terminated or truncated
        if progress and sys.stderr.isatty():
            print(f"\r  eval target {target_return:g}: step {t + 1}/{H}, {int((~done).sum())} of {n} running, "
                  f"{time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    for env in envs:
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal)


def _result(d, returns, lengths, success, steps_to_goal):
    res = dict(returns=returns, lengths=lengths, normalized=d.normalize_score(returns))
    if d.goal_reaching:
        res.update(success=success, steps_to_goal=steps_to_goal)
    return res


def evaluate_sequential(act, d, episodes, target_return, seed, context, device="cpu"):
    """Reference: the same protocol, one episode at a time, windows built from plain Python lists (independent of
    data.gather_windows). Slow; kept for the test that the batched path gives the same episodes."""
    n, H, K = episodes, d.max_ep_len, context
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)
    zero_a = np.zeros(d.act_dim, np.float32)
    for i in range(n):
        env = d.make_env()
        obs, _ = env.reset(seed=seed + i)
        S, A, R, G = [d.normalize_states(flatten_obs(obs))], [], [], [target_return * d.return_scale]
        low, high = env.action_space.low, env.action_space.high
        for t in range(H):
            lo = max(0, t + 1 - K)                  # window = steps lo..t, padded on the left to K
            pad = K - (t + 1 - lo)
            A_win = A[lo:t] + [zero_a]              # a_t unknown -> 0
            R_win = R[lo:t] + [0.0]
            batch = dict(
                states=[np.zeros(d.obs_dim, np.float32)] * pad + S[lo:t + 1],
                actions=[zero_a] * pad + A_win,
                rewards=[[0.0]] * pad + [[r] for r in R_win],
                rtg=[[0.0]] * pad + [[g] for g in G[lo:t + 1]],
                timesteps=[0] * pad + list(range(lo, t + 1)),
                mask=[0.0] * pad + [1.0] * (t + 1 - lo),
                prev_action=A[lo - 1] if lo > 0 else zero_a,
                prev_reward=[R[lo - 1] if lo > 0 else 0.0],
            )
            batch = {k: torch.tensor(np.array([v]), dtype=torch.int64 if k == "timesteps" else torch.float32,
                                     device=device) for k, v in batch.items()}
            with torch.no_grad():
                a = np.clip(_as_numpy(act(batch, np.array([i])))[0], low, high)
            obs, r, terminated, truncated, info = env.step(a)
            A.append(a.astype(np.float32))
            R.append(float(np.float32(r)))
            G.append(np.float32(G[-1] - r * d.return_scale))
            S.append(d.normalize_states(flatten_obs(obs)))
            returns[i] += r
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            if terminated or truncated:
                break
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal)


def summarize(res):
    """One line: mean +- std of the normalised score and return (and maze success / steps to the goal)."""
    s = (f"normalized_score={res['normalized'].mean():.1f}±{res['normalized'].std():.1f} "
         f"return={res['returns'].mean():.1f}±{res['returns'].std():.1f} length={res['lengths'].mean():.0f}")
    if "success" in res:
        s += f" success={100 * res['success'].mean():.0f}% steps_to_goal={res['steps_to_goal'].mean():.0f}"
    return s
