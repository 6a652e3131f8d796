"""
Minari datasets -> episodes -> training windows. The only data code the model files share.

    d = load_data("hopper-medium")            # short name, or any Minari id ("replica/hopper/medium-v0")
    batch = d.sample(64, 20, rng)              # dict of torch tensors, shapes below

What a window holds (B windows of K steps, left-padded, the last position is always a real step):
    states      (B, K, obs_dim)  float32, normalised (s - mean) / std, 0 where padded
    actions     (B, K, act_dim)  float32, 0 where padded
    rewards     (B, K, 1)        float32, raw r_t, 0 where padded
    rtg         (B, K, 1)        float32, return-to-go R_t = sum_{t' >= t} r_t' (undiscounted), times return_scale
    timesteps   (B, K)           int64, step index inside the episode, 0 where padded
    mask        (B, K)           float32, 1 = real step, 0 = padding
    prev_action (B, act_dim)     a_{t0-1} for the window's first real step t0; the null action (zeros) when t0 = 0
    prev_reward (B, 1)           r_{t0-1}; the null reward 0 when t0 = 0
The null action/reward equal the padding value (0), so the per-step previous action inside a window is simply
cat(prev_action, actions[:, :-1]) along time, padded windows included. evaluate.py uses the same null values.

Episodes from Minari have T+1 observations for T actions: s_t is paired with a_t, r_t for t < T and the final
observation s_T (no action follows it) is dropped. Dict observations (mazes) are flattened to one vector, see
flatten_obs. Data with a NaN or infinite observation, action or reward is refused when it is loaded.

Command line:
    python data.py info hopper-medium        # summary and sampling rate (`python data.py NAME` is short for it)
    python data.py convert-d4rl hopper_medium-v2.hdf5 d4rl/hopper/medium-v2 [--env Hopper-v5]
    python data.py mix hopper-medium hopper-expert local/hopper/medium-expert-v0    # D4RL's medium-expert recipe
"""
import argparse
import contextlib
import io
import os
import re
import shutil
import socket
import sys
import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------------------
# names

_LOCOMOTION = ["halfcheetah", "hopper", "walker2d", "ant"]
SHORT_NAMES = {f"{env}-{level}": f"mujoco/{env}/{level}-v0" for env in _LOCOMOTION for level in ("simple", "medium", "expert")}
SHORT_NAMES.update({f"pointmaze-{m}": f"D4RL/pointmaze/{m}-v2" for m in
                    ("umaze", "umaze-dense", "medium", "medium-dense", "large", "large-dense")})
SHORT_NAMES.update({f"antmaze-{m}": f"D4RL/antmaze/{m}-v1" for m in
                    ("umaze", "umaze-diverse", "medium-play", "medium-diverse", "large-play", "large-diverse")})

# D4RL's reference returns (d4rl/infos.py), used when a dataset carries none (Minari's mujoco/* sets, Minari#323)
D4RL_REF_SCORES = {"Hopper": (-20.272305, 3234.3), "HalfCheetah": (-280.178953, 12135.0),
                   "Walker2d": (1.629008, 4592.3), "Ant": (-325.6, 3879.7)}
# Decision Transformer's evaluation targets (Chen et al. 2021, gym/experiment.py), raw return units
DT_TARGETS = {"Hopper": [3600.0, 1800.0], "HalfCheetah": [12000.0, 6000.0], "Walker2d": [5000.0, 2500.0]}
# AntMaze returns: reward 1 on every step within 0.45 of the goal (gymnasium-robotics maze_v4.compute_reward, sparse),
# and Minari's D4RL/antmaze-v1 data runs as a continuing task that keeps the goal (reset_target=False) up to the time
# limit (700 steps umaze, 1000 medium/large), so a return counts the steps spent at the goal: 0 to several hundred.
NULL_ACTION_VALUE = 0.0  # a_{-1} and r_{-1} at an episode's first step (and the padding value)


class FlagParser(argparse.ArgumentParser):
    """argparse with the project's rule for bad input: one sentence on stderr and exit 1 (argparse's own is the usage
    block and exit 2). The command lines of data.py, evaluate.py and the model files' harness use it."""

    def error(self, message):
        print(f"error: {message} (see python {self.prog} --help)", file=sys.stderr)
        raise SystemExit(1)


class DataError(Exception):
    """A problem the user can fix (unknown name, dataset not available). main() prints it as one sentence."""


def resolve(name):
    """Short name -> Minari id. Strings with a '/' are taken as Minari ids as they are."""
    if "/" in name:
        return name
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    raise DataError(f"unknown environment '{name}'; known names: {', '.join(sorted(SHORT_NAMES))} "
                    f"(or pass any Minari dataset id with --dataset, e.g. mujoco/hopper/medium-v0)")


