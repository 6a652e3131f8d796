"""The run record (evaluate.py) as the five model scripts use it, each test against every script where the behaviour
is the script's: every bad flag is one sentence and exit 1, a run is never replaced or shared, --resume after an
interrupt at an arbitrary moment gives bit-identical weights, saves are atomic, I/O failures and sizes that cannot fit
are one sentence with the folder unchanged, --compile matches eager, analyses never retrain (each model block run
alone: test_copy.py)."""
import csv
import importlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCRIPTS = ["dt", "gpt2_dtma", "lsdt", "starformer", "dema"]
# small models that train in milliseconds a step on the tiny datasets of conftest.py
TINY = {
    "dt": ["--n-embd", "16", "--n-layer", "1", "--context", "4", "--batch-size", "8", "--warmup-steps", "5"],
    "gpt2_dtma": ["--init", "random", "--n-layer", "1", "--n-embd", "24", "--n-head", "12", "--context", "4",
                  "--batch-size", "4", "--warmup-steps", "2"],
    "lsdt": ["--n-embd", "32", "--n-layer", "2", "--batch-size", "16", "--context", "5", "--warmup-steps", "10"],
    "starformer": ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--step-embd", "8", "--step-head", "2",
                   "--context", "4", "--batch-size", "8", "--warmup-steps", "5"],
    "dema": ["--n-embd", "16", "--d-model", "8", "--d-state", "4", "--n-layer", "1", "--context", "4",
             "--batch-size", "8", "--warmup-steps", "5"],
}


def module(script):
    return importlib.import_module(script)


def flags(script, out, *extra, dataset):
    return ["--dataset", dataset, *TINY[script], "--eval-episodes", "1", "--out", str(out), *map(str, extra)]


def zero_dropout(script):
    """Flags that set every dropout of the script to 0 (compiled dropout draws other random numbers than eager)."""
    return [x for f in module(script).Config.__dataclass_fields__ if f.endswith("dropout")
            for x in ("--" + f.replace("_", "-"), "0")]


