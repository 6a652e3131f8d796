r"""
Long-Short Decision Transformer (LSDT): "Long-Short Decision Transformer: Bridging Global and Local Dependencies
for Generalized Decision-Making" (anonymous ICLR submission). Official code, built on min-decision-transformer:
https://github.com/WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER/blob/1feb77acff9b4a2ab6aa889210887f7d96918b1d/decision_transformer/LSDT.py#L137
Decision Convformer (DC, Kim et al. 2023), the paper's conv-only baseline and LSDC's short-term branch, is here too:
https://github.com/beanie00/Decision-ConvFormer/blob/3db9b9ecf6885b1ed9c1e7a20d5dd92aa132b1ef/gym/models/decision_convformer.py#L43

LSDT is dt.py's Decision Transformer whose token mixer (Sec. 3.2.1, Fig. 4) splits the D channels: (1 - xi) D go to
causal self-attention (long-term branch), xi D to a causal dynamic convolution over the last k_m tokens (short-term
branch, Eq. 1); the Hybrid Fusion Module (HFM, App. B.3) re-weights their concatenation, W_O projects it.
    X[..., :D_a] -> causal multi-head attention (long-term)  --\
                                                               concat -> HFM -> W_O -> + X -> LN -> MLP ...
    X[..., D_a:] -> causal DynamicConv, k_m taps (short-term) --/

    python lsdt.py --env hopper-medium               # the paper's hopper-medium row: xi=1, D=256, no action tokens
    python lsdt.py --env hopper-medium --preset cpu  # small configuration for a 2-core laptop
    MINARI_DATASETS_PATH=<local datasets> python lsdt.py --dataset replica/pointmaze/medium-dense-v0 --preset cpu
    python lsdt.py --out <run folder> --plot-mixing  # the run's attention / kernel / HFM maps (never retrains)
    python lsdt.py --out <run folder> --target-sweep # DT's Fig. 4: the return achieved against the one asked for

What each flag reproduces:
    --conv-ratio XI          Fig. 7 and Table 14 (the xi sweep; 0 = DT, 1 = CDT)
    --no-goal-state          Table 2 (LSDT vs LSDT-gs, DC_h vs DC_h-gs) and Table 4 (goal-state conditioning, Sec. 3.3)
    --conv dc                Table 3 and Fig. 2, 6 (LSDC: DC's static filters as the short-term branch, D.3)
    --arch dc / dc_h         Tables 1-3 (the Decision Convformer baselines, Table 12)
    --fusion concat          Fig. 10 (HFM vs direct concatenation, B.3)
    --routing res / weight   Table 8 (LSDT-res, LSDT-weight: other ways of routing channels to the branches, B.10)
    --dropkey P              Table 6 (DropKey in place of attention dropout, B.8)
    --kernel K_M             Table 7 (kernel size, B.7 / B.9)
    --no-action-tokens       D.2 (hopper-medium is trained on (R, s) tokens only)
    --norm pre               Figure 1 as drawn (pre-LN)
    --plot-mixing            Fig. 3 and 9 (attention and dynamic-kernel matrices), Fig. 11 (HFM weights)
    --plot-paths             Fig. 8 (maze paths of the run's policy over the dataset's goals, B.1)

Glossary (paper symbol -> code name; R_t, s_t, a_t, t, B and mask as in dt.py):
    K       context: timesteps the model sees (Table 5)                        Config.context
    L       tokens per window: 3K for (R, s, a), 2K without action tokens     n * K, n = tokens per timestep
    D       token width (Table 13: 128; 256 for hopper-medium/-medium-replay)  Config.n_embd
    xi      share of D for the short-term (conv) branch (Sec. 3.2.1)           Config.conv_ratio
    D_c, D_a  conv / attention channels: round(xi D), D - D_c (conv_dims())    LongShortMixer.dc, .da
    N_h     attention heads of the long-term branch; d = D_a / N_h per head    Config.n_head; hs
    k_m     causal taps of a dynamic kernel, the current token included (B.7)  Config.kernel, DynamicConv.k
    H_c     dynamic kernels per token, D_c / 4 (4 channels share one)          DynamicConv.heads
    U       GLU(X_2 W_1), the conv branch's input                              u (B, L, D_c)
    alpha   softmax-normalised dynamic kernels, Eq. 1                          alpha (B, L, k_m, H_c)
    P       attention probabilities softmax(Q K^T / sqrt(d))                   probs (B, N_h, L, L), analysis path
    A       HFM weights softmax(Z), over channels (Eq. 4)                      HybridFusion.weights (B, L, D)
    W_O     output projection after the concat                                 LongShortMixer.c_proj
    g       goal (x, y) appended to the state (goal-state conditioning, 3.3)   the last goal_dim entries of states

Layout: Config -> the model (copy it alone) -> the paper's pieces -> train(), as in dt.py -> figures -> main().

Departures from the paper and the official code (#Lnn alone: a line of its LSDT.py):
 1. Post-LN, no final LN, as the code (#L262) behind the paper's numbers; its Figure 1 draws pre-LN (--norm pre).
 2. HFM's softmax (Eq. 4) is over channels, as the code (#L200) and Fig. 11; the text says "time dimension".
 3. DynamicConv predicts only the k_m causal taps; the code predicts 2 k_m - 1 centred taps and masks the future half
    (#L88): the same function without dead weights (W_w's Xavier init scale differs with its width).
 4. xi = 0 is attention + W_O without HFM, the paper's "standard DT"; the code fails there (#L173).
 5. --no-action-tokens (D.2's hopper-medium) is DC's remove_act_embs; the released LSDT code has no such path.
 6. --dropkey sets dropped logits to -inf, never a token's own (Li et al. 2022); the code's is commented out (#L229).
 7. Windows are data.py's (episodes by length, left-padded as evaluation feeds them, padding masked); the code
    draws episodes uniformly and windows whole where it can (utils_o.py#L180).
 8. DC's filters read padding as zeros, so padding changes nothing; DC's code convolves the embedded padding tokens.
 9. Maze2d rows serve Minari's PointMaze with data.py's target, not RTG 300: Minari's episodes stop at the goal.
10. A run keeps its last checkpoint; the code, the best of 200 evaluations on the test env (scripts/train.py#L266).
"""
import math
import os
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import data as data_lib
import evaluate as ev

