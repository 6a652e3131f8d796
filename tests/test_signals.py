"""Issue 54: Ctrl-C and SIGTERM at any moment of every analysis and of --bench: the analysis's one sentence, exit 130
or 143, nothing half-written (no .tmp, the previous files kept); a stop inside an import exits without the clean-up
at which a half-made extension can abort the interpreter."""
import importlib
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import data
import evaluate
from test_harness import TINY, snapshot

SENTENCE = "{sig}: --{flag} stops; an analysis writes nothing half-made (each file whole, or its previous copy kept)"
RUN = ["--steps", "2", "--eval-every", "2", "--eval-episodes", "1"]


class Enc:
    """A stand-in for GPT-2's tokenizer (its BPE files need the network)."""
    eot_token = 0
    encode = staticmethod(lambda s: [ord(c) % 97 for c in s])
    decode = staticmethod(lambda ids: "".join(chr(65 + i % 26) for i in ids))


@pytest.fixture(scope="module")
def runs(tiny_hopper, tiny_maze, tiny_breakout, tmp_path_factory):
    """A tiny trained run per (script, data) that the analyses read, and a tiny GPT-2 checkpoint in HF's layout."""
    from test_gpt2_dtma import hf_tiny_state, write_hf_folder
    root = tmp_path_factory.mktemp("runs")
    folders = {}
    for script, name, dataset, extra in (("dt", "hopper", tiny_hopper, TINY["dt"]),
                                         ("dt", "breakout", tiny_breakout, ["--n-embd", "16", "--n-layer", "1",
                                                                            "--n-head", "2", "--context", "4",
                                                                            "--batch-size", "8"]),
                                         ("gpt2_dtma", "hopper", tiny_hopper, TINY["gpt2_dtma"]),
                                         ("lsdt", "hopper", tiny_hopper, TINY["lsdt"]),
                                         ("lsdt", "maze", tiny_maze, TINY["lsdt"]),
                                         ("dema", "hopper", tiny_hopper, TINY["dema"])):
        out = root / f"{script}_{name}"
        importlib.import_module(script).main(["--dataset", dataset, *extra, *RUN, "--out", str(out)])
        folders[script, name] = out
    folders["gpt2", "hf"] = write_hf_folder(str(root / "gpt2"), hf_tiny_state(5))
    return folders


def half(target):
    """Half a file at a path or into an open file, as a write cut short leaves it."""
    if hasattr(target, "write"):
        target.write(b"half a file")
    else:
        with open(target, "wb") as f:
            f.write(b"half a file")


def stop_in(monkeypatch, owner, name, sig, writes=None):
    """owner.name sends `sig` to this process as it runs; a write (writes: its file's argument) after half its file.
    raise_signal signals this thread: the handler runs at once, inside the call."""
    real = getattr(owner, name, print)

    def signalled(*args, **kwargs):
        if writes is not None:
            half(args[writes])
        signal.raise_signal(sig)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, signalled, raising=False)


def caller_handlers():
    """Handlers that fail the test where a stop reaches past the analysis (SIGTERM would otherwise end pytest)."""
    def fail(signum, frame):
        pytest.fail(f"{signal.Signals(signum).name} reached the caller's handler")
    return {s: signal.signal(s, fail) for s in (signal.SIGINT, signal.SIGTERM)}


def figure(m):
    from matplotlib.figure import Figure
    return Figure, "savefig", 1


def image(m):
    from PIL import Image
    return Image.Image, "save", 1


