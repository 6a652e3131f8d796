"""Issue 39, the new features hold as the old ones do: a dataset write that fails (a full disk, another filesystem,
a read-only namespace folder) is one sentence and leaves nothing; a stopped analysis keeps its previous files and says
so, SIGTERM as Ctrl-C; sizes that cannot fit are refused before any work; the maze sweep is in one unit; the messages
say what is true; report keeps greedy evaluations apart."""
import csv
import errno
import os
import re
import signal

import numpy as np
import pytest
import torch

import data
import evaluate
from test_convert import minari_tmp, write_d4rl  # noqa: F401 (minari_tmp: a fixture)
from test_evaluate import TINY_DT, files


def one_sentence(capsys, fn, argv, code=1):
    with pytest.raises(SystemExit) as e:
        fn(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == code and "\n" not in err and "Traceback" not in err, err
    return err


def no_work(*args):
    pytest.fail("the command did work before refusing")

# ---------------------------------------------------------------------------------------------------------------
# 1. a dataset write that fails: one sentence naming the folder and the cause, nothing left


HDF5_FULL = "(file write failed: time = ..., errno = 28, error message = 'No space left on device')"


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   RuntimeError(f"Can't decrement id ref count {HDF5_FULL}"),
                                   ValueError(f"Unable to synchronously create group {HDF5_FULL}")])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_full_disk_during_a_write_is_one_sentence_and_leaves_nothing(error, where, tmp_path, minari_tmp,
                                                                        monkeypatch, capsys):
    """The OS's words, or HDF5's (h5py raises a RuntimeError or a ValueError naming the errno on a full disk),
    before Minari's first group or after its file."""
    import minari
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    real = minari.create_dataset_from_buffers

    def full(*args, **kwargs):
        if where == "after":
            real(*args, **kwargs)
        raise error
    monkeypatch.setattr(minari, "create_dataset_from_buffers", full)
    err = one_sentence(capsys, data.main, ["convert-d4rl", path, "d4rl/hopper/full-v0"])
    assert err == f"error: could not write the dataset 'd4rl/hopper/full-v0' in {minari_tmp / 'd4rl' / 'hopper'} " \
                  f"(No space left on device); nothing of it is left"
    assert os.listdir(minari_tmp) == []


FULL_AT_EXIT = """
import atexit, errno, runpy, sys
import minari
def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")
minari.create_dataset_from_buffers = full
atexit.register(lambda: print("finalised", file=sys.stderr))
sys.argv = ["data.py", "convert-d4rl", {path!r}, "d4rl/hopper/full-v0"]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_failed_write_ends_the_command_before_hdf5_is_finalised(tmp_path, minari_tmp):
    """HDF5 can crash where it closes or finalises a file whose write failed: `python data.py` says its sentence
    and exits 1 without finalising anything, whatever the error's type."""
    import subprocess
    import sys
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    r = subprocess.run([sys.executable, "-c", FULL_AT_EXIT.format(path=path, script=data.__file__)],
                       capture_output=True, text=True, env=dict(os.environ, MINARI_DATASETS_PATH=str(minari_tmp)),
                       timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == \
        f"error: could not write the dataset 'd4rl/hopper/full-v0' in {minari_tmp / 'd4rl' / 'hopper'} (No space " \
        f"left on device); nothing of it is left", r.stderr
    assert os.listdir(minari_tmp) == []


def test_a_dataset_that_cannot_fit_on_the_disk_is_refused_before_it_is_written(tmp_path, minari_tmp, monkeypatch,
                                                                              capsys):
    """The free space against the file Minari writes (uncompressed: the most the disk holds at once), and that
    estimate against the real file."""
    import minari
    import shutil
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    sizes, real_gzip = [], data._gzip_hdf5
    monkeypatch.setattr(data, "_gzip_hdf5", lambda p: sizes.append(os.path.getsize(p)) or real_gzip(p))
    real_need = data._disk_need
    monkeypatch.setattr(data, "_disk_need", lambda buffers: sizes.append(real_need(buffers)) or sizes[-1])
    data.convert_d4rl(path, "d4rl/hopper/fits-v0")
    assert sizes[1] < sizes[0], sizes                                      # the file within the estimate

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2 ** 30, 2 ** 30 - 2 ** 20, 2 ** 20))
    monkeypatch.setattr(minari, "create_dataset_from_buffers", no_work)
    err = one_sentence(capsys, data.main, ["convert-d4rl", path, "d4rl/hopper/full-v0"])
    assert re.fullmatch(rf"error: the dataset 'd4rl/hopper/full-v0' would take about [\d.]+ MB in {minari_tmp} "
                        rf"while it is written, more than the 1 MB free there; free some space, or set "
                        rf"MINARI_DATASETS_PATH to a folder with room", err), err
    assert not (minari_tmp / "d4rl" / "hopper" / "full-v0").exists() and os.listdir(minari_tmp) == ["d4rl"]


