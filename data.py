"""
Minari datasets -> episodes -> training windows: the only data code the model files share.

    d = load_data("hopper-medium")    # a short name or any Minari id ("D4RL/pen/human-v2")
    batch = d.sample(64, 20, rng)     # dict of torch tensors, shapes below

Above the "Dataset tools" fence: what the model files and evaluate.py use. "kzl PATH#Lnn" is DT's
official code, https://github.com/kzl/decision-transformer/blob/e2d82e68f330c00f763507b3b01d774740bee53f/PATH#Lnn

A batch: B windows of K steps, left-padded with 0 in every entry (the last step is always real):
    states      (B, K, obs_dim)  float32, normalised (s - mean) / std
    actions     (B, K, act_dim)  float32
    rewards     (B, K, 1)        float32, raw r_t
    rtg         (B, K, 1)        float32, R_t = sum_{t' >= t} r_t' (undiscounted) x return_scale
    timesteps   (B, K)           int64, the step's index in its episode
    mask        (B, K)           float32, 1 = real step, 0 = padding
    prev_action (B, act_dim)     a_{t0-1} for the window's first real step t0; zeros when t0 = 0
    prev_reward (B, 1)           r_{t0-1}; 0 when t0 = 0
The null action and reward are the padding's 0, so a window's per-step previous action is
cat(prev_action, actions[:, :-1]) along time, padded windows included (as in evaluate.py).

Atari (family 'atari': image states, discrete actions) differs in two entries:
    states      (B, K, 4, 84, 84) uint8, the last 4 frames up to each step (0 before the episode's
                first), stacked when the batch is drawn from one 84x84 frame per step
    actions     (B, K) int64 action index; prev_action (B,) int64
A state is divided by 255 inside the model. Atari data: Minari's atari/* RGB screens (made 84x84
grayscale at load) or DQN-replay's frames (convert-dqn-replay).

Command line: python data.py {info,convert-d4rl,convert-dqn-replay,mix,make} --help
"""
import argparse
import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import urllib.parse
from dataclasses import dataclass, field, replace

# the command line: signals wait for main() (in numpy's and torch's threads too)
if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))

import numpy as np
import torch

# ---- names and tables ----

_LOCOMOTION = ["halfcheetah", "hopper", "walker2d", "ant"]
SHORT_NAMES = {f"{env}-{level}": f"mujoco/{env}/{level}-v0" for env in _LOCOMOTION
               for level in ("simple", "medium", "expert")}
SHORT_NAMES.update({f"pointmaze-{m}": f"D4RL/pointmaze/{m}-v2" for m in
                    ("umaze", "umaze-dense", "medium", "medium-dense", "large", "large-dense")})
SHORT_NAMES.update({f"antmaze-{m}": f"D4RL/antmaze/{m}-v1" for m in ("umaze", "umaze-diverse",
                    "medium-play", "medium-diverse", "large-play", "large-diverse")})
# Adroit (AdroitHand*-v1): D4RL's v1 data re-recorded by Minari (LSDT's Table 9: v0 human, cloned)
ADROIT_TASKS = ("pen", "hammer", "door", "relocate")
SHORT_NAMES.update({f"{t}-{level}": f"D4RL/{t}/{level}-v2" for t in ADROIT_TASKS
                    for level in ("human", "cloned", "expert")})
# The Atari games of DT (Breakout, Qbert, Pong, Seaquest), StARformer (+ Assault, Boxing) and DeMa
# (+ Asterix, Frostbite, Gopher) as Minari's expert sets (the papers' data: convert-dqn-replay)
ATARI_GAMES = ("breakout", "qbert", "pong", "seaquest", "assault", "boxing", "asterix", "frostbite",
               "gopher")
SHORT_NAMES.update({f"{g}-expert": f"atari/{g}/expert-v0" for g in ATARI_GAMES})

# D4RL's reference returns (d4rl/infos.py) where a dataset carries none (mujoco/*: Minari#323)
D4RL_REF_SCORES = {"Hopper": (-20.272305, 3234.3), "HalfCheetah": (-280.178953, 12135.0),
                   "Walker2d": (1.629008, 4592.3), "Ant": (-325.6, 3879.7)}
# Adroit's, likewise (apart: D4RL_REF_SCORES' keys name the locomotion robots); d4rl/infos.py
# has pen's minimum +96.262799, door's and relocate's maxima 2880.5693 and 4233.8778
ADROIT_REF_SCORES = {"AdroitHandPen": (-96.262264, 3076.8331),
                     "AdroitHandHammer": (-274.856578, 12794.1),
                     "AdroitHandDoor": (-56.512833, 2880.5697),
                     "AdroitHandRelocate": (-6.425911, 4233.8773)}
# DT's evaluation targets, raw return units (kzl gym/experiment.py#L41-L51)
DT_TARGETS = {"Hopper": [3600.0, 1800.0], "HalfCheetah": [12000.0, 6000.0],
              "Walker2d": [5000.0, 2500.0]}
# Atari's return-to-go prompts, raw return units: DT's (kzl atari/mingpt/trainer_atari.py#L161-L168)
# and DeMa's Table 9 (dema.py)
DT_ATARI_TARGETS = {"Breakout": 90.0, "Qbert": 14000.0, "Pong": 20.0, "Seaquest": 1150.0}
DEMA_ATARI_TARGETS = {"Breakout": 90.0, "Qbert": 12000.0, "Pong": 20.0, "Seaquest": 1750.0,
                      "Asterix": 700.0, "Frostbite": 1450.0, "Assault": 1200.0, "Gopher": 6500.0}
# Atari's normalised score, 100 (R - random) / (gamer - random), with these (random, gamer) returns
# where a dataset carries none (DeMa's Table 19, after Ye et al. 2021); other games score raw
ATARI_GAMER_SCORES = {"Breakout": (1.7, 30.5), "Qbert": (163.9, 13455.0), "Pong": (-20.7, 14.6),
                      "Seaquest": (68.4, 42054.7), "Asterix": (210.0, 8503.0),
                      "Frostbite": (65.0, 4335.0), "Assault": (222.0, 742.0),
                      "Gopher": (258.0, 2412.0)}
FRAME_STACK = 4  # frames in an Atari state (DQN's, every paper's)

# What `python data.py make NAME` makes offline (below the fence) -> what it stands in for; a
# missing dataset's message names the make. Hopper's ARS reaches expert in a make's minutes,
# HalfCheetah's medium only (make's LOCOMOTION).
MAKE_NAMES = {f"pointmaze-{maze}{dense}": f"D4RL/pointmaze/{maze}{dense}-v2"
              for maze in ("umaze", "medium", "large") for dense in ("", "-dense")}
MAKE_NAMES["breakout-mixed"] = "1% of DQN-replay Breakout (the DT paper's data)"
for _robot, _levels in (("hopper", ("medium", "medium-replay", "expert", "medium-expert")),
                        ("halfcheetah", ("medium", "medium-replay"))):
    for _level in _levels:
        MAKE_NAMES[f"{_robot}-{_level}"] = (f"mujoco/{_robot}/{_level}-v0" if "-" not in _level
                                            else f"D4RL's {_robot}-{_level}-v2")


def _made_id(name):
    """make's default id: pointmaze-medium-dense -> made/pointmaze/medium-dense-v0."""
    return "made/" + name.replace("-", "/", 1) + "-v0"


