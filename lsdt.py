r"""
Long-Short Decision Transformer (LSDT; "Long-Short Decision Transformer: Bridging Global and Local
Dependencies for Generalized Decision-Making", an anonymous ICLR submission), and Decision
Convformer (DC, Kim et al. 2023), the paper's conv-only baseline and LSDC's short-term branch.

LSDT is dt.py's Decision Transformer whose token mixer (Sec. 3.2.1, Fig. 4) splits the D channels:
(1 - xi) D go to causal self-attention (the long-term branch), xi D to a causal dynamic convolution
over the last k_m tokens (the short-term branch, Eq. 1); the Hybrid Fusion Module (HFM, App. B.3)
re-weights their concatenation and W_O projects it.
    X[..., :D_a] -> causal multi-head attention (long-term)  --\
                                                               concat -> HFM -> W_O -> + X -> LN
    X[..., D_a:] -> causal DynamicConv, k_m taps (short-term) --/

    python lsdt.py --env hopper-medium               # the paper's row: xi=1, D=256, (R, s) tokens
    python lsdt.py --env hopper-medium --preset cpu  # a small configuration for a 2-core laptop
    python data.py make pointmaze-medium-dense       # a maze with goals, made offline
    python lsdt.py --dataset made/pointmaze/medium-dense-v0 --preset cpu
    python lsdt.py --out <run folder> --plot-mixing  # the run's attention, kernel and HFM maps
    python lsdt.py --out <run folder> --target-sweep # DT's Fig. 4: the return against the target

What each flag reproduces:
    --conv-ratio XI         Fig. 7, Table 14 (the xi sweep; 0 = DT, 1 = CDT)
    --no-goal-state         Table 2 (Maze2d: LSDT, DC_h without "-gs", goal-state conditioning),
                            Table 4 and Fig. 6 (AntMaze: DT without "-gs", --conv-ratio 0)
    --conv dc               Table 3, Fig. 2, 6 (LSDC: DC's static filters as the short-term branch)
    --arch dc / dc_h        Tables 1-3 (the Decision Convformer baselines, Table 12)
    --fusion concat         Fig. 10 (B.3: no HFM)
    --routing res / weight  Table 8 (B.10)
    --dropkey P             Table 6 (B.8)
    --kernel K_M            Table 7 (B.7, B.9)
    --plot-mixing           Fig. 3, 9 (attention and dynamic-kernel matrices), Fig. 11 (HFM weights)
    --plot-paths            Fig. 8 (B.1: the run's maze paths over the data's goals)

Glossary (paper symbol -> code name; R_t, s_t, a_t, t, B and mask as in dt.py):
    K      context: the timesteps seen (Table 5)      Config.context
    L      tokens a window: 3K, or 2K without a_t     n * K
    D      token width (Table 13)                     Config.n_embd
    xi     the conv branch's share of D (3.2.1)       Config.conv_ratio
    D_c    conv channels round(xi D); D_a = D - D_c   LongShortMixer.dc, .da
    N_h    attention heads, d = D_a / N_h each        Config.n_head; hs
    k_m    causal taps of a dynamic kernel (B.7)      Config.kernel, DynamicConv.k
    H_c    dynamic kernels a token, D_c / 4           DynamicConv.heads
    alpha  the dynamic kernels, Eq. 1                 alpha (B, L, k_m, H_c)
    g      the goal (x, y) in the state (Sec. 3.3)    the last goal_dim state entries

Layout: as dt.py's. The official code (#Lnn alone: a line of its LSDT.py), built on
min-decision-transformer:
https://github.com/WangJinCheng1998/LONG-SHORT-DECISION-TRANSFORMER/tree/1feb77acff9b4a2ab6aa889210887f7d96918b1d
DC's: https://github.com/beanie00/Decision-ConvFormer/tree/3db9b9ecf6885b1ed9c1e7a20d5dd92aa132b1ef

Departures from the paper and the official code:
 1. Post-LN and no final LN, as the code behind the paper's numbers (#L265-L268, #L346); its
    Figure 1 draws pre-LN (--norm pre).
 2. HFM's softmax (Eq. 4) is over channels, as the code (#L200) and Fig. 11; the text says "time
    dimension".
 3. DynamicConv predicts only the k_m causal taps; the code predicts 2 k_m - 1 centred taps (#L88)
    and masks the future half (#L97-L100): the same function without dead weights (W_w's Xavier
    init scale differs with its width).
 4. xi = 0 is attention + W_O without HFM, the paper's "standard DT"; the code fails there (#L174
    builds 0 kernels, #L36 divides by them).
 5. --no-action-tokens (D.2's hopper-medium) is DC's remove_act_embs
    (gym/models/decision_convformer.py#L227-L231); the released LSDT code has no such path.
 6. --dropkey sets dropped logits to -inf, never a token's own (Li et al. 2022); the code's is
    commented out (#L229-L233).
 7. Windows are data.py's (episodes by length, left-padded as evaluation feeds them, padding
    masked); the code's loader draws each episode once an epoch, a whole window at a uniform start
    (utils_o.py#L184-L186), right-padding an episode shorter than K (#L197-L223).
 8. DC's filters read padding as zeros, so padding changes nothing; DC's code left-pads windows
    (gym/experiment.py#L126-L134) and convolves the embedded padding tokens.
 9. Maze2d rows serve Minari's PointMaze with data.py's target, not the code's RTG 300
    (scripts/train.py#L63): Minari's episodes stop at the goal.
10. A run keeps its last checkpoint; the code also saves the best of its 200 evaluations on the
    test env (scripts/train.py#L266-L269), the checkpoint its README evaluates.
"""
import os
from dataclasses import dataclass, field, fields, replace

import numpy as np

import data as data_lib
import evaluate as ev


# >>> model: begin (copy this block alone, to "model: end", into any file: it needs only torch)
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class LSDTConfig:
    """The model's settings, the paper's defaults (Table 13; build_model fills it from Config)."""
    arch: str = "lsdt"  # lsdt | dc (Decision Convformer) | dc_h (DC, attention in the last block)
    n_layer: int = 3
    n_embd: int = 128  # D, the token width
    n_head: int = 1  # N_h, the attention branch's heads
    conv_ratio: float = 0.5  # xi: the conv branch's share of D (Sec. 3.2.1)
    kernel: int = 6  # k_m, the conv branch's causal taps (DC: its window L_w)
    conv: str = "dynamic"  # the short-term branch: dynamic (DynamicConv) | dc (DC's filters, LSDC)
    fusion: str = "hfm"  # hfm (App. B.3) | concat
    routing: str = "split"  # App. B.10: split (LSDT) | res (LSDT-res) | weight (LSDT-weight)
    norm: str = "post"  # post (the official code) | pre (the paper's Figure 1, and DC)
    dropout: float = 0.25  # after W_O and after the MLP
    attn_dropout: float = 0.1  # on the attention output P V
    conv_dropout: float = 0.2  # on the dynamic-kernel logits
    embd_dropout: float = 0.0  # on the token embeddings (DC: 0.1)
    dropkey: float = 0.0  # DropKey's probability (B.8), in place of attn_dropout
    action_tokens: bool = True  # False: (R_t, s_t) tokens only (D.2)