def is_maze(name):
    """A goal-reaching maze (PointMaze, AntMaze, D4RL maze2d), told from the name before any data is read (presets
    and the papers' per-dataset rows are chosen from it)."""
    return "maze" in name.lower()             # short names (pointmaze-umaze) and Minari ids (D4RL/antmaze/...) alike


# Dict observations are flattened in a fixed key order. PointMaze's `observation` starts with the ball's x, y, so its
# state is observation ++ desired_goal. AntMaze's `observation` leaves out the torso's x, y (they are `achieved_goal`),
# while D4RL's AntMaze state started with them (29-d), so its state is achieved_goal ++ observation ++ desired_goal:
# x, y, the other 27 (105 in v5, with contact forces), goal x, y. desired_goal always comes last (goal_dim entries).
MAZE_KEYS = ("observation", "desired_goal")
ANTMAZE_KEYS = ("achieved_goal", "observation", "desired_goal")


def obs_keys_for(spec):
    """The key order of an env's dict observations. Read from the env's entry point (ant_maze_v4/v5:AntMazeEnv), not
    from array sizes: AntMaze's observation is 27-d in v4, 105-d in v5 and changes with kwargs, while the entry point
    names the robot for the dataset's env and for the eval env alike."""
    return ANTMAZE_KEYS if "ant_maze" in str(getattr(spec, "entry_point", "")) else MAZE_KEYS


def flatten_obs(obs, keys=MAZE_KEYS):
    """Dict observations (PointMaze, AntMaze) -> the `keys` entries concatenated in that order (OfflineData.obs_keys).
    Works on one observation or on arrays with a leading time axis; plain arrays pass through."""
    if isinstance(obs, dict):
        return np.concatenate([np.asarray(obs[k]) for k in keys], axis=-1)
    return np.asarray(obs)


# ----------------------------------------------------------------------------------------------------------------
# loading

def dataset_folder(dataset_id):
    """Where Minari keeps a dataset: <MINARI_DATASETS_PATH, else ~/.minari/datasets>/<namespace>/<name>-vN."""
    from minari.storage.datasets_root_dir import get_dataset_path
    root = os.environ.get("MINARI_DATASETS_PATH", "")
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f"MINARI_DATASETS_PATH={root} is a file, not a folder of datasets; point it at a folder")
    return str(get_dataset_path(dataset_id))


def damaged(dataset_id, detail):
    """The one sentence for a dataset that is there but cannot be read as Minari wrote it."""
    return DataError(f"the dataset '{dataset_id}' at {dataset_folder(dataset_id)} is damaged ({detail}); delete that "
                     f"folder and download it again with `minari download {dataset_id}` (or write it again)")


def _open_minari(dataset_id, download):
    """-> (MinariDataset, its metadata, its episodes), with what a user can hit turned into one sentence: not there,
    not downloadable, or there but damaged."""
    import minari
    folder = dataset_folder(dataset_id)
    if not os.path.exists(os.path.join(folder, "data")):  # minari's own test for "the dataset is here"
        _download(dataset_id, download)
    try:
        ds = minari.load_dataset(dataset_id)
        return ds, ds.storage.metadata, list(ds.iterate_episodes())
    except Exception as e:  # the folder is there but unreadable: h5py's OSError, json's ValueError, a missing key, ...
        detail = str(e).splitlines()[0].split(". ")[0] if str(e) else ""  # its first sentence
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise damaged(dataset_id, type(e).__name__ + (": " + detail if detail else "")) from None


def _download(dataset_id, download):
    import minari
    where = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
    if not download:
        raise DataError(f"dataset '{dataset_id}' is not in {where}; download it with `minari download {dataset_id}` "
                        f"or set MINARI_DATASETS_PATH to a folder that holds it")
    print(f"downloading {dataset_id} (once) into {where} ...", flush=True)
    try:
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", ""):
            socket.getaddrinfo("huggingface.co", 443)  # no network: fail now, not after a minute of retries
        minari.load_dataset(dataset_id, download=True)
    except Exception as e:  # network errors come from several libraries (httpx, huggingface_hub, socket)
        raise DataError(f"dataset '{dataset_id}' is not in {where} and could not be downloaded "
                        f"({'no network' if isinstance(e, OSError) else type(e).__name__}); with a network run "
                        f"`minari download {dataset_id}`, or copy it there and set MINARI_DATASETS_PATH") from None


