"""Each model block copies by itself: its text alone, written into an empty file and run with only torch installed
(data.py and evaluate.py out of reach), builds the paper's model and runs a forward pass.

CASES maps a name ('script' or 'script: what') to the snippet run after the block: it builds the model with the
paper's shapes from the block's own config and asserts the output's shape."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

CASES = {
    # LSDT's practical default (Table 13: 3 blocks of 128, xi = 0.5) on hopper, K = 20; hopper-medium's
    # row (D = 256, xi = 1, (R, s) tokens, K = 10); each routing of B.10, LSDC, and DC / DC_h (Table 12)
    "lsdt": """
B = 2
for variant, K in ((dict(), 20), (dict(n_embd=256, conv_ratio=1.0, action_tokens=False), 10),
                   (dict(routing="res"), 20), (dict(routing="weight"), 20), (dict(conv="dc"), 20),
                   (dict(dropkey=0.1, norm="pre", fusion="concat"), 20),
                   (dict(arch="dc", conv="dc", conv_ratio=1.0, norm="pre", embd_dropout=0.1), 8),
                   (dict(arch="dc_h", conv="dc", conv_ratio=1.0, norm="pre", n_head=2), 8)):
    model = LSDT(LSDTConfig(**variant), obs_dim=11, act_dim=3, max_ep_len=1000)
    model.train(variant.get("dropkey", 0) > 0)
    y = model(torch.randn(B, K, 11), torch.rand(B, K, 3) * 2 - 1, torch.randn(B, K, 1),
              torch.arange(K).repeat(B, 1), torch.ones(B, K))
    assert y.shape == (B, K, 3), variant
""",
}

# after the snippet: the block reached for none of the project's files
CHECK = """
import sys
assert not {"data", "evaluate", "dt"} & set(sys.modules), "the block imported a project file"
print("copied block ran")
"""


def block(script):
    """The text between '# >>> model: begin' and '# <<< model: end', both lines included."""
    text = (ROOT / f"{script}.py").read_text()
    m = re.search(r"^# >>> model: begin.*?^# <<< model: end", text, re.S | re.M)
    assert m, f"{script}.py has no '# >>> model: begin' ... '# <<< model: end' block"
    return m.group(0)


@pytest.mark.parametrize("name", CASES)
def test_model_block_runs_alone_in_an_empty_file(name, tmp_path):
    script = name.split(":")[0]
    path = tmp_path / "model.py"
    path.write_text(block(script) + "\n\ntorch.manual_seed(0)\n" + CASES[name] + CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "copied block ran" in proc.stdout, proc.stderr[-3000:]