def conv_dims(cfg):
    """D_c per block: round(xi D) for LSDT and LSDC (Sec. 3.2.1); D for DC; DC_h: D, ..., D, 0."""
    if cfg.arch == "lsdt":
        return [int(round(cfg.conv_ratio * cfg.n_embd))] * cfg.n_layer
    return [cfg.n_embd] * (cfg.n_layer - 1) + [0 if cfg.arch == "dc_h" else cfg.n_embd]


class CausalSelfAttention(nn.Module):
    """The long-term branch (Sec. 3.2.1): causal multi-head attention on D_a channels (W_O is the
    mixer's); P explicit for the analysis (Fig. 3), else torch's fused kernel."""

    def __init__(self, dim, n_head, attn_dropout):
        super().__init__()
        assert dim % n_head == 0, f"{dim} attention channels do not split into {n_head} heads"
        self.n_head = n_head
        self.c_attn = nn.Linear(dim, 3 * dim)  # W_Q || W_K || W_V, the code's three Linears fused
        self.drop = nn.Dropout(attn_dropout)  # on P V, not on P (#L238)
        self.keep, self.probs = False, None  # analysis: keep the last P

    def forward(self, x, attn_mask):
        B, T, C = x.shape  # x: (B, L, D_a); attn_mask: (B, 1, L, L)
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, L, D_a)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (B, nh, L, hs)
        y = self.attend(q, k, v, attn_mask)  # (B, nh, L, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, L, D_a)
        return self.drop(y)

    def attend(self, q, k, v, attn_mask):
        """softmax(Q K^T / sqrt(d)) V: torch's fused kernel, or P explicit for the analysis."""
        if not self.keep:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.weigh(self.logits(q, k, attn_mask), v)

    def logits(self, q, k, attn_mask):
        att = q @ k.transpose(-2, -1) / math.sqrt(k.size(-1))  # (B, nh, L, L) Q K^T / sqrt(d)
        return att.masked_fill(~attn_mask, float("-inf"))

    def weigh(self, att, v):
        att = att.softmax(-1)  # (B, nh, L, L) P
        if self.keep:
            self.probs = att.detach()
        return att @ v  # (B, nh, L, hs)


class DynamicConv(nn.Module):
    """The short-term branch: causal DynamicConv (Wu et al. 2019; Eq. 1) as the official code has it
    (#L22), ESPnet's DynamicConvolution with a kernel mask:
        U = GLU(X W_1)                               the input GLU, (B, L, D_c)
        alpha[i, h, :] = softmax(dropout(U_i W_w))   one kernel of k_m taps per token i and head h
        Y[i, c] = sum_j alpha[i, h(c), j] U[i-k_m+1+j, c] + b_c,   h(c) = c // 4
        out = Y W_2
    Only the k_m causal taps (departure 3)."""

    def __init__(self, dim, k_m, conv_dropout):
        super().__init__()
        assert dim % 4 == 0, f"{dim} conv channels are not a multiple of 4"
        self.k = k_m
        self.heads = dim // 4  # H_c = D_c / 4 (Table 13)
        self.p = conv_dropout

        self.glu_in = nn.Linear(dim, 2 * dim)  # W_1
        self.w_gen = nn.Linear(dim, k_m * self.heads)  # W_w: f(X_t) in Eq. 1, of token t alone
        self.bias = nn.Parameter(torch.zeros(dim))
        self.out = nn.Linear(dim, dim)  # W_2
        self.keep, self.alpha = False, None  # analysis: keep the last kernels

    def forward(self, x, real):
        B, L, C = x.shape  # x: (B, L, D_c); real: (B, L) bool
        k, H = self.k, self.heads
        u = F.glu(self.glu_in(x), dim=-1)  # (B, L, D_c), u * sigmoid(v)

        # the kernels; taps before 0 or on padding masked, the softmax renormalising
        logits = F.dropout(self.w_gen(u), self.p, self.training)  # (B, L, k*H), as #L89
        logits = logits.view(B, L, k, H)  # (B, L, k, H)
        src_real = F.pad(real, (k - 1, 0)).unfold(1, k, 1)  # (B, L, k)
        src_real = src_real | (torch.arange(k, device=x.device) == k - 1)  # a token reads itself
        alpha = logits.masked_fill(~src_real[..., None], float("-inf")).softmax(2)  # (B, L, k, H)
        if self.keep:
            self.alpha = alpha.detach().transpose(2, 3)  # (B, L, H, k)

        # Eq. 1's sum over taps
        up = F.pad(u, (0, 0, k - 1, 0))  # (B, L+k-1, D_c)
        win = torch.stack([up[:, j:j + L] for j in range(k)], dim=2)  # (B, L, k, D_c) U[i-k+1+j]
        y = (win.view(B, L, k, H, 4) * alpha[..., None]).sum(2)  # (B, L, H, 4)
        return self.out(y.reshape(B, L, C) + self.bias)  # (B, L, D_c)


