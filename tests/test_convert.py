"""data.py convert-d4rl: a small file in D4RL's layout with known episode boundaries -> a local Minari dataset."""
import contextlib
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 9   # rows 0-3: episode ending by terminal, 4-6: by timeout, 7-8: trailing (neither)


def write_d4rl(path, next_obs=True, obs_dim=11, drop=()):
    """Hopper-shaped D4RL file: observations[i] = i, next_observations[i] = 100 + i, actions[i] = i / 10,
    rewards[i] = i / 2."""
    import h5py
    terminals, timeouts = np.zeros(N, bool), np.zeros(N, bool)
    terminals[3], timeouts[6] = True, True
    arrays = dict(observations=np.stack([np.full(obs_dim, i, np.float32) for i in range(N)]),
                  next_observations=np.stack([np.full(obs_dim, 100 + i, np.float32) for i in range(N)]),
                  actions=np.stack([np.full(3, i / 10, np.float32) for i in range(N)]),
                  rewards=np.arange(N, dtype=np.float32) / 2, terminals=terminals, timeouts=timeouts)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            if k not in drop and (next_obs or k != "next_observations"):
                f[k] = v
    return str(path)


@pytest.fixture
def minari_tmp(tmp_path, monkeypatch):
    """A fresh MINARI_DATASETS_PATH for this test only (the session's stays clean)."""
    path = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(path))
    return path


@pytest.mark.parametrize("next_obs", [True, False])
def test_convert_episodes_and_final_observations(tmp_path, minari_tmp, capsys, next_obs):
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5", next_obs=next_obs)
    assert data.convert_d4rl(path, "d4rl/hopper/tiny-v2") == 3
    out = capsys.readouterr().out
    assert "the last 2 steps end with neither terminal nor timeout: kept as a truncated episode" in out
    assert ("final observation repeats" in out) == (not next_obs)
    assert os.path.isdir(minari_tmp / "d4rl" / "hopper" / "tiny-v2" / "data")
    eps = list(minari.load_dataset("d4rl/hopper/tiny-v2").iterate_episodes())
    assert [len(e.actions) for e in eps] == [4, 3, 2]
    for e, rows in zip(eps, ([0, 1, 2, 3], [4, 5, 6], [7, 8])):
        final = 100 + rows[-1] if next_obs else rows[-1]        # next_observations' last row, else s_{T-1} repeated
        assert np.allclose(e.observations[:, 0], rows + [final]) and e.observations.shape == (len(rows) + 1, 11)
        assert np.allclose(e.rewards, np.array(rows) / 2) and np.allclose(e.actions[:, 0], np.array(rows) / 10)
    assert [e.terminations.tolist() for e in eps] == [[False, False, False, True], [False] * 3, [False] * 2]
    assert [e.truncations.tolist() for e in eps] == [[False] * 4, [False, False, True], [False, True]]
    d = data.load_data("d4rl/hopper/tiny-v2")
    assert d.ref_source == "dataset metadata" and (d.ref_min, d.ref_max) == data.D4RL_REF_SCORES["Hopper"]
    assert d.env_spec.id == "Hopper-v5" and d.family == "mujoco" and d.target_returns == [3600.0, 1800.0]
    assert [len(e["actions"]) for e in d.episodes] == [4, 3, 2]
    with pytest.raises(data.DataError, match="already exists.*nothing is overwritten"):
        data.convert_d4rl(path, "d4rl/hopper/tiny-v2")


def test_convert_robot_from_names_or_env_flag(tmp_path, minari_tmp, capsys):
    path = write_d4rl(tmp_path / "data.hdf5")
    with pytest.raises(data.DataError, match="cannot tell the robot.*--env"):
        data.convert_d4rl(path, "mine/robot/tiny-v0")
    assert not os.path.exists(minari_tmp / "mine" / "robot" / "tiny-v0")
    assert data.convert_d4rl(path, "mine/robot/tiny-v0", env_id="Hopper-v5") == 3
    assert data._d4rl_env("walker2d_medium_replay-v2.hdf5", "x/y-v0", None) == "Walker2d-v5"
    assert data._d4rl_env("d.hdf5", "d4rl/halfcheetah/expert-v2", None) == "HalfCheetah-v5"
    assert data._d4rl_env("antmaze.hdf5", "d4rl/ant/expert-v2", None) == "Ant-v5"   # 'antmaze' is not 'ant'