def arg(default, help, run=False):
    """A Config field and flag. run=True: not what is trained (not in the variant name, may differ on --resume)."""
    return field(default=default, metadata={"help": help, "run": run})

@dataclass
class Config:
    # --- the paper's settings (what is trained): data, optimisation (Table 13), the model (Table 13, official code)
    delayed_reward: bool = arg(False, "rewards paid at an episode's last step, in data and evaluation (DT Table 5)")
    batch_size: int = arg(64, "windows per batch (Table 13: 64 locomotion, 256 mazes)")
    context: int = arg(10, "K, timesteps the model sees (Table 5)")
    lr: float = arg(1e-4, "AdamW learning rate (Table 13: 1e-4 locomotion, 2e-4 mazes)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (Tables 12, 13)")
    warmup_steps: int = arg(10_000, "linear warmup; then LSDT: cosine to 0 at --steps (Table 13); DC: constant")
    grad_clip: float = arg(0.25, "gradient-norm clip (Tables 12, 13)")
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine")
    amp: bool = arg(False, "bf16 autocast for the forward pass (for CUDA; the loss is reduced in fp32)")
    paper_table: bool = arg(True, "apply PAPER_TABLE's row for the dataset (K, xi, RTG, width...) under the flags")
    arch: str = arg("lsdt", "lsdt | dc (Decision Convformer) | dc_h (DC with attention in the last block)")
    n_layer: int = arg(3, "blocks")
    n_embd: int = arg(128, "token width D (256 for hopper-medium / -medium-replay)")
    n_head: int = arg(1, "heads of the attention (long-term) branch")
    conv_ratio: float = arg(0.5, "xi: share of D for the conv (short-term) branch; 0 = DT, 1 = conv only (CDT)")
    kernel: int = arg(6, "k_m, causal taps of the conv branch incl. the current token (3 for Maze2d; DC: window)")
    conv: str = arg("dynamic", "short-term branch: dynamic (DynamicConv, LSDT) | dc (DC's static filters, LSDC)")
    fusion: str = arg("hfm", "hfm (Hybrid Fusion Module, App. B.3) | concat (direct concatenation)")
    routing: str = arg("split", "B.10, Table 8: split (LSDT) | res (LSDT-res) | weight (LSDT-weight: all D to both)")
    norm: str = arg("post", "post (official code) | pre (the paper's Figure 1, and DC)")
    dropout: float = arg(0.25, "dropout after W_O and after the MLP")
    attn_dropout: float = arg(0.1, "dropout on the attention output P V (official code)")
    conv_dropout: float = arg(0.2, "dropout on the dynamic-kernel logits before the softmax (official code)")
    embd_dropout: float = arg(0.0, "dropout on the token embeddings (none in LSDT, 0.1 in DC)")
    dropkey: float = arg(0.0, "DropKey (B.8, Table 6): drop attention logits with this probability, not --attn-dropout")
    action_tokens: bool = arg(True, "a_t tokens in the sequence; --no-action-tokens: (R, s) only (D.2, hopper-medium)")
    goal_state: bool = arg(True, "goal-state conditioning (Sec. 3.3): keep desired_goal in the state on goal tasks")
    # --- the run (seed, data, evaluation, output, device, analyses): these do not change what is trained
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)", run=True)
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env", run=True)
    seed: int = arg(0, "seed for sampling, initialisation and evaluation", run=True)
    steps: int = arg(100_000, "gradient steps (Table 13: 1e5; the cosine ends here: resume with the same)", run=True)
    eval_every: int = arg(500, "evaluate and checkpoint every this many steps and at the end (code: 500)", run=True)
    eval_episodes: int = arg(20, "episodes per target, in parallel (Table 1: 20 locomotion, 100 mazes)", run=True)
    target_return: float = arg(None, "return-to-go prompt, raw units; default: Table 5's, else the dataset's", run=True)
    log_every: int = arg(100, "print and log the training loss every this many steps", run=True)
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", run=True)
    out: str = arg("", "output folder; default runs/lsdt/<env>/<variant>/seed<N>", run=True)
    resume: bool = arg(False, "continue the run in the output folder (its settings come from its checkpoint)", run=True)
    compile: bool = arg(False, "torch.compile the model for training (same results within float tolerance)", run=True)
    bench: bool = arg(False, "time training steps (eager vs compiled, AMP on CUDA) on synthetic data; exit", run=True)
    plot_mixing: bool = arg(False, "write mixing.png: block 1's maps in the run's checkpoint (Fig. 3, 9, 11)", run=True)
    plot_paths: bool = arg(False, "write paths.png: --eval-episodes maze rollouts of the checkpoint (Fig. 8)", run=True)
    gif: bool = arg(False, "write episode.gif: one evaluation episode of the checkpoint at its first target", run=True)
    target_sweep: bool = arg(False, "target_sweep.png (DT's Fig. 4): the return achieved at 8 targets, from the "
                                    "data's lowest to above its best", run=True)

# A small LSDT for 2 CPU cores (dt.py's cpu budget) over the dataset's row: Config < row < --arch < --preset < flags.
# Mazes: K=1, as their noisy actions are a history to copy (medium-dense, seed 0: 92% reach the goal at K=1, 24% at 20).
PRESETS = {"cpu": dict(n_embd=64, n_layer=2, batch_size=64, lr=1e-3, warmup_steps=500, steps=6000, eval_every=2000,
                       eval_episodes=10, mazes=dict(context=1, eval_episodes=50))}

# >>> model: begin (needs only torch, math and dataclasses: copy this block, with Config and arg above, into your code)
# Under --amp (bf16 autocast) the Linears and matmuls run in bf16; nothing here is a recurrence or a long sum.

def conv_dims(cfg):
    """D_c per block: round(xi D) for LSDT / LSDC (Sec. 3.2.1); D for DC; DC_h: D, ..., D, 0 (attention last)."""
    if cfg.arch == "lsdt":
        return [int(round(cfg.conv_ratio * cfg.n_embd))] * cfg.n_layer
    return [cfg.n_embd] * (cfg.n_layer - 1) + [0 if cfg.arch == "dc_h" else cfg.n_embd]   # DC_h: attention last

