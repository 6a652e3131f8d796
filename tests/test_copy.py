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
    # DeMa at hopper-medium's sizes (D.1: E = 256, D = 64, N = 64, 3 layers), K = 20: Table 7's 175.5K less
    # the dropped heads; each block and layout, transformer-like (forward) and RNN-like (step)
    "dema": """
B, K = 2, 20
b = (torch.randn(B, K, 11), torch.rand(B, K, 3) * 2 - 1, torch.randn(B, K, 1), torch.arange(K).repeat(B, 1),
     torch.ones(B, K), torch.zeros(B, 3))
assert sum(p.numel() for p in DeMa(DeMaConfig(), 11, 3, 1000).parameters()) == 174_723
for variant in ({}, dict(residual="post"), dict(token_layout="bl3d"), dict(timestep_embedding=True),
                dict(scan="parallel")):
    model = DeMa(DeMaConfig(**variant), obs_dim=11, act_dim=3, max_ep_len=1000).eval()
    with torch.no_grad():
        y = model(*b)
        z, _ = model.step(b[0][:, 0], b[5], b[2][:, 0], b[3][:, 0], model.init_cache(B))
    assert y.shape == (B, K, 3) and torch.allclose(z, y[:, 0], atol=1e-5), variant
""",
    # the Atari model at the official code's sizes (E = D = N = 128, 6 layers; Table 7's 1.7M), K = 30, Breakout's
    # 4 actions, both blocks, transformer-like and RNN-like
    "dema: Atari": """
B, K = 1, 30
b = (torch.randint(0, 256, (B, K, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 4, (B, K)),
     torch.randn(B, K, 1), torch.arange(K).repeat(B, 1), torch.ones(B, K), torch.zeros(B, dtype=torch.long))
for residual in ("pre", "post"):
    cfg = DeMaConfig(n_embd=128, d_model=128, d_state=128, n_layer=6, dropout=0.1, residual=residual)
    model = DeMa(cfg, obs_dim=4 * 84 * 84, act_dim=4, max_ep_len=1000, discrete=True).eval()
    assert residual == "post" or sum(p.numel() for p in model.parameters()) == 1_713_184
    with torch.no_grad():
        y = model(*b)
        z, _ = model.step(b[0][:, 0], b[5], b[2][:, 0], b[3][:, 0], model.init_cache(B))
    assert y.shape == (B, K, 4) and torch.allclose(z, y[:, 0], atol=1e-4), residual
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