def _check_finite(source, arrays, ep_start):
    """Refuse NaN/inf: arrays maps a name to an array with one row per step; ep_start (n_episodes,) first rows."""
    for name, a in arrays.items():
        bad = ~np.isfinite(np.asarray(a, dtype=np.float64).reshape(len(a), -1)).all(axis=1)  # (N,) rows with NaN/inf
        if bad.any():
            episode = int(np.searchsorted(ep_start, np.argmax(bad), side="right")) - 1
            raise DataError(f"{source} has NaN or infinite {name}, first in episode {episode}, so it cannot be used")


@dataclass
class OfflineData:
    dataset_id: str
    family: str                 # 'mujoco' | 'maze' | 'other'
    episodes: list              # dicts: observations (T, obs_dim), actions (T, act_dim), rewards (T,), terminated
    env_spec: object            # gymnasium EnvSpec of the evaluation env (None for synthetic_data)
    ref_min: float = float("nan")
    ref_max: float = float("nan")
    ref_source: str = "none"
    return_scale: float = 1.0
    target_returns: list = field(default_factory=list)
    max_ep_len: int = 1000
    goal_reaching: bool = False
    goal_dim: int = 0           # the last goal_dim state entries are desired_goal (dict observations), else 0
    obs_keys: tuple = MAZE_KEYS  # how flatten_obs orders dict observations (obs_keys_for(env_spec))
    state_mean: np.ndarray = field(default=None, repr=False)  # computed from the episodes unless given (keep_top)
    state_std: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        eps = self.episodes
        self.obs_dim = eps[0]["observations"].shape[1]
        self.act_dim = eps[0]["actions"].shape[1]
        lengths = np.array([len(e["actions"]) for e in eps])
        self.ep_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])            # (n_episodes,)
        self.step_ep_start = np.repeat(self.ep_start, lengths)                     # (N,) first row of its episode
        obs = np.concatenate([e["observations"] for e in eps]).astype(np.float64)  # (N, obs_dim)
        actions = np.concatenate([e["actions"] for e in eps]).astype(np.float32)   # (N, act_dim)
        rewards = np.concatenate([e["rewards"] for e in eps]).astype(np.float32)   # (N,)
        _check_finite(f"dataset '{self.dataset_id}'", dict(observations=obs, actions=actions, rewards=rewards),
                      self.ep_start)
        if self.state_mean is None:
            self.state_mean = obs.mean(0).astype(np.float32)
            self.state_std = (obs.std(0) + 1e-6).astype(np.float32)
        # Flat arrays, one row per dataset step; a batch is a handful of fancy-indexing slices of these.
        self.flat = dict(
            states=self.normalize_states(obs),                                      # (N, obs_dim)
            actions=actions,                                                        # (N, act_dim)
            rewards=rewards,                                                        # (N,)
            rtg=np.concatenate([returns_to_go(e["rewards"]) for e in eps]).astype(np.float32) * self.return_scale,
            timesteps=np.concatenate([np.arange(n) for n in lengths]),              # (N,)
        )
        self.episode_returns = np.array([e["rewards"].sum() for e in eps])

    def info(self):
        """What a model is built from; saved with its checkpoint, so that an analysis rebuilds it without the data."""
        return dict(obs_dim=self.obs_dim, act_dim=self.act_dim, max_ep_len=self.max_ep_len, goal_dim=self.goal_dim)

    def normalize_states(self, obs):
        return ((np.asarray(obs, dtype=np.float64) - self.state_mean) / self.state_std).astype(np.float32)

    def normalize_score(self, returns):
        """D4RL-style normalised score: 100 * (R - ref_min) / (ref_max - ref_min)."""
        return 100.0 * (np.asarray(returns, dtype=np.float64) - self.ref_min) / (self.ref_max - self.ref_min)

    def flatten_obs(self, obs):
        """An env's (or the dataset's) observation -> this data's flat state layout."""
        return flatten_obs(obs, self.obs_keys)

    def make_env(self, render=False):
        """The dataset's own evaluation env (Minari's eval_env_spec, else env_spec); render=True: one that renders
        240 x 240 RGB frames offscreen (MuJoCo needs MUJOCO_GL on a machine without a display, evaluate.pick_gl)."""
        import gymnasium as gym
        if self.env_spec is None:
            raise DataError(f"'{self.dataset_id}' is synthetic data and has no environment to evaluate in")
        if self.family == "maze":
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                import gymnasium_robotics   # (its import prints a notice about its Adroit envs)
            gym.register_envs(gymnasium_robotics)
        if not render:
            return gym.make(self.env_spec)
        # the locomotion robots' own "track" camera follows the body (the default camera would watch it walk away)
        track = dict(camera_name="track") if self.env_spec.id.split("-")[0] in D4RL_REF_SCORES else {}
        env = gym.make(self.env_spec, render_mode="rgb_array", width=240, height=240, **track)
        robot = getattr(env.unwrapped, "point_env", None) or getattr(env.unwrapped, "ant_env", None)
        if self.family == "maze" and robot is not None:   # the whole maze from above (its own camera crops the medium)
            m = env.unwrapped.maze                        # read at the first render, so set before it
            robot.mujoco_renderer.default_cam_config = dict(
                distance=1.25 * max(m.map_length, m.map_width) * m.maze_size_scaling, elevation=-90.0, azimuth=90.0,
                lookat=np.zeros(3))
        return env

    def sample(self, batch_size, K, rng):
        """B windows of K steps: the last step is uniform over all dataset steps (so episodes are drawn in
        proportion to their length), and the window reaches back K-1 steps, left-padded at an episode's start.
        End-anchored rather than start-anchored (kzl's DT): every step is the newest token equally often, and the
        padded windows are exactly what evaluation feeds the model during an episode's first K-1 steps."""
        end = rng.integers(0, len(self.step_ep_start), size=batch_size)  # (B,)
        return gather_windows(self.flat, self.step_ep_start[end], end, K)

    def keep_top(self, fraction):
        """%BC (DT Sec. 5.3; kzl gym/experiment.py `pct_traj`): the episodes with the highest returns, best first, as
        long as their steps together stay within `fraction` of all steps (at least the best episode). -> a new
        OfflineData that samples only those; state_mean/state_std stay the full dataset's (as in the DT code), and
        targets, reference scores and max_ep_len are unchanged."""
        if not 0 < fraction <= 1:
            raise DataError(f"the fraction of episodes to keep must lie in (0, 1], got {fraction}")
        lengths = np.array([len(e["actions"]) for e in self.episodes])             # (n_episodes,)
        order = np.argsort(-self.episode_returns, kind="stable")                    # best first, ties in dataset order
        budget = max(int(fraction * lengths.sum()), 1)                              # kzl: max(int(pct * N), 1)
        n = max(1, int(np.searchsorted(np.cumsum(lengths[order]), budget, side="right")))  # whole episodes that fit
        keep = np.sort(order[:n])
        return replace(self, episodes=[self.episodes[i] for i in keep])  # carries state_mean/std over


