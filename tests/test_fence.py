"""data.py's fence: what stands above it (what the model files and evaluate.py use) runs alone, pasted into an
empty folder with nothing from below, and the made ids its messages name agree with what `make` makes."""
import builtins
import importlib.util
import os
import symtable

import numpy as np
import pytest

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def above_the_fence(tmp_path):
    """data.py up to its fence comment, as data.py in an empty folder -> (its text, the module loaded from it)."""
    text = open(os.path.join(ROOT, "data.py")).read()
    fence = text.index("\n# Dataset tools: below this line")
    head = text[:text.rindex("\n# ====", 0, fence) + 1]
    (tmp_path / "data.py").write_text(head)
    spec = importlib.util.spec_from_file_location("data_above_the_fence", tmp_path / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return head, module


def global_names(table):
    """The module-level names that the code in a symbol table (and every function in it) reads."""
    names = {s.get_name() for s in table.get_symbols()
             if s.is_referenced() and (table.get_type() == "module" or s.is_global())}
    for child in table.get_children():
        names |= global_names(child)
    return names


def test_above_the_fence_runs_alone(tmp_path, tiny_hopper, minari_path):
    head, fenced = above_the_fence(tmp_path)
    assert "def make(" not in head and "def _write_dataset(" not in head

    # every global name it reads is its own (or a builtin): none from below the fence
    table = symtable.symtable(head, "data.py", "exec")
    missing = sorted(n for n in global_names(table) if not hasattr(fenced, n) and not hasattr(builtins, n))
    assert missing == [], f"read above the fence, defined below it: {missing}"

    # a tiny dataset loaded, windows sampled, as the full file does
    d, full = fenced.load_data(tiny_hopper), data.load_data(tiny_hopper)
    a, b = d.sample(8, 5, np.random.default_rng(0)), full.sample(8, 5, np.random.default_rng(0))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)

    # a missing id: one sentence, naming the make that stands in for it
    for dataset_id, says in (("made/hopper/medium-v0", "`python data.py make hopper-medium made/hopper/medium-v0`"),
                             ("made/nothing/here-v0", "NAME one of pointmaze-umaze, "),
                             ("mujoco/hopper/medium-v0", "`python data.py make hopper-medium` makes a stand-in")):
        with pytest.raises(fenced.DataError) as e:
            fenced.load_data(dataset_id, download=False)
        msg = str(e.value)
        assert says in msg and f"dataset '{dataset_id}' is not in {minari_path}" in msg and "\n" not in msg, msg


def test_make_names_are_what_make_makes():
    """MAKE_NAMES (above the fence) lists the locomotion levels that make's ARS table (below) reaches."""
    for robot, settings in data.LOCOMOTION.items():
        levels = {n.split("-", 1)[1] for n in data.MAKE_NAMES if n.split("-")[0] == robot}
        assert levels == {"medium", "medium-replay"} | (
            {"expert", "medium-expert"} if "expert" in settings["iterations"] else set()), robot
    others = {n.split("-")[0] for n in data.MAKE_NAMES} - set(data.LOCOMOTION)
    assert others == {"pointmaze", "breakout"}