# (script, its run, the flag and its arguments, where the stop comes: (owner, name, the written file's argument))
CASES = [
    ("dt", "hopper", ["--target-sweep"], figure),
    ("dt", "breakout", ["--gif"], image),
    ("dt", "hopper", ["--bench-eval"], lambda m: (evaluate, "evaluate", None)),
    ("gpt2_dtma", "hopper", ["--markov"], figure),
    ("gpt2_dtma", "hopper", ["--attention-maps"], figure),
    ("gpt2_dtma", "hopper", ["--attention-distance"], figure),
    ("gpt2_dtma", "hopper", ["--importance"], figure),
    ("gpt2_dtma", "hf", ["--sample", "abc"], lambda m: (Enc, "decode", None)),
    ("gpt2_dtma", "hf", ["--text-attention", "hello world"], figure),
    ("lsdt", "hopper", ["--plot-mixing"], figure),
    ("lsdt", "maze", ["--plot-paths"], figure),
    ("dema", "hopper", ["--attention"], lambda m: (np, "savez", 0)),
    ("dema", "hopper", ["--s6-ablation", "zero"], lambda m: (evaluate, "evaluate", None)),
    ("dema", None, ["--bench-scan"], lambda m: (m, "time_scan", None)),
    ("dema", None, ["--params"], lambda m: (m, "print", None)),
]


def test_every_analysis_flag_has_a_case():
    """The cases above cover --gif, --target-sweep and every model file's ANALYSES."""
    flags = {(script, flag[0]) for script, _, flag, _ in CASES}
    for script in ("dt", "gpt2_dtma", "lsdt", "starformer", "dema"):
        names = {"gif", "target_sweep"} | set(importlib.import_module(script).ANALYSES)
        for name in names:
            assert any(f == "--" + name.replace("_", "-") for _, f in flags), (script, name)
    assert not importlib.import_module("starformer").ANALYSES


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("script, run, flag, moment", CASES, ids=[c[2][0] for c in CASES])
def test_a_stop_in_any_analysis_is_its_sentence_and_leaves_nothing_half_written(script, run, flag, moment, sig,
                                                                                runs, tmp_path, monkeypatch,
                                                                                capsys):
    """The stop comes as the analysis writes its first file (half of it on disk), or where it writes none, inside its
    work: exit 128 + the signal, one sentence, and every folder as it was, no .tmp in it."""
    m = importlib.import_module(script)
    argv = list(flag)
    if run == "hf":                                         # GPT-2's own weights: no run, an output folder
        monkeypatch.setattr(m, "tiktoken_gpt2", lambda: Enc)
        argv += ["--init", str(runs["gpt2", "hf"]), "--out", str(tmp_path / "out")]
        out = tmp_path / "out"
    elif run is not None:
        out = runs[script, run]
        argv += ["--out", str(out), "--device", "cpu"]
    else:
        out = tmp_path
    before = snapshot(out)
    owner, name, writes = moment(m)
    stop_in(monkeypatch, owner, name, sig, writes)

    capsys.readouterr()
    previous = caller_handlers()
    try:
        with pytest.raises(SystemExit) as e:
            m.main(argv)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 128 + sig and err == SENTENCE.format(sig=signal.Signals(sig).name, flag=flag[0][2:]), err
    assert snapshot(out) in (before, {})                                   # (an empty output folder made)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")] if os.path.isdir(out) else True
    assert signal.getsignal(signal.SIGINT) is previous[signal.SIGINT]      # the caller's handlers back


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("owner, name", [("evaluate.Run", "log"), ("data", "synthetic_like")])
def test_a_stopped_bench_says_it_saves_nothing_wherever_it_stops(owner, name, sig, monkeypatch, capsys):
    """In its training steps or before them (its data being made): the bench's sentence, never training's "nothing
    was saved since the last checkpoint"; its temporary runs are gone."""
    import tempfile
    import dt
    made = []
    real_tmp = tempfile.TemporaryDirectory

    def tracked(*args, **kwargs):
        made.append(real_tmp(*args, **kwargs))
        return made[-1]
    monkeypatch.setattr(tempfile, "TemporaryDirectory", tracked)
    stop_in(monkeypatch, evaluate.Run if owner == "evaluate.Run" else data, name, sig)
    previous = caller_handlers()
    try:
        with pytest.raises(SystemExit) as e:
            dt.main(["--bench", *TINY["dt"]])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 128 + sig and err == f"{signal.Signals(sig).name}: the bench stops; a bench saves nothing"
    assert all(not os.path.exists(t.name) for t in made)


