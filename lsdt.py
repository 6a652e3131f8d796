"""
Long-Short Decision Transformer (LSDT): "Long-Short Decision Transformer: Bridging Global and Local Dependencies
for Generalized Decision-Making" (anonymous ICLR submission; official code
github.com/WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER). Decision Convformer (Kim et al. 2023) is in here
too, as the paper uses it: a conv-only special case and the source of LSDC's short-term branch.

What is in this file, top to bottom:
  Config           the paper's defaults (Table 13) + PAPER_TABLE, the per-dataset settings (Tables 5, 14, D.2)
  model            CausalSelfAttention (long-term branch), DynamicConv (short-term branch, Wu et al. 2019, Eq. 1),
                   DCConv (Decision Convformer's static per-token-type causal filters), HybridFusion (HFM, B.3),
                   LongShortMixer (the "Masked Long-Short block", Sec. 3.2.1), Block, LSDT.
                   Imports only torch, math, dataclasses: copy it alone into another project.
  training         train(cfg): data.py windows -> masked MSE on actions -> evaluate.py rollouts.
  analysis         mixing_maps(): the L x L attention / dynamic-kernel matrices and HFM weights (Fig. 3, 9, 11).
  main()           command line.

One layer in a picture (X: B x L x D tokens R_1, s_1, a_1, R_2, ...; xi = --conv-ratio):
    X[..., :(1-xi)D] -> causal multi-head attention (long-term)  --\
                                                                    concat -> HFM -> W_O -> + X -> LN -> MLP ...
    X[..., (1-xi)D:] -> causal DynamicConv, k_m taps (short-term) --/
xi = 0 is DT's attention block, xi = 1 is a convolution-only DT (CDT). --conv dc swaps DynamicConv for DC's
static filters (the paper's LSDC); --arch dc / dc_h is Decision Convformer itself (all-conv MetaFormer, and its
hybrid with attention in the last block), the baselines the paper "integrates" its branches into.

Run:
    python lsdt.py --env hopper-medium                         # the paper's hopper-medium row: xi=1, D=256, no a-tokens
    python lsdt.py --dataset replica/pointmaze/medium-dense-v0 --preset cpu
    python lsdt.py --env hopper-medium --conv dc               # LSDC;  --arch dc: Decision Convformer
    python lsdt.py --dataset replica/pointmaze/medium-dense-v0 --no-goal-state   # the LSDT vs LSDT-gs ablation
    python -m pytest -q tests/test_lsdt.py
"""
import math
from dataclasses import dataclass, field


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # data and run
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)")
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env")
    seed: int = arg(0, "seed for sampling, initialisation and evaluation")
    steps: int = arg(100_000, "gradient steps (Table 13: 1e5)")
    batch_size: int = arg(64, "windows per batch (Table 13: 64 locomotion, 256 mazes)")
    context: int = arg(10, "K, timesteps the model sees (Table 5)")
    lr: float = arg(1e-4, "AdamW learning rate (Table 13: 1e-4 locomotion, 2e-4 mazes)")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    warmup_steps: int = arg(10_000, "linear warmup, then cosine decay to 0 at --steps (official code)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    eval_every: int = arg(10_000, "evaluate (and checkpoint) every this many steps, and at the end")
    eval_episodes: int = arg(10, "episodes per target return, run in parallel")
    target_return: float = arg(None, "return-to-go prompt in raw units; default: the paper's (Table 5), "
                                     "else the dataset's targets")
    log_every: int = arg(100, "print and log the training loss every this many steps")
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, mps")
    out: str = arg("", "output folder; default runs/lsdt/<env>/seed<N>")
    resume: bool = arg(False, "continue from <out>/ckpt.pt")
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine")
    paper_table: bool = arg(True, "apply PAPER_TABLE's row for the dataset (K, xi, RTG, width, ...) under the flags")
    # model (Table 13 and the official code)
    arch: str = arg("lsdt", "lsdt | dc (Decision Convformer) | dc_h (DC with attention in the last block)")
    n_layer: int = arg(3, "blocks")
    n_embd: int = arg(128, "token width D (256 for hopper-medium / -medium-replay)")
    n_head: int = arg(1, "heads of the attention (long-term) branch")
    conv_ratio: float = arg(0.5, "xi: share of D for the conv (short-term) branch; 0 = DT, 1 = conv only (CDT)")
    kernel: int = arg(6, "k_m, causal taps of the conv branch incl. the current token (3 for mazes; DC: window)")
    conv: str = arg("dynamic", "short-term branch: dynamic (DynamicConv, LSDT) | dc (DC's static filters, LSDC)")
    fusion: str = arg("hfm", "hfm (Hybrid Fusion Module, App. B.3) | concat (direct concatenation)")
    norm: str = arg("post", "post (official code) | pre (the paper's Figure 1, and DC)")
    dropout: float = arg(0.25, "dropout after W_O and after the MLP")
    attn_dropout: float = arg(0.1, "dropout on the attention output P V (official code)")
    conv_dropout: float = arg(0.2, "dropout on the dynamic-kernel logits before the softmax (official code)")
    embd_dropout: float = arg(0.0, "dropout on the token embeddings (none in LSDT, 0.1 in DC)")
    action_tokens: bool = arg(True, "a_t tokens in the sequence; --no-action-tokens: (R, s) only (D.2, hopper-medium)")
    goal_state: bool = arg(True, "goal-state conditioning (Sec. 3.3): keep desired_goal in the state on goal tasks")
    plot_mixing: bool = arg(False, "write mixing.png: attention / dynamic-kernel maps and HFM weights (Fig. 3, 9, 11)")
    # set from the dataset by train(); the model reads them
    state_dim: int = arg(0, "(set from the dataset)")
    act_dim: int = arg(0, "(set from the dataset)")
    max_ep_len: int = arg(1000, "(set from the dataset)")


# A small LSDT for a 2-core CPU, at the budget of dt.py's cpu preset (width 64, 2 blocks, batch 64, 6000 steps,
# lr 1e-3 with a 500-step warmup). The dataset's row of PAPER_TABLE still sets xi, K, RTG, heads, kernel, tokens.
PRESETS = {"cpu": dict(n_embd=64, n_layer=2, batch_size=64, context=10, lr=1e-3, warmup_steps=500, steps=6000,
                       eval_every=2000, eval_episodes=10)}


# The paper's per-dataset settings: K and RTG target (Table 5), best xi (Table 14), width (Table 13 / D.2), heads,
# batch, lr, kernel (Table 13), action tokens (D.2: hopper-medium is trained without them). Keys are the D4RL
# names; paper_row() maps Minari ids onto them (mujoco/hopper/medium-v0, replica/pointmaze/medium-dense-v0, ...).
# Maze rows are the paper's Maze2d rows (D4RL maze2d-*-v1), used for Minari's PointMaze. Their RTG target (300)
# is on the scale of D4RL maze2d's never-ending sparse episodes; Minari's maze episodes stop at the goal (returns
# ~1 sparse, ~20 dense), so None there means "data.py's target, the dataset's best episode return".
_LOCO = dict(n_embd=128, n_head=1, batch_size=64, lr=1e-4, kernel=6, action_tokens=True)
_MAZE = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=3, action_tokens=True, context=20,
             target_return=None)
