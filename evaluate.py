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

Command line:
    python evaluate.py report [RUNS_DIR]     # a folder of runs -> seed-aggregated table and figure (end of this file)
"""
import csv
import json
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch

from data import DataError, FlagParser, gather_windows


def _as_numpy(a):
    return a.detach().float().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float32)


def evaluate(act, d, episodes, target_return, seed, context, device="cpu", progress=True):
    """Run `episodes` episodes in parallel (env i reset with seed + i) with return-to-go target `target_return`
    (None for a model that takes no return target: the rtg column is then 0)
    (raw units). Returns dict of per-episode arrays: returns, lengths, normalized; goal tasks add success,
    steps_to_goal (first step with info['success'], the horizon when never reached) and positions (a list of
    (length + 1, 2) arrays: the agent's x, y after reset and after each step, for drawing paths).

    The loop is the DT paper's Algorithm 1 (evaluation), for n envs at once (timesteps count from 0 here):
        R, s, a, t, done = [target_return], [env.reset()], [], [0], False    # the RTG prompt at reset
        while not done:
            action = DecisionTransformer(R, s, a, t)[-1]                      # one batched act() call for all live envs
            new_s, r, done, _ = env.step(action)
            R = R + [R[-1] - r]                                               # RTG_{t+1} = RTG_t - r_t
            s, a, t = s + [new_s], a + [action], t + [t[-1] + 1]              # append the new state
            R, s, a, t = R[-K:], s[-K:], a[-K:], t[-K:]                       # the rolling context of the last K steps
    """
    n, H, K = episodes, d.max_ep_len, context
    envs = [d.make_env() for _ in range(n)]
    # Per-env history, H + 1 rows each (a row for the step after the last): states, actions, rewards, RTG, timesteps.
    hist = dict(states=np.zeros((n, H + 1, d.obs_dim), np.float32), actions=np.zeros((n, H + 1, d.act_dim), np.float32),
                rewards=np.zeros((n, H + 1), np.float32), rtg=np.zeros((n, H + 1), np.float32),
                timesteps=np.broadcast_to(np.minimum(np.arange(H + 1), H - 1), (n, H + 1)).copy())
    positions = [[] for _ in range(n)]
    for i, env in enumerate(envs):
        obs, _ = env.reset(seed=seed + i)
        hist["states"][i, 0] = d.normalize_states(d.flatten_obs(obs))           # s_0
        positions[i].append(_position(obs))
    hist["rtg"][:, 0] = (target_return or 0.0) * d.return_scale                 # R_0: the prompt (None: no RTG, 0)
    # The same memory seen as one flat array of n * (H + 1) rows: env i's history is the block of rows
    # i*(H+1) .. i*(H+1)+H, so row i*(H+1) + t is env i's step t. data.gather_windows then cuts each live env's last
    # K steps exactly as it cuts training windows, with the block's first row as the episode start (left padding
    # before it). These are views: writes to hist show here.
    flat = {k: v.reshape(n * (H + 1), *v.shape[2:]) for k, v in hist.items()}  # (n * (H + 1), ...)
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)
    done = np.zeros(n, dtype=bool)
    low, high = envs[0].action_space.low, envs[0].action_space.high
    t0 = time.time()
    for t in range(H):
        live = np.flatnonzero(~done)                                            # (L,) envs still running
        if len(live) == 0:
            break
        # the rolling context: rows t-K+1 .. t of each live env's block (episode start row live*(H+1))
        batch = gather_windows(flat, live * (H + 1), live * (H + 1) + t, K)     # (L, K, ...) tensors
        with torch.no_grad():  # one batched call: action = DecisionTransformer(R, s, a, t)[-1] for every live env
            actions = np.clip(_as_numpy(act({k: v.to(device) for k, v in batch.items()}, live)), low, high)  # (L, act)
        for j, i in enumerate(live):
            obs, r, terminated, truncated, info = envs[i].step(actions[j])
            hist["actions"][i, t] = actions[j]
            hist["rewards"][i, t] = r
            hist["rtg"][i, t + 1] = hist["rtg"][i, t] - r * d.return_scale  # RTG_{t+1} = RTG_t - r_t (DT Sec. 3)
            hist["states"][i, t + 1] = d.normalize_states(d.flatten_obs(obs))  # append the new state s_{t+1}
            positions[i].append(_position(obs))
            returns[i] += r
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            done[i] = terminated or truncated
        if progress and sys.stderr.isatty():
            print(f"\r  eval target {target_return}: step {t + 1}/{H}, {int((~done).sum())} of {n} running, "
                  f"{time.time() - t0:.0f}s", end="", file=sys.stderr, flush=True)
    if progress and sys.stderr.isatty():
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    for env in envs:
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal, positions)


def _position(obs):
    """The agent's x, y: achieved_goal of a maze's dict observation, else the first two entries (PointMaze layout)."""
    return np.asarray(obs["achieved_goal"] if isinstance(obs, dict) else obs, dtype=np.float64)[:2]


def _result(d, returns, lengths, success, steps_to_goal, positions):
    res = dict(returns=returns, lengths=lengths, normalized=d.normalize_score(returns))
    if d.goal_reaching:
        res.update(success=success, steps_to_goal=steps_to_goal, positions=[np.array(p) for p in positions])
    return res


def evaluate_sequential(act, d, episodes, target_return, seed, context, device="cpu"):
    """Reference: the same protocol, one episode at a time, windows built from plain Python lists (independent of
    data.gather_windows). Slow; kept for the test that the batched path gives the same episodes."""
    n, H, K = episodes, d.max_ep_len, context
    returns, lengths = np.zeros(n), np.zeros(n, dtype=np.int64)
    success, steps_to_goal = np.zeros(n, dtype=bool), np.full(n, H, dtype=np.int64)
    zero_a = np.zeros(d.act_dim, np.float32)
    positions = []
    for i in range(n):
        env = d.make_env()
        obs, _ = env.reset(seed=seed + i)
        S, A, R, G = [d.normalize_states(d.flatten_obs(obs))], [], [], [(target_return or 0.0) * d.return_scale]
        positions.append([_position(obs)])
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
            S.append(d.normalize_states(d.flatten_obs(obs)))
            positions[i].append(_position(obs))
            returns[i] += r
            lengths[i] = t + 1
            if info.get("success", False) and not success[i]:
                success[i], steps_to_goal[i] = True, t + 1
            if terminated or truncated:
                break
        env.close()
    return _result(d, returns, lengths, success, steps_to_goal, positions)


def summarize(res):
    """One line: mean +- std of the normalised score and return (and maze success / steps to the goal)."""
    s = (f"normalized_score={res['normalized'].mean():.1f}±{res['normalized'].std():.1f} "
         f"return={res['returns'].mean():.1f}±{res['returns'].std():.1f} length={res['lengths'].mean():.0f}")
    if "success" in res:
        s += f" success={100 * res['success'].mean():.0f}% steps_to_goal={res['steps_to_goal'].mean():.0f}"
    return s


# ================================================================================================================
# report: python evaluate.py report [RUNS_DIR] -> one table over seeds (printed and RUNS_DIR/report.md) and one figure
# (RUNS_DIR/report.png). A run folder is any folder under RUNS_DIR with config.json (every Config field plus script,
# variant, dataset_id) and log.csv (training rows, and evaluation rows with target and normalized_score filled), as the
# model files write them. Runs are grouped by (dataset_id, script, variant), whatever the folder names say.

def find_runs(runs_dir):
    """Every folder under runs_dir (itself included) holding config.json and log.csv, sorted."""
    return sorted(root for root, _, files in os.walk(runs_dir) if {"config.json", "log.csv"} <= set(files))


def _number(v):
    return float(v) if v != "" else None


def read_run(folder):
    """-> dict(folder, key=(dataset_id, script, variant), steps, evals, status). evals: the evaluations of the
    headline target (the first target in log.csv) as dicts step, normalized_score, eval_return, success_rate,
    steps_to_goal.
    status: None for a finished run, else why it is left out of the averages."""
    run = dict(folder=folder, key=None, steps=None, evals=[], status=None)
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
        run.update(key=(str(cfg["dataset_id"]), str(cfg["script"]), str(cfg["variant"])), steps=int(cfg["steps"]))
        with open(os.path.join(folder, "log.csv"), newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, ValueError, KeyError, TypeError, csv.Error) as e:  # ValueError: bad JSON, undecodable bytes
        return run | dict(status=f"unreadable ({type(e).__name__})")
    header = rows[0] if rows else []
    if not {"step", "target", "normalized_score", "success_rate", "steps_to_goal"} <= set(header):
        return run | dict(status="unreadable (log.csv lacks the step, target and evaluation columns)")
    parsed = []
    for r in rows[1:]:
        if len(r) != len(header):
            continue  # a half-written line (a killed process): skipped
        row = dict(zip(header, r))
        try:
            parsed.append(dict(step=int(row["step"]), target=row["target"],
                               normalized_score=_number(row["normalized_score"]),
                               eval_return=_number(row.get("eval_return", "")),
                               success_rate=_number(row["success_rate"]), steps_to_goal=_number(row["steps_to_goal"])))
        except ValueError:
            continue  # a malformed number: skipped as well
    evals = [r for r in parsed if r["normalized_score"] is not None]
    if not evals:
        return run | dict(status="no evaluation yet")
    run["evals"] = [r for r in evals if r["target"] == evals[0]["target"]]  # the headline target
    if max(r["step"] for r in run["evals"]) < run["steps"]:
        run["status"] = f"in progress at step {max(r['step'] for r in parsed)} of {run['steps']}"
    return run


def _last(run):
    """A run's final evaluation (of its headline target)."""
    return max(run["evals"], key=lambda e: e["step"])


def _mean_std(values, scale=1.0):
    """'mean ± std' over seeds, population std (ddof=0, so 0.0 with one seed); '-' when any value is missing."""
    if any(v is None for v in values):
        return "-"
    v = scale * np.asarray(values, dtype=np.float64)
    return f"{v.mean():.1f} ± {v.std():.1f}"


def report(runs_dir="runs"):
    """The markdown report of every run under runs_dir; also written to runs_dir/report.md, with runs_dir/report.png.
    Per (dataset_id, script, variant) over its finished seeds: the last and the best evaluation of each seed's
    headline target, the last evaluation's raw return (StARformer's tables are raw returns), and for goal-reaching
    data the last evaluation's success rate and steps to the goal."""
    if not os.path.isdir(runs_dir):
        raise DataError(f"{runs_dir} is not a folder; pass the folder that holds the runs (default: runs)")
    runs = [read_run(f) for f in find_runs(runs_dir)]
    if not runs:
        raise DataError(f"{runs_dir} holds no run folder (a folder with config.json and log.csv)")
    groups = defaultdict(list)
    for r in runs:
        if r["status"] is None:
            groups[r["key"]].append(r)
    goal = any(_last(r)["success_rate"] is not None for g in groups.values() for r in g)
    lines = ["Normalised score (D4RL: 100 * (return - random) / (expert - random)) of each run's headline target "
             "(the first target in its log.csv): **last** = the final evaluation, **best** = the best evaluation "
             "during training, each taken per seed, then mean ± std over seeds (population std, ddof=0: 0.0 with one "
             "seed); **last return** = the final evaluation's raw episode return, the same way."
             + (" Success and steps to the goal: the final evaluation." if goal else ""), ""]
    columns = ["dataset", "script", "variant", "seeds", "steps", "last score", "best score", "last return"]
    columns += ["success % (last)", "steps to goal (last)"] if goal else []
    lines += ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for key in sorted(groups):
        g = groups[key]
        steps = sorted({r["steps"] for r in g})
        cells = [*key, str(len(g)), str(steps[0]) if len(steps) == 1 else "differ: " + ", ".join(map(str, steps)),
                 _mean_std([_last(r)["normalized_score"] for r in g]),
                 _mean_std([max(e["normalized_score"] for e in r["evals"]) for r in g]),
                 _mean_std([_last(r)["eval_return"] for r in g])]
        if goal:
            cells += [_mean_std([_last(r)["success_rate"] for r in g], 100.0),
                      _mean_std([_last(r)["steps_to_goal"] for r in g])]
        lines.append("| " + " | ".join(cells) + " |")
    if not groups:
        lines.append("(no finished run yet)")
    left_out = [r for r in runs if r["status"] is not None]
    if left_out:
        lines += ["", "Not in the table:"]
        lines += [f"- {os.path.relpath(r['folder'], runs_dir)}: {r['status']}" for r in left_out]
    text = "\n".join(lines)
    with open(os.path.join(runs_dir, "report.md"), "w") as f:
        f.write(text + "\n")
    if groups:
        plot_report(groups, os.path.join(runs_dir, "report.png"))
    return text


def plot_report(groups, path):
    """One subplot per dataset: each group's normalised score vs step, mean over seeds, band = min..max over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    datasets = sorted({key[0] for key in groups})
    cols = min(3, len(datasets))
    rows = -(-len(datasets) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, dataset in zip(axes.flat, datasets):
        for key in sorted(k for k in groups if k[0] == dataset):
            by_step = defaultdict(list)
            for run in groups[key]:
                for e in run["evals"]:
                    by_step[e["step"]].append(e["normalized_score"])
            steps = sorted(by_step)
            line, = ax.plot(steps, [np.mean(by_step[s]) for s in steps], marker="o", markersize=3,
                            label=f"{key[1]}/{key[2]} ({len(groups[key])} seeds)")
            ax.fill_between(steps, [min(by_step[s]) for s in steps], [max(by_step[s]) for s in steps],
                            color=line.get_color(), alpha=0.2)
        ax.set(title=dataset, xlabel="step", ylabel="normalised score")
        ax.legend(fontsize=8)
    for ax in axes.flat[len(datasets):]:
        ax.axis("off")
    fig.suptitle("mean over seeds; band: min..max over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------------------------
# command line

def main(argv=None):
    p = FlagParser(prog="evaluate.py", description="Evaluation helpers for the model files; from the command line: "
                   "a seed-aggregated report of a folder of runs.")
    sub = p.add_subparsers(dest="command", required=True)
    p_report = sub.add_parser("report", help="one table (printed, RUNS_DIR/report.md) and figure (RUNS_DIR/report.png) "
                              "over every run folder under RUNS_DIR")
    p_report.add_argument("runs_dir", nargs="?", default="runs", metavar="RUNS_DIR", help="default: %(default)s")
    args = p.parse_args(argv)
    try:
        print(report(args.runs_dir))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
