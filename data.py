"""
Minari datasets -> episodes -> training windows: the only data code the model files share.

    d = load_data("hopper-medium")            # short name, or any Minari id ("replica/hopper/medium-v0")
    batch = d.sample(64, 20, rng)              # dict of torch tensors, shapes below

The top of the file is what the model files and evaluate.py use, in the order a training step meets it; below the
"Dataset tools" fence: the converters, mix, make, atomic writes and the command line. Lines that follow DT's official
code name it (kzl/decision-transformer@e2d82e6 PATH#Lnn, i.e.
https://github.com/kzl/decision-transformer/blob/e2d82e68f330c00f763507b3b01d774740bee53f/gym/experiment.py#L103).

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

Atari (image states, discrete actions; family 'atari') differs in two entries and keeps the rest:
    states      (B, K, 4, 84, 84) uint8, the last 4 frames up to each step, stacked when the batch is drawn (memory
                holds one 84x84 frame per step); frames before the episode's first are 0 (stack_frames)
    actions     (B, K) int64 action index (0 where padded); prev_action (B,) int64
A state is divided by 255 inside the model. Atari data: Minari's atari/<game>/expert-v0 (RGB screens, made 84x84
grayscale at load by atari_frame_wrappers, as in its eval env) or DQN-replay's 84x84 frames (convert-dqn-replay).

Minari stores T+1 observations for T actions: s_t is paired with a_t, r_t for t < T and the final observation s_T
is dropped. Dict observations (mazes) are flattened to one vector (flatten_obs). Data with a NaN or infinite
observation, action or reward is refused when it is loaded.

Command line:
    python data.py info hopper-medium        # summary and sampling rate (`python data.py NAME` is short for it)
    python data.py convert-d4rl hopper_medium-v2.hdf5 d4rl/hopper/medium-v2 [--env Hopper-v5]
    python data.py mix hopper-medium hopper-expert local/hopper/medium-expert-v0    # D4RL's medium-expert recipe
    python data.py convert-dqn-replay Breakout/1/replay_logs Breakout dqn-replay/breakout/1pct-v0   # 1% of DQN-replay
    python data.py make pointmaze-medium-dense   # made offline, Minari's way: made/pointmaze/medium-dense-v0
    python data.py make breakout-mixed           # a scripted player's mixed play: made/breakout/mixed-v0
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
import time
import warnings
from dataclasses import dataclass, field, replace

if __name__ == "__main__":  # the command line: stop signals wait (in the threads numpy and torch start too) for main()
    signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))

import numpy as np
import torch

# -------------------------------------------------------------------------------------------------------------------
# names and tables: short names -> Minari ids, reference returns, the papers' return-to-go targets

_LOCOMOTION = ["halfcheetah", "hopper", "walker2d", "ant"]
SHORT_NAMES = {f"{env}-{level}": f"mujoco/{env}/{level}-v0" for env in _LOCOMOTION
               for level in ("simple", "medium", "expert")}
SHORT_NAMES.update({f"pointmaze-{m}": f"D4RL/pointmaze/{m}-v2" for m in
                    ("umaze", "umaze-dense", "medium", "medium-dense", "large", "large-dense")})
SHORT_NAMES.update({f"antmaze-{m}": f"D4RL/antmaze/{m}-v1" for m in
                    ("umaze", "umaze-diverse", "medium-play", "medium-diverse", "large-play", "large-diverse")})
# Adroit (24-DoF Shadow Hand, AdroitHand{Pen,Hammer,Door,Relocate}-v1): D4RL's v1 data as Minari re-recorded it
# (LSDT's Table 9 ran D4RL's v0 human and cloned sets)
ADROIT_TASKS = ("pen", "hammer", "door", "relocate")
SHORT_NAMES.update({f"{t}-{level}": f"D4RL/{t}/{level}-v2" for t in ADROIT_TASKS
                    for level in ("human", "cloned", "expert")})
# The Atari games of the DT (Breakout, Qbert, Pong, Seaquest), StARformer (+ Assault, Boxing) and DeMa (+ Asterix,
# Frostbite, Gopher) papers, as Minari's expert sets (the papers' own data, 1% of DQN-replay: convert-dqn-replay)
ATARI_GAMES = ("breakout", "qbert", "pong", "seaquest", "assault", "boxing", "asterix", "frostbite", "gopher")
SHORT_NAMES.update({f"{g}-expert": f"atari/{g}/expert-v0" for g in ATARI_GAMES})

# D4RL's reference returns (d4rl/infos.py), used when a dataset carries none (Minari's mujoco/* sets, Minari#323)
D4RL_REF_SCORES = {"Hopper": (-20.272305, 3234.3), "HalfCheetah": (-280.178953, 12135.0),
                   "Walker2d": (1.629008, 4592.3), "Ant": (-325.6, 3879.7)}
# D4RL's Adroit reference returns (d4rl/infos.py), likewise (D4RL_REF_SCORES' keys name the locomotion robots only)
ADROIT_REF_SCORES = {"AdroitHandPen": (-96.262264, 3076.8331), "AdroitHandHammer": (-274.856578, 12794.1),
                     "AdroitHandDoor": (-56.512833, 2880.5697), "AdroitHandRelocate": (-6.425911, 4233.8773)}
# Decision Transformer's evaluation targets, raw return units: kzl/decision-transformer@e2d82e6 gym/experiment.py#L41
DT_TARGETS = {"Hopper": [3600.0, 1800.0], "HalfCheetah": [12000.0, 6000.0], "Walker2d": [5000.0, 2500.0]}
# Return-to-go prompts on Atari, raw return units: kzl/decision-transformer@e2d82e6 atari/mingpt/trainer_atari.py#L161,
# and DeMa's Table 9 (DeMa raised Qbert to 12000 and Seaquest to 1750; dema.py reads DEMA_ATARI_TARGETS).
DT_ATARI_TARGETS = {"Breakout": 90.0, "Qbert": 14000.0, "Pong": 20.0, "Seaquest": 1150.0}
DEMA_ATARI_TARGETS = {"Breakout": 90.0, "Qbert": 12000.0, "Pong": 20.0, "Seaquest": 1750.0, "Asterix": 700.0,
                      "Frostbite": 1450.0, "Assault": 1200.0, "Gopher": 6500.0}
# Atari's normalised score is 100 (R - random) / (gamer - random) with these returns (DeMa's Table 19, after Ye et al.
# 2021), used where a dataset carries no reference scores; a game without them is scored raw only.
ATARI_GAMER_SCORES = {"Breakout": (1.7, 30.5), "Qbert": (163.9, 13455.0), "Pong": (-20.7, 14.6),
                      "Seaquest": (68.4, 42054.7), "Asterix": (210.0, 8503.0), "Frostbite": (65.0, 4335.0),
                      "Assault": (222.0, 742.0), "Gopher": (258.0, 2412.0)}
FRAME_STACK = 4  # an Atari state is the last 4 frames (DQN, and every paper here)

class FlagParser(argparse.ArgumentParser):
    """argparse with the project's rule for bad input: one sentence on stderr and exit 1 (argparse's: usage, exit 2)."""

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
    """A goal-reaching maze (PointMaze, AntMaze, D4RL maze2d), told from the name before any data is read."""
    return "maze" in name.lower()

def is_atari(name):
    """Atari data (an atari/* id, or a local dataset whose env is ale-py's), told before it is read; else False."""
    try:
        dataset_id = resolve(name)
        if dataset_id.startswith("atari/"):
            return True
        with open(os.path.join(dataset_folder(dataset_id), "data", "metadata.json")) as f:
            return "ale_py" in str(json.load(f).get("env_spec", ""))
    except (DataError, OSError, ValueError, AttributeError):
        return False

# Dict observations are flattened in a fixed key order. PointMaze: observation (starts with the ball's x, y) ++
# desired_goal. AntMaze's `observation` leaves out the torso's x, y (its `achieved_goal`), which D4RL's AntMaze state
# started with, so: achieved_goal ++ observation ++ desired_goal. desired_goal always comes last (goal_dim entries).
MAZE_KEYS = ("observation", "desired_goal")
ANTMAZE_KEYS = ("achieved_goal", "observation", "desired_goal")

def obs_keys_for(spec):
    """The key order of an env's dict observations, read from its entry point (ant_maze_v4/v5:AntMazeEnv), not from
    array sizes (AntMaze's observation is 27-d in v4, 105-d in v5 and changes with kwargs)."""
    return ANTMAZE_KEYS if "ant_maze" in str(getattr(spec, "entry_point", "")) else MAZE_KEYS

def flatten_obs(obs, keys=MAZE_KEYS):
    """Dict observations -> the `keys` entries concatenated (with or without a time axis); arrays pass through."""
    if isinstance(obs, dict):
        return np.concatenate([np.asarray(obs[k]) for k in keys], axis=-1)
    return np.asarray(obs)

# -------------------------------------------------------------------------------------------------------------------
# one training step: load_data -> OfflineData (returns-to-go, sample) -> gather_windows -> stack_frames

def load_data(name, download=True, delayed_reward=False):
    """Short name or Minari id -> OfflineData (episodes, state stats, eval env, reference scores, targets).
    delayed_reward: the delayed-return setting of DT's Table 5 and DeMa's Table 13 (delay_rewards)."""
    dataset_id = resolve(name)
    ds, meta, raw_episodes = _open_minari(dataset_id, download)
    spec = getattr(ds, "_eval_env_spec", None) or ds.env_spec  # what recover_environment(eval_env=True) makes
    if spec is None:
        raise DataError(f"dataset '{dataset_id}' records no environment, so it cannot be evaluated")
    entry = str(spec.entry_point)
    family = ("maze" if "maze" in entry else "mujoco" if "gymnasium.envs.mujoco" in entry else
              "atari" if entry.startswith("ale_py") else "other")
    keys = obs_keys_for(spec)
    space, n_actions, raw, frames = ds.observation_space, 0, False, None
    if family == "atari":
        n_actions, raw, frames = _atari_spaces(dataset_id, space, ds.action_space, spec)
    episodes = [_episode_arrays(ep, keys, family == "maze", dataset_id, frames) for ep in raw_episodes]
    if not episodes:
        raise DataError(f"dataset '{dataset_id}' has no episodes")
    env_key = spec.id.split("/")[-1].split("-")[0]  # 'Hopper-v5' -> 'Hopper', 'ALE/Breakout-v5' -> 'Breakout'
    if meta.get("ref_min_score") is not None and meta.get("ref_max_score") is not None:
        ref_min, ref_max, ref_source = float(meta["ref_min_score"]), float(meta["ref_max_score"]), "dataset metadata"
    elif env_key in D4RL_REF_SCORES | ADROIT_REF_SCORES:
        ref_min, ref_max = (D4RL_REF_SCORES | ADROIT_REF_SCORES)[env_key]
        ref_source = f"D4RL reference returns for {env_key}"
    elif family == "atari" and env_key in ATARI_GAMER_SCORES:
        (ref_min, ref_max), ref_source = ATARI_GAMER_SCORES[env_key], f"random and gamer returns for {env_key}"
    else:
        ref_min, ref_max, ref_source = float("nan"), float("nan"), "none (normalised scores are NaN)"
    goal_dim = int(np.prod(space["desired_goal"].shape)) if "desired_goal" in getattr(space, "spaces", {}) else 0
    returns = np.array([e["rewards"].sum() for e in episodes])
    # MuJoCo locomotion: returns / 1000 and DT's targets. Anything else: unscaled, the best episode's return as target
    # (Adroit too: LSDT's Table 13 scales AntMaze, Maze2d and Adroit by 1 and gives no Adroit target). On PointMaze,
    # whose best dense return is a slow path (an episode ends at its goal), the best still beat the median return:
    # classroom DT on the made medium-dense maze, 6 seeds x 200 episodes, goal 94.4% against 91.1%, in fewer steps.
    scale = 1e-3 if family == "mujoco" else 1.0
    target = float(returns.max())
    targets = (list(DT_TARGETS.get(env_key, [target])) if family == "mujoco" else
               [DT_ATARI_TARGETS.get(env_key, target)] if family == "atari" else [target])
    longest = max(len(e["actions"]) for e in episodes)
    # Atari: the timestep embedding covers the data's longest episode (kzl/decision-transformer@e2d82e6
    # atari/run_dt_atari.py#L80; evaluation clamps to it), while an evaluation episode may run to 27k steps.
    max_len = longest if family == "atari" else max(int(spec.max_episode_steps or 0), longest)
    horizon = 0                         # evaluation steps at most (0: max_ep_len); Atari: ALE's frame limit (108k in
    if family == "atari":               # the papers) over the frames one step takes
        horizon = int(spec.kwargs.get("max_num_frames_per_episode", 108_000)) // atari_frame_skip(spec)
    if delayed_reward:
        episodes = [e | dict(rewards=delay_rewards(e["rewards"])) for e in episodes]
    return OfflineData(dataset_id=dataset_id, family=family, episodes=episodes, env_spec=spec, ref_min=ref_min,
                       ref_max=ref_max, ref_source=ref_source, return_scale=scale, target_returns=targets,
                       max_ep_len=max_len, goal_dim=goal_dim, obs_keys=keys, horizon=horizon, n_actions=n_actions,
                       raw_frames=raw, delayed_reward=delayed_reward)

@dataclass
class OfflineData:
    dataset_id: str
    family: str                 # 'mujoco' | 'maze' | 'atari' | 'other'
    episodes: list              # dicts: observations (T, obs_dim), actions (T, act_dim), rewards (T,), terminated;
                                # Atari: observations (T, 84, 84) uint8 frames, actions (T,) int64
    env_spec: object            # gymnasium EnvSpec of the evaluation env (None for synthetic_data)
    ref_min: float = float("nan")
    ref_max: float = float("nan")
    ref_source: str = "none"
    return_scale: float = 1.0
    target_returns: list = field(default_factory=list)
    max_ep_len: int = 1000      # timesteps the model embeds (0 .. max_ep_len - 1; evaluation clamps to the last)
    horizon: int = 0            # evaluation steps at most (0: max_ep_len); Atari: 108k frames / frame skip 4
    n_actions: int = 0          # discrete actions (Atari's Discrete space), 0 for continuous actions
    raw_frames: bool = False    # Atari frames stored as 210x160 RGB (Minari's atari/*): atari_frame_wrappers applied
    delayed_reward: bool = False  # rewards moved to each episode's last step (delay_rewards), in evaluation too
    goal_dim: int = 0           # the last goal_dim state entries are desired_goal (dict observations), else 0
    obs_keys: tuple = MAZE_KEYS  # how flatten_obs orders dict observations (obs_keys_for(env_spec))
    state_mean: np.ndarray = field(default=None, repr=False)  # computed from the episodes unless given (keep_top)
    state_std: np.ndarray = field(default=None, repr=False)

    def __post_init__(self):
        eps = self.episodes
        self.discrete = self.n_actions > 0
        self.goal_reaching = self.family == "maze"
        lengths = np.array([len(e["actions"]) for e in eps])
        self.ep_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])            # (n_episodes,)
        self.step_ep_start = np.repeat(self.ep_start, lengths)                     # (N,) first row of its episode
        rewards = np.concatenate([e["rewards"] for e in eps]).astype(np.float32)   # (N,)
        if self.family == "atari":
            # one frame per step, uint8; the episodes' own arrays become views of it (one copy of 500k frames)
            frames = np.concatenate([e["observations"] for e in eps])               # (N, 84, 84) uint8
            for e, a, n in zip(eps, self.ep_start, lengths):
                e["observations"] = frames[a:a + n]
            self.obs_shape = (FRAME_STACK, *frames.shape[1:])                      # (4, 84, 84)
            actions = np.concatenate([e["actions"] for e in eps]).astype(np.int64)  # (N,)
            if actions.min() < 0 or actions.max() >= self.n_actions:
                raise DataError(f"dataset '{self.dataset_id}' has action indices outside its Discrete("
                                f"{self.n_actions}) space, so it cannot be used")
            _check_finite(f"dataset '{self.dataset_id}'", dict(rewards=rewards), self.ep_start)
            self.state_mean, self.state_std = np.zeros(1, np.float32), np.ones(1, np.float32)  # (/ 255 in the model)
            states = dict(frames=frames)
        else:
            obs = np.concatenate([e["observations"] for e in eps]).astype(np.float64)  # (N, obs_dim)
            self.obs_shape = obs.shape[1:]
            actions = np.concatenate([e["actions"] for e in eps]).astype(np.float32)   # (N, act_dim)
            _check_finite(f"dataset '{self.dataset_id}'", dict(observations=obs, actions=actions, rewards=rewards),
                          self.ep_start)
            if self.state_mean is None:
                self.state_mean = obs.mean(0).astype(np.float32)
                self.state_std = (obs.std(0) + 1e-6).astype(np.float32)
            states = dict(states=self.normalize_states(obs))                          # (N, obs_dim)
        self.obs_dim = int(np.prod(self.obs_shape))
        self.act_dim = self.n_actions if self.discrete else actions.shape[1]
        self.horizon = self.horizon or self.max_ep_len
        # Flat arrays, one row per dataset step; a batch is a handful of fancy-indexing slices of these.
        self.flat = dict(
            **states,                                                               # (N, obs_dim) or frames (N, 84, 84)
            actions=actions,                                                        # (N, act_dim) or (N,) int64
            rewards=rewards,                                                        # (N,)
            rtg=np.concatenate([returns_to_go(e["rewards"]) for e in eps]).astype(np.float32) * self.return_scale,
            timesteps=np.concatenate([np.arange(n) for n in lengths]),              # (N,)
        )
        self.episode_returns = np.array([e["rewards"].sum() for e in eps])

    def info(self):
        """What a model is built from; saved with its checkpoint, so that an analysis rebuilds it without the data.
        act_dim is the number of actions where they are discrete (discrete=True); obs_shape (4, 84, 84) for Atari."""
        return dict(obs_dim=self.obs_dim, act_dim=self.act_dim, max_ep_len=self.max_ep_len, goal_dim=self.goal_dim,
                    discrete=self.discrete, obs_shape=list(self.obs_shape))

    def normalize_states(self, obs):
        return ((np.asarray(obs, dtype=np.float64) - self.state_mean) / self.state_std).astype(np.float32)

    def observe(self, obs):
        """An env's observation -> what a history row holds: the normalised flat state, or Atari's 84x84 uint8 frame
        (the eval env applies the frame transform itself)."""
        if self.family == "atari":
            return np.asarray(obs, dtype=np.uint8)
        return self.normalize_states(flatten_obs(obs, self.obs_keys))

    def normalize_score(self, returns):
        """D4RL-style normalised score: 100 * (R - ref_min) / (ref_max - ref_min)."""
        return 100.0 * (np.asarray(returns, dtype=np.float64) - self.ref_min) / (self.ref_max - self.ref_min)

    def make_env(self, render=False):
        """The dataset's own evaluation env (Minari's eval_env_spec, else env_spec); render=True: one that renders
        240 x 240 RGB frames offscreen (MuJoCo: evaluate.pick_gl), or on Atari the game's 210 x 160 colour screen."""
        import gymnasium as gym
        if self.env_spec is None:
            raise DataError(f"'{self.dataset_id}' is synthetic data and has no environment to evaluate in")
        if self.family == "atari":
            env = make_atari_env(self.env_spec, render_mode="rgb_array" if render else None)
            return atari_frame_wrappers(env) if self.raw_frames else env
        if self.family == "maze" or str(self.env_spec.entry_point).startswith("gymnasium_robotics"):  # and Adroit
            _robotics()
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
        """B windows of K steps: the last step is uniform over all dataset steps (episodes drawn in proportion to
        their length), the window reaching back K-1 steps, left-padded at an episode's start. End-anchored, where
        kzl/decision-transformer@e2d82e6 gym/experiment.py#L129 draws the start: every step is the newest token
        equally often, and the padded windows are what evaluation feeds the model in an episode's first K-1 steps.
        Its Atari code (atari/run_dt_atari.py#L52-L66) draws the first step uniformly over the data, shifts a window
        that would cross an episode's end back inside it and never pads: the per-step loss weights are mirror images
        (it under-weights an episode's first K-1 steps, this sampler its last K-1)."""
        end = rng.integers(0, len(self.step_ep_start), size=batch_size)  # (B,)
        return gather_windows(self.flat, self.step_ep_start[end], end, K)

    def keep_top(self, fraction):
        """%BC (DT Sec. 5.3; kzl/decision-transformer@e2d82e6 gym/experiment.py#L103): a new OfflineData of the
        highest-return episodes, best first, while their steps stay within `fraction` of all steps (at least one);
        state_mean/std stay the full dataset's, as in the DT code, and so do targets, reference scores, max_ep_len."""
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

def delay_rewards(rewards):
    """The delayed-return setting (DT Sec. 5.4, Table 5; DeMa Table 13): r'_t = 0 for t < T-1, r'_{T-1} = sum_t r_t,
    so every return-to-go R_t is the episode's return. Evaluation delays the env's rewards alike (evaluate.evaluate)."""
    out = np.zeros_like(rewards)
    out[-1] = np.sum(rewards, dtype=np.float64)
    return out

def gather_windows(flat, start, end, K, ring=0):
    """Windows of K rows ending at row `end` (inclusive) that never reach before row `start` (their episode's first
    row): positions before it are padding. flat: dict of arrays with rows as the first axis (Atari: `frames` in place
    of `states`, stacked by stack_frames). start, end: (B,) ints. Used for training batches (rows = dataset steps) and
    by evaluate.py (rows = each env's history). ring > 0: each episode's rows are stored in a ring of `ring` rows
    from `start` on (row r at start + (r - start) % ring), which is how evaluate.py keeps only the recent past."""
    def at(rows):                                              # row numbers -> where they are stored
        s = start.reshape(-1, *[1] * (rows.ndim - 1))
        return s + (rows - s) % ring if ring else rows
    idx = end[:, None] - (K - 1) + np.arange(K)[None, :]       # (B, K) row of each position
    real = idx >= start[:, None]                               # (B, K) False on the left padding
    rows = np.where(real, idx, start[:, None])                 # (B, K) padding points at the start row (zeroed below)
    idx = at(rows)
    f = real.astype(np.float32)
    first = np.maximum(end - (K - 1), start)                   # (B,) first real row t0
    has_prev = first > start                                   # a_{t0-1} exists inside the episode
    prev = at(np.where(has_prev, first - 1, start))
    a = flat["actions"]
    states = (stack_frames(flat["frames"], start, rows, at) * real[..., None, None, None]  # (B, K, 4, 84, 84) uint8
              if "frames" in flat else flat["states"][idx] * f[..., None])                 # (B, K, obs_dim)
    batch = dict(
        states=states,
        actions=a[idx] * (real if a.ndim == 1 else f[..., None]),               # (B, K, act_dim), or (B, K) int64
        rewards=(flat["rewards"][idx] * f)[..., None],                          # (B, K, 1)
        rtg=(flat["rtg"][idx] * f)[..., None],                                  # (B, K, 1)
        timesteps=flat["timesteps"][idx] * real,                                # (B, K)
        mask=f,                                                                 # (B, K)
        prev_action=a[prev] * (has_prev if a.ndim == 1 else has_prev[:, None]),  # (B, act_dim) or (B,), null = 0
        prev_reward=(flat["rewards"][prev] * has_prev)[:, None],               # (B, 1), null = 0
    )
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in batch.items()}   # dtypes as above

def stack_frames(frames, start, rows, at=lambda r: r):
    """Atari's state at each of `rows`: its frame and the FRAME_STACK - 1 before it, oldest first, with the frames
    before the episode's first row (`start`, one per window) set to 0, as DT's Atari env fills its frame buffer at
    reset (kzl/decision-transformer@e2d82e6 atari/mingpt/trainer_atari.py#L247); training and evaluation stack by
    this one rule. frames (N, 84, 84) uint8; rows (B, K) -> (B, K, 4, 84, 84)."""
    r = rows[..., None] - (FRAME_STACK - 1) + np.arange(FRAME_STACK)          # (B, K, 4) rows of the stacked frames
    inside = r >= start.reshape(-1, 1, 1)                                       # (B, K, 4) False before the episode
    return frames[at(np.where(inside, r, start.reshape(-1, 1, 1)))] * inside[..., None, None]  # (B, K, 4, 84, 84)

# -------------------------------------------------------------------------------------------------------------------
# reading a Minari dataset (what load_data calls)

def _open_minari(dataset_id, download):
    """-> (MinariDataset, its metadata, its episodes), downloaded if allowed; one sentence if missing or damaged."""
    import minari
    where = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
    if not os.path.exists(os.path.join(dataset_folder(dataset_id), "data")):  # minari's own test for "it is here"
        if not download:
            raise DataError(f"dataset '{dataset_id}' is not in {where}; download it with `minari download "
                            f"{dataset_id}` or set MINARI_DATASETS_PATH to a folder that holds it")
        print(f"downloading {dataset_id} (once) into {where} ...", flush=True)
        try:
            if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", ""):
                socket.getaddrinfo("huggingface.co", 443)  # no network: fail now, not after a minute of retries
            minari.load_dataset(dataset_id, download=True)
        except Exception as e:  # network errors come from several libraries (httpx, huggingface_hub, socket)
            raise DataError(f"dataset '{dataset_id}' is not in {where} and could not be downloaded "
                            f"({'no network' if isinstance(e, OSError) else type(e).__name__}); with a network run "
                            f"`minari download {dataset_id}`, or copy it there and set MINARI_DATASETS_PATH") from None
    try:
        ds = minari.load_dataset(dataset_id)
        return ds, ds.storage.metadata, list(ds.iterate_episodes())
    except Exception as e:  # the folder is there but unreadable: h5py's OSError, json's ValueError, a missing key, ...
        detail = str(e).splitlines()[0].split(". ")[0] if str(e) else ""  # its first sentence
        detail = detail if len(detail) <= 160 else detail[:157] + "..."
        raise damaged(dataset_id, type(e).__name__ + (": " + detail if detail else "")) from None

def damaged(dataset_id, detail):
    """The one sentence for a dataset that is there but unreadable, saying how to get it again: the data.py command
    that made it (its metadata's data_py_command, or algorithm_name in older datasets), else `minari download`."""
    folder = dataset_folder(dataset_id)
    again = (f"get it again (`minari download {dataset_id}` if it came from Minari's servers, else the data.py "
             f"command that made it)")
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no metadata, not JSON, not a JSON object
        with open(os.path.join(folder, "data", "metadata.json")) as f:
            meta = json.load(f)
        algorithm, command = str(meta.get("algorithm_name")), meta.get("data_py_command")
        again = (f"make it again with `{command}`" if command else f"make it again with the data.py command that "
                 f"made it ({algorithm}: {meta.get('description')})" if "data.py" in algorithm else
                 f"download it again with `minari download {dataset_id}`")
    return DataError(f"the dataset '{dataset_id}' at {folder} is damaged ({detail}); delete that folder and {again}")

def dataset_folder(dataset_id):
    """Where Minari keeps a dataset: <MINARI_DATASETS_PATH, else ~/.minari/datasets>/<namespace>/<name>-vN."""
    from minari.storage.datasets_root_dir import get_dataset_path
    root = os.environ.get("MINARI_DATASETS_PATH", "")
    if os.path.exists(root) and not os.path.isdir(root):
        raise DataError(f"MINARI_DATASETS_PATH={root} is a file, not a folder of datasets; point it at a folder")
    return str(get_dataset_path(dataset_id))

def _episode_arrays(ep, keys, fix_first_goal, dataset_id, frames=None):
    """One Minari episode -> dict of arrays (drops the final observation s_T). frames: Atari's frame transform (the
    identity for 84x84 frames, atari_frame_wrappers' for raw RGB), applied to each kept frame; frames stay uint8."""
    T = len(ep.actions)
    if T == 0:
        raise damaged(dataset_id, f"episode {ep.id} has no steps")
    obs = ep.observations
    rows = len(next(iter(obs.values()))) if isinstance(obs, dict) else len(obs)
    if rows != T + 1 or len(ep.rewards) != T:
        raise damaged(dataset_id, f"episode {ep.id} has {rows} observations and {len(ep.rewards)} rewards for {T} "
                                  f"actions, where Minari stores T + 1 and T")
    if frames is not None:
        return dict(observations=frames(np.asarray(obs[:T], dtype=np.uint8)), actions=np.asarray(ep.actions).reshape(T),
                    rewards=np.asarray(ep.rewards, dtype=np.float32), terminated=bool(np.asarray(ep.terminations)[-1]))
    if isinstance(obs, dict):
        obs = {k: np.asarray(v) for k, v in obs.items()}
        if fix_first_goal and len(obs["desired_goal"]) > 2:
            # Minari's maze collection continues across goals: an episode's first observation still shows the
            # previous episode's goal. Evaluation never shows a stale goal, so use step 1's.
            obs["desired_goal"][0] = obs["desired_goal"][1]
        obs = flatten_obs(obs, keys)
    obs = np.asarray(obs, dtype=np.float32).reshape(len(obs), -1)
    actions = np.asarray(ep.actions, dtype=np.float32).reshape(T, -1)
    return dict(observations=obs[:T], actions=actions, rewards=np.asarray(ep.rewards, dtype=np.float32),
                terminated=bool(np.asarray(ep.terminations)[-1]))

def _check_finite(source, arrays, ep_start):
    """Refuse NaN/inf: arrays maps a name to an array with one row per step; ep_start (n_episodes,) first rows."""
    for name, a in arrays.items():
        bad = ~np.isfinite(np.asarray(a, dtype=np.float64).reshape(len(a), -1)).all(axis=1)  # (N,) rows with NaN/inf
        if bad.any():
            episode = int(np.searchsorted(ep_start, np.argmax(bad), side="right")) - 1
            raise DataError(f"{source} has NaN or infinite {name}, first in episode {episode}, so it cannot be used")

# -------------------------------------------------------------------------------------------------------------------
# Atari: the environment and the frames (load_data, OfflineData.make_env, evaluate.py)

def _atari_spaces(dataset_id, obs_space, action_space, spec):
    """-> (number of actions, raw RGB frames?, the frame transform) of an Atari dataset; one sentence for others."""
    if not hasattr(action_space, "n"):
        raise DataError(f"dataset '{dataset_id}' is Atari data with a {type(action_space).__name__} action space; the "
                        f"models read Discrete actions")
    shape = tuple(getattr(obs_space, "shape", ()) or ())
    if shape == (84, 84):
        return int(action_space.n), False, lambda f: f
    if len(shape) == 3 and shape[2] == 3:  # RGB screens, made 84x84 by the eval env's own two wrappers
        resize = atari_frame_wrappers(make_atari_env(spec))
        resize.close()

        def frames(rgb):  # (T, 210, 160, 3) -> (T, 84, 84) uint8
            return np.stack([resize.observation(resize.env.observation(f)) for f in rgb]).astype(np.uint8)
        return int(action_space.n), True, frames
    raise DataError(f"dataset '{dataset_id}' has Atari observations of shape {shape}; the models read 84x84 grayscale "
                    f"frames (DQN-replay's) or RGB screens (Minari's atari/*, made 84x84 at load)")

def atari_frame_wrappers(env):
    """Raw 210x160 RGB screens (Minari's atari/*) -> the papers' 84x84 grayscale, by gymnasium's own wrappers (OpenCV's
    INTER_AREA): on the eval env, and on each dataset frame at load (_atari_spaces), so both see the same pixels."""
    from gymnasium.wrappers import GrayscaleObservation, ResizeObservation
    return ResizeObservation(GrayscaleObservation(env), (84, 84))

def make_atari_env(spec, render_mode=None):
    """An Atari dataset's eval env: gymnasium.make on its spec (with AtariPreprocessing where the spec names it)."""
    return _ale().make(spec, render_mode=render_mode)

def atari_env_spec(game):
    """The papers' Atari evaluation env as an EnvSpec: ALE/<Game>-v5 without sticky actions, with ALE's own frame skip
    off and the 108k-frame limit, in gymnasium's AtariPreprocessing (up to 30 no-ops at reset, 4 frames a step
    max-pooled, 84x84 grayscale uint8, an episode ends at game over, not at a lost life): DQN's preprocessing, which
    the DQN-replay frames went through. `game`: ALE's name in any case (Breakout, breakout)."""
    import difflib
    from gymnasium.envs.registration import WrapperSpec
    gym = _ale()
    games = {k[4:-3].lower(): k for k in gym.registry if k.startswith("ALE/") and k.endswith("-v5")}  # 'breakout'
    key = re.sub(r"[^a-z0-9]", "", game.lower())
    if key not in games:
        near = difflib.get_close_matches(key, games, n=1)
        raise DataError(f"ALE knows no game '{game}'" + (f" (did you mean {games[near[0]][4:-3]}?)" if near else "")
                        + f"; its {len(games)} games include {', '.join(sorted(ATARI_GAMER_SCORES))}")
    base = gym.spec(games[key])
    preprocessing = WrapperSpec("AtariPreprocessing", "gymnasium.wrappers.atari_preprocessing:AtariPreprocessing",
                                dict(noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False,
                                     grayscale_obs=True, grayscale_newaxis=False, scale_obs=False))
    kwargs = dict(base.kwargs, repeat_action_probability=0.0, full_action_space=False, frameskip=1,
                  max_num_frames_per_episode=108_000)
    return replace(base, kwargs=kwargs, additional_wrappers=(preprocessing,))

def atari_frame_skip(spec):
    """Emulator frames (1/60 s each) per env step: AtariPreprocessing's frame_skip times ALE's own frameskip."""
    skips = [w.kwargs.get("frame_skip", 4) for w in spec.additional_wrappers or () if w.name == "AtariPreprocessing"]
    skip = skips[0] * spec.kwargs.get("frameskip", 1) if skips else spec.kwargs.get("frameskip", 4)
    return skip if isinstance(skip, int) else max(skip)                     # (a (low, high) frameskip: the longest)

def _robotics():
    """-> gymnasium with gymnasium-robotics' envs (mazes, Adroit) registered, its import's notice silenced."""
    import gymnasium as gym
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import gymnasium_robotics   # (its import prints a notice about its Adroit envs)
    gym.register_envs(gymnasium_robotics)
    return gym

def _ale():
    """-> gymnasium with ale-py's ALE/* envs registered, its banner off; one sentence if ale-py or OpenCV is missing."""
    import gymnasium as gym
    try:
        import ale_py
        import cv2  # noqa: F401  (AtariPreprocessing resizes with OpenCV)
    except ImportError as e:
        raise DataError(f"Atari needs ale-py and OpenCV ({e.name} is missing): pip install ale-py "
                        f"opencv-python-headless") from None
    ale_py.ALEInterface.setLoggerMode(ale_py.LoggerMode.Error)   # (C++ prints it, past Python's stderr)
    gym.register_envs(ale_py)
    return gym

# -------------------------------------------------------------------------------------------------------------------
# synthetic data (the model files' --bench)

def available_memory():
    """Bytes of memory the OS can give now (Linux's MemAvailable; elsewhere the physical memory), or None."""
    with contextlib.suppress(OSError, ValueError, StopIteration), open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None

def synthetic_data(obs_dim=11, act_dim=3, episodes=8, length=50, seed=0, goal_dim=0):
    """Random MuJoCo-like episodes with no environment (env_spec None) for --bench: returns scaled by 1e-3, the best
    episode's return as target; the last goal_dim state entries stay fixed in an episode, like a maze goal."""
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

def synthetic_atari(n_actions=4, episodes=16, length=200, seed=0):
    """Random 84 x 84 frames, actions and rewards in Atari's layout (family 'atari'), for --bench on Atari's shapes;
    Breakout's eval env is recorded (train() checks that ale-py can make it) but never run."""
    rng = np.random.default_rng(seed)
    eps = [dict(observations=rng.integers(0, 256, (length, 84, 84), dtype=np.uint8),
                actions=rng.integers(0, n_actions, length), rewards=rng.integers(0, 2, length).astype(np.float32),
                terminated=False) for _ in range(episodes)]
    return OfflineData(dataset_id="synthetic-atari", family="atari", episodes=eps, env_spec=atari_env_spec("breakout"),
                       n_actions=n_actions, max_ep_len=length, target_returns=[90.0])

# ===================================================================================================================
# Dataset tools: below this line nothing is used by the model files or evaluate.py. The converters (D4RL HDF5,
# DQN-replay), mix, make (datasets made offline), the atomic dataset writes and the command line (python data.py ...).
# ===================================================================================================================

# -------------------------------------------------------------------------------------------------------------------
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
    from minari.data_collector import EpisodeBuffer
    _new_dataset_folder(dataset_id)  # (a taken id or an unwritable folder: said before the file is read)
    env_arg, env_id = env_id, _d4rl_env(path, dataset_id, env_id)
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
    if "next_observations" not in a:
        # After a terminal or timeout D4RL's next row is a new episode's reset state, not the successor, so the final
        # observation s_T is unknown: repeat s_{T-1}. data.py drops s_T (no action follows it); training never sees it.
        print("no next_observations: each episode's final observation repeats its last one (never used for training)")
    nxt = a.get("next_observations", a["observations"])                          # (N, obs_dim): s_T at row e - 1
    buffers = []
    for i, (s, e) in enumerate(zip(starts, stops)):
        term = a["terminals"][s:e]                                               # (T,)
        trunc = a["timeouts"][s:e] & ~term                                       # (T,)
        trunc[-1] |= not term[-1]                                                # the trailing episode: truncated
        buffers.append(EpisodeBuffer(id=i, observations=np.concatenate([a["observations"][s:e], nxt[e - 1:e]]),
                                     actions=a["actions"][s:e].astype(np.float32), rewards=a["rewards"][s:e].tolist(),
                                     terminations=term.tolist(), truncations=trunc.tolist(), infos={}))
    ref = D4RL_REF_SCORES.get(env_id.split("-")[0], (None, None))
    command = ["convert-d4rl", os.path.abspath(path), dataset_id, *(["--env", env_arg] if env_arg else [])]
    folder = _write_dataset(dataset_id, buffers, command, env=env_id, ref_min_score=ref[0], ref_max_score=ref[1],
                            algorithm_name="D4RL (converted by data.py convert-d4rl)",
                            description=f"converted from {path}")
    n_term = sum(bool(b.terminations[-1]) for b in buffers)
    refs = f"reference returns {ref[0]} / {ref[1]}" if ref[0] is not None else "no reference returns"
    print(f"{dataset_id}: {len(buffers)} episodes ({n_term} end by terminal, {len(buffers) - n_term} truncated), "
          f"{n:,} steps, env {env_id}, {refs}, written to {folder}")
    return len(buffers)

# -------------------------------------------------------------------------------------------------------------------
# DQN-replay (Dopamine's replay-buffer checkpoints) -> local Minari dataset (python data.py convert-dqn-replay)
#
# A DQN-replay run folder (gs://atari-replay-datasets/dqn/<Game>/<run>/replay_logs) holds checkpoints N = 0..49 of
# 1M transitions each, one gzipped np.save array per field and one row per transition t:
#   $store$_observation_ckpt.N.gz (n, 84, 84) uint8: the newest frame of s_t (stacking 4 is the reader's job)
#   $store$_action_ckpt.N.gz      (n,) int32: a_t, an index into ALE's minimal action set
#   $store$_reward_ckpt.N.gz      (n,) float32: r_t as Dopamine stored it (clipped to [-1, 1])
#   $store$_terminal_ckpt.N.gz    (n,) uint8: 1 on an episode's last step (game over; no life-loss ends)
#   add_count_ckpt.N.gz           (): transitions added so far (optional here; it places the buffer's oldest row)
# Dopamine's buffer is circular: one buffer is a window of one long stream, starting and ending anywhere (mid-episode
# too), whose oldest row is add_count % n (n - 1 in DQN-replay, saved when the cursor reached it). Before an
# episode's first transition it adds 3 blank ones (zero frame, action 0, reward 0; frame stack 4, minus 1): no steps
# of the game, dropped here. The data was played with sticky actions (p = 0.25); the papers evaluate without them.

DQN_REPLAY_FIELDS = ("observation", "action", "reward", "terminal")
DQN_REPLAY_MAX_ROWS = 10_000_000  # rows a checkpoint may declare (Dopamine's hold 1M): a larger header is refused
DQN_BLANK_ROWS = 3                # Dopamine's blank transitions before an episode (frame stack 4, minus 1)

@contextlib.contextmanager
def _npy_open(path, row_shape=(), kinds="biuf", scalar=False):
    """The gzipped np.save array at `path` -> (the gzip file at its first data byte, dtype, number of rows). Its header
    (read by np.lib.format) must declare rows of `row_shape` (uint8 frames) with a dtype of one of `kinds` (numpy's
    kind letters), or one number (scalar); else one sentence, before anything is allocated or unpickled."""
    import gzip
    import zlib
    try:
        f = gzip.open(path, "rb")
    except OSError as e:
        raise DataError(f"{path} cannot be opened ({e.strerror or e})") from None
    with f:
        try:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise ValueError(f"np.save format {version}")
            header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran_order, dtype = header(f)
        except (OSError, EOFError, zlib.error, ValueError) as e:  # (gzip's BadGzipFile is an OSError)
            what = ("not a gzip file, or a damaged one" if isinstance(e, OSError) else "truncated" if
                    isinstance(e, EOFError) else "damaged" if isinstance(e, zlib.error) else
                    "not an array np.save wrote, or damaged")
            raise DataError(f"{path} cannot be read ({what}); DQN-replay's {os.path.basename(path).split('_ckpt')[0]} "
                            f"files are gzipped np.save arrays") from None
        want = f"(n, {', '.join(map(str, row_shape))})" if row_shape else "()" if scalar else "(n,)"
        shape_ok = shape in ((), (1,)) if scalar else len(shape) == 1 + len(row_shape) and shape[1:] == row_shape
        if (not shape_ok or dtype.hasobject or dtype.kind not in kinds or (row_shape and dtype != np.uint8)
                or (fortran_order and len(shape) > 1)):
            raise DataError(f"{path} holds an array of {dtype} with shape {shape} where DQN-replay has {want} "
                            f"{'uint8 frames' if row_shape else 'numbers'}")
        if shape and shape[0] > DQN_REPLAY_MAX_ROWS:
            raise DataError(f"{path} declares {shape[0]:,} rows, more than the {DQN_REPLAY_MAX_ROWS:,} this reader "
                            f"accepts (DQN-replay buffers hold 1M)")
        yield f, dtype, int(shape[0]) if shape else 1

def _npy_fill(f, out, path, last=True):
    """Fill the array `out` with the next bytes of the open array file f -> out. last: nothing may follow (and
    reaching the end makes gzip check its CRC). One sentence if the file ends early or is damaged."""
    import zlib
    try:
        got = f.readinto(memoryview(out).cast("B"))
    except (OSError, EOFError, zlib.error):
        got = -1
    if got != out.nbytes:
        raise DataError(f"{path} is truncated or damaged (it ends within its array); download it again")
    try:
        extra = f.read(1) if last else b""
    except (OSError, EOFError, zlib.error):
        extra = b"?"
    if extra:
        raise DataError(f"{path} is damaged (bytes after its array, or a failed gzip check); download it again")
    return out

def _npy_read(path, kinds, scalar=False):
    """A whole gzipped (n,) array (action, reward, terminal: 1M rows are a few MB), or one number (scalar)."""
    with _npy_open(path, (), kinds, scalar) as (f, dtype, n):
        if n * dtype.itemsize > 1032 * os.path.getsize(path):  # deflate expands a byte into 1032 at most
            raise DataError(f"{path} is truncated or damaged (its header declares {n:,} rows, more than its "
                            f"{os.path.getsize(path):,} bytes can hold); download it again")
        return _npy_fill(f, np.empty(n, dtype), path)

def _dqn_replay_episodes(folder, number, n_actions, budget, counts):
    """Buffer `number`'s whole episodes, in order, until `budget` steps (the episode that reaches it is kept whole)
    -> list of (frames (T+1, 84, 84) uint8, actions (T,) int64, rewards (T,) float32); counts: what is dropped."""
    paths = {k: os.path.join(folder, f"$store$_{k}_ckpt.{number}.gz") for k in DQN_REPLAY_FIELDS}
    for p in paths.values():
        if not os.path.isfile(p):
            raise DataError(f"buffer {number} in {folder} has no {os.path.basename(p)} (a buffer needs its "
                            f"observation, action, reward and terminal files); download it again")
    with _npy_open(paths["observation"], (84, 84), "u") as (_, _, n):
        pass                                                              # (its header only: n rows)
    act, rew, term = (_npy_read(paths[k], kinds) for k, kinds in (("action", "iu"), ("reward", "fiu"),
                                                                   ("terminal", "biu")))
    lengths = {"observation": n, "action": len(act), "reward": len(rew), "terminal": len(term)}
    if len(set(lengths.values())) != 1:
        raise DataError(f"buffer {number} in {folder} has arrays of different lengths ("
                        f"{', '.join(f'{k} {v:,}' for k, v in lengths.items())}), so its rows do not line up")
    if not np.isin(term, (0, 1)).all() or not np.isfinite(rew).all():
        raise DataError(f"buffer {number} in {folder} has terminal flags other than 0 and 1 or rewards that are NaN "
                        f"or infinite, so it cannot be used")
    if n == 0:
        raise DataError(f"buffer {number} in {folder} holds no rows (DQN-replay's hold 1M); download it again")
    count = os.path.join(folder, f"add_count_ckpt.{number}.gz")          # places the oldest row: add_count % n
    cursor = int(_npy_read(count, "iu", scalar=True)[0]) % n if os.path.isfile(count) else 0
    order = (np.arange(n) + cursor) % n                                   # (n,) stream position -> file row
    act, rew, term = act[order], rew[order], term[order].astype(bool)
    ends = np.flatnonzero(term)                                           # stream positions of episodes' last steps
    counts["cut"] += 1
    counts["head"] += ends[0] + 1 if len(ends) else n  # rows up to the first terminal: an episode begun before it
    if len(ends) == 0:
        return []
    episodes, taken = [], 0                       # (first row, end row, blank rows maybe) in stream positions
    for s, e in zip(ends[:-1] + 1, ends[1:] + 1):
        maybe = 0                                 # Dopamine's blank rows, as far as actions and rewards tell
        while maybe < min(DQN_BLANK_ROWS, e - s - 1) and act[s + maybe] == 0 and rew[s + maybe] == 0:
            maybe += 1
        if taken >= budget:
            break
        episodes.append((s, e, maybe))
        taken += e - s - maybe
    else:
        counts["cut"] += int(ends[-1] + 1 < n)
        counts["tail"] += n - ends[-1] - 1        # rows after the last terminal: an episode that goes on after it
    if not episodes:
        return []
    bad = [a for s, e, _ in episodes for a in (act[s:e].min(), act[s:e].max()) if not 0 <= a < n_actions]
    if bad:
        raise DataError(f"buffer {number} in {folder} has action {bad[0]} where the game has {n_actions} actions "
                        f"(ALE's minimal set); is the folder this game's?")
    # frames: one array for the buffer, each episode's T + 1 rows a slice of it (the last: the final frame repeated)
    sizes = np.array([e - s + 1 for s, e, _ in episodes])
    base = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    frames = np.empty((sizes.sum(), 84, 84), np.uint8)
    dest = np.full(n, -1, np.int64)                                       # file row -> row of `frames`, -1: not kept
    for (s, e, _), b in zip(episodes, base):
        dest[order[s:e]] = b + np.arange(e - s)
    last = int(np.flatnonzero(dest >= 0)[-1]) + 1                        # read no further than the last row kept,
    chunk = np.empty((min(4096, last), 84, 84), np.uint8)                 # 4096 rows (29 MB) at a time
    with _npy_open(paths["observation"], (84, 84), "u") as (f, _, _):
        for r0 in range(0, last, 4096):
            r1 = min(r0 + 4096, last)
            rows = _npy_fill(f, chunk[:r1 - r0], paths["observation"], last=r1 == n)
            keep = dest[r0:r1] >= 0
            frames[dest[r0:r1][keep]] = rows[keep]
    out = []
    for (s, e, maybe), b in zip(episodes, base):
        frames[b + e - s] = frames[b + e - s - 1]
        blank = 0
        while blank < maybe and not frames[b + blank].any():
            blank += 1                            # a blank row has a zero frame too; a real NOOP step does not
        counts["blank"] += blank
        out.append((frames[b + blank:b + e - s + 1], act[s + blank:e].astype(np.int64),
                    rew[s + blank:e].astype(np.float32)))
    return out

def convert_dqn_replay(folder, game, dataset_id, buffers=None, steps=500_000):
    """A DQN-replay run folder -> the local Minari dataset `dataset_id`: whole episodes of its last `buffers`
    checkpoints (default all), each buffer in turn giving an equal share of the `steps` still wanted, so that they come
    from all of them, not from the earliest, near-random play (kzl/decision-transformer@e2d82e6
    atari/create_dataset.py#L33 draws 10 episodes at a time from random buffers). Pieces of episodes cut by a buffer's
    edge (their timesteps or returns-to-go would be wrong) and blank rows are dropped. -> the number of episodes."""
    from collections import Counter
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer
    _new_dataset_folder(dataset_id)  # (a taken id or an unwritable folder: said before the buffers are read)
    spec = atari_env_spec(game)
    env = gym.make(spec)
    n_actions, obs_space = int(env.action_space.n), env.observation_space
    env.close()
    frame_space = gym.spaces.Box(0, 255, (84, 84), np.uint8)
    if obs_space != frame_space:
        raise DataError(f"{spec.id} in AtariPreprocessing gives observations {obs_space} here, not 84x84 uint8 "
                        f"frames; check the gymnasium and ale-py versions")
    if not os.path.isdir(folder):
        raise DataError(f"{folder} is not a folder; pass a DQN-replay <Game>/<run>/replay_logs folder")
    found = (re.fullmatch(r"\$store\$_(\w+)_ckpt\.(\d+)\.gz", f) for f in os.listdir(folder))
    numbers = sorted({int(m[2]) for m in found if m and m[1] in DQN_REPLAY_FIELDS})    # the buffers' N, ascending
    if not numbers:
        raise DataError(f"{folder} holds no DQN-replay buffers ($store$_observation_ckpt.N.gz and the action, reward "
                        f"and terminal files); pass a <Game>/<run>/replay_logs folder, e.g. Breakout/1/replay_logs")
    if buffers is not None and buffers > len(numbers):
        print(f"{folder} has {len(numbers)} buffers, fewer than --buffers {buffers}: all of them are used")
    counts, episodes, read, total = Counter(), [], [], 0
    chosen = numbers[-buffers:] if buffers else numbers
    rows = 0
    for path in (os.path.join(folder, f"$store$_observation_ckpt.{k}.gz") for k in chosen):
        if os.path.isfile(path):                                   # (headers only; a missing file is said below)
            with _npy_open(path, (84, 84), "u") as (_, _, n):
                rows += n
    held, free = min(rows, steps), available_memory()             # frames held at most: --steps, or every row
    if free is not None and 84 * 84 * held > free:
        raise DataError(f"the frames of {held:,} steps need about {84 * 84 * held / 2**30:.3g} GB, more than the "
                        f"{free / 2**30:.3g} GB of memory available; lower --steps" + " or --buffers" * (rows <= steps))
    for k, number in enumerate(chosen):
        if total >= steps:
            break
        share = -(-(steps - total) // (len(chosen) - k))            # an equal share of the steps still wanted
        episodes += _dqn_replay_episodes(folder, number, n_actions, share, counts)
        read.append(number)
        total = sum(len(a) for _, a, _ in episodes)
    which = f"buffer {read[0]}" if len(read) == 1 else f"buffers {read[0]}-{read[-1]}"
    if not episodes:
        raise DataError(f"{which} of {folder} hold no whole episode (the rows before a buffer's first terminal and "
                        f"after its last are pieces of episodes cut by its edges)")
    print(f"dropped {counts['cut']} piece{'s' * (counts['cut'] != 1)} of episodes at the edges of {which} "
          f"({counts['head']:,} rows up to a buffer's first terminal, {counts['tail']:,} after its last): each lacks "
          f"its start or its end, which lie in another buffer or in none")
    if counts["blank"]:
        print(f"dropped {counts['blank']:,} blank rows (zero frame, action 0, reward 0) that Dopamine adds before an "
              f"episode's first step")
    print("each episode's final observation repeats its last frame (the replay keeps no frame after a terminal; "
          "never used for training)")
    if total < steps:
        print(f"{which} of {folder} hold {total:,} steps in whole episodes, fewer than --steps {steps:,}: all of "
              f"them are used")
    # Dopamine's rewards, clipped to +-1: returns-to-go count clipped rewards while evaluation subtracts the game's raw
    # reward, as the official code does (the replica Breakout set stores raw rewards)
    ep_buffers = [EpisodeBuffer(id=i, observations=obs, actions=act, rewards=rew.tolist(), infos={},
                                terminations=[False] * (len(act) - 1) + [True], truncations=[False] * len(act))
                  for i, (obs, act, rew) in enumerate(episodes)]
    ref = ATARI_GAMER_SCORES.get(spec.name, (None, None))
    command = ["convert-dqn-replay", os.path.abspath(folder), game, dataset_id,
               *(["--buffers", buffers] if buffers else []), "--steps", steps]
    out = _write_dataset(dataset_id, ep_buffers, command, env=spec, eval_env=spec, observation_space=frame_space,
                         action_space=gym.spaces.Discrete(n_actions), ref_min_score=ref[0], ref_max_score=ref[1],
                         algorithm_name="DQN (Dopamine), DQN-replay dataset (converted by data.py convert-dqn-replay)",
                         description=f"whole episodes of {which} of {folder}, {total:,} steps", jpeg_encoding=False)
    refs = f"random / gamer returns {ref[0]} / {ref[1]}" if ref[0] is not None else "no reference returns"
    print(f"{dataset_id}: {len(episodes)} episodes, {total:,} steps from {which}, env {spec.id} in "
          f"AtariPreprocessing, {n_actions} actions, {refs}, written to {out}")
    return len(episodes)

# -------------------------------------------------------------------------------------------------------------------
# several Minari datasets of one environment -> one local dataset (python data.py mix)

def mix(sources, dataset_id):
    """Every episode of each source, source by source, as the new local dataset `dataset_id` (D4RL's medium-expert).
    The sources must share the env (the larger max_episode_steps is kept), spaces and reference returns; the eval env
    is the first's, the sources are listed under minari.combine_datasets' metadata key, episode infos are not copied.
    -> the number of episodes."""
    from minari.data_collector import EpisodeBuffer
    ids = [resolve(s) for s in sources]
    if len(ids) < 2:
        raise DataError("mix needs at least two source datasets, then the new id")
    _new_dataset_folder(dataset_id)  # (a taken id or an unwritable folder: said before the sources are read)
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
            raise DataError(f"{first} and {i} have different observation or action spaces, so they cannot be mixed")
        for key in ("ref_min_score", "ref_max_score"):
            if meta.get(key) != first_meta.get(key):
                raise DataError(f"{first} and {i} have different reference returns ({key} {first_meta.get(key)} and "
                                f"{meta.get(key)}), so the mix would have no single normalised score")
    steps = [ds.env_spec.max_episode_steps for ds, _, _ in loaded]
    spec = replace(spec, max_episode_steps=None if None in steps else max(steps))
    buffers = [EpisodeBuffer(id=n, observations=ep.observations, actions=ep.actions, rewards=list(ep.rewards),
                             terminations=list(ep.terminations), truncations=list(ep.truncations), infos={})
               for n, ep in enumerate(ep for _, _, episodes in loaded for ep in episodes)]
    folder = _write_dataset(
        dataset_id, buffers, ["mix", *sources, dataset_id], {"combined_datasets": ids}, env=spec,
        eval_env=getattr(first_ds, "_eval_env_spec", None), observation_space=first_ds.observation_space,
        action_space=first_ds.action_space, ref_min_score=first_meta.get("ref_min_score"),
        ref_max_score=first_meta.get("ref_max_score"), algorithm_name="data.py mix",
        description=f"every episode of {', then '.join(ids)}", jpeg_encoding=False)  # lossless, as DESIGN.md asks
    counts = ", ".join(f"{len(episodes)} from {i}" for i, (_, _, episodes) in zip(ids, loaded))
    print(f"{dataset_id}: {len(buffers)} episodes ({counts}), {sum(len(b.actions) for b in buffers):,} steps, env "
          f"{spec.id}, written to {folder}")
    return len(buffers)

# -------------------------------------------------------------------------------------------------------------------
# making a dataset offline (python data.py make NAME)
#
# PointMaze, by the method Minari used for its D4RL/pointmaze sets (d4rl-minari-dataset-generation, after D4RL's
# maze2d): gymnasium-robotics' maze as a continuing task (a new goal when one is reached, no reset), a waypoint planner
# over the maze's cells steering a PD controller, N(0, 0.5^2) noise on every action, and the one long run cut into
# episodes at each goal reached (truncated, never terminated). The eval env is Minari's: one fixed goal cell, the
# ball kept running at the goal until the horizon (300 / 600 / 800 steps).

MAKE_NAMES = {f"pointmaze-{maze}{dense}": f"D4RL/pointmaze/{maze}{dense}-v2"
              for maze in ("umaze", "medium", "large") for dense in ("", "-dense")}
MAKE_NAMES["breakout-mixed"] = "1% of DQN-replay Breakout (the DT paper's data)"
MAZE_ENVS = {"umaze": "UMaze", "medium": "Medium", "large": "Large"}       # gymnasium-robotics' PointMaze_<name>-v3
MAZE_EVAL_GOALS = {"umaze": (1, 1), "medium": (6, 6), "large": (7, 9)}     # the eval maps' goal cell, as Minari's
MAZE_STEPS = {"umaze": 200_000, "medium": 300_000, "large": 400_000}  # default --steps (under a minute each, 2 cores)
MAZE_REF_EPISODES = 100  # episodes of the random and the noise-free policy for the reference returns (Minari's 100)

def make(name, dataset_id=None, seed=0, steps=None):
    """python data.py make NAME: the local Minari dataset `dataset_id` (default made/<env>/<kind>-v0), made offline
    from `seed`; prints what it made. -> its folder."""
    import difflib
    if name not in MAKE_NAMES:
        near = difflib.get_close_matches(name, MAKE_NAMES, n=1)
        raise DataError(f"make knows no '{name}'; it makes {', '.join(MAKE_NAMES)}"
                        + (f" (did you mean {near[0]}?)" if near else ""))
    if seed < 0:
        raise DataError(f"--seed {seed} is negative; pass a whole number from 0")
    dataset_id = dataset_id or _made_id(name)
    _new_dataset_folder(dataset_id)  # (a taken id or an unwritable folder: said before any work)
    t0 = time.time()
    if name == "breakout-mixed":
        buffers, write_kwargs, behaviour = _make_breakout(seed, steps)
    elif name.startswith("hopper-"):
        buffers, write_kwargs, behaviour = _make_hopper(name, seed, steps)
    else:
        buffers, write_kwargs, behaviour = _make_pointmaze(name, seed, steps)
    command = ["make", name, dataset_id, *(["--seed", seed] if seed else []), *(["--steps", steps] if steps else [])]
    folder = _write_dataset(dataset_id, buffers, command, {"stands_in_for": MAKE_NAMES[name]}, **write_kwargs)
    returns = np.array([sum(b.rewards) for b in buffers])                         # (episodes,)
    q = np.percentile(returns, [0, 50, 75, 100])
    print(f"{dataset_id} (stands in for {MAKE_NAMES[name]}): {len(buffers):,} episodes, "
          f"{sum(len(b.rewards) for b in buffers):,} steps\n"
          f"episode returns: min {q[0]:.4g}, median {q[1]:.4g}, 75th percentile {q[2]:.4g}, max {q[3]:.4g}, "
          f"mean {returns.mean():.4g}\n{behaviour}\nmade in {time.time() - t0:.0f} s, written to {folder}")
    return folder

def _made_id(name):
    """make's default id: pointmaze-medium-dense -> made/pointmaze/medium-dense-v0."""
    return "made/" + name.replace("-", "/", 1) + "-v0"

def maze_steps(maze_map, goal):
    """The planner: value iteration over the maze's cells (as D4RL's and Minari's QIteration) with a cost of 1 per
    move up, down, left or right. maze_map: rows of cells, 1 a wall (0, 'g', 'r', 'c' open); goal: (row, col).
    -> (rows, cols) moves from each cell to the goal, inf for walls and cells that cannot reach it."""
    free = np.array([[cell != 1 for cell in row] for row in maze_map])        # (H, W) open cells
    steps = np.full(free.shape, np.inf)                                         # (H, W)
    steps[goal] = 0.0
    while True:
        p = np.pad(steps, 1, constant_values=np.inf)                            # (H + 2, W + 2)
        best = np.minimum.reduce([p[:-2, 1:-1], p[2:, 1:-1], p[1:-1, :-2], p[1:-1, 2:]])  # (H, W) best neighbour
        new = np.where(free, np.minimum(steps, best + 1), np.inf)               # Bellman update, V = min(V, 1 + V')
        if np.array_equal(new, steps):
            return steps
        steps = new

def next_cell(steps, cell):
    """The waypoint cell: the neighbour of `cell` (row, col) fewest moves from the goal (ties: up, down, left,
    right)."""
    r, c = cell
    return min([(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)], key=lambda n: steps[n])

def _waypoint_action(obs, maze, plans, kp=10.0, kd=1.0):
    """The expert: a PD controller (D4RL's pointmaze/waypoint_controller.py gains, p 10, d -1) toward the centre of
    the next cell on the planner's path, or the goal itself once in its cell. plans: maze_steps per goal cell.
    -> (2,) action."""
    pos, vel, goal = obs["achieved_goal"], obs["observation"][2:], obs["desired_goal"]    # (2,) each
    cell, goal_cell = tuple(maze.cell_xy_to_rowcol(pos)), tuple(maze.cell_xy_to_rowcol(goal))
    if goal_cell not in plans:
        plans[goal_cell] = maze_steps(maze.maze_map, goal_cell)
    waypoint = goal if cell == goal_cell else maze.cell_rowcol_to_xy(np.array(next_cell(plans[goal_cell], cell)))
    return np.clip(kp * (waypoint - pos) - kd * vel, -1.0, 1.0)

def _maze_returns(spec, policy, episodes, seed):
    """policy(obs) in a fresh env of `spec` for `episodes` episodes (the first reset seeded, as Minari's
    get_average_reference_score). -> (mean return, fraction of episodes that reached the goal)."""
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
    """Minari's PointMaze collection (see above). -> (EpisodeBuffers, create_dataset_from_buffers' keyword
    arguments, the behaviour line)."""
    from minari.data_collector import EpisodeBuffer
    gym = _robotics()
    maze_name = name.split("-")[1]
    env_id = f"PointMaze_{MAZE_ENVS[maze_name]}{'Dense' if name.endswith('-dense') else ''}-v3"
    steps = steps or MAZE_STEPS[maze_name]
    horizon = gym.spec(env_id).max_episode_steps                               # 300 / 600 / 800
    eval_map = [list(row) for row in gym.spec(env_id).kwargs["maze_map"]]
    eval_map[MAZE_EVAL_GOALS[maze_name][0]][MAZE_EVAL_GOALS[maze_name][1]] = "g"
    eval_env = gym.make(env_id, maze_map=eval_map, continuing_task=True, reset_target=False)
    eval_spec = eval_env.spec
    eval_env.close()
    env = gym.make(env_id, continuing_task=True, reset_target=True, max_episode_steps=steps)
    maze, plans, rng = env.unwrapped.maze, {}, np.random.default_rng(seed)

    def noisy(obs):  # the behaviour policy: the expert plus N(0, 0.5^2) on each action, clipped
        return np.clip(_waypoint_action(obs, maze, plans) + 0.5 * rng.standard_normal(2), -1, 1).astype(np.float32)

    buffers, obs_list, actions, rewards = [], [], [], []
    obs, _ = env.reset(seed=seed)
    for t in range(steps):
        obs_list.append(obs)
        actions.append(noisy(obs))
        obs, reward, _, _, info = env.step(actions[-1])
        rewards.append(float(reward))
        # an episode ends at the first step within 0.45 of its goal (the env draws the next goal; the ball goes on),
        # at the env's horizon, or at the last step
        if info["success"] or len(actions) == horizon or t == steps - 1:
            obs_list.append(obs)                                                # s_T, also the next episode's s_0
            buffers.append(EpisodeBuffer(
                id=len(buffers), observations={k: np.stack([o[k] for o in obs_list]) for k in obs},  # (T + 1, .)
                actions=np.stack(actions), rewards=rewards, terminations=[False] * len(actions),
                truncations=[False] * (len(actions) - 1) + [True], infos={}))
            obs_list, actions, rewards = [], [], []
    env.close()
    # reference returns as Minari measures them, in the eval env: random actions and the noise-free expert
    ref_min, _ = _maze_returns(eval_spec, lambda obs: rng.uniform(-1, 1, 2).astype(np.float32), MAZE_REF_EPISODES,
                               seed)
    ref_max, _ = _maze_returns(eval_spec, lambda obs: _waypoint_action(obs, maze, plans).astype(np.float32),
                               MAZE_REF_EPISODES, seed)
    score, reached = _maze_returns(eval_spec, noisy, MAZE_REF_EPISODES, seed)
    behaviour = (f"behaviour policy (the noisy controller), {MAZE_REF_EPISODES} eval episodes: return {score:.1f} "
                 f"(normalised {100 * (score - ref_min) / (ref_max - ref_min):.1f}), goal reached in "
                 f"{100 * reached:.0f}%; reference returns {ref_min:.1f} (random actions) / {ref_max:.1f} (no noise)")
    write_kwargs = dict(
        env=env.spec, eval_env=eval_spec, observation_space=env.observation_space, action_space=env.action_space,
        ref_min_score=ref_min, ref_max_score=ref_max, num_episodes_average_score=MAZE_REF_EPISODES,
        algorithm_name="value-iteration waypoints + PD controller, action noise N(0, 0.5^2) (data.py make)",
        description=f"stands in for {MAKE_NAMES[name]}: {steps:,} steps of a continuing {env_id} run (seed {seed}), "
                    f"cut into episodes at each goal reached", jpeg_encoding=False)
    return buffers, write_kwargs, behaviour

# -------------------------------------------------------------------------------------------------------------------
# Breakout, made offline (python data.py make breakout-mixed)
#
# Mixed-quality play, as a DQN agent's replay is, in the papers' evaluation env (atari_env_spec). A scripted paddle
# controller reads the ball and the paddle from the console's RAM (AtariARI's annotation of Breakout's RAM, Anand et
# al. 2019: ball x at 99, ball y at 101, paddle x at 72; y grows downward and is 0 while no ball is in play), presses
# FIRE when no ball is in play and otherwise moves the paddle's middle under the ball. In an episode each action is
# replaced with probability eps by a uniformly random one; episode k plays at eps BREAKOUT_EPS[k % 10], so any number
# of episodes spreads eps from 0 (the controller alone) to 1 (random play).
# Departure: it moves under where the ball is, not under where it will land. A DQN agent acts on the frames it sees,
# and a model imitates best a player whose choice those 84x84 frames show. A landing-point controller (the falling
# ball's line folded at the walls, a NOOP zone of 2) was tried with the same seed: it scores less alone (mean 70.8
# against 93.1 over its 12 eps-0 episodes) and dt.py --preset cpu imitated it worse (30 episodes, seeds 0 / 1: 17.2
# / 20.5 against that data's median 29.5; training loss 0.72 at the end against 0.5 here).

BREAKOUT_RAM = dict(ball_x=99, ball_y=101, paddle_x=72)
BREAKOUT_PADDLE_MIDDLE = 10    # ball x - paddle x at the paddle's middle (measured: it returns the ball at -1..21)
BREAKOUT_NOOP_ZONE = 4         # NOOP while the paddle's middle is this close to the ball (the paddle has momentum)
BREAKOUT_EPS = (0.0, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.7, 1.0)
BREAKOUT_EPISODES = 12 * len(BREAKOUT_EPS)

def _breakout_action(ram):
    """The controller: the console's RAM -> an action (0 NOOP, 1 FIRE, 2 RIGHT, 3 LEFT)."""
    x, y, paddle = (int(ram[BREAKOUT_RAM[k]]) for k in ("ball_x", "ball_y", "paddle_x"))
    if y == 0:
        return 1                                   # no ball in play: serve
    off = x - (paddle + BREAKOUT_PADDLE_MIDDLE)    # > 0: the ball is right of the paddle's middle
    return 0 if abs(off) <= BREAKOUT_NOOP_ZONE else 2 if off > 0 else 3

def _make_breakout(seed=0, steps=None):
    """BREAKOUT_EPISODES episodes (with `steps`: episodes until that many steps, the last cut there, truncated) ->
    (EpisodeBuffers, _write_dataset's keyword arguments, a line on the behaviour). Seeded: the reset seeds (the no-op
    starts) and the random actions come from numpy's Generator(seed)."""
    from minari.data_collector import EpisodeBuffer
    spec = atari_env_spec("breakout")
    env = make_atari_env(spec)
    ale = env.unwrapped.ale
    rng = np.random.default_rng(seed)
    buffers, returns, total, t0 = [], {eps: [] for eps in BREAKOUT_EPS}, 0, time.time()
    while (len(buffers) < BREAKOUT_EPISODES) if steps is None else (total < steps):
        eps = BREAKOUT_EPS[len(buffers) % len(BREAKOUT_EPS)]
        obs, _ = env.reset(seed=int(rng.integers(2**31)))
        frames, actions, rewards, terms, truncs = [obs], [], [], [], []
        while True:
            action = _breakout_action(ale.getRAM())
            if rng.random() < eps:
                action = int(rng.integers(4))
            obs, reward, term, trunc, _ = env.step(action)
            total += 1
            cut = steps is not None and total >= steps        # --steps reached: the episode ends here, truncated
            frames.append(obs)
            actions.append(action)
            rewards.append(float(reward))                     # raw game points
            terms.append(bool(term))
            truncs.append(bool(trunc or cut) and not term)
            if term or trunc or cut:
                break
        buffers.append(EpisodeBuffer(id=len(buffers), observations=np.stack(frames), infos={},  # (T+1, 84, 84) uint8
                                     actions=np.array(actions, np.int64), rewards=rewards, terminations=terms,
                                     truncations=truncs))
        returns[eps].append(sum(rewards))
        if len(buffers) % len(BREAKOUT_EPS) == 0:
            print(f"breakout-mixed: {len(buffers)} episodes, {total:,} steps, {time.time() - t0:.0f}s")
    env.close()
    low, high = ATARI_GAMER_SCORES["Breakout"]
    mean = float(np.mean([r for rs in returns.values() for r in rs]))
    alone, random_play = returns[0.0], returns[1.0]
    behaviour = (f"mean return {mean:.1f} ({100 * (mean - low) / (high - low):.1f} gamer-normalised); the controller "
                 f"alone (eps 0, {len(alone)} episode{'s' * (len(alone) != 1)}): {min(alone):.0f} to "
                 f"{max(alone):.0f}, mean {np.mean(alone):.1f}")
    if random_play:
        behaviour += f"; random play (eps 1): mean {np.mean(random_play):.1f}"
    write_kwargs = dict(env=spec, eval_env=spec, observation_space=env.observation_space,
                        action_space=env.action_space, ref_min_score=low, ref_max_score=high,
                        algorithm_name="scripted RAM-reading paddle controller, each action random with an "
                        "episode-wide probability eps (data.py make breakout-mixed)",
                        description=f"{len(buffers)} episodes, {total:,} steps of Breakout, mixed-quality play: eps "
                        f"{', '.join(map(str, BREAKOUT_EPS))} in turn, seed {seed}",
                        jpeg_encoding=False)  # lossless frames
    return buffers, write_kwargs, behaviour


# --------------------------------------------------------------------------------------------------
# Hopper, made offline (python data.py make hopper-medium, hopper-medium-replay, hopper-expert)
#
# D4RL's recipe with Augmented Random Search (Mania, Guy and Recht 2018) in place of SAC: ARS V2-t
# trains a linear policy in Hopper-v5, the alive bonus (1 a step) off its training returns as the
# paper does for Hopper (modestyachts/ARS@4c8e24e code/ars.py#L399), until its noise-free eval
# return reaches the level's share of the way from D4RL's random to expert return, or the budget
# ends (then the best policy evaluated). Departures from the paper:
# 1. gymnasium's Hopper-v5, not gym 0.9's Hopper-v1 (MuJoCo 1.31): the same robot and reward.
# 2. Actions clipped to the env's [-1, 1]: the simulator clamps them alike, the control cost not.
# 3. A run below medium after HOPPER_RESTART iterations restarts from M = 0 with new directions:
#    Hopper's runs vary widely with the seed, and one can stall for long.

MAKE_NAMES.update({"hopper-medium": "mujoco/hopper/medium-v0",
                   "hopper-medium-replay": "D4RL's hopper-medium-replay-v2",
                   "hopper-expert": "mujoco/hopper/expert-v0"})
HOPPER_ARS = dict(alpha=0.01, nu=0.025, directions=8, top=4)  # the paper's Table 9, Hopper-v1
HOPPER_LEVELS = {"medium": 1 / 3, "expert": 1.0}  # the eval return that stops training, normalised
HOPPER_ITERATIONS = {"medium": 1000, "expert": 300}  # at most; set from measured runs (README)
HOPPER_RESTART, HOPPER_EVAL_EPISODES, HOPPER_NOISE, HOPPER_STEPS = 200, 5, 0.05, 300_000
HOPPER_HELP = ("hopper-*: ARS trains a linear policy in Hopper-v5 to a third of D4RL's expert "
               f"return\n(expert: all, or the best in {HOPPER_ITERATIONS['expert']} iterations); "
               f"data: its rollouts, N(0, {HOPPER_NOISE}^2) on each action\n(medium-replay: "
               "every rollout of training to medium).")


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


def _make_hopper(name, seed, steps):
    """ARS to the level `name` names, then its noisy rollouts, or for medium-replay every rollout
    ARS ran. -> (EpisodeBuffers, _write_dataset's keyword arguments, the behaviour line)."""
    import gymnasium as gym
    from minari.data_collector import EpisodeBuffer
    level, (low, high), t0 = name.removeprefix("hopper-"), D4RL_REF_SCORES["Hopper"], time.time()
    env, noise_rng = gym.make("Hopper-v5"), np.random.default_rng([seed, 0])
    env.reset(seed=seed)

    def rollout(M, mu, std, shift=1.0, noise=0.0, limit=None):
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
                                truncations=ends + [not term], infos={})        # (T + 1, 11) states
        return sum(rewards) - shift * len(rewards), np.stack(states[:-1]), episode

    # train; (re)start a run at first, and where it is below medium HOPPER_RESTART iterations on
    stop = level.removesuffix("-replay")
    medium, target = (low + HOPPER_LEVELS[k] * (high - low) for k in ("medium", stop))
    replay, best, start, runs = [], (-np.inf,), 0, 0
    for it in range(1, HOPPER_ITERATIONS[stop] + 1):
        if it == start + 1 and best[0] < medium:
            training = ars(rollout, (3, 11), np.random.default_rng([seed, it]), **HOPPER_ARS)
            start, runs = it - 1 + HOPPER_RESTART, runs + 1
        M, mu, std, episodes = next(training)
        replay += episodes
        score = np.mean([rollout(M, mu, std, 0.0)[0] for _ in range(HOPPER_EVAL_EPISODES)])
        best = max(best, (score, it, M, mu, std), key=lambda b: b[0])
        if score >= target:
            break

    # the data: noisy rollouts until `steps`, the last cut there, or the newest training rollouts
    score, it, M, mu, std = best
    lengths = np.cumsum([len(e.rewards) for e in replay[::-1]])          # steps of the newest k
    buffers = replay[-max((lengths <= steps).sum(), 1):] if steps else replay
    if level != "medium-replay":
        buffers, total, steps = [], 0, steps or HOPPER_STEPS
        while total < steps:
            buffers.append(rollout(M, mu, std, noise=HOPPER_NOISE, limit=steps - total)[2])
            total += len(buffers[-1].rewards)

    norm = lambda r: f"{r:.1f} (normalised {100 * (r - low) / (high - low):.1f})"
    behaviour = (f"mean return {norm(np.mean([sum(e.rewards) for e in buffers]))}; the policy's "
                 f"eval return {norm(score)}, level {norm(target)}, at ARS iteration {it} of "
                 f"{runs} run(s), {lengths[-1]:,} training steps, {time.time() - t0:.0f} s")
    write_kwargs = dict(
        env=env.spec, eval_env=env.spec, observation_space=env.observation_space,
        action_space=env.action_space, ref_min_score=low, ref_max_score=high,
        algorithm_name=f"ARS V2-t, N(0, {HOPPER_NOISE}^2) action noise (data.py make)",
        description=f"stands in for {MAKE_NAMES[name]}: {behaviour}, seed {seed}")
    return buffers, write_kwargs, behaviour


# -------------------------------------------------------------------------------------------------------------------
# writing a new dataset, all or nothing (convert-d4rl, convert-dqn-replay, mix, make)
#
# A dataset is written whole into a hidden folder in the datasets folder (same filesystem; Minari lists no hidden
# folder) and renamed into place when complete: an interrupt (Ctrl-C, SIGTERM, kill -9) never leaves a partial dataset
# where Minari looks. The writing process holds a lock on the hidden folder; the next dataset command removes any such
# folder whose lock no live process holds. A stop signal (main's _stop) waits while the hidden folder is made and from
# the write's end to the cleanup's end: acted on before the rename, it undoes the write; after it, it is only said.

PARTIAL_PREFIX = ".data.py-partial-"
STOP = dict(signals=[], in_place=False, hold=False)  # the stop signals caught; the new dataset in place; held

def _new_dataset_folder(dataset_id):
    """-> (the new dataset's folder, the datasets folder); one sentence if the id is malformed or taken, or the
    datasets folder cannot be written."""
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.storage.datasets_root_dir import get_dataset_path
    namespace = None
    with contextlib.suppress(ValueError, TypeError):  # (TypeError: minari's parser on an id without -vN)
        namespace = parse_dataset_id(dataset_id)[0]
    if namespace is None:  # load_data reads an id without a namespace as a short name
        raise DataError(f"dataset id '{dataset_id}' must look like namespace/name-vN, e.g. d4rl/hopper/medium-v2")
    try:
        folder, root = dataset_folder(dataset_id), str(get_dataset_path())  # (makes the datasets folder if missing)
    except OSError as e:
        raise _unwritable(os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets"), e) from None
    if os.path.exists(folder):
        raise DataError(f"dataset '{dataset_id}' already exists at {folder}; choose another id (nothing is "
                        f"overwritten)")
    parent = os.path.dirname(folder)
    while not os.path.isdir(parent):  # (the datasets folder is one)
        if os.path.exists(parent):
            raise DataError(f"{parent} is a file, so the dataset '{dataset_id}' cannot be written in it; choose "
                            f"another id or move that file")
        parent = os.path.dirname(parent)
    if not os.access(root, os.W_OK):
        raise _unwritable(root, PermissionError("not writable"))
    return folder, root

def _unwritable(root, e):
    return DataError(f"cannot write a dataset in {root} ({e.strerror or e}); set MINARI_DATASETS_PATH to a folder "
                     f"you can write")

def _clean_partial(root):
    """Remove the partial datasets interrupted commands left in `root`, but not one whose lock a live command holds."""
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

def _gzip_hdf5(path):
    """Rewrite Minari's HDF5 file with each array gzip-compressed in one chunk (Minari writes them uncompressed; h5py
    reads both alike): Atari frames take about a fortieth of the space."""
    import h5py
    with h5py.File(path, "r") as src, h5py.File(path + ".gz", "w", libver="latest") as dst:
        dst.attrs.update(src.attrs)
        def copy(name, obj):
            if isinstance(obj, h5py.Group):
                dst.require_group(name).attrs.update(obj.attrs)
            else:
                data = obj[()]
                chunks = data.shape if data.ndim and data.size else None
                out = dst.create_dataset(name, data=data, chunks=chunks, compression="gzip" if chunks else None)
                out.attrs.update(obj.attrs)
        src.visititems(copy)
    os.replace(path + ".gz", path)

def _write_dataset(dataset_id, buffers, command, extra_metadata=None, **kwargs):
    """minari.create_dataset_from_buffers(dataset_id, buffers, **kwargs), all or nothing, with its command line
    (`python data.py` + the words of `command`) and extra_metadata in its metadata. -> its folder."""
    import fcntl
    import shlex
    import tempfile
    from unittest import mock
    import minari
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.namespace import create_namespace
    folder, root = _new_dataset_folder(dataset_id)
    _clean_partial(root)
    tmp = None
    _hold(True)
    try:
        try:
            tmp = tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=root)
            lock = open(os.path.join(tmp, "lock.new"), "w")
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until this function ends, or this process does
            os.rename(lock.name, os.path.join(tmp, "lock"))  # named only once held, so _clean_partial never takes it
        except OSError as e:
            raise _unwritable(root, e) from None
        with lock:
            _hold(False)  # a stop signal ends the write at once
            with mock.patch.dict(os.environ, MINARI_DATASETS_PATH=os.path.join(tmp, "datasets")):  # (restored after)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # minari's advice about missing author, code permalink, ...
                    ds = minari.create_dataset_from_buffers(dataset_id, buffers, **kwargs)
                command = shlex.join(["python", "data.py", *map(str, command)])
                ds.storage.update_metadata({"data_py_command": command, **(extra_metadata or {})})
                written = dataset_folder(dataset_id)
                _gzip_hdf5(os.path.join(written, "data", "main_data.hdf5"))
            _hold(True)
            if STOP["signals"]:  # one that a finaliser swallowed ("Exception ignored in ..."): acted on here
                _act(STOP["signals"][-1])
            with contextlib.suppress(ValueError):  # (there already, or made by another command meanwhile)
                create_namespace(parse_dataset_id(dataset_id)[0])
            os.makedirs(os.path.dirname(folder), exist_ok=True)
            try:
                os.rename(written, folder)  # atomic
            except OSError:
                _new_dataset_folder(dataset_id)  # "already exists" where another command wrote this id meanwhile
                raise
            STOP["in_place"] = True
    finally:
        _hold(True)  # (where the write raised)
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        _hold(False)  # a stop signal that waited is acted on here
    return folder

# -------------------------------------------------------------------------------------------------------------------
# command line

def info(name):
    """python data.py info NAME: load a dataset, print its summary and the sampling rate (windows/s)."""
    t0 = time.time()
    d = load_data(name)
    print(f"{d.dataset_id}: {len(d.episodes)} episodes, {len(d.flat['rewards'])} steps, obs {d.obs_dim}, "
          f"act {d.act_dim}, loaded in {time.time() - t0:.1f}s; refs {d.ref_min:.1f}/{d.ref_max:.1f} ({d.ref_source}); "
          f"targets {d.target_returns}; max_ep_len {d.max_ep_len}")
    rng, t0 = np.random.default_rng(0), time.time()
    for _ in range(200):
        d.sample(64, 20, rng)
    dt = (time.time() - t0) / 200
    print(f"sampling: {64 / dt:,.0f} windows/s ({1e3 * dt:.2f} ms per batch of 64 x K=20)")

class Stopped(BaseException):
    """SIGTERM, raised where the program is, as Ctrl-C raises KeyboardInterrupt: a dataset write is undone alike."""

def _stop(signum, frame):
    """Ctrl-C and SIGTERM in a command: noted in STOP (a finaliser swallows what it raises: _write_dataset looks);
    while a write holds them, left waiting; else raised as KeyboardInterrupt or Stopped, or, once the new dataset is
    in place, only said. (Python runs this in the main thread whichever thread the signal reached.)"""
    STOP["signals"].append(signum)
    if STOP["hold"]:
        STOP["waiting"] = signum
    else:
        _act(signum)

def _act(signum):
    """A stop signal acted on: only said once the new dataset is in place, else raised where the program is."""
    if STOP["in_place"]:
        print("done; the signal came after the dataset was written", file=sys.stderr)
    else:
        raise KeyboardInterrupt if signum == signal.SIGINT else Stopped(signum)

def _hold(on):
    """Stop signals wait (on) or act again (off); one that waited is acted on when the hold ends."""
    STOP["hold"] = on
    if not on and (signum := STOP.pop("waiting", None)):
        _act(signum)

def _unraisable(u):
    """sys.unraisablehook in a command: a stop raised inside a finaliser is lost there quietly (STOP has it)."""
    if not isinstance(u.exc_value, (KeyboardInterrupt, Stopped)):
        sys.__unraisablehook__(u)

def _positive(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number above 0")
    return int(text)

def main(argv=None):
    import difflib
    import threading
    p = FlagParser(prog="data.py", description="Minari datasets for the model files: inspect one, convert D4RL or "
                   "DQN-replay data, mix datasets of one environment, or make one offline (new datasets are written "
                   "all or nothing).")
    sub = p.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="load a dataset, print its summary and the sampling rate")
    p_info.add_argument("name", nargs="?", default="hopper-medium",
                        help="short name or Minari id (default: %(default)s)")
    p_conv = sub.add_parser("convert-d4rl", help="D4RL MuJoCo HDF5 file -> local Minari dataset")
    p_conv.add_argument("path", help="the D4RL file, e.g. hopper_medium-v2.hdf5")
    p_conv.add_argument("dataset_id", help="the new dataset's Minari id, e.g. d4rl/hopper/medium-v2")
    p_conv.add_argument("--env", default=None, help="its gymnasium env (default: the robot's v5 env, from the names)")
    p_dqn = sub.add_parser("convert-dqn-replay", help="DQN-replay folder -> local Minari dataset of whole episodes")
    p_dqn.add_argument("folder", help="a downloaded <Game>/<run>/replay_logs folder, e.g. Breakout/1/replay_logs")
    p_dqn.add_argument("game", help="ALE's name of the game, e.g. Breakout")
    p_dqn.add_argument("dataset_id", help="the new dataset's Minari id, e.g. dqn-replay/breakout/1pct-v0")
    p_dqn.add_argument("--buffers", type=_positive, default=None, metavar="N",
                       help="read the last N buffers, the highest numbers (default: all, as DT's --num_buffers 50)")
    p_dqn.add_argument("--steps", type=_positive, default=500_000, metavar="S",
                       help="whole episodes until S steps, spread over the buffers (default: %(default)s, DT's 1%%)")
    p_mix = sub.add_parser("mix", help="datasets of one environment -> one local dataset (D4RL's medium-expert)")
    p_mix.add_argument("sources", nargs="+", metavar="SOURCE", help="short names or Minari ids, in order")
    p_mix.add_argument("dataset_id", help="the new dataset's Minari id, e.g. local/hopper/medium-expert-v0")
    p_make = sub.add_parser(
        "make", help="make a dataset offline in minutes: PointMaze by Minari's method, Breakout by a scripted player, Hopper by ARS",
        formatter_class=argparse.RawDescriptionHelpFormatter, description="Make a local Minari dataset offline, "
        "seeded. NAME, and what it stands in for:\n" + "".join(f"  {n:24}{what}\n" for n, what in MAKE_NAMES.items())
        + "PointMaze, by Minari's method: a continuing task, a planner (value iteration over the maze's\ncells) "
        "steering a PD controller, N(0, 0.5^2) noise on every action, episodes cut at each goal\nreached, Minari's "
        f"eval env. Its reference returns are measured as Minari measures them:\n{MAZE_REF_EPISODES} eval episodes "
        "of random actions, and of the controller without noise.\nbreakout-mixed: a controller that reads the ball "
        "from the console's RAM and keeps the paddle\nunder it, each action random with an episode-wide probability "
        f"eps, eps from 0 to 1 across\n{BREAKOUT_EPISODES} episodes, in the papers' evaluation env (AtariPreprocessing, "
        "no sticky actions);\nframes stored lossless.\n" + HOPPER_HELP)
    p_make.add_argument("name", metavar="NAME", help=", ".join(MAKE_NAMES))
    p_make.add_argument("dataset_id", nargs="?", default=None,
                        help="the new dataset's Minari id (default: made/pointmaze/<maze>[-dense]-v0, "
                             "made/breakout/mixed-v0, made/hopper/<level>-v0)")
    p_make.add_argument("--seed", type=int, default=0, help="the seed of everything random (default: %(default)s)")
    p_make.add_argument("--steps", type=_positive, default=None, metavar="N",
                        help="steps to collect (default: PointMaze umaze / medium / large " + " / ".join(
                            f"{n:,}" for n in MAZE_STEPS.values()) + f"; breakout-mixed: {BREAKOUT_EPISODES} episodes; hopper: {HOPPER_STEPS:,}, medium-replay all)")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and not argv[0].startswith("-") and argv[0] not in sub.choices:
        if "/" not in argv[0] and argv[0] not in SHORT_NAMES:  # neither a command nor a dataset name
            near = difflib.get_close_matches(argv[0], [*sub.choices, *SHORT_NAMES], n=1)
            print(f"error: unknown command '{argv[0]}'; the commands are {', '.join(sub.choices)}"
                  + (f" (did you mean {near[0]}?)" if near else " (or name a dataset: a short name such as "
                     "hopper-medium, or a Minari id such as mujoco/hopper/medium-v0)"), file=sys.stderr)
            raise SystemExit(1)
        argv = ["info", *argv]  # python data.py NAME: short for info NAME
    args = p.parse_args(argv)
    here = threading.current_thread() is threading.main_thread()  # (signal handlers can be set from there only)
    stops = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, _stop) for s in stops} if here else {}
    hook, sys.unraisablehook = sys.unraisablehook, _unraisable
    STOP.update(signals=[], in_place=False, hold=False)
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)  # (blocked while the command line loaded: acted on now)
        if args.command == "info":
            info(args.name)
        elif args.command == "mix":
            mix(args.sources, args.dataset_id)
        elif args.command == "make":
            args.dataset_id = args.dataset_id or _made_id(args.name)  # (said by a stop signal's line below)
            make(args.name, args.dataset_id, args.seed, args.steps)
        elif args.command == "convert-dqn-replay":
            convert_dqn_replay(args.folder, args.game, args.dataset_id, args.buffers, args.steps)
        else:
            convert_d4rl(args.path, args.dataset_id, args.env)
    except (Exception, KeyboardInterrupt, Stopped) as e:
        if isinstance(e, Exception) and not STOP["signals"]:  # (a stop raised inside an import or a reader comes
            if not isinstance(e, DataError):                   # back as an ImportError or a DataError: STOP has it)
                raise
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(1)
        ctrl_c = not STOP["signals"] or STOP["signals"][0] == signal.SIGINT  # (none noted: a KeyboardInterrupt)
        how, code = ("Ctrl-C", 130) if ctrl_c else ("SIGTERM", 143)
        new = getattr(args, "dataset_id", None)
        print(f"stopped by {how}" + (f": the dataset '{new}' was not written, and nothing of it is left" if new
                                     else ""), file=sys.stderr)
        raise SystemExit(code) from None
    finally:
        if __name__ == "__main__":  # the command line's work is done: a stop signal from here to its exit is moot
            for s in stops:
                signal.signal(s, signal.SIG_IGN)
        else:  # a caller's handlers back (None: not Python's)
            sys.unraisablehook = hook
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
        STOP.update(signals=[], in_place=False, hold=False)

if __name__ == "__main__":
    main()