class CausalSelfAttention(nn.Module):
    """Long-term branch (Sec. 3.2.1): causal multi-head self-attention on D_a channels, W_O being the mixer's. P is
    explicit for the analysis (keep, Fig. 3) and DropKey, else torch's fused softmax(q k^T / sqrt(hs)) v."""

    def __init__(self, dim, n_head, attn_dropout, dropkey):
        super().__init__()
        assert dim % n_head == 0, f"{dim} attention channels do not split into {n_head} heads"
        self.n_head, self.dropkey = n_head, dropkey
        self.c_attn = nn.Linear(dim, 3 * dim)          # W_Q || W_K || W_V (the code's three Linears, fused)
        # WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L238
        self.drop = nn.Dropout(0.0 if dropkey else attn_dropout)   # on P V, not on P; DropKey replaces it (B.8)
        self.keep, self.probs = False, None            # analysis: keep the last P in self.probs

    def forward(self, x, attn_mask):
        B, T, C = x.shape                                                  # x: (B, L, D_a); attn_mask (B, 1, L, L)
        q, k, v = self.c_attn(x).split(C, dim=2)                          # 3 x (B, L, D_a)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, L, hs)
        dropkey = self.training and self.dropkey > 0
        if self.keep or dropkey:
            att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))         # (B, nh, L, L) Q K^T / sqrt(d)
            att = att.masked_fill(~attn_mask, float("-inf"))
            if dropkey:  # B.8, DropKey (Li et al. 2022): drop keys, i.e. logits, before the softmax (no rescaling:
                # the softmax renormalises); a token's own key is never dropped, so no row of the softmax is empty
                drop = torch.rand(att.shape, device=att.device) < self.dropkey
                att = att.masked_fill(drop & ~torch.eye(T, dtype=torch.bool, device=x.device), float("-inf"))
            att = att.softmax(-1)                                          # (B, nh, L, L) P
            if self.keep:
                self.probs = att.detach()
            y = att @ v                                                    # (B, nh, L, hs)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, nh, L, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                   # (B, L, D_a)
        return self.drop(y)

class DynamicConv(nn.Module):
    """Short-term branch: causal DynamicConv (Wu et al. 2019; paper Eq. 1) as the official code computes it, ESPnet's
    DynamicConvolution with a kernel mask:
        U = GLU(X W_1)                                  input GLU, (B, L, D_c)
        alpha[i, h, :] = softmax(dropout(U_i W_w))      one kernel of k_m taps per token i and head h
        Y[i, c] = sum_j alpha[i, h(c), j] U[i-k_m+1+j, c] + b_c,  h(c) = c // 4   (4 channels share a kernel)
        out = Y W_2
    Only the k_m causal taps (departure 3); taps before the sequence or on padding masked, the softmax renormalising.
    WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L22"""

    def __init__(self, dim, k_m, conv_dropout):
        super().__init__()
        assert dim % 4 == 0, f"{dim} conv channels are not a multiple of 4"
        self.k = k_m
        self.heads = dim // 4                             # H_c = D_c / 4 ("Number of kernels", Table 13)
        self.p = conv_dropout
        self.glu_in = nn.Linear(dim, 2 * dim)             # W_1
        self.w_gen = nn.Linear(dim, k_m * self.heads)     # W_w: f(X_t) in Eq. 1, a linear map of token t only
        self.bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, dim)                    # W_2
        self.keep, self.alpha = False, None               # analysis: keep the last kernels in self.alpha

    def forward(self, x, real):
        B, L, C = x.shape                                                  # x: (B, L, D_c); real: (B, L) bool
        k, H = self.k, self.heads
        u = F.glu(self.glu_in(x), dim=-1)                                  # (B, L, D_c), u * sigmoid(v)
        logits = F.dropout(self.w_gen(u), self.p, self.training)           # (B, L, k*H), dropout before softmax (code)
        logits = logits.view(B, L, k, H)                                   # tap j of token i reads token i-k+1+j
        src_real = F.pad(real, (k - 1, 0)).unfold(1, k, 1)                 # (B, L, k) False before 0 / on padding
        src_real = src_real | (torch.arange(k, device=x.device) == k - 1)  # a token always reads itself
        alpha = logits.masked_fill(~src_real[..., None], float("-inf")).softmax(2)  # (B, L, k, H), over taps: Eq. 1
        if self.keep:
            self.alpha = alpha.detach().transpose(2, 3)                    # (B, L, H, k)
        up = F.pad(u, (0, 0, k - 1, 0))                                    # (B, L+k-1, D_c)
        win = torch.stack([up[:, j:j + L] for j in range(k)], dim=2)       # (B, L, k, D_c): U[i-k+1+j], tap by tap
        y = (win.view(B, L, k, H, 4) * alpha[..., None]).sum(2)            # (B, L, H, 4): Eq. 1's sum over taps
        return self.out(y.reshape(B, L, C) + self.bias)                    # (B, L, D_c)

class DCConv(nn.Module):
    """Decision Convformer's token mixer (Kim et al. 2023, Sec. 3.1): three static causal depthwise filters of
    window L_w, one per token type (R, s, a), token i taking its own type's (no softmax, GLU or projection).
    LSDC's short-term branch (paper Sec. 4.4, D.3) and DC's mixer:
    beanie00/Decision-ConvFormer@3db9b9e gym/models/decision_convformer.py#L43
    WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDC.py#L20"""

    def __init__(self, dim, window, n_types):
        super().__init__()
        self.w, self.n_types = window, n_types
        bound = 1 / math.sqrt(window)  # nn.Conv1d's default init for a depthwise filter (fan_in = window)
        self.weight = nn.Parameter(torch.empty(n_types, dim, window).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_types, dim).uniform_(-bound, bound))

    def forward(self, x, real):
        B, L, C = x.shape                                                  # x: (B, L, D_c); real: (B, L) bool
        x = x * real[..., None]                   # padding tokens as the zeros DC pads with (departure 8)
        win = F.pad(x, (0, 0, self.w - 1, 0)).unfold(1, self.w, 1)        # (B, L, D_c, w): x[i-w+1 .. i]
        types = torch.arange(L, device=x.device) % self.n_types           # (L,) 0 = R, 1 = s, 2 = a
        y = torch.einsum("blcw,lcw->blc", win, self.weight[types])        # (B, L, D_c)
        return y + self.bias[types]