_ANT = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=6, action_tokens=True, context=10,
            target_return=100.0)
PAPER_TABLE = {
    "halfcheetah-medium":        dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "hopper-medium":             dict(_LOCO, context=10, conv_ratio=1.0, target_return=7000.0, n_embd=256,
                                      action_tokens=False),
    "walker2d-medium":           dict(_LOCO, context=5, conv_ratio=0.125, target_return=7000.0),
    "halfcheetah-medium-replay": dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "hopper-medium-replay":      dict(_LOCO, context=20, conv_ratio=1.0, target_return=7000.0, n_embd=256),
    "walker2d-medium-replay":    dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "halfcheetah-medium-expert": dict(_LOCO, context=10, conv_ratio=0.75, target_return=15000.0),
    "hopper-medium-expert":      dict(_LOCO, context=20, conv_ratio=0.75, target_return=10000.0),
    "walker2d-medium-expert":    dict(_LOCO, context=10, conv_ratio=0.125, target_return=10000.0),
    "antmaze-umaze":             dict(_ANT, conv_ratio=0.5, n_head=1),
    "antmaze-umaze-diverse":     dict(_ANT, conv_ratio=0.75),
    "antmaze-medium-play":       dict(_ANT, conv_ratio=0.75),
    "antmaze-medium-diverse":    dict(_ANT, conv_ratio=0.5, lr=1e-4),
    "pointmaze-umaze":           dict(_MAZE, conv_ratio=0.5),
    "pointmaze-medium":          dict(_MAZE, conv_ratio=0.125),
    "pointmaze-large":           dict(_MAZE, conv_ratio=0.25),  # Table 14 prints "Maze2d-medium" twice; 2nd = large
}
# Decision Convformer as the paper ran it (Table 12 and the DC code): pre-LN MetaFormer, conv mixer without output
# projection, embedding dropout, final LayerNorm; DC_h puts 2-head attention in the last block.
ARCH_DEFAULTS = {
    "dc": dict(conv="dc", conv_ratio=1.0, norm="pre", dropout=0.1, embd_dropout=0.1, context=8, kernel=6,
               n_embd=128, n_head=1, batch_size=64, lr=1e-4, weight_decay=1e-4),
    "dc_h": dict(conv="dc", conv_ratio=1.0, norm="pre", dropout=0.1, embd_dropout=0.1, context=8, kernel=6,
                 n_embd=128, n_head=2, batch_size=64, lr=1e-4, weight_decay=1e-4),
}


