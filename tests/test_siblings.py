"""The five model files share their plumbing word for word, as CleanRL keeps its sibling files, so that
`diff dt.py X.py` shows only what paper X changes: `arg`, Config's run flags, and the section from
load_model to main() must be dt.py's text exactly."""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIBLINGS = ["gpt2_dtma", "lsdt", "starformer", "dema"]
RUN_FLAGS = "    # ---- the run: the same flags in every model file ----"
PLUMBING = "# ---- the run's plumbing, the same text in every model file"


def shared_text(script):
    """-> {part: text} of the parts every model file holds word for word."""
    src = (ROOT / f"{script}.py").read_text()
    tree = ast.parse(src)
    arg = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "arg")
    lines = src.splitlines()
    start = lines.index(RUN_FLAGS)
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("target_sweep:"))
    plumbing = next(i for i, line in enumerate(lines) if line.startswith(PLUMBING))
    return {"arg": ast.get_source_segment(src, arg), "Config's run flags": lines[start:end + 1],
            "plumbing (load_model .. main)": lines[plumbing:]}


@pytest.mark.parametrize("script", SIBLINGS)
def test_shared_text_is_dt_py_word_for_word(script):
    mine, dt = shared_text(script), shared_text("dt")
    for part in dt:
        assert mine[part] == dt[part], f"{script}.py's {part} differs from dt.py's"


@pytest.mark.parametrize("script", ["dt", *SIBLINGS])
def test_the_run_flags_are_the_shared_block_and_the_paper_comes_first(script):
    """Config: the paper's settings, then the shared run flags, then the file's own analyses."""
    lines = (ROOT / f"{script}.py").read_text().splitlines()
    config = lines.index("class Config:")
    assert lines[config + 1].startswith("    # ---- the paper's settings")
    assert all(len(line) <= 100 or "http" in line for line in lines), "a line over 100 columns"