class HybridFusion(nn.Module):
    """Hybrid Fusion Module (App. B.3, Eqs. 2-4): Y_o = softmax(MLP(Y)) * Y, MLP: W -> W/2 -> W, on Y = concat(Y_att,
    Y_conv) (B, L, W). over_branches: LSDT-weight's join (App. B.10), "a learnable weighted sum, computed using a
    modified version of our HFM module", without equations; here HFM on the 2D-wide concat of the full-width outputs,
    softmax over the two branches per token and channel: Y = A_att * Y_att + A_conv * Y_conv (B, L, D)."""

    def __init__(self, width, over_branches=False):
        super().__init__()
        self.reduce = nn.Linear(width, width // 2)  # Eq. 2, W_f
        self.expand = nn.Linear(width // 2, width)  # Eq. 3, W_f1 || W_f2 as one Linear
        self.over_branches = over_branches
        self.keep, self.weights = False, None       # analysis: keep the last A in self.weights

    def forward(self, y):
        z = self.expand(F.relu(self.reduce(y)))                         # (B, L, W) Z, Eqs. 2-3
        if self.over_branches:
            a = z.view(*z.shape[:-1], 2, -1).softmax(-2)                # (B, L, 2, D) A over {att, conv}, per channel
            y_att, y_conv = y.chunk(2, dim=-1)                          # 2 x (B, L, D)
            out = a[..., 0, :] * y_att + a[..., 1, :] * y_conv          # (B, L, D)
        else:
            # Eq. 4's softmax over channels, each token's D weights summing to 1 (departure 2):
            # WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L195
            a = z.softmax(-1)                                           # (B, L, D) A = softmax(Z)
            out = a * y                                                 # (B, L, D) Y_o, Eq. 4
        if self.keep:
            self.weights = (a[..., 0, :] if self.over_branches else a).detach()   # (B, L, D) A, or A_att = 1 - A_conv
        return out

class LongShortMixer(nn.Module):
    """The Masked Long-Short token mixer (Sec. 3.2.1, Fig. 4; the figure atop this file), then dropout; --routing's
    variants (App. B.10, Table 8) are marked below.
    WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L182"""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D = cfg.n_embd
        self.routing = cfg.routing
        # App. B.10, LSDT-weight: "the full embedding is fed into both branches instead of a subset" (xi unused)
        self.dc, self.da = (D, D) if cfg.routing == "weight" else (conv_dim, D - conv_dim)
        self.attn = CausalSelfAttention(self.da, cfg.n_head, cfg.attn_dropout, cfg.dropkey) if self.da else None
        self.conv = None
        if self.dc:
            self.conv = (DynamicConv(self.dc, cfg.kernel, cfg.conv_dropout) if cfg.conv == "dynamic"
                         else DCConv(self.dc, cfg.kernel, 3 if cfg.action_tokens else 2))
        # App. B.10, LSDT-res: "two separate linear projections with residual connections before feeding inputs to the
        # branches" (no equations); chosen: X_1 + W_r1 X_1 (D_a -> D_a), X_2 + W_r2 X_2 (D_c -> D_c), per branch
        res = cfg.routing == "res"
        self.res_attn = nn.Linear(self.da, self.da) if res and self.attn is not None else None
        self.res_conv = nn.Linear(self.dc, self.dc) if res and self.conv is not None else None
        # HFM only when both branches exist (code), so xi = 0 is DT's attention + W_O (departure 4). LSDT-weight: its
        # "modified HFM" (App. B.10) on the 2D-wide concatenation
        self.fuse = (HybridFusion(2 * D, over_branches=True) if cfg.routing == "weight" else
                     HybridFusion(D) if self.da and self.dc and cfg.fusion == "hfm" else None)
        # DC's conv mixer has no W_O and no dropout, where LSDT, LSDC and DC_h's attention have W_O, then dropout
        # beanie00/Decision-ConvFormer@3db9b9e gym/models/decision_convformer.py#L101
        self.c_proj = None if (cfg.arch in ("dc", "dc_h") and not self.da) else nn.Linear(D, D)
        self.resid_drop = nn.Dropout(cfg.dropout) if self.c_proj is not None else nn.Identity()

    def forward(self, x, attn_mask, real):
        # Sec. 3.2.1: X_1 (B, L, D_a) | X_2 (B, L, D_c); LSDT-weight (App. B.10): all of X (B, L, D) to both
        x1, x2 = (x, x) if self.routing == "weight" else x.split([self.da, self.dc], dim=-1)
        if self.res_attn is not None:
            x1 = x1 + self.res_attn(x1)                       # App. B.10 LSDT-res: X_1 + W_r1 X_1
        if self.res_conv is not None:
            x2 = x2 + self.res_conv(x2)                       # App. B.10 LSDT-res: X_2 + W_r2 X_2
        ys = []
        if self.attn is not None:
            ys.append(self.attn(x1, attn_mask))               # (B, L, D_a) long-term branch
        if self.conv is not None:
            ys.append(self.conv(x2, real))                    # (B, L, D_c) short-term branch
        y = torch.cat(ys, dim=-1)                             # (B, L, D), attention first (Eq. 2); weight: (B, L, 2D)
        if self.fuse is not None:
            y = self.fuse(y)                                  # Eqs. 2-4; weight: the branches' weighted sum (B, L, D)
        if self.c_proj is not None:
            y = self.c_proj(y)                                # W_O
        return self.resid_drop(y)

class Block(nn.Module):
    """One layer. 'post' (official code): x = LN(x + mixer(x)); x = LN(x + MLP(x)).
    'pre' (the paper's Figure 1, dt.py's GPT-2 block, and DC): x = x + mixer(LN(x)); x = x + MLP(LN(x)).
    WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L262"""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D = cfg.n_embd
        self.pre = cfg.norm == "pre"
        self.ln_1 = nn.LayerNorm(D)
        self.mixer = LongShortMixer(cfg, conv_dim)
        self.ln_2 = nn.LayerNorm(D)
        # GELU (Table 13; DT's gym code uses ReLU)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D), nn.Dropout(cfg.dropout))

    def forward(self, x, attn_mask, real):
        if self.pre:
            x = x + self.mixer(self.ln_1(x), attn_mask, real)
            return x + self.mlp(self.ln_2(x))
        x = self.ln_1(x + self.mixer(x, attn_mask, real))
        return self.ln_2(x + self.mlp(x))

class LSDT(nn.Module):
    """dt.py's DecisionTransformer with LongShortMixer blocks: tokens (R_1, s_1, a_1, R_2, ...), or (R_t, s_t) (D.2) ->
    a_t = tanh(W h(s_t)); DC / DC_h (--arch) differ in mixers, norm and init. obs_dim: the width embedded (+ goal)."""

    def __init__(self, cfg, obs_dim, act_dim, max_ep_len):
        super().__init__()
        D = cfg.n_embd
        self.embed_timestep = nn.Embedding(max_ep_len, D)   # as DT: one learned embedding per timestep, on every token
        self.embed_return = nn.Linear(1, D)
        self.embed_state = nn.Linear(obs_dim, D)
        self.action_tokens = cfg.action_tokens
        self.embed_action = nn.Linear(act_dim, D) if cfg.action_tokens else None
        self.embed_ln = nn.LayerNorm(D)
        self.drop = nn.Dropout(cfg.embd_dropout)             # none in the LSDT code; DC's GPT-2 embd_pdrop 0.1
        self.blocks = nn.ModuleList(Block(cfg, dc) for dc in conv_dims(cfg))
        self.ln_f = nn.LayerNorm(D) if cfg.norm == "pre" else nn.Identity()  # no final LN in the post-LN code
        self.predict_action = nn.Sequential(nn.Linear(D, act_dim), nn.Tanh())  # actions live in [-1, 1]
        if cfg.arch == "lsdt":
            # Xavier-uniform weights, zero biases, every Linear and Embedding
            # WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDT.py#L315
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.xavier_uniform_(m.weight)
                if isinstance(m, nn.Linear):
                    nn.init.zeros_(m.bias)
        else:
            # DC: GPT-2's N(0, 0.02) and zero biases in the blocks' Linears only; the rest keeps PyTorch's defaults
            # beanie00/Decision-ConvFormer@3db9b9e gym/models/decision_convformer.py#L123
            for m in self.blocks.modules():
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, mean=0.0, std=0.02)
                    nn.init.zeros_(m.bias)

    def forward(self, states, actions, rtg, timesteps, mask):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions (B,K,act).
        The prediction at position t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only."""
        B, K, _ = states.shape
        time = self.embed_timestep(timesteps.clamp(max=self.embed_timestep.num_embeddings - 1))  # (B, K, D)
        tokens = [self.embed_return(rtg) + time,                               # R_t
                  self.embed_state(states) + time]                             # s_t
        if self.action_tokens:
            tokens.append(self.embed_action(actions) + time)                   # a_t
        n = len(tokens)                                                         # tokens per step: 3 (2 without a_t)
        x = torch.stack(tokens, dim=2).reshape(B, n * K, -1)                   # (B, L, D): R_1, s_1, a_1, R_2, ...
        x = self.drop(self.embed_ln(x))                                         # (B, L, D)
        # causal mask, and no attention to left padding; a padding query may see itself (its output is never used),
        # so that no row of the softmax is empty
        real = mask.bool().repeat_interleave(n, dim=1)                          # (B, L)
        causal = torch.ones(n * K, n * K, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(n * K, dtype=torch.bool, device=x.device)
        attn_mask = (causal & (real[:, None, :] | eye))[:, None]               # (B, 1, L, L)
        for block in self.blocks:
            x = block(x, attn_mask, real)
        x = self.ln_f(x).reshape(B, K, n, -1)                                   # (B, K, n, D)
        return self.predict_action(x[:, :, 1])       # a_t predicted from the s_t token (token 1 of a step): (B, K, act)

    def keep_maps(self, on=True):
        """Analysis: make the attention / dynamic-conv / HFM modules keep their last weights."""
        for m in self.modules():
            if hasattr(m, "keep"):
                m.keep = on
# <<< model: end

# ----------------------------------------------------------------------------------------------------------------
# the paper's pieces: the per-dataset settings, data, learning-rate schedule, loss, policy

SCRIPT = "lsdt"
CHOICES = dict(arch=("lsdt", "dc", "dc_h"), conv=("dynamic", "dc"), fusion=("hfm", "concat"), norm=("post", "pre"),
               routing=("split", "res", "weight"))

# The paper's per-dataset settings: K and RTG (Table 5), best xi (Table 14), width (Table 13 / D.2), heads, batch, lr,
# kernel (Table 13), action tokens (D.2); keys are D4RL names (paper_row), Maze2d's served by PointMaze (departure 9).
_LOCO = dict(n_embd=128, n_head=1, batch_size=64, lr=1e-4, kernel=6, action_tokens=True)
_MAZE = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=3, action_tokens=True, context=20,
             target_return=None, eval_episodes=100)     # Table 3 (Maze2d): 4 seeds x 100 evaluations
# AntMaze RTG 100 is on D4RL's 0/1 scale; Minari's (maze_v4.py) pays 1 per step at the goal: returns 0..700/1000
_ANT = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=6, action_tokens=True, context=10,
            target_return=100.0, eval_episodes=100)     # Table 1 (AntMaze): 4 seeds x 100 evaluations
# Adroit (Table 9, 5 seeds x 20 evaluations; Minari's D4RL/<task>/*-v2): Table 13's column. No Adroit K, xi or RTG
# in the paper: Config's K = 10 and xi = 0.5 (its "practical default"), data.py's target (the best episode return).
_ADROIT = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=6, action_tokens=True, eval_episodes=20)
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
    **{f"{task}-{level}": dict(_ADROIT) for task in data_lib.ADROIT_TASKS for level in ("human", "cloned")},  # Table 9
}
# Decision Convformer as the paper ran it (Table 12 and the DC code): pre-LN MetaFormer, conv mixer without output
# projection, embedding dropout, final LayerNorm, window L_w = 6; DC_h puts 2-head attention in the last block.
_DC = dict(conv="dc", conv_ratio=1.0, norm="pre", dropout=0.1, embd_dropout=0.1, context=8, kernel=6, n_embd=128,
           n_head=1, batch_size=64, lr=1e-4, weight_decay=1e-4)
ARCH_DEFAULTS = {"dc": _DC, "dc_h": dict(_DC, n_head=2)}

def paper_row(name):
    """PAPER_TABLE key for a short name (env-level) or Minari id (namespace/env/level-vN), else None."""
    parts = name.lower().split("/")
    if len(parts) >= 3:                                   # namespace/env/level-vN
        env, level = parts[-2], parts[-1].rsplit("-v", 1)[0]
    else:                                                 # short name env-level
        env, _, level = parts[-1].partition("-")
    env = "pointmaze" if env == "maze2d" else env
    level = level.removesuffix("-dense").removesuffix("-sparse")  # the paper's Maze2d rows are sparse; dense too
    key = f"{env}-{level}"
    return key if key in PAPER_TABLE else None

def paper_settings(cfg, given):
    """The dataset's PAPER_TABLE row and --arch's defaults laid under the preset and the flags in `given`: Config <
    row < ARCH_DEFAULTS < --preset < flags. -> (cfg, the fields the row and --arch set)"""
    row = PAPER_TABLE.get(paper_row(cfg.dataset or cfg.env), {}) if cfg.paper_table else {}
    layers = row | ARCH_DEFAULTS.get(cfg.arch, {})
    kept = set(given) | set(PRESETS.get(cfg.preset, {}))
    conv = cfg.conv if "conv" in kept else layers.get("conv", cfg.conv)
    if conv == "dc" and "kernel" in row:
        # LSDC and DC keep DC's 6-token window where a maze row sets DynamicConv's k_m = 3 (Table 13); the official
        # LSDC hard-codes 6: WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a decision_transformer/LSDC.py#L23
        layers = dict(layers, kernel=ARCH_DEFAULTS["dc"]["kernel"])
    changes = {k: v for k, v in layers.items() if k not in kept and getattr(cfg, k) != v}
    return replace(cfg, **changes), changes

def settings_source(cfg):
    """Where paper_settings' values come from, in words: the dataset's row, --arch's defaults, or both."""
    row = paper_row(cfg.dataset or cfg.env) if cfg.paper_table else None
    return " and ".join(([f"the paper's row for {row}"] if row else []) +
                        ([f"--arch {cfg.arch}'s defaults"] if cfg.arch in ARCH_DEFAULTS else [])) or "nothing"

def check_model(cfg, changes=()):
    """LSDT's own flags, after paper_settings (its `changes` named where they take part): one sentence (DataError)."""
    def why(*names):
        set_by = ", ".join(f"--{k.replace('_', '-')} {changes[k]}" for k in names if k in changes)
        return f" ({set_by} from {settings_source(cfg)}; override with flags)" if set_by else ""

    for name, ok in CHOICES.items():
        if getattr(cfg, name) not in ok:
            raise data_lib.DataError(f"unknown --{name} '{getattr(cfg, name)}'; use {', '.join(ok[:-1])} or {ok[-1]}")
    dims, weight = conv_dims(cfg), cfg.routing == "weight"    # weight (App. B.10): both branches get all D channels
    for bad, problem in (
            (not 0.0 <= cfg.conv_ratio <= 1.0, f"--conv-ratio must lie in [0, 1], got {cfg.conv_ratio}"),
            (cfg.kernel < 1, f"--kernel must be a positive number of taps, got {cfg.kernel}"),
            (not 0.0 <= cfg.dropkey < 1.0, f"--dropkey must lie in [0, 1), got {cfg.dropkey}"),
            (cfg.routing != "split" and cfg.arch != "lsdt", f"--routing {cfg.routing} is an LSDT variant (App. B.10) "
             f"and --arch {cfg.arch} has its own mixers; use --routing {cfg.routing} with --arch lsdt"),
            (weight and cfg.fusion != "hfm", f"--routing weight joins its branches by its own weighted sum, so "
             f"--fusion {cfg.fusion} has nothing to join; drop --fusion, or use --routing split or res"),
            (cfg.dropkey and all(dc == cfg.n_embd for dc in dims) and not weight, f"--dropkey acts on the attention "
             f"branch, which this model lacks (--arch {cfg.arch}, conv ratio {cfg.conv_ratio}){why('conv_ratio')}")):
        if bad:
            raise data_lib.DataError(problem)
    for dc in [cfg.n_embd] if weight else sorted(set(dims)):
        da = cfg.n_embd if weight else cfg.n_embd - dc
        share = (f"all of --n-embd {cfg.n_embd}, --routing weight" if weight else
                 f"--conv-ratio {cfg.conv_ratio} of --n-embd {cfg.n_embd}")
        set_by = ["n_embd"] if weight else ["n_embd", "conv_ratio"]
        if da and da % cfg.n_head:
            raise data_lib.DataError(f"--n-head {cfg.n_head} does not divide the {da} attention channels ({share})"
                                     f"{why('n_head', *set_by)}")
        if dc and cfg.conv == "dynamic" and dc % 4:
            raise data_lib.DataError(f"the dynamic-conv branch gets {dc} channels ({share}), not a multiple of 4 (4 "
                                     f"channels share each kernel, Table 13){why(*set_by)}")

def build_model(cfg, info):
    """The state embedded: observation ++ goal (Sec. 3.3; data.py puts it last), the goal cut by --no-goal-state."""
    return LSDT(cfg, info["obs_dim"] - (0 if cfg.goal_state else info["goal_dim"]), info["act_dim"],
                info["max_ep_len"])

def lr_factor(s, cfg):
    """Multiplier of --lr at step s: warmup ((s + 1) / warmup, both codes), then LSDT: a cosine to 0 at --steps (Table
    13, its code); DC / DC_h: constant (Table 12, DC's code).
    WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER@1feb77a scripts/train.py#L28
    beanie00/Decision-ConvFormer@3db9b9e gym/utils.py#L101"""
    if s < cfg.warmup_steps or cfg.arch != "lsdt":
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress))

