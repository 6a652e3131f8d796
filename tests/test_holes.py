"""Issue 54, the holes a hostile user found: restating a run's preset on --resume changes nothing; report keeps
the user's files; make's refusal hints name counts that every later check accepts; make says which policies it
used; an --out without a checkpoint is said, not replaced by GPT-2's weights; --bench refuses run flags."""
import os
import re

import pytest
import torch

import dt
import evaluate
from test_convert import minari_tmp  # noqa: F401 (a fixture)
from test_evaluate import files
from test_harness import one_sentence_exit_1

# ---------------------------------------------------------------------------------------------------------------
# 1. --resume --preset NAME on a run made with that preset: the run's own settings, not the preset's

TINY_CPU = ["--preset", "cpu", "--steps", "4", "--eval-every", "2", "--eval-episodes", "1"]
SMALLER = ["--n-embd", "16", "--n-layer", "1", "--context", "4", "--batch-size", "8", "--warmup-steps", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("model", [[], SMALLER], ids=["preset-model", "smaller-model"])
def test_restating_a_finished_runs_preset_changes_nothing(model, tiny_hopper, tmp_path, capsys):
    """--preset cpu's own values (6000 steps, an evaluation every 2000, 10 episodes, the cosine's end; its model)
    are not typed, so they neither replace the run's nor are refused: the finished run stays at step 4, its files
    byte for byte."""
    out = tmp_path / "run"
    dt.main(["--dataset", tiny_hopper, *TINY_CPU, *model, "--out", str(out)])
    before = files(out)
    capsys.readouterr()

    dt.main(["--out", str(out), "--resume", "--preset", "cpu"])
    said = capsys.readouterr().out
    assert f"resumed from {out}/ckpt.pt at step 4 of 4; the run is finished" in said, said
    assert "episodes=1" in said                                            # its own --eval-episodes, not 10
    assert files(out) == before

    # a flag typed still counts: --steps 6 continues it
    dt.main(["--out", str(out), "--resume", "--preset", "cpu", "--steps", "6"])
    assert torch.load(out / "ckpt.pt", weights_only=True)["step"] == 6


def test_resume_with_another_preset_is_refused_by_name(tiny_hopper, tmp_path, capsys, monkeypatch):
    """The preset typed is checked against the run's, as any flag that changes what is trained."""
    out = tmp_path / "run"
    out.mkdir()
    cfg, _ = dt.parse_flags(["--dataset", tiny_hopper, *TINY_CPU[2:]])                     # no preset
    torch.save(dict(dict.fromkeys(evaluate.CKPT_KEYS), script="dt", step=4, dataset_id=tiny_hopper,
                    config=vars(cfg) | dict(out=str(out))), out / "ckpt.pt")
    monkeypatch.setattr(dt.data_lib, "load_data", lambda *a, **k: pytest.fail("loaded data before refusing"))
    err = one_sentence_exit_1(capsys, dt.main, ["--out", str(out), "--resume", "--preset", "cpu"])
    assert "(--preset none there, cpu here)" in err, err

# ---------------------------------------------------------------------------------------------------------------
# 2. report replaces only the report.md and report.png it wrote, unchanged


def test_report_replaces_its_own_report_and_keeps_any_other_file(tmp_path, capsys):
    """Its own report again (a seed added: the new table); a user's report.md, its own report edited, or a
    report.png it did not draw: one sentence, exit 1, the file byte for byte, nothing else written."""
    from test_report import HOPPER, hopper_evals, write_run
    root = tmp_path / "runs"
    write_run(str(root), "dt", HOPPER, "default", 0, 200, hopper_evals([10, 20], (100, 200)))
    evaluate.main(["report", str(root)])
    write_run(str(root), "dt", HOPPER, "default", 1, 200, hopper_evals([10, 40], (100, 200)))
    evaluate.main(["report", str(root)])
    text = (root / "report.md").read_text()
    assert "| 2 | 200 | 3600.0 | 30.0 ± 10.0 |" in text and capsys.readouterr().out.count("| dataset |") == 2

    # the user's notes, and the report with a line added by hand
    ours = (root / "report.md").read_bytes()
    for theirs in (b"# my notes on these runs\n", ours.replace(b"\n<!--", b"\nseed 1 was run twice\n<!--"), b""):
        (root / "report.md").write_bytes(theirs)
        err = one_sentence_exit_1(capsys, evaluate.main, ["report", str(root)])
        assert err == (f"error: {root}/report.md was not written by evaluate.py report, or was changed since, so "
                       f"the report keeps it; move or rename it, then run the report again")
        assert (root / "report.md").read_bytes() == theirs and capsys.readouterr().out == ""

    # the user's own figure under the report's name (a PNG without its mark), beside the user's notes
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.figure().savefig(root / "report.png")
    figure = (root / "report.png").read_bytes()
    err = one_sentence_exit_1(capsys, evaluate.main, ["report", str(root)])
    assert f"{root}/report.md and {root}/report.png were not written by evaluate.py report" in err, err
    (root / "report.md").unlink()
    assert "report.png was not written" in one_sentence_exit_1(capsys, evaluate.main, ["report", str(root)])
    assert (root / "report.png").read_bytes() == figure and not (root / "report.md").exists()
    assert sorted(os.listdir(root)) == ["dt", "report.png"]

# ---------------------------------------------------------------------------------------------------------------
# 3. make's refusal hints: the --steps a refusal names passes every later check, the write's too


def refused_steps(capsys, argv, kind):
    import data
    err = one_sentence_exit_1(capsys, data.main, argv)
    fit = re.fullmatch(rf"error: --steps [\d,]+ would {kind} .*; use --steps ([\d,]+) or fewer(, or set "
                       rf"MINARI_DATASETS_PATH to a folder with room)?", err)
    assert fit, err
    return fit[1].replace(",", "")


def disk_of(monkeypatch, free):
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(2 ** 40, 2 ** 40 - free, free))


