"""The five model files share their plumbing word for word, as CleanRL keeps its sibling files, so that
`diff dt.py X.py` shows only what paper X changes: `arg`, Config's run flags, evaluate(), and the section from
load_model to main() must be dt.py's text exactly; the plumbing's header lists the names it calls."""
import ast
import builtins
import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIBLINGS = ["gpt2_dtma", "lsdt", "starformer", "dema"]
RUN_FLAGS = "    # ---- the run: the same flags in every model file ----"
PLUMBING = "# ---- the run's plumbing, the same text in every model file"
BESIDE = "# ---- what the plumbing needs that no paper says"


def shared_text(script):
    """-> {part: text} of the parts every model file holds word for word."""
    src = (ROOT / f"{script}.py").read_text()
    tree = ast.parse(src)
    arg, evaluate = (next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
                     for name in ("arg", "evaluate"))
    lines = src.splitlines()
    start = lines.index(RUN_FLAGS)
    end = next(i for i in range(start, len(lines)) if lines[i].lstrip().startswith("target_sweep:"))
    plumbing = next(i for i, line in enumerate(lines) if line.startswith(PLUMBING))
    return {"arg": ast.get_source_segment(src, arg), "Config's run flags": lines[start:end + 1],
            "evaluate()": ast.get_source_segment(src, evaluate),
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


@pytest.mark.parametrize("script", ["dt", *SIBLINGS])
def test_the_plumbing_header_lists_exactly_the_names_it_calls(script):
    """The names the plumbing reads and does not bind (its protocol), against the comment at its header: each one
    listed, the count right, and no other name of the file listed."""
    src = (ROOT / f"{script}.py").read_text()
    lines = src.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(PLUMBING))
    plumbing = ast.parse("\n".join(lines[start:]))
    nodes = list(ast.walk(plumbing))
    bound = ({n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
             | {n.arg for n in nodes if isinstance(n, ast.arg)}
             | {n.name for n in nodes if isinstance(n, ast.FunctionDef)})
    free = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound - set(dir(builtins))
    modules = {"ev", "data_lib"}

    comment = list(itertools.takewhile(lambda line: line.startswith("#"), lines[start + 1:]))
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(comment)))
    tree = ast.parse(src)
    defined = ({n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
               | {t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
               | {a.asname or a.name for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                  for a in n.names})
    assert free <= defined, f"the plumbing reads {free - defined}, which {script}.py does not define"
    assert words & defined == free, "the header's list is not the names the plumbing calls"
    assert f"calls {len(free - modules)} names" in " ".join(comment)


@pytest.mark.parametrize("script", ["dt", *SIBLINGS])
def test_the_run_s_own_names_sit_beside_the_plumbing(script):
    """SCRIPT, LOG_COLUMNS and batch_tokens (the plumbing's names that no paper gives) are what stands between the
    fence above the plumbing and its header, and nowhere else."""
    src = (ROOT / f"{script}.py").read_text()
    lines = src.splitlines()
    fence = next(i for i, line in enumerate(lines) if line.startswith(BESIDE))
    plumbing = next(i for i, line in enumerate(lines) if line.startswith(PLUMBING))
    between = ast.parse("\n".join(lines[fence:plumbing])).body
    names = [n.name if isinstance(n, ast.FunctionDef) else n.targets[0].id for n in between]
    assert names == ["SCRIPT", "LOG_COLUMNS", "batch_tokens"]
    everywhere = [n.name if isinstance(n, ast.FunctionDef) else t.id for n in ast.parse(src).body
                  for t in (n.targets if isinstance(n, ast.Assign) else [n])
                  if isinstance(n, ast.FunctionDef) or isinstance(t, ast.Name)]
    assert all(everywhere.count(name) == 1 for name in names), "defined again elsewhere in the file"
