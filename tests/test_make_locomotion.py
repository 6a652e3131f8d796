"""python data.py make hopper-* and halfcheetah-*: ARS's update by hand on a toy objective, tiny
makes of each kind (a few ARS iterations) that data.py loads and dt.py trains on, and bad input
said in one sentence."""
import minari
import numpy as np
import pytest

import data
from test_harness import one_sentence_exit_1


class FixedDirections:
    """A stand-in for numpy's Generator: standard_normal gives the directions it was built with."""

    def __init__(self, deltas):
        self.deltas = np.array(deltas, dtype=float)

    def standard_normal(self, shape):
        assert shape == self.deltas.shape
        return self.deltas


def test_ars_update_by_hand():
    # the toy: M (1 x 2) returns -|M - (1, 1)|^2; every rollout meets the states (1, 3), (3, 3)
    seen = []

    def rollout(M, mu, std):
        seen.append((mu.copy(), std.copy()))
        return -((M - 1.0) ** 2).sum(), np.array([[1.0, 3.0], [3.0, 3.0]]), None

    directions = FixedDirections([[[1.0, 0.0]], [[0.0, 2.0]]])                  # (N = 2, 1, 2)
    training = data.ars(rollout, (1, 2), directions, alpha=0.1, nu=0.5, directions=2, top=1)
    M, mu, std, episodes = next(training)

    # by hand, from M = 0: delta_1 = (1, 0): r+ = -(0.5^2 + 1) = -1.25, r- = -(1.5^2 + 1) = -3.25;
    # delta_2 = (0, 2): r+ = -(1 + 0) = -1, r- = -(1 + 2^2) = -5. The top direction (b = 1) is
    # delta_2 (max -1 > -1.25); sigma_R = std(-1, -5) = 2; M = 0.1 / (1 * 2) * (-1 - -5) * (0, 2)
    # = (0, 0.4)
    np.testing.assert_allclose(M, [[0.0, 0.4]])
    assert len(episodes) == 4 and len(seen) == 4
    assert all(np.array_equal(m, [0, 0]) and np.array_equal(s, [1, 1]) for m, s in seen)  # mu 0, I

    # mu, Sigma: of the 8 states met; the second entry never varied and is ignored (std inf)
    np.testing.assert_allclose(mu, [2.0, 3.0])
    np.testing.assert_allclose(std, [1.0, np.inf])

    # the next iteration's rollouts normalise with them
    seen.clear()
    next(training)
    np.testing.assert_allclose(seen[0][0], [2.0, 3.0])
    assert std[1] == np.inf and seen[0][1][1] == np.inf


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """A fresh MINARI_DATASETS_PATH, ARS cut to 3 iterations (a restart after 2; HalfCheetah: 1
    direction), 1 eval episode, levels every return reaches, and a check of each training rollout:
    its return is the env's less the alive bonus (1 a step on Hopper, none on HalfCheetah). -> the
    folder and every update's policy (M, mu, std), in order."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    monkeypatch.setitem(data.LOCOMOTION, "hopper", data.LOCOMOTION["hopper"]
                        | dict(iterations={"medium": 3, "expert": 3}))
    monkeypatch.setitem(data.LOCOMOTION, "halfcheetah", data.LOCOMOTION["halfcheetah"]
                        | dict(iterations={"medium": 3}, ars=dict(alpha=0.02, nu=0.03,
                                                                  directions=1, top=1)))
    monkeypatch.setattr(data, "LEVELS", {"medium": -1e9, "expert": -1e9})  # below any return
    monkeypatch.setattr(data, "ARS_RESTART", 2)
    monkeypatch.setattr(data, "ARS_EVAL_EPISODES", 1)
    real_ars, made = data.ars, []

    def checked_ars(rollout, shape, rng, **settings):
        hopper = shape == (3, 11)
        assert shape in ((3, 11), (6, 17))
        assert settings == (dict(alpha=0.01, nu=0.025, directions=8, top=4) if hopper
                            else dict(alpha=0.02, nu=0.03, directions=1, top=1))

        def checked(M, mu, std):
            ret, states, episode = rollout(M, mu, std)
            alive = len(episode.rewards) if hopper else 0
            assert ret == pytest.approx(sum(episode.rewards) - alive)
            np.testing.assert_array_equal(states, episode.observations[:-1])
            return ret, states, episode

        for M, mu, std, episodes in real_ars(checked, shape, rng, **settings):
            made.append((M, mu, std))
            yield M, mu, std, episodes

    monkeypatch.setattr(data, "ars", checked_ars)
    return tmp_path, made


@pytest.mark.slow
def test_tiny_makes_load_and_dt_trains_on_one(tiny, capsys):
    import dt
    tmp_path, made = tiny

    # one make of each kind (the level is reached at the first update, so medium-replay's
    # policies are that one policy)
    for name in ("hopper-medium", "hopper-expert", "hopper-medium-replay"):
        data.main(["make", name, "--steps", "300"])
    data.main(["make", "hopper-medium-expert", "--steps", "300"])
    out = capsys.readouterr().out
    assert out.count("at ARS iteration 1 of 1 run(s), ") == 5     # medium-expert: two of them
    assert "training steps, the data from its 1 policy, an episode of each in turn" in out

    # each: Minari's metadata, D4RL's reference returns, Hopper-v5, whole or cut episodes, loaded
    made = {name: minari.load_dataset(f"made/hopper/{name}-v0")
            for name in ("medium", "medium-replay", "expert", "medium-expert")}
    for name, ds in made.items():
        meta = ds.storage.metadata
        assert meta["data_py_command"] == (f"python data.py make hopper-{name} "
                                           f"made/hopper/{name}-v0 --steps 300")
        assert meta["stands_in_for"] == {"medium": "mujoco/hopper/medium-v0",
                                         "medium-replay": "D4RL's hopper-medium-replay-v2",
                                         "expert": "mujoco/hopper/expert-v0",
                                         "medium-expert": "D4RL's hopper-medium-expert-v2"}[name]
        assert (meta["ref_min_score"], meta["ref_max_score"]) == data.D4RL_REF_SCORES["Hopper"]
        assert ds.env_spec.id == "Hopper-v5" and ds._eval_env_spec.id == "Hopper-v5"
        episodes = list(ds.iterate_episodes())
        for e in episodes:
            assert e.actions.dtype == np.float32 and np.abs(e.actions).max() <= 1
            assert e.terminations[-1] != e.truncations[-1]                   # fell, or cut
            assert not (e.terminations[:-1].any() or e.truncations[:-1].any())
        d = data.load_data(f"made/hopper/{name}-v0", download=False)
        assert d.family == "mujoco" and (d.obs_dim, d.act_dim) == (11, 3)
        assert (d.ref_min, d.ref_max) == data.D4RL_REF_SCORES["Hopper"]
        # the behaviour's rollouts, the last cut at --steps
        assert sum(len(e.actions) for e in episodes) == (600 if name == "medium-expert" else 300)
        assert episodes[-1].truncations[-1]

    # medium, expert and medium-replay end at the same policy from the same seed, so hold the
    # same noisy rollouts; medium-expert is medium's data, then expert's
    medium, expert, replay, both = ([e.actions for e in made[n].iterate_episodes()]
                                    for n in ("medium", "expert", "medium-replay", "medium-expert"))
    assert len(medium) == len(expert) == len(replay)
    assert all(np.array_equal(a, b) and np.array_equal(a, c)
               for a, b, c in zip(medium, expert, replay))
    assert len(both) == len(medium) + len(expert)
    assert all(np.array_equal(a, b) for a, b in zip(both, medium + expert))

    # dt.py trains 2 steps on the made medium and evaluates it
    dt.main(["--dataset", "made/hopper/medium-v0", "--n-embd", "16", "--n-layer", "1",
             "--context", "4", "--batch-size", "8", "--steps", "2", "--eval-every", "2",
             "--eval-episodes", "1", "--out", str(tmp_path / "run")])
    assert capsys.readouterr().out.splitlines()[-1].startswith("final: ")


@pytest.mark.slow
def test_tiny_halfcheetah_makes_load_and_dt_trains_on_one(tiny, capsys):
    import dt
    tmp_path, made = tiny

    # 1000-step rollouts, the last cut at --steps
    for name in ("halfcheetah-medium", "halfcheetah-medium-replay"):
        data.main(["make", name, "--steps", "1500"])
    for name in ("medium", "medium-replay"):
        ds = minari.load_dataset(f"made/halfcheetah/{name}-v0")
        assert ds.env_spec.id == "HalfCheetah-v5"
        episodes = list(ds.iterate_episodes())
        assert [len(e.actions) for e in episodes] == [1000, 500]
        assert not any(e.terminations.any() for e in episodes)         # a cheetah never falls
        d = data.load_data(f"made/halfcheetah/{name}-v0", download=False)
        assert (d.obs_dim, d.act_dim) == (17, 6)
        assert (d.ref_min, d.ref_max) == data.D4RL_REF_SCORES["HalfCheetah"]

    dt.main(["--dataset", "made/halfcheetah/medium-v0", "--n-embd", "16", "--n-layer", "1",
             "--context", "4", "--batch-size", "8", "--steps", "2", "--eval-every", "2",
             "--eval-episodes", "1", "--out", str(tmp_path / "run")])
    assert capsys.readouterr().out.splitlines()[-1].startswith("final: ")


@pytest.mark.slow
def test_a_level_not_reached_is_one_sentence(tiny, monkeypatch, capsys):
    monkeypatch.setattr(data, "LEVELS", {"medium": 1 / 3, "expert": 1.0})
    with pytest.raises(SystemExit) as e:
        data.main(["make", "hopper-medium", "--steps", "100"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "\n" not in err
    assert err.startswith("error: ARS did not reach hopper's medium level (an eval return of 1065)"
                          " in 3 iterations of 2 run(s) at --seed 0"), err
    assert not (tiny[0] / "minari" / "made").exists() or not any(
        (tiny[0] / "minari" / "made").rglob("*.hdf5"))


@pytest.mark.slow
def test_training_stops_at_the_level(tiny, monkeypatch, capsys):
    data.main(["make", "hopper-medium", "--steps", "100"])
    assert "at ARS iteration 1 of 1 run(s), " in capsys.readouterr().out


def test_make_hopper_bad_input_is_one_sentence_before_any_work(tiny, monkeypatch, capsys):
    def no_work(*args):
        raise AssertionError("make did work before checking its input")

    monkeypatch.setattr(data, "_make_locomotion", no_work)
    taken = tiny[0] / "minari" / "made" / "hopper" / "medium-v0" / "data"
    taken.mkdir(parents=True)                                                           # a taken id
    for argv, said in (
            (["make", "hopper-medum"], "make knows no 'hopper-medum'; it makes "),
            (["make", "hopper-medum"], "halfcheetah-medium-replay (did you mean hopper-medium?)"),
            (["make", "hopper-medium"], "dataset 'made/hopper/medium-v0' already exists at "),
            (["make", "walker2d-medium"], "no 'walker2d-medium' (ARS does not reach Walker2d's "
                                          "medium in a make's minutes); it makes"),
            (["make", "halfcheetah-expert"], "(ARS does not reach HalfCheetah's expert in a "),
            (["make", "hopper-expert", "nonamespace-v0"], "must look like namespace/name-vN"),
            (["make", "hopper-expert", "--seed", "-1"], "--seed -1 is negative"),
            (["make", "hopper-expert", "--steps", "0"], "'0' is not a whole number above 0")):
        err = one_sentence_exit_1(capsys, data.main, argv)
        assert said in err, err

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(data, "_make_locomotion", interrupted)          # Ctrl-C while it trains
    with pytest.raises(SystemExit) as e:
        data.main(["make", "hopper-expert"])
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "stopped by Ctrl-C: the " \
        "dataset 'made/hopper/expert-v0' was not written, and nothing of it is left"