def get_batch(d, n, cfg, rng):
    """n of data.py's windows (departure 7); --no-goal-state drops the goal from the states."""
    b = d.sample(n, cfg.context, rng)
    if not cfg.goal_state and d.goal_dim:
        b["states"] = b["states"][..., :-d.goal_dim]
    return b

def loss_fn(model, batch, cfg):
    pred = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])  # (B, K, act)
    err = ((pred.float() - batch["actions"]) ** 2).mean(-1)                                             # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()      # MSE on actions over real (unpadded) steps (code)

def policy(model):
    """For evaluate.evaluate: contexts -> the current step's action, the states cut to the width the model embeds."""
    n_state = model.embed_state.in_features

    def act(batch, live):
        return model(batch["states"][..., :n_state], batch["actions"], batch["rtg"], batch["timesteps"],
                     batch["mask"])[:, -1]
    return act

def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the paper's (Table 5, from the row), else data.py's."""
    return [cfg.target_return] if cfg.target_return is not None else d.target_returns

def evaluate(model, d, cfg, device):
    """--eval-episodes episodes in parallel for each target, in the dataset's env. -> [(target, results)]"""
    model.eval()
    results = [(g, ev.evaluate(policy(model), d, cfg.eval_episodes, g, cfg.seed + 10_000, cfg.context, device))
               for g in targets(cfg, d)]
    model.train()
    return results

