"""evaluate.py report: run folders with known config.json / log.csv -> a table whose numbers are checked by hand."""
import csv
import json
import os
import subprocess
import sys

import pytest

import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = ["step", "loss", "lr", "target", "eval_return", "eval_return_std", "normalized_score", "normalized_score_std",
          "success_rate", "steps_to_goal", "wall_time"]
HOPPER, MAZE = "replica/hopper/medium-v0", "replica/pointmaze/umaze-dense-v0"


def write_run(root, script, dataset, variant, seed, steps, evals, train_steps=(), extra=None, tail=""):
    """A run folder as the model files write it. evals: (step, target, score[, success_rate, steps_to_goal]) rows."""
    folder = os.path.join(root, script, dataset.replace("/", "-"), variant, f"seed{seed}")
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(seed=seed, steps=steps, env="", dataset=dataset, script=script, variant=variant,
                       dataset_id=dataset, lr=1e-4), f)
    fields = FIELDS[:3] + list(extra or {}) + FIELDS[3:]
    rows = [dict(step=s, loss=0.5, lr=1e-4, wall_time=1.0, **(extra or {})) for s in train_steps]
    for s, target, score, *goal in evals:
        rows.append(dict(step=s, target=target, eval_return=10 * score, eval_return_std=1.0, normalized_score=score,
                         normalized_score_std=2.0, success_rate=goal[0] if goal else "",
                         steps_to_goal=goal[1] if goal else "", wall_time=2.0))
    with open(os.path.join(folder, "log.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fields, restval="")
        w.writeheader()
        w.writerows(sorted(rows, key=lambda r: r["step"]))   # stable: a step's training row, then its evaluations
        f.write(tail)
    return folder


def hopper_evals(scores, steps, noise=90.0):
    """Evaluations of two targets per step: 3600 first (the headline), then 1800 with a score that must be ignored."""
    return [row for s, v in zip(steps, scores) for row in ((s, 3600.0, v), (s, 1800.0, noise))]


@pytest.fixture
def runs(tmp_path):
    root = str(tmp_path / "runs")
    # dt/default: 3 finished seeds, evaluated at 100, 200, 300
    for seed, scores in enumerate(([20, 50, 40], [30, 35, 45], [10, 60, 55])):
        write_run(root, "dt", HOPPER, "default", seed, 300, hopper_evals(scores, (100, 200, 300)), (100, 200, 300))
    write_run(root, "dt", HOPPER, "default", 3, 300, hopper_evals([99], (100,)), (100, 150))       # in progress
    # dt/cpu: 2 finished seeds (one with a half-written last line), one without evaluations, one unreadable log
    write_run(root, "dt", HOPPER, "cpu", 0, 200, hopper_evals([10, 20], (100, 200)), (100, 200))
    write_run(root, "dt", HOPPER, "cpu", 1, 200, hopper_evals([30, 25], (100, 200)), (100, 200),
              tail="200,,,3600.0,990.0,1.0,9")
    write_run(root, "dt", HOPPER, "cpu", 2, 200, [], (100,))
    garbage = write_run(root, "dt", HOPPER, "cpu", 3, 200, [], (100,))
    with open(os.path.join(garbage, "log.csv"), "wb") as f:
        f.write(b"\x89\xff\xfe\x00 not a csv \xc3")
    # lsdt on a maze, with an extra model column: success rate and steps to the goal
    write_run(root, "lsdt", MAZE, "default", 0, 100, [(50, 20.0, 40, 0.5, 200), (100, 20.0, 60, 0.8, 150)], (50, 100),
              extra={"g_markov": 0.3})
    write_run(root, "lsdt", MAZE, "default", 1, 100, [(50, 20.0, 70, 0.9, 100), (100, 20.0, 50, 0.6, 180)], (50, 100),
              extra={"g_markov": 0.3})
    return root


def table_row(text, dataset, script, variant):
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:3] == [dataset, script, variant]:
            return cells[3:]
    raise AssertionError(f"no row for {dataset} {script} {variant} in\n{text}")


def test_report_numbers_by_hand(runs):
    text = evaluate.report(runs)
    header = [c.strip() for c in next(l for l in text.splitlines() if l.startswith("| dataset")).strip("|").split("|")]
    assert header == ["dataset", "script", "variant", "seeds", "steps", "target", "last score", "best score", "last return",
                      "success % (last)", "steps to goal (last)"]
    # dt/default, target 3600: last = 40, 45, 55 -> mean 46.67, population std
    #   sqrt(((-6.67)^2 + (-1.67)^2 + 8.33^2) / 3) = 6.24
    #                          best = 50, 45, 60 -> mean 51.67, std 6.24 (the 1800 rows' 90 never counts)
    #   last return (10 x the score in these logs) = 400, 450, 550 -> mean 466.67, std 62.36
    assert table_row(text, HOPPER, "dt", "default") == ["3", "300", "3600.0", "46.7 ± 6.2", "51.7 ± 6.2",
                                                        "466.7 ± 62.4", "-", "-"]
    # dt/cpu: last = 20, 25 -> 22.5 ± 2.5; best = 20, 30 -> 25.0 ± 5.0 (the half-written line's 990 is skipped)
    assert table_row(text, HOPPER, "dt", "cpu") == ["2", "200", "3600.0", "22.5 ± 2.5", "25.0 ± 5.0", "225.0 ± 25.0",
                                                    "-", "-"]
    # lsdt maze: last = 60, 50; best = 60, 70; success 80 %, 60 %; steps to goal 150, 180
    assert table_row(text, MAZE, "lsdt", "default") == ["2", "100", "20.0", "55.0 ± 5.0", "65.0 ± 5.0", "550.0 ± 50.0",
                                                        "70.0 ± 10.0", "165.0 ± 15.0"]
    lines = text.splitlines()
    rows = [l for l in lines if l.startswith("| replica")]
    assert [r.split("|")[1].strip() for r in rows] == [HOPPER, HOPPER, MAZE]       # grouped by dataset
    assert "population std, ddof=0" in text and "first target" in text
    below = lines[lines.index("Not in the table:") + 1:]
    hop = HOPPER.replace("/", "-")
    assert f"- dt/{hop}/default/seed3: in progress at step 150 of 300" in below
    assert f"- dt/{hop}/cpu/seed2: no evaluation yet" in below
    assert any(l.startswith(f"- dt/{hop}/cpu/seed3: unreadable") for l in below) and len(below) == 3
    assert open(os.path.join(runs, "report.md")).read() == text + "\n" + evaluate.report_mark(text + "\n")
    with open(os.path.join(runs, "report.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_report_steps_that_differ_and_one_seed(tmp_path):
    root = str(tmp_path)
    write_run(root, "dt", HOPPER, "default", 0, 100, hopper_evals([40], (100,)))
    write_run(root, "dt", HOPPER, "default", 1, 200, hopper_evals([10, 20], (100, 200)))
    write_run(root, "dema", HOPPER, "default", 0, 100, hopper_evals([33], (100,)))
    text = evaluate.report(root)
    assert table_row(text, HOPPER, "dt", "default") == ["2", "differ: 100, 200", "3600.0", "30.0 ± 10.0",
                                                        "30.0 ± 10.0", "300.0 ± 100.0"]
    assert table_row(text, HOPPER, "dema", "default") == ["1", "100", "3600.0", "33.0 ± 0.0", "33.0 ± 0.0", "330.0 ± 0.0"]
    assert "success" not in text and "Not in the table" not in text


def test_atari_rows_are_said_to_be_gamer_normalised(tmp_path):
    """A report over an Atari run and a MuJoCo one says which normalisation each family's score is; best = the best
    evaluation's score at the first target (the second target's higher score never counts)."""
    root, breakout = str(tmp_path), "replica/breakout/mixed-v0"
    write_run(root, "dt", HOPPER, "default", 0, 200, hopper_evals([30, 20], (100, 200)))
    write_run(root, "dt", breakout, "cpu", 0, 200, [(100, 90.0, 103.0), (100, 10.0, 500.0), (200, 90.0, 80.0)])
    text = evaluate.report(root)
    head = text.split("| dataset |")[0]
    assert "D4RL's expert return (MuJoCo, Adroit, mazes)" in head
    assert "on Atari rows, a human gamer's (gamer-normalised)" in head
    assert "**best** = the best evaluation's during training" in head
    assert table_row(text, breakout, "dt", "cpu")[:5] == ["1", "200", "90.0", "80.0 ± 0.0", "103.0 ± 0.0"]
    assert table_row(text, HOPPER, "dt", "default")[3:5] == ["20.0 ± 0.0", "30.0 ± 0.0"]


@pytest.mark.slow
def test_report_cli(runs):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "report", runs], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout + evaluate.report_mark(r.stdout) == open(os.path.join(runs, "report.md")).read()
    assert "46.7 ± 6.2" in r.stdout
    r = subprocess.run([sys.executable, os.path.join(ROOT, "evaluate.py"), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "usage: evaluate.py" in r.stdout and "report" in r.stdout


def test_report_cli_errors(tmp_path, capsys):
    for runs_dir, message in ((tmp_path / "missing", "is not a folder"), (tmp_path, "holds no run folder")):
        with pytest.raises(SystemExit) as e:
            evaluate.main(["report", str(runs_dir)])
        err = capsys.readouterr().err
        assert e.value.code == 1 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_value_that_is_not_a_number_is_named_not_in_progress(tmp_path):
    """A finished run whose log.csv holds a score that is not a finite number (hand-edited, or NaN) is unreadable,
    and says where; it is never reported as a run in progress, nor averaged as 'nan'."""
    root = str(tmp_path)
    write_run(root, "dt", HOPPER, "default", 0, 200, hopper_evals([10, 20], (100, 200)))
    for seed, bad in ((1, "abc"), (2, "nan")):
        folder = write_run(root, "dt", HOPPER, "default", seed, 200, hopper_evals([10, 20.5], (100, 200)))
        text = open(os.path.join(folder, "log.csv")).read().replace(",20.5,", f",{bad},", 1)
        open(os.path.join(folder, "log.csv"), "w").write(text)
    text = evaluate.report(root)
    hop = HOPPER.replace("/", "-")
    assert f"- dt/{hop}/default/seed1: unreadable (log.csv line 4: normalized_score 'abc' is not a finite number)" in text
    assert f"- dt/{hop}/default/seed2: unreadable (log.csv line 4: normalized_score 'nan' is not a finite number)" in text
    assert table_row(text, HOPPER, "dt", "default")[:4] == ["1", "200", "3600.0", "20.0 ± 0.0"] and "in progress" not in text


def test_copies_of_a_seed_count_once_and_every_folder_left_out_is_named(tmp_path):
    """Three copies of one seed-0 run are one seed (the copies are named, not averaged); a folder with a run's file
    but no config.json is named; a run stopped between log lines shows its checkpoint's step."""
    import shutil
    import torch
    root = str(tmp_path / "runs")
    first = write_run(root, "dt", HOPPER, "cpu", 0, 200, hopper_evals([10, 20], (100, 200)), (100, 200))
    for copy in ("copy1", "copy2"):
        shutil.copytree(first, os.path.join(root, copy))
    write_run(root, "dt", HOPPER, "cpu", 1, 200, hopper_evals([30, 40], (100, 200)), (100, 200))
    stray = os.path.join(root, "stray")
    os.makedirs(stray)
    open(os.path.join(stray, "log.csv"), "w").write("step,loss\n1,0.5\n")
    stopped = write_run(root, "dt", HOPPER, "default", 0, 200, hopper_evals([10], (100,)), (100,))
    torch.save(dict(step=197, model={}), os.path.join(stopped, "ckpt.pt"))
    text = evaluate.report(root)
    assert table_row(text, HOPPER, "dt", "cpu")[0] == "2"                          # seeds 0 and 1, not 4
    assert table_row(text, HOPPER, "dt", "cpu")[3] == "30.0 ± 10.0"                 # last: 20 and 40
    assert text.count(": seed 0 again (the table counts ") == 2                   # two of the three are named
    assert "stray: no config.json" in text
    assert "in progress at step 197 of 200" in text


def test_a_folder_that_cannot_be_written_still_prints_its_table(runs, capsys, monkeypatch):
    real_open = open

    def read_only(path, mode="r", *a, **k):
        if "w" in mode and str(path).endswith("report.md"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, mode, *a, **k)
    monkeypatch.setattr("builtins.open", read_only)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["report", runs])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and "| dataset |" in out
    assert err.startswith("error: the table above could not be saved") and "\n" not in err.strip()
