"""data.py against hand-computed values: RTGs, masks, timesteps, T+1 alignment, dict flattening, error messages."""
import os
import subprocess
import sys

import numpy as np
import pytest

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hopper_episode(rewards, seed):
    """A hand-made Hopper-shaped episode: T+1 observations, each filled with a recognisable value."""
    T = len(rewards)
    obs = np.stack([np.full(11, 10.0 * seed + t) for t in range(T + 1)])   # obs[t] == 10*seed + t everywhere
    actions = np.stack([np.full(3, 0.1 * (t + 1) + seed) for t in range(T)]).astype(np.float32) / 10
    return dict(observations=obs, actions=actions, rewards=np.array(rewards, float),
                terminations=np.array([False] * (T - 1) + [True]), truncations=np.zeros(T, bool))


@pytest.fixture(scope="module")
def hand_made(make_dataset):
    import gymnasium as gym
    ds = make_dataset("test/hopper/handmade-v0", [hopper_episode([1.0, 2.0, 3.0], 0), hopper_episode([5.0, 7.0], 1)],
                      env=gym.make("Hopper-v5"))
    return data.load_data(ds)


def test_returns_to_go():
    assert np.allclose(data.returns_to_go([1.0, 2.0, 3.0]), [6.0, 5.0, 3.0])
    assert np.allclose(data.returns_to_go([-1.0, 0.5]), [-0.5, 0.5])


def test_t_plus_one_alignment(hand_made):
    d = hand_made
    ep0, ep1 = d.episodes
    assert ep0["observations"].shape == (3, 11) and ep1["observations"].shape == (2, 11)  # last observation dropped
    assert np.allclose(ep0["observations"][:, 0], [0, 1, 2]) and np.allclose(ep1["observations"][:, 0], [10, 11])
    assert np.allclose(ep0["actions"][:, 0], [0.01, 0.02, 0.03])
    # state stats over the 5 aligned states (values 0,1,2,10,11), not over the 7 stored observations
    assert np.allclose(d.state_mean, np.mean([0, 1, 2, 10, 11]))
    assert np.allclose(d.state_std, np.std([0, 1, 2, 10, 11]) + 1e-6)


def test_window_values_by_hand(hand_made):
    d = hand_made
    s = 1e-3  # MuJoCo return scale
    # K=4 window ending at episode 0's step 1: two padding steps, then steps 0 and 1
    b = data.gather_windows(d.flat, np.array([0]), np.array([1]), 4)
    assert b["mask"].tolist() == [[0, 0, 1, 1]]
    assert b["timesteps"].tolist() == [[0, 0, 0, 1]]
    assert np.allclose(b["rtg"][0, :, 0], [0, 0, 6 * s, 5 * s])
    assert np.allclose(b["rewards"][0, :, 0], [0, 0, 1, 2])
    assert np.allclose(b["actions"][0, :, 0], [0, 0, 0.01, 0.02])
    assert np.allclose(b["states"][0, :, 0], [0, 0, *((np.array([0, 1]) - d.state_mean[0]) / d.state_std[0])])
    assert np.allclose(b["prev_action"], 0) and np.allclose(b["prev_reward"], 0)   # null: the window starts at t=0
    # K=2 window ending at episode 0's step 2: steps 1, 2; the step before is step 0
    b = data.gather_windows(d.flat, np.array([0]), np.array([2]), 2)
    assert b["mask"].tolist() == [[1, 1]] and b["timesteps"].tolist() == [[1, 2]]
    assert np.allclose(b["rtg"][0, :, 0], [5 * s, 3 * s])
    assert np.allclose(b["prev_action"][0], 0.01) and np.allclose(b["prev_reward"][0], 1.0)
    # K=3 window ending at episode 1's step 0 (row 3) must not reach into episode 0
    b = data.gather_windows(d.flat, np.array([3]), np.array([3]), 3)
    assert b["mask"].tolist() == [[0, 0, 1]] and b["timesteps"].tolist() == [[0, 0, 0]]
    assert np.allclose(b["rtg"][0, :, 0], [0, 0, 12 * s]) and np.allclose(b["prev_action"], 0)
    assert np.allclose(b["states"][0, :2], 0)


