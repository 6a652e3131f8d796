"""data.py's Breakout maker (make breakout-mixed): the RAM addresses its controller reads, its landing point against
hand-computed ones, and a tiny made dataset that data.py loads and dt.py trains and evaluates on."""
import os

import h5py
import numpy as np
import pytest

pytest.importorskip("ale_py")

import data  # noqa: E402
import dt  # noqa: E402
from test_atari import TINY_DT  # noqa: E402


def ball_and_paddle(env):
    ram = env.unwrapped.ale.getRAM()
    return tuple(int(ram[data.BREAKOUT_RAM[k]]) for k in ("ball_x", "ball_y", "paddle_x"))


def test_the_ram_holds_the_ball_and_the_paddle_and_the_served_ball_lands_where_predicted():
    env = data.make_atari_env(data.atari_env_spec("breakout"))
    env.reset(seed=0)
    _, y, paddle = ball_and_paddle(env)
    assert y == 0 and data._breakout_action(env.unwrapped.ale.getRAM(), None) == (1, None)  # no ball yet: FIRE
    env.step(1)
    seen = []
    for _ in range(3):
        env.step(0)
        seen.append(ball_and_paddle(env))
    (x0, y0, _), (x1, y1, p1) = seen[-2:]
    assert 0 < y0 < y1 and x0 != x1 and p1 == paddle           # served: the ball falls and moves sideways, NOOP
    landing = data._breakout_landing(x1, y1, x1 - x0, y1 - y0)
    lo, hi = data.BREAKOUT_WALLS
    assert lo <= landing <= hi
    x, y = x1, y1
    while y < data.BREAKOUT_PADDLE_ROW:                        # nothing below the bricks: a straight fall to the row
        x_before, y_before = x, y
        env.step(0)
        x, y, _ = ball_and_paddle(env)
    crossing = x_before + (x - x_before) * (data.BREAKOUT_PADDLE_ROW - y_before) / (y - y_before)
    assert abs(landing - crossing) <= 2
    for _ in range(4):
        env.step(2)                                             # RIGHT
    assert ball_and_paddle(env)[2] > paddle
    env.close()


def test_landing_point_by_hand():
    # walls at 56 and 200, paddle row 177; the ball at (x, y) moves (vx, vy) a step
    assert data._breakout_landing(100, 137, 4, 4) == 140      # 10 steps: 100 + 40, no wall
    assert data._breakout_landing(190, 157, 4, 2) == 170      # 10 steps: to 230, 30 past the right wall: 200 - 30
    assert data._breakout_landing(60, 147, -6, 2) == 142      # 15 steps: to -30, 86 past the left wall: 56 + 86
    assert data._breakout_landing(100, 77, -8, 2) == 124      # 50 steps: to -300: 356 past the left wall = 144 to the
    #                                                           right wall, 212 back from it, 68 past the left: 56 + 68
    assert data._breakout_landing(100, 77, 0, 2) == 100
    # the controller: the paddle's middle (paddle x + 10) goes under the landing point, within 2
    ram = np.zeros(128, np.uint8)
    ram[[99, 101, 72]] = (100, 137, 130)                       # falling to x 140: the paddle should be at 130
    assert data._breakout_action(ram, (96, 133)) == (0, (100, 137))
    ram[72] = 120
    assert data._breakout_action(ram, (96, 133)) == (2, (100, 137))   # RIGHT
    assert data._breakout_action(ram, None) == (3, (100, 137))        # no velocity yet: follow the ball (x 100), LEFT
    ram[101] = 0
    assert data._breakout_action(ram, (96, 133)) == (1, None)         # the ball is lost: FIRE


@pytest.fixture(scope="module")
def made_breakout(minari_path):
    buffers, kwargs, behaviour = data._make_breakout(seed=0, steps=300)
    dataset_id = "test/breakout/made-v0"
    data._write_dataset(dataset_id, buffers, ["make", "breakout-mixed", "--steps", 300], **kwargs)
    return dataset_id, buffers, behaviour


def test_a_tiny_make_loads_lossless_and_its_controller_outscores_random_play(made_breakout):
    dataset_id, buffers, behaviour = made_breakout
    assert sum(len(b.actions) for b in buffers) == 300                 # --steps: the last episode cut there
    assert buffers[-1].truncations[-1] and not buffers[-1].terminations[-1]
    with h5py.File(os.path.join(data.dataset_folder(dataset_id), "data", "main_data.hdf5")) as f:
        assert f["episode_0/observations"].compression == "gzip"       # _write_dataset compresses Minari's arrays
    d = data.load_data(dataset_id)
    assert d.family == "atari" and d.n_actions == 4 and (d.ref_min, d.ref_max) == (1.7, 30.5)
    assert len(d.episodes) == len(buffers)
    for ep, b in zip(d.episodes, buffers):
        frames = ep["observations"]
        assert frames.dtype == np.uint8 and frames.shape == (len(b.actions), 84, 84)
        np.testing.assert_array_equal(frames, b.observations[:-1])     # lossless (no JPEG)
        np.testing.assert_array_equal(ep["actions"], b.actions)
        assert ep["actions"].min() >= 0 and ep["actions"].max() < 4
    assert d.episode_returns.tolist() == [sum(b.rewards) for b in buffers]
    np.testing.assert_allclose(d.flat["rtg"][d.ep_start], d.episode_returns)
    # episode 0 is the controller alone (eps 0); random play on the same start for as many steps scores far less
    controller = sum(buffers[0].rewards)
    env = data.make_atari_env(data.atari_env_spec("breakout"))
    env.reset(seed=0)
    rng, random_play = np.random.default_rng(0), 0.0
    for _ in range(len(buffers[0].actions)):
        _, r, term, trunc, _ = env.step(int(rng.integers(4)))
        random_play += r
        if term or trunc:
            break
    env.close()
    assert controller >= 5 and controller > random_play + 3, (controller, random_play)
    assert f"(eps 0, 1 episode): {controller:.0f} to {controller:.0f}" in behaviour


def test_dt_trains_and_evaluates_on_a_made_breakout(made_breakout, tmp_path, capsys):
    out = tmp_path / "run"
    dt.main(["--dataset", made_breakout[0], *TINY_DT, "--steps", "2", "--eval-every", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert "final: normalized_score=" in text and "episodes=1" in text