def returns_to_go(rewards):
    """R_t = sum_{t'>=t} r_t' (undiscounted, DT Sec. 3.1); float64 accumulation."""
    return np.cumsum(np.asarray(rewards, dtype=np.float64)[::-1])[::-1]


def gather_windows(flat, start, end, K):
    """Windows of K rows ending at row `end` (inclusive) that never reach before row `start` (their episode's first
    row): positions before it are padding. flat: dict of arrays with rows as the first axis. start, end: (B,) ints.
    Used for training batches (rows = dataset steps) and by evaluate.py (rows = each env's history)."""
    idx = end[:, None] - (K - 1) + np.arange(K)[None, :]       # (B, K) row of each position
    real = idx >= start[:, None]                               # (B, K) False on the left padding
    idx = np.where(real, idx, 0)
    f = real.astype(np.float32)
    first = np.maximum(end - (K - 1), start)                   # (B,) first real row t0
    has_prev = first > start                                   # a_{t0-1} exists inside the episode
    prev = np.where(has_prev, first - 1, 0)
    batch = dict(
        states=flat["states"][idx] * f[..., None],                              # (B, K, obs_dim)
        actions=flat["actions"][idx] * f[..., None],                            # (B, K, act_dim)
        rewards=(flat["rewards"][idx] * f)[..., None],                          # (B, K, 1)
        rtg=(flat["rtg"][idx] * f)[..., None],                                  # (B, K, 1)
        timesteps=flat["timesteps"][idx] * real,                                # (B, K)
        mask=f,                                                                 # (B, K)
        prev_action=flat["actions"][prev] * has_prev[:, None],                 # (B, act_dim), null = 0
        prev_reward=(flat["rewards"][prev] * has_prev)[:, None],               # (B, 1), null = 0
    )
    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.int64 if k == "timesteps" else np.float32))
            for k, v in batch.items()}


