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


@pytest.mark.parametrize("script", ["dt", *SIBLINGS])
def test_the_model_comes_first_and_each_departure_is_short(script):
    """nanoGPT's order: the docstring, the imports, the model block, then `arg`, Config and PRESETS before the
    paper's pieces; the first nn.Module within the first 150 lines (dema.py: DeMa within 200); each departure
    item in the docstring at most 3 lines, its detail at the line that implements it."""
    src = (ROOT / f"{script}.py").read_text()
    lines, tree = src.splitlines(), ast.parse(src)
    begin = next(i for i, line in enumerate(lines, 1) if line.startswith("# >>> model: begin"))
    end = lines.index("# <<< model: end") + 1
    pieces = next(i for i, line in enumerate(lines, 1) if line.startswith("# ---- the paper's pieces"))
    assert all(isinstance(n, (ast.Import, ast.ImportFrom)) for n in tree.body[1:] if n.lineno < begin)
    top = {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    assert end < top["arg"] < top["Config"] < pieces, "arg and Config stand between the model and its pieces"

    modules = [n.lineno for n in tree.body if isinstance(n, ast.ClassDef)
               and any(ast.unparse(b) == "nn.Module" for b in n.bases)]
    assert min(modules) <= 150 and (script != "dema" or top["DeMa"] <= 200)

    doc = ast.get_docstring(tree, clean=False)
    items = re.split(r"\n\s?\d+\. ", doc[doc.index("\nDepartures"):].split("\n\n")[0])[1:]
    assert items and all(len(item.splitlines()) <= 3 for item in items), "a departure over 3 lines"


def test_lsdt_reads_the_method_before_the_appendix_variants():
    """lsdt.py's block: attention, dynamic convolution, HFM, the split, the mixer, the block and LSDT in the paper's
    order (Sec. 3.2.1, App. B.3), then one section for B.8's, B.10's and DC's variants."""
    src = (ROOT / "lsdt.py").read_text()
    lines = src.splitlines()
    variants = next(i for i, line in enumerate(lines, 1) if line.startswith("# ---- the appendix's variants"))
    classes = [(n.name, n.lineno) for n in ast.parse(src).body if isinstance(n, ast.ClassDef)]
    method = [name for name, line in classes if line < variants]
    assert method == ["LSDTConfig", "CausalSelfAttention", "DynamicConv", "HybridFusion", "Split", "NoBranch",
                      "LongShortMixer", "Block", "LSDT"]
    assert {"DropKeyAttention", "ResidualSplit", "Shared", "BranchWeights", "DCConv", "ConvMixer",
            "PreLNBlock"} <= {name for name, line in classes if line > variants}