def paper_row(name):
    """PAPER_TABLE key for a short name or Minari id ('hopper-medium', 'mujoco/hopper/medium-v0',
    'replica/pointmaze/medium-dense-v0', 'D4RL/antmaze/medium-play-v1'), or None when the paper has no such row."""
    parts = name.lower().split("/")
    if len(parts) >= 3:                                   # namespace/env/level-vN
        env, level = parts[-2], parts[-1].rsplit("-v", 1)[0]
    else:                                                 # short name env-level
        env, _, level = parts[-1].partition("-")
    env = "pointmaze" if env == "maze2d" else env
    level = level.removesuffix("-dense").removesuffix("-sparse")  # the paper's Maze2d rows are sparse; dense too
    key = f"{env}-{level}"
    return key if key in PAPER_TABLE else None


def conv_dims(cfg):
    """Channels D_c = round(xi * D) that each layer gives its short-term branch (the rest, D_a, go to attention)."""
    if cfg.arch in ("dc", "dc_h"):
        dims = [cfg.n_embd] * cfg.n_layer
        if cfg.arch == "dc_h":
            dims[-1] = 0  # DC_h: the final block's conv mixer is replaced by causal self-attention (DC paper)
        return dims
    return [int(round(cfg.conv_ratio * cfg.n_embd))] * cfg.n_layer


def check_config(cfg):
    """Returns a one-sentence problem with the model settings, or None."""
    if not 0.0 <= cfg.conv_ratio <= 1.0:
        return f"--conv-ratio must lie in [0, 1], got {cfg.conv_ratio}"
    if cfg.kernel < 1:
        return f"--kernel must be >= 1, got {cfg.kernel}"
    for dc in set(conv_dims(cfg)):
        da = cfg.n_embd - dc
        if da and da % cfg.n_head:
            return (f"the attention branch gets {da} of {cfg.n_embd} channels (conv ratio {cfg.conv_ratio}), "
                    f"which {cfg.n_head} heads cannot split evenly")
        if dc and cfg.conv == "dynamic" and dc % 4:
            return (f"the dynamic-conv branch gets {dc} channels (conv ratio {cfg.conv_ratio} of {cfg.n_embd}), "
                    f"not a multiple of 4 (4 channels share each kernel, Table 13)")
    return None