class HybridFusion(nn.Module):
    """The Hybrid Fusion Module (App. B.3, Eqs. 2-4): Y_o = softmax(MLP(Y)) * Y, MLP W -> W/2 -> W,
    on Y = concat(Y_att, Y_conv) (B, L, W)."""

    def __init__(self, width):
        super().__init__()
        self.reduce = nn.Linear(width, width // 2)  # Eq. 2, W_f
        self.expand = nn.Linear(width // 2, width)  # Eq. 3, W_f1 || W_f2 as one Linear
        self.keep, self.weights = False, None  # analysis: keep the last A

    def mlp(self, y):
        return self.expand(F.relu(self.reduce(y)))  # (B, L, W) Z, Eqs. 2-3

    def forward(self, y):
        a = self.mlp(y).softmax(-1)  # (B, L, D) A = softmax(Z), over channels (departure 2)
        if self.keep:
            self.weights = a.detach()
        return a * y  # (B, L, D) Y_o, Eq. 4


class Split(nn.Module):
    """LSDT (Sec. 3.2.1): X_1 = X[..., :D_a] to attention, X_2 = X[..., D_a:] to the conv."""

    def __init__(self, da, dc):
        super().__init__()
        self.sizes = [da, dc]

    @staticmethod
    def widths(D, conv_dim):
        return D - conv_dim, conv_dim

    def forward(self, x):
        return x.split(self.sizes, dim=-1)  # (B, L, D_a), (B, L, D_c)


class NoBranch(nn.Module):
    """The branch xi = 0 or 1 leaves no channels: its empty slice (B, L, 0) passes through."""

    def forward(self, x, *context):
        return x


class LongShortMixer(nn.Module):
    """The Masked Long-Short token mixer (Sec. 3.2.1, Fig. 4, the figure atop this file; #L182),
    then dropout; --routing's variants (App. B.10) route X to the branches and join them."""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D, route = cfg.n_embd, ROUTES[cfg.routing]
        self.da, self.dc = route.widths(D, conv_dim)
        self.attn = long_term_branch(cfg, self.da) if self.da else NoBranch()
        self.conv = short_term_branch(cfg, self.dc) if self.dc else NoBranch()
        self.route = route(self.da, self.dc)

        self.fuse = fusion(cfg, self.da, self.dc)  # HFM (B.3), none, or LSDT-weight's (B.10)
        self.c_proj = nn.Linear(D, D)  # W_O
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask, real):
        x1, x2 = self.route(x)  # Sec. 3.2.1: X_1 (B, L, D_a), X_2 (B, L, D_c); B.10's variants
        y_att = self.attn(x1, attn_mask)  # (B, L, D_a) the long-term branch
        y_conv = self.conv(x2, real)  # (B, L, D_c) the short-term branch
        y = self.fuse(torch.cat([y_att, y_conv], dim=-1))  # (B, L, D) HFM, Eqs. 2-4, or concat
        return self.resid_drop(self.c_proj(y))  # (B, L, D) W_O


class Block(nn.Module):
    """One layer, 'post' as the official code (#L265-L268): x = LN(x + mixer(x)), LN(x + MLP(x)).
    DC's conv-only blocks take DC's mixer, every other LSDT's."""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        D = cfg.n_embd
        self.ln_1 = nn.LayerNorm(D)
        dc_conv = cfg.arch != "lsdt" and conv_dim == D
        self.mixer = (ConvMixer if dc_conv else LongShortMixer)(cfg, conv_dim)
        self.ln_2 = nn.LayerNorm(D)
        # GELU (Table 13; DT's gym code has ReLU)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x, attn_mask, real):
        x = self.ln_1(x + self.mixer(x, attn_mask, real))
        return self.ln_2(x + self.mlp(x))


def xavier_init(model):
    """LSDT: Xavier-uniform weights and zero biases, every Linear and Embedding (#L312-L321)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.xavier_uniform_(m.weight)
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.bias)


class LSDT(nn.Module):
    """dt.py's DecisionTransformer with LongShortMixer blocks: (R_1, s_1, a_1, R_2, ...), or
    (R_t, s_t) (D.2) -> a_t = tanh(W h(s_t)); DC and DC_h (arch) differ in mixers, norm and init.
    cfg an LSDTConfig; obs_dim: the goal's included."""

    def __init__(self, cfg, obs_dim, act_dim, max_ep_len):
        super().__init__()
        D = cfg.n_embd
        self.embed_timestep = nn.Embedding(max_ep_len, D)  # DT's: one per timestep, on each token
        self.embed_return = nn.Linear(1, D)
        self.embed_state = nn.Linear(obs_dim, D)
        self.action_tokens = cfg.action_tokens
        self.embed_action = nn.Linear(act_dim, D) if cfg.action_tokens else None

        self.embed_ln = nn.LayerNorm(D)
        self.drop = nn.Dropout(cfg.embd_dropout)

        # post-LN and no final LN (#L346), or pre-LN and a final LN
        block, ln_f = (PreLNBlock, nn.LayerNorm(D)) if cfg.norm == "pre" else (Block, nn.Identity())
        self.blocks = nn.ModuleList(block(cfg, dc) for dc in conv_dims(cfg))
        self.ln_f = ln_f
        self.predict_action = nn.Sequential(nn.Linear(D, act_dim), nn.Tanh())  # actions in [-1, 1]
        (xavier_init if cfg.arch == "lsdt" else gpt2_block_init)(self)

    def forward(self, states, actions, rtg, timesteps, mask):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions
        (B,K,act). The prediction at t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only."""
        B, K, _ = states.shape
        time = self.embed_timestep(timesteps.clamp(max=self.embed_timestep.num_embeddings - 1))
        tokens = [self.embed_return(rtg) + time, self.embed_state(states) + time]  # R_t, s_t
        if self.action_tokens:
            tokens.append(self.embed_action(actions) + time)  # a_t
        n = len(tokens)  # tokens per step: 3 (2 without a_t)

        # the sequence R_1, s_1, a_1, R_2, ...
        x = torch.stack(tokens, dim=2).reshape(B, n * K, -1)  # (B, L, D)
        x = self.drop(self.embed_ln(x))  # (B, L, D)

        # causal, no key on left padding; a padding query sees itself (its output unused), so no
        # softmax row is empty
        real = mask.bool().repeat_interleave(n, dim=1)  # (B, L)
        causal = torch.ones(n * K, n * K, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(n * K, dtype=torch.bool, device=x.device)
        attn_mask = (causal & (real[:, None, :] | eye))[:, None]  # (B, 1, L, L)
        for block in self.blocks:
            x = block(x, attn_mask, real)
        x = self.ln_f(x).reshape(B, K, n, -1)  # (B, K, n, D)

        # a_t predicted from the s_t token (token 1 of a step)
        return self.predict_action(x[:, :, 1])  # (B, K, act)

    def keep_maps(self, on=True):
        """Analysis: the attention, dynamic-conv and HFM modules keep their last weights."""
        for m in self.modules():
            if hasattr(m, "keep"):
                m.keep = on


# ---- the appendix's variants: DropKey (B.8), the routings (B.10), Decision Convformer (DC) ----
# with the functions by which LongShortMixer chooses its branches and fusion

# B.8: DropKey in the long-term branch

class DropKeyAttention(CausalSelfAttention):
    """B.8, DropKey (Li et al. 2022; departure 6): in training, each logit set to -inf with
    probability p, never a token's own; it replaces the dropout on P V."""

    def __init__(self, dim, n_head, p):
        super().__init__(dim, n_head, attn_dropout=0.0)
        self.p = p

    def attend(self, q, k, v, attn_mask):
        if not self.training:
            return super().attend(q, k, v, attn_mask)
        att = self.logits(q, k, attn_mask)  # (B, nh, L, L)
        drop = torch.rand(att.shape, device=att.device) < self.p
        own = torch.eye(att.shape[-1], dtype=torch.bool, device=att.device)
        return self.weigh(att.masked_fill(drop & ~own, float("-inf")), v)  # (B, nh, L, hs)


def long_term_branch(cfg, dim):
    """Attention on dim channels; DropKey's under cfg.dropkey (B.8, Table 6)."""
    if cfg.dropkey:
        return DropKeyAttention(dim, cfg.n_head, cfg.dropkey)
    return CausalSelfAttention(dim, cfg.n_head, cfg.attn_dropout)


# B.10: --routing, what each branch reads of X (B, L, D) and the widths D_a, D_c it gives, and
# LSDT-weight's fusion

class ResidualSplit(Split):
    """LSDT-res: "two separate linear projections with residual connections" (no equations):
    X_1 + W_r1 X_1, X_2 + W_r2 X_2, on the split's parts."""

    def __init__(self, da, dc):
        super().__init__(da, dc)
        self.res_attn, self.res_conv = (nn.Linear(d, d) if d else NoBranch() for d in (da, dc))

    def forward(self, x):
        x1, x2 = super().forward(x)  # (B, L, D_a), (B, L, D_c)
        return x1 + self.res_attn(x1), x2 + self.res_conv(x2)


class Shared(nn.Module):
    """LSDT-weight: "the full embedding is fed into both branches instead of a subset"."""

    def __init__(self, da, dc):
        super().__init__()

    @staticmethod
    def widths(D, conv_dim):
        return D, D

    def forward(self, x):
        return x, x  # 2 x (B, L, D)


ROUTES = {"split": Split, "res": ResidualSplit, "weight": Shared}


class BranchWeights(HybridFusion):
    """LSDT-weight's "modified version of our HFM module" (B.10, no equations): HFM's MLP on the
    2D-wide concat, a softmax over the two branches a token and channel:
    Y = A_att * Y_att + A_conv * Y_conv (B, L, D)."""

    def forward(self, y):
        z = self.mlp(y)  # (B, L, 2D)
        a = z.view(*z.shape[:-1], 2, -1).softmax(-2)  # (B, L, 2, D) A over {att, conv}
        if self.keep:
            self.weights = a[..., 0, :].detach()  # (B, L, D) A_att; A_conv = 1 - A_att
        y_att, y_conv = y.chunk(2, dim=-1)  # 2 x (B, L, D)
        return a[..., 0, :] * y_att + a[..., 1, :] * y_conv  # (B, L, D)


def fusion(cfg, da, dc):
    """Y's fusion: HFM (B.3) only where both branches are, as the code (#L186-L208; departure 4);
    --fusion concat: none (Fig. 10); LSDT-weight: its "modified HFM" (B.10)."""
    if cfg.routing == "weight":
        return BranchWeights(2 * cfg.n_embd)
    if da and dc and cfg.fusion == "hfm":
        return HybridFusion(cfg.n_embd)
    return nn.Identity()


# Decision Convformer (DC, DC_h, LSDC's short-term branch; Table 12): its static filters, its
# conv-only mixer, pre-LN blocks (also the paper's Figure 1, --norm pre) and its init

class DCConv(nn.Module):
    """Decision Convformer's token mixer (Kim et al. 2023, Sec. 3.1; DC's
    gym/models/decision_convformer.py#L43, the code's LSDC.py#L20): three static causal depthwise
    filters of window L_w, one per token type (R, s, a), each token taking its type's (no softmax,
    GLU or projection). LSDC's short-term branch (Sec. 4.4, D.3)."""

    def __init__(self, dim, window, n_types):
        super().__init__()
        self.w, self.n_types = window, n_types
        bound = 1 / math.sqrt(window)  # nn.Conv1d's default init, depthwise: fan_in = window
        self.weight = nn.Parameter(torch.empty(n_types, dim, window).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n_types, dim).uniform_(-bound, bound))

    def forward(self, x, real):
        B, L, C = x.shape  # x: (B, L, D_c); real: (B, L) bool
        x = x * real[..., None]  # padding tokens as the zeros DC pads with (departure 8)

        win = F.pad(x, (0, 0, self.w - 1, 0)).unfold(1, self.w, 1)  # (B, L, D_c, w) x[i-w+1..i]
        types = torch.arange(L, device=x.device) % self.n_types  # (L,) 0 = R, 1 = s, 2 = a
        y = torch.einsum("blcw,lcw->blc", win, self.weight[types])  # (B, L, D_c)
        return y + self.bias[types]