@pytest.mark.parametrize("name, player", [("pointmaze-umaze", "_waypoint_action"),
                                          ("breakout-mixed", "_breakout_action"), ("hopper-medium", "ars")])
def test_a_make_too_large_for_the_disk_is_refused_before_it_collects(name, player, minari_tmp, monkeypatch, capsys):
    import shutil
    monkeypatch.setattr(data, player, no_work)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2 ** 30, 2 ** 30 - 2 ** 21, 2 ** 21))
    err = one_sentence(capsys, data.main, ["make", name, "--steps", "1000000"])
    fit = re.fullmatch(rf"error: --steps 1,000,000 would write about [\d.]+ [MG]B to {minari_tmp}, more than the 2 MB "
                       rf"free there; use --steps ([\d,]+) or fewer, or set MINARI_DATASETS_PATH to a folder with "
                       rf"room", err)
    assert fit and 0 < int(fit[1].replace(",", "")) < 10 ** 6, err
    assert not os.path.exists(minari_tmp / "made")


def test_medium_expert_checks_the_disk_for_both_halves_before_it_trains(minari_tmp, monkeypatch, capsys):
    """3 MB free: one 2,500-step hopper half fits (about 2.6 MB with the margin and episodes of 40 steps), the two
    halves do not (4.2 MB)."""
    import shutil
    monkeypatch.setattr(data, "ars", lambda *args, **settings: no_work())
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2 ** 30, 2 ** 30 - 3 * 2 ** 20, 3 * 2 ** 20))
    with pytest.raises(pytest.fail.Exception):                             # a half alone gets to ARS
        data.main(["make", "hopper-medium", "--steps", "2500"])
    err = one_sentence(capsys, data.main, ["make", "hopper-medium-expert", "--steps", "2500"])
    fit = re.fullmatch(rf"error: --steps 2,500 twice would write about [\d.]+ MB to {minari_tmp}, more than the 3 MB "
                       rf"free there; use --steps ([\d,]+) or fewer, or set MINARI_DATASETS_PATH to a folder with "
                       rf"room", err)
    assert fit and 1_000 < int(fit[1].replace(",", "")) < 2_500, err
    assert not os.path.exists(minari_tmp / "made" / "hopper" / "medium-expert-v0")


def test_a_rename_across_filesystems_leaves_no_namespace_metadata(tmp_path, minari_tmp, monkeypatch, capsys):
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    real = os.rename

    def cross_device(src, dst):
        if dst.endswith("xdev-v0"):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        return real(src, dst)
    monkeypatch.setattr(os, "rename", cross_device)
    err = one_sentence(capsys, data.main, ["convert-d4rl", path, "d4rl/hopper/xdev-v0"])
    assert err == f"error: could not write the dataset 'd4rl/hopper/xdev-v0' in {minari_tmp / 'd4rl' / 'hopper'} " \
                  f"(Invalid cross-device link); nothing of it is left"
    assert os.listdir(minari_tmp) == []


def test_a_namespace_folder_that_cannot_take_the_dataset_is_refused_before_any_work(minari_tmp, monkeypatch, capsys):
    """Read-only inside a writable datasets folder, or on another filesystem (a rename cannot cross it)."""
    monkeypatch.setattr(data, "_make_pointmaze", no_work)
    made = minari_tmp / "made"
    os.makedirs(made)
    real_access, real_stat = os.access, os.stat
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(made) and real_access(p, mode))
    err = one_sentence(capsys, data.main, ["make", "pointmaze-umaze"])
    assert err == f"error: cannot write a dataset in {made} (not writable); set MINARI_DATASETS_PATH to a folder " \
                  f"you can write"
    monkeypatch.setattr(os, "access", real_access)

    def elsewhere(p, *args, **kwargs):  # the namespace folder on another device
        st = real_stat(p, *args, **kwargs)
        return os.stat_result((*st[:2], st.st_dev + 1, *st[3:])) if str(p) == str(made) else st
    monkeypatch.setattr(os, "stat", elsewhere)
    err = one_sentence(capsys, data.main, ["make", "pointmaze-umaze"])
    assert err == f"error: cannot write a dataset in {made} (on another filesystem than {minari_tmp}); set " \
                  f"MINARI_DATASETS_PATH to a folder you can write"
    assert os.listdir(minari_tmp) == ["made"] and os.listdir(made) == []

