"""data.py's Breakout maker (make breakout-mixed): the RAM addresses its controller reads against the screen, its
choices by hand, and a tiny made dataset that data.py loads and dt.py trains and evaluates on."""
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


def red_on_screen(env, rows):
    """The leftmost column and top row of the ball's and paddle's colour (200, 72, 72) in these screen rows."""
    screen = env.unwrapped.ale.getScreenRGB()[rows]                     # (rows, 160, 3) uint8
    r, c = np.nonzero((screen[..., 0] == 200) & (screen[..., 1] == 72) & (screen[..., 2] == 72))
    return (int(c.min()), int(r.min()) + rows.start) if len(c) else None


def test_the_ram_addresses_hold_the_ball_and_the_paddle_the_screen_shows():
    # independent of the annotation: the ball's RAM x / y and the paddle's RAM x sit a fixed offset from where their
    # colour is on the raw 210x160 screen (ball: rows 94-188, between the bricks and the paddle; paddle: rows 189-193)
    env = data.make_atari_env(data.atari_env_spec("breakout"))
    env.reset(seed=0)
    assert ball_and_paddle(env)[1] == 0 and data._breakout_action(env.unwrapped.ale.getRAM()) == 1  # no ball: FIRE
    env.step(1)
    ball, paddle, ball_at, paddle_at = set(), set(), set(), set()
    for i in range(14):                                       # the served ball falls; the paddle moves both ways
        env.step((0, 2, 3)[i % 3])
        x, y, p = ball_and_paddle(env)
        seen = red_on_screen(env, slice(94, 189))
        if seen is not None:
            ball.add((x - seen[0], y - seen[1]))
            ball_at.add((x, y))
        paddle.add(p - red_on_screen(env, slice(189, 194))[0])
        paddle_at.add(p)
    assert ball == {(49, -9)} and paddle == {47}              # (measured once; any other address would drift)
    assert len(ball_at) >= 10 and len(paddle_at) > 1           # ... over a moving ball and a moving paddle
    env.close()


def test_the_controller_by_hand():
    # the paddle's middle is paddle x + 10; NOOP within 4 of the ball's x, else toward it
    ram = np.zeros(128, np.uint8)
    ram[[99, 101, 72]] = (100, 137, 90)                       # the ball at x 100, the paddle's middle at 100
    assert data._breakout_action(ram) == 0
    ram[72] = 86                                              # middle at 96: within 4
    assert data._breakout_action(ram) == 0
    ram[72] = 85                                              # middle at 95: 5 left of the ball
    assert data._breakout_action(ram) == 2                    # RIGHT
    ram[72] = 95                                              # middle at 105
    assert data._breakout_action(ram) == 3                    # LEFT
    ram[101] = 0                                              # no ball in play
    assert data._breakout_action(ram) == 1                    # FIRE


@pytest.fixture(scope="module")
def made_breakout(minari_path):
    buffers, kwargs, behaviour = data._make_breakout(seed=0, steps=300)
    dataset_id = "test/breakout/made-v0"
    data._write_dataset(dataset_id, buffers, ["make", "breakout-mixed", "--steps", 300], **kwargs)
    return dataset_id, buffers, behaviour


@pytest.mark.slow
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


@pytest.mark.slow
def test_dt_trains_and_evaluates_on_a_made_breakout(made_breakout, tmp_path, capsys):
    out = tmp_path / "run"
    dt.main(["--dataset", made_breakout[0], *TINY_DT, "--steps", "2", "--eval-every", "2", "--out", str(out)])
    text = capsys.readouterr().out
    assert "final: normalized_score=" in text and "episodes=1" in text