def short_term_branch(cfg, dim):
    """DynamicConv on dim channels; DC's filters under cfg.conv == 'dc' (LSDC, Sec. 4.4), one per
    token type: (R, s) and a_t where there are action tokens."""
    if cfg.conv == "dc":
        return DCConv(dim, cfg.kernel, n_types=2 + cfg.action_tokens)
    return DynamicConv(dim, cfg.kernel, cfg.conv_dropout)


class ConvMixer(nn.Module):
    """Decision Convformer's token mixer: the conv alone, with neither W_O nor dropout (DC's
    decision_convformer.py#L101-L102)."""

    def __init__(self, cfg, conv_dim):
        super().__init__()
        self.da, self.dc = 0, conv_dim
        self.conv = short_term_branch(cfg, conv_dim)

    def forward(self, x, attn_mask, real):
        return self.conv(x, real)  # (B, L, D)


class PreLNBlock(Block):
    """'pre', the paper's Figure 1 (dt.py's GPT-2 block, DC): x + mixer(LN(x)), x + MLP(LN(x))."""

    def forward(self, x, attn_mask, real):
        x = x + self.mixer(self.ln_1(x), attn_mask, real)
        return x + self.mlp(self.ln_2(x))


def gpt2_block_init(model):
    """DC: GPT-2's N(0, 0.02) and zero biases in the blocks' Linears alone, PyTorch's defaults
    elsewhere (DC's decision_convformer.py#L123-L130, applied at #L145)."""
    for m in model.blocks.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            nn.init.zeros_(m.bias)

# <<< model: end

# ---- the settings: Config (the paper's, then the run's flags) and PRESETS ----


def arg(default, help, in_name=True):
    """A Config field that is a flag; in_name=False: it changes nothing trained, so the run's
    variant name (its folder's) leaves it out."""
    return field(default=default, metadata={"help": help, "in_name": in_name})