# ============================================================================================================
# Model (torch only)
# ============================================================================================================
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    """Long-term branch (Sec. 3.2.1): causal multi-head self-attention over the first D_a channels. The output
    projection is the mixer's shared W_O. With keep=True (analysis) the probabilities are computed explicitly and
    kept for plotting (Fig. 3); training uses torch's fused attention."""

    def __init__(self, dim, n_head, attn_dropout):
        super().__init__()
        assert dim % n_head == 0, f"{dim} attention channels do not split into {n_head} heads"
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)  # W_Q || W_K || W_V (the code's three Linears, fused)
        self.drop = nn.Dropout(attn_dropout)   # official code: dropout on P V, not on P
        self.keep = False                      # analysis: keep the last probabilities in self.probs
        self.probs = None

    def forward(self, x, allowed):
        # x: (B, L, Da); allowed: (B, 1, L, L) bool, query i may read key j (causal, and j is not padding)
        B, L, C = x.shape
        h = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)                          # 3 x (B, L, Da)
        q, k, v = (z.view(B, L, h, C // h).transpose(1, 2) for z in (q, k, v))  # (B, h, L, dh)
        if self.keep:  # analysis path: the probabilities themselves (Fig. 3, 9)
            scores = q @ k.transpose(-2, -1) / math.sqrt(C // h)          # (B, h, L, L)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)  # (B, h, L, L)
            self.probs = probs.detach()
            y = probs @ v                                                 # (B, h, L, dh)
        else:          # the same softmax(q k^T / sqrt(dh)) v, fused (a test checks both paths agree)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, h, L, dh)
        y = y.transpose(1, 2).reshape(B, L, C)                            # (B, L, Da)
        return self.drop(y)


class DynamicConv(nn.Module):
    """Short-term branch: causal DynamicConv (Wu et al. 2019; paper Eq. 1), as the official code (ESPnet's
    DynamicConvolution with a kernel mask) computes it:
        U = GLU(X W_1)                                  input GLU, (B, L, Dc)
        alpha[i, h, :] = softmax(dropout(U_i W_w))      one kernel of k_m taps per token i and head h
        Y[i, c] = sum_j alpha[i, h(c), j] U[i-k_m+1+j, c] + b_c,  h(c) = c // 4   (4 channels share a kernel)
        out = Y W_2
    The code predicts a centred kernel of k = 2 k_m - 1 taps and masks the k_m - 1 future ones to -inf; predicting
    only the k_m causal taps is the same function (B.7) with fewer dead weights. Taps that fall before the sequence or
    on left padding are masked too and the softmax renormalises over the rest (as in the code; no zero padding)."""

    def __init__(self, dim, k_m, conv_dropout, channels_per_kernel=4):
        super().__init__()
        assert dim % channels_per_kernel == 0, f"{dim} conv channels are not a multiple of {channels_per_kernel}"
        self.k = k_m
        self.cpk = channels_per_kernel
        self.heads = dim // channels_per_kernel           # H_c = D_c / 4 ("Number of kernels", Table 13)
        self.p = conv_dropout
        self.glu_in = nn.Linear(dim, 2 * dim)             # W_1
        self.w_gen = nn.Linear(dim, k_m * self.heads)     # W_w: f(X_t) in Eq. 1, a linear map of token t only
        self.bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, dim)                    # W_2
        self.keep = False
        self.alpha = None

    def forward(self, x, real):
        # x: (B, L, Dc); real: (B, L) bool, False on left padding
        B, L, C = x.shape
        k, H = self.k, self.heads
        u = F.glu(self.glu_in(x), dim=-1)                                  # (B, L, Dc), u * sigmoid(v)
        logits = F.dropout(self.w_gen(u), self.p, self.training)           # (B, L, k*H), dropout before softmax
        logits = logits.view(B, L, k, H)                                   # tap j of token i reads token i-k+1+j
        src_real = F.pad(real, (k - 1, 0)).unfold(1, k, 1)                 # (B, L, k) False before 0 / on padding
        src_real = src_real | (torch.arange(k, device=x.device) == k - 1)  # a token always reads itself
        alpha = logits.masked_fill(~src_real[..., None], float("-inf")).softmax(2)  # (B, L, k, H), over taps
        if self.keep:
            self.alpha = alpha.detach().transpose(2, 3)                    # (B, L, H, k)
        up = F.pad(u, (0, 0, k - 1, 0))                                    # (B, L+k-1, Dc)
        win = torch.stack([up[:, j:j + L] for j in range(k)], dim=2)       # (B, L, k, Dc): U[i-k+1+j], a loop over taps
        y = (win.view(B, L, k, H, self.cpk) * alpha[..., None]).sum(2)     # (B, L, H, 4)
        return self.out(y.reshape(B, L, C) + self.bias)                    # (B, L, Dc)


class DCConv(nn.Module):
    """Decision Convformer's token mixer (Kim et al. 2023, Sec. 3.1): three static causal depthwise filters of
    window L_w, one per token type (R, s, a); token i takes the output of the filter of its own type. No softmax,
    no GLU, no projection. Used as LSDC's short-term branch (paper Sec. 4.4, D.3) and as DC's mixer."""

    def __init__(self, dim, window, n_types):
        super().__init__()
        self.w, self.n_types = window, n_types
        bound = 1 / math.sqrt(window)  # nn.Conv1d's default init for a depthwise filter (fan_in = window)
        self.weight = nn.Parameter(torch.empty(n_types, dim, window).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_types, dim).uniform_(-bound, bound))

    def forward(self, x, real):
        # x: (B, L, Dc); real: (B, L) bool
        B, L, C = x.shape
        # Padding tokens enter as zeros, exactly the zeros DC pads a sequence with, so a left-padded window gives
        # the same outputs as the shorter unpadded one (DC's code convolves over embedded padding tokens instead).
        x = x * real[..., None]
        win = F.pad(x, (0, 0, self.w - 1, 0)).unfold(1, self.w, 1)        # (B, L, Dc, w): x[i-w+1 .. i]
        types = torch.arange(L, device=x.device) % self.n_types           # (L,) 0 = R, 1 = s, 2 = a
        y = torch.einsum("blcw,lcw->blc", win, self.weight[types])        # (B, L, Dc)
        return y + self.bias[types]


class HybridFusion(nn.Module):
    """Hybrid Fusion Module (App. B.3, Eqs. 2-4): Y_o = softmax(MLP(Y)) * Y with MLP: D -> D/2 -> D."""

    def __init__(self, dim):
        super().__init__()
        self.reduce = nn.Linear(dim, dim // 2)  # Eq. 2, W_f
        self.expand = nn.Linear(dim // 2, dim)  # Eq. 3, W_f1 || W_f2 as one Linear
        self.keep = False
        self.weights = None

    def forward(self, y):
        # y: (B, L, D) = concat(Y_att, Y_conv)
        # Eq. 4: the text says softmax over the "time dimension"; the official code (and Fig. 11, weights per
        # channel) take it over channels, so each token's D weights sum to 1. We follow the code.
        a = self.expand(F.relu(self.reduce(y))).softmax(-1)  # (B, L, D)
        if self.keep:
            self.weights = a.detach()
        return a * y


class LongShortMixer(nn.Module):
    """Masked Long-Short block's token mixer (Sec. 3.2.1, Fig. 4): split channels (1-xi)D | xi D, attention on the
    first part, causal conv on the second, concatenate, fuse (HFM), project (W_O), dropout."""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D = cfg.n_embd
        self.dc, self.da = conv_dim, D - conv_dim
        n_types = 3 if cfg.action_tokens else 2
        self.attn = CausalSelfAttention(self.da, cfg.n_head, cfg.attn_dropout) if self.da else None
        self.conv = None
        if self.dc:
            self.conv = (DynamicConv(self.dc, cfg.kernel, cfg.conv_dropout) if cfg.conv == "dynamic"
                         else DCConv(self.dc, cfg.kernel, n_types))
        # HFM only when both branches exist (code); xi = 0 is then exactly DT's attention + W_O.
        self.fuse = HybridFusion(D) if self.da and self.dc and cfg.fusion == "hfm" else None
        # DC's conv mixer has no output projection and no dropout (x = x + conv(LN(x)), DC code); everything else
        # (LSDT, LSDC, DC_h's attention) has W_O followed by dropout.
        self.proj = None if (cfg.arch in ("dc", "dc_h") and not self.da) else nn.Linear(D, D)
        self.drop = nn.Dropout(cfg.dropout) if self.proj is not None else nn.Identity()

    def forward(self, x, allowed, real):
        # x: (B, L, D)
        x1, x2 = x.split([self.da, self.dc], dim=-1)          # Sec. 3.2.1: attention gets the first (1-xi)D
        ys = []
        if self.attn is not None:
            ys.append(self.attn(x1, allowed))                 # (B, L, Da)
        if self.conv is not None:
            ys.append(self.conv(x2, real))                    # (B, L, Dc)
        y = torch.cat(ys, dim=-1)                             # (B, L, D), attention channels first
        if self.fuse is not None:
            y = self.fuse(y)
        if self.proj is not None:
            y = self.proj(y)                                  # W_O
        return self.drop(y)


class Block(nn.Module):
    """One layer. 'post' (official code, min-decision-transformer): x = LN(x + mixer(x)); x = LN(x + MLP(x)).
    'pre' (the paper's Figure 1 and DC): x = x + mixer(LN(x)); x = x + MLP(LN(x))."""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D = cfg.n_embd
        self.pre = cfg.norm == "pre"
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.mixer = LongShortMixer(cfg, conv_dim)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(cfg.dropout))

    def forward(self, x, allowed, real):
        if self.pre:
            x = x + self.mixer(self.ln_1(x), allowed, real)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.mixer(x, allowed, real))
        return self.ln_2(x + self.mlp(x))


class LSDT(nn.Module):
    """Tokens (R_1, s_1, a_1, R_2, ...) (or (R_t, s_t) without action tokens) -> blocks -> a_t = tanh(W h(s_t)).
    Embeddings as DT: Linear per token type + a learned timestep embedding on every token, then LayerNorm."""

    def __init__(self, cfg):
        super().__init__()
        D = cfg.n_embd
        self.cfg = cfg
        self.n_types = 3 if cfg.action_tokens else 2
        self.embed_t = nn.Embedding(cfg.max_ep_len, D)
        self.embed_rtg = nn.Linear(1, D)
        self.embed_s = nn.Linear(cfg.state_dim, D)
        self.embed_a = nn.Linear(cfg.act_dim, D) if cfg.action_tokens else None
        self.embed_ln = nn.LayerNorm(D)
        self.drop = nn.Dropout(cfg.embd_dropout)
        self.blocks = nn.ModuleList(Block(cfg, dc) for dc in conv_dims(cfg))
        self.ln_f = nn.LayerNorm(D) if cfg.norm == "pre" else nn.Identity()  # no final LN in the post-LN code
        self.head = nn.Sequential(nn.Linear(D, cfg.act_dim), nn.Tanh())
        # Official LSDT code: Xavier-uniform weights, zero biases for every Linear and Embedding; DC's code keeps
        # GPT-2's N(0, 0.02) (its conv filters keep nn.Conv1d's default, as DCConv does).
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                if cfg.arch in ("dc", "dc_h"):
                    nn.init.normal_(m.weight, std=0.02)
                else:
                    nn.init.xavier_uniform_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, states, actions, rtg, timesteps, mask=None):
        # states (B, K, state_dim), actions (B, K, act_dim), rtg (B, K, 1), timesteps (B, K), mask (B, K) 1 = real
        B, K, _ = states.shape
        P = self.n_types
        t = self.embed_t(timesteps.clamp(0, self.embed_t.num_embeddings - 1))   # (B, K, D)
        tok = [self.embed_rtg(rtg) + t, self.embed_s(states) + t]
        if P == 3:
            tok.append(self.embed_a(actions) + t)
        x = torch.stack(tok, dim=2).reshape(B, P * K, -1)                        # (B, L, D), L = P K interleaved
        x = self.drop(self.embed_ln(x))
        L = P * K
        real = (torch.ones(B, K, dtype=torch.bool, device=x.device) if mask is None
                else mask.bool()).repeat_interleave(P, dim=1)                    # (B, L)
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()     # (L, L)
        eye = torch.eye(L, dtype=torch.bool, device=x.device)
        # query i reads key j <= i unless j is padding; padding queries read themselves only (never used)
        allowed = (causal & (real[:, None, :] | eye))[:, None]                  # (B, 1, L, L)
        for block in self.blocks:
            x = block(x, allowed, real)
        x = self.ln_f(x).view(B, K, P, -1)                                       # (B, K, P, D)
        return self.head(x[:, :, 1])                                            # (B, K, act_dim), from s_t tokens

    def keep_maps(self, on=True):
        """Analysis: make the attention / dynamic-conv / HFM modules keep their last weights."""
        for m in self.modules():
            if hasattr(m, "keep"):
                m.keep = on


