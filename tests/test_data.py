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
    assert d.target_returns == [1.0]                              # every episode returns 1
    flat = data.flatten_obs({"desired_goal": np.array([5.0, 6.0]), "observation": np.array([1.0, 2, 3, 4]),
                             "achieved_goal": np.zeros(2)})
    assert flat.tolist() == [1, 2, 3, 4, 5, 6]


def test_the_target_outside_mujoco_and_atari_is_the_best_episode_return(make_dataset):
    """PointMaze (dense rewards until the goal ends an episode) and any other data: the best episode's return."""
    import gymnasium as gym
    import gymnasium_robotics
    gym.register_envs(gymnasium_robotics)
    env = gym.make("PointMaze_UMazeDense-v3")

    def episode(rewards):
        T = len(rewards)
        obs = dict(observation=np.zeros((T + 1, 4)), achieved_goal=np.zeros((T + 1, 2)), desired_goal=np.ones((T + 1, 2)))
        return dict(observations=obs, actions=np.zeros((T, 2), np.float32), rewards=np.array(rewards, float),
                    terminations=np.eye(1, T, T - 1, dtype=bool)[0], truncations=np.zeros(T, bool))

    eps = [episode([0.5] * 2), episode([0.5] * 6), episode([0.5] * 3), episode([0.5] * 9), episode([0.5] * 4)]
    d = data.load_data(make_dataset("test/pointmaze/best-v0", eps, env=env))
    assert d.target_returns == [4.5]                              # returns 1, 3, 1.5, 4.5, 2: the best
    flat = [dict(observations=np.zeros((T + 1, 10)), actions=np.zeros((T, 2), np.float32),
                 rewards=np.full(T, 0.5), terminations=np.zeros(T, bool), truncations=np.eye(1, T, T - 1, dtype=bool)[0])
            for T in (2, 6, 3)]
    assert data.load_data(make_dataset("test/other/best-v0", flat, env=gym.make("Reacher-v5"))).target_returns == [3.0]


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


@pytest.mark.slow
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
    with pytest.raises(data.DataError, match=r"could not be downloaded \(HF_HUB_OFFLINE is set\).*minari download "
                       "mujoco/walker2d/expert-v0"):
        data.load_data("walker2d-expert")


# ---- damaged vs missing datasets, non-finite data ----------------------------------------------------------------