def one_sentence_exit_1(capsys, fn, *args):
    with pytest.raises(SystemExit) as e:
        fn(*args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def final_weights(out):
    return torch.load(os.path.join(out, "ckpt.pt"), weights_only=True)["model"]


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def log_rows(out):
    with open(os.path.join(out, "log.csv")) as f:
        return [{k: v for k, v in r.items() if k != "wall_time"} for r in csv.DictReader(f)]


def marked(path, name):
    text = open(os.path.join(ROOT, path)).read()
    m = re.search(rf"^# >>> {name}: begin.*?^# <<< {name}: end", text, re.S | re.M)
    assert m, f"{path} has no '# >>> {name}: begin' ... '# <<< {name}: end' block"
    return m.group(0)


# ---------------------------------------------------------------------------------------------------------------
# every flag checked before any work: one sentence, exit 1

BAD = [["--steps", "0"], ["--steps", "-3"], ["--batch-size", "0"], ["--context", "0"], ["--lr", "-1"],
       ["--lr", "nan"], ["--eval-every", "0"], ["--log-every", "0"], ["--eval-episodes", "0"], ["--grad-clip", "0"],
       ["--warmup-steps", "-1"], ["--n-head", "5"], ["--dropout", "2"], ["--dropout", "-0.1"], ["--device", "tpu"],
       ["--target-return", "nan"], ["--target-return", "inf"], ["--preset", "cpu", "--steps", "0"],
       ["--seed", "-1"], ["--seed", "100000000000000000000000000000"], ["--eval-episodes", "100000000"]]
if not torch.cuda.is_available():
    BAD.append(["--device", "cuda"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_bad_flags_are_one_sentence_before_any_work(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    fields = m.Config.__dataclass_fields__
    for bad in BAD + [["--no-such-flag", "1"], ["--steps", "ten"], ["--dropout"]]:
        out = tmp_path / "_".join(bad).replace("-", "")
        err = one_sentence_exit_1(capsys, m.main, flags(script, out, *bad, dataset=tiny_hopper))
        if any(a.startswith("--") and a[2:].replace("-", "_") not in fields for a in bad):
            assert "unrecognized arguments" in err, (bad, err)   # a flag this model does not have
        else:
            name = [a for a in bad if a.startswith("--")][-1]           # the flag at fault is named
            assert name in err or name.replace("--", "") in err, (bad, err)
        assert not out.exists(), f"{bad}: the output folder was created before the flags were checked"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_cli_errors_have_no_traceback(script, tmp_path):
    """The real command line (a subprocess): --help is usage with exit 0; a bad value is one line on stderr, exit 1."""
    p = subprocess.run([sys.executable, f"{script}.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0 and "usage:" in p.stdout and "--resume" in p.stdout
    p = subprocess.run([sys.executable, f"{script}.py", "--steps", "0", "--out", str(tmp_path / "x")], cwd=ROOT,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.strip().startswith("error:") and len(p.stderr.strip().splitlines()) == 1, p.stderr


# ---------------------------------------------------------------------------------------------------------------
# run identity: the variant names the flags that change training; config.json records the dataset used

@pytest.mark.slow
def test_run_folder_names_the_variant(tiny_maze, tmp_path, monkeypatch, capsys):
    import dt
    monkeypatch.chdir(tmp_path)
    cfg, _ = dt.parse_flags(["--preset", "cpu"])
    assert evaluate.variant_name(cfg, dt.PRESETS) == "cpu"
    assert evaluate.variant_name(dt.parse_flags([])[0], dt.PRESETS) == "default"
    cfg, _ = dt.parse_flags(["--preset", "cpu", "--no-return-token", "--context", "5", "--seed", "3", "--steps", "7",
                             "--eval-episodes", "2", "--lr", "1e-3"])  # lr 1e-3 is the preset's: not a variant
    assert evaluate.variant_name(cfg, dt.PRESETS) == "cpu_context5_no-return-token"
    assert evaluate.run_folder("dt", cfg, dt.PRESETS) == os.path.join("runs", "dt", "hopper-medium",
                                                                      "cpu_context5_no-return-token", "seed3")
    dt.main(["--dataset", tiny_maze, *TINY["dt"][:-4], "--steps", "2", "--eval-every", "2", "--eval-episodes", "1"])
    folder = tmp_path / "runs" / "dt" / tiny_maze.replace("/", "-") / "context4_n-embd16_n-layer1" / "seed0"
    config = json.loads((folder / "config.json").read_text())
    assert config["dataset_id"] == tiny_maze and config["env"] == "" and config["variant"] == folder.parent.name
    assert config["script"] == "dt" and config["seed"] == 0


@pytest.mark.parametrize("script", SCRIPTS)
def test_cpu_preset_has_a_maze_setting_under_the_flags(script, capsys):
    """--preset cpu on a maze lays the preset's "mazes" entries (50 episodes, K=1) over its own; explicit flags still
    win, the folder is still named "cpu", and locomotion data keeps the plain preset."""
    m = importlib.import_module(script)
    plain = {k: v for k, v in m.PRESETS["cpu"].items() if k not in evaluate.FAMILIES}
    mazes = m.PRESETS["cpu"]["mazes"]
    assert mazes["eval_episodes"] == 50 and mazes.get("context", 1) == 1           # StARformer keeps its K
    for name, want in (("pointmaze-medium-dense", mazes), ("replica/pointmaze/umaze-sparse-v0", mazes),
                       ("hopper-medium", plain)):
        capsys.readouterr()
        cfg, _ = m.parse_flags(["--env", name, "--preset", "cpu"])
        assert all(getattr(cfg, k) == v for k, v in (plain | want).items()), name
        assert evaluate.variant_name(cfg, m.PRESETS) == "cpu"
        said = capsys.readouterr().out                                    # the maze setting is named when it applies
        assert ("--eval-episodes 50" in said) == (want is mazes), (name, said)
    cfg, given = m.parse_flags(["--env", "pointmaze-medium-dense", "--preset", "cpu", "--context", "20"])
    assert cfg.context == 20 and cfg.eval_episodes == 50 and "context" in given
    assert evaluate.variant_name(cfg, m.PRESETS) == "cpu_context20"
    cfg, _ = m.parse_flags(["--env", "pointmaze-medium-dense"])                     # no preset: the paper's settings
    assert cfg.context != 1


# ---------------------------------------------------------------------------------------------------------------
# never overwrite, never share

@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_a_finished_run_is_not_replaced(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    args = flags(script, tmp_path / "run", "--steps", 4, "--eval-every", 4, dataset=tiny_hopper)
    m.main(args)
    before = {f: (tmp_path / "run" / f).read_bytes() for f in ("ckpt.pt", "log.csv", "config.json")}
    err = one_sentence_exit_1(capsys, m.main, args)
    assert "already holds a run" in err and "--resume" in err
    err = one_sentence_exit_1(capsys, m.main, args[:-2] + ["--steps", "6"])   # another --steps: still refused
    assert {f: (tmp_path / "run" / f).read_bytes() for f in before} == before
    assert not list((tmp_path / "run").glob("*.tmp"))


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_resume_refuses_other_settings_by_name(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    args = flags(script, tmp_path, "--steps", 2, "--eval-every", 2, dataset=tiny_hopper)
    m.main(args)
    capsys.readouterr()
    err = one_sentence_exit_1(capsys, m.main, args + ["--resume", "--lr", "0.123"])
    assert "--lr 0.123" in err or "0.123 here" in err, err
    err = one_sentence_exit_1(capsys, m.main, args + ["--resume", "--env", "walker2d-medium", "--dataset", ""])
    assert "dataset" in err, err
    # the run's own settings need not be repeated: --out and --resume are enough
    m.main(["--out", str(tmp_path), "--resume", "--steps", "3", "--eval-every", "3"])
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 3


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_a_folder_in_use_is_refused(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    (tmp_path / "run").mkdir()
    lock = evaluate.lock_folder(str(tmp_path / "run"))  # as another process's run would hold it
    try:
        err = one_sentence_exit_1(capsys, m.main, flags(script, tmp_path / "run", "--steps", 2, dataset=tiny_hopper))
        assert "in use" in err and str(os.getpid()) in err
    finally:
        lock.close()
    m.main(flags(script, tmp_path / "run", "--steps", 2, "--eval-every", 2, dataset=tiny_hopper))  # free again


def start(script, args, cwd=ROOT):
    return subprocess.Popen([sys.executable, "-u", f"{script}.py", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})


def wait_for(p, prefix):
    """Read p's stdout until a line starting with prefix; -> the lines read."""
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the process ended before printing '{prefix}': {''.join(lines)} {p.stderr.read()}")


def interrupt_resume_equals_straight(script, args, steps, tmp_path):
    """args (the run's flags, --steps included) run straight, and again with SIGINT after step 10 then --resume: the
    interrupted run exits 130 with a checkpoint inside the run, and ends with the straight run's weights and log."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    p = start(script, [*args, "--out", straight])
    assert p.wait(timeout=300) == 0, p.stderr.read()
    p = start(script, [*args, "--out", run])
    wait_for(p, "step     10")
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=300)
    assert p.returncode == 130 and "Traceback" not in err, err
    assert 0 < torch.load(run / "ckpt.pt", weights_only=True)["step"] < steps
    p = start(script, ["--out", run, "--resume"])
    assert p.wait(timeout=300) == 0, p.stderr.read()
    assert_same_weights(final_weights(straight), final_weights(run))
    assert log_rows(run) == log_rows(straight)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_two_processes_on_one_folder(script, tiny_hopper, tmp_path):
    """A second process on a folder in use refuses; a killed run's lock is released by the OS."""
    args = flags(script, tmp_path, "--steps", 100_000, "--eval-every", 20, "--log-every", 10, dataset=tiny_hopper)
    first = start(script, args)
    try:
        wait_for(first, "eval step 20")
        for extra in (["--resume"], []):     # resuming it, or starting another run there
            second = subprocess.run([sys.executable, f"{script}.py", *map(str, args), *extra], cwd=ROOT,
                                    capture_output=True, text=True)
            assert second.returncode == 1 and "in use by another run" in second.stderr, second.stderr
            assert len(second.stderr.strip().splitlines()) == 1
    finally:
        first.kill()
        first.wait()
    reached = torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"]
    again = subprocess.run([sys.executable, f"{script}.py", "--out", str(tmp_path), "--steps", str(reached + 20),
                            "--resume"], cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "resumed from" in again.stdout, again.stderr


# ---------------------------------------------------------------------------------------------------------------
# exact resume after an interrupt at an arbitrary moment (Ctrl-C lands inside a step, an evaluation, a save...)

DELAYS = {"dt": (0.05, 0.6, 1.3), "gpt2_dtma": (0.3, 1.0), "lsdt": (0.3, 1.0), "starformer": (0.3, 1.0),
          "dema": (0.3, 1.0)}


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_sigint_at_arbitrary_moments_then_resume_is_bit_identical(script, tiny_hopper, tmp_path):
    steps = 160
    common = ["--steps", steps, "--eval-every", 60, "--log-every", 20, "--seed", 1]
    straight = tmp_path / "straight"
    p = start(script, flags(script, straight, *common, dataset=tiny_hopper))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    expected_final = [line for line in out.splitlines() if line.startswith("final:")]
    # the run says its length early: after the first step and 10 timed ones, then again after the first evaluation
    length = [line for line in out.splitlines() if line.startswith("run length:")]
    assert len(length) == 2 and length[0].startswith(f"run length: {steps - 11} steps at ") and \
        "3 evaluations of 1 episodes (timed at the first)" in length[0] and "2 evaluations of" in length[1], length
    assert out.index("run length:") < out.index("step     20")
    interrupted = 0
    for i, delay in enumerate(DELAYS[script]):
        run = tmp_path / f"interrupted{i}"
        p = start(script, flags(script, run, *common, dataset=tiny_hopper))
        wait_for(p, "step")
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        rest, err = p.communicate(timeout=300)
        # -SIGINT only where the run had ended and saved ("final:") and the signal came while Python shut down
        assert p.returncode in (0, 130) or p.returncode == -signal.SIGINT and "final:" in rest, err
        assert "Traceback" not in err, err
        if p.returncode == 130:
            interrupted += 1
            assert "stopped at step" in rest and not list(run.glob("*.tmp"))
            ck = torch.load(run / "ckpt.pt", weights_only=True)
            assert 0 < ck["step"] < steps
            p = start(script, ["--out", run, "--resume"])
            rest, err = p.communicate(timeout=300)
            assert p.returncode == 0, err
        assert [line for line in rest.splitlines() if line.startswith("final:")] == expected_final
        assert_same_weights(final_weights(straight), final_weights(run))
        assert log_rows(run) == log_rows(straight)
    assert interrupted, "no run was still training when the signal came: make the runs longer"


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_kill_9_loses_no_logged_step(script, tiny_hopper, tmp_path):
    """SIGKILL at any instant: log.csv covers every step of the checkpoint, and the resumed run's log is whole."""
    common = ["--steps", 200, "--eval-every", 40, "--log-every", 10]
    straight, run = tmp_path / "straight", tmp_path / "killed"
    assert start(script, flags(script, straight, *common, dataset=tiny_hopper)).wait(timeout=300) == 0
    assert not list(straight.glob("*.tmp"))
    p = start(script, flags(script, run, *common, dataset=tiny_hopper))
    wait_for(p, "eval step 40")
    time.sleep(0.4)
    p.kill()
    p.wait()
    ck = torch.load(run / "ckpt.pt", weights_only=True)
    on_disk = log_rows(run)
    assert all({k: str(v) for k, v in r.items() if k != "wall_time"} in on_disk for r in ck["rows"])
    p = start(script, ["--out", run, "--resume"])
    assert p.wait(timeout=300) == 0, p.stderr.read()
    assert log_rows(run) == log_rows(straight)
    assert_same_weights(final_weights(straight), final_weights(run))


# ---------------------------------------------------------------------------------------------------------------
# I/O failures: one sentence, nothing lost

@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_damaged_checkpoints_are_one_sentence(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    args = flags(script, tmp_path, "--steps", 2, "--eval-every", 2, dataset=tiny_hopper)
    m.main(args)
    good = (tmp_path / "ckpt.pt").read_bytes()
    saved_rows = [r["step"] for r in torch.load(tmp_path / "ckpt.pt", weights_only=True)["rows"]]
    for content, words in ((good[: len(good) // 2], "cannot be read"), (os.urandom(5000), "cannot be read"),
                           (b"", "cannot be read")):
        (tmp_path / "ckpt.pt").write_bytes(content)
        assert words in one_sentence_exit_1(capsys, m.main, args + ["--resume", "--steps", "3"])
    torch.save({"model": {}, "step": 3}, tmp_path / "ckpt.pt")                     # someone else's torch file
    assert f"not a checkpoint of {script}.py" in one_sentence_exit_1(capsys, m.main, args + ["--resume"])
    (tmp_path / "ckpt.pt").write_bytes(good)
    (tmp_path / "log.csv").write_text("garbage,\n\x00\x01 not a log\n")           # the checkpoint holds the log
    m.main(args + ["--resume", "--steps", "3", "--eval-every", "3"])
    steps = [int(r["step"]) for r in log_rows(tmp_path)]
    assert steps[:len(saved_rows)] == saved_rows and set(steps[len(saved_rows):]) == {3}


@pytest.mark.parametrize("script", SCRIPTS)
def test_unwritable_out_is_one_sentence(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    (tmp_path / "file").write_text("x")
    err = one_sentence_exit_1(capsys, m.main, flags(script, tmp_path / "file", "--steps", 2, dataset=tiny_hopper))
    assert "is a file" in err
    err = one_sentence_exit_1(capsys, m.main, flags(script, tmp_path / "file" / "run", "--steps", 2,
                                                    dataset=tiny_hopper))
    assert "cannot create the output folder" in err


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_full_disk_keeps_the_previous_checkpoint(script, tiny_hopper, tmp_path, capsys, monkeypatch):
    m = module(script)
    saves, real_save, real_usage = [], torch.save, evaluate.shutil.disk_usage

    def failing_save(obj, path, *a, **kw):
        saves.append(path)
        if len(saves) > 1:     # the second checkpoint hits a full disk halfway through
            with open(path, "wb") as f:
                f.write(b"partial")
            raise RuntimeError("[enforce fail at inline_container.cc] PytorchStreamWriter failed writing file data/0")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(torch, "save", failing_save)
    monkeypatch.setattr(evaluate.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))   # the disk is full
    err = one_sentence_exit_1(capsys, m.main, flags(script, tmp_path, "--steps", 4, "--eval-every", 2,
                                                    dataset=tiny_hopper))
    assert "could not write" in err and "previous copy is kept" in err and "enforce fail" not in err
    assert f"no space left on the device holding {tmp_path}" in err
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == 2 and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_non_finite_loss_stops_with_the_step(script, tiny_hopper, tmp_path, capsys, monkeypatch):
    m = module(script)
    calls, real = [0], m.loss_fn

    def poisoned(model, batch, cfg):
        calls[0] += batch["states"].device.type != "meta"     # not train()'s memory count, on the meta device
        loss = real(model, batch, cfg)
        return loss * float("nan") if calls[0] == 3 else loss

    monkeypatch.setattr(m, "loss_fn", poisoned)
    err = one_sentence_exit_1(capsys, m.main, flags(script, tmp_path, "--steps", 10, "--log-every", 5,
                                                    dataset=tiny_hopper))
    assert "at step 3" in err and "nan" in err
    assert not (tmp_path / "ckpt.pt").exists()


# ---------------------------------------------------------------------------------------------------------------
# analyses read the checkpoint and never retrain

@pytest.mark.slow
def test_analysis_reads_the_run_and_never_trains(tiny_hopper, tmp_path, capsys):
    import dt
    err = one_sentence_exit_1(capsys, dt.main, ["--out", str(tmp_path / "none"), "--bench-eval"])
    assert "no checkpoint" in err and not (tmp_path / "none").exists()
    dt.main(flags("dt", tmp_path, "--steps", 2, "--eval-every", 2, "--preset", "cpu", dataset=tiny_hopper))
    before = (tmp_path / "ckpt.pt").read_bytes()
    capsys.readouterr()
    dt.main(["--out", str(tmp_path), "--bench-eval"])         # the preset run's settings come from its checkpoint
    assert "speed-up" in capsys.readouterr().out and (tmp_path / "ckpt.pt").read_bytes() == before


# ---------------------------------------------------------------------------------------------------------------
# --compile, --amp, --bench

@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_compile_matches_eager(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    args = ["--steps", 3, "--eval-every", 3, *zero_dropout(script)]
    m.main(flags(script, tmp_path / "eager", *args, dataset=tiny_hopper))
    m.main(flags(script, tmp_path / "compiled", *args, "--compile", dataset=tiny_hopper))
    a, b = final_weights(tmp_path / "eager"), final_weights(tmp_path / "compiled")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=k)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_amp_runs_and_loss_stays_fp32(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    m.main(flags(script, tmp_path, "--steps", 3, "--eval-every", 3, "--log-every", 1, "--amp", dataset=tiny_hopper))
    losses = [float(r["loss"]) for r in log_rows(tmp_path) if r["loss"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_bench_times_train_and_writes_nothing(script, capsys, monkeypatch, tmp_path):
    m = module(script)
    monkeypatch.setattr(torch, "compile", lambda model: model)   # the compile itself is tested above
    monkeypatch.chdir(tmp_path)
    m.main(["--bench", *TINY[script], "--steps", "2"])
    lines = [line for line in capsys.readouterr().out.strip().splitlines() if not line.startswith(("lsdt:", "blocks"))]
    assert lines[0].startswith(f"bench {script}") and "tokens per batch" in lines[0]
    assert os.listdir(tmp_path) == []                          # no run folder
    assert [line.split()[0] for line in lines[1:]] == ["eager", "compiled"]
    assert all("ms/step" in line and "tokens/s" in line for line in lines[1:])


# ---------------------------------------------------------------------------------------------------------------
# the holes a fault trial found: each one sentence, exit 1, the folder unchanged

def snapshot(folder):
    """Every file of a folder with its bytes (the lock file aside); None when the folder does not exist."""
    if not os.path.isdir(folder):
        return None
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder)) if f != ".lock"}


@pytest.mark.parametrize("script", SCRIPTS)
def test_resume_needs_a_checkpoint(script, tiny_hopper, tmp_path, capsys, monkeypatch):
    """--resume where ckpt.pt is missing (the run stopped before its first checkpoint, or the file was moved away)
    never starts a fresh run over the folder's log.csv and config.json, and never reaches for a dataset."""
    m = module(script)
    monkeypatch.setattr(m.data_lib, "load_data", lambda *a, **k: pytest.fail("--resume without ckpt.pt loaded data"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.csv").write_text("step,loss\n100,0.5\n")
    (run / "config.json").write_text(json.dumps({"script": script, "steps": 200}))
    before = snapshot(run)
    for extra in ([], ["--dataset", tiny_hopper, "--steps", "300"]):
        err = one_sentence_exit_1(capsys, m.main, ["--out", str(run), "--resume", *extra])
        assert "no ckpt.pt to resume from" in err and "put ckpt.pt back" in err, err
        assert snapshot(run) == before
    # the same folder without --resume (a run killed before its first checkpoint): the sentence says what works
    err = one_sentence_exit_1(capsys, m.main, ["--out", str(run), "--dataset", tiny_hopper, "--steps", "2"])
    assert "stopped before its first checkpoint" in err and "--resume" not in err, err
    assert snapshot(run) == before
    for folder in (tmp_path / "missing", tmp_path / "empty"):
        if folder.name == "empty":
            folder.mkdir()
        err = one_sentence_exit_1(capsys, m.main, ["--out", str(folder), "--resume"])
        assert "holds no run to resume" in err and "drop --resume" in err, err
        assert snapshot(folder) == ({} if folder.name == "empty" else None)


@pytest.mark.parametrize("script", SCRIPTS)
def test_out_never_writes_into_a_folder_that_is_not_its_run(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    gpt2 = tmp_path / "gpt2"                        # someone's model folder, with a config.json of its own
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"n_layer": 12, "n_embd": 768}))
    (gpt2 / "model.safetensors").write_bytes(b"weights")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("my notes")
    other = tmp_path / "other"                      # a run of another script
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"script": "someone_else", "steps": 3}))
    (other / "log.csv").write_text("step\n")
    for folder, words in ((gpt2, "not a run of"), (notes, "not a run of"), (other, "not a run of")):
        before = snapshot(folder)
        err = one_sentence_exit_1(capsys, m.main, flags(script, folder, "--steps", 2, dataset=tiny_hopper))
        assert words in err and "nothing there is overwritten" in err, err
        assert snapshot(folder) == before


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_resume_cannot_shorten_a_run(script, tiny_hopper, tmp_path, capsys):
    m = module(script)
    m.main(flags(script, tmp_path, "--steps", 4, "--eval-every", 4, dataset=tiny_hopper))
    before = snapshot(tmp_path)
    err = one_sentence_exit_1(capsys, m.main, ["--out", str(tmp_path), "--resume", "--steps", "2"])
    assert "--steps 2 is below the step this run has reached (4)" in err, err
    assert snapshot(tmp_path) == before and json.loads((tmp_path / "config.json").read_text())["steps"] == 4


# script -> flags that make one training step far too large for any machine (the model's own width flags)
HUGE = {"dt": ["--n-embd", "65536"], "gpt2_dtma": ["--n-embd", "65536", "--n-head", "16"],
        "lsdt": ["--n-embd", "65536"], "starformer": ["--n-embd", "65536"], "dema": ["--d-model", "65536"]}


@pytest.mark.parametrize("script", SCRIPTS)
def test_sizes_that_mean_nothing_or_cannot_fit_are_one_sentence_before_any_folder(script, tiny_hopper, tmp_path,
                                                                                   capsys):
    """A context longer than any episode and a return target far outside the data mean nothing; a batch or a width
    that cannot fit says what it needs before anything is allocated (train() sizes a step on the meta device)."""
    m = module(script)
    target = ["--reward-input", "rtg"] if script == "starformer" else []      # StARformer has a target only then
    for bad, words in ((["--context", "100000"], "longer than the longest episode"),
                       ([*target, "--target-return", "1e30"], "more than 100 times the largest episode return"),
                       (["--batch-size", "100000000"], "a training step needs about"),
                       (HUGE[script], "a GPT-2 has at most" if script == "gpt2_dtma" else "a training step needs about")):
        out = tmp_path / "_".join(bad).replace("-", "")
        err = one_sentence_exit_1(capsys, m.main, flags(script, out, *bad, dataset=tiny_hopper))
        assert words in err, (bad, err)
        assert not out.exists(), f"{bad}: the output folder was created"


def test_gpt2_random_blocks_stay_within_gpt2s_bounds(tiny_hopper, tmp_path, capsys):
    import gpt2_dtma
    err = one_sentence_exit_1(capsys, gpt2_dtma.main, flags("gpt2_dtma", tmp_path / "r", "--n-layer", 99,
                                                           dataset=tiny_hopper))
    assert "--n-layer 99: a GPT-2 has at most 96" in err and not (tmp_path / "r").exists()


def test_an_allocation_failure_is_one_sentence(tiny_hopper, tmp_path, capsys, monkeypatch):
    """Where the memory count cannot see it (another process takes the memory), the allocator's error is still one
    sentence, without torch's C++ words."""
    import dt
    real = dt.DecisionTransformer.forward

    def out_of_memory(*a, **kw):
        if torch.is_grad_enabled() and a[1].device.type != "meta":
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: you "
                               "tried to allocate 644245094400 bytes.")
        return real(*a, **kw)
    monkeypatch.setattr(dt.DecisionTransformer, "forward", out_of_memory)
    err = one_sentence_exit_1(capsys, dt.main, flags("dt", tmp_path / "r", "--steps", 2, dataset=tiny_hopper))
    assert err == "error: out of memory (it asked for 600 GB at once); lower --batch-size, --context or the model's size"
    assert not (tmp_path / "r").exists()        # a new folder that never got a log line is removed again


# ---------------------------------------------------------------------------------------------------------------
# --gif: an episode you can watch, from the run's checkpoint

@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.slow
def test_gif_renders_one_episode_and_changes_nothing_else(script, tiny_hopper, tiny_maze, tmp_path, capsys):
    """A frame after reset, one every ceil(horizon / 150) steps and the last; 240 x 240; the run's files untouched.
    Skipped, with the reason, where MuJoCo finds no offscreen OpenGL."""
    from PIL import Image
    try:
        evaluate.pick_gl()
    except evaluate.DataError as e:
        pytest.skip(f"no offscreen OpenGL here: {e}")
    m = module(script)
    for dataset in (tiny_hopper, tiny_maze) if script in ("dt", "lsdt") else (tiny_hopper,):
        out = tmp_path / dataset.split("/")[1]
        m.main(flags(script, out, "--steps", 2, "--eval-every", 2, dataset=dataset))
        before = snapshot(out)
        capsys.readouterr()
        m.main(["--out", str(out), "--gif"])
        said = capsys.readouterr().out
        gif = Image.open(out / "episode.gif")
        length = int(re.search(r"length=(\d+)", said)[1])
        every = -(-(1000 if dataset == tiny_hopper else 40) // 150)          # the envs' horizons
        assert gif.n_frames == 1 + length // every + (length % every > 0), (said, gif.n_frames)
        assert gif.size == (240, 240) and os.path.getsize(out / "episode.gif") < 5 * 2 ** 20
        after = snapshot(out)
        assert after.pop("episode.gif") and after == before


def test_run_length_names_the_faster_ways_past_a_few_hours_on_a_cpu(capsys):
    """Run.length: the steps left times the measured step, the evaluations left (counted until one is timed), and
    past three hours on a CPU the words for --preset cpu and the GPU."""
    run = evaluate.Run.__new__(evaluate.Run)
    run.cfg = module("dt").Config(steps=100_000, eval_every=10_000, eval_episodes=100)
    run.device, run.step_s, run.eval_s = torch.device("cpu"), 0.9, None
    run.length(11)
    said = capsys.readouterr().out
    assert said.startswith("run length: 99,989 steps at 900 ms/step = 25.0 h, plus 10 evaluations of 100 episodes")
    assert "--preset cpu" in said and "--device cuda" in said
    run.step_s, run.eval_s = 0.01, 30.0
    run.length(10_000)
    said = capsys.readouterr().out
    assert "90,000 steps at 10 ms/step = 15 min, plus 9 evaluations of 30 s each: about 20 min" in said, said
    assert "--preset cpu" not in said