# ============================================================================================================
# Training (numpy, data.py, evaluate.py from here on)
# ============================================================================================================

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import data as data_lib  # noqa: E402
import evaluate as eval_lib  # noqa: E402


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def model_inputs(batch, n_state):
    """The model's view of a data.py / evaluate.py batch; n_state < obs_dim drops the goal (LSDT vs LSDT-gs)."""
    return batch["states"][..., :n_state], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"]


def make_act(model, n_state):
    """The evaluate() policy: a batch of contexts -> the action predicted at the last (current) position."""
    def act(batch, live):
        return model(*model_inputs(batch, n_state))[:, -1]
    return act


def loss_fn(model, batch, n_state):
    pred = model(*model_inputs(batch, n_state))                     # (B, K, act)
    err = ((pred - batch["actions"]) ** 2).mean(-1)                  # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()         # MSE over real (unpadded) steps (code)


def lr_lambda(cfg):
    """Official code: linear warmup for warmup_steps updates, then one cosine cycle down to 0 at --steps."""
    def f(s):
        if s < cfg.warmup_steps:
            return (s + 1) / cfg.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))))
    return f


LOG_FIELDS = ["step", "loss", "lr", "target", "eval_return", "eval_return_std", "normalized_score",
              "normalized_score_std", "success_rate", "steps_to_goal", "wall_time"]