# ----------------------------------------------------------------------------------------------------------------
# training: dt.py's loop; LSDT's own are the model, the schedule (lr_factor) and the goal-state choice (get_batch)

def train(cfg, run, d=None):
    """Train LSDT (or continue the run) and evaluate it. `run`: evaluate.Run (folder, log, checkpoint), or --bench's
    timer with synthetic data `d`. -> the first target's final evaluation (per-episode arrays)"""
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward) if d is None else d
    ev.check_data(cfg, d)                                           # a context or target that means nothing here
    device, info = ev.pick_device(cfg.device), d.info()
    share = (f"both branches on all {cfg.n_embd} channels, xi unused" if cfg.routing == "weight" else
             f"xi={cfg.conv_ratio}: conv channels per block {conv_dims(cfg)} of {cfg.n_embd}")
    print(f"{cfg.arch}: conv {cfg.conv}, routing {cfg.routing} ({share}), K={cfg.context}, k_m={cfg.kernel}, "
          f"{cfg.fusion}, {cfg.norm}-LN, {'(R, s, a)' if cfg.action_tokens else '(R, s)'} tokens"
          + (f"; goal-state {'on' if cfg.goal_state else 'OFF'} ({d.goal_dim} goal dims)" if d.goal_dim else ""))
    template = get_batch(d, 2, cfg, np.random.default_rng(0))
    with torch.device("meta"):                                      # one step's memory, from shapes, before allocating
        meta = build_model(cfg, info)
        need = ev.check_memory(meta, lambda b: loss_fn(meta, b, cfg), template, cfg.batch_size, device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)   # both codes: AdamW, all
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    rng = np.random.default_rng(cfg.seed)                           # draws the training windows
    step = run.start(cfg, model, opt, sched, rng, d, info, need)    # --resume: all of the above as the run left it
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)   # --amp: bf16 forward pass
    results = None
    with ev.StopSignal() as stop:                                   # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = {k: v.to(device, non_blocking=True) for k, v in get_batch(d, cfg.batch_size, cfg, rng).items()}
            with autocast:
                loss = loss_fn(fwd, batch, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            run.log(step, loss, sched.get_last_lr()[0])             # every --log-every steps: a line and log.csv
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)           # the env, for each target
                run.save(step, model, opt, sched, rng, results)     # log.csv, then ckpt.pt, then curve.png
        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)
    return run.finish(results or evaluate(model, d, cfg, device))   # resumed at --steps: evaluate the checkpoint