def _episode_arrays(ep, keys, fix_first_goal, dataset_id):
    T = len(ep.actions)
    if T == 0:
        raise damaged(dataset_id, f"episode {ep.id} has no steps")
    obs = ep.observations
    if isinstance(obs, dict):
        obs = {k: np.asarray(v) for k, v in obs.items()}
        if fix_first_goal and len(obs["desired_goal"]) > 2:
            # Minari's maze collection continues across goals: an episode's first observation still shows the
            # previous episode's goal. Evaluation never shows a stale goal, so use step 1's.
            obs["desired_goal"][0] = obs["desired_goal"][1]
        obs = flatten_obs(obs, keys)
    obs = np.asarray(obs, dtype=np.float32).reshape(len(obs), -1)
    actions = np.asarray(ep.actions, dtype=np.float32).reshape(T, -1)
    if len(obs) != T + 1 or len(ep.rewards) != T:
        raise damaged(dataset_id, f"episode {ep.id} has {len(obs)} observations and {len(ep.rewards)} rewards for {T} "
                                  f"actions, where Minari stores T + 1 and T")
    return dict(observations=obs[:T], actions=actions, rewards=np.asarray(ep.rewards, dtype=np.float32),
                terminated=bool(np.asarray(ep.terminations)[-1]))


def load_data(name, download=True):
    """Short name or Minari id -> OfflineData (episodes, state stats, eval env, reference scores, targets)."""
    dataset_id = resolve(name)
    ds, meta, raw_episodes = _open_minari(dataset_id, download)
    spec = getattr(ds, "_eval_env_spec", None) or ds.env_spec  # what recover_environment(eval_env=True) makes
    if spec is None:
        raise DataError(f"dataset '{dataset_id}' records no environment, so it cannot be evaluated")
    entry = str(spec.entry_point)
    family = "maze" if "maze" in entry else "mujoco" if "gymnasium.envs.mujoco" in entry else "other"
    keys = obs_keys_for(spec)
    episodes = [_episode_arrays(ep, keys, family == "maze", dataset_id) for ep in raw_episodes]
    if not episodes:
        raise DataError(f"dataset '{dataset_id}' has no episodes")
    env_key = spec.id.split("-")[0]  # 'Hopper-v5' -> 'Hopper'
    if meta.get("ref_min_score") is not None and meta.get("ref_max_score") is not None:
        ref_min, ref_max, ref_source = float(meta["ref_min_score"]), float(meta["ref_max_score"]), "dataset metadata"
    elif env_key in D4RL_REF_SCORES:
        (ref_min, ref_max), ref_source = D4RL_REF_SCORES[env_key], f"D4RL reference returns for {env_key}"
    else:
        ref_min, ref_max, ref_source = float("nan"), float("nan"), "none (normalised scores are NaN)"
    space = ds.observation_space
    goal_dim = int(np.prod(space["desired_goal"].shape)) if hasattr(space, "spaces") and "desired_goal" in space.spaces else 0
    returns = np.array([e["rewards"].sum() for e in episodes])
    # MuJoCo locomotion: returns / 1000 and DT's targets. Anything else: unscaled, target the best episode return.
    # PointMaze: Minari cuts an episode when its goal is reached, and a dense reward is paid on every step until
    # then, so an episode's return grows with its length and the best return is the slowest path. Its target is the
    # median episode's return, "reach the goal as a typical episode does" (1 on sparse data, where every episode
    # returns 1). Kept on the dataset's scale: evaluation runs on to the horizon (returns in the hundreds), a scale
    # the data never shows. (AntMaze's data keeps its goal to the time limit: there the best return is the fastest.)
    scale = 1e-3 if family == "mujoco" else 1.0
    target = float(np.median(returns) if spec.id.startswith("PointMaze") else returns.max())
    targets = list(DT_TARGETS.get(env_key, [target])) if family == "mujoco" else [target]
    max_len = max(int(spec.max_episode_steps or 0), max(len(e["actions"]) for e in episodes))
    return OfflineData(dataset_id=dataset_id, family=family, episodes=episodes, env_spec=spec, ref_min=ref_min,
                       ref_max=ref_max, ref_source=ref_source, return_scale=scale, target_returns=targets,
                       max_ep_len=max_len, goal_reaching=family == "maze", goal_dim=goal_dim, obs_keys=keys)


def synthetic_data(obs_dim=11, act_dim=3, episodes=8, length=50, seed=0, goal_dim=0):
    """Random episodes with no environment behind them (env_spec None), for benchmarks: MuJoCo-like (family 'mujoco',
    returns scaled by 1e-3, target = the best episode's return); the last goal_dim state entries stay fixed during an
    episode, like a maze goal."""
    assert 0 <= goal_dim <= obs_dim
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(episodes):
        obs = rng.standard_normal((length, obs_dim)).astype(np.float32)            # (T, obs_dim)
        obs[:, obs_dim - goal_dim:] = obs[0, obs_dim - goal_dim:]                   # the goal part is constant
        eps.append(dict(observations=obs, actions=rng.uniform(-1, 1, (length, act_dim)).astype(np.float32),
                        rewards=rng.uniform(0, 2, length).astype(np.float32), terminated=False))
    best = float(max(e["rewards"].sum() for e in eps))
    return OfflineData(dataset_id="synthetic", family="mujoco", episodes=eps, env_spec=None, return_scale=1e-3,
                       target_returns=[best], max_ep_len=length, goal_dim=goal_dim)