def test_convert_refuses_what_it_cannot_convert(tmp_path, minari_tmp):
    wide = write_d4rl(tmp_path / "hopper_wide.hdf5", obs_dim=12)
    with pytest.raises(data.DataError, match=r"observations \(12,\).*Hopper-v5 has \(11,\).*pass --env"):
        data.convert_d4rl(wide, "d4rl/hopper/wide-v0")
    with pytest.raises(data.DataError, match="D4RL ant files are not supported"):
        data.convert_d4rl(wide, "d4rl/ant/wide-v0", env_id="Ant-v5")
    no_timeouts = write_d4rl(tmp_path / "hopper_old.hdf5", drop=("timeouts",))
    with pytest.raises(data.DataError, match="has no timeouts"):
        data.convert_d4rl(no_timeouts, "d4rl/hopper/old-v0")
    garbage = tmp_path / "hopper_garbage.hdf5"
    garbage.write_bytes(b"not an HDF5 file")
    with pytest.raises(data.DataError, match="cannot be read as HDF5"):
        data.convert_d4rl(str(garbage), "d4rl/hopper/garbage-v0")
    with pytest.raises(data.DataError, match="namespace/name-vN"):
        data.convert_d4rl(wide, "hopper-medium")
    import h5py
    grouped = write_d4rl(tmp_path / "hopper_grouped.hdf5", drop=("timeouts",))
    with h5py.File(grouped, "a") as f:
        f.create_group("timeouts")                                  # a key that is an HDF5 group, not an array
    with pytest.raises(data.DataError, match="holds timeouts as an HDF5 group, not an array"):
        data.convert_d4rl(grouped, "d4rl/hopper/grouped-v0")
    assert not os.path.exists(minari_tmp / "d4rl" / "hopper" / "wide-v0")   # nothing half-written is left