class FlagParser(argparse.ArgumentParser):
    """argparse whose bad input is one sentence on stderr and exit 1, and which takes a negative
    number in any spelling (-1e-3, -inf, -nan) as a flag's value, not as a flag."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (argparse's own pattern knows only -N and -N.N)
        self._negative_number_matcher = re.compile(
            r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)

    def error(self, message):
        print(f"error: {message} (see python {self.prog} --help)", file=sys.stderr)
        raise SystemExit(1)


class DataError(Exception):
    """A problem the user can fix; main() prints it as one sentence."""


def resolve(name):
    """Short name -> Minari id; a string with a '/' is one already."""
    if "/" in name:
        return name
    if name in SHORT_NAMES:
        return SHORT_NAMES[name]
    raise DataError(f"unknown environment '{name}'; known names: {', '.join(sorted(SHORT_NAMES))} "
                    f"(or pass any Minari dataset id with --dataset, e.g. mujoco/hopper/medium-v0)")


def is_maze(name):
    """A goal-reaching maze (PointMaze, AntMaze, D4RL maze2d), told by its name."""
    return "maze" in name.lower()


def is_atari(name):
    """Atari data (an atari/* id, or a local dataset with ale-py's env)? Told before reading it."""
    try:
        dataset_id = resolve(name)
        if dataset_id.startswith("atari/"):
            return True
        with open(os.path.join(dataset_folder(dataset_id), "data", "metadata.json")) as f:
            return "ale_py" in str(json.load(f).get("env_spec", ""))
    except (DataError, OSError, ValueError, AttributeError):
        return False


# Dict observations are flattened in a fixed key order, desired_goal (goal_dim entries) last.
# PointMaze's observation starts with the ball's x, y; AntMaze's leaves out the torso's x, y (its
# achieved_goal), with which D4RL's AntMaze state began, so they go first.
MAZE_KEYS = ("observation", "desired_goal")
ANTMAZE_KEYS = ("achieved_goal", "observation", "desired_goal")


def obs_keys_for(spec):
    """The key order of an env's dict observations, told by its entry point (ant_maze_v4/v5), not
    by sizes (AntMaze's observation is 27-d in v4, 105-d in v5, and kwargs change it)."""
    return ANTMAZE_KEYS if "ant_maze" in str(getattr(spec, "entry_point", "")) else MAZE_KEYS


def flatten_obs(obs, keys=MAZE_KEYS):
    """Dict observations -> the `keys` entries concatenated (time axis or not); arrays pass."""
    if isinstance(obs, dict):
        return np.concatenate([np.asarray(obs[k]) for k in keys], axis=-1)
    return np.asarray(obs)

# ---- a training step's data ----


def load_data(name, download=True, delayed_reward=False):
    """Short name or Minari id -> OfflineData. delayed_reward: DT's Table 5, DeMa's Table 13."""
    dataset_id = resolve(name)
    ds, meta, raw_episodes = _open_minari(dataset_id, download)
    spec = getattr(ds, "_eval_env_spec", None) or ds.env_spec  # Minari's eval env spec
    if spec is None:
        raise DataError(f"dataset '{dataset_id}' records no environment, so it cannot be evaluated")

    # the family and its spaces
    entry = str(spec.entry_point)
    family = ("maze" if "maze" in entry else "mujoco" if "gymnasium.envs.mujoco" in entry else
              "atari" if entry.startswith("ale_py") else "other")
    keys = obs_keys_for(spec)
    space, n_actions, raw, frames = ds.observation_space, 0, False, None
    if family == "atari":
        n_actions, raw, frames = _atari_spaces(dataset_id, space, ds.action_space, spec)

    episodes = [_episode_arrays(ep, keys, family == "maze", dataset_id, frames)
                for ep in raw_episodes]
    if not episodes:
        raise DataError(f"dataset '{dataset_id}' has no episodes")

    # the normalised score's reference returns ('ALE/Breakout-v5' -> 'Breakout')
    env_key = spec.id.split("/")[-1].split("-")[0]
    tables = D4RL_REF_SCORES | ADROIT_REF_SCORES
    if meta.get("ref_min_score") is not None and meta.get("ref_max_score") is not None:
        ref_min, ref_max = float(meta["ref_min_score"]), float(meta["ref_max_score"])
        ref_source = "dataset metadata"
    elif env_key in tables:
        (ref_min, ref_max), ref_source = tables[env_key], f"D4RL reference returns for {env_key}"
    elif family == "atari" and env_key in ATARI_GAMER_SCORES:
        ref_min, ref_max = ATARI_GAMER_SCORES[env_key]
        ref_source = f"random and gamer returns for {env_key}"
    else:
        ref_min, ref_max = float("nan"), float("nan")
        ref_source = "none (normalised scores are NaN)"

    has_goal = "desired_goal" in getattr(space, "spaces", {})
    goal_dim = int(np.prod(space["desired_goal"].shape)) if has_goal else 0

    # MuJoCo locomotion: returns / 1000, DT's targets; else unscaled, the best return as target
    # (LSDT's Table 13 scales AntMaze, Maze2d, Adroit by 1, gives no Adroit target). PointMaze's
    # episodes end at the goal: the best dense return is a slow path's (README: against the median).
    returns = np.array([e["rewards"].sum() for e in episodes])
    scale = 1e-3 if family == "mujoco" else 1.0
    target = float(returns.max())
    targets = (list(DT_TARGETS.get(env_key, [target])) if family == "mujoco" else
               [DT_ATARI_TARGETS.get(env_key, target)] if family == "atari" else [target])

    # Atari: the time embedding covers the data's longest episode (kzl atari/run_dt_atari.py#L80),
    # evaluation clamping to it; the horizon: kzl's 108k-frame limit in steps
    # (atari/mingpt/trainer_atari.py#L317)
    longest = max(len(e["actions"]) for e in episodes)
    max_len = longest if family == "atari" else max(int(spec.max_episode_steps or 0), longest)
    horizon = 0
    if family == "atari":
        frame_limit = int(spec.kwargs.get("max_num_frames_per_episode", 108_000))
        horizon = frame_limit // atari_frame_skip(spec)

    if delayed_reward:
        episodes = [e | dict(rewards=delay_rewards(e["rewards"])) for e in episodes]
    return OfflineData(dataset_id=dataset_id, family=family, episodes=episodes, env_spec=spec,
                       ref_min=ref_min, ref_max=ref_max, ref_source=ref_source,
                       return_scale=scale, target_returns=targets, max_ep_len=max_len,
                       goal_dim=goal_dim, obs_keys=keys, horizon=horizon, n_actions=n_actions,
                       raw_frames=raw, delayed_reward=delayed_reward)


@dataclass
class OfflineData:
    dataset_id: str
    family: str                 # 'mujoco' | 'maze' | 'atari' | 'other'
    # dicts: observations (T, obs_dim), actions (T, act_dim), rewards (T,), terminated;
    # Atari: observations (T, 84, 84) uint8 frames, actions (T,) int64
    episodes: list
    env_spec: object            # the eval env's gymnasium EnvSpec, or None
    ref_min: float = float("nan")
    ref_max: float = float("nan")
    ref_source: str = "none"
    return_scale: float = 1.0
    target_returns: list = field(default_factory=list)
    max_ep_len: int = 1000      # timesteps embedded, 0 .. max_ep_len - 1 (evaluation clamps)
    horizon: int = 0            # evaluation steps at most (0: max_ep_len); Atari: 108k frames / 4
    n_actions: int = 0          # discrete actions (Atari's Discrete space), 0 for continuous
    raw_frames: bool = False    # RGB Atari screens (Minari's atari/*), made 84x84 at load
    delayed_reward: bool = False  # rewards paid at each episode's last step, in evaluation too
    goal_dim: int = 0           # the last goal_dim state entries are desired_goal, else 0
    obs_keys: tuple = MAZE_KEYS  # how flatten_obs orders dict observations (obs_keys_for)
    state_mean: np.ndarray = field(default=None, repr=False)  # from the episodes unless given
    state_std: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        eps = self.episodes
        self.discrete = self.n_actions > 0
        self.goal_reaching = self.family == "maze"

        lengths = np.array([len(e["actions"]) for e in eps])
        self.ep_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])  # (n_episodes,)
        self.step_ep_start = np.repeat(self.ep_start, lengths)  # (N,) its episode's first row
        rewards = np.concatenate([e["rewards"] for e in eps]).astype(np.float32)  # (N,)

        # Atari: a uint8 frame per step; the episodes' arrays are views of one
        if self.family == "atari":
            frames = np.concatenate([e["observations"] for e in eps])  # (N, 84, 84) uint8
            for e, a, n in zip(eps, self.ep_start, lengths):
                e["observations"] = frames[a:a + n]
            self.obs_shape = (FRAME_STACK, *frames.shape[1:])  # (4, 84, 84)
            actions = np.concatenate([e["actions"] for e in eps]).astype(np.int64)  # (N,)
            if actions.min() < 0 or actions.max() >= self.n_actions:
                raise DataError(f"dataset '{self.dataset_id}' has action indices outside its "
                                f"Discrete({self.n_actions}) space, so it cannot be used")
            _check_finite(f"dataset '{self.dataset_id}'", dict(rewards=rewards), self.ep_start)
            self.state_mean, self.state_std = np.zeros(1, np.float32), np.ones(1, np.float32)
            states = dict(frames=frames)

        else:  # vectors, normalised
            obs = np.concatenate([e["observations"] for e in eps]).astype(np.float64)
            self.obs_shape = obs.shape[1:]  # obs (N, obs_dim)
            actions = np.concatenate([e["actions"] for e in eps]).astype(np.float32)  # (N, act_dim)
            _check_finite(f"dataset '{self.dataset_id}'",
                          dict(observations=obs, actions=actions, rewards=rewards), self.ep_start)
            if self.state_mean is None:
                self.state_mean = obs.mean(0).astype(np.float32)
                self.state_std = (obs.std(0) + 1e-6).astype(np.float32)
            states = dict(states=self.normalize_states(obs))  # (N, obs_dim)

        self.obs_dim = int(np.prod(self.obs_shape))
        self.act_dim = self.n_actions if self.discrete else actions.shape[1]
        self.horizon = self.horizon or self.max_ep_len

        # flat arrays, a row per dataset step, which a batch fancy-indexes
        rtg = np.concatenate([returns_to_go(e["rewards"]) for e in eps]).astype(np.float32)
        self.flat = dict(
            **states,                   # (N, obs_dim), or frames (N, 84, 84)
            actions=actions,            # (N, act_dim), or (N,) int64
            rewards=rewards,            # (N,)
            rtg=rtg * self.return_scale,  # (N,)
            timesteps=np.concatenate([np.arange(n) for n in lengths]),  # (N,)
        )
        self.episode_returns = np.array([e["rewards"].sum() for e in eps])

    def info(self):
        """What a model is built from, kept in its checkpoint (act_dim: the action count if
        discrete)."""
        return dict(obs_dim=self.obs_dim, act_dim=self.act_dim, max_ep_len=self.max_ep_len,
                    goal_dim=self.goal_dim, discrete=self.discrete, obs_shape=list(self.obs_shape))

    def normalize_states(self, obs):
        obs = np.asarray(obs, dtype=np.float64)
        return ((obs - self.state_mean) / self.state_std).astype(np.float32)

    def observe(self, obs):
        """An env's observation -> a history row: the normalised flat state, or Atari's frame."""
        if self.family == "atari":
            return np.asarray(obs, dtype=np.uint8)
        return self.normalize_states(flatten_obs(obs, self.obs_keys))

    def normalize_score(self, returns):
        """D4RL-style normalised score: 100 * (R - ref_min) / (ref_max - ref_min)."""
        returns = np.asarray(returns, dtype=np.float64)
        return 100.0 * (returns - self.ref_min) / (self.ref_max - self.ref_min)

    def make_env(self, render=False):
        """The dataset's own eval env (Minari's eval_env_spec, else env_spec); render=True: 240 x
        240 RGB frames offscreen (MuJoCo: evaluate.pick_gl), or Atari's 210 x 160 screen."""
        import gymnasium as gym
        if self.env_spec is None:
            raise DataError(f"'{self.dataset_id}' is synthetic data and has no environment to "
                            f"evaluate in")

        if self.family == "atari":
            env = make_atari_env(self.env_spec, render_mode="rgb_array" if render else None)
            return atari_frame_wrappers(env) if self.raw_frames else env

        if self.family == "maze" or str(self.env_spec.entry_point).startswith("gymnasium_robotics"):
            _robotics()  # mazes and Adroit
        if not render:
            return gym.make(self.env_spec)

        # the locomotion robots' "track" camera follows the body
        robots = self.env_spec.id.split("-")[0] in D4RL_REF_SCORES
        env = gym.make(self.env_spec, render_mode="rgb_array", width=240, height=240,
                       **(dict(camera_name="track") if robots else {}))

        # the whole maze from above (its camera crops the medium one), set before a render
        robot = getattr(env.unwrapped, "point_env", None) or getattr(env.unwrapped, "ant_env", None)
        if self.family == "maze" and robot is not None:
            m = env.unwrapped.maze
            robot.mujoco_renderer.default_cam_config = dict(
                distance=1.25 * max(m.map_length, m.map_width) * m.maze_size_scaling,
                elevation=-90.0, azimuth=90.0, lookat=np.zeros(3))
        return env

    def sample(self, batch_size, K, rng):
        """B windows of K steps ending at steps drawn uniformly over the dataset, left-padded at
        an episode's start as in an evaluation's first K-1 steps: each step is a window's newest
        equally often. kzl's gym window starts at a uniform step (gym/experiment.py#L129); DT's
        Atari sampler (kzl atari/run_dt_atari.py#L52-L66, copied by StARformer and transformer-like
        DeMa) draws the first step and moves a window that would cross its episode's end back to
        end there, so that window comes K times as often as any other."""
        end = rng.integers(0, len(self.step_ep_start), size=batch_size)  # (B,)
        return gather_windows(self.flat, self.step_ep_start[end], end, K)

    def keep_top(self, fraction):
        """%BC (DT Sec. 5.3; kzl gym/experiment.py#L103-L113): the best episodes, best first, while
        their steps fit in `fraction` of all (at least one); state_mean/std stay the full data's
        (as kzl's, #L86-L87), as do targets, reference scores and max_ep_len."""
        if not 0 < fraction <= 1:
            raise DataError(f"the fraction of episodes to keep must lie in (0, 1], got {fraction}")

        lengths = np.array([len(e["actions"]) for e in self.episodes])  # (n_episodes,)
        order = np.argsort(-self.episode_returns, kind="stable")  # best first, ties in data order
        budget = max(int(fraction * lengths.sum()), 1)  # kzl: max(int(pct * N), 1)

        # the whole episodes that fit
        n = max(1, int(np.searchsorted(np.cumsum(lengths[order]), budget, side="right")))
        keep = np.sort(order[:n])
        return replace(self, episodes=[self.episodes[i] for i in keep])


def returns_to_go(rewards):
    """R_t = sum_{t'>=t} r_t' (undiscounted, DT Sec. 3.1); float64 accumulation."""
    return np.cumsum(np.asarray(rewards, dtype=np.float64)[::-1])[::-1]


def delay_rewards(rewards):
    """The delayed-return setting (DT Sec. 5.4, Table 5; DeMa Table 13): r'_t = 0 for t < T-1,
    r'_{T-1} = sum_t r_t, so every R_t is the return; evaluate.evaluate delays the env's alike."""
    out = np.zeros_like(rewards)
    out[-1] = np.sum(rewards, dtype=np.float64)
    return out


def gather_windows(flat, start, end, K, ring=0):
    """Windows of K rows ending at row `end`, padded before row `start` (the episode's first).
    flat: dict of arrays, rows first (Atari: `frames`, not `states`); start, end: (B,) ints.
    Rows: dataset steps, or (ring > 0) evaluate's Contexts, row r at start + (r - start) % ring."""
    def at(rows):  # row numbers -> where they are stored
        s = start.reshape(-1, *[1] * (rows.ndim - 1))
        return s + (rows - s) % ring if ring else rows

    # each position's row; padding points at the start row (zeroed below)
    idx = end[:, None] - (K - 1) + np.arange(K)[None, :]  # (B, K)
    real = idx >= start[:, None]                          # (B, K) False on the left padding
    rows = np.where(real, idx, start[:, None])            # (B, K)
    idx = at(rows)
    f = real.astype(np.float32)

    # the step before the first real row t0 if in the episode (else the null action and reward)
    first = np.maximum(end - (K - 1), start)              # (B,) t0
    has_prev = first > start
    prev = at(np.where(has_prev, first - 1, start))

    # gather, zeroing the padding
    a = flat["actions"]
    if "frames" in flat:
        states = stack_frames(flat["frames"], start, rows, at) * real[..., None, None, None]
    else:
        states = flat["states"][idx] * f[..., None]

    batch = dict(
        states=states,                                    # (B, K, obs_dim) or (B, K, 4, 84, 84)
        actions=a[idx] * (real if a.ndim == 1 else f[..., None]),  # (B, K, act_dim) or (B, K)
        rewards=(flat["rewards"][idx] * f)[..., None],    # (B, K, 1)
        rtg=(flat["rtg"][idx] * f)[..., None],            # (B, K, 1)
        timesteps=flat["timesteps"][idx] * real,          # (B, K)
        mask=f,                                           # (B, K)
        prev_action=a[prev] * (has_prev if a.ndim == 1 else has_prev[:, None]),  # (B, act_dim)
        prev_reward=(flat["rewards"][prev] * has_prev)[:, None],  # (B, 1)
    )
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}


def stack_frames(frames, start, rows, at=lambda r: r):
    """Atari's state at each of `rows`: its frame and the 3 before, oldest first, 0 before the
    episode's first row (`start`) as kzl's env fills its frame buffer at reset
    (atari/mingpt/trainer_atari.py#L247-L249), in training and evaluation alike.
    frames (N, 84, 84) uint8; rows (B, K) -> (B, K, 4, 84, 84)."""
    r = rows[..., None] - (FRAME_STACK - 1) + np.arange(FRAME_STACK)  # (B, K, 4) rows stacked
    inside = r >= start.reshape(-1, 1, 1)  # (B, K, 4) False before the episode
    return frames[at(np.where(inside, r, start.reshape(-1, 1, 1)))] * inside[..., None, None]

# ---- reading a Minari dataset ----


def _open_minari(dataset_id, download):
    """-> (MinariDataset, its metadata, its episodes), downloaded if allowed."""
    import minari
    where = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")

    # not here: the id in another case, or download it, or say how to get it (made/...: make's)
    if not os.path.exists(os.path.join(dataset_folder(dataset_id), "data")):
        if twin := _case_twin(dataset_id):
            raise DataError(f"dataset '{dataset_id}' is not in {where}, but '{twin}' is (ids are "
                            f"case-sensitive); use that id")
        made = dataset_id.startswith("made/")
        if made or not download:
            name = next((n for n in MAKE_NAMES if _made_id(n) == dataset_id), None)
            how = (f"make it with `python data.py make {name} {dataset_id}`" if name else
                   f"make it with `python data.py make NAME {dataset_id}` (NAME one of "
                   f"{', '.join(MAKE_NAMES)})" if made else
                   f"download it with `minari download {dataset_id}`")
            raise DataError(f"dataset '{dataset_id}' is not in {where}; {how} or set "
                            f"MINARI_DATASETS_PATH to a folder that holds it"
                            f"{_stand_in(dataset_id)}")

        print(f"downloading {dataset_id} (once) into {where} ...", flush=True)
        try:
            _download(dataset_id)
        except DataError:
            raise
        except Exception as e:  # httpx's, huggingface_hub's, socket's, minari's ValueError, ...
            raise _dataset_download_error(e, dataset_id, where) from None

    # there but unreadable: h5py's OSError, json's ValueError, a missing key, ...
    try:
        ds = minari.load_dataset(dataset_id)
        return ds, ds.storage.metadata, list(ds.iterate_episodes())
    except Exception as e:
        detail = str(e).splitlines()[0].split(". ")[0] if str(e) else ""  # its first sentence
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise damaged(dataset_id, type(e).__name__ + (": " + detail if detail else "")) from None


def _remote():
    """-> (Minari's remote, as MINARI_REMOTE names it, the server it downloads from): the
    Hugging Face endpoint (HF_ENDPOINT, e.g. a mirror) for an hf:// remote."""
    from huggingface_hub import constants
    from minari.storage.remotes import DEFAULT_REMOTE
    remote = os.environ.get("MINARI_REMOTE", DEFAULT_REMOTE)
    return remote, constants.ENDPOINT if remote.startswith("hf://") else remote


def _download(dataset_id):
    """minari.download_dataset into a hidden folder of the datasets folder, the dataset's data/
    moved into place when complete: a failure or a stop half-way leaves no folder that the next
    run takes for the dataset (it downloads again)."""
    import minari
    from huggingface_hub import constants
    root = dataset_folder("")
    try:
        staging = tempfile.mkdtemp(prefix=".data.py-download-", dir=root)
    except OSError as e:
        raise DataError(f"cannot download into {root} ({e.strerror}); set MINARI_DATASETS_PATH "
                        f"to a folder you can write") from None
    try:
        # no route to the remote's host: fail now, not after a minute of retries
        remote, server = _remote()
        host = urllib.parse.urlparse(server).hostname
        if remote.startswith("hf://") and host and not constants.HF_HUB_OFFLINE:
            socket.getaddrinfo(host, 443)

        # into the hidden folder (minari reads MINARI_DATASETS_PATH at each call), quietly: its
        # lines name that folder (huggingface_hub's progress bars stay, on stderr)
        old = os.environ.get("MINARI_DATASETS_PATH")
        os.environ["MINARI_DATASETS_PATH"] = staging
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                minari.download_dataset(dataset_id)
        finally:
            if old is None:
                del os.environ["MINARI_DATASETS_PATH"]
            else:
                os.environ["MINARI_DATASETS_PATH"] = old

        # into place in one rename (a download that finished first is kept)
        target = os.path.join(dataset_folder(dataset_id), "data")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            os.rename(os.path.join(staging, dataset_id, "data"), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_failure(e, server):
    """-> (why a download from `server` failed, in words; whether it lacks what was asked for):
    HF_HUB_OFFLINE, huggingface_hub's errors and their causes (httpx's, socket's), minari's
    ValueError."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (HfHubHTTPError, RemoteEntryNotFoundError,
                                        RepositoryNotFoundError)
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set", False
    chain = [e]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) and len(chain) < 20:
        chain.append(cause)

    # minari's "Couldn't find any version for dataset ... in the remote Farama server", ...
    if any(isinstance(c, (RepositoryNotFoundError, RemoteEntryNotFoundError)) for c in chain) or (
            isinstance(e, ValueError) and "in the remote" in str(e)):
        return f"{server} does not hold it", True
    if http := next((c for c in chain if isinstance(c, HfHubHTTPError) and c.response is not None),
                    None):
        return f"{server} answered HTTP {http.response.status_code}", False
    if any(isinstance(c, socket.gaierror) for c in chain):
        return "no network", False
    if any(type(c).__name__ in ("ConnectError", "ConnectTimeout") for c in chain):
        return f"{server} cannot be reached", False
    if any(type(c).__name__ in ("RemoteProtocolError", "ReadError", "ReadTimeout") for c in chain):
        return f"the connection to {server} broke off in a file", False

    # minari's own: the files not listed (its "The data path ... doesn't exist"), a version, ...
    if isinstance(e, ValueError) and "data path" in str(e):
        return f"{server} did not list the files", False
    if isinstance(e, ValueError) and str(e):
        return "minari: " + str(e).splitlines()[0].split(". ")[0][:160], False
    return f"{type(e).__name__} from {server}", False


def _dataset_download_error(e, dataset_id, where):
    """The DataError for a failed download of a dataset, with its cause."""
    remote, server = _remote()
    why, missing = download_failure(e, server)
    if missing:
        return DataError(f"dataset '{dataset_id}' is not in {where} and not on Minari's remote "
                         f"({remote} at {server}); check the id (`minari list remote` lists the "
                         f"remote's){_stand_in(dataset_id)}")
    return DataError(f"dataset '{dataset_id}' is not in {where} and could not be downloaded "
                     f"({why}); with a network run `minari download {dataset_id}`, or copy it "
                     f"there and set MINARI_DATASETS_PATH{_stand_in(dataset_id)}")


def _stand_in(dataset_id):
    """The offline way to a dataset that `make` stands in for, in words (else "")."""
    name = next((n for n, what in MAKE_NAMES.items() if what == dataset_id), None)
    return (f"; offline, `python data.py make {name}` makes a stand-in: then pass --dataset "
            f"{_made_id(name)}" if name else "")


def _case_twin(dataset_id):
    """The id of a local dataset that differs from `dataset_id` in case alone, else None."""
    folder, found = dataset_folder(""), []
    for part in dataset_id.split("/"):
        names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        if (match := next((n for n in names if n.lower() == part.lower()), None)) is None:
            return None
        folder = os.path.join(folder, match)
        found.append(match)
    twin = "/".join(found)
    return twin if twin != dataset_id and os.path.isdir(os.path.join(folder, "data")) else None


def damaged(dataset_id, detail):
    """The DataError for a dataset there but unreadable, with how to get it again."""
    folder = dataset_folder(dataset_id)
    again = (f"get it again (`minari download {dataset_id}` if it came from Minari's servers, "
             f"else the data.py command that made it)")

    # from its metadata, where readable
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(os.path.join(folder, "data", "metadata.json")) as f:
            meta = json.load(f)
        algorithm, command = str(meta.get("algorithm_name")), meta.get("data_py_command")
        again = (f"make it again with `{command}`" if command else
                 f"make it again with the data.py command that made it ({algorithm}: "
                 f"{meta.get('description')})" if "data.py" in algorithm else
                 f"download it again with `minari download {dataset_id}`")
    return DataError(f"the dataset '{dataset_id}' at {folder} is damaged ({detail}); delete that "
                     f"folder and {again}")


def dataset_folder(dataset_id):
    """Where Minari keeps a dataset: <MINARI_DATASETS_PATH, else ~/.minari/datasets>/<id>."""
    from minari.storage.datasets_root_dir import get_dataset_path
    root = os.environ.get("MINARI_DATASETS_PATH")
    if root == "" or root and os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f"MINARI_DATASETS_PATH{'=' + root if root else ''} is "
                        f"{'a file' if root else 'empty'}, not a folder of datasets; point it at a "
                        f"folder")
    return str(get_dataset_path(dataset_id))


def _episode_arrays(ep, keys, fix_first_goal, dataset_id, frames=None):
    """One Minari episode (T+1 observations, T actions) -> dict of arrays without s_T; frames:
    Atari's uint8 frame transform (_atari_spaces)."""
    T = len(ep.actions)
    if T == 0:
        raise damaged(dataset_id, f"episode {ep.id} has no steps")

    obs = ep.observations
    rows = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
    if rows != T + 1 or len(ep.rewards) != T:
        raise damaged(dataset_id, f"episode {ep.id} has {rows} observations and {len(ep.rewards)} "
                      f"rewards for {T} actions, where Minari stores T + 1 and T")

    rewards = np.asarray(ep.rewards, dtype=np.float32)
    terminated = bool(np.asarray(ep.terminations)[-1])
    if frames is not None:
        return dict(observations=frames(np.asarray(obs[:T], dtype=np.uint8)),
                    actions=np.asarray(ep.actions).reshape(T), rewards=rewards,
                    terminated=terminated)

    # Minari's maze collection runs on across goals: an episode's first observation shows the
    # previous episode's goal, which evaluation never does; step 1's goal replaces it
    if isinstance(obs, dict):
        obs = {k: np.asarray(v) for k, v in obs.items()}
        if fix_first_goal and len(obs["desired_goal"]) > 2:
            obs["desired_goal"][0] = obs["desired_goal"][1]
        obs = flatten_obs(obs, keys)
    obs = np.asarray(obs, dtype=np.float32).reshape(len(obs), -1)
    actions = np.asarray(ep.actions, dtype=np.float32).reshape(T, -1)
    return dict(observations=obs[:T], actions=actions, rewards=rewards, terminated=terminated)


def _check_finite(source, arrays, ep_start):
    """A DataError at NaN/inf in arrays (name -> a row per step); ep_start: episodes' first rows."""
    for name, a in arrays.items():
        bad = ~np.isfinite(np.asarray(a, dtype=np.float64).reshape(len(a), -1)).all(axis=1)  # (N,)
        if bad.any():
            episode = int(np.searchsorted(ep_start, np.argmax(bad), side="right")) - 1
            raise DataError(f"{source} has NaN or infinite {name}, first in episode {episode}, so "
                            f"it cannot be used")

# ---- Atari: the environment and the frames ----


def _atari_spaces(dataset_id, obs_space, action_space, spec):
    """-> (number of actions, raw RGB frames?, frame transform) of Atari data."""
    if not hasattr(action_space, "n"):
        raise DataError(f"dataset '{dataset_id}' is Atari data with a "
                        f"{type(action_space).__name__} action space; the models read Discrete "
                        f"actions")

    shape = tuple(getattr(obs_space, "shape", ()) or ())
    if shape == (84, 84):
        return int(action_space.n), False, lambda f: f

    # RGB screens, made 84x84 by the eval env's wrappers
    if len(shape) == 3 and shape[2] == 3:
        resize = atari_frame_wrappers(make_atari_env(spec))
        resize.close()

        def frames(rgb):  # (T, 210, 160, 3) -> (T, 84, 84) uint8
            return np.stack([resize.observation(resize.env.observation(f))
                             for f in rgb]).astype(np.uint8)
        return int(action_space.n), True, frames

    raise DataError(f"dataset '{dataset_id}' has Atari observations of shape {shape}; the models "
                    f"read 84x84 grayscale frames (DQN-replay's) or RGB screens (Minari's atari/*, "
                    f"made 84x84 at load)")


def atari_frame_wrappers(env):
    """210x160 RGB screens -> 84x84 grayscale (INTER_AREA), for the eval env and data alike."""
    from gymnasium.wrappers import GrayscaleObservation, ResizeObservation
    return ResizeObservation(GrayscaleObservation(env), (84, 84))


def make_atari_env(spec, render_mode=None):
    """gymnasium.make(spec) with ale-py's envs registered."""
    return _ale().make(spec, render_mode=render_mode)


def atari_env_spec(game):
    """The Atari eval env as an EnvSpec: ALE/<Game>-v5 without sticky actions or ALE's frame skip,
    to game over or 108k frames, in gymnasium's AtariPreprocessing (how it departs from Dopamine's
    and kzl's: evaluate.py's docstring)."""
    import difflib
    from gymnasium.envs.registration import WrapperSpec
    gym = _ale()

    # ALE's name of the game, in any case
    games = {k[4:-3].lower(): k for k in gym.registry if k.startswith("ALE/") and k.endswith("-v5")}
    key = re.sub(r"[^a-z0-9]", "", game.lower())
    if key not in games:
        near = difflib.get_close_matches(key, games, n=1)
        raise DataError(f"ALE knows no game '{game}'"
                        + (f" (did you mean {games[near[0]][4:-3]}?)" if near else "")
                        + f"; its {len(games)} games include "
                        + ", ".join(sorted(ATARI_GAMER_SCORES)))

    base = gym.spec(games[key])
    preprocessing = WrapperSpec("AtariPreprocessing",
                                "gymnasium.wrappers.atari_preprocessing:AtariPreprocessing",
                                dict(noop_max=30, frame_skip=4, screen_size=84,
                                     terminal_on_life_loss=False, grayscale_obs=True,
                                     grayscale_newaxis=False, scale_obs=False))
    kwargs = dict(base.kwargs, repeat_action_probability=0.0, full_action_space=False,
                  frameskip=1, max_num_frames_per_episode=108_000)
    return replace(base, kwargs=kwargs, additional_wrappers=(preprocessing,))


def atari_frame_skip(spec):
    """Emulator frames (1/60 s each) per env step: AtariPreprocessing's frame_skip times ALE's."""
    skips = [w.kwargs.get("frame_skip", 4) for w in spec.additional_wrappers or ()
             if w.name == "AtariPreprocessing"]
    skip = skips[0] * spec.kwargs.get("frameskip", 1) if skips else spec.kwargs.get("frameskip", 4)
    return skip if isinstance(skip, int) else max(skip)  # a (low, high) frameskip: the longest


def _robotics():
    """-> gymnasium with gymnasium-robotics' envs (mazes, Adroit) registered, quietly."""
    import gymnasium as gym
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import gymnasium_robotics  # (it prints a notice on import)
    gym.register_envs(gymnasium_robotics)
    return gym


def _ale():
    """-> gymnasium with ale-py's envs registered quietly; a DataError without ale-py or cv2."""
    import gymnasium as gym
    try:
        import ale_py
        import cv2  # noqa: F401  (AtariPreprocessing resizes with OpenCV)
    except ImportError as e:
        raise DataError(f"Atari needs ale-py and OpenCV ({e.name} is missing): pip install ale-py "
                        f"opencv-python-headless") from None

    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)  # (C++ prints past Python's stderr)
    gym.register_envs(ale_py)
    return gym

# ---- memory and time in words; synthetic data (--bench) ----


def available_memory():
    """Bytes of memory the OS can give now (Linux's MemAvailable, else physical memory) or None."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))

    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def gb(n):
    """Bytes in MB, GB or TB."""
    e, unit = next(((e, u) for e, u in ((40, "TB"), (30, "GB")) if n >= 2 ** e), (20, "MB"))
    return f"{n / 2 ** e:.3g} {unit}"


def duration(seconds):
    """Seconds in words: '40 s', '12 min', '3.5 h', '6.2 days'."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.1f} {unit}" if unit != "min" else f"{seconds / size:.0f} min"
    return f"{seconds:.0f} s"


def synthetic_data(obs_dim=11, act_dim=3, episodes=8, length=50, seed=0, goal_dim=0, env_id=None):
    """Random MuJoCo-like episodes (eval env env_id or none), returns scaled by 1e-3, the best as
    target; the last goal_dim state entries, constant in an episode, as a goal."""
    assert 0 <= goal_dim <= obs_dim
    rng = np.random.default_rng(seed)
    eps = []
    for _ in range(episodes):
        obs = rng.standard_normal((length, obs_dim)).astype(np.float32)  # (T, obs_dim)
        obs[:, obs_dim - goal_dim:] = obs[0, obs_dim - goal_dim:]
        eps.append(dict(observations=obs,
                        actions=rng.uniform(-1, 1, (length, act_dim)).astype(np.float32),
                        rewards=rng.uniform(0, 2, length).astype(np.float32), terminated=False))

    best = float(max(e["rewards"].sum() for e in eps))

    spec = None
    if env_id is not None:
        import gymnasium as gym
        spec = gym.spec(env_id)
    return OfflineData(dataset_id="synthetic", family="mujoco", episodes=eps, env_spec=spec,
                       return_scale=1e-3, target_returns=[best], max_ep_len=length,
                       goal_dim=goal_dim)


def synthetic_atari(n_actions=4, episodes=16, length=200, seed=0):
    """Random Atari-shaped episodes; Breakout's eval env recorded (train() checks that ale-py can
    make it), never run."""
    rng = np.random.default_rng(seed)
    eps = [dict(observations=rng.integers(0, 256, (length, 84, 84), dtype=np.uint8),
                actions=rng.integers(0, n_actions, length),
                rewards=rng.integers(0, 2, length).astype(np.float32), terminated=False)
           for _ in range(episodes)]

    return OfflineData(dataset_id="synthetic-atari", family="atari", episodes=eps,
                       env_spec=atari_env_spec("breakout"), n_actions=n_actions,
                       max_ep_len=length, target_returns=[90.0])


def synthetic_like(name, length=200):
    """--bench's data: random episodes shaped as hopper's (Hopper-v5) or Atari's (Breakout)."""
    if is_atari(name):
        return synthetic_atari(length=length)
    return synthetic_data(obs_dim=11, act_dim=3, episodes=16, length=length, env_id="Hopper-v5")

# ==================================================================================================
# Dataset tools: below this line nothing is used by the model files or evaluate.py.
# ==================================================================================================
# the tools' own imports (what stands above runs without them)
import time
import warnings

# ---- D4RL HDF5 -> local Minari dataset (convert-d4rl) ----

D4RL_ROBOTS = {"halfcheetah": "HalfCheetah-v5", "hopper": "Hopper-v5", "walker2d": "Walker2d-v5",
               "ant": "Ant-v5"}
D4RL_KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")  # + next_observations


def _read_d4rl(path):
    """A D4RL MuJoCo HDF5 file -> dict of arrays of N rows."""
    import h5py
    if not os.path.isfile(path):
        raise DataError(f"{path} is not a file")

    # the arrays
    try:
        with h5py.File(path, "r") as f:
            layout = (f"convert-d4rl reads D4RL's MuJoCo layout ({', '.join(D4RL_KEYS)}, "
                      f"optionally next_observations)")
            missing = [k for k in D4RL_KEYS if k not in f]
            if missing:
                raise DataError(f"{path} has no {', '.join(missing)}; {layout}")
            groups = [k for k in (*D4RL_KEYS, "next_observations")
                      if k in f and not isinstance(f[k], h5py.Dataset)]
            if groups:
                raise DataError(
                    f"{path} holds {', '.join(groups)} as an HDF5 group, not an array; {layout}")
            a = {k: np.asarray(f[k][()]) for k in (*D4RL_KEYS, "next_observations") if k in f}
    except OSError as e:  # not HDF5, truncated
        raise DataError(f"{path} cannot be read as HDF5 ({type(e).__name__})") from None

    # one row per step
    a["rewards"] = a["rewards"].reshape(-1).astype(np.float64)  # (N,), also from (N, 1)
    for k in ("terminals", "timeouts"):
        a[k] = a[k].reshape(-1).astype(bool)  # (N,), also from 0./1. floats
    n = len(a["rewards"])
    if n == 0:
        raise DataError(f"{path} holds no steps")
    rows = ("observations", "next_observations", "actions")  # (N, dim) each
    bad = [k for k, v in a.items() if len(v) != n or (k in rows and v.ndim != 2)]
    if bad:
        raise DataError(
            f"{path} does not hold one row per step in {', '.join(bad)} (rewards has {n} rows)")
    return a


def _d4rl_env(path, dataset_id, env_id):
    """--env, else the v5 env of the robot the file name or dataset id names."""
    if env_id is not None:
        return env_id
    words = set(re.split(r"[^a-z0-9]+", f"{os.path.basename(path)} {dataset_id}".lower()))
    robots = sorted(words & set(D4RL_ROBOTS))
    if len(robots) != 1:
        found = "found " + " and ".join(robots) if robots else "none of " + ", ".join(D4RL_ROBOTS)
        raise DataError(f"cannot tell the robot from '{os.path.basename(path)}' and '{dataset_id}' "
                        f"({found}); pass --env, e.g. --env Hopper-v5")
    return D4RL_ROBOTS[robots[0]]


def convert_d4rl(path, dataset_id, env_id=None):
    """A D4RL MuJoCo HDF5 file -> the local Minari dataset `dataset_id` with the robot's v5 env
    and D4RL's reference returns. -> the number of episodes."""
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer

    _new_dataset_folder(dataset_id)
    env_arg, env_id = env_id, _d4rl_env(path, dataset_id, env_id)
    a = _read_d4rl(path)

    # the env, whose spaces must be the file's
    try:
        env = gym.make(env_id)
    except gym.error.Error as e:
        raise DataError(f"--env {env_id} cannot be made here ({type(e).__name__}); pass a "
                        f"gymnasium MuJoCo env id such as Hopper-v5") from None
    have = (a["observations"].shape[1:], a["actions"].shape[1:])
    want = (env.observation_space.shape, env.action_space.shape)
    if have != want:
        raise DataError(f"{path} has observations {have[0]} and actions {have[1]} but {env_id} has "
                        f"{want[0]} and {want[1]}; pass --env with an env whose spaces match"
                        + (" (D4RL's 111-d Ant observation, with contact forces, matches no v5 "
                           "env, so D4RL ant files are not supported)"
                           if env_id.startswith("Ant") else ""))

    # episodes: from the row after an end (terminal or timeout) to the next; the rest truncated
    n = len(a["rewards"])
    ends = np.flatnonzero(a["terminals"] | a["timeouts"]) + 1  # (E,) the row after each episode
    trailing = len(ends) == 0 or ends[-1] < n
    stops = np.append(ends, n) if trailing else ends  # (n_episodes,)
    starts = np.concatenate([[0], stops[:-1]])  # (n_episodes,)
    _check_finite(path, {k: a[k] for k in ("observations", "actions", "rewards")}, starts)
    if trailing:
        print(f"the last {n - starts[-1]} steps end with neither terminal nor timeout: kept as a "
              f"truncated episode")

    # each episode's T + 1 observations, T actions, T rewards
    if "next_observations" not in a:
        # D4RL's row after an end is the next episode's reset state: s_T is unknown
        print("no next_observations: each episode's final observation repeats its last one (never "
              "used for training)")
    nxt = a.get("next_observations", a["observations"])  # (N, obs_dim): s_T at row e - 1
    buffers = []
    for i, (s, e) in enumerate(zip(starts, stops)):
        term = a["terminals"][s:e]  # (T,)
        trunc = a["timeouts"][s:e] & ~term  # (T,)
        trunc[-1] |= not term[-1]  # the trailing episode: truncated
        buffers.append(EpisodeBuffer(
            id=i, observations=np.concatenate([a["observations"][s:e], nxt[e - 1:e]]),  # (T + 1, .)
            actions=a["actions"][s:e].astype(np.float32), rewards=a["rewards"][s:e].tolist(),
            terminations=term.tolist(), truncations=trunc.tolist(), infos={}))

    # written, with the robot's D4RL reference returns
    ref = D4RL_REF_SCORES.get(env_id.split("-")[0], (None, None))
    command = ["convert-d4rl", os.path.abspath(path), dataset_id,
               *(["--env", env_arg] if env_arg else [])]
    folder = _write_dataset(
        dataset_id, buffers, command, env=env_id, ref_min_score=ref[0], ref_max_score=ref[1],
        algorithm_name="D4RL (converted by data.py convert-d4rl)",
        description=f"converted from {path}")

    n_term = sum(bool(b.terminations[-1]) for b in buffers)
    refs = (f"reference returns {ref[0]} / {ref[1]}" if ref[0] is not None
            else "no reference returns")
    print(f"{dataset_id}: {len(buffers)} episodes ({n_term} end by terminal, "
          f"{len(buffers) - n_term} truncated), {n:,} steps, env {env_id}, {refs}, written to "
          f"{folder}")
    return len(buffers)


# ---- DQN-replay (Dopamine's replay buffers) -> local Minari dataset (convert-dqn-replay) ----
#
# A run folder (gs://atari-replay-datasets/dqn/<Game>/<run>/replay_logs) holds buffers N = 0..49
# of 1M transitions, a row per transition t in gzipped np.save arrays $store$_<field>_ckpt.N.gz:
# observation (n, 84, 84) uint8, the newest frame of s_t; action (n,) int32, a_t in ALE's minimal
# action set; reward (n,) float32, r_t clipped to [-1, 1]; terminal (n,) uint8, 1 at game over or
# the step limit, not at a life lost; optionally add_count_ckpt.N.gz (), transitions added so far.
# A buffer is circular, a window of one stream cut anywhere (mid-episode too), its oldest row
# add_count % n (n - 1 in DQN-replay). Dopamine adds 3 blank transitions before an episode (zero
# frame, action 0, reward 0: frame stack 4, minus 1), dropped here. google/dopamine@00a5b32:
# dopamine/discrete_domains/run_experiment.py#L291 clips, #L293-L305 ends episodes;
# dopamine/replay_memory/circular_replay_buffer.py#L251-L255 adds blank rows.

DQN_REPLAY_FIELDS = ("observation", "action", "reward", "terminal")
DQN_REPLAY_MAX_ROWS = 10_000_000  # a header declaring more rows is refused (Dopamine's hold 1M)
DQN_BLANK_ROWS = 3


@contextlib.contextmanager
def _npy_open(path, row_shape=(), kinds="biuf", scalar=False):
    """The gzipped np.save array at `path` -> (the file at its data, dtype, rows). A header not
    declaring rows of `row_shape` (uint8 frames) of a kind in `kinds`, or one number (scalar), is
    a DataError before anything is allocated or unpickled."""
    import gzip
    import zlib

    try:
        f = gzip.open(path, "rb")
    except OSError as e:
        raise DataError(f"{path} cannot be opened ({e.strerror or e})") from None

    # the header, read by np.lib.format
    with f:
        try:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"np.save format {version}")
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, fortran_order, dtype = header(f)
        except (OSError, EOFError, zlib.error, ValueError) as e:  # (BadGzipFile: an OSError)
            what = ("not a gzip file, or a damaged one" if isinstance(e, OSError)
                    else "truncated" if isinstance(e, EOFError)
                    else "damaged" if isinstance(e, zlib.error)
                    else "not an array np.save wrote, or damaged")
            field = os.path.basename(path).split("_ckpt")[0]
            raise DataError(f"{path} cannot be read ({what}); DQN-replay's {field} files are "
                            f"gzipped np.save arrays") from None

        want = f"(n, {', '.join(map(str, row_shape))})" if row_shape else "()" if scalar else "(n,)"
        shape_ok = (shape in ((), (1,)) if scalar
                    else len(shape) == 1 + len(row_shape) and shape[1:] == row_shape)
        if (not shape_ok or dtype.hasobject or dtype.kind not in kinds
                or (row_shape and dtype != np.uint8) or (fortran_order and len(shape) > 1)):
            raise DataError(f"{path} holds an array of {dtype} with shape {shape} where DQN-replay "
                            f"has {want} {'uint8 frames' if row_shape else 'numbers'}")
        if shape and shape[0] > DQN_REPLAY_MAX_ROWS:
            raise DataError(
                f"{path} declares {shape[0]:,} rows, more than the {DQN_REPLAY_MAX_ROWS:,} this "
                f"reader accepts (DQN-replay buffers hold 1M)")
        yield f, dtype, int(shape[0]) if shape else 1


def _npy_fill(f, out, path, last=True):
    """Fill `out` from the open array file f -> out. last: nothing may follow (reading to the end
    makes gzip check its CRC)."""
    import zlib
    try:
        got = f.readinto(memoryview(out).cast("B"))
    except (OSError, EOFError, zlib.error):
        got = -1
    if got != out.nbytes:
        raise DataError(
            f"{path} is truncated or damaged (it ends within its array); download it again")

    try:
        extra = f.read(1) if last else b""
    except (OSError, EOFError, zlib.error):
        extra = b"?"
    if extra:
        raise DataError(f"{path} is damaged (bytes after its array, or a failed gzip check); "
                        "download it again")
    return out


def _npy_read(path, kinds, scalar=False):
    """A whole gzipped (n,) array (a few MB), or one number (scalar)."""
    with _npy_open(path, (), kinds, scalar) as (f, dtype, n):
        if n * dtype.itemsize > 1032 * os.path.getsize(path):  # (deflate: 1 byte -> 1032 at most)
            raise DataError(
                f"{path} is truncated or damaged (its header declares {n:,} rows, more than its "
                f"{os.path.getsize(path):,} bytes can hold); download it again")
        return _npy_fill(f, np.empty(n, dtype), path)


def _dqn_replay_episodes(folder, number, n_actions, budget, counts):
    """Buffer `number`'s whole episodes until `budget` steps (the last one whole) -> [(frames
    (T+1, 84, 84) uint8, actions (T,) int64, rewards (T,) float32)]; counts: the drops."""
    paths = {k: os.path.join(folder, f"$store$_{k}_ckpt.{number}.gz") for k in DQN_REPLAY_FIELDS}
    for p in paths.values():
        if not os.path.isfile(p):
            raise DataError(
                f"buffer {number} in {folder} has no {os.path.basename(p)}; download it again")

    # the small arrays; of the frames the header only (n rows)
    with _npy_open(paths["observation"], (84, 84), "u") as (_, _, n):
        pass
    act, rew, term = (_npy_read(paths[k], kinds) for k, kinds in
                      (("action", "iu"), ("reward", "fiu"), ("terminal", "biu")))
    lengths = {"observation": n, "action": len(act), "reward": len(rew), "terminal": len(term)}
    if len(set(lengths.values())) != 1:
        said = ", ".join(f"{k} {v:,}" for k, v in lengths.items())
        raise DataError(f"buffer {number} in {folder} has arrays of different lengths ({said})")
    if not np.isin(term, (0, 1)).all() or not np.isfinite(rew).all():
        raise DataError(f"buffer {number} in {folder} has terminal flags other than 0 and 1 or "
                        f"rewards that are NaN or infinite")
    if n == 0:
        raise DataError(
            f"buffer {number} in {folder} holds no rows (DQN-replay's hold 1M); download it again")

    # the stream, oldest row first
    count = os.path.join(folder, f"add_count_ckpt.{number}.gz")
    cursor = int(_npy_read(count, "iu", scalar=True)[0]) % n if os.path.isfile(count) else 0
    order = (np.arange(n) + cursor) % n  # (n,) stream position -> file row
    act, rew, term = act[order], rew[order], term[order].astype(bool)
    ends = np.flatnonzero(term)  # stream positions of episodes' last steps
    counts["cut"] += 1
    counts["head"] += ends[0] + 1 if len(ends) else n  # (an episode begun before the buffer)
    if len(ends) == 0:
        return []

    # whole episodes until the budget: (first, end, blank rows maybe) in stream positions
    episodes, taken = [], 0
    for s, e in zip(ends[:-1] + 1, ends[1:] + 1):
        maybe = 0  # Dopamine's blank rows, as far as actions and rewards tell
        while (maybe < min(DQN_BLANK_ROWS, e - s - 1) and act[s + maybe] == 0
               and rew[s + maybe] == 0):
            maybe += 1
        if taken >= budget:
            break
        episodes.append((s, e, maybe))
        taken += e - s - maybe
    else:
        counts["cut"] += int(ends[-1] + 1 < n)
        counts["tail"] += n - ends[-1] - 1  # (an episode going on after the buffer)
    if not episodes:
        return []

    # their actions, in the game's set
    bad = [a for s, e, _ in episodes for a in (act[s:e].min(), act[s:e].max())
           if not 0 <= a < n_actions]
    if bad:
        raise DataError(f"buffer {number} in {folder} has action {bad[0]} where the game has "
                        f"{n_actions} actions (ALE's minimal set); is the folder this game's?")

    # frames: one array, each episode's T + 1 rows a slice (the last: the final frame repeated),
    # read 4096 rows (29 MB) at a time up to the last row kept
    sizes = np.array([e - s + 1 for s, e, _ in episodes])
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    frames = np.empty((sizes.sum(), 84, 84), np.uint8)
    dest = np.full(n, -1, np.int64)  # file row -> row of `frames`, -1: not kept
    for (s, e, _), b in zip(episodes, base):
        dest[order[s:e]] = b + np.arange(e - s)

    last = int(np.flatnonzero(dest >= 0)[-1]) + 1
    chunk = np.empty((min(4096, last), 84, 84), np.uint8)
    with _npy_open(paths["observation"], (84, 84), "u") as (f, _, _):
        for r0 in range(0, last, 4096):
            r1 = min(r0 + 4096, last)
            rows = _npy_fill(f, chunk[:r1 - r0], paths["observation"], last=r1 == n)
            keep = dest[r0:r1] >= 0
            frames[dest[r0:r1][keep]] = rows[keep]

    # episodes without their blank rows (a blank row's frame is zero too, a NOOP step's not)
    out = []
    for (s, e, maybe), b in zip(episodes, base):
        frames[b + e - s] = frames[b + e - s - 1]
        blank = 0
        while blank < maybe and not frames[b + blank].any():
            blank += 1
        counts["blank"] += blank
        out.append((frames[b + blank:b + e - s + 1], act[s + blank:e].astype(np.int64),
                    rew[s + blank:e].astype(np.float32)))
    return out


def convert_dqn_replay(folder, game, dataset_id, buffers=None, steps=500_000):
    """A DQN-replay run folder -> the local Minari dataset `dataset_id`: whole episodes of its last
    `buffers` buffers (default all), each in turn giving an equal share of the `steps` still
    wanted, so that all are drawn on, not only the earliest (near-random play). Episode pieces cut
    by a buffer's edge (their timesteps and returns-to-go would be wrong) and blank rows are
    dropped. -> the number of episodes.

    kzl atari/create_dataset.py draws a random one of the last --num_buffers buffers (#L33) and
    keeps from where its last draw of it stopped (row 0 at first, maybe mid-episode) through the
    11th terminal (trajectories_to_load counts 10 down to 0, #L49-L62), or nothing if row 100,000
    comes first (#L65-L71)."""
    from collections import Counter
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer

    _new_dataset_folder(dataset_id)

    # the game's env
    spec = atari_env_spec(game)
    env = gym.make(spec)
    n_actions, obs_space = int(env.action_space.n), env.observation_space
    env.close()
    frame_space = gym.spaces.Box(0, 255, (84, 84), np.uint8)
    if obs_space != frame_space:
        raise DataError(f"{spec.id} in AtariPreprocessing gives observations {obs_space} here, not "
                        f"84x84 uint8 frames; check the gymnasium and ale-py versions")

    # the folder's buffers
    if not os.path.isdir(folder):
        raise DataError(
            f"{folder} is not a folder; pass a DQN-replay <Game>/<run>/replay_logs folder")
    found = (re.fullmatch(r"\$store\$_(\w+)_ckpt\.(\d+)\.gz", f) for f in os.listdir(folder))
    numbers = sorted({int(m[2]) for m in found if m and m[1] in DQN_REPLAY_FIELDS})  # ascending
    if not numbers:
        raise DataError(f"{folder} holds no DQN-replay buffers ($store$_observation_ckpt.N.gz and "
                        f"the action, reward and terminal files); pass a <Game>/<run>/replay_logs "
                        f"folder, e.g. Breakout/1/replay_logs")
    if buffers is not None and buffers > len(numbers):
        print(f"{folder} has {len(numbers)} buffers, fewer than --buffers {buffers}: all of them "
              f"are used")
    chosen = numbers[-buffers:] if buffers else numbers

    # memory for the frames
    rows = 0
    for path in (os.path.join(folder, f"$store$_observation_ckpt.{k}.gz") for k in chosen):
        if os.path.isfile(path):  # (a missing file is said below)
            with _npy_open(path, (84, 84), "u") as (_, _, n):
                rows += n
    held, free = min(rows, steps), available_memory()
    if free is not None and 84 * 84 * held > free:
        raise DataError(f"the frames of {held:,} steps need about {84 * 84 * held / 2**30:.3g} GB, "
                        f"more than the {free / 2**30:.3g} GB of memory available; lower --steps"
                        + " or --buffers" * (rows <= steps))

    # the buffers in turn
    counts, episodes, read, total = Counter(), [], [], 0
    for k, number in enumerate(chosen):
        if total >= steps:
            break
        share = -(-(steps - total) // (len(chosen) - k))
        episodes += _dqn_replay_episodes(folder, number, n_actions, share, counts)
        read.append(number)
        total = sum(len(a) for _, a, _ in episodes)

    # what was read, kept and dropped
    which = f"buffer {read[0]}" if len(read) == 1 else f"buffers {read[0]}-{read[-1]}"
    if not episodes:
        raise DataError(
            f"{which} of {folder} hold no whole episode, only pieces cut by their edges")

    print(f"dropped {counts['cut']} piece{'s' * (counts['cut'] != 1)} of episodes at the edges of "
          f"{which} ({counts['head']:,} rows up to a buffer's first terminal, {counts['tail']:,} "
          f"after its last): each lacks its start or its end, which lie in another buffer or in "
          f"none")
    if counts["blank"]:
        print(f"dropped {counts['blank']:,} blank rows (zero frame, action 0, reward 0) that "
              f"Dopamine adds before an episode's first step")
    print("each episode's final observation repeats its last frame (the replay keeps no frame "
          "after a terminal; never used for training)")
    if total < steps:
        print(f"{which} of {folder} hold {total:,} steps in whole episodes, fewer than --steps "
              f"{steps:,}: all of them are used")

    # Dopamine's clipped rewards: returns-to-go count them, evaluation the game's raw ones, as in
    # kzl's (atari/mingpt/trainer_atari.py#L211, #L275)
    ep_buffers = [EpisodeBuffer(id=i, observations=obs, actions=act, rewards=rew.tolist(), infos={},
                                terminations=[False] * (len(act) - 1) + [True],
                                truncations=[False] * len(act))
                  for i, (obs, act, rew) in enumerate(episodes)]

    # written, with the game's random and gamer returns
    ref = ATARI_GAMER_SCORES.get(spec.name, (None, None))
    command = ["convert-dqn-replay", os.path.abspath(folder), game, dataset_id,
               *(["--buffers", buffers] if buffers else []), "--steps", steps]
    out = _write_dataset(
        dataset_id, ep_buffers, command, env=spec, eval_env=spec, observation_space=frame_space,
        action_space=gym.spaces.Discrete(n_actions), ref_min_score=ref[0], ref_max_score=ref[1],
        algorithm_name="DQN (Dopamine), DQN-replay dataset (converted by data.py "
                       "convert-dqn-replay)",
        description=f"whole episodes of {which} of {folder}, {total:,} steps", jpeg_encoding=False)

    refs = (f"random / gamer returns {ref[0]} / {ref[1]}" if ref[0] is not None
            else "no reference returns")
    print(f"{dataset_id}: {len(episodes)} episodes, {total:,} steps from {which}, env {spec.id} in "
          f"AtariPreprocessing, {n_actions} actions, {refs}, written to {out}")
    return len(episodes)


# ---- datasets of one environment -> one local dataset (mix) ----


def mix(sources, dataset_id):
    """Every episode of each source in turn as the local dataset `dataset_id` (D4RL's
    medium-expert). The sources share the env (the larger max_episode_steps kept), spaces and
    reference returns; the eval env is the first's; infos are not copied. -> the number of
    episodes."""
    from minari.data_collector import EpisodeBuffer

    if files := [s for s in sources if os.path.isfile(s)]:
        raise DataError(f"{files[0]} is a file, not a dataset name or id (a D4RL file: "
                        f"convert-d4rl it first)")

    ids = [resolve(s) for s in sources]
    if len(ids) < 2:
        raise DataError("mix needs at least two source datasets, then the new id")
    _new_dataset_folder(dataset_id)

    # the sources, which must agree
    loaded = [_open_minari(i, download=True) for i in ids]  # (MinariDataset, metadata, episodes)
    first, (first_ds, first_meta, _) = ids[0], loaded[0]
    spec = first_ds.env_spec

    for i, (ds, meta, _) in zip(ids[1:], loaded[1:]):
        same = spec is not None and ds.env_spec is not None and replace(
            ds.env_spec, max_episode_steps=None) == replace(spec, max_episode_steps=None)
        if not same:
            raise DataError(f"{first} and {i} are datasets of different environments ("
                            f"{getattr(spec, 'id', None)} and {getattr(ds.env_spec, 'id', None)}); "
                            f"mix takes one environment's datasets")
        if (ds.observation_space != first_ds.observation_space
                or ds.action_space != first_ds.action_space):
            raise DataError(f"{first} and {i} have different observation or action spaces, so they "
                            f"cannot be mixed")
        for key in ("ref_min_score", "ref_max_score"):
            if meta.get(key) != first_meta.get(key):
                raise DataError(f"{first} and {i} have different reference returns ({key} "
                                f"{first_meta.get(key)} and {meta.get(key)}), so the mix would "
                                f"have no single normalised score")

    # every episode
    steps = [ds.env_spec.max_episode_steps for ds, _, _ in loaded]
    spec = replace(spec, max_episode_steps=None if None in steps else max(steps))
    buffers = [EpisodeBuffer(id=n, observations=ep.observations, actions=ep.actions,
                             rewards=list(ep.rewards), terminations=list(ep.terminations),
                             truncations=list(ep.truncations), infos={})
               for n, ep in enumerate(ep for _, _, episodes in loaded for ep in episodes)]
    folder = _write_dataset(
        dataset_id, buffers, ["mix", *sources, dataset_id], {"combined_datasets": ids}, env=spec,
        eval_env=getattr(first_ds, "_eval_env_spec", None),
        observation_space=first_ds.observation_space, action_space=first_ds.action_space,
        ref_min_score=first_meta.get("ref_min_score"),
        ref_max_score=first_meta.get("ref_max_score"), algorithm_name="data.py mix",
        description=f"every episode of {', then '.join(ids)}", jpeg_encoding=False)

    counts = ", ".join(f"{len(episodes)} from {i}" for i, (_, _, episodes) in zip(ids, loaded))
    print(f"{dataset_id}: {len(buffers)} episodes ({counts}), "
          f"{sum(len(b.actions) for b in buffers):,} steps, env {spec.id}, written to {folder}")
    return len(buffers)


# ---- making a dataset offline (make NAME): PointMaze, Breakout, Hopper ----
#
# PointMaze by the method of Minari's D4RL/pointmaze sets (d4rl-minari-dataset-generation, after
# D4RL's maze2d; make's help sums it up).

MAZE_ENVS = {"umaze": "UMaze", "medium": "Medium", "large": "Large"}  # PointMaze_<name>-v3
MAZE_EVAL_GOALS = {"umaze": (1, 1), "medium": (6, 6), "large": (7, 9)}  # Minari's eval goal cells
MAZE_STEPS = {"umaze": 200_000, "medium": 300_000, "large": 400_000}  # default --steps
MAZE_REF_EPISODES = 100  # eval episodes for the reference returns (Minari's default)


def make(name, dataset_id=None, seed=0, steps=None):
    """The local Minari dataset `dataset_id` (default _made_id), made offline from `seed`. -> its
    folder."""
    import difflib
    if name not in MAKE_NAMES:
        near = difflib.get_close_matches(name, MAKE_NAMES, n=1)
        level = next((what for start, what in NOT_MADE.items() if name.startswith(start)), None)
        raise DataError(f"make knows no '{name}'"
                        + (f" (ARS does not reach {level} in a make's minutes)" if level else "")
                        + f"; it makes {', '.join(MAKE_NAMES)}"
                        + (f" (did you mean {near[0]}?)" if near else ""))
    if seed < 0:
        raise DataError(f"--seed {seed} is negative; pass a whole number from 0")

    dataset_id = dataset_id or _made_id(name)
    _new_dataset_folder(dataset_id)

    # made, then written
    t0 = time.time()
    if name == "breakout-mixed":
        buffers, write_kwargs, behaviour = _make_breakout(seed, steps)
    elif name.split("-")[0] in LOCOMOTION:
        buffers, write_kwargs, behaviour = _make_locomotion(name, seed, steps)
    else:
        buffers, write_kwargs, behaviour = _make_pointmaze(name, seed, steps)
    command = ["make", name, dataset_id, *(["--seed", seed] if seed else []),
               *(["--steps", steps] if steps else [])]
    folder = _write_dataset(dataset_id, buffers, command, {"stands_in_for": MAKE_NAMES[name]},
                            **write_kwargs)

    # what it made
    returns = np.array([sum(b.rewards) for b in buffers])  # (episodes,)
    q = np.percentile(returns, [0, 50, 75, 100])
    print(f"{dataset_id} (stands in for {MAKE_NAMES[name]}): {len(buffers):,} episodes, "
          f"{sum(len(b.rewards) for b in buffers):,} steps\n"
          f"episode returns: min {q[0]:.4g}, median {q[1]:.4g}, 75th percentile {q[2]:.4g}, max "
          f"{q[3]:.4g}, mean {returns.mean():.4g}\n{behaviour}\nmade in {time.time() - t0:.0f} s, "
          f"written to {folder}")
    return folder


# the fewest steps a make's episodes average, for its disk estimate before any work: HalfCheetah's
# time limit (it never falls); the others about half the least average their makes gave
EPISODE_STEPS = dict(pointmaze=40, breakout=100, hopper=40, halfcheetah=1000)


def _check_make(env, steps, episode_steps, halves=1):
    """make's cost before any work: `halves` times `steps` times a step's memory (observation,
    action, 128 bytes of list entries) and time (a random step of `env`), and Minari's file of
    them (_file_bytes, as the write's check counts it) in episodes of `episode_steps` on average;
    a DataError if it cannot fit, naming the most --steps that both memory and disk allow."""
    import gymnasium as gym
    t0 = time.time()
    env.reset()
    for _ in range(100):
        env.step(env.action_space.sample())
    seconds = (time.time() - t0) / 100 * halves * steps

    # a step's bytes; an episode's arrays (each observation key, the action, reward and two flags)
    space = env.observation_space
    obs, act = (gym.spaces.flatten(s, s.sample()).nbytes for s in (space, env.action_space))
    arrays = (len(space.spaces) if isinstance(space, gym.spaces.Dict) else 1) + 4

    def memory(n):
        return halves * n * (obs + act + 128)

    def disk(n):  # the arrays, a reward and two flags a step, an episode's last observation
        episodes = -(-n // episode_steps)
        return _file_bytes(halves * (n * (obs + act + 10) + episodes * obs),
                           halves * episodes * arrays)

    # the most steps both allow (a hint leaves HINT_ROOM of each: they move between runs)
    root = dataset_folder("")  # (the datasets folder)
    ram, room = available_memory(), shutil.disk_usage(root).free
    lo, hi = 0, steps  # (fit(lo), not fit(hi))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ((ram is None or memory(mid) <= (1 - HINT_ROOM) * ram)
                and disk(mid) <= (1 - HINT_ROOM) * room):
            lo = mid
        else:
            hi = mid

    what, need = f"--steps {steps:,}" + " twice" * (halves > 1), memory(steps)
    cost = f"about {gb(need)} of memory and {duration(seconds)} of env steps"
    if need > (ram or need):
        raise DataError(f"{what} would take {cost}, more than the {gb(ram)} free; "
                        + (f"use --steps {lo:,} or fewer" if lo else "free some memory"))
    if disk(steps) > room:
        raise DataError(f"{what} would write about {gb(disk(steps))} to {root}, more than the "
                        f"{gb(room)} free there; "
                        + (f"use --steps {lo:,} or fewer" if lo else "free some space")
                        + ", or set MINARI_DATASETS_PATH to a folder with room")
    print(f"{halves * steps:,} steps: {cost}", flush=True)


def maze_steps(maze_map, goal):
    """The planner: value iteration over the maze's cells (1 a wall), 1 per move up, down, left or
    right, as D4RL's and Minari's QIteration. -> moves from each cell to goal (row, col), inf where
    unreachable."""
    free = np.array([[cell != 1 for cell in row] for row in maze_map])  # (H, W) open cells
    steps = np.full(free.shape, np.inf)  # (H, W)
    steps[goal] = 0.0

    while True:
        p = np.pad(steps, 1, constant_values=np.inf)  # (H + 2, W + 2)
        best = np.minimum.reduce([p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]])  # (H, W)
        new = np.where(free, np.minimum(steps, best + 1), np.inf)  # V = min(V, 1 + V')
        if np.array_equal(new, steps):
            return steps
        steps = new


def next_cell(steps, cell):
    """The waypoint: the neighbour of `cell` (row, col) fewest moves from the goal (ties: up first,
    then down, left, right)."""
    r, c = cell
    return min([(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)], key=lambda n: steps[n])


def _waypoint_action(obs, maze, plans, kp=10.0, kd=1.0):
    """The expert: a PD controller (D4RL's pointmaze/waypoint_controller.py gains, p 10, d -1)
    toward the centre of the next cell on the planner's path, or the goal in its cell. plans:
    maze_steps per goal cell. -> (2,) action."""
    pos, vel, goal = obs["achieved_goal"], obs["observation"][2:], obs["desired_goal"]  # (2,) each
    cell, goal_cell = tuple(maze.cell_xy_to_rowcol(pos)), tuple(maze.cell_xy_to_rowcol(goal))
    if goal_cell not in plans:
        plans[goal_cell] = maze_steps(maze.maze_map, goal_cell)
    waypoint = (goal if cell == goal_cell
                else maze.cell_rowcol_to_xy(np.array(next_cell(plans[goal_cell], cell))))
    return np.clip(kp * (waypoint - pos) - kd * vel, -1.0, 1.0)


def _maze_returns(spec, policy, episodes, seed):
    """policy(obs) in a fresh env of `spec` for `episodes` episodes, the first reset seeded (as
    Minari's get_average_reference_score) -> (mean return, fraction reaching the goal)."""
    import gymnasium as gym
    env = gym.make(spec)
    returns, reached = np.zeros(episodes), np.zeros(episodes, dtype=bool)

    obs, _ = env.reset(seed=seed)
    for i in range(episodes):
        done = False
        while not done:
            obs, reward, terminated, truncated, info = env.step(policy(obs))
            returns[i] += reward
            reached[i] |= info["success"]
            done = terminated or truncated
        obs, _ = env.reset()
    env.close()
    return returns.mean(), reached.mean()


def _make_pointmaze(name, seed, steps):
    """Minari's PointMaze collection -> (buffers, _write_dataset's kwargs, behaviour line)."""
    from minari.data_collector import EpisodeBuffer

    gym = _robotics()
    maze_name = name.split("-")[1]
    env_id = f"PointMaze_{MAZE_ENVS[maze_name]}{'Dense' if name.endswith('-dense') else ''}-v3"
    steps = steps or MAZE_STEPS[maze_name]

    # Minari's eval env, one goal cell (the ball goes on there until the horizon); the collection
    # env, a new goal at each one reached
    horizon = gym.spec(env_id).max_episode_steps  # 300 / 600 / 800
    eval_map = [list(row) for row in gym.spec(env_id).kwargs["maze_map"]]
    eval_map[MAZE_EVAL_GOALS[maze_name][0]][MAZE_EVAL_GOALS[maze_name][1]] = "g"
    eval_env = gym.make(env_id, maze_map=eval_map, continuing_task=True, reset_target=False)
    eval_spec = eval_env.spec
    eval_env.close()

    env = gym.make(env_id, continuing_task=True, reset_target=True, max_episode_steps=steps)
    maze, plans, rng = env.unwrapped.maze, {}, np.random.default_rng(seed)
    _check_make(env, steps, EPISODE_STEPS["pointmaze"])

    def noisy(obs):  # the behaviour policy: the expert plus N(0, 0.5^2) on each action, clipped
        action = _waypoint_action(obs, maze, plans) + 0.5 * rng.standard_normal(2)
        return np.clip(action, -1, 1).astype(np.float32)

    # one long run, cut into episodes
    buffers, obs_list, actions, rewards = [], [], [], []
    obs, _ = env.reset(seed=seed)

    for t in range(steps):
        obs_list.append(obs)
        actions.append(noisy(obs))
        obs, reward, _, _, info = env.step(actions[-1])
        rewards.append(float(reward))

        # an episode ends within 0.45 of its goal (the env draws the next, the ball goes on), at
        # the horizon, or at the last step
        if info["success"] or len(actions) == horizon or t == steps - 1:
            obs_list.append(obs)  # s_T, also the next episode's s_0
            buffers.append(EpisodeBuffer(
                id=len(buffers),
                observations={k: np.stack([o[k] for o in obs_list]) for k in obs},  # (T + 1, .)
                actions=np.stack(actions), rewards=rewards, terminations=[False] * len(actions),
                truncations=[False] * (len(actions) - 1) + [True], infos={}))
            obs_list, actions, rewards = [], [], []
    env.close()

    # reference returns as Minari measures them: random actions and the noise-free expert
    ref_min, _ = _maze_returns(eval_spec, lambda obs: rng.uniform(-1, 1, 2).astype(np.float32),
                               MAZE_REF_EPISODES, seed)
    ref_max, _ = _maze_returns(eval_spec,
                               lambda obs: _waypoint_action(obs, maze, plans).astype(np.float32),
                               MAZE_REF_EPISODES, seed)

    # the behaviour policy's score, the metadata
    score, reached = _maze_returns(eval_spec, noisy, MAZE_REF_EPISODES, seed)
    behaviour = (f"behaviour policy (the noisy controller), {MAZE_REF_EPISODES} eval episodes: "
                 f"return {score:.1f} (normalised "
                 f"{100 * (score - ref_min) / (ref_max - ref_min):.1f}), goal reached in "
                 f"{100 * reached:.0f}%; reference returns {ref_min:.1f} (random actions) / "
                 f"{ref_max:.1f} (no noise)")
    write_kwargs = dict(
        env=env.spec, eval_env=eval_spec, observation_space=env.observation_space,
        action_space=env.action_space, ref_min_score=ref_min, ref_max_score=ref_max,
        num_episodes_average_score=MAZE_REF_EPISODES,
        algorithm_name="value-iteration waypoints + PD controller, action noise N(0, 0.5^2) "
                       "(data.py make)",
        description=f"stands in for {MAKE_NAMES[name]}: {steps:,} steps of a continuing {env_id} "
                    f"run (seed {seed}), cut into episodes at each goal reached",
        jpeg_encoding=False)
    return buffers, write_kwargs, behaviour


# Breakout, made offline (make breakout-mixed)
#
# Mixed-quality play, as a DQN agent's replay is, in the eval env (atari_env_spec). The controller
# reads the ball and the paddle from the RAM (AtariARI's annotation, Anand et al. 2019; y grows
# downward, 0 while no ball is in play) and follows where the ball is, not where it will land: a
# model imitates best a player whose choice the frames show (RESULTS.md). Episodes take the eps of
# BREAKOUT_EPS in turn, from 0 (the controller) to 1 (random).

BREAKOUT_RAM = dict(ball_x=99, ball_y=101, paddle_x=72)
BREAKOUT_PADDLE_MIDDLE = 10  # ball x - paddle x at its middle (the paddle returns it at -1..21)
BREAKOUT_NOOP_ZONE = 4  # NOOP while the paddle's middle is this close to the ball (it has momentum)
BREAKOUT_EPS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 1.0)
BREAKOUT_EPISODES = 12 * len(BREAKOUT_EPS)


def _breakout_action(ram):
    """The controller: the console's RAM -> an action (0 NOOP, 1 FIRE, 2 RIGHT, 3 LEFT)."""
    x, y, paddle = (int(ram[BREAKOUT_RAM[k]]) for k in ("ball_x", "ball_y", "paddle_x"))
    if y == 0:
        return 1  # no ball in play: serve
    off = x - (paddle + BREAKOUT_PADDLE_MIDDLE)  # > 0: the ball is right of the paddle's middle
    return 0 if abs(off) <= BREAKOUT_NOOP_ZONE else 2 if off > 0 else 3


def _make_breakout(seed=0, steps=None):
    """BREAKOUT_EPISODES episodes (with `steps`: until that many steps, the last truncated) ->
    (buffers, _write_dataset's kwargs, behaviour line); reset seeds (the no-op starts) and random
    actions from default_rng(seed)."""
    from minari.data_collector import EpisodeBuffer

    spec = atari_env_spec("breakout")
    env = make_atari_env(spec)
    ale = env.unwrapped.ale
    rng = np.random.default_rng(seed)
    if steps:
        _check_make(env, steps, EPISODE_STEPS["breakout"])

    # episodes at each eps in turn
    buffers, returns, total, t0 = [], {eps: [] for eps in BREAKOUT_EPS}, 0, time.time()
    while (len(buffers) < BREAKOUT_EPISODES) if steps is None else (total < steps):
        eps = BREAKOUT_EPS[len(buffers) % len(BREAKOUT_EPS)]
        obs, _ = env.reset(seed=int(rng.integers(2**31)))
        frames, actions, rewards, terms, truncs = [obs], [], [], [], []

        # the controller, or with probability eps a random action
        while True:
            action = _breakout_action(ale.getRAM())
            if rng.random() < eps:
                action = int(rng.integers(4))
            obs, reward, term, trunc, _ = env.step(action)
            total += 1
            cut = steps is not None and total >= steps  # --steps reached: truncated here
            frames.append(obs)
            actions.append(action)
            rewards.append(float(reward))  # raw game points
            terms.append(bool(term))
            truncs.append(bool(trunc or cut) and not term)
            if term or trunc or cut:
                break

        # frames: (T+1, 84, 84) uint8
        buffers.append(EpisodeBuffer(id=len(buffers), observations=np.stack(frames), infos={},
                                     actions=np.array(actions, np.int64), rewards=rewards,
                                     terminations=terms, truncations=truncs))
        returns[eps].append(sum(rewards))
        if len(buffers) % len(BREAKOUT_EPS) == 0:
            print(f"breakout-mixed: {len(buffers)} episodes, {total:,} steps, "
                  f"{time.time() - t0:.0f}s")
    env.close()

    # the behaviour line and the metadata
    low, high = ATARI_GAMER_SCORES["Breakout"]
    mean = float(np.mean([r for rs in returns.values() for r in rs]))
    alone, random_play = returns[0.0], returns[1.0]
    behaviour = (f"mean return {mean:.1f} ({100 * (mean - low) / (high - low):.1f} "
                 f"gamer-normalised); the controller alone (eps 0, {len(alone)} "
                 f"episode{'s' * (len(alone) != 1)}): {min(alone):.0f} to {max(alone):.0f}, mean "
                 f"{np.mean(alone):.1f}")
    if random_play:
        behaviour += f"; random play (eps 1): mean {np.mean(random_play):.1f}"

    write_kwargs = dict(env=spec, eval_env=spec, observation_space=env.observation_space,
                        action_space=env.action_space, ref_min_score=low, ref_max_score=high,
                        algorithm_name="scripted RAM-reading paddle controller, each action random "
                        "with an episode-wide probability eps (data.py make breakout-mixed)",
                        description=f"{len(buffers)} episodes, {total:,} steps of Breakout, "
                        f"mixed-quality play: eps {', '.join(map(str, BREAKOUT_EPS))} in turn, "
                        f"seed {seed}", jpeg_encoding=False)
    return buffers, write_kwargs, behaviour


# Locomotion, made offline (make hopper-*, halfcheetah-*)
#
# D4RL's recipe with Augmented Random Search (Mania, Guy and Recht 2018) in place of SAC: ARS V2-t
# trains a linear policy in the robot's gymnasium v5 env, the alive bonus (1 a step) off its
# training returns as the paper does (modestyachts/ARS@4c8e24e code/ars.py#L399), until its
# noise-free eval return reaches the level or the budget ends (then the best policy). Departures
# from the paper and from D4RL:
# 1. gymnasium's v5 robots, not gym 0.9's v1: the same robots and rewards.
# 2. Actions clipped to the env's [-1, 1]: the simulator clamps them alike, the control cost not.
# 3. A run below medium after ARS_RESTART iterations restarts from M = 0 with new directions:
#    Hopper's runs vary widely with the seed, and one can stall for long.
# 4. medium-replay: noisy rollouts of the ARS run's policy after each of its updates, from the
#    first to medium, an episode of each in turn until --steps, so that each update's share
#    follows its episodes' length, as in a learner's replay (D4RL keeps SAC's): the size is
#    --steps at any seed, however many updates ARS took.
# 5. medium-expert: `make <robot>-medium`'s data, then `make <robot>-expert`'s, at the same seed
#    (D4RL's recipe, both datasets whole).
# Walker2d is not made, nor HalfCheetah's expert: ARS, with RL Zoo's settings for the robot, does
# not reach the level within the make's budget (RESULTS.md).

# robot: its env, ARS's settings and the alive bonus off a training return as RL Zoo's ars.yml
# gives them ("closest to the original paper"), the most iterations to each level, set from
# measured runs, and the std of the data's action noise, the one its gait survives (HalfCheetah's
# linear gait flips over under Hopper's: RESULTS.md)
LOCOMOTION = {
    "hopper": dict(env="Hopper-v5", ars=dict(alpha=0.01, nu=0.025, directions=8, top=4),
                   alive=1.0, iterations={"medium": 1000, "expert": 300}, noise=0.05),
    "halfcheetah": dict(env="HalfCheetah-v5", ars=dict(alpha=0.02, nu=0.03, directions=32, top=4),
                        alive=0.0, iterations={"medium": 200}, noise=0.02),
}
# what ARS does not reach within a make's minutes, with RL Zoo's settings (RESULTS.md)
NOT_MADE = {"walker2d-": "Walker2d's medium", "halfcheetah-expert": "HalfCheetah's expert",
            "halfcheetah-medium-expert": "HalfCheetah's expert"}
LEVELS = {"medium": 1 / 3, "expert": 1.0}  # the eval return that stops training, normalised
ARS_RESTART, ARS_EVAL_EPISODES, LOCOMOTION_STEPS = 200, 5, 300_000
LOCOMOTION_HELP = (
    "hopper-*, halfcheetah-*: ARS trains a linear policy in the v5 robot to a third of D4RL's "
    "expert\nreturn (expert: all, or the best in "
    f"{LOCOMOTION['hopper']['iterations']['expert']} iterations); data: its rollouts, "
    f"N(0, {LOCOMOTION['hopper']['noise']}^2) on\neach action (HalfCheetah: "
    f"{LOCOMOTION['halfcheetah']['noise']}; medium-replay: those of its policy after each update "
    "on the way\nto medium, an episode of each in turn; medium-expert: the medium data, then the "
    "expert data).\nWalker2d: ARS does not reach medium in the make's budget (RESULTS.md).")


def ars(rollout, shape, rng, alpha, nu, directions, top):
    """ARS V2-t (Mania et al. 2018, Algorithm 2) of the policy a = M diag(Sigma)^(-1/2) (x - mu).
    rollout(M, mu, std) -> (training return, the (T, n) states met, the episode). Yields after each
    update: M, mu, std and the iteration's 2N episodes."""
    M, mu, std = np.zeros(shape), np.zeros(shape[1]), np.ones(shape[1])
    seen, total, squares = 0, np.zeros(shape[1]), np.zeros(shape[1])
    while True:
        # N directions delta_k ~ N(0, I), rollouts of M + nu delta_k and M - nu delta_k (lines 4-5)
        deltas = rng.standard_normal((directions, *shape))                 # (N, p, n)
        runs = [rollout(M + sign * nu * d, mu, std) for d in deltas for sign in (1, -1)]
        r = np.array([run[0] for run in runs]).reshape(directions, 2)      # (N, 2): r+, r-

        # the top b directions by max(r+, r-), a step over the std of their 2b returns (lines 6-7)
        best = np.argsort(-r.max(1), kind="stable")[:top]
        step = alpha / (top * (r[best].std() or 1.0))
        M = M + step * np.tensordot(r[best, 0] - r[best, 1], deltas[best], axes=1)     # (p, n)

        # mu, Sigma: the mean and diagonal covariance of every state met in training (line 8); an
        # entry that never varied is ignored (modestyachts/ARS@4c8e24e code/filter.py#L223)
        states = np.concatenate([run[1] for run in runs])                  # (steps, n)
        seen, total = seen + len(states), total + states.sum(0)
        squares = squares + (states**2).sum(0)
        mu = total / seen
        std = np.sqrt(np.maximum(squares / seen - mu**2, 0.0))
        std[std < 1e-7] = np.inf
        yield M, mu, std, [run[2] for run in runs]


def _make_locomotion(name, seed, steps, halves=1):
    """ARS to the level `name` names, then its noisy rollouts; medium-replay: those of each policy
    on the way to medium; medium-expert: medium's data, then expert's (the room for `halves` such
    datasets checked first). -> (buffers, _write_dataset's kwargs, behaviour line)"""
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer
    robot, level = name.split("-", 1)
    if level == "medium-expert":
        parts = [_make_locomotion(f"{robot}-medium", seed, steps, halves=2),
                 _make_locomotion(f"{robot}-expert", seed, steps)]
        kwargs = parts[0][1] | dict(description=f"stands in for {MAKE_NAMES[name]}: the medium "
                                    f"data, then the expert data, seed {seed}")
        return (parts[0][0] + parts[1][0], kwargs,
                f"medium: {parts[0][2]}\nexpert: {parts[1][2]}")
    settings, t0 = LOCOMOTION[robot], time.time()
    (low, high), steps = D4RL_REF_SCORES[settings["env"].split("-")[0]], steps or LOCOMOTION_STEPS
    env, noise_rng = gym.make(settings["env"]), np.random.default_rng([seed, 0])
    shape = env.action_space.shape + env.observation_space.shape                      # (p, n)
    _check_make(env, steps, EPISODE_STEPS[robot], halves)
    env.reset(seed=seed)

    def rollout(M, mu, std, alive=settings["alive"], noise=0.0, limit=None):
        obs, _ = env.reset()
        states, actions, rewards = [obs], [], []
        while True:
            a = M @ ((obs - mu) / std) + noise * noise_rng.standard_normal(len(M))
            actions.append(np.clip(a, -1, 1).astype(np.float32))
            obs, reward, term, trunc, _ = env.step(actions[-1])
            states.append(obs)
            rewards.append(float(reward))
            if term or trunc or len(actions) == limit:
                break
        ends = [False] * (len(actions) - 1)
        episode = EpisodeBuffer(observations=np.stack(states), actions=np.stack(actions),
                                rewards=rewards, terminations=ends + [term],
                                truncations=ends + [not term], infos={})        # (T + 1, n) states
        return sum(rewards) - alive * len(rewards), np.stack(states[:-1]), episode

    def train(stop):
        """ARS until the eval return reaches `stop`'s level or the budget ends; (re)start a run at
        first, and where it is below medium ARS_RESTART iterations on. -> (best (score, iteration,
        M, mu, std), the last run's policies (M, mu, std) in order, training steps, runs)"""
        medium, target = (low + LEVELS[k] * (high - low) for k in ("medium", stop))
        best, start, runs, seen = (-np.inf,), 0, 0, 0
        for it in range(1, settings["iterations"][stop] + 1):
            if it == start + 1 and best[0] < medium:
                training = ars(rollout, shape, np.random.default_rng([seed, it]),
                               **settings["ars"])
                start, runs, policies = it - 1 + ARS_RESTART, runs + 1, []
            M, mu, std, episodes = next(training)
            policies.append((M, mu, std))
            seen += sum(len(e.rewards) for e in episodes)
            score = np.mean([rollout(M, mu, std, 0.0)[0] for _ in range(ARS_EVAL_EPISODES)])
            best = max(best, (score, it, M, mu, std), key=lambda b: b[0])
            if score >= target:
                break
        if best[0] < medium:
            raise DataError(f"ARS did not reach {robot}'s medium level (an eval return of "
                            f"{medium:.0f}) in {it} iterations of {runs} run(s) at --seed {seed} "
                            f"(its best: {best[0]:.0f}); try another --seed")
        return best, policies, seen, runs

    # train; the data: noisy rollouts until `steps`, the last cut there, of the best policy, or
    # (medium-replay) of the run's policy after each update, an episode of each in turn
    (score, it, M, mu, std), policies, seen, runs = train(level.removesuffix("-replay"))
    if level != "medium-replay":
        policies = [(M, mu, std)]
    rounds, total = [], 0
    while total < steps:
        rounds.append([])
        for M_k, mu_k, std_k in policies:
            rounds[-1].append(rollout(M_k, mu_k, std_k, noise=settings["noise"],
                                      limit=steps - total)[2])
            total += len(rounds[-1][-1].rewards)
            if total == steps:
                break
    # (in the order of the policies, as a learner's replay)
    buffers = [r[k] for k in range(len(policies)) for r in rounds if k < len(r)]

    # the behaviour line; medium-replay: the policies the data holds (--steps can end the first
    # round early)
    norm = lambda r: f"{r:.1f} (normalised {100 * (r - low) / (high - low):.1f})"
    returns, used = [sum(e.rewards) for e in buffers], len(rounds[0])
    whose = (f"its {used} polic{'y' if used == 1 else 'ies'}" if used == len(policies) else
             f"the first {used} of its {len(policies)} policies")
    behaviour = (f"mean return {norm(np.mean(returns))}, best {norm(max(returns))}; the policy's "
                 f"eval return {norm(score)}, at ARS iteration {it} of {runs} run(s), {seen:,} "
                 f"training steps" + (f", the data from {whose}, an episode of each in "
                                     f"turn" if level == "medium-replay" else "")
                 + f", {time.time() - t0:.0f} s")
    write_kwargs = dict(
        env=env.spec, eval_env=env.spec, observation_space=env.observation_space,
        action_space=env.action_space, ref_min_score=low, ref_max_score=high,
        algorithm_name=f"ARS V2-t, N(0, {settings['noise']}^2) action noise (data.py make)",
        description=f"stands in for {MAKE_NAMES[name]}: {behaviour}, seed {seed}")
    return buffers, write_kwargs, behaviour


# ---- writing a new dataset, all or nothing ----
#
# A dataset is written into a hidden folder of the datasets folder (Minari lists none), renamed into
# place when whole: an interrupt (Ctrl-C, SIGTERM, kill -9) or a failed write leaves no partial
# dataset where Minari looks. The writer locks the hidden folder; the next dataset command removes
# any such folder no live process holds. A stop signal (_stop) waits while the folder is made and
# from the write's end to the cleanup's end.

PARTIAL_PREFIX = ".data.py-partial-"
# signals caught; the dataset in place; signals held; HDF5 writing (after a failed write it can
# crash where it closes the file or at the exit: such a command ends by os._exit)
STOP = dict(signals=[], in_place=False, hold=False, hdf5=False)
DISK_MARGIN = 2 ** 20  # bytes kept free beyond a dataset's estimate (metadata, the lock)
HDF5_ARRAY_BYTES = 4096  # an array's headers and chunk index in Minari's file, with a margin
HINT_ROOM = 0.05  # the share of the free memory and disk a refusal's --steps leaves


def _new_dataset_folder(dataset_id):
    """-> (the new dataset's folder, the datasets folder), checked before any work; a DataError if
    the id is malformed or taken, or a folder unwritable or on another filesystem."""
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.storage.datasets_root_dir import get_dataset_path
    namespace = None
    with contextlib.suppress(ValueError, TypeError):  # (TypeError: minari's, on an id without -vN)
        namespace = parse_dataset_id(dataset_id)[0]
    if namespace is None:  # load_data reads an id without a namespace as a short name
        raise DataError(f"dataset id '{dataset_id}' must look like namespace/name-vN, of letters, "
                        f"digits, _ and - (the namespace 2 or more, / allowed inside), e.g. "
                        f"d4rl/hopper/medium-v2")

    # a free folder in a datasets folder that can be written (made by get_dataset_path if missing)
    try:
        folder, root = dataset_folder(dataset_id), str(get_dataset_path())
    except OSError as e:
        raise _unwritable(os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets"), e) from None

    if os.path.exists(folder):
        raise DataError(f"dataset '{dataset_id}' already exists at {folder}; choose another id "
                        f"(nothing is overwritten)")
    parent = os.path.dirname(folder)
    while not os.path.isdir(parent):  # (the datasets folder is one)
        if os.path.exists(parent):
            raise DataError(f"{parent} is a file, so the dataset '{dataset_id}' cannot be written "
                            f"in it; choose another id or move that file")
        parent = os.path.dirname(parent)

    # the folders it goes in: writable, on one filesystem
    for where in dict.fromkeys([root, parent]):
        if not os.access(where, os.W_OK):
            raise _unwritable(where, PermissionError("not writable"))
    if os.stat(parent).st_dev != os.stat(root).st_dev:  # (a rename cannot cross filesystems)
        raise _unwritable(parent, OSError(f"on another filesystem than {root}"))
    return folder, root


def _unwritable(root, e):
    return DataError(f"cannot write a dataset in {root} ({e.strerror or e}); set "
                     f"MINARI_DATASETS_PATH to a folder you can write")


def _clean_partial(root):
    """Remove the partial datasets in `root` that no live command holds."""
    import fcntl
    for name in sorted(os.listdir(root)):
        path, lock = os.path.join(root, name), os.path.join(root, name, "lock")
        if not name.startswith(PARTIAL_PREFIX) or not os.path.isdir(path):
            continue
        if not os.path.exists(lock) and time.time() - os.path.getmtime(path) < 60:
            continue  # made a moment ago by a live command, whose lock comes next

        with open(lock, "a") as f:  # (made here where a command was killed before it made its own)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live command is writing it
                continue
            print(f"removing {path}: a partial dataset left by an interrupted data.py command")
            shutil.rmtree(path, ignore_errors=True)


def _file_bytes(nbytes, arrays):
    """Bytes of Minari's uncompressed file (the most the disk holds at once: _gzip_hdf5 replaces
    it) of `arrays` arrays of `nbytes` in all: a tenth more, HDF5_ARRAY_BYTES an array and
    DISK_MARGIN; make's first estimate and the write's check alike."""
    return int(1.1 * nbytes) + HDF5_ARRAY_BYTES * arrays + DISK_MARGIN


def _disk_need(buffers):
    """_file_bytes of `buffers`."""
    def size(x):  # -> (bytes, arrays); an episode's list holds entries of one shape
        if isinstance(x, dict):
            return tuple(map(sum, zip((0, 0), *map(size, x.values()))))
        return (0, 0) if x is None or not len(x) else (len(x) * np.asarray(x[0]).nbytes, 1)

    keys = ("observations", "actions", "rewards", "terminations", "truncations", "infos")
    nbytes, arrays = map(sum, zip((0, 0), *(size(getattr(b, k)) for b in buffers for k in keys)))
    return _file_bytes(nbytes, arrays)


def _gzip_hdf5(path):
    """Rewrite Minari's HDF5 file with each array gzip-compressed in one chunk (Minari writes them
    uncompressed; h5py reads both alike). The copy is made in memory and written by Python, so the
    disk holds one of the two at a time and a full disk is an OSError, not HDF5's."""
    import h5py
    with h5py.File(path, "r") as src, h5py.File(path + ".gz", "w", driver="core",
                                                backing_store=False, libver="latest") as dst:
        dst.attrs.update(src.attrs)

        def copy(name, obj):
            if isinstance(obj, h5py.Group):
                dst.require_group(name).attrs.update(obj.attrs)
            else:
                data = obj[()]
                chunks = data.shape if data.ndim and data.size else None
                out = dst.create_dataset(name, data=data, chunks=chunks,
                                         compression="gzip" if chunks else None)
                out.attrs.update(obj.attrs)

        src.visititems(copy)
        dst.flush()
        image = dst.id.get_file_image()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(image)


def _write_dataset(dataset_id, buffers, command, extra_metadata=None, **kwargs):
    """minari.create_dataset_from_buffers(dataset_id, buffers, **kwargs), all or nothing, with
    `python data.py` + `command` and extra_metadata in its metadata; callers pass
    jpeg_encoding=False (Minari's default JPEG is lossy). -> its folder."""
    import fcntl
    import shlex
    import tempfile
    from unittest import mock
    import minari
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.namespace import create_namespace

    folder, root = _new_dataset_folder(dataset_id)
    _clean_partial(root)
    if (need := _disk_need(buffers)) > (free := shutil.disk_usage(root).free):
        raise DataError(f"the dataset '{dataset_id}' would take about {gb(need)} in {root} while "
                        f"it is written, more than the {gb(free)} free there; free some space, "
                        f"or set MINARI_DATASETS_PATH to a folder with room")

    tmp = None
    _hold(True)
    try:
        # the hidden folder and its lock
        try:
            tmp = tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=root)
            lock = open(os.path.join(tmp, "lock.new"), "w")
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until this function ends, or this process does
            os.rename(lock.name, os.path.join(tmp, "lock"))  # named once held: never cleaned
        except OSError as e:
            raise _unwritable(root, e) from None

        # the dataset, written into the hidden folder
        with lock:
            _hold(False)  # a stop signal ends the write at once
            # (HDF5 prints a traceback per object it fails to write: said once, below)
            with mock.patch.dict(os.environ, MINARI_DATASETS_PATH=os.path.join(tmp, "datasets")), \
                    contextlib.redirect_stderr(io.StringIO()):
                STOP["hdf5"] = True
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # minari's advice: author, code permalink, ...
                    ds = minari.create_dataset_from_buffers(dataset_id, buffers, **kwargs)
                command = shlex.join(["python", "data.py", *map(str, command)])
                ds.storage.update_metadata({"data_py_command": command, **(extra_metadata or {})})
                written = dataset_folder(dataset_id)
                _gzip_hdf5(os.path.join(written, "data", "main_data.hdf5"))
                STOP["hdf5"] = False

            # renamed into place, unless a stop signal came; then its namespace recorded
            _hold(True)
            if STOP["signals"]:  # (one a finaliser swallowed: acted on here)
                _act(STOP["signals"][-1])
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            try:
                os.rename(written, folder)  # atomic
            except OSError:
                _new_dataset_folder(dataset_id)  # "already exists" if another command wrote it
                raise
            STOP["in_place"] = True
            with contextlib.suppress(ValueError):  # (there already)
                create_namespace(parse_dataset_id(dataset_id)[0])

    # a full disk, a quota, a permission: one sentence; the empty folders made for it removed
    # (HDF5's failed writes: OSErrors, or RuntimeErrors and ValueErrors naming the errno)
    except (OSError, RuntimeError, ValueError) as e:
        code = getattr(e, "errno", None) or int((re.findall(r"errno = (\d+)", str(e)) or [0])[0])
        if not code or STOP["in_place"]:
            raise
        with contextlib.suppress(OSError):
            os.removedirs(os.path.dirname(folder))
        raise DataError(f"could not write the dataset '{dataset_id}' in {os.path.dirname(folder)} "
                        f"({os.strerror(code)}); nothing of it is left") from None
    finally:
        _hold(True)  # (where the write raised)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        _hold(False)  # a stop signal that waited is acted on here
    return folder


# ---- command line ----


def info(name):
    """Print a dataset's summary and sampling rate."""
    t0 = time.time()
    d = load_data(name)
    print(f"{d.dataset_id}: {len(d.episodes)} episodes, {len(d.flat['rewards'])} steps, obs "
          f"{d.obs_dim}, act {d.act_dim}, loaded in {time.time() - t0:.1f}s; refs {d.ref_min:.1f}/"
          f"{d.ref_max:.1f} ({d.ref_source}); targets {d.target_returns}; max_ep_len "
          f"{d.max_ep_len}")

    rng, t0 = np.random.default_rng(0), time.time()
    for _ in range(200):
        d.sample(64, 20, rng)
    dt = (time.time() - t0) / 200
    print(f"sampling: {64 / dt:,.0f} windows/s ({1e3 * dt:.2f} ms per batch of 64 x K=20)")


class Stopped(BaseException):
    """SIGTERM raised where the program is, as Ctrl-C raises KeyboardInterrupt."""


def _stop(signum, frame):
    """Ctrl-C and SIGTERM in a command: noted in STOP (_write_dataset looks: a finaliser swallows
    what it raises), left waiting while a write holds them, else acted on."""
    STOP["signals"].append(signum)
    if STOP["hold"]:
        STOP["waiting"] = signum
    else:
        _act(signum)


def _act(signum):
    """A stop signal acted on: said once the new dataset is in place, else raised."""
    if STOP["in_place"]:
        print("done; the signal came after the dataset was written", file=sys.stderr)
    else:
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)


def _hold(on):
    """Stop signals wait (on) or act (off; one that waited is acted on now)."""
    STOP["hold"] = on
    if not on and (signum := STOP.pop("waiting", None)):
        _act(signum)


def _unraisable(u):
    """sys.unraisablehook in a command: a stop raised in a finaliser is dropped (STOP has it)."""
    if not isinstance(u.exc_value, (KeyboardInterrupt, Stopped)):
        sys.__unraisablehook__(u)


def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number above 0")
    return int(text)


def main(argv=None):
    import difflib
    import threading

    p = FlagParser(prog="data.py", description="Minari datasets for the model files: inspect one, "
                   "convert D4RL or DQN-replay data, mix datasets of one environment, or make one "
                   "offline (new datasets are written all or nothing).")
    sub = p.add_subparsers(dest="command", required=True)

    # the commands and their flags
    p_info = sub.add_parser("info", help="load a dataset, print its summary and the sampling rate")
    p_info.add_argument("name", nargs="?", default="hopper-medium",
                        help="short name or Minari id (default: %(default)s)")

    p_conv = sub.add_parser("convert-d4rl", help="D4RL MuJoCo HDF5 file -> local Minari dataset")
    p_conv.add_argument("path", help="the D4RL file, e.g. hopper_medium-v2.hdf5")
    p_conv.add_argument("dataset_id",
                        help="the new dataset's Minari id, e.g. d4rl/hopper/medium-v2")
    p_conv.add_argument("--env", default=None,
                        help="its gymnasium env (default: the robot's v5 env, from the names)")

    p_dqn = sub.add_parser("convert-dqn-replay",
                           help="DQN-replay folder -> local Minari dataset of whole episodes")
    p_dqn.add_argument("folder", help="a downloaded <Game>/<run>/replay_logs folder, e.g. "
                                      "Breakout/1/replay_logs")
    p_dqn.add_argument("game", help="ALE's name of the game, e.g. Breakout")
    p_dqn.add_argument("dataset_id",
                       help="the new dataset's Minari id, e.g. dqn-replay/breakout/1pct-v0")
    p_dqn.add_argument("--buffers", type=_positive, default=None, metavar="N",
                       help="read the last N buffers, the highest numbers (default: all, as DT's "
                            "--num_buffers 50)")
    p_dqn.add_argument("--steps", type=_positive, default=500_000, metavar="S",
                       help="whole episodes until S steps, spread over the buffers (default: "
                            "%(default)s, DT's 1%%)")

    p_mix = sub.add_parser("mix", help="datasets of one environment -> one local dataset (D4RL's "
                                       "medium-expert)")
    p_mix.add_argument("sources", nargs="+", metavar="SOURCE",
                       help="short names or Minari ids, in order")
    p_mix.add_argument("dataset_id",
                       help="the new dataset's Minari id, e.g. local/hopper/medium-expert-v0")

    p_make = sub.add_parser(
        "make", help="make a dataset offline: PointMaze by Minari's method, Breakout by a scripted "
        "player, Hopper and HalfCheetah by ARS",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Make a local Minari dataset offline, seeded. NAME, and what it stands in "
        "for:\n" + "".join(f"  {n:27}{what}\n" for n, what in MAKE_NAMES.items())
        + "PointMaze, by Minari's method: a continuing task, a planner (value iteration over the "
        "maze's\ncells) steering a PD controller, N(0, 0.5^2) noise on every action, episodes cut "
        "at each goal\nreached, Minari's eval env and reference returns (random actions, the "
        "controller without noise).\nbreakout-mixed: a controller that reads the ball from the "
        "console's RAM and keeps the paddle\nunder it, each action random with an episode-wide "
        f"probability eps, eps from 0 to 1 across\n{BREAKOUT_EPISODES} episodes, in the env the "
        "project evaluates in (no sticky actions, unlike DQN-replay's);\nframes lossless.\n"
        + LOCOMOTION_HELP)

    p_make.add_argument("name", metavar="NAME", help=", ".join(MAKE_NAMES))
    p_make.add_argument("dataset_id", nargs="?", default=None,
                        help="the new dataset's Minari id (default: "
                             "made/pointmaze/<maze>[-dense]-v0, made/breakout/mixed-v0, "
                             "made/<robot>/<level>-v0)")
    p_make.add_argument("--seed", type=int, default=0,
                        help="the seed of everything random (default: %(default)s)")
    p_make.add_argument("--steps", type=_positive, default=None, metavar="N",
                        help="steps to collect (default: PointMaze umaze / medium / large "
                             + " / ".join(f"{n:,}" for n in MAZE_STEPS.values())
                             + f"; breakout-mixed: {BREAKOUT_EPISODES} episodes; locomotion: "
                             f"{LOCOMOTION_STEPS:,}, medium-expert: each half)")

    # python data.py NAME: short for info NAME
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in sub.choices:
        if "/" not in argv[0] and argv[0] not in SHORT_NAMES:  # neither a command nor a dataset
            near = difflib.get_close_matches(argv[0], [*sub.choices, *SHORT_NAMES], n=1)
            print(f"error: unknown command '{argv[0]}'; the commands are {', '.join(sub.choices)}"
                  + (f" (did you mean {near[0]}?)" if near else " (or name a dataset: a short name "
                     "such as hopper-medium, or a Minari id such as mujoco/hopper/medium-v0)"),
                  file=sys.stderr)
            raise SystemExit(1)
        argv = ["info", *argv]
    args = p.parse_args(argv)

    # Ctrl-C and SIGTERM: _stop (set from the main thread only)
    here = threading.current_thread() is threading.main_thread()
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, _stop) for s in stops} if here else {}
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    STOP.update(signals=[], in_place=False, hold=False, hdf5=False)
    try:
        # (blocked while the command line loaded: acted on now)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)

        if args.command == "info":
            info(args.name)
        elif args.command == "mix":
            mix(args.sources, args.dataset_id)
        elif args.command == "make":
            # (said by a stop signal's line below)
            args.dataset_id = args.dataset_id or _made_id(args.name)
            make(args.name, args.dataset_id, args.seed, args.steps)
        elif args.command == "convert-dqn-replay":
            convert_dqn_replay(args.folder, args.game, args.dataset_id, args.buffers, args.steps)
        else:
            convert_d4rl(args.path, args.dataset_id, args.env)

    # bad input: one sentence, exit 1; a stop: what was left, exit 130 or 143
    except (Exception, KeyboardInterrupt, Stopped) as e:
        # (a stop raised in an import or a reader comes back as another error: STOP has it)
        if isinstance(e, Exception) and not STOP["signals"]:
            if not isinstance(e, DataError):
                raise
            print(f"error: {e}", file=sys.stderr)
            if STOP["hdf5"] and __name__ == "__main__":  # (HDF5's objects never finalised)
                sys.stdout.flush()
                os._exit(1)
            raise SystemExit(1)

        ctrl_c = not STOP["signals"] or STOP["signals"][0] == signal.SIGINT  # none: a Ctrl-C
        how, code = ("Ctrl-C", 130) if ctrl_c else ("SIGTERM", 143)
        new = getattr(args, "dataset_id", None)
        print(f"stopped by {how}" + (f": the dataset '{new}' was not written, and nothing of it is "
                                     "left" if new else ""), file=sys.stderr)
        raise SystemExit(code) from None
    finally:
        if __name__ == "__main__":  # the work is done: a stop signal from here to the exit is moot
            for s in stops:
                signal.signal(s, signal.SIG_IGN)
        else:  # a caller's handlers back (None: not Python's)
            sys.unraisablehook = hook
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
        STOP.update(signals=[], in_place=False, hold=False)


if __name__ == "__main__":
    main()