def test_a_bench_run_keeps_the_callers_handlers_and_a_training_run_takes_them():
    """StopSignal's saving is its argument: saves=False (a bench's run) leaves the signals to analysis('bench')."""
    handler = signal.getsignal(signal.SIGTERM)
    with evaluate.StopSignal(saves=False) as stop:
        assert signal.getsignal(signal.SIGTERM) is handler and not stop.signum
    with evaluate.StopSignal() as stop:
        assert signal.getsignal(signal.SIGTERM) == stop.handle
    assert signal.getsignal(signal.SIGTERM) is handler
    assert "saves" not in vars(evaluate.StopSignal)                        # no class state to flip


IN_AN_IMPORT = """
import atexit, importlib.abc, importlib.util, runpy, signal, sys
class Stop(importlib.abc.MetaPathFinder):
    # SIGTERM as matplotlib.figure's module runs (its first import is the analysis's)
    def find_spec(self, name, path, target=None):
        if name != "matplotlib.figure":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module
        def exec_module(module):
            signal.raise_signal(signal.SIGTERM)
            run(module)
        spec.loader.exec_module = exec_module
        return spec
sys.meta_path.insert(0, Stop())
atexit.register(lambda: print("finalised", file=sys.stderr))
sys.argv = ["dt.py", "--out", {out!r}, "--target-sweep", "--eval-episodes", "1"]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_a_stop_inside_an_import_is_the_sentence_and_skips_the_exits_clean_up(runs):
    """An exception inside an extension's import can leave it half made, and the interpreter can then abort as it
    exits (Fatal Python error): a stop inside an import says its sentence and exits 143 without that clean-up (no
    atexit handler runs), the folder as it was."""
    import dt
    out = runs["dt", "hopper"]
    before = snapshot(out)
    r = subprocess.run([sys.executable, "-c", IN_AN_IMPORT.format(out=str(out), script=dt.__file__)],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert r.returncode == 143 and r.stderr.strip() == SENTENCE.format(sig="SIGTERM", flag="target-sweep"), r.stderr
    assert snapshot(out) == before


def test_a_stop_outside_an_import_exits_through_the_clean_up(tmp_path):
    """The ordinary stop is SystemExit: `finally` blocks and atexit run (and pytest survives it)."""
    cleaned = []
    previous = caller_handlers()
    try:
        with pytest.raises(SystemExit) as e:
            with evaluate.analysis("target_sweep"):
                try:
                    signal.raise_signal(signal.SIGTERM)
                finally:
                    cleaned.append(True)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert e.value.code == 143 and cleaned == [True]


def test_a_stop_a_library_turns_into_its_own_error_or_swallows_is_still_the_stop(capsys):
    """numpy and matplotlib raise ImportError for a KeyboardInterrupt inside their extensions; code may catch it."""
    previous = caller_handlers()
    try:
        for swallow in (False, True):
            with pytest.raises(SystemExit) as e:
                with evaluate.analysis("markov"):
                    try:
                        signal.raise_signal(signal.SIGINT)
                    except KeyboardInterrupt:
                        if not swallow:
                            raise ImportError("initialization failed") from None
            assert e.value.code == 130
            assert capsys.readouterr().err.strip() == SENTENCE.format(sig="SIGINT", flag="markov")
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_a_second_stop_lets_the_first_clean_up(tmp_path, monkeypatch, capsys):
    """Ctrl-C twice, the second as write_atomic removes the first's .tmp: it is removed, the previous copy kept."""
    path = tmp_path / "figure.png"
    path.write_bytes(b"the previous figure")
    real_remove = os.remove

    def remove(p):
        signal.raise_signal(signal.SIGINT)
        real_remove(p)
    monkeypatch.setattr(os, "remove", remove)

    def write(tmp):
        half(tmp)
        signal.raise_signal(signal.SIGTERM)
    previous = caller_handlers()
    try:
        with pytest.raises(SystemExit) as e:
            with evaluate.analysis("plot_mixing"):
                evaluate.write_atomic(str(path), write)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    assert e.value.code == 143 and capsys.readouterr().err.strip() == SENTENCE.format(sig="SIGTERM", flag="plot-mixing")
    assert os.listdir(tmp_path) == ["figure.png"] and path.read_bytes() == b"the previous figure"