def plot_curve(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    train_rows = [r for r in rows if r["loss"] != ""]
    ax1.plot([int(r["step"]) for r in train_rows], [float(r["loss"]) for r in train_rows])
    ax1.set(xlabel="step", ylabel="action MSE", yscale="log", title="training loss")
    for target in sorted({r["target"] for r in rows if r["target"] != ""}, key=float):
        ev = [r for r in rows if r["target"] == target]
        ax2.plot([int(r["step"]) for r in ev], [float(r["normalized_score"]) for r in ev], "o-", label=f"target {target}")
    ax2.set(xlabel="step", ylabel="normalised score", title="evaluation")
    if ax2.lines:
        ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def eval_targets(cfg, d):
    """--target-return, else the paper's (Table 5) for the dataset, else data.py's targets."""
    if cfg.target_return is not None:
        return [cfg.target_return]
    row = PAPER_TABLE.get(paper_row(cfg.dataset or cfg.env)) if cfg.paper_table else None
    if row and row.get("target_return") is not None:
        return [row["target_return"]]
    return d.target_returns


def run_evals(model, d, cfg, device, seed, n_state):
    """Evaluate every target return; returns [(target, result dict)]."""
    model.eval()
    out = [(g, eval_lib.evaluate(make_act(model, n_state), d, cfg.eval_episodes, g, seed, cfg.context, device))
           for g in eval_targets(cfg, d)]
    model.train()
    return out


def train(cfg):
    problem = check_config(cfg)
    if problem:
        raise data_lib.DataError(problem)
    device = pick_device(cfg.device)
    d = data_lib.load_data(cfg.dataset or cfg.env)
    name = (cfg.dataset or cfg.env).replace("/", "-")
    out = cfg.out or os.path.join("runs", "lsdt", name, f"seed{cfg.seed}")
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "ckpt.pt")
    n_goal = d.goal_dim  # data.py flattens dict observations to observation ++ desired_goal
    n_state = d.obs_dim - (0 if cfg.goal_state else n_goal)
    cfg = dataclasses.replace(cfg, state_dim=n_state, act_dim=d.act_dim, max_ep_len=d.max_ep_len)
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; "
          f"normalised with {d.ref_source}; eval targets {eval_targets(cfg, d)}; device {device}")
    row = paper_row(cfg.dataset or cfg.env)
    print(f"model: {cfg.arch}, conv {cfg.conv}, xi={cfg.conv_ratio} (conv channels per block {conv_dims(cfg)} of "
          f"{cfg.n_embd}), K={cfg.context}, k_m={cfg.kernel}, fusion {cfg.fusion}, {cfg.norm}-LN, "
          f"{'(R, s, a)' if cfg.action_tokens else '(R, s)'} tokens; paper row: {row if cfg.paper_table else 'off'}"
          + (f"; goal-state {'on' if cfg.goal_state else 'OFF (goal dims dropped)'} ({n_goal} goal dims)"
             if n_goal else ""))

    torch.manual_seed(cfg.seed)
    model = LSDT(cfg).to(device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    rng = np.random.default_rng(cfg.seed)
    step, wall, rows = 0, 0.0, []

    if cfg.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location=device, weights_only=True)
        try:
            model.load_state_dict(ck["model"])
        except RuntimeError:
            raise data_lib.DataError(f"{ckpt_path} does not fit this model (it was written with config "
                                     f"{ck.get('config')}); pass the same model flags or another --out") from None
        opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"])
        step, wall = ck["step"], ck["wall_time"]
        rng.bit_generator.state = json.loads(ck["numpy_rng"])
        torch.set_rng_state(ck["torch_rng"])
        if os.path.exists(os.path.join(out, "log.csv")):  # keep the rows written up to the checkpoint
            with open(os.path.join(out, "log.csv")) as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= step]
        print(f"resumed from {ckpt_path} at step {step}")
    elif cfg.resume:
        print(f"no checkpoint at {ckpt_path}; starting from scratch")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg) | {"dataset_id": d.dataset_id, "device": device, "paper_row": row}, f,
                  indent=2)

    def save():
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step,
                        wall_time=wall, numpy_rng=json.dumps(rng.bit_generator.state), torch_rng=torch.get_rng_state(),
                        config=dataclasses.asdict(cfg), state_mean=torch.from_numpy(d.state_mean),
                        state_std=torch.from_numpy(d.state_std), return_scale=d.return_scale,
                        max_ep_len=d.max_ep_len, dataset_id=d.dataset_id), ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)  # never leave a half-written checkpoint behind
        with open(os.path.join(out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(rows)

    last_eval, final = "", None
    t_log, losses = time.time(), []
    model.train()
    try:
        while step < cfg.steps:
            t0 = time.time()
            batch = {k: v.to(device) for k, v in d.sample(cfg.batch_size, cfg.context, rng).items()}
            loss = loss_fn(model, batch, n_state)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            wall += time.time() - t0
            losses.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.steps:
                ms = 1e3 * (time.time() - t_log) / len(losses)
                rows.append(dict.fromkeys(LOG_FIELDS, "") | dict(step=step, loss=f"{np.mean(losses):.6f}",
                                                                 lr=f"{sched.get_last_lr()[0]:.3e}",
                                                                 wall_time=f"{wall:.1f}"))
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{ms:.1f} ms/step{last_eval}", flush=True)
                t_log, losses = time.time(), []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.time()
                results = run_evals(model, d, cfg, device, cfg.seed + 10_000, n_state)
                wall += time.time() - t0
                for g, res in results:
                    rows.append(dict.fromkeys(LOG_FIELDS, "") | dict(
                        step=step, target=g, eval_return=f"{res['returns'].mean():.2f}",
                        eval_return_std=f"{res['returns'].std():.2f}",
                        normalized_score=f"{res['normalized'].mean():.2f}",
                        normalized_score_std=f"{res['normalized'].std():.2f}",
                        success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                        steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                        wall_time=f"{wall:.1f}"))
                    print(f"eval step {step} target {g:g}: {eval_lib.summarize(res)} ({time.time() - t0:.0f}s)")
                final = results[0]
                last_eval = f" | eval {final[1]['normalized'].mean():.1f}"
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), f"lsdt {d.dataset_id} seed {cfg.seed}")
                t_log = time.time()
    except KeyboardInterrupt:
        save()
        print(f"\ninterrupted at step {step}; checkpoint saved, continue with --resume")
        raise SystemExit(130)
    if final is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        final = run_evals(model, d, cfg, device, cfg.seed + 10_000, n_state)[0]
    if cfg.plot_mixing:
        batch = d.sample(8, cfg.context, np.random.default_rng(cfg.seed + 1))
        path = plot_mixing(model, {k: v.to(device) for k, v in batch.items()}, n_state, os.path.join(out, "mixing.png"))
        print(f"mixing maps: {path}" if path else "mixing maps: nothing to plot (no attention, dynamic conv or HFM)")
    res = final[1]
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