def test_damaged_dataset_says_damaged_not_missing(tiny_hopper, minari_path, tmp_path, monkeypatch, capsys):
    import shutil
    for what in ("hdf5", "metadata"):
        root = tmp_path / what
        shutil.copytree(minari_path / tiny_hopper, root / tiny_hopper)   # never damage the session's copy
        folder = root / tiny_hopper
        if what == "hdf5":
            f = folder / "data" / "main_data.hdf5"
            f.write_bytes(f.read_bytes()[:3000])                         # a truncated download
        else:
            (folder / "data" / "metadata.json").write_text('{"total_episodes": 12,')
        monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
        with pytest.raises(data.DataError) as e:
            data.load_data(tiny_hopper)
        msg = str(e.value)
        assert f"at {folder} is damaged" in msg and "delete that folder" in msg and "could not be downloaded" not in msg
        assert ("OSError" if what == "hdf5" else "JSONDecodeError") in msg
    with pytest.raises(SystemExit) as e:                                  # the CLI: one line, exit 1
        data.main(["info", tiny_hopper])
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.startswith("error: ") and "damaged" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_malformed_episodes_say_damaged_and_the_run_leaves_no_folder(make_dataset, minari_path, tmp_path, capsys):
    """An episode with no steps, or with fewer observations than actions + 1: 'damaged', one sentence, and a model
    script stops before it makes its run folder."""
    import glob
    import h5py
    import gymnasium as gym
    import dt
    env = gym.make("Hopper-v5")
    few = [hopper_episode([1.0, 2.0], 0), hopper_episode([1.0, 2.0, 3.0], 1)]
    few[1]["observations"] = few[1]["observations"][:3]                        # T observations for T actions
    name = make_dataset("test/hopper/few-obs-v0", few, env=env)
    with pytest.raises(data.DataError, match=r"is damaged \(episode 1 has 3 observations .* for 3 actions"):
        data.load_data(name)
    empty = make_dataset("test/hopper/empty-episode-v0", [hopper_episode([1.0, 2.0], 0), hopper_episode([1.0], 1)],
                         env=env)
    with h5py.File(glob.glob(str(minari_path / empty / "data" / "*.hdf5"))[0], "a") as f:   # episode 1 loses its steps
        g = f["episode_1"]
        for k in ("observations", "actions", "rewards", "terminations", "truncations"):
            rows, dtype = g[k].shape, g[k].dtype
            del g[k]
            g.create_dataset(k, data=np.zeros(((1,) if k == "observations" else (0,)) + rows[1:], dtype))
    with pytest.raises(data.DataError, match=r"is damaged \(episode 1 has no steps\)"):
        data.load_data(empty)
    for bad in (name, empty):
        out = tmp_path / bad.replace("/", "_")
        with pytest.raises(SystemExit) as e:
            dt.main(["--dataset", bad, "--steps", "2", "--out", str(out)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and "damaged" in err and "\n" not in err and not out.exists(), err


def test_datasets_path_that_is_a_file_is_one_sentence(tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("x")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "a_file"))
    with pytest.raises(SystemExit) as e:
        data.main(["info", "hopper-medium"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err == (f"error: MINARI_DATASETS_PATH={tmp_path / 'a_file'} is a file, not a folder "
                                         f"of datasets; point it at a folder")


def test_non_finite_data_is_refused(make_dataset):
    import gymnasium as gym
    env = gym.make("Hopper-v5")
    bad_reward = [hopper_episode([1.0, 2.0], 0), hopper_episode([1.0, np.nan, 3.0], 1), hopper_episode([np.inf], 2)]
    with pytest.raises(data.DataError, match=r"NaN or infinite rewards, first in episode 1"):
        data.load_data(make_dataset("test/hopper/nan-reward-v0", bad_reward, env=env))
    bad_obs = [hopper_episode([1.0, 2.0], 0), hopper_episode([1.0], 1), hopper_episode([1.0, 2.0], 2)]
    bad_obs[2]["observations"][1, 4] = np.inf
    with pytest.raises(data.DataError, match=r"NaN or infinite observations, first in episode 2"):
        data.load_data(make_dataset("test/hopper/inf-obs-v0", bad_obs, env=env))
    eps = [dict(observations=np.zeros((3, 2)), actions=np.zeros((3, 1)), rewards=np.zeros(3)) for _ in range(2)]
    eps[1]["actions"][2, 0] = np.nan
    with pytest.raises(data.DataError, match=r"'hand' has NaN or infinite actions, first in episode 1"):
        data.OfflineData("hand", "mujoco", eps, env_spec=None)


# ---- AntMaze layout ----------------------------------------------------------------------------------------------

def test_antmaze_state_starts_with_torso_xy():
    import gymnasium as gym
    import gymnasium_robotics
    gym.register_envs(gymnasium_robotics)
    ant_id = max(i for i in gym.registry if i.startswith("AntMaze_UMaze-v"))   # the newest installed version
    for env_id, keys in ((ant_id, data.ANTMAZE_KEYS), ("PointMaze_UMaze-v3", data.MAZE_KEYS)):
        env = gym.make(env_id)
        obs, _ = env.reset(seed=0)
        assert data.obs_keys_for(env.spec) == keys
        flat = data.flatten_obs(obs, keys)
        if keys == data.ANTMAZE_KEYS:   # x, y, the ant's own observation, goal x, y
            assert flat.shape == (2 + obs["observation"].size + 2,)
            assert np.array_equal(flat[:2], obs["achieved_goal"]) and np.array_equal(flat[2:-2], obs["observation"])
        else:                           # PointMaze's observation already starts with x, y
            assert flat.shape == (obs["observation"].size + 2,) and np.array_equal(flat[:2], obs["achieved_goal"])
        assert np.array_equal(flat[-2:], obs["desired_goal"])
        env.close()


def test_antmaze_dataset_and_eval_share_the_layout(make_dataset):
    import gymnasium as gym
    import gymnasium_robotics
    from conftest import rollout
    import evaluate
    gym.register_envs(gymnasium_robotics)
    ant_id = max(i for i in gym.registry if i.startswith("AntMaze_UMaze-v"))
    env = gym.make(ant_id, continuing_task=True, max_episode_steps=12)
    eps = rollout(env, 3, 12, seed=2)
    d = data.load_data(make_dataset("test/antmaze/tiny-v0", eps, env=env, eval_env=env.spec))
    n_obs = eps[0]["observations"]["observation"].shape[1]
    assert d.obs_keys == data.ANTMAZE_KEYS and d.obs_dim == 2 + n_obs + 2 and d.goal_dim == 2 and d.family == "maze"
    o = d.episodes[1]["observations"]
    assert np.allclose(o[:, :2], eps[1]["observations"]["achieved_goal"][:-1])
    assert np.allclose(o[:, 2:-2], eps[1]["observations"]["observation"][:-1])
    seen = []

    def act(batch, live):
        seen.append(batch["states"][:, -1].numpy())
        return np.zeros((len(live), d.act_dim))
    res = evaluate.evaluate(act, d, 2, 1.0, seed=5, context=3, progress=False)
    assert seen[0].shape == (2, d.obs_dim)                          # eval states have the dataset's layout
    e = d.make_env()
    obs, _ = e.reset(seed=5)
    assert np.allclose(seen[0][0], d.normalize_states(np.concatenate([obs["achieved_goal"], obs["observation"],
                                                                      obs["desired_goal"]])))
    assert np.allclose(res["positions"][0][0], obs["achieved_goal"]) and res["positions"][0].shape == (13, 2)


# ---- %BC, synthetic data ----------------------------------------------------------------------------------------

def plain_episodes(returns, lengths):
    """Episodes whose observations hold their index, with the given returns (spread over the steps) and lengths."""
    return [dict(observations=np.full((n, 2), float(i)), actions=np.zeros((n, 1), np.float32),
                 rewards=np.full(n, r / n), terminated=True) for i, (r, n) in enumerate(zip(returns, lengths))]


def test_keep_top_as_in_the_dt_code():
    d = data.OfflineData("hand", "mujoco", plain_episodes([1.0, 10.0, 5.0, 7.0], [2, 3, 4, 1]), env_spec=None,
                         return_scale=1e-3, target_returns=[3600.0], ref_min=0.0, ref_max=100.0)
    # 10 steps; 50% = 5 steps: by return, episode 1 (3 steps), episode 3 (1 step, total 4), episode 2 would make 8
    top = d.keep_top(0.5)
    assert [e["observations"][0, 0] for e in top.episodes] == [1.0, 3.0]
    assert np.array_equal(top.state_mean, d.state_mean) and np.array_equal(top.state_std, d.state_std)
    kept_mean = np.mean([1, 1, 1, 3])
    assert not np.isclose(d.state_mean[0], kept_mean)              # the full data's stats, not the kept episodes'
    assert np.allclose(top.flat["states"][:, 0], (np.array([1, 1, 1, 3]) - d.state_mean[0]) / d.state_std[0])
    assert top.target_returns == [3600.0] and (top.ref_min, top.ref_max) == (0.0, 100.0)
    b = top.sample(200, 2, np.random.default_rng(0))
    raw = b["states"][:, -1, 0].numpy() * d.state_std[0] + d.state_mean[0]
    assert set(np.round(raw).astype(int).tolist()) == {1, 3}        # samples only the kept episodes
    assert [e["observations"][0, 0] for e in d.keep_top(0.01).episodes] == [1.0]     # at least the best episode
    assert len(d.keep_top(1.0).episodes) == 4
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(data.DataError, match=r"\(0, 1\]"):
            d.keep_top(bad)


def test_synthetic_data():
    d = data.synthetic_data(obs_dim=6, act_dim=2, episodes=4, length=30, seed=1, goal_dim=2)
    assert d.env_spec is None and d.family == "mujoco" and d.return_scale == 1e-3 and d.max_ep_len == 30
    b = d.sample(5, 7, np.random.default_rng(0))
    assert b["states"].shape == (5, 7, 6) and b["actions"].shape == (5, 7, 2) and b["rtg"].shape == (5, 7, 1)
    assert b["timesteps"].shape == (5, 7) and b["prev_action"].shape == (5, 2)
    assert np.ptp(d.episodes[0]["observations"][:, -2:], axis=0).max() == 0   # the goal part stays fixed
    with pytest.raises(data.DataError, match="synthetic data and has no environment"):
        d.make_env()


@pytest.mark.slow
def test_cli_help_info_and_shortcut(tiny_hopper, capsys):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: data.py" in r.stdout and "convert-d4rl" in r.stdout and "info" in r.stdout
    for args in (["info", tiny_hopper], [tiny_hopper]):                  # `data.py NAME` is short for `info NAME`
        data.main(args)
        out = capsys.readouterr().out
        assert out.startswith(f"{tiny_hopper}: 12 episodes") and "windows/s" in out


# ---- python data.py mix: D4RL's medium-expert recipe from Minari's own datasets ---------------------------------

@pytest.mark.slow
def test_mix_concatenates_datasets_of_one_environment(make_dataset, minari_path, tiny_hopper, tiny_maze, tmp_path,
                                                      capsys):
    import gymnasium as gym
    import minari
    from conftest import rollout
    import dt
    env = gym.make("Hopper-v5")
    a = make_dataset("test/hopper/mix-a-v0", rollout(env, 3, 30, seed=5), env=env, ref_min_score=-20.0,
                     ref_max_score=3000.0)
    b = make_dataset("test/hopper/mix-b-v0", rollout(env, 2, 30, seed=9), env=env, ref_min_score=-20.0,
                     ref_max_score=3000.0)
    assert data.mix([a, b], "test/hopper/mixed-v0") == 5
    mixed, da, db = (data.load_data(n) for n in ("test/hopper/mixed-v0", a, b))
    assert len(mixed.episodes) == 5
    for got, want in zip(mixed.episodes, da.episodes + db.episodes):             # all of a, then all of b
        assert np.array_equal(got["actions"], want["actions"]) and np.array_equal(got["rewards"], want["rewards"])
    meta = minari.load_dataset("test/hopper/mixed-v0").storage.metadata
    assert meta["combined_datasets"] == [a, b] and (meta["ref_min_score"], meta["ref_max_score"]) == (-20.0, 3000.0)
    assert mixed.env_spec.id == "Hopper-v5" and (mixed.ref_min, mixed.ref_max) == (-20.0, 3000.0)
    dt.main(["--dataset", "test/hopper/mixed-v0", "--n-embd", "16", "--n-layer", "1", "--context", "4",
             "--batch-size", "8", "--steps", "2", "--eval-every", "2", "--eval-episodes", "1",
             "--out", str(tmp_path / "run")])                                  # a model trains on it
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("final: ")
    wide = make_dataset("test/hopper/mix-wide-v0", rollout(env, 2, 20, seed=3), env=env,
                        observation_space=gym.spaces.Box(-1e6, 1e6, (11,), np.float64))
    other_refs = make_dataset("test/hopper/mix-refs-v0", rollout(env, 2, 20, seed=4), env=env, ref_min_score=0.0,
                              ref_max_score=1.0)
    for sources, new, words in (([a, tiny_maze], "test/x/y-v0", "different environments"),
                                ([a, wide], "test/x/y-v0", "different observation or action spaces"),
                                ([a, other_refs], "test/x/y-v0", "different reference returns"),
                                ([a, "test/hopper/not-here-v0"], "test/x/y-v0", "not-here-v0"),
                                ([a, b], "test/hopper/mixed-v0", "already exists"),
                                ([a], "test/x/y-v0", "at least two")):
        with pytest.raises(data.DataError, match=words):
            data.mix(sources, new)
        assert not (minari_path / "test" / "x").exists()                       # nothing half-written
    with pytest.raises(SystemExit) as e:                                          # the CLI: one sentence, exit 1
        data.main(["mix", a, tiny_maze, "test/x/y-v0"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error: ") and "\n" not in err and "different environments" in err


# ---- Adroit (D4RL/{pen,hammer,door,relocate}/{human,cloned,expert}-v2) --------------------------------------------

def test_adroit_short_names_resolve_without_data():
    for task in ("pen", "hammer", "door", "relocate"):
        for level in ("human", "cloned", "expert"):
            assert data.resolve(f"{task}-{level}") == f"D4RL/{task}/{level}-v2"
    assert data.resolve("D4RL/pen/human-v2") == "D4RL/pen/human-v2"
    for name in ("pen-humn", "pen-medium", "adroit-pen-human"):
        with pytest.raises(data.DataError, match=f"unknown environment '{name}'.*pen-human"):
            data.resolve(name)


@pytest.mark.slow
def test_adroit_unknown_name_is_one_sentence(tmp_path):
    r = _cli(["--env", "hammer-clone"], tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "unknown environment 'hammer-clone'" in r.stderr and "hammer-cloned" in r.stderr


@pytest.fixture(scope="module")
def tiny_pen(make_dataset):
    """5 smooth-random episodes of gymnasium-robotics' AdroitHandPen-v1 cut at 12 steps (so is the eval env), named
    like the paper's pen-human so that lsdt.py's Adroit row applies; no reference returns in the metadata."""
    import gymnasium as gym
    import gymnasium_robotics
    from conftest import rollout
    gym.register_envs(gymnasium_robotics)
    env = gym.make("AdroitHandPen-v1", max_episode_steps=12)
    return make_dataset("test/pen/human-v0", rollout(env, 5, 12, seed=11), env=env)


def test_adroit_loads_with_d4rl_refs_unscaled_returns_and_best_return_target(tiny_pen, make_dataset):
    d = data.load_data(tiny_pen)
    assert d.family == "other" and (d.obs_dim, d.act_dim, d.goal_dim) == (45, 24, 0) and d.max_ep_len == 12
    assert d.ref_source == "D4RL reference returns for AdroitHandPen"
    assert np.allclose(d.normalize_score([-96.262264, 3076.8331]), [0.0, 100.0])
    assert d.return_scale == 1.0 and d.target_returns == [pytest.approx(d.episode_returns.max())]
    assert np.allclose(d.flat["rtg"][d.ep_start], d.episode_returns, rtol=1e-5)        # R_0 = the return, unscaled
    env = d.make_env()                                                                   # the dataset's own eval env
    assert env.spec.id == "AdroitHandPen-v1" and env.spec.max_episode_steps == 12
    assert d.observe(env.reset(seed=0)[0]).shape == (45,)
    env.close()
    import gymnasium as gym
    from conftest import rollout
    env = gym.make("AdroitHandDoor-v1", max_episode_steps=5)                           # refs in the metadata win
    own = data.load_data(make_dataset("test/door/refs-v0", rollout(env, 2, 5, seed=1), env=env,
                                      ref_min_score=-50.0, ref_max_score=3000.0))
    assert own.ref_source == "dataset metadata" and (own.ref_min, own.ref_max) == (-50.0, 3000.0)


@pytest.mark.slow
def test_adroit_trains_and_evaluates_with_lsdt_and_dt(tiny_pen, tmp_path, capsys):
    import csv
    import json
    import dt
    import lsdt
    small = ["--dataset", tiny_pen, "--n-embd", "32", "--n-layer", "1", "--context", "4", "--batch-size", "8",
             "--steps", "3", "--eval-every", "3", "--eval-episodes", "1", "--warmup-steps", "2"]
    ref = data.ADROIT_REF_SCORES["AdroitHandPen"]
    for name, main in (("lsdt", lsdt.main), ("dt", dt.main)):
        main(small + ["--out", str(tmp_path / name)])
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith("final: normalized_score=") and last.endswith("episodes=1"), last
        row = [r for r in csv.DictReader(open(tmp_path / name / "log.csv")) if r["target"]][-1]
        assert float(row["normalized_score"]) == pytest.approx(
            100 * (float(row["eval_return"]) - ref[0]) / (ref[1] - ref[0]), abs=0.01)
    cfg = json.loads((tmp_path / "lsdt" / "config.json").read_text())                 # lsdt.py's pen-human row
    assert (cfg["n_head"], cfg["lr"], cfg["kernel"], cfg["conv_ratio"], cfg["batch_size"]) == (2, 2e-4, 6, 0.5, 8)


def test_what_the_model_files_use_is_above_the_fence():
    """data.py's reading order: every name a model file or evaluate.py takes from it is defined above the one
    "Dataset tools" fence, below which sit only the converters, mix, atomic writes and the command line."""
    import ast
    source = open(os.path.join(ROOT, "data.py")).read()
    fence = [i for i, line in enumerate(source.splitlines(), 1) if line.startswith("# Dataset tools:")]
    assert len(fence) == 1, fence
    defined = {}
    for node in ast.parse(source).body:
        names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)] or [getattr(node, "name", "")]
        defined.update({name: node.lineno for name in names if name})
    used = set()
    for name in ("dt", "lsdt", "starformer", "dema", "gpt2_dtma", "evaluate"):
        for node in ast.walk(ast.parse(open(os.path.join(ROOT, f"{name}.py")).read())):
            if isinstance(node, ast.ImportFrom) and node.module == "data":
                used |= {a.name for a in node.names}
            elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "data_lib":
                used.add(node.attr)
    assert used and all(n in defined for n in used), used - set(defined)
    below = sorted(n for n in used if defined[n] > fence[0])
    assert not below, f"defined below the fence: {below}"