@pytest.mark.slow
def test_convert_cli(tmp_path, monkeypatch, capsys):
    path = write_d4rl(tmp_path / "hopper_tiny.hdf5", next_obs=False)
    env = dict(os.environ, MINARI_DATASETS_PATH=str(tmp_path / "minari"), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, os.path.join(ROOT, "data.py"), "convert-d4rl", path, "d4rl/hopper/cli-v0"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "d4rl/hopper/cli-v0: 3 episodes" in r.stdout
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    with pytest.raises(SystemExit) as e:                                  # again: refused in one line, exit 1
        data.main(cmd[2:])
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: dataset 'd4rl/hopper/cli-v0' already exists")


@pytest.mark.slow
def test_converted_file_trains_and_finds_its_paper_rows(tmp_path, minari_tmp, capsys):
    """The D4RL rows end to end: convert a file, train a model file on it for 2 steps, evaluate in Hopper-v5; the
    per-dataset paper settings of lsdt.py and dema.py recognise the converted id as hopper-medium-replay."""
    import dema
    import dt
    import lsdt
    path = write_d4rl(tmp_path / "hopper_medium_replay-v2.hdf5")
    data.convert_d4rl(path, "d4rl/hopper/medium-replay-v2")
    out = tmp_path / "run"
    dt.main(["--dataset", "d4rl/hopper/medium-replay-v2", "--n-embd", "16", "--n-layer", "1", "--context", "4",
             "--batch-size", "4", "--steps", "2", "--eval-every", "2", "--eval-episodes", "1", "--out", str(out)])
    final = [line for line in capsys.readouterr().out.splitlines() if line.startswith("final:")]
    assert len(final) == 1 and "normalized_score=" in final[0] and "nan" not in final[0]
    assert json.load(open(out / "config.json"))["dataset_id"] == "d4rl/hopper/medium-replay-v2"
    assert lsdt.paper_row("d4rl/hopper/medium-replay-v2") == "hopper-medium-replay"
    assert dema.paper_values("d4rl/hopper/medium-replay-v2")["n_embd"] == 256


# ---- python data.py convert-dqn-replay: Dopamine's replay-buffer checkpoints -> a local Minari dataset -----------

def save_gz(path, array, **kw):
    with gzip.open(path, "wb") as f:
        np.save(f, array, **kw)


def write_dqn_replay(folder, buffers=3, n=40, blank=3, logged=True, seed=0,
                     lengths=(5, 7, 3, 9, 4, 6, 8, 2, 5, 7, 4, 6, 3)):
    """A DQN-replay folder in Dopamine's own layout: one stream of episodes, each `blank` zero rows (frame 0, action
    0, reward 0) then its steps (random frames 1..255, actions 0..3, rewards -1/0/1, terminal 1 on the last; every
    third episode starts with a real NOOP step of reward 0), cut into buffers of n rows. logged: as batch_rl's logger
    saves them, buffer k holds stream rows k*n - 1 .. k*n + n - 2 with the first at file row n - 1, and add_count
    k*n + n - 1 (row -1 of buffer 0: zeros, never written); else buffer k holds rows k*n .. k*n + n - 1 in order, with
    no add_count file. -> (episodes: dicts with first (blank) row, end row, frames, actions, rewards; the windows)."""
    rng = np.random.default_rng(seed)
    frames, actions, rewards, terminals, episodes = [], [], [], [], []
    while len(actions) < buffers * n:
        L = lengths[len(episodes) % len(lengths)]
        f = rng.integers(1, 256, (L, 84, 84), dtype=np.uint8)
        a, r = rng.integers(0, 4, L), rng.choice([-1.0, 0.0, 1.0], L).astype(np.float32)
        if len(episodes) % 3 == 1:
            a[0], r[0] = 0, 0.0
        episodes.append(dict(first=len(actions), end=len(actions) + blank + L, frames=f, actions=a, rewards=r))
        frames += [np.zeros((84, 84), np.uint8)] * blank + list(f)
        actions += [0] * blank + list(a)
        rewards += [0.0] * blank + list(r)
        terminals += [0] * (blank + L - 1) + [1]
    stream = dict(observation=np.stack(frames), action=np.array(actions, np.int32),
                  reward=np.array(rewards, np.float32), terminal=np.array(terminals, np.uint8))
    os.makedirs(folder, exist_ok=True)
    windows = []
    for k in range(buffers):
        start = k * n - 1 if logged else k * n
        pos = np.arange(start, start + n)                                    # stream rows, in time order
        for name, x in stream.items():
            rows = x[np.maximum(pos, 0)] * (pos >= 0).reshape(-1, *[1] * (x.ndim - 1)).astype(x.dtype)
            save_gz(os.path.join(folder, f"$store$_{name}_ckpt.{k}.gz"), np.roll(rows, -1, 0) if logged else rows)
        if logged:
            save_gz(os.path.join(folder, f"add_count_ckpt.{k}.gz"), np.array(k * n + n - 1))
        windows.append((start, start + n))
    return episodes, windows


def whole_episodes(episodes, windows):
    """The episodes the converter keeps, by its rule: inside one window, after a terminal in it (the rows up to a
    buffer's first terminal and after its last are pieces of episodes)."""
    return [e for w0, w1 in windows for e in episodes if 0 <= e["first"] - 1 and w0 <= e["first"] - 1 and
            e["end"] <= w1]                              # (row first - 1 is the previous episode's terminal)


def check_episodes(dataset_id, want):
    import minari
    got = list(minari.load_dataset(dataset_id).iterate_episodes())
    assert [len(e.actions) for e in got] == [len(w["actions"]) for w in want]
    for e, w in zip(got, want):
        assert e.observations.dtype == np.uint8 and np.array_equal(e.observations[:-1], w["frames"])   # lossless
        assert np.array_equal(e.observations[-1], w["frames"][-1])                  # the last frame repeated
        assert e.actions.dtype == np.int64 and np.array_equal(e.actions, w["actions"])
        assert np.array_equal(e.rewards, w["rewards"])
        assert e.terminations.tolist() == [False] * (len(w["actions"]) - 1) + [True] and not e.truncations.any()


@pytest.mark.slow
def test_dqn_replay_whole_episodes_lossless_with_the_papers_env(tmp_path, minari_tmp, capsys):
    import json
    import minari
    folder = tmp_path / "Breakout" / "1" / "replay_logs"
    episodes, windows = write_dqn_replay(folder)
    want = whole_episodes(episodes, windows)
    assert len(want) == 11 and any(w["actions"][0] == 0 and w["rewards"][0] == 0 for w in want)
    assert data.convert_dqn_replay(str(folder), "breakout", "dqn/breakout/tiny-v0") == 11
    out = capsys.readouterr().out
    assert "dropped 6 pieces of episodes at the edges of buffers 0-2 (20 rows up to a buffer's first terminal, 9 " \
           "after its last)" in out
    assert f"dropped {3 * 11} blank rows" in out and "final observation repeats its last frame" in out
    assert "hold 58 steps in whole episodes, fewer than --steps 500,000: all of them are used" in out
    check_episodes("dqn/breakout/tiny-v0", want)
    ds = minari.load_dataset("dqn/breakout/tiny-v0")
    meta = ds.storage.metadata
    assert meta["jpeg_encoding"] is False and (meta["ref_min_score"], meta["ref_max_score"]) == (1.7, 30.5)
    assert meta["data_py_command"].startswith("python data.py convert-dqn-replay ")
    spec = json.loads(meta["env_spec"])
    assert spec["id"] == "ALE/Breakout-v5" and json.loads(meta["eval_env_spec"]) == spec
    assert spec["kwargs"] == dict(game="breakout", repeat_action_probability=0.0, full_action_space=False,
                                  frameskip=1, max_num_frames_per_episode=108000)
    wrapper, = spec["additional_wrappers"]
    assert wrapper["entry_point"] == "gymnasium.wrappers.atari_preprocessing:AtariPreprocessing"
    assert wrapper["kwargs"] == dict(noop_max=30, frame_skip=4, screen_size=84, terminal_on_life_loss=False,
                                     grayscale_obs=True, grayscale_newaxis=False, scale_obs=False)
    env = ds.recover_environment(eval_env=True)                             # the papers' env, stepped once
    obs, _ = env.reset(seed=0)
    obs, *_ = env.step(1)
    assert obs.shape == (84, 84) and obs.dtype == np.uint8 and env.action_space.n == 4
    assert os.path.isfile(minari_tmp / "dqn" / "namespace_metadata.json")


@pytest.mark.slow
def test_dqn_replay_buffers_and_steps(tmp_path, minari_tmp, capsys):
    folder = tmp_path / "replay_logs"
    episodes, windows = write_dqn_replay(folder)
    data.convert_dqn_replay(str(folder), "Breakout", "dqn/breakout/last-v0", buffers=1)   # the last buffer only
    check_episodes("dqn/breakout/last-v0", whole_episodes(episodes, windows[2:]))
    data.convert_dqn_replay(str(folder), "Breakout", "dqn/breakout/two-v0", buffers=2)
    check_episodes("dqn/breakout/two-v0", whole_episodes(episodes, windows[1:]))
    want = whole_episodes(episodes, windows)
    lengths = np.cumsum([len(w["actions"]) for w in want])

    def spread(steps):
        """--steps spread over the 3 buffers: each in turn gives whole episodes until it has an equal share of the
        steps still wanted (the episode that reaches the share kept whole)."""
        kept, total = [], 0
        for k in range(3):
            share, got = -(-(steps - total) // (3 - k)), 0
            for w in whole_episodes(episodes, windows[k:k + 1]):
                if got >= share:
                    break
                kept.append(w)
                got += len(w["actions"])
            total += got
        return kept
    for steps in (1, int(lengths[3]), int(lengths[3]) + 1, int(lengths[5]) - 1):
        data.convert_dqn_replay(str(folder), "Breakout", f"dqn/breakout/steps{steps}-v0", steps=steps)
        check_episodes(f"dqn/breakout/steps{steps}-v0", spread(steps))
    assert spread(int(lengths[3]))[-1] is not want[3], "the test needs a step count the first buffer alone would fill"
    capsys.readouterr()
    data.convert_dqn_replay(str(folder), "Breakout", "dqn/breakout/all-v0", buffers=9)
    assert "has 3 buffers, fewer than --buffers 9: all of them are used" in capsys.readouterr().out
    check_episodes("dqn/breakout/all-v0", want)


@pytest.mark.slow
def test_dqn_replay_without_blank_rows_or_add_count(tmp_path, minari_tmp):
    """Rows in time order with no add_count file, and episodes with no blank rows before them: a first step that is a
    NOOP of reward 0 (as every third episode's is here) has a real frame, so it is kept."""
    folder = tmp_path / "replay_logs"
    episodes, windows = write_dqn_replay(folder, blank=0, logged=False)
    want = whole_episodes(episodes, windows)
    assert sum(w["actions"][0] == 0 and w["rewards"][0] == 0 for w in want) >= 3
    data.convert_dqn_replay(str(folder), "Breakout", "dqn/breakout/plain-v0")
    check_episodes("dqn/breakout/plain-v0", want)


def dqn_error(args, capsys):
    """data.main(args) -> its one stderr line (exit 1)."""
    with pytest.raises(SystemExit) as e:
        data.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 1 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err


def flip(data):
    """Bytes with the middle 100 inverted (the gzip stream stays whole in length; its inflate or its CRC fails)."""
    mid = len(data) // 2
    return data[:mid] + bytes(255 - x for x in data[mid:mid + 100]) + data[mid + 100:]


def npy_header(shape, descr="|u1"):
    """An np.save header that declares `shape`, and no data (10^12 frames: 7 PB)."""
    import io
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": shape})
    return f.getvalue()


@pytest.mark.slow
def test_dqn_replay_bad_input_one_sentence_nothing_written(tmp_path, minari_tmp, capsys):
    good = tmp_path / "good"
    write_dqn_replay(good, buffers=2)
    data.convert_dqn_replay(str(good), "Breakout", "dqn/breakout/taken-v0")
    capsys.readouterr()

    def broken(name, change):
        folder = tmp_path / name
        shutil.copytree(good, folder)
        change(folder)
        return str(folder)

    def obs(folder):
        return folder / "$store$_observation_ckpt.1.gz"

    cases = [
        (broken("missing", lambda f: os.remove(f / "$store$_terminal_ckpt.1.gz")), "Breakout",
         r"buffer 1 in .* has no \$store\$_terminal_ckpt.1.gz"),
        (broken("truncated", lambda f: (f / "$store$_reward_ckpt.1.gz").write_bytes(
            (f / "$store$_reward_ckpt.1.gz").read_bytes()[:30])), "Breakout", "truncated"),
        (broken("corrupt", lambda f: (f / "$store$_observation_ckpt.0.gz").write_bytes(flip(
            (f / "$store$_observation_ckpt.0.gz").read_bytes()))), "Breakout", "observation_ckpt.0.gz .*damaged"),
        (broken("not-gzip", lambda f: (f / "$store$_action_ckpt.0.gz").write_bytes(b"not gzip at all")), "Breakout",
         r"cannot be read \(not a gzip file, or a damaged one\)"),
        (broken("not-npy", lambda f: save_gz(f / "$store$_action_ckpt.0.gz", None, allow_pickle=True)), "Breakout",
         "holds an array of object with shape"),
        (broken("pickle", lambda f: save_gz(f / "$store$_action_ckpt.0.gz", np.array([1, None], object),
                                            allow_pickle=True)), "Breakout", r"array of object with shape \(2,\)"),
        (broken("raw-bytes", lambda f: gzip.open(f / "$store$_action_ckpt.0.gz", "wb").close()), "Breakout",
         r"not an array np.save wrote|truncated"),
        (broken("lengths", lambda f: save_gz(f / "$store$_action_ckpt.1.gz", np.zeros(39, np.int32))), "Breakout",
         "arrays of different lengths .*action 39"),
        (broken("frames-cut", lambda f: obs(f).write_bytes(obs(f).read_bytes()[:len(obs(f).read_bytes()) // 2])),
         "Breakout", "observation_ckpt.1.gz is truncated or damaged"),
        (broken("shape", lambda f: save_gz(obs(f), np.zeros((40, 84, 83), np.uint8))), "Breakout",
         r"shape \(40, 84, 83\) where DQN-replay has \(n, 84, 84\) uint8 frames"),
        (broken("dtype", lambda f: save_gz(obs(f), np.zeros((40, 84, 84), np.float32))), "Breakout",
         "array of float32 with shape"),
        (broken("huge", lambda f: obs(f).write_bytes(gzip.compress(npy_header((10 ** 12, 84, 84))))), "Breakout",
         "declares 1,000,000,000,000 rows"),
        (broken("short", lambda f: (f / "$store$_action_ckpt.1.gz").write_bytes(gzip.compress(npy_header(
            (9_000_000,), "<i4")))), "Breakout", r"action_ckpt.1.gz is truncated or damaged \(its header declares "
         r"9,000,000 rows, more than its \d+ bytes can hold\)"),
        (broken("actions", lambda f: save_gz(f / "$store$_action_ckpt.1.gz", np.full(40, 7, np.int32))), "Breakout",
         "has action 7 where the game has 4 actions"),
        (broken("no-rows", lambda f: [save_gz(f / f"$store$_{k}_ckpt.1.gz", np.zeros((0, 84, 84) if k == "observation"
                                                                                       else 0, np.uint8))
                                      for k in data.DQN_REPLAY_FIELDS]), "Breakout",
         r"buffer 1 in .* holds no rows \(DQN-replay's hold 1M\); download it again"),   # (its add_count file kept)
        (str(good), "Breakot", r"ALE knows no game 'Breakot' \(did you mean Breakout\?\)"),
        (str(tmp_path / "empty"), "Breakout", "is not a folder"),
        (str(tmp_path), "Breakout", "holds no DQN-replay buffers"),
    ]
    for folder, game, words in cases:
        err = dqn_error(["convert-dqn-replay", folder, game, "dqn/breakout/bad-v0"], capsys)
        assert re.search(words, err), (words, err)
        assert not os.path.exists(minari_tmp / "dqn" / "breakout" / "bad-v0")
        assert not [p for p in os.listdir(minari_tmp) if p.startswith(".")]        # no partial dataset either
    err = dqn_error(["convert-dqn-replay", str(good), "Breakout", "dqn/breakout/taken-v0"], capsys)
    assert "already exists" in err
    (minari_tmp / "plain").write_text("a file where a namespace would be")                  # said before any work
    err = dqn_error(["convert-dqn-replay", str(tmp_path / "nowhere"), "Breakout", "plain/x/y-v0"], capsys)
    assert f"{minari_tmp / 'plain'} is a file, so the dataset 'plain/x/y-v0' cannot be written in it" in err
    assert (minari_tmp / "plain").read_text() == "a file where a namespace would be"
    err = dqn_error(["convert-dqn-replay", str(good), "Breakout", "x", "--steps", "0"], capsys)
    assert "'0' is not a whole number above 0" in err


def test_dqn_replay_says_when_its_frames_would_not_fit_in_memory(tmp_path, minari_tmp, capsys):
    """Headers just under the row limit with a large --steps: the frames the conversion would hold are counted from the
    headers and compared with the memory available before anything is allocated (no 66 GB traceback)."""
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    rows = data.DQN_REPLAY_MAX_ROWS - 1                                           # 70 GB of frames a buffer
    buffers = int(free // (84 * 84 * rows)) + 2
    folder = tmp_path / "replay_logs"
    write_dqn_replay(folder, buffers=buffers)
    for k in range(buffers):                                                     # headers only, no frames
        (folder / f"$store$_observation_ckpt.{k}.gz").write_bytes(gzip.compress(npy_header((rows, 84, 84))))
    err = dqn_error(["convert-dqn-replay", str(folder), "Breakout", "dqn/breakout/big-v0", "--steps",
                     str(buffers * rows)], capsys)
    assert re.search(rf"the frames of {buffers * rows:,} steps need about [\d.]+ GB, more than the [\d.]+ GB of memory "
                     rf"available; lower --steps or --buffers$", err.strip()), err
    err = dqn_error(["convert-dqn-replay", str(folder), "Breakout", "dqn/breakout/big-v0", "--steps",
                     str(buffers * rows - 1)], capsys)
    assert err.strip().endswith("; lower --steps"), err
    assert os.listdir(minari_tmp) == []


def test_atari_env_spec_makes_the_papers_env(monkeypatch):
    import gymnasium as gym
    spec = data.atari_env_spec("Pong")
    assert spec.id == "ALE/Pong-v5" and spec.additional_wrappers[0].name == "AtariPreprocessing"
    env = gym.make(spec)
    obs, _ = env.reset(seed=0)
    assert obs.shape == (84, 84) and obs.dtype == np.uint8 and env.observation_space.shape == (84, 84)
    assert data.atari_env_spec("montezuma-revenge").id == "ALE/MontezumaRevenge-v5"
    with pytest.raises(data.DataError, match="ALE knows no game 'Pongg' .*did you mean Pong.*include Assault"):
        data.atari_env_spec("Pongg")
    monkeypatch.setitem(sys.modules, "cv2", None)                          # OpenCV missing: how to install it
    with pytest.raises(data.DataError, match=r"\(cv2 is missing\): pip install ale-py opencv-python-headless"):
        data.atari_env_spec("Pong")


# ---- every dataset command writes atomically -------------------------------------------------------------------

def test_interrupted_write_leaves_nothing_and_the_next_command_works(tmp_path, minari_tmp, monkeypatch, capsys):
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    real = minari.create_dataset_from_buffers

    def interrupted(*args, **kwargs):                     # writes the whole dataset, then Ctrl-C before the rename
        real(*args, **kwargs)
        raise KeyboardInterrupt
    monkeypatch.setattr(minari, "create_dataset_from_buffers", interrupted)
    with pytest.raises(SystemExit) as e:
        data.main(["convert-d4rl", path, "d4rl/hopper/cut-v0"])
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.strip() == "stopped by Ctrl-C: the dataset 'd4rl/hopper/cut-v0' was not " \
                                                  "written, and nothing of it is left"
    assert not os.path.exists(minari_tmp / "d4rl" / "hopper" / "cut-v0") and os.listdir(minari_tmp) == []
    assert os.environ["MINARI_DATASETS_PATH"] == str(minari_tmp)
    monkeypatch.setattr(minari, "create_dataset_from_buffers", real)
    assert data.convert_d4rl(path, "d4rl/hopper/cut-v0") == 3
    assert minari.list_local_datasets().keys() == {"d4rl/hopper/cut-v0"}


KILLED = """
import os, signal, sys
sys.path.insert(0, {root!r})
import minari, data
real_write, real_rename = minari.create_dataset_from_buffers, os.rename
class Finaliser:
    def __del__(self):  # what a handler raises in a finaliser is lost there ("Exception ignored in ...")
        os.kill(os.getpid(), signal.SIGTERM)
def write(*args, **kwargs):
    ds = real_write(*args, **kwargs)
    {after_write}
    return ds
def rename(src, dst):
    real_rename(src, dst)
    if dst.endswith("killed-v0"):
        {after_rename}
minari.create_dataset_from_buffers, os.rename = write, rename
data.main(["convert-d4rl", {path!r}, "d4rl/hopper/killed-v0"])
"""
KILLS = dict(SIGKILL=("os.kill(os.getpid(), signal.SIGKILL)", "pass"),
             SIGTERM=("os.kill(os.getpid(), signal.SIGTERM)", "pass"),
             swallowed=("Finaliser()", "pass"),                                  # SIGTERM inside a finaliser
             after=("pass", "os.kill(os.getpid(), signal.SIGTERM)"))             # SIGTERM once the dataset is in place


@pytest.mark.parametrize("sig", list(KILLS))
@pytest.mark.slow
def test_killed_write_leaves_no_dataset_and_is_cleaned(tmp_path, minari_tmp, capsys, sig):
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    env = dict(os.environ, MINARI_DATASETS_PATH=str(minari_tmp), HF_HUB_OFFLINE="1")
    after_write, after_rename = KILLS[sig]
    r = subprocess.run([sys.executable, "-c", KILLED.format(root=ROOT, path=path, after_write=after_write,
                                                             after_rename=after_rename)],
                       capture_output=True, text=True, env=env, timeout=120)
    partial = [p for p in os.listdir(minari_tmp) if p.startswith(data.PARTIAL_PREFIX)]
    if sig == "after":                                                     # done, and said so
        assert r.returncode == 0 and partial == [], r.stderr
        assert r.stderr.strip() == "done; the signal came after the dataset was written"
        assert list(minari.list_local_datasets()) == ["d4rl/hopper/killed-v0"]
        return
    assert not os.path.exists(minari_tmp / "d4rl" / "hopper" / "killed-v0")
    assert minari.list_local_datasets() == {}                             # a partial folder is never a dataset
    if sig != "SIGKILL":                                                   # undone at once: one sentence, exit 143
        assert r.returncode == 143 and partial == [], r.stderr
        assert r.stderr.strip() == "stopped by SIGTERM: the dataset 'd4rl/hopper/killed-v0' was not written, and " \
                                   "nothing of it is left"
    else:                                                                  # kill -9: the next command removes it
        assert r.returncode == -9 and len(partial) == 1
        assert data.convert_d4rl(path, "d4rl/hopper/killed-v0") == 3
        assert f"removing {minari_tmp / partial[0]}: a partial dataset left by an interrupted data.py command" in \
            capsys.readouterr().out
        assert not os.path.exists(minari_tmp / partial[0])
        assert list(minari.list_local_datasets()) == ["d4rl/hopper/killed-v0"]


@pytest.mark.slow
def test_a_stop_signal_at_any_moment_is_one_of_two_outcomes(tmp_path, minari_tmp):
    """Ctrl-C or SIGTERM at moments spread over a whole `python data.py mix` (from data.py's first line, where it
    holds the signals for main(), to its exit): either exit 130 / 143 with one sentence and nothing left, or the
    dataset whole, exit 0, and, where the signal came before main() ended, a sentence saying it came after."""
    import signal
    import time
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    data.convert_d4rl(path, "d4rl/hopper/a-v0")
    data.convert_d4rl(path, "d4rl/hopper/b-v0")
    env = dict(os.environ, MINARI_DATASETS_PATH=str(minari_tmp), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    new, seen = minari_tmp / "local" / "hopper" / "ab-v0", []

    def held(pid):
        """Whether the process holds SIGTERM (its signal mask, SigBlk in /proc/PID/status), as data.py's first line
        makes it do until main() acts on a signal."""
        with contextlib.suppress(OSError):
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) & 1 << signal.SIGTERM - 1)
        return False

    def run(sig, delay):
        p = subprocess.Popen([sys.executable, os.path.join(ROOT, "data.py"), "mix", "d4rl/hopper/a-v0",
                              "d4rl/hopper/b-v0", "local/hopper/ab-v0"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
        while p.poll() is None and not held(p.pid):                        # from data.py's first line on
            time.sleep(0.005)
        t0 = time.time()
        time.sleep(delay)
        if sig:
            p.send_signal(sig)
        out, err = p.communicate(timeout=120)
        return out, err.strip(), p.returncode, time.time() - t0

    out, err, code, duration = run(None, 0)
    assert code == 0 and err == "" and "local/hopper/ab-v0: 6 episodes" in out
    for i in range(12):
        shutil.rmtree(minari_tmp / "local", ignore_errors=True)
        sig = (signal.SIGINT, signal.SIGTERM)[i % 2]
        out, err, code, _ = run(sig, duration * i / 8)                   # (the last after its exit)
        partial = [p for p in os.listdir(minari_tmp) if p.startswith(".")]
        if code == 0:                                                      # done: whole, and said if it came in time
            assert err in ("", "done; the signal came after the dataset was written") and partial == [], err
            assert "local/hopper/ab-v0: 6 episodes" in out
            assert minari.load_dataset("local/hopper/ab-v0").total_episodes == 6
        else:                                                              # stopped: one sentence, nothing left
            how = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
            assert code == 128 + sig and not new.exists() and partial == [], (i, code, err)
            assert err == f"stopped by {how}: the dataset 'local/hopper/ab-v0' was not written, and nothing of it is " \
                          f"left", err
        seen.append(code)
    assert {0, 130, 143} <= set(seen), seen


@pytest.mark.slow
def test_a_live_write_is_not_cleaned(tmp_path, minari_tmp):
    """A partial folder whose lock a live process holds (another command writing) is left alone."""
    import fcntl
    os.makedirs(minari_tmp)
    live = minari_tmp / (data.PARTIAL_PREFIX + "live")
    os.makedirs(live)
    with open(live / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        r = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); import data; "
                            f"data._clean_partial({str(minari_tmp)!r})"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "" and os.path.isdir(live)
    data._clean_partial(str(minari_tmp))                                   # released: removed
    assert not os.path.exists(live)


def test_mix_writes_atomically_and_records_its_command(tmp_path, minari_tmp, capsys):
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    data.convert_d4rl(path, "d4rl/hopper/a-v0")
    data.convert_d4rl(path, "d4rl/hopper/b-v0")
    assert data.mix(["d4rl/hopper/a-v0", "d4rl/hopper/b-v0"], "local/hopper/ab-v0") == 6
    meta = minari.load_dataset("local/hopper/ab-v0").storage.metadata
    assert meta["data_py_command"] == "python data.py mix d4rl/hopper/a-v0 d4rl/hopper/b-v0 local/hopper/ab-v0"
    assert meta["combined_datasets"] == ["d4rl/hopper/a-v0", "d4rl/hopper/b-v0"]
    assert sorted(p for p in os.listdir(minari_tmp)) == ["d4rl", "local"]


def test_read_only_datasets_folder_is_one_sentence(tmp_path, minari_tmp, monkeypatch, capsys):
    os.makedirs(minari_tmp)
    os.chmod(minari_tmp, 0o555)
    real_access = os.access
    if os.geteuid() == 0:                                  # root writes anywhere: make the check see what a user would
        monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(minari_tmp) else real_access(p, mode))
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    write_dqn_replay(tmp_path / "replay_logs", buffers=1)
    try:
        for args in (["convert-d4rl", path, "d4rl/hopper/ro-v0"], ["mix", "hopper-medium", "hopper-expert",
                     "local/hopper/ro-v0"], ["convert-dqn-replay", str(tmp_path / "replay_logs"), "Breakout",
                                             "dqn/breakout/ro-v0"]):
            err = dqn_error(args, capsys)
            assert f"cannot write a dataset in {minari_tmp}" in err and "set MINARI_DATASETS_PATH" in err
    finally:
        os.chmod(minari_tmp, 0o755)
    assert os.listdir(minari_tmp) == []


def test_damaged_dataset_says_how_it_was_made(tmp_path, minari_tmp):
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    data.convert_d4rl(path, "local/hopper/made-v0")
    main_data = minari_tmp / "local" / "hopper" / "made-v0" / "data" / "main_data.hdf5"
    main_data.write_bytes(b"damaged")
    with pytest.raises(data.DataError) as e:
        data.load_data("local/hopper/made-v0")
    assert "is damaged" in str(e.value) and "minari download" not in str(e.value)
    assert f"make it again with `python data.py convert-d4rl {path} local/hopper/made-v0`" in str(e.value)
    (main_data.parent / "metadata.json").write_text("{not json")
    assert "if it came from Minari's servers, else the data.py command" in str(data.damaged("local/hopper/made-v0",
                                                                                            "x"))


def test_unknown_command_names_the_commands(capsys):
    for word, near in (("mixx", " (did you mean mix?)"), ("convert-d4r", " (did you mean convert-d4rl?)"),
                       ("hoper-medium", " (did you mean hopper-medium?)")):
        err = dqn_error([word, "a", "b"], capsys)
        assert err.strip() == f"error: unknown command '{word}'; the commands are info, convert-d4rl, " \
                              f"convert-dqn-replay, mix, make{near}"
    err = dqn_error(["bogus"], capsys)
    assert err.startswith("error: unknown command 'bogus'; the commands are info, convert-d4rl, convert-dqn-replay, "
                          "mix, make (or name a dataset")