# ---------------------------------------------------------------------------------------------------------------
# 1b. every flag checked before the paper's settings read it; a negative number of any spelling is a value


@pytest.mark.parametrize("script", ["dt", "gpt2_dtma", "lsdt", "starformer", "dema"])
def test_every_float_flag_that_is_not_finite_is_one_sentence_before_the_papers_settings(script, monkeypatch,
                                                                                       capsys):
    """NaN and the infinities, after `=` or a space (argparse's own pattern takes -inf for a flag): each float flag
    with one of them, in turn; every one with the first flag and with LSDT's --conv-ratio."""
    import dataclasses
    import importlib
    import itertools
    m = importlib.import_module(script)
    monkeypatch.setattr(m, "paper_settings", no_work)
    names = [f.name for f in dataclasses.fields(m.Config) if f.type is float]
    assert "lr" in names and (script != "lsdt" or "conv_ratio" in names)
    spellings = list(itertools.product(("nan", "inf", "-inf", "-Infinity"), ("=", " ")))
    cases = [(name, spellings[i % len(spellings)]) for i, name in enumerate(names)]
    cases += [(name, s) for name in {names[0], "conv_ratio"} & set(names) for s in spellings]
    for name, (value, form) in cases:
        flag = "--" + name.replace("_", "-")
        argv = [f"{flag}={value}"] if form == "=" else [flag, value]
        err = one_sentence(capsys, m.main, argv)
        assert err == f"error: {flag} must be a finite number, got {float(value)}", (argv, err)


def test_a_negative_number_of_any_spelling_is_a_flags_value(capsys):
    import dt
    for value in ("-1e-3", "-.5", "-2E+1", "-1"):
        err = one_sentence(capsys, dt.main, ["--weight-decay", value])
        assert err == f"error: --weight-decay must be >= 0, got {float(value)}", err
    cfg, _ = dt.parse_flags(["--target-return", "-1e-3"])
    assert cfg.target_return == -1e-3
    assert one_sentence(capsys, dt.main, ["--no-such-flag", "-1e-3"]) == \
        "error: unrecognized arguments: --no-such-flag -1e-3 (see python dt.py --help)"

# ---------------------------------------------------------------------------------------------------------------
# 2. a stopped analysis keeps the previous files (written whole, renamed together) and says so


STOPS = "stops; an analysis writes nothing half-made (each file whole, or its previous copy kept)"


def test_an_interrupted_gif_keeps_the_previous_one(tiny_breakout, tmp_path, monkeypatch, capsys):
    """Atari's frames need no OpenGL; Ctrl-C halfway through the GIF's write."""
    from PIL import Image
    d = data.load_data(tiny_breakout)
    d.horizon = 20
    (tmp_path / "episode.gif").write_bytes(b"the previous gif")

    def cut(self, fp, *args, **kwargs):
        with open(fp, "wb") as f:
            f.write(b"GIF89a, half of it")
        raise KeyboardInterrupt
    monkeypatch.setattr(Image.Image, "save", cut)
    with pytest.raises(SystemExit) as e, evaluate.one_sentence_errors(), evaluate.analysis("gif"):
        evaluate.episode_gif(lambda batch, live: np.zeros((len(live), d.act_dim)), d, 90.0, 0, 4, "cpu",
                             str(tmp_path), "a title")
    assert e.value.code == 130 and capsys.readouterr().err.strip() == f"SIGINT: --gif {STOPS}"
    assert os.listdir(tmp_path) == ["episode.gif"] and (tmp_path / "episode.gif").read_bytes() == b"the previous gif"