@dataclass
class Config:
    # ---- the paper's settings (Table 13, the official code; a dataset's row: PAPER_TABLE) ----
    steps: int = arg(100_000, "gradient steps",
                     in_name=False)  # Table 13: 1e5; the cosine ends here
    delayed_reward: bool = arg(False, "each episode's rewards paid at its last step (DT's Table 5)")
    batch_size: int = arg(64, "windows per batch (Table 13: 64 locomotion, 256 mazes)")
    context: int = arg(10, "K, the number of timesteps the model sees (Table 5)")
    lr: float = arg(1e-4, "AdamW learning rate (Table 13: 1e-4 locomotion, 2e-4 mazes)")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    warmup_steps: int = arg(10_000, "linear warmup, then a cosine to 0 (LSDT) or constant (DC)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    paper_table: bool = arg(True, "the dataset's PAPER_TABLE row (K, xi, RTG...) under the flags")
    arch: str = arg("lsdt", "lsdt | dc (Decision Convformer) | dc_h (DC, attention last)")
    n_layer: int = arg(3, "blocks")
    n_embd: int = arg(128, "token width D (256 for hopper-medium and -medium-replay)")
    n_head: int = arg(1, "heads of the attention (long-term) branch")
    conv_ratio: float = arg(0.5, "xi: share of D for the conv branch; 0 = DT, 1 = conv only (CDT)")
    kernel: int = arg(6, "k_m, the conv branch's causal taps, its token's own too (Maze2d: 3)")
    conv: str = arg("dynamic", "short-term branch: dynamic (DynamicConv) | dc (DC's filters, LSDC)")
    fusion: str = arg("hfm", "hfm (Hybrid Fusion Module, App. B.3) | concat (direct concatenation)")
    routing: str = arg("split", "App. B.10: split (LSDT) | res (LSDT-res) | weight (LSDT-weight)")
    norm: str = arg("post", "post (the official code) | pre (the paper's Figure 1, and DC)")
    dropout: float = arg(0.25, "dropout after W_O and after the MLP")
    attn_dropout: float = arg(0.1, "dropout on the attention output P V (the official code)")
    conv_dropout: float = arg(0.2, "dropout on the dynamic-kernel logits, before the softmax")
    embd_dropout: float = arg(0.0, "dropout on the token embeddings (none in LSDT, 0.1 in DC)")
    dropkey: float = arg(0.0, "DropKey (B.8, Table 6): drop attention logits with this probability")
    action_tokens: bool = arg(True, "a_t tokens; without: (R, s) only (D.2, hopper-medium)")
    goal_state: bool = arg(True, "goal-state conditioning (Sec. 3.3): the goal kept in the state")
    # the code evaluates every 500 updates; Table 1: 20 episodes (locomotion), 100 (mazes)
    eval_every: int = arg(500, "evaluate and checkpoint every this many steps, and at the end",
                          in_name=False)
    eval_episodes: int = arg(20, "episodes per target return, run in parallel", in_name=False)

    # ---- the run: the same flags in every model file ----
    preset: str = arg("", "named settings from PRESETS, under the flags ('cpu': a 2-core machine)")
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)", in_name=False)
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env", in_name=False)
    seed: int = arg(0, "seed for sampling, initialisation and evaluation", in_name=False)
    target_return: float = arg(None, "return-to-go prompt, raw units (default: the data's)",
                               in_name=False)
    log_every: int = arg(100, "print and log the training loss every this many steps",
                         in_name=False)
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", in_name=False)
    amp: bool = arg(False, "bf16 autocast for the forward pass (CUDA; the loss is reduced in fp32)")
    compile: bool = arg(False, "torch.compile the model for training", in_name=False)
    out: str = arg("", "output folder (default: runs/<script>/<env>/<variant>/seed<N>)",
                   in_name=False)
    resume: bool = arg(False, "continue the run in the output folder, with its settings",
                       in_name=False)
    bench: bool = arg(False, "time training steps on synthetic data, eager and compiled",
                      in_name=False)
    gif: bool = arg(False, "episode.gif: one evaluation episode of the run's checkpoint",
                    in_name=False)
    target_sweep: bool = arg(False, "target_sweep.png (DT's Fig. 4): return at 8 targets",
                             in_name=False)

    # ---- this file's analyses ----
    plot_mixing: bool = arg(False, "mixing.png: block 1's maps (Fig. 3, 9, 11)", in_name=False)
    plot_paths: bool = arg(False, "paths.png: the run's maze paths (Fig. 8)", in_name=False)


# --preset cpu: dt.py's budget for 2 cores, over the dataset's row; mazes at K=1, as their noisy
# actions are a history to copy (README).
PRESETS = {"cpu": dict(n_embd=64, n_layer=2, batch_size=64, lr=1e-3, warmup_steps=500, steps=6000,
                       eval_every=2000, eval_episodes=10, mazes=dict(context=1, eval_episodes=50))}

# ---- the paper's pieces: the per-dataset settings, data, model, schedule, loss, policy ----

CHOICES = dict(arch=("lsdt", "dc", "dc_h"), conv=("dynamic", "dc"), fusion=("hfm", "concat"),
               norm=("post", "pre"), routing=("split", "res", "weight"))

# The paper's rows: K and RTG (Table 5), the best xi (Table 14), the width (Table 13, D.2), heads,
# batch, lr, kernel (Table 13), action tokens (D.2); keyed by D4RL names (paper_row).
_LOCO = dict(n_embd=128, n_head=1, batch_size=64, lr=1e-4, kernel=6, action_tokens=True)
# Table 2 (Maze2d)
_MAZE = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=3, action_tokens=True,
             context=20, target_return=None, eval_episodes=100)
# Table 1 (AntMaze): RTG 100 is on D4RL's 0/1 scale, where Minari's pays 1 a step at the goal
_ANT = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=6, action_tokens=True,
            context=10, target_return=100.0, eval_episodes=100)
# Adroit (Table 9: 20 evaluations): Table 13's column; no K, xi or RTG in the paper: Config's K
# and xi (its "practical default"), data.py's target
_ADROIT = dict(n_embd=128, n_head=2, batch_size=256, lr=2e-4, kernel=6, action_tokens=True,
               eval_episodes=20)
PAPER_TABLE = {
    "halfcheetah-medium": dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "hopper-medium": dict(_LOCO, context=10, conv_ratio=1.0, target_return=7000.0, n_embd=256,
                          action_tokens=False),
    "walker2d-medium": dict(_LOCO, context=5, conv_ratio=0.125, target_return=7000.0),
    "halfcheetah-medium-replay": dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "hopper-medium-replay": dict(_LOCO, context=20, conv_ratio=1.0, target_return=7000.0,
                                 n_embd=256),
    "walker2d-medium-replay": dict(_LOCO, context=10, conv_ratio=0.5, target_return=7000.0),
    "halfcheetah-medium-expert": dict(_LOCO, context=10, conv_ratio=0.75, target_return=15000.0),
    "hopper-medium-expert": dict(_LOCO, context=20, conv_ratio=0.75, target_return=10000.0),
    "walker2d-medium-expert": dict(_LOCO, context=10, conv_ratio=0.125, target_return=10000.0),
    "antmaze-umaze": dict(_ANT, conv_ratio=0.5, n_head=1),
    "antmaze-umaze-diverse": dict(_ANT, conv_ratio=0.75),
    "antmaze-medium-play": dict(_ANT, conv_ratio=0.75),
    "antmaze-medium-diverse": dict(_ANT, conv_ratio=0.5, lr=1e-4),
    "pointmaze-umaze": dict(_MAZE, conv_ratio=0.5),
    "pointmaze-medium": dict(_MAZE, conv_ratio=0.125),
    # Table 14 prints "Maze2d-medium" twice; the second is large
    "pointmaze-large": dict(_MAZE, conv_ratio=0.25),
    **{f"{task}-{level}": dict(_ADROIT) for task in data_lib.ADROIT_TASKS
       for level in ("human", "cloned")},
}
# DC as the paper ran it (Table 12, DC's code), window L_w = 6; DC_h: 2-head attention in the last
# block.
_DC = dict(conv="dc", conv_ratio=1.0, norm="pre", dropout=0.1, embd_dropout=0.1, context=8,
           kernel=6, n_embd=128, n_head=1, batch_size=64, lr=1e-4, weight_decay=1e-4)