@pytest.mark.slow
def test_the_disk_hint_is_a_make_that_the_write_accepts(minari_tmp, monkeypatch, capsys):
    """2 MB free: the --steps that the refusal names makes hopper-medium-replay whole, its write's own check (with
    each episode's arrays, which the first estimate used to leave out) passed. ARS stops at its first update (the
    level lowered), so the data holds the short episodes of an untrained policy."""
    import data
    disk_of(monkeypatch, 2 * 2 ** 20)
    steps = refused_steps(capsys, ["make", "hopper-medium-replay", "--steps", "1000000"], "write about")
    monkeypatch.setattr(data, "LEVELS", {"medium": -1.0, "expert": -1.0})
    folder = data.make("hopper-medium-replay", steps=int(steps))
    said = capsys.readouterr().out
    assert os.path.isdir(folder) and f"{int(steps):,} steps" in said, said
    assert not any(name.startswith(data.PARTIAL_PREFIX) for name in os.listdir(minari_tmp))


def test_the_memory_hint_passes_the_disk_check_and_a_little_less_memory(minari_tmp, monkeypatch, capsys):
    """The memory refusal's --steps fits the disk too (the hint is the most that both allow), and still fits when
    the memory free has moved down by 1% (the edge itself would not)."""
    import data
    monkeypatch.setattr(data, "ars", lambda *args, **settings: pytest.fail("reached ARS"))
    disk_of(monkeypatch, 30 * 2 ** 20)
    monkeypatch.setattr(data, "available_memory", lambda: 2 ** 30)
    steps = refused_steps(capsys, ["make", "hopper-medium", "--steps", "100000000"], "take about")
    monkeypatch.setattr(data, "available_memory", lambda: int(0.99 * 2 ** 30))
    with pytest.raises(pytest.fail.Exception, match="reached ARS"):    # both checks passed
        data.main(["make", "hopper-medium", "--steps", steps])

    # the memory alone short: its hint is at most the memory's edge, below it by HINT_ROOM
    disk_of(monkeypatch, 2 ** 40)
    monkeypatch.setattr(data, "available_memory", lambda: 2 ** 26)
    steps = int(refused_steps(capsys, ["make", "hopper-medium", "--steps", "100000000"], "take about"))
    edge = 2 ** 26 // (8 * 11 + 4 * 3 + 128)                              # float64 states, float32 actions, lists
    assert 0.9 * edge < steps <= 0.95 * edge, (steps, edge)