@pytest.mark.slow
def test_a_stopped_sweep_keeps_the_previous_pair_and_sigterm_stops_it_as_ctrl_c(tiny_hopper, tmp_path, monkeypatch,
                                                                                capsys):
    """Ctrl-C in the figure's write, SIGTERM in an evaluation (exit 143): the previous csv and png kept, no .tmp; a
    Ctrl-C that comes while they are renamed waits until both are in place."""
    import dt
    from matplotlib.figure import Figure
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_hopper, *TINY_DT, "--out", str(out)])
    (out / "target_sweep.csv").write_text("the previous table")
    (out / "target_sweep.png").write_bytes(b"the previous figure")
    before = files(out)
    sweep = ["--out", str(out), "--target-sweep"]
    capsys.readouterr()

    def interrupted(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a png")
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(Figure, "savefig", interrupted)
        err = one_sentence(capsys, dt.main, sweep, code=130)
    assert err == f"SIGINT: --target-sweep {STOPS}" and files(out) == before

    real = evaluate.evaluate

    def terminated(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)  # (to this thread: delivered at once)
        return real(*args, **kwargs)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM reached the caller's handler"))
    try:
        with monkeypatch.context() as m:
            m.setattr(evaluate, "evaluate", terminated)
            err = one_sentence(capsys, dt.main, sweep, code=143)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert err == f"SIGTERM: --target-sweep {STOPS}" and files(out) == before

    real_replace = os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if dst.endswith("target_sweep.csv"):
            signal.raise_signal(signal.SIGINT)  # (to this thread: delivered at once)
    monkeypatch.setattr(os, "replace", replace)
    err = one_sentence(capsys, dt.main, sweep, code=130)
    after = files(out)
    assert err == f"SIGINT: --target-sweep {STOPS}" and set(after) == set(before)
    assert after["target_sweep.csv"].startswith(b"target,") and after["target_sweep.png"].startswith(b"\x89PNG")


def test_save_figure_renames_a_whole_figure_into_place(tmp_path, monkeypatch):
    """The other analyses' figures: a stop in the write keeps the previous file, and no .tmp."""
    from matplotlib.figure import Figure
    fig = Figure()
    ax = fig.subplots()
    ax.plot([0, 1])
    path = tmp_path / "figure.png"
    path.write_bytes(b"the previous figure")
    evaluate.save_figure(fig, str(path), dpi=50)
    whole = path.read_bytes()
    assert whole.startswith(b"\x89PNG") and os.listdir(tmp_path) == ["figure.png"]

    def cut(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"half a png")
        raise KeyboardInterrupt
    monkeypatch.setattr(type(fig), "savefig", cut)
    with pytest.raises(KeyboardInterrupt):
        evaluate.save_figure(fig, str(path), dpi=50)
    assert path.read_bytes() == whole and os.listdir(tmp_path) == ["figure.png"]

# ---------------------------------------------------------------------------------------------------------------
# 3. sizes that cannot fit: one sentence with the number to lower, before any work


@pytest.mark.parametrize("name, player", [("pointmaze-umaze", "_waypoint_action"),
                                          ("breakout-mixed", "_breakout_action"), ("hopper-medium", "ars")])
def test_a_make_too_large_for_memory_is_refused_before_it_collects(name, player, minari_tmp, monkeypatch, capsys):
    monkeypatch.setattr(data, player, no_work)
    monkeypatch.setattr(data, "available_memory", lambda: 2 ** 30)
    err = one_sentence(capsys, data.main, ["make", name, "--steps", "1000000000"])
    fit = re.fullmatch(r"error: --steps 1,000,000,000 would take about [\d.]+ [GT]B of memory and [\d.]+ [a-z]+ of "
                       r"env steps, more than the 1 GB free; use --steps ([\d,]+) or fewer", err)
    assert fit and 0 < int(fit[1].replace(",", "")) < 10 ** 9, err
    assert not os.path.exists(minari_tmp / "made")


def test_make_counts_a_steps_memory_from_the_spaces(capsys):
    """PointMaze: 8 float64 observation entries, 2 float32 action entries and 128 bytes of list entries a step."""
    env = data._robotics().make("PointMaze_UMaze-v3")
    data._check_make(env, 2 ** 20, data.EPISODE_STEPS["pointmaze"])
    assert capsys.readouterr().out.startswith(f"{2 ** 20:,} steps: about {(8 * 8 + 2 * 4 + 128):.3g} MB of memory "
                                              f"and ")


def test_evaluations_too_large_for_memory_are_refused_before_any_work(tiny_hopper, tmp_path, monkeypatch, capsys):
    """A training run's (before its folder is made) and --target-sweep's: the environments of --eval-episodes, an
    env's memory measured."""
    import dt
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_hopper, *TINY_DT, "--out", str(out)])
    before = files(out)
    monkeypatch.setattr(data, "available_memory", lambda: 2 ** 28)
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **kw: pytest.fail("it evaluated"))
    for argv in (["--dataset", tiny_hopper, *TINY_DT, "--eval-episodes", "5000", "--out", str(tmp_path / "new")],
                 ["--out", str(out), "--target-sweep", "--eval-episodes", "5000"]):
        err = one_sentence(capsys, dt.main, argv)
        assert re.fullmatch(r"error: --eval-episodes 5000 would need about [\d.]+ GB for its environments \([\d.]+ "
                            r"MB each\), more than the 256 MB free; use --eval-episodes \d+ or fewer", err), err
    assert not (tmp_path / "new").exists() and files(out) == before