ARCH_DEFAULTS = {"dc": _DC, "dc_h": dict(_DC, n_head=2)}


def paper_row(name):
    """PAPER_TABLE's key for a short name or Minari id, else None."""
    parts = name.lower().split("/")
    if len(parts) >= 3:  # namespace/env/level-vN
        env, level = parts[-2], parts[-1].rsplit("-v", 1)[0]
    else:  # short name env-level
        env, _, level = parts[-1].partition("-")

    env = "pointmaze" if env == "maze2d" else env
    # the paper's Maze2d rows are sparse; dense too
    level = level.removesuffix("-dense").removesuffix("-sparse")
    key = f"{env}-{level}"
    return key if key in PAPER_TABLE else None


def paper_values(cfg, given):
    """The fields the dataset's PAPER_TABLE row and --arch's defaults set, under the flags and
    preset in `given`: Config < row < ARCH_DEFAULTS < --preset < flags."""
    row = PAPER_TABLE.get(paper_row(cfg.dataset or cfg.env), {}) if cfg.paper_table else {}
    layers = row | ARCH_DEFAULTS.get(cfg.arch, {})

    conv = cfg.conv if "conv" in given else layers.get("conv", cfg.conv)
    if conv == "dc" and "kernel" in row:
        # LSDC and DC keep DC's window 6 where a maze row sets k_m = 3, as the official LSDC
        # (LSDC.py#L23)
        layers = dict(layers, kernel=ARCH_DEFAULTS["dc"]["kernel"])

    return {k: v for k, v in layers.items() if k not in given and getattr(cfg, k) != v}


def paper_settings(cfg, given):
    """paper_values laid under the flags, then this file's checks -> cfg."""
    changes = paper_values(cfg, given)
    cfg = replace(cfg, **changes)

    row = paper_row(cfg.dataset or cfg.env) if cfg.paper_table else None
    source = " and ".join(([f"the paper's row for {row}"] if row else []) +
                          ([f"--arch {cfg.arch}'s defaults"] if cfg.arch in ARCH_DEFAULTS else []))

    def why(*names):
        set_by = ", ".join(f"--{k.replace('_', '-')} {changes[k]}" for k in names if k in changes)
        return f" ({set_by} from {source}; override with flags)" if set_by else ""

    # the choices, and values that mean nothing
    for name, ok in CHOICES.items():
        if getattr(cfg, name) not in ok:
            raise data_lib.DataError(f"unknown --{name} '{getattr(cfg, name)}'; use "
                                     f"{', '.join(ok[:-1])} or {ok[-1]}")
    dims, weight = conv_dims(cfg), cfg.routing == "weight"  # weight: all D channels to both
    for bad, problem in (
            (not 0.0 <= cfg.conv_ratio <= 1.0, f"--conv-ratio must lie in [0, 1], got "
             f"{cfg.conv_ratio}"),
            (cfg.kernel < 1, f"--kernel must be a positive number of taps, got {cfg.kernel}"),
            (not 0.0 <= cfg.dropkey < 1.0, f"--dropkey must lie in [0, 1), got {cfg.dropkey}"),
            (cfg.routing != "split" and cfg.arch != "lsdt", f"--routing {cfg.routing} is LSDT's "
             f"(B.10), not --arch {cfg.arch}'s; use --routing {cfg.routing} with --arch lsdt"),
            (weight and cfg.fusion != "hfm", f"--routing weight joins its branches by its own sum, "
             f"so --fusion {cfg.fusion} has nothing to join; drop --fusion"),
            (cfg.dropkey and all(dc == cfg.n_embd for dc in dims) and not weight, f"--dropkey acts "
             f"on the attention branch, which this model lacks (--arch {cfg.arch}, conv ratio "
             f"{cfg.conv_ratio}){why('conv_ratio')}")):
        if bad:
            raise data_lib.DataError(problem)

    # each block's branches: heads that divide D_a, conv channels by fours
    for dc in [cfg.n_embd] if weight else sorted(set(dims)):
        da = cfg.n_embd if weight else cfg.n_embd - dc
        share = (f"all of --n-embd {cfg.n_embd}, --routing weight" if weight else
                 f"--conv-ratio {cfg.conv_ratio} of --n-embd {cfg.n_embd}")
        set_by = ["n_embd"] if weight else ["n_embd", "conv_ratio"]
        if da and cfg.n_head > 0 and da % cfg.n_head:
            raise data_lib.DataError(f"--n-head {cfg.n_head} does not divide the {da} attention "
                                     f"channels ({share}){why('n_head', *set_by)}")
        if dc and cfg.conv == "dynamic" and dc % 4:
            raise data_lib.DataError(f"the dynamic-conv branch gets {dc} channels ({share}), not a "
                                     f"multiple of 4 (4 channels share each kernel, Table 13)"
                                     f"{why(*set_by)}")

    # what was set, where a run is trained
    flags = ("resume", "bench", "gif", "target_sweep", *ANALYSES)
    if changes and not any(getattr(cfg, name) for name in flags):
        print(f"set by {source or 'nothing'}: {changes}")
    return cfg


def load_dataset(cfg):
    return data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)


def build_model(cfg, info):
    """The state embedded: the observation ++ the goal (Sec. 3.3; data.py puts it last), the goal
    cut by --no-goal-state."""
    model_cfg = LSDTConfig(**{f.name: getattr(cfg, f.name) for f in fields(LSDTConfig)})
    return LSDT(model_cfg, info["obs_dim"] - (0 if cfg.goal_state else info["goal_dim"]),
                info["act_dim"], info["max_ep_len"])


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: warmup ((s + 1) / warmup, both codes), then LSDT: a cosine to
    0 at --steps (Table 13; scripts/train.py#L28-L34), DC and DC_h: constant (Table 12; DC's
    gym/utils.py#L101-L104)."""
    if s < cfg.warmup_steps or cfg.arch != "lsdt":
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)

    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress))


def get_batch(d, n, cfg, rng):
    """n of data.py's windows (departure 7), without the goal under --no-goal-state."""
    b = d.sample(n, cfg.context, rng)
    if not cfg.goal_state and d.goal_dim:
        b["states"] = b["states"][..., :-d.goal_dim]
    return b


def loss_fn(model, batch, cfg):
    b = batch
    pred = model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])  # (B, K, act)
    # mean-squared error (scripts/train.py#L215-L219)
    err = ((pred.float() - b["actions"]) ** 2).mean(-1)  # (B, K)
    return (err * b["mask"]).sum() / b["mask"].sum()  # real steps only


def policy(model, cfg):
    """The live envs' contexts -> the current step's action, the states cut to the model's width."""
    n_state = model.embed_state.in_features

    def act(b, live):
        return model(b["states"][..., :n_state], b["actions"], b["rtg"], b["timesteps"],
                     b["mask"])[:, -1]
    return act