# ----------------------------------------------------------------------------------------------------------------
# D4RL HDF5 -> local Minari dataset (python data.py convert-d4rl)

D4RL_ROBOTS = {"halfcheetah": "HalfCheetah-v5", "hopper": "Hopper-v5", "walker2d": "Walker2d-v5", "ant": "Ant-v5"}
D4RL_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")  # and optionally next_observations


def _read_d4rl(path):
    """A D4RL MuJoCo HDF5 file -> dict of arrays with N rows each (rewards, terminals, timeouts flattened to (N,))."""
    import h5py
    if not os.path.isfile(path):
        raise DataError(f"{path} is not a file")
    try:
        with h5py.File(path, "r") as f:
            layout = f"convert-d4rl reads D4RL's MuJoCo layout ({', '.join(D4RL_KEYS)}, optionally next_observations)"
            missing = [k for k in D4RL_KEYS if k not in f]
            if missing:
                raise DataError(f"{path} has no {', '.join(missing)}; {layout}")
            groups = [k for k in (*D4RL_KEYS, "next_observations") if k in f and not isinstance(f[k], h5py.Dataset)]
            if groups:
                raise DataError(f"{path} holds {', '.join(groups)} as an HDF5 group, not an array; {layout}")
            a = {k: np.asarray(f[k][()]) for k in (*D4RL_KEYS, "next_observations") if k in f}
    except OSError as e:  # not HDF5, truncated
        raise DataError(f"{path} cannot be read as HDF5 ({type(e).__name__})") from None
    a["rewards"] = a["rewards"].reshape(-1).astype(np.float64)                  # (N,), also from (N, 1)
    for k in ("terminals", "timeouts"):
        a[k] = a[k].reshape(-1).astype(bool)                                     # (N,), also from 0./1. floats
    n = len(a["rewards"])
    if n == 0:
        raise DataError(f"{path} holds no steps")
    rows = ("observations", "next_observations", "actions")                    # (N, dim) each
    bad = [k for k, v in a.items() if len(v) != n or (k in rows and v.ndim != 2)]
    if bad:
        raise DataError(f"{path} does not hold one row per step in {', '.join(bad)} (rewards has {n} rows)")
    return a


def _d4rl_env(path, dataset_id, env_id):
    """The v5 env of the file's robot (from the file name or the dataset id), or --env."""
    if env_id is not None:
        return env_id
    words = set(re.split(r"[^a-z0-9]+", f"{os.path.basename(path)} {dataset_id}".lower()))
    robots = sorted(words & set(D4RL_ROBOTS))
    if len(robots) != 1:
        raise DataError(f"cannot tell the robot from '{os.path.basename(path)}' and '{dataset_id}' "
                        f"({'found ' + ' and '.join(robots) if robots else 'none of ' + ', '.join(D4RL_ROBOTS)}); "
                        f"pass --env, e.g. --env Hopper-v5")
    return D4RL_ROBOTS[robots[0]]


