"""python data.py make: the maze planner on a hand-drawn maze, a tiny PointMaze made, loaded, trained on and evaluated,
and bad input said in one sentence before any work."""
import numpy as np
import pytest

import data
from test_harness import one_sentence_exit_1

I = np.inf
# a hand-drawn maze: a ring of corridors around walls, the goal 'g' at the end of a dead end below it
RING = [[1, 1, 1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0, 0, 1],
        [1, 0, 1, 1, 1, 0, 1],
        [1, 0, 1, "g", 1, 0, 1],
        [1, 0, 1, 0, 1, 0, 1],
        [1, 0, 0, 0, 0, 0, 1],
        [1, 1, 1, 1, 1, 1, 1]]
RING_STEPS = [[I, I, I, I, I, I, I],     # moves to the goal (3, 3), counted by hand
              [I, 8, 9, 10, 9, 8, I],
              [I, 7, I, I, I, 7, I],
              [I, 6, I, 0, I, 6, I],
              [I, 5, I, 1, I, 5, I],
              [I, 4, 3, 2, 3, 4, I],
              [I, I, I, I, I, I, I]]


@pytest.fixture
def minari_tmp(tmp_path, monkeypatch):
    """A fresh MINARI_DATASETS_PATH for this test only, and 2 eval episodes per reference return (not 100)."""
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    monkeypatch.setattr(data, "MAZE_REF_EPISODES", 2)
    return tmp_path / "minari"


def walk(steps, cell, goal):
    path = [cell]
    while path[-1] != goal and len(path) < 50:
        path.append(data.next_cell(steps, path[-1]))
    return path


def test_planner_on_a_hand_drawn_maze():
    steps = data.maze_steps(RING, (3, 3))
    assert np.array_equal(steps, np.array(RING_STEPS))
    # from either side of the top corridor the planner takes the shorter way round the ring
    assert walk(steps, (1, 2), (3, 3)) == [(1, 2), (1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (5, 2), (5, 3), (4, 3),
                                           (3, 3)]
    assert walk(steps, (1, 4), (3, 3)) == [(1, 4), (1, 5), (2, 5), (3, 5), (4, 5), (5, 5), (5, 4), (5, 3), (4, 3),
                                           (3, 3)]
    umaze = data.maze_steps([[1, 1, 1, 1, 1], [1, 0, 0, 0, 1], [1, 1, 1, 0, 1], [1, 0, 0, 0, 1], [1, 1, 1, 1, 1]],
                            (3, 1))
    assert [umaze[c] for c in walk(umaze, (1, 1), (3, 1))] == [6, 5, 4, 3, 2, 1, 0]


@pytest.mark.slow
def test_make_a_tiny_pointmaze_that_dt_trains_on(minari_tmp, tmp_path, capsys):
    import minari
    import dt
    data.main(["make", "pointmaze-umaze-dense", "--steps", "400"])
    out = capsys.readouterr().out
    ds = minari.load_dataset("made/pointmaze/umaze-dense-v0")
    episodes = list(ds.iterate_episodes())
    meta = ds.storage.metadata
    assert meta["data_py_command"] == "python data.py make pointmaze-umaze-dense made/pointmaze/umaze-dense-v0 " \
                                      "--steps 400"
    assert ds.env_spec.kwargs["continuing_task"] and ds.env_spec.kwargs["reset_target"]
    eval_spec = ds._eval_env_spec                                    # Minari's eval env: one goal, kept to 300 steps
    assert eval_spec.id == "PointMaze_UMazeDense-v3" and eval_spec.max_episode_steps == 300
    assert eval_spec.kwargs["maze_map"][1][1] == "g" and not eval_spec.kwargs["reset_target"]
    assert sum(len(e.actions) for e in episodes) == 400 and len(episodes) >= 3
    for e, nxt in zip(episodes[:-1], episodes[1:]):                 # one continuing run, cut at each goal reached
        obs = e.observations
        assert np.linalg.norm(obs["achieved_goal"][-1] - obs["desired_goal"][-1]) <= 0.45
        assert np.linalg.norm(obs["achieved_goal"][-2] - obs["desired_goal"][-2]) > 0.45
        assert e.truncations[-1] and not e.truncations[:-1].any() and not e.terminations.any()
        assert np.array_equal(nxt.observations["observation"][0], obs["observation"][-1])
        assert np.allclose(e.rewards, np.exp(-np.linalg.norm(obs["achieved_goal"][1:] - obs["desired_goal"][1:],
                                                             axis=1)))     # the dense reward of the goal then shown
    returns = np.array([e.rewards.sum() for e in episodes])
    assert f"{len(episodes)} episodes, 400 steps" in out and f"median {np.median(returns):.4g}," in out
    assert f"max {returns.max():.4g}," in out and "goal reached in" in out
    d = data.load_data("made/pointmaze/umaze-dense-v0", download=False)
    assert d.family == "maze" and d.obs_dim == 6 and d.goal_dim == 2 and len(d.episodes) == len(episodes)
    assert (d.ref_min, d.ref_max) == (meta["ref_min_score"], meta["ref_max_score"]) and d.ref_min < d.ref_max
    data.make("pointmaze-umaze-dense", "test/pointmaze/again-v0", steps=400)     # the same seed, the same data
    again = list(minari.load_dataset("test/pointmaze/again-v0").iterate_episodes())
    assert all(np.array_equal(a.actions, b.actions) for a, b in zip(episodes, again)) and len(again) == len(episodes)
    capsys.readouterr()
    dt.main(["--dataset", "made/pointmaze/umaze-dense-v0", "--n-embd", "16", "--n-layer", "1", "--context", "4",
             "--batch-size", "8", "--steps", "2", "--eval-every", "2", "--eval-episodes", "1",
             "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("final: ") and any(l.startswith("maze: steps_to_goal=") for l in lines)


def test_make_bad_input_is_one_sentence_before_any_work(minari_tmp, monkeypatch, capsys):
    def no_work(*args):
        raise AssertionError("make did work before checking its input")
    monkeypatch.setattr(data, "_make_pointmaze", no_work)
    (minari_tmp / "made" / "pointmaze" / "medium-v0" / "data").mkdir(parents=True)      # a taken id
    for argv, said in ((["make", "pointmaze-medum"], "make knows no 'pointmaze-medum'; it makes pointmaze-umaze, "
                        "pointmaze-umaze-dense, pointmaze-medium, pointmaze-medium-dense, pointmaze-large, "
                        "pointmaze-large-dense, breakout-mixed, hopper-medium, hopper-medium-replay, "
                        "hopper-expert, hopper-medium-expert, halfcheetah-medium, "
                        "halfcheetah-medium-replay (did you mean pointmaze-medium?)"),
                       (["make", "pointmaze-medium"], "dataset 'made/pointmaze/medium-v0' already exists at "),
                       (["make", "pointmaze-large", "nonamespace-v0"], "must look like namespace/name-vN"),
                       (["make", "pointmaze-large", "--seed", "-1"], "--seed -1 is negative"),
                       (["make", "pointmaze-large", "--steps", "0"], "'0' is not a whole number above 0")):
        err = one_sentence_exit_1(capsys, data.main, argv)
        assert said in err, err

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(data, "_make_pointmaze", interrupted)                            # Ctrl-C while it collects
    with pytest.raises(SystemExit) as e:
        data.main(["make", "pointmaze-large-dense"])
    assert e.value.code == 130 and capsys.readouterr().err.strip() == "stopped by Ctrl-C: the dataset " \
        "'made/pointmaze/large-dense-v0' was not written, and nothing of it is left"