def rollout(cfg):
    """How evaluate.py runs the policy: the context it keeps."""
    return dict(context=cfg.context)


def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the paper's (Table 5, the row's), else
    data.py's."""
    return [cfg.target_return] if cfg.target_return is not None else d.target_returns


def evaluate(model, d, cfg, device):
    """policy() at each of targets(), --eval-episodes in parallel in the data's env ->
    [(target, results)]."""
    model.eval()
    act = policy(model, cfg)
    results = [(g, ev.evaluate(act, d, cfg.eval_episodes, g, cfg.seed + 10_000, device=device,
                               **rollout(cfg))) for g in targets(cfg, d)]
    model.train()
    return results

# ---- training ----


def train(cfg, run, d=None):
    """Train the model of Sec. 3 and evaluate it with Alg. 1 -> the first target's final evaluation.
    run: the evaluate.Run that keeps the folder, log and checkpoint (--resume: restores them)."""
    d = load_dataset(cfg) if d is None else d
    ev.check_data(cfg, d)  # a context or target that means nothing for this data
    device, info = ev.pick_device(cfg.device), d.info()

    # what is trained, in one line
    share = (f"both branches on all {cfg.n_embd} channels, xi unused" if cfg.routing == "weight"
             else f"xi={cfg.conv_ratio}: conv channels per block {conv_dims(cfg)} of {cfg.n_embd}")
    goal = f"; goal-state {'on' if cfg.goal_state else 'OFF'} ({d.goal_dim} goal dims)"
    print(f"{cfg.arch}: conv {cfg.conv}, routing {cfg.routing} ({share}), K={cfg.context}, "
          f"k_m={cfg.kernel}, {cfg.fusion}, {cfg.norm}-LN, "
          f"{'(R, s, a)' if cfg.action_tokens else '(R, s)'} tokens" + (goal if d.goal_dim else ""))

    # one step's memory, from shapes alone, before anything is allocated
    need = ev.check_memory(lambda: build_model(cfg, info), lambda m, b: loss_fn(m, b, cfg),
                           get_batch(d, 2, cfg, np.random.default_rng(0)), cfg.batch_size, device)

    # the model, the optimiser (both codes: AdamW on every parameter) and the schedule
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    rng = np.random.default_rng(cfg.seed)  # draws the training windows

    # open the run, or with --resume restore all of the above as the run left it
    step = run.start(cfg, model, opt, sched, rng, d, info, need)
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)
    results = None
    with ev.StopSignal(run.saves) as stop:  # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = get_batch(d, cfg.batch_size, cfg, rng)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}

            # forward, backward, clip the gradient, step the optimiser and the schedule
            with autocast:
                loss = loss_fn(fwd, batch, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1

            # log every --log-every steps; evaluate (Alg. 1) and checkpoint every --eval-every
            run.log(step, loss, sched.get_last_lr()[0])
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)
                run.save(step, model, opt, sched, rng, results)  # log.csv, ckpt.pt, curve.png

        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)

    # a run resumed at --steps evaluates its checkpoint
    return run.finish(results or evaluate(model, d, cfg, device))

# ---- this file's analyses: they read a run's checkpoint and never train ----


def mixing_maps(model, batch, layer=0, index=0):
    """What the branches of one block mix in window `index` of a batch, heads averaged, for those
    the block has: 'attention' P (L, L); 'kernel' alpha as a banded (L, L), row i weighting tokens
    i-k_m+1 .. i (Fig. 3, 9); 'hfm' A (L, D), or LSDT-weight's A_att (Fig. 11)."""
    was = model.training
    model.eval()
    model.keep_maps(True)
    with torch.no_grad():
        model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    model.keep_maps(False)
    model.train(was)

    mixer = model.blocks[layer].mixer
    maps = {}
    if mixer.da:
        maps["attention"] = mixer.attn.probs[index].mean(0).cpu()  # (L, L)
    if isinstance(mixer.conv, DynamicConv):
        alpha = mixer.conv.alpha[index].mean(1).cpu()  # (L, k)
        L, k = alpha.shape
        dense = torch.zeros(L, L + k - 1)
        rows = torch.arange(L)[:, None]
        dense[rows, rows + torch.arange(k)[None, :]] = alpha  # tap j of row i -> token i-k+1+j
        maps["kernel"] = dense[:, k - 1:]  # (L, L); taps before 0 dropped
    fuse = getattr(mixer, "fuse", None)  # DC's ConvMixer has none
    if isinstance(fuse, HybridFusion):
        maps["hfm"] = fuse.weights[index].cpu()  # (L, D)
    return maps


def plot_mixing(cfg, given):
    """--plot-mixing (Fig. 3, 9, 11): block 1's mixing_maps on the fullest of 8 windows of the
    data -> mixing.png."""
    cfg, model, d, out = load_model(cfg, given)
    device = next(model.parameters()).device
    b = get_batch(d, 8, cfg, np.random.default_rng(cfg.seed + 1))
    b = {k: v.to(device) for k, v in b.items()}
    index = int(b["mask"].sum(1).argmax())

    maps = mixing_maps(model, b, index=index)
    if not maps:
        print("mixing maps: nothing to plot (no attention, dynamic conv or HFM)")
        return

    # a panel a map
    from matplotlib.figure import Figure
    mixer = model.blocks[0].mixer
    n = 3 if model.action_tokens else 2
    real = int(b["mask"][index].sum().item()) * n
    fuse = getattr(mixer, "fuse", None)  # DC's ConvMixer has none
    weighted = isinstance(fuse, BranchWeights)  # LSDT-weight (B.10)
    text = {"attention": ("long-term branch: attention", "P", "key token"),
            "kernel": ("short-term branch: dynamic kernels", "alpha", "key token"),
            "hfm": ("LSDT-weight's branch weights", "A_att (conv: 1 - A_att)", "channel")
            if weighted else ("HFM weights", "A", "channel (attention | conv)")}

    fig = Figure(figsize=(5.5 * len(maps), 4.8))
    axes = fig.subplots(1, len(maps), squeeze=False)
    for ax, (name, m) in zip(axes[0], maps.items()):
        m = m[-real:, -real:] if name != "hfm" else m[-real:]  # drop the left padding
        im = ax.imshow(m.float().numpy(), cmap="viridis",
                       aspect="auto" if name == "hfm" else "equal")
        ticks = list(range(0, m.shape[0], n))
        labels = [f"R{i}" for i in range(len(ticks))]
        ax.set_yticks(ticks, labels)
        if name != "hfm":
            ax.set_xticks(ticks, labels, rotation=90)
        elif not weighted:
            ax.axvline(mixer.da - 0.5, color="white", lw=1)  # attention | conv channels
        title, bar, xlabel = text[name]
        ax.set(title=f"{title} (block 1)", xlabel=xlabel,
               ylabel="query token (R_i, s_i" + (", a_i)" if n == 3 else ")") + " of the window")
        fig.colorbar(im, ax=ax, label=bar)

    # why a panel is missing
    if not (mixer.da and mixer.dc):  # xi = 1 or 0
        fig.suptitle(f"no {'attention' if not mixer.da else 'kernel'} or HFM panel: xi = "
                     f"{mixer.dc / cfg.n_embd:g} leaves one branch", fontsize=8)
    elif not isinstance(fuse, HybridFusion):
        fig.suptitle("no HFM panel: --fusion concat", fontsize=8)

    fig.tight_layout()
    path = os.path.join(out, "mixing.png")
    ev.save_figure(fig, path, dpi=100)
    print(f"mixing maps: {path}")