# ----------------------------------------------------------------------------------------------------------------
# figures and analyses (read a run's checkpoint, never train), --bench (times train() on synthetic data), main()

def mixing_maps(model, batch, layer=0, index=0):
    """What the branches of one block mix in window `index` of a batch, heads averaged, for those the block has:
    'attention' P (L, L) and 'kernel' alpha as a banded (L, L), row i weighting tokens i-k_m+1 .. i (Fig. 3, 9);
    'hfm' A (L, D), or LSDT-weight's A_att (Fig. 11)."""
    was = model.training
    model.eval()
    model.keep_maps(True)
    with torch.no_grad():
        model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
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

def load_model(cfg, given):
    """An analysis's run from its checkpoint. -> (cfg, model in eval mode, its device, its dataset, its folder)"""
    cfg, ck = ev.load_run(SCRIPT, cfg, given, PRESETS)
    model = build_model(cfg, ck["info"])
    model.load_state_dict(ck["model"])
    device = ev.pick_device(cfg.device)
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    return cfg, model.to(device).eval(), device, d, ev.run_folder(SCRIPT, cfg, PRESETS)

def gif(cfg, given):
    """--gif: one evaluation episode of the run's checkpoint at its first target -> episode.gif (never trains)."""
    cfg, model, device, d, out = load_model(cfg, given)
    ev.episode_gif(policy(model), d, targets(cfg, d)[0], cfg.seed + 10_000, cfg.context, device, out,
                   f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}")

def target_sweep(cfg, given):
    """--target-sweep (DT's Fig. 4): the run's checkpoint at 8 targets from the data's lowest return to above its best,
    --eval-episodes each -> target_sweep.png and .csv (never trains)."""
    cfg, model, device, d, out = load_model(cfg, given)
    ev.target_sweep(policy(model), d, cfg.eval_episodes, cfg.seed + 10_000, cfg.context, device, out,
                    f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}")

