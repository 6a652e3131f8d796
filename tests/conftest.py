"""Shared fixtures: tiny Minari datasets written by the tests themselves (no network, no ../shared/datasets).

    make_dataset(dataset_id, episodes, env, eval_env=None, **metadata) -> dataset_id
        episodes: list of dicts with observations (T+1, ...) array or dict of arrays, actions (T, act), rewards (T,),
        terminations (T,), truncations (T,). Written under a temporary MINARI_DATASETS_PATH (set for the session).
    tiny_hopper -> 'test/hopper/tiny-v0': 12 random-policy Hopper-v5 episodes, no reference scores in the metadata
    tiny_maze   -> 'test/pointmaze/tiny-dense-v0': 8 PointMaze_UMazeDense-v3 episodes (dict observations), eval
                   horizon 40
    tiny_breakout -> 'test/breakout/tiny-v0': 4 short episodes of real Breakout frames (84x84 uint8, the papers'
                   AtariPreprocessing env in the spec, stored lossless, int64 actions), as convert-dqn-replay writes
"""
import os
import signal

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # belt and braces: nothing in the suite may reach the network
# A shell's background job (`pytest &`, a CI script's) starts with SIGINT ignored, and an ignored signal is
# inherited across exec: with Python's own handler here, every child a test starts takes Ctrl-C as from a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def minari_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("minari_datasets")
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(path)
    yield path
    if old is None:
        del os.environ["MINARI_DATASETS_PATH"]
    else:
        os.environ["MINARI_DATASETS_PATH"] = old


@pytest.fixture(scope="session")
def make_dataset(minari_path):
    import minari
    from minari.data_collector import EpisodeBuffer

    def make(dataset_id, episodes, env, eval_env=None, **metadata):
        buffers = [EpisodeBuffer(id=i, observations=e["observations"],
                                 actions=np.asarray(e["actions"], None if np.asarray(e["actions"]).dtype.kind == "i"
                                                    else np.float32),
                                 rewards=list(map(float, e["rewards"])), terminations=list(map(bool, e["terminations"])),
                                 truncations=list(map(bool, e["truncations"])), infos={})
                   for i, e in enumerate(episodes)]
        minari.create_dataset_from_buffers(dataset_id, buffers, env=env, eval_env=eval_env, algorithm_name="test",
                                           author="tests", author_email="tests@example.org",
                                           description="written by the test suite", **metadata)
        return dataset_id
    return make


def rollout(env, n_episodes, max_steps, seed):
    """Episodes of a smooth random policy (an Ornstein-Uhlenbeck-ish walk), recorded in Minari's T+1 layout."""
    rng = np.random.default_rng(seed)
    episodes = []
    for ep in range(n_episodes):
        obs, _ = env.reset(seed=seed + ep)
        obs_list, acts, rews, terms, truncs = [obs], [], [], [], []
        a = np.zeros(env.action_space.shape, np.float32)
        for t in range(max_steps):
            a = np.clip(0.8 * a + 0.5 * rng.standard_normal(a.shape), -1, 1).astype(np.float32)
            obs, r, term, trunc, _ = env.step(a)
            trunc = trunc or t == max_steps - 1
            obs_list.append(obs), acts.append(a), rews.append(r), terms.append(term), truncs.append(trunc)
            if term or trunc:
                break
        if isinstance(obs_list[0], dict):
            obs_arr = {k: np.stack([o[k] for o in obs_list]) for k in obs_list[0]}
        else:
            obs_arr = np.stack(obs_list)
        episodes.append(dict(observations=obs_arr, actions=np.stack(acts), rewards=np.array(rews),
                             terminations=np.array(terms), truncations=np.array(truncs)))
    return episodes


@pytest.fixture(scope="session")
def tiny_hopper(make_dataset):
    import gymnasium as gym
    env = gym.make("Hopper-v5")
    return make_dataset("test/hopper/tiny-v0", rollout(env, 12, 200, seed=0), env=env)


@pytest.fixture(scope="session")
def tiny_maze(make_dataset):
    import gymnasium as gym
    import gymnasium_robotics
    gym.register_envs(gymnasium_robotics)
    env = gym.make("PointMaze_UMazeDense-v3", continuing_task=True, max_episode_steps=40)
    eps = rollout(env, 8, 40, seed=1)
    return make_dataset("test/pointmaze/tiny-dense-v0", eps, env=env, eval_env=env.spec,
                        ref_min_score=0.0, ref_max_score=40.0)


@pytest.fixture(scope="session")
def tiny_breakout(make_dataset):
    """Real frames: the papers' Breakout env (AtariPreprocessing: 84x84 grayscale, frame skip 4) played by a policy
    that presses FIRE and moves at random, 4 episodes of at most 120 steps (the last cut as truncated)."""
    import data
    env = data.make_atari_env(data.atari_env_spec("breakout"))
    rng = np.random.default_rng(0)
    episodes = []
    for ep in range(4):
        obs, _ = env.reset(seed=ep)
        frames, acts, rews, terms, truncs = [obs], [], [], [], []
        for t in range(60 + 20 * ep):
            a = int(rng.choice(4, p=[0.2, 0.3, 0.25, 0.25]))
            obs, r, term, trunc, _ = env.step(a)
            trunc = trunc or t == 60 + 20 * ep - 1
            frames.append(obs), acts.append(a), rews.append(r), terms.append(term), truncs.append(trunc and not term)
            if term or trunc:
                break
        rews[len(rews) // 2] += 1.0 + ep         # returns 1..4 beside whatever the random play scored
        episodes.append(dict(observations=np.stack(frames), actions=np.array(acts, np.int64), rewards=np.array(rews),
                             terminations=np.array(terms), truncations=np.array(truncs)))
    return make_dataset("test/breakout/tiny-v0", episodes, env=env, eval_env=env.spec, jpeg_encoding=False,
                        ref_min_score=1.7, ref_max_score=30.5)


def pytest_configure(config):
    # the quick tier, `python -m pytest -q -m "not slow"`, leaves these out
    config.addinivalue_line("markers", "slow: runs a whole script (a subprocess, a training "
                                       "main(), a make) or takes seconds on 2 cores")
    config.addinivalue_line("filterwarnings", "ignore::UserWarning:minari.*")  # metadata advice for test datasets
    config.option.reportchars = (config.option.reportchars or "") + "s"       # say why a test was skipped