# ---------------------------------------------------------------------------------------------------------------
# 4. the maze sweep in one unit: returns to the goal, as the data's episodes end there


@pytest.mark.slow
def test_the_maze_sweep_compares_returns_to_the_goal(minari_tmp, tmp_path, monkeypatch):
    """A made sparse PointMaze (each episode ends at its goal with return 1) swept with the planner's controller: each
    episode ends at its first goal, its return 1 as the data's; the success rate per target in the csv."""
    monkeypatch.setattr(data, "MAZE_REF_EPISODES", 2)
    data.make("pointmaze-umaze", steps=600)
    d = data.load_data("made/pointmaze/umaze-v0")
    assert (d.episode_returns[:-1] == 1).all()
    maze, plans = d.make_env().unwrapped.maze, {}

    def expert(batch, live):  # the state (x, y, vx, vy, goal x, goal y), unnormalised
        s = batch["states"][:, -1].numpy() * d.state_std + d.state_mean
        return np.stack([data._waypoint_action(dict(achieved_goal=r[:2], observation=r[:4], desired_goal=r[4:]),
                                               maze, plans) for r in s])
    torch.save({"step": 7}, tmp_path / "ckpt.pt")
    results = evaluate.target_sweep(expert, d, 2, 0, 1, "cpu", str(tmp_path), "the expert")
    for _, res in results:
        assert res["success"].all() and (res["returns"] == 1).all() and (res["lengths"] < d.horizon).all()
        assert (res["lengths"] == res["steps_to_goal"]).all()
    with open(tmp_path / "target_sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["eval_return"], r["success_rate"], r["target_normalized"]) for r in rows] == [("1.00", "1.000", "")] * 8

# ---------------------------------------------------------------------------------------------------------------
# 5. the messages, and report


def test_the_messages_say_what_is_true(tmp_path, minari_tmp, monkeypatch, capsys):
    """A made/... id is made, not downloaded; a file is not a dataset; minari's rule for an id (letters, digits, _
    and -; a namespace of two or more); an empty MINARI_DATASETS_PATH is named empty."""
    for download in (True, False):
        with pytest.raises(data.DataError) as e:
            data.load_data("made/pointmaze/medium-dense-v0", download=download)
        assert "make it with `python data.py make pointmaze-medium-dense made/pointmaze/medium-dense-v0`" in \
            str(e.value) and "download" not in str(e.value)
    path = write_d4rl(tmp_path / "hopper_medium-v2.hdf5")
    err = one_sentence(capsys, data.main, ["mix", path, "hopper-medium", "local/hopper/mixed-v0"])
    assert err == f"error: {path} is a file, not a dataset name or id (a D4RL file: convert-d4rl it first)"
    for bad in ("made/pointmaze/u1.5-v0", "x/u-v0"):
        err = one_sentence(capsys, data.main, ["make", "pointmaze-umaze", bad])
        assert err == f"error: dataset id '{bad}' must look like namespace/name-vN, of letters, digits, _ and - (the " \
                      f"namespace 2 or more, / allowed inside), e.g. d4rl/hopper/medium-v2"
    monkeypatch.setenv("MINARI_DATASETS_PATH", "")
    for argv in (["make", "pointmaze-umaze"], ["info", "made/pointmaze/umaze-v0"]):
        assert one_sentence(capsys, data.main, argv) == "error: MINARI_DATASETS_PATH is empty, not a folder of " \
                                                        "datasets; point it at a folder"


def test_a_missing_made_id_is_told_the_make_that_writes_it_or_the_makes(minari_tmp):
    """The maker is named only for an id that `make` writes by default; a case-different id in the folder is named."""
    os.makedirs(minari_tmp / "made" / "hopper" / "medium-v0" / "data")
    names = ", ".join(data.MAKE_NAMES)
    for made in ("made/breakout/k9-v0", "made/hopper/k9-v0", "made/pointmaze/umaze-dense-v1"):
        with pytest.raises(data.DataError) as e:
            data.load_data(made)
        assert str(e.value) == f"dataset '{made}' is not in {minari_tmp}; make it with `python data.py make NAME " \
                               f"{made}` (NAME one of {names}) or set MINARI_DATASETS_PATH to a folder that holds it"
    with pytest.raises(data.DataError) as e:
        data.load_data("made/hopper/expert-v0")
    assert "make it with `python data.py make hopper-expert made/hopper/expert-v0`" in str(e.value)
    with pytest.raises(data.DataError) as e:
        data.load_data("made/Hopper/medium-v0")
    assert str(e.value) == f"dataset 'made/Hopper/medium-v0' is not in {minari_tmp}, but 'made/hopper/medium-v0' " \
                           f"is (ids are case-sensitive); use that id"


def test_offline_a_class_is_told_the_make_and_random_weights(minari_tmp, tmp_path, monkeypatch):
    """gpt2_dtma.py --env hopper-medium offline: the data's message names the make that stands in and the id it
    writes; GPT-2's weights' message names --init random."""
    import huggingface_hub
    import minari
    import gpt2_dtma as G

    def offline(dataset_id, download=False):
        raise ConnectionError("network unreachable")
    monkeypatch.setattr(minari, "load_dataset", offline)
    for download in (True, False):
        with pytest.raises(data.DataError) as e:
            data.load_data("hopper-medium", download=download)
        assert str(e.value).endswith("; offline, `python data.py make hopper-medium` makes a stand-in: then pass "
                                     "--dataset made/hopper/medium-v0"), str(e.value)
    with pytest.raises(data.DataError) as e:
        data.load_data("walker2d-medium")
    assert "data.py make" not in str(e.value)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(G, "try_to_load_from_cache", lambda *a, **kw: None)
    with pytest.raises(G.CheckpointError) as e:
        G.find_weights("gpt2")
    assert str(e.value).endswith("pass --init PATH to a local model.safetensors, or train from random weights "
                                 "with --init random"), str(e.value)


def test_an_atari_run_says_the_papers_atari_row_in_its_help_and_first_line(tiny_breakout, capsys):
    """Not MuJoCo's defaults (context 20, batch 64, 100,000 steps): the Atari row (30, 128, 19,530; Pong 50, 512)."""
    import dt
    for name, context, batch, steps in ((tiny_breakout, 30, 128, 19530), ("atari/pong/expert-v0", 50, 512, 4885)):
        with pytest.raises(SystemExit) as e:
            dt.main(["--dataset", name, "--help"])
        text = re.sub(r"\s+", " ", capsys.readouterr().out)
        row = f"here, the paper's Atari row for {name}"
        assert e.value.code == 0 and f"(3K tokens) (default: {context} {row}; else 20)" in text, text
        assert f"windows per batch (default: {batch} {row}; else 64)" in text
        assert f"gradient steps (default: {steps} {row}; else 100000)" in text
        dt.parse_flags(["--dataset", name])
        first = capsys.readouterr().out
        assert first.startswith("the paper's row for Atari: --n-layer 6,") and f"--context {context}, --batch-size " \
            f"{batch}," in first and f"--steps {steps}" in first, first
    with pytest.raises(SystemExit):
        dt.main(["--help"])
    assert "(3K tokens) (default: 20)" in re.sub(r"\s+", " ", capsys.readouterr().out)


def test_report_keeps_greedy_evaluations_apart(tmp_path):
    """Atari seeds evaluated by argmax (--greedy, log.csv's greedy column) and by sampling are two rows."""
    from test_report import table_row, write_run
    breakout = "replica/breakout/mixed-v0"
    for seed, greedy, score in ((0, "0", 80.0), (1, "1", 120.0), (2, "1", 100.0)):
        log = os.path.join(write_run(str(tmp_path), "dt", breakout, "cpu", seed, 200, [(200, 90.0, score)]),
                           "log.csv")
        with open(log, newline="") as f:
            rows = list(csv.DictReader(f))
        with open(log, "w", newline="") as f:
            w = csv.DictWriter(f, [*rows[0], "greedy"])
            w.writeheader()
            w.writerows(r | dict(greedy=greedy) for r in rows)
    text = evaluate.report(str(tmp_path))
    assert table_row(text, breakout, "dt", "cpu")[:4] == ["1", "200", "90.0", "80.0 ± 0.0"]
    assert table_row(text, breakout, "dt", "cpu (greedy)")[:4] == ["2", "200", "90.0", "110.0 ± 10.0"]