def mixing_analysis(cfg, given):
    """--plot-mixing (Fig. 3, 9, 11): block 1's mixing_maps on the fullest of 8 windows of the data -> mixing.png."""
    cfg, model, device, d, out = load_model(cfg, given)
    b = {k: v.to(device) for k, v in get_batch(d, 8, cfg, np.random.default_rng(cfg.seed + 1)).items()}
    index = int(b["mask"].sum(1).argmax())
    maps = mixing_maps(model, b, index=index)
    if not maps:
        print("mixing maps: nothing to plot (no attention, dynamic conv or HFM)")
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    mixer = model.blocks[0].mixer
    n = 3 if model.action_tokens else 2
    real = int(b["mask"][index].sum().item()) * n                                   # tokens after the left padding
    weighted = mixer.routing == "weight"                                            # LSDT-weight (B.10)
    keys = "key token (each timestep's R_i tick)"
    text = {"attention": ("long-term branch: attention P", "attention weight P", keys),  # title, colour bar, x axis
            "kernel": ("short-term branch: dynamic kernels", "dynamic-kernel weight alpha", keys),
            "hfm": ("LSDT-weight's branch weights", "attention branch's weight A_att (conv: 1 - A_att)",
                    "channel (both branches see all of them)") if weighted else
                   ("HFM weights (tokens x channels)", "HFM weight A", "channel (attention | conv)")}
    fig, axes = plt.subplots(1, len(maps), figsize=(5.5 * len(maps), 4.8), squeeze=False)
    for ax, (name, m) in zip(axes[0], maps.items()):
        m = m[-real:, -real:] if name != "hfm" else m[-real:]                      # drop left padding
        im = ax.imshow(m.float().numpy(), cmap="viridis", aspect="auto" if name == "hfm" else "equal")
        ticks = list(range(0, m.shape[0], n))
        labels = [f"R{i}" for i in range(len(ticks))]                              # each timestep's R_i token
        ax.set_yticks(ticks, labels)
        if name != "hfm":
            ax.set_xticks(ticks, labels, rotation=90)
        elif not weighted:
            ax.axvline(mixer.da - 0.5, color="white", lw=1)                        # attention | conv channels
        title, bar, xlabel = text[name]
        ax.set(title=f"{title} (block 1)", xlabel=xlabel,
               ylabel="query token (R_i, s_i" + (", a_i)" if n == 3 else ")") + " of the window")
        fig.colorbar(im, ax=ax, label=bar)
    if mixer.attn is None or mixer.conv is None:                                    # xi = 1 or 0
        fig.suptitle(f"no {'attention' if mixer.attn is None else 'kernel'} or HFM panel: xi = "
                     f"{mixer.dc / cfg.n_embd:g} leaves this block one branch", fontsize=8)
    elif mixer.fuse is None:
        fig.suptitle("no HFM panel: --fusion concat joins the branches without it", fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "mixing.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"mixing maps: {path}")

def paths_analysis(cfg, given):
    """--plot-paths (Fig. 8, B.1): the checkpoint's --eval-episodes maze paths over the data's goals -> paths.png."""
    cfg, model, device, d, out = load_model(cfg, given)
    if not d.goal_reaching:
        raise data_lib.DataError(f"--plot-paths draws maze paths; {d.dataset_id} is not a goal-reaching maze dataset")
    seed, target = cfg.seed + 10_000, targets(cfg, d)[0]
    res = ev.evaluate(policy(model), d, cfg.eval_episodes, target, seed, cfg.context, device)
    data_goals = np.concatenate([e["observations"][:, -d.goal_dim:] for e in d.episodes])      # (N, 2) raw x, y
    env = d.make_env()
    eval_goals = np.array([env.reset(seed=seed + i)[0]["desired_goal"] for i in range(cfg.eval_episodes)])  # evaluate's
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.scatter(*data_goals[:, :2].T, s=4, c="lightgrey", label="goals in the dataset")
    for path, ok in zip(res["positions"], res["success"]):
        ax.plot(*path.T, color="tab:green" if ok else "tab:red", lw=1, alpha=0.8)
        ax.plot(*path[0], "o", color="black", ms=3)
    ax.scatter(*eval_goals[:, :2].T, marker="*", s=200, c="gold", edgecolors="black", label="evaluation goal", zorder=3)
    ax.plot([], [], color="tab:green", label="path that reached the goal")
    ax.plot([], [], color="tab:red", label="path that did not")
    ax.set(xlabel="x (maze units)", ylabel="y (maze units)", aspect="equal",
           title=f"{SCRIPT} {'with' if cfg.goal_state else 'without'} goal-state conditioning, target {target:g}: "
                 f"{100 * res['success'].mean():.0f}% reached")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = os.path.join(out, "paths.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"paths: {path} ({ev.summarize(res)})")

def bench(cfg):
    """--bench: train()'s steps timed, eager vs compiled (and + bf16 on CUDA), on hopper-shaped synthetic data."""
    d = data_lib.synthetic_data(obs_dim=11, act_dim=3, episodes=16, length=max(200, 2 * cfg.context))
    tokens = (3 if cfg.action_tokens else 2) * cfg.context * cfg.batch_size
    for mode_cfg, timer in ev.bench_modes(cfg, SCRIPT, ev.variant_name(cfg, PRESETS), tokens):
        with timer:
            train(mode_cfg, timer, d)

def parse_flags(argv=None):
    return ev.parse_flags(Config, PRESETS, argv, f"{SCRIPT}.py", __doc__.split("\n\n")[1])

def main(argv=None):
    with ev.one_sentence_errors():
        cfg, given = parse_flags(argv)
        ev.check_flags(cfg, "bench", "plot_mixing", "plot_paths", "gif", "target_sweep")   # before any work
        cfg, changes = paper_settings(cfg, given)                   # the dataset's row and --arch's, under the flags
        check_model(cfg, changes)
        if cfg.bench:
            return bench(cfg)
        if cfg.plot_mixing or cfg.plot_paths or cfg.gif or cfg.target_sweep:
            return (mixing_analysis if cfg.plot_mixing else paths_analysis if cfg.plot_paths else gif if cfg.gif else
                    target_sweep)(cfg, given)
        if changes and not cfg.resume:
            print(f"set by {settings_source(cfg)}: {changes}")
        with ev.Run(SCRIPT, cfg, given, PRESETS) as run:            # --resume: the run's own settings, in run.cfg
            return train(run.cfg, run)

if __name__ == "__main__":
    main()