def convert_d4rl(path, dataset_id, env_id=None):
    """A D4RL MuJoCo HDF5 file -> the local Minari dataset `dataset_id` (under MINARI_DATASETS_PATH), with the
    robot's v5 env as its env and D4RL's reference returns in its metadata. Episodes end at terminals | timeouts; rows
    after the last end form a trailing episode, kept as truncated. Never overwrites. -> the number of episodes."""
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer
    folder = _new_dataset_folder(dataset_id)
    env_id = _d4rl_env(path, dataset_id, env_id)
    a = _read_d4rl(path)
    try:
        env = gym.make(env_id)
    except gym.error.Error as e:
        raise DataError(f"--env {env_id} cannot be made here ({type(e).__name__}); pass a gymnasium MuJoCo env id "
                        f"such as Hopper-v5") from None
    have = (a["observations"].shape[1:], a["actions"].shape[1:])
    want = (env.observation_space.shape, env.action_space.shape)
    if have != want:
        raise DataError(f"{path} has observations {have[0]} and actions {have[1]} but {env_id} has {want[0]} and "
                        f"{want[1]}; pass --env with an env whose spaces match"
                        + (" (D4RL's 111-d Ant observation, with contact forces, matches no v5 env, so D4RL ant files "
                           "are not supported)" if env_id.startswith("Ant") else ""))
    n = len(a["rewards"])
    ends = np.flatnonzero(a["terminals"] | a["timeouts"]) + 1                    # (E,) the row after each episode
    trailing = len(ends) == 0 or ends[-1] < n                                    # rows after the last end
    stops = np.append(ends, n) if trailing else ends                             # (n_episodes,)
    starts = np.concatenate([[0], stops[:-1]])                                   # (n_episodes,)
    _check_finite(path, {k: a[k] for k in ("observations", "actions", "rewards")}, starts)
    if trailing:
        print(f"the last {n - starts[-1]} steps end with neither terminal nor timeout: kept as a truncated episode")
    nxt = a.get("next_observations")
    if nxt is None:
        # After a terminal or timeout D4RL's next row is a new episode's reset state, not the successor, so the final
        # observation s_T is unknown: repeat s_{T-1}. data.py drops s_T (no action follows it); training never sees it.
        print("no next_observations in the file: each episode's final observation repeats its last one "
              "(never used for training)")
    buffers = []
    for i, (s, e) in enumerate(zip(starts, stops)):
        term = a["terminals"][s:e]                                               # (T,)
        trunc = a["timeouts"][s:e] & ~term                                       # (T,)
        trunc[-1] |= not term[-1]                                                # the trailing episode: truncated
        last = nxt[e - 1] if nxt is not None else a["observations"][e - 1]       # s_T
        buffers.append(EpisodeBuffer(id=i, observations=np.concatenate([a["observations"][s:e], last[None]]),
                                     actions=a["actions"][s:e].astype(np.float32), rewards=a["rewards"][s:e].tolist(),
                                     terminations=term.tolist(), truncations=trunc.tolist(), infos={}))
    ref = D4RL_REF_SCORES.get(env_id.split("-")[0], (None, None))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # minari's advice about missing author, eval_env, ... metadata
            minari.create_dataset_from_buffers(
                dataset_id, buffers, env=env_id, ref_min_score=ref[0], ref_max_score=ref[1],
                algorithm_name="D4RL (converted by data.py convert-d4rl)", description=f"converted from {path}")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # no half-written dataset (the folder did not exist before)
        raise
    n_term = sum(bool(b.terminations[-1]) for b in buffers)
    refs = f"reference returns {ref[0]} / {ref[1]}" if ref[0] is not None else "no reference returns"
    print(f"{dataset_id}: {len(buffers)} episodes ({n_term} end by terminal, {len(buffers) - n_term} truncated), "
          f"{n:,} steps, env {env_id}, {refs}, written to {folder}")
    return len(buffers)


# ----------------------------------------------------------------------------------------------------------------
# several Minari datasets of one environment -> one local dataset (python data.py mix)

def _new_dataset_folder(dataset_id):
    """The folder a new local dataset `dataset_id` gets; one sentence if the id is malformed or already taken."""
    from minari.dataset.minari_dataset import parse_dataset_id
    try:
        namespace = parse_dataset_id(dataset_id)[0]
    except (ValueError, TypeError):  # TypeError: minari's parser on an id without -vN
        namespace = None
    if namespace is None:  # load_data reads an id without a namespace as a short name
        raise DataError(f"dataset id '{dataset_id}' must look like namespace/name-vN, e.g. d4rl/hopper/medium-v2")
    folder = dataset_folder(dataset_id)
    if os.path.exists(folder):
        raise DataError(f"dataset '{dataset_id}' already exists at {folder}; choose another id (nothing is overwritten)")
    return folder