def test_sample_is_consistent_with_episodes(hand_made):
    d = hand_made
    b = d.sample(500, 3, np.random.default_rng(0))
    assert b["states"].shape == (500, 3, 11) and b["actions"].shape == (500, 3, 3) and b["rtg"].shape == (500, 3, 1)
    assert b["timesteps"].dtype.is_floating_point is False and (b["mask"][:, -1] == 1).all()
    # the mask is a suffix of ones, and timesteps count up by one across real steps
    m = b["mask"].numpy()
    assert (np.diff(m, axis=1) >= 0).all()
    ts = b["timesteps"].numpy()
    real_pairs = (m[:, 1:] == 1) & (m[:, :-1] == 1)
    assert (np.diff(ts, axis=1)[real_pairs] == 1).all()
    # the newest step is uniform over the 5 dataset steps, so episodes are drawn in proportion to their length (3:2)
    last_rtg = np.round(b["rtg"][:, -1, 0].numpy() * 1e3).astype(int)
    freq = np.array([np.mean(last_rtg == v) for v in (6, 5, 3, 12, 7)])
    assert np.all(np.abs(freq - 0.2) < 0.07), freq


def test_dict_observations_flattened(make_dataset):
    import gymnasium as gym
    import gymnasium_robotics
    gym.register_envs(gymnasium_robotics)
    env = gym.make("PointMaze_UMaze-v3")
    T = 3
    obs = dict(observation=np.arange(4 * (T + 1), dtype=float).reshape(T + 1, 4),
               achieved_goal=np.full((T + 1, 2), -7.0),
               desired_goal=np.array([[9.0, 9.0], [1.0, 2.0], [1.0, 2.0], [1.0, 2.0]]))  # step 0 shows a stale goal
    ep = dict(observations=obs, actions=np.zeros((T, 2), np.float32), rewards=np.array([0.0, 0.0, 1.0]),
              terminations=np.zeros(T, bool), truncations=np.array([False, False, True]))
    d = data.load_data(make_dataset("test/pointmaze/flat-v0", [ep, ep], env=env))
    o = d.episodes[0]["observations"]
    assert o.shape == (3, 6)                                      # observation (4) ++ desired_goal (2), no achieved_goal
    assert np.allclose(o[:, :4], obs["observation"][:3])
    assert np.allclose(o[:, 4:], [[1, 2]] * 3)                    # the stale first goal is replaced by step 1's
    assert d.family == "maze" and d.goal_reaching and d.return_scale == 1.0 and d.goal_dim == 2
    assert d.target_returns == [1.0]                              # best dataset episode return
    flat = data.flatten_obs({"desired_goal": np.array([5.0, 6.0]), "observation": np.array([1.0, 2, 3, 4]),
                             "achieved_goal": np.zeros(2)})
    assert flat.tolist() == [1, 2, 3, 4, 5, 6]


def test_normalised_score_uses_d4rl_refs_when_dataset_has_none(tiny_hopper):
    d = data.load_data(tiny_hopper)
    assert "D4RL" in d.ref_source and d.goal_dim == 0
    assert np.allclose(d.normalize_score([-20.272305, 3234.3, 1607.0139]), [0.0, 100.0, 50.0], atol=1e-4)
    assert d.target_returns == [3600.0, 1800.0] and d.return_scale == 1e-3 and d.max_ep_len == 1000


def test_unknown_name_lists_known_names():
    with pytest.raises(data.DataError, match="unknown environment 'hoper-medium'.*hopper-medium"):
        data.resolve("hoper-medium")
    assert data.resolve("hopper-medium") == "mujoco/hopper/medium-v0"
    assert data.resolve("pointmaze-umaze-dense") == "D4RL/pointmaze/umaze-dense-v2"
    assert data.resolve("some/other/id-v1") == "some/other/id-v1"


def _cli(args, tmp_path):
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "dt.py"), *args], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=120)


def test_cli_messages_unknown_and_offline(tmp_path):
    r = _cli(["--env", "hoper-medium"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "unknown environment 'hoper-medium'" in r.stderr and "hopper-medium" in r.stderr
    r = _cli(["--env", "hopper-medium"], tmp_path)   # no local copy, no network
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert "mujoco/hopper/medium-v0" in r.stderr and "minari download" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_download_failure_is_one_sentence(monkeypatch, tmp_path):
    import minari

    def fake_load(dataset_id, download=False):
        if download:
            raise ConnectionError("network unreachable")
        raise FileNotFoundError(dataset_id)
    monkeypatch.setattr(minari, "load_dataset", fake_load)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(data.DataError, match="could not be downloaded.*minari download mujoco/walker2d/expert-v0"):
        data.load_data("walker2d-expert")
