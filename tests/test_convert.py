"""data.py convert-d4rl: a small file in D4RL's layout with known episode boundaries -> a local Minari dataset."""
import json
import os
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