# ============================================================================================================
# Analysis: what each branch mixes (paper Fig. 3 / 9: attention and kernel matrices; Fig. 11: HFM weights)
# ============================================================================================================

def mixing_maps(model, batch, n_state, layer=0, index=0):
    """L x L matrices of one window (batch element `index`, block `layer`), heads averaged:
    'attention' = the long-term branch's probabilities P, 'kernel' = the dynamic kernels alpha laid out as a banded
    L x L matrix (row i: weights on tokens i-k_m+1 .. i), 'hfm' = the HFM weights A (L x D). Missing branches absent."""
    was = model.training
    model.eval()
    model.keep_maps(True)
    with torch.no_grad():
        model(*model_inputs(batch, n_state))
    model.keep_maps(False)
    model.train(was)
    mixer = model.blocks[layer].mixer
    maps = {}
    if mixer.attn is not None:
        maps["attention"] = mixer.attn.probs[index].mean(0).cpu()                       # (L, L)
    if isinstance(mixer.conv, DynamicConv):
        alpha = mixer.conv.alpha[index].mean(1).cpu()                                   # (L, k) heads averaged
        L, k = alpha.shape
        dense = torch.zeros(L, L + k - 1)
        rows = torch.arange(L)[:, None]
        dense[rows, rows + torch.arange(k)[None, :]] = alpha                            # tap j of row i -> i-k+1+j
        maps["kernel"] = dense[:, k - 1:]                                               # (L, L); taps before 0 drop
    if mixer.fuse is not None:
        maps["hfm"] = mixer.fuse.weights[index].cpu()                                  # (L, D)
    return maps