# ---------------------------------------------------------------------------------------------------------------
# 4. make hopper-medium-replay says how many of the run's policies its data holds


def test_medium_replay_says_which_policies_its_data_holds(minari_tmp, monkeypatch, capsys):
    """Five policies, the fifth the first at the level (four that fall at once, then M = 0, which stands): 12
    steps hold the episodes of the first one or two, and the line says so, not 'its 5 policies'."""
    import data
    import numpy as np

    def five(rollout, shape, rng, **settings):
        for k in range(10):
            yield np.full(shape, 5.0 if k < 4 else 0.0), np.zeros(shape[1]), np.ones(shape[1]), []
    monkeypatch.setattr(data, "ars", five)
    low, high = data.D4RL_REF_SCORES["Hopper"]
    monkeypatch.setattr(data, "LEVELS", {"medium": (80 - low) / (high - low), "expert": 1.0})  # a return of 80
    data.main(["make", "hopper-medium-replay", "--steps", "12"])
    out = capsys.readouterr().out
    said = re.search(r"at ARS iteration 5 of 1 run\(s\), 0 training steps, the data from the first (\d) of its 5 "
                     r"policies, an episode of each in turn", out)
    assert said and f": {said[1]} episodes, 12 steps" in out, out

# ---------------------------------------------------------------------------------------------------------------
# 5. gpt2_dtma.py --markov with an --out that holds no checkpoint: said, as --importance says it


@pytest.mark.parametrize("made", [False, True], ids=["missing", "empty"])
def test_markov_with_an_out_and_no_checkpoint_is_said_not_gpt2s_weights(made, tmp_path, monkeypatch, capsys):
    import gpt2_dtma as G
    out = tmp_path / "run"
    if made:
        out.mkdir()
    monkeypatch.setattr(G, "load_checkpoint", lambda *a, **k: pytest.fail("fell back to GPT-2's weights"))
    for analysis in ("--markov", "--importance"):
        err = one_sentence_exit_1(capsys, G.main, ["--out", str(out), analysis])
        assert err == f"error: no checkpoint at {out}/ckpt.pt; train the run first, or pass --out <run folder>"
    assert os.path.isdir(out) == made and (not made or os.listdir(out) == [])

    # --init named: its weights alone, --out the figure's folder (as before)
    def read(init):
        raise G.data_lib.DataError(f"read {init}")
    monkeypatch.setattr(G, "load_checkpoint", read)
    assert one_sentence_exit_1(capsys, G.main, ["--out", str(out), "--markov", "--init", "gpt2"]) == "error: read gpt2"

# ---------------------------------------------------------------------------------------------------------------
# 6. --bench with a run's flags: said before any work, in every model file


@pytest.mark.parametrize("script", ["dt", "gpt2_dtma", "lsdt", "starformer", "dema"])
def test_bench_with_resume_or_out_is_one_sentence_before_any_work(script, tmp_path, monkeypatch, capsys):
    import importlib
    m = importlib.import_module(script)
    monkeypatch.setattr(evaluate, "bench_runs", lambda *a, **k: pytest.fail("the bench ran"))
    for run, flags in (("--resume", ["--resume"]), ("--out", ["--out", str(tmp_path / "run")]),
                       ("--resume or --out", ["--resume", "--out", str(tmp_path / "run")])):
        err = one_sentence_exit_1(capsys, m.main, ["--bench", *flags])
        assert err == (f"error: --bench times training on synthetic data in a temporary folder, so it takes no "
                       f"{run}; drop {'them' if ' or ' in run else 'it'}")
    assert os.listdir(tmp_path) == []
