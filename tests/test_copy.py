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
    # the paper's hopper model: 3 blocks of 128, one head, K = 20 (Sec. 4, kzl's gym defaults)
    "dt": """
cfg = DTConfig()
model = DecisionTransformer(cfg, obs_dim=11, act_dim=3, max_ep_len=1000).eval()
assert sum(p.numel() for p in model.parameters()) == 726_019
B, K = 2, 20
y = model(torch.randn(B, K, 11), torch.rand(B, K, 3) * 2 - 1, torch.randn(B, K, 1),
          torch.arange(K).repeat(B, 1), torch.ones(B, K))
assert y.shape == (B, K, 3)
""",
    # the paper's Atari model (kzl's atari/run_dt_atari.py: 6 blocks of 128, 8 heads, K = 30), both state encoders
    "dt: Atari": """
for encoder in ("conv", "patch"):
    cfg = DTConfig(n_layer=6, n_head=8, context=30, state_encoder=encoder)
    model = AtariDecisionTransformer(cfg, n_actions=4, max_ep_len=2000).eval()
    B, K = 1, 30
    y = model(torch.randint(0, 256, (B, K, 4, 84, 84), dtype=torch.uint8), torch.randint(0, 4, (B, K)),
              torch.randn(B, K, 1), torch.arange(K).repeat(B, 1), torch.ones(B, K))
    assert y.shape == (B, K, 4)
""",
    # GPT2-DTMA on GPT-2 small's shape (12 blocks of 768, 12 heads), K = 20, and GPT2-DT without the gate
    "gpt2_dtma": """
B, K = 1, 20
for moa in (True, False):
    model = DecisionTransformer(GPT2Config(), obs_dim=11, act_dim=3, max_ep_len=1000, moa=moa).eval()
    a, aux = model(torch.randn(B, K, 11), torch.rand(B, K, 3) * 2 - 1, torch.randn(B, K, 1),
                   torch.arange(K).repeat(B, 1), torch.ones(B, K), need_probs=True)
    assert a.shape == (B, K, 3) and aux["probs"][0].shape == (B, 12, 3 * K, 3 * K)
    assert [g is None for g in aux["gates"]] == [not moa] * 12
    assert not moa or aux["gates"][0].shape == (B, 3 * K, 12)
""",
    # CLIP-DT: the blocks in CLIP ViT-B/32's text-tower shape (12 blocks of 512, 8 heads, quick GELU)
    "gpt2_dtma: CLIP-DT": """
clip = GPT2Config(vocab_size=49408, n_positions=77, n_embd=512, n_layer=12, n_head=8, activation="quick_gelu")
model = DecisionTransformer(clip, obs_dim=11, act_dim=3, max_ep_len=1000).eval()
a, aux = model(torch.randn(1, 20, 11), torch.zeros(1, 20, 3), torch.randn(1, 20, 1),
               torch.arange(20)[None], torch.ones(1, 20))
assert a.shape == (1, 20, 3) and aux["gates"][0].shape == (1, 60, 8)
""",
    # GPT-2's language model (--sample), one block: logits over the vocabulary, and nanoGPT's sampling
    "gpt2_dtma: GPT-2": """
lm = GPT2(GPT2Config(n_layer=1)).eval()
idx = torch.randint(0, 50257, (1, 8))
assert lm(idx).shape == (1, 8, 50257)
assert lm.generate(idx, 2, generator=torch.Generator().manual_seed(0)).shape == (1, 10)
""",
    # Table 6's gym model (6 layer pairs, D = 192, d = 64), T = 20 on hopper, and each Table 3-4 variant
    "starformer": """
B, T = 2, 20
b = dict(states=torch.randn(B, T, 11), actions=torch.rand(B, T, 3) * 2 - 1, rewards=torch.randn(B, T, 1),
         rtg=torch.randn(B, T, 1), timesteps=torch.arange(T).repeat(B, 1), mask=torch.ones(B, T),
         prev_action=torch.zeros(B, 3), prev_reward=torch.zeros(B, 1))
for variant in ({}, dict(connection="fusion"), dict(connection="stack"), dict(state_token="none"),
                dict(state_token="patch"), dict(reward_token=False)):
    model = StARformer(StARConfig(**variant), obs_shape=11, act_dim=3).eval()
    assert model(**b).shape == (B, T, 3), variant
""",
    # Table 6's Atari model: 7x7 patches of 4x84x84 frames, T = 30, Breakout's 4 actions
    "starformer: Atari": """
B, T = 1, 30
model = StARformer(StARConfig(context=30), obs_shape=(4, 84, 84), act_dim=4, discrete=True).eval()
y = model(states=torch.randint(0, 256, (B, T, 4, 84, 84), dtype=torch.uint8),
          actions=torch.randint(0, 4, (B, T)), rewards=torch.randn(B, T, 1), rtg=torch.randn(B, T, 1),
          timesteps=torch.arange(T).repeat(B, 1), mask=torch.ones(B, T),
          prev_action=torch.zeros(B, dtype=torch.long), prev_reward=torch.zeros(B, 1))
assert y.shape == (B, T, 4)
""",
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
@pytest.mark.slow
def test_model_block_runs_alone_in_an_empty_file(name, tmp_path):
    script = name.split(":")[0]
    path = tmp_path / "model.py"
    path.write_text(block(script) + "\n\ntorch.manual_seed(0)\n" + CASES[name] + CHECK)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "copied block ran" in proc.stdout, proc.stderr[-3000:]