def plot_mixing(model, batch, n_state, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    maps = mixing_maps(model, batch, n_state)
    if not maps:
        return None
    P = model.n_types
    real = int(batch["mask"][0].sum().item()) * P
    labels = ["R", "s", "a"][:P]
    fig, axes = plt.subplots(1, len(maps), figsize=(5 * len(maps), 4.5), squeeze=False)
    for ax, (name, m) in zip(axes[0], maps.items()):
        m = m[-real:, -real:] if name != "hfm" else m[-real:]                          # drop left padding
        im = ax.imshow(m.numpy(), cmap="viridis", aspect="auto" if name == "hfm" else "equal")
        ticks = list(range(0, m.shape[0], P))
        ax.set_yticks(ticks, [f"{labels[0]}{i}" for i in range(len(ticks))])
        if name != "hfm":
            ax.set_xticks(ticks, [f"{labels[0]}{i}" for i in range(len(ticks))], rotation=90)
        else:  # attention channels | conv channels
            ax.axvline(model.blocks[0].mixer.da - 0.5, color="white", lw=1)
            ax.set_xlabel("channel (attention | conv)")
        ax.set_title({"attention": "long-term branch: attention P", "kernel": "short-term branch: dynamic kernels",
                      "hfm": "HFM weights (tokens x channels)"}[name] + " (block 1)")
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ============================================================================================================
# Command line
# ============================================================================================================

def parse_args(argv):
    """Every Config field is a flag (--conv-ratio for conv_ratio). Layers, later ones win: Config defaults ->
    PAPER_TABLE row of the dataset -> --arch defaults -> --preset -> explicit flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Config):
        if f.name in ("state_dim", "act_dim", "max_ep_len"):
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f.metadata["help"])
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type) if f.default is not None else float
            p.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{f.metadata['help']} (default: {f.default})")
    given = vars(p.parse_args(argv))
    preset, arch = given.get("preset", ""), given.get("arch", "lsdt")
    if preset and preset not in PRESETS:
        p.error(f"unknown preset '{preset}'; known: {', '.join(PRESETS)}")
    if arch not in ("lsdt", *ARCH_DEFAULTS):
        p.error(f"unknown --arch '{arch}'; known: lsdt, {', '.join(ARCH_DEFAULTS)}")
    for name, known in (("conv", ("dynamic", "dc")), ("fusion", ("hfm", "concat")), ("norm", ("post", "pre"))):
        if name in given and given[name] not in known:
            p.error(f"unknown --{name} '{given[name]}'; known: {', '.join(known)}")
    layers = {}
    if given.get("paper_table", True):
        row = PAPER_TABLE.get(paper_row(given.get("dataset") or given.get("env", Config.env)), {})
        layers.update({k: v for k, v in row.items() if k != "target_return"})  # the target is read in eval_targets
    layers.update(ARCH_DEFAULTS.get(arch, {}))
    layers.update(PRESETS.get(preset, {}))
    layers.update(given)
    return Config(**layers)


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        train(cfg)
    except data_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