def plot_paths(cfg, given):
    """--plot-paths (Fig. 8, B.1): the run's --eval-episodes maze paths over the data's goals ->
    paths.png."""
    cfg, model, d, out = load_model(cfg, given)
    if not d.goal_reaching:
        raise data_lib.DataError(f"--plot-paths draws maze paths; {d.dataset_id} is not a "
                                 f"goal-reaching maze dataset")

    device = next(model.parameters()).device
    seed, target = cfg.seed + 10_000, targets(cfg, d)[0]
    res = ev.evaluate(policy(model, cfg), d, cfg.eval_episodes, target, seed, device=device,
                      **rollout(cfg))

    # the data's goals and evaluate()'s
    data_goals = np.concatenate([e["observations"][:, -d.goal_dim:] for e in d.episodes])
    env = d.make_env()
    eval_goals = np.array([env.reset(seed=seed + i)[0]["desired_goal"]
                           for i in range(cfg.eval_episodes)])

    # the paths over the goals
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 6))
    ax = fig.subplots()
    ax.scatter(*data_goals[:, :2].T, s=4, c="lightgrey", label="goals in the dataset")
    for path, ok in zip(res["positions"], res["success"]):
        ax.plot(*path.T, color="tab:green" if ok else "tab:red", lw=1, alpha=0.8)
        ax.plot(*path[0], "o", color="black", ms=3)
    ax.scatter(*eval_goals[:, :2].T, marker="*", s=200, c="gold", edgecolors="black",
               label="evaluation goal", zorder=3)
    ax.plot([], [], color="tab:green", label="path that reached the goal")
    ax.plot([], [], color="tab:red", label="path that did not")
    ax.set(xlabel="x (maze units)", ylabel="y (maze units)", aspect="equal",
           title=f"{SCRIPT} {'with' if cfg.goal_state else 'without'} goal-state conditioning, "
                 f"target {target:g}: {100 * res['success'].mean():.0f}% reached")
    ax.legend(fontsize=8, loc="best")

    fig.tight_layout()
    path = os.path.join(out, "paths.png")
    ev.save_figure(fig, path, dpi=100)
    print(f"paths: {path} ({ev.summarize(res)})")


ANALYSES = {"plot_mixing": plot_mixing, "plot_paths": plot_paths}

# ---- what the plumbing needs that no paper says: the script, its log's columns, its tokens ----

SCRIPT = "lsdt"
LOG_COLUMNS = ()


def batch_tokens(cfg):
    """Tokens in one training batch, for --bench's tokens/s."""
    return (3 if cfg.action_tokens else 2) * cfg.context * cfg.batch_size

# ---- the run's plumbing, the same text in every model file: gif, sweep, bench, main ----
# It calls 13 names that every model file defines above it: the paper's Config, PRESETS,
# paper_settings, load_dataset, build_model, train, policy, rollout, targets and ANALYSES, and the
# run's SCRIPT, LOG_COLUMNS and batch_tokens (just above); besides them only ev, data_lib and the
# docstring's second paragraph (the --help text).


def load_model(cfg, given):
    """An analysis's run, from its checkpoint -> (its settings, its model in eval mode, its data,
    its folder)."""
    cfg, ck = ev.load_run(SCRIPT, cfg, given, PRESETS)
    model = build_model(cfg, ck["info"])
    model.load_state_dict(ck["model"])
    model = model.to(ev.pick_device(cfg.device)).eval()
    return cfg, model, load_dataset(cfg), ev.run_folder(SCRIPT, cfg, PRESETS)


def gif(cfg, given):
    """--gif: one evaluation episode of the run's checkpoint at its first target -> episode.gif."""
    cfg, model, d, out = load_model(cfg, given)
    device, title = next(model.parameters()).device, f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}"
    ev.episode_gif(policy(model, cfg), d, targets(cfg, d)[0], cfg.seed + 10_000, device=device,
                   out=out, title=title, **rollout(cfg))


def target_sweep(cfg, given):
    """--target-sweep (DT's Fig. 4): the run's checkpoint at 8 targets from the data's lowest return
    to above its best, --eval-episodes each -> target_sweep.png and .csv."""
    cfg, model, d, out = load_model(cfg, given)
    if targets(cfg, d) == [None]:
        raise data_lib.DataError("this run's model reads no return-to-go (it was trained without "
                                 "one), so there is no target to sweep")
    device, title = next(model.parameters()).device, f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}"
    ev.target_sweep(policy(model, cfg), d, cfg.eval_episodes, cfg.seed + 10_000, device=device,
                    out=out, title=title, **rollout(cfg))


def bench(cfg, given):
    """--bench: train() run briefly on synthetic data of the dataset's shapes, in each mode; the
    run's own record times its steps (evaluate.bench_runs prints them)."""
    d = data_lib.synthetic_like(cfg.dataset or cfg.env, length=max(200, 2 * cfg.context))
    tokens = batch_tokens(cfg)
    for mode_cfg, run in ev.bench_runs(SCRIPT, cfg, given, PRESETS, tokens, LOG_COLUMNS):
        train(mode_cfg, run, d)


def parse_flags(argv=None):
    return ev.parse_flags(Config, PRESETS, argv, f"{SCRIPT}.py", __doc__.split("\n\n")[1])


def main(argv=None):
    with ev.one_sentence_errors():
        # every flag checked before any work: the paper's settings for the data, then shared checks
        cfg, given = parse_flags(argv)
        cfg = paper_settings(cfg, given)
        ev.check_flags(cfg, "bench", "gif", "target_sweep", *ANALYSES)

        # --bench, or an analysis of a run's checkpoint: a stop anywhere in it is one sentence
        tools = dict(bench=bench, gif=gif, target_sweep=target_sweep, **ANALYSES)
        if name := next((name for name in tools if getattr(cfg, name)), None):
            with ev.analysis(name):
                return tools[name](cfg, given)

        # train (--resume: the run's own settings, from its checkpoint, in run.cfg)
        with ev.Run(SCRIPT, cfg, given, PRESETS, columns=LOG_COLUMNS) as run:
            return train(run.cfg, run)


if __name__ == "__main__":
    main()