def mix(sources, dataset_id):
    """Every episode of each source, source by source, as the new local dataset `dataset_id` (D4RL built
    medium-expert this way: all of medium, then all of expert). The sources must share the environment (as Minari
    compares specs: max_episode_steps may differ, the larger is kept) and the observation and action spaces; the
    evaluation env and the reference returns are carried over, and the sources are listed in the metadata
    (`combined_datasets`, as minari.combine_datasets names them). Episode infos are not copied (no model here reads
    them). -> the number of episodes."""
    import minari
    from minari.data_collector import EpisodeBuffer
    ids = [resolve(s) for s in sources]
    if len(ids) < 2:
        raise DataError("mix needs at least two source datasets, then the new id")
    folder = _new_dataset_folder(dataset_id)
    loaded = [_open_minari(i, download=True) for i in ids]               # (MinariDataset, metadata, episodes) each
    first, (first_ds, first_meta, _) = ids[0], loaded[0]
    spec = first_ds.env_spec
    for i, (ds, meta, _) in zip(ids[1:], loaded[1:]):
        same = spec is not None and ds.env_spec is not None and replace(ds.env_spec, max_episode_steps=None) == \
            replace(spec, max_episode_steps=None)
        if not same:
            raise DataError(f"{first} and {i} are datasets of different environments ("
                            f"{getattr(spec, 'id', None)} and {getattr(ds.env_spec, 'id', None)}); mix takes one "
                            f"environment's datasets")
        if ds.observation_space != first_ds.observation_space or ds.action_space != first_ds.action_space:
            raise DataError(f"{first} and {i} have different observation or action spaces, so their episodes cannot "
                            f"form one dataset")
        for key in ("ref_min_score", "ref_max_score"):
            if meta.get(key) != first_meta.get(key):
                raise DataError(f"{first} and {i} have different reference returns ({key} {first_meta.get(key)} and "
                                f"{meta.get(key)}), so the mix would have no single normalised score")
    steps = [ds.env_spec.max_episode_steps for ds, _, _ in loaded]
    spec = replace(spec, max_episode_steps=None if None in steps else max(steps))
    buffers = [EpisodeBuffer(id=n, observations=ep.observations, actions=ep.actions, rewards=list(ep.rewards),
                             terminations=list(ep.terminations), truncations=list(ep.truncations), infos={})
               for n, ep in enumerate(ep for _, _, episodes in loaded for ep in episodes)]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # minari's advice about missing author, code permalink, ... metadata
            ds = minari.create_dataset_from_buffers(
                dataset_id, buffers, env=spec, eval_env=getattr(first_ds, "_eval_env_spec", None),
                observation_space=first_ds.observation_space, action_space=first_ds.action_space,
                ref_min_score=first_meta.get("ref_min_score"), ref_max_score=first_meta.get("ref_max_score"),
                algorithm_name="data.py mix", description=f"every episode of {', then '.join(ids)}")
        ds.storage.update_metadata({"combined_datasets": ids})
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)  # no half-written dataset (the folder did not exist before)
        raise
    counts = ", ".join(f"{len(episodes)} from {i}" for i, (_, _, episodes) in zip(ids, loaded))
    print(f"{dataset_id}: {len(buffers)} episodes ({counts}), {sum(len(b.actions) for b in buffers):,} steps, env "
          f"{spec.id}, written to {folder}")
    return len(buffers)


# ----------------------------------------------------------------------------------------------------------------
# command line

def info(name):
    """python data.py info NAME: load a dataset, print its summary and the sampling rate (windows/s)."""
    t0 = time.time()
    d = load_data(name)
    print(f"{d.dataset_id}: {len(d.episodes)} episodes, {len(d.flat['rewards'])} steps, obs {d.obs_dim}, "
          f"act {d.act_dim}, loaded in {time.time() - t0:.1f}s; refs {d.ref_min:.1f}/{d.ref_max:.1f} ({d.ref_source}); "
          f"targets {d.target_returns}; max_ep_len {d.max_ep_len}")
    rng = np.random.default_rng(0)
    n, t0 = 200, time.time()
    for _ in range(n):
        d.sample(64, 20, rng)
    dt = time.time() - t0
    print(f"sampling: {n * 64 / dt:,.0f} windows/s ({1e3 * dt / n:.2f} ms per batch of 64 x K=20)")


def main(argv=None):
    p = FlagParser(prog="data.py", description="Minari datasets for the model files: inspect one, turn a D4RL "
                   "MuJoCo HDF5 file into a local Minari dataset, or mix datasets of one environment into one.")
    sub = p.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="load a dataset, print its summary and the sampling rate")
    p_info.add_argument("name", nargs="?", default="hopper-medium",
                        help="short name or Minari id (default: %(default)s)")
    p_conv = sub.add_parser("convert-d4rl", help="D4RL MuJoCo HDF5 file -> local Minari dataset")
    p_conv.add_argument("path", help="the D4RL file, e.g. hopper_medium-v2.hdf5")
    p_conv.add_argument("dataset_id", help="the new dataset's Minari id, e.g. d4rl/hopper/medium-v2")
    p_conv.add_argument("--env", default=None, help="its gymnasium env (default: the robot's v5 env, from the names)")
    p_mix = sub.add_parser("mix", help="datasets of one environment -> one local dataset, episode by episode (D4RL's "
                           "medium-expert: medium, then expert)")
    p_mix.add_argument("sources", nargs="+", metavar="SOURCE", help="short names or Minari ids, in order")
    p_mix.add_argument("dataset_id", help="the new dataset's Minari id, e.g. local/hopper/medium-expert-v0")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in sub.choices:
        argv = ["info", *argv]  # python data.py NAME: short for info NAME
    args = p.parse_args(argv)
    try:
        if args.command == "info":
            info(args.name)
        elif args.command == "mix":
            mix(args.sources, args.dataset_id)
        else:
            convert_d4rl(args.path, args.dataset_id, args.env)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
