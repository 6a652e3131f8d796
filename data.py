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
observation s_T (no action follows it) is dropped.
"""
import os
import socket
from dataclasses import dataclass, field

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
NULL_ACTION_VALUE = 0.0  # a_{-1} and r_{-1} at an episode's first step (and the padding value)


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


def flatten_obs(obs):
    """Dict observations (PointMaze, AntMaze) -> observation ++ desired_goal, in that fixed order. Works on one
    observation or on arrays with a leading time axis; plain arrays pass through."""
    if isinstance(obs, dict):
        return np.concatenate([np.asarray(obs["observation"]), np.asarray(obs["desired_goal"])], axis=-1)
    return np.asarray(obs)


# ----------------------------------------------------------------------------------------------------------------
# loading

def _open_minari(dataset_id, download):
    """minari.load_dataset with the failures a user can hit turned into one sentence."""
    import minari
    try:
        return minari.load_dataset(dataset_id, download=False)
    except (FileNotFoundError, ValueError):  # not in MINARI_DATASETS_PATH (minari raises either, by version)
        pass
    where = os.environ.get("MINARI_DATASETS_PATH", "~/.minari/datasets")
    if not download:
        raise DataError(f"dataset '{dataset_id}' is not in {where}; download it with `minari download {dataset_id}` "
                        f"or set MINARI_DATASETS_PATH to a folder that holds it")
    print(f"downloading {dataset_id} (once) into {where} ...", flush=True)
    try:
        if os.environ.get("HF_HUB_OFFLINE", "0") in ("0", ""):
            socket.getaddrinfo("huggingface.co", 443)  # no network: fail now, not after a minute of retries
        return minari.load_dataset(dataset_id, download=True)
    except Exception as e:  # network errors come from several libraries (httpx, huggingface_hub, socket)
        raise DataError(f"dataset '{dataset_id}' is not in {where} and could not be downloaded "
                        f"({'no network' if isinstance(e, OSError) else type(e).__name__}); with a network run `minari download {dataset_id}`, or copy it there "
                        f"and set MINARI_DATASETS_PATH") from None


@dataclass
class OfflineData:
    dataset_id: str
    family: str                 # 'mujoco' | 'maze' | 'other'
    episodes: list              # dicts: observations (T, obs_dim), actions (T, act_dim), rewards (T,), terminated
    env_spec: object            # gymnasium EnvSpec of the evaluation env
    ref_min: float = float("nan")
    ref_max: float = float("nan")
    ref_source: str = "none"
    return_scale: float = 1.0
    target_returns: list = field(default_factory=list)
    max_ep_len: int = 1000
    goal_reaching: bool = False
    goal_dim: int = 0           # the last goal_dim state entries are desired_goal (dict observations), else 0

    def __post_init__(self):
        eps = self.episodes
        self.obs_dim = eps[0]["observations"].shape[1]
        self.act_dim = eps[0]["actions"].shape[1]
        obs = np.concatenate([e["observations"] for e in eps]).astype(np.float64)
        self.state_mean = obs.mean(0).astype(np.float32)
        self.state_std = (obs.std(0) + 1e-6).astype(np.float32)
        # Flat arrays, one row per dataset step; a batch is a handful of fancy-indexing slices of these.
        lengths = np.array([len(e["actions"]) for e in eps])
        self.ep_start = np.concatenate([[0], np.cumsum(lengths)[:-1]])            # (n_episodes,)
        self.step_ep_start = np.repeat(self.ep_start, lengths)                     # (N,) start row of each row's episode
        self.flat = dict(
            states=self.normalize_states(obs),                                      # (N, obs_dim)
            actions=np.concatenate([e["actions"] for e in eps]).astype(np.float32),  # (N, act_dim)
            rewards=np.concatenate([e["rewards"] for e in eps]).astype(np.float32),  # (N,)
            rtg=np.concatenate([returns_to_go(e["rewards"]) for e in eps]).astype(np.float32) * self.return_scale,
            timesteps=np.concatenate([np.arange(n) for n in lengths]),              # (N,)
        )
        self.episode_returns = np.array([e["rewards"].sum() for e in eps])

    def normalize_states(self, obs):
        return ((np.asarray(obs, dtype=np.float64) - self.state_mean) / self.state_std).astype(np.float32)

    def normalize_score(self, returns):
        """D4RL-style normalised score: 100 * (R - ref_min) / (ref_max - ref_min)."""
        return 100.0 * (np.asarray(returns, dtype=np.float64) - self.ref_min) / (self.ref_max - self.ref_min)

    def make_env(self):
        """The dataset's own evaluation env (Minari's eval_env_spec, else env_spec)."""
        import gymnasium as gym
        if self.family == "maze":
            import gymnasium_robotics
            gym.register_envs(gymnasium_robotics)
        return gym.make(self.env_spec)

    def sample(self, batch_size, K, rng):
        """B windows of K steps: the last step is uniform over all dataset steps (so episodes are drawn in
        proportion to their length), and the window reaches back K-1 steps, left-padded at an episode's start.
        End-anchored rather than start-anchored (kzl's DT): every step is the newest token equally often, and the
        padded windows are exactly what evaluation feeds the model during an episode's first K-1 steps."""
        end = rng.integers(0, len(self.step_ep_start), size=batch_size)  # (B,)
        return gather_windows(self.flat, self.step_ep_start[end], end, K)


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


def _episode_arrays(ep, fix_first_goal):
    obs = ep.observations
    if isinstance(obs, dict):
        obs = {k: np.asarray(v) for k, v in obs.items()}
        if fix_first_goal and len(obs["desired_goal"]) > 2:
            # Minari's maze collection continues across goals: an episode's first observation still shows the
            # previous goal (shared/datasets/README.md). Evaluation never shows a stale goal, so use step 1's.
            obs["desired_goal"][0] = obs["desired_goal"][1]
        obs = flatten_obs(obs)
    obs = np.asarray(obs, dtype=np.float32).reshape(len(obs), -1)
    actions = np.asarray(ep.actions, dtype=np.float32).reshape(len(ep.actions), -1)
    T = len(actions)
    assert len(obs) == T + 1, f"episode {ep.id}: expected T+1 = {T + 1} observations, got {len(obs)}"
    return dict(observations=obs[:T], actions=actions, rewards=np.asarray(ep.rewards, dtype=np.float32),
                terminated=bool(np.asarray(ep.terminations)[-1]))


def load_data(name, download=True):
    """Short name or Minari id -> OfflineData (episodes, state stats, eval env, reference scores, targets)."""
    dataset_id = resolve(name)
    ds = _open_minari(dataset_id, download)
    meta = ds.storage.metadata
    spec = getattr(ds, "_eval_env_spec", None) or ds.env_spec  # what recover_environment(eval_env=True) makes
    if spec is None:
        raise DataError(f"dataset '{dataset_id}' records no environment, so it cannot be evaluated")
    entry = str(spec.entry_point)
    family = "maze" if "maze" in entry else "mujoco" if "gymnasium.envs.mujoco" in entry else "other"
    episodes = [_episode_arrays(ep, family == "maze") for ep in ds.iterate_episodes()]
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
    best = float(max(e["rewards"].sum() for e in episodes))
    # MuJoCo locomotion: returns / 1000 and DT's targets. Mazes (and anything else): unscaled, and the target is the
    # dataset's best episode return; maze datasets stop at the goal, evaluation runs on to the horizon, so a target on
    # the evaluation scale (hundreds) would lie far outside anything the model saw.
    scale = 1e-3 if family == "mujoco" else 1.0
    targets = list(DT_TARGETS.get(env_key, [best])) if family == "mujoco" else [best]
    max_len = max(int(spec.max_episode_steps or 0), max(len(e["actions"]) for e in episodes))
    return OfflineData(dataset_id=dataset_id, family=family, episodes=episodes, env_spec=spec, ref_min=ref_min,
                       ref_max=ref_max, ref_source=ref_source, return_scale=scale, target_returns=targets,
                       max_ep_len=max_len, goal_reaching=family == "maze", goal_dim=goal_dim)


def _benchmark():
    """python data.py [name]: load a dataset, print its summary and the sampling rate (windows/s)."""
    import sys
    import time
    name = sys.argv[1] if len(sys.argv) > 1 else "hopper-medium"
    try:
        t0 = time.time()
        d = load_data(name)
    except DataError as e:
        print(f"error: {e}")
        raise SystemExit(1)
    print(f"{d.dataset_id}: {len(d.episodes)} episodes, {len(d.flat['rewards'])} steps, obs {d.obs_dim}, "
          f"act {d.act_dim}, loaded in {time.time() - t0:.1f}s; refs {d.ref_min:.1f}/{d.ref_max:.1f} ({d.ref_source}); "
          f"targets {d.target_returns}; max_ep_len {d.max_ep_len}")
    rng = np.random.default_rng(0)
    n, t0 = 200, time.time()
    for _ in range(n):
        d.sample(64, 20, rng)
    dt = time.time() - t0
    print(f"sampling: {n * 64 / dt:,.0f} windows/s ({1e3 * dt / n:.2f} ms per batch of 64 x K=20)")


if __name__ == "__main__":
    _benchmark()
