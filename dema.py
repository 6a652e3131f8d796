"""
Decision Mamba (DeMa): Dai et al. 2024, "Is Mamba Compatible with Trajectory Optimization in
Offline Reinforcement Learning?" (NeurIPS 2024, arXiv 2405.12094).

Decision Transformer's GPT replaced by plain Mamba-1 blocks (pre-RMSNorm residual, no MLP, no
timestep embedding). Step t gives tokens [R_t, a_{t-1}, s_t] (return-to-go, PREVIOUS action,
state); a_t is read from the s_t token. Transformer-like DeMa (the method, --mode transformer)
re-runs the last K steps from a zero state at every decision; RNN-like DeMa (--mode rnn) carries
the conv and SSM states through an episode (Sec. 3.2, App. C).

    python dema.py --env hopper-medium                 # the paper's settings (a GPU)
    python dema.py --env hopper-medium --preset cpu    # for a 2-core laptop
    python dema.py --env hopper-medium --mode rnn --batch-size 16 --scan-chunk 30    # RNN-like
    python data.py make breakout-mixed
    python dema.py --dataset made/breakout/mixed-v0 --preset cpu         # Atari, on a CPU
    python dema.py --out <run folder> --attention      # Fig. 4: hidden attention
    python dema.py --out <run folder> --s6-ablation zero --s6-layers 0   # Fig. 5: S6 zeroed
    python dema.py --bench --env breakout-expert       # Table 7: a training step on frames
    python dema.py --out <run folder> --target-sweep   # DT's Fig. 4 on a run

Glossary (paper symbol -> code name, shape; R_t, s_t and Atari's s_t, a_t as in dt.py, b its B;
Config: K context, E n_embd, D d_model, N d_state, W d_conv):
    L        tokens in a sequence: 3K (B3LD), K (BL3D)   T in the code
    d_inner  expand * D, the S6 layer's channels         Mamba.d_inner, "di" in shapes
    x_i      S6 input, after the conv and SiLU           x (b, di, L)
    Delta_i  step size (Eq. 5)                           delta (b, di, L)
    A        diagonal state matrix -exp(A_log) (Eq. 1)   A (di, N)
    B_i, C_i input-dependent S_B(x_i), S_C(x_i) (Eq. 5)  B, C (b, N, L)
    alpha    hidden attention (Sec. 3.3)                 Mamba.hidden_attention (b, di, L, L)
    a_{t-1}  the previous action                         previous_actions() (b, K, act_dim)

Layout: as dt.py's, the model block top-down: DeMa and its tokens, its two blocks, the S6 layer
(Mamba, S6), RMSNorm, and the selective scans last.

Official code ("the code"; paths cited bare are its, at e2aed7e): AndssY/dema, branch main (the
hidden attention: branch attention, 05bd941), https://github.com/AndssY/dema/tree/e2aed7e1a3893bbf0ff651388659f0927c88d365
It vendors state-spaces/mamba@12d8550 as mamba/,
https://github.com/state-spaces/mamba/tree/12d855003ba92c8a15d1739ce65a14c6fb16e254
changing one line: MixerModel's embedding is nn.Linear(vocab_size, d_model) (DeMa's E -> D), not
nn.Embedding (mamba/mamba_ssm/models/mixer_seq_simple.py#L105); the attention branch adds hooks
returning the hidden attention.

Departures from the paper and the official code (the detail at the line that says "departure N"):
 1. Plain PyTorch scan, causal conv and RMSNorm instead of mamba's CUDA and Triton kernels (CPU
    too; equal to float tolerance).
 2. Left padding is inert (zero conv input, Delta = 0: a padded window's outputs are the shorter
    window's); the code's pads enter the state (--no-pad-mask: data.py's zeros, not its raw-zero
    states, actions -10 and start-anchored windows, gym/experiment.py#L217-L237).
 3. Training reads (R_t, a_{t-1}, s_t) -> a_t over all K steps, as evaluation does; the code trains
    on (R_{t-1}, a_{t-1}, s_t) over a window's last K-1 steps and evaluates on R_t, on MuJoCo and
    Atari alike (--rtg-shift: its way, for both).
 4. MuJoCo warmup: 10k steps, the code's (gym/experiment.py#L608; Table 8 says 1e5).
 5. Atari: the code's E=128 and N=128 (Table 9: 256, 64), the only sizes that give Table 7's 1.7M
    parameters, and its cosine's end; Table 9's batch, lr, weight decay, clip and warmup, where the
    code's Mamba path has others.
 6. The code's unused predict_state / predict_return heads (780 parameters at hopper) are dropped.
 7. "DeMa with post." (--residual post) swaps the block inside DeMa (its tokens, E -> D and final
    RMSNorm stay), as Fig. 1 draws it; the code's is DT's GPT with S6 for attention (DT's tokens,
    LayerNorm, no E -> D; gym/decision_transformer/models/trajectory_gpt2.py#L450-L451).
 8. RNN-like DeMa (Tables 10-12) trains on trajectories cut to --rnn-max-len 1000 steps, left-padded
    under the inert pad mask; the code's Atari path needs an unreleased kernel and feeds a_t beside
    s_t. Atari here: Table 10's settings; evaluation from a_{-1} = 0 with the full softmax.
 9. Hidden attention (Fig. 4): Eq. 5 exactly (softplus, fp32, vectorised), not Eq. 6's ReLU
    approximation; the attention branch computes the same sum in a triple loop in fp16.
10. MuJoCo evaluation: DT's two targets, the last evaluation the result; the code conditions on
    four and keeps each one's best over its 10 evaluations. Atari: Table 9's one target per game;
    the code evaluates up to three.
11. Mazes: the paper's maze code is unreleased; Tables 14-15's settings here, and --preset cpu
    drops a_{t-1} (the data's actions are noisy: a_{t-1} is copied rather than used).
12. Atari: data.py's window sampler and evaluate.py's frames, which say how they differ from DT's
    official code (DeMa's copies).
13. Hopper-medium and -medium-replay: E=256, D.1's, which Table 7's 175.5K parameters fit (E=128
    gives 165.0K); the code's only MuJoCo script trains hopper-medium at --embedding_dim 128
    (gym/run.sh#L1), its default (gym/experiment.py#L597).
"""
import dataclasses
import os
import re
import timeit
from dataclasses import dataclass, field

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
class DeMaConfig:
    """The model's settings, hopper-medium's (D.1; build_model fills it from Config)."""
    n_embd: int = 256  # E, the token-embedding width (hopper, D.1; departure 13)
    d_model: int = 64  # D, Mamba's residual width
    n_layer: int = 3
    d_state: int = 64  # N, the SSM state size per channel
    d_conv: int = 4  # W, the causal depthwise convolution's width
    expand: int = 2  # d_inner = expand * D
    dropout: float = 0.0  # on the tokens (Atari: 0.1), and after the post block's MLP
    token_layout: str = "b3ld"  # b3ld: R_t, a_{t-1}, s_t, 3 tokens a step | bl3d: 1 (Sec. 4.1)
    residual: str = "pre"  # pre: Mamba's block (the method) | post: S6 in a transformer's
    prev_action: bool = True  # False: the null a_{-1} = 0 in every step
    timestep_embedding: bool = False  # DT's timestep embedding on every token (Table 17)
    pad_mask: bool = True  # left padding inert: zero conv input, Delta = 0 (departure 2)
    scan: str = "auto"  # auto (CPU: sequential, CUDA: parallel) | sequential | parallel
    scan_chunk: int = 0  # N > 0: the sequential scan's backward recomputes N-token chunks


class DeMa(nn.Module):
    """Tokens (B3LD or BL3D, Sec. 4.1), Linear E (3E) -> D, the blocks, RMSNorm,
    a_t = tanh(Linear(s_t's output)); no LayerNorm on the embeddings (ssm.py#L30); Atari (Sec. 5;
    mamba.py#L76): logits. cfg: a DeMaConfig."""

    def __init__(self, cfg, obs_dim, act_dim, max_ep_len, discrete=False):
        super().__init__()
        E, D = cfg.n_embd, cfg.d_model
        self.discrete = discrete
        self.layout, self.n = LAYOUTS[cfg.token_layout]  # n: tokens per step
        self.pad_mask, self.scan, self.scan_chunk = cfg.pad_mask, cfg.scan, cfg.scan_chunk
        self.prev_action = cfg.prev_action

        # Table 17's "DeMa with pos. embed."
        self.embed_timestep = nn.Embedding(max_ep_len, E) if cfg.timestep_embedding else None

        # token embeddings: Atari's DQN torso and tanh (Table 9's "ReLU (state encoder)"), tanh
        # after R_t's and a_{t-1}'s too (the code's); MuJoCo: DT's
        if discrete:
            self.embed_state = nn.Sequential(
                nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
                nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, E),
                nn.Tanh())
            self.embed_return = nn.Sequential(nn.Linear(1, E), nn.Tanh())
            self.embed_action = nn.Sequential(nn.Embedding(act_dim, E), nn.Tanh())
        else:
            self.embed_return = nn.Linear(1, E)
            self.embed_action = nn.Linear(act_dim, E)
            self.embed_state = nn.Linear(obs_dim, E)
        self.drop = nn.Dropout(cfg.dropout)

        # the code's MixerModel (mixer_seq_simple.py#L86; the paper names no norm_f); a token holds
        # 3 / n of a step's embeddings
        self.embedding = nn.Linear(3 * E // self.n, D)
        self.blocks = nn.ModuleList([PostBlock(cfg, gelu=discrete) if cfg.residual == "post" else
                                     Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = RMSNorm(D)
        # Atari: the code's logits (mamba.py#L132)
        self.predict_action = (nn.Linear(D, act_dim, bias=False) if discrete else
                               nn.Sequential(nn.Linear(D, act_dim), nn.Tanh()))

        # the code's apply(_init_weights) (ssm.py#L96): biases zero but dt_proj's, tables N(0, 0.02)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear) and m.bias is not None and not name.endswith("dt_proj"):
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def tokens(self, states, prev_actions, rtg, timesteps):
        """forward's states, rtg and timesteps, prev_actions (b, K, act) = a_{t-1} (Atari: (b, K)
        int64) -> (b, nK, D), fp32."""
        b, K = states.shape[:2]
        if not self.prev_action:
            prev_actions = torch.zeros_like(prev_actions)

        # Atari: the frames / 255 through the torso, the code's order a_{t-1}, R_t, s_t
        # (mamba.py#L222-L224); MuJoCo: R_t, a_{t-1}, s_t (ssm.py#L134-L136)
        if self.discrete:
            frames = states.reshape(b * K, *states.shape[2:])  # (bK, 4, 84, 84)
            frames = frames.to(self.embedding.weight.dtype) / 255.0
            # channels-last: faster convolutions on CPU
            frames = frames.contiguous(memory_format=torch.channels_last)
            e = [self.embed_action(prev_actions), self.embed_return(rtg),
                 self.embed_state(frames).view(b, K, -1)]  # 3 x (b, K, E)
        else:
            e = [self.embed_return(rtg), self.embed_action(prev_actions), self.embed_state(states)]
        if self.embed_timestep is not None:
            time = self.embed_timestep(timesteps)  # (b, K, E)
            e = [x + time for x in e]

        u = self.layout(e)  # (b, nK, 3E / n)
        # an fp32 residual stream under --amp (the code's too)
        return fp32(self.embedding(self.drop(u)))

    def token_mask(self, mask):
        """mask (b, K) -> (b, nK), or None where padding enters the state (--no-pad-mask)."""
        return mask.repeat_interleave(self.n, dim=1) if self.pad_mask else None

    def forward(self, states, actions, rtg, timesteps, mask, prev_action):
        """Sec. 3.1: a_t from s_{t-K+1:t}, R_{t-K+1:t}, a_{t-K:t-1}. states (b,K,obs), actions
        (b,K,act), rtg (b,K,1), timesteps (b,K), mask (b,K) 1 = real, prev_action (b,act) ->
        actions (b,K,act) (Atari: logits (b,K,|A|))."""
        prev_actions = previous_actions(actions, prev_action)  # (b, K, act)
        x = self.tokens(states, prev_actions, rtg, timesteps)  # (b, nK, D)
        tmask = self.token_mask(mask)  # (b, nK)

        for block in self.blocks:
            x = block(x, tmask, self.scan, self.scan_chunk)

        x = self.ln_f(x)  # (b, nK, D)
        return self.predict_action(x[:, self.n - 1::self.n])  # from the s_t token (BL3D: each)

    def init_cache(self, batch, device=None, dtype=torch.float32):
        """Per layer, zero: the last W conv inputs (b, di, W) and the SSM state h (b, di, N)."""
        return [(torch.zeros(batch, b.mixer.d_inner, b.mixer.d_conv, device=device, dtype=dtype),
                 torch.zeros(batch, b.mixer.d_inner, b.mixer.d_state, device=device, dtype=dtype))
                for b in self.blocks]

    def step(self, states, prev_action, rtg, timesteps, cache):
        """RNN-like DeMa (Sec. 3.2): the current triplet through the layers' states.
        states (b, obs), prev_action (b, act), rtg (b, 1), timesteps (b,) -> (actions, cache)."""
        toks = self.tokens(states[:, None], prev_action[:, None], rtg[:, None],
                           timesteps[:, None])  # (b, n, D)

        cache = list(cache)
        for x in toks.unbind(1):  # the step's tokens, s_t's last
            for l, block in enumerate(self.blocks):
                x, cache[l] = block.step(x, cache[l])
        return self.predict_action(self.ln_f(x)), cache

    def hidden_attention(self, states, actions, rtg, timesteps, mask, prev_action, last_row=False):
        """Each layer's hidden attention (Sec. 3.3) on this window."""
        x = self.tokens(states, previous_actions(actions, prev_action), rtg, timesteps)
        tmask = self.token_mask(mask)

        attn = []
        for block in self.blocks:
            attn.append(block.mixer.hidden_attention(block.norm(x), tmask, last_row))
            x = block(x, tmask, self.scan)
        return attn


def previous_actions(actions, prev_action):
    """a_{t-1} at every step (b, K, act); prev_action: the first step's."""
    return torch.cat([prev_action[:, None], actions[:, :-1]], dim=1)


# Sec. 4.1's token layouts: a step's three embeddings (b, K, E) as 3 tokens or as 1

def b3ld(e):
    """B3LD: (b, 3K, E), step 0's three tokens, step 1's, ..."""
    b, K = e[0].shape[:2]
    return torch.stack(e, dim=2).reshape(b, 3 * K, -1)


def bl3d(e):
    """BL3D: (b, K, 3E), one token per step."""
    return torch.cat(e, dim=-1)


LAYOUTS = {"b3ld": (b3ld, 3), "bl3d": (bl3d, 1)}  # the layout and its tokens per step


class Block(nn.Module):
    """Sec. 4.2, Fig. 1: Mamba's "pre up-projection" block x + Mamba(RMSNorm(x)), no MLP (the
    method; mamba@12d8550 mamba_ssm/modules/mamba_simple.py#L297)."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.mixer = Mamba(cfg.d_model, cfg.d_state, cfg.d_conv, cfg.expand, n_layer=cfg.n_layer)

    def forward(self, x, mask=None, scan='auto', chunk=0):
        return x + self.mixer(self.norm(x), mask, scan, chunk)

    def step(self, x, cache):
        out, cache = self.mixer.step(self.norm(x), cache)
        return x + out, cache


class PostBlock(nn.Module):
    """"DeMa with post." (departure 7): x + S6(LN(x)), then x + MLP(LN(x)); ReLU in the MLP (D.1),
    GELU on Atari as the code's (atari/mingpt/model_atari2.py#L273)."""

    def __init__(self, cfg, gelu=False):
        super().__init__()
        D = cfg.d_model
        self.norm = nn.LayerNorm(D)
        self.mixer = S6(D, cfg.d_state, cfg.d_conv, cfg.expand)
        self.norm2 = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU() if gelu else nn.ReLU(),
                                 nn.Linear(4 * D, D), nn.Dropout(cfg.dropout))

    def forward(self, x, mask=None, scan='auto', chunk=0):
        x = x + self.mixer(self.norm(x), mask, scan, chunk)
        return x + self.mlp(self.norm2(x))

    def step(self, x, cache):
        out, cache = self.mixer.step(self.norm(x), cache)
        x = x + out
        return x + self.mlp(self.norm2(x)), cache


class SelectiveSSM(nn.Module):
    """What Mamba and the post block's S6 share: the S6 layer (Sec. 3.3, Fig. 5; its parameters
    S6_PARAMETERS) on d_inner channels: causal depthwise conv + SiLU -> x_proj -> (Delta, B, C)
    (Eq. 5) -> the selective scan with the D skip (mamba@12d8550
    mamba_ssm/modules/mamba_simple.py#L31). Each subclass adds it at its place in __init__
    (add_s6, init_dt: the code's order of random draws) and says what feeds it (s6_input)."""

    def add_s6(self, d_inner, d_state, d_conv, dt_rank):
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        # S_Delta (rank R), S_B and S_C of Eq. (5)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        A = torch.arange(1, d_state + 1, dtype=torch.float32)  # S4D-real
        self.A_log = nn.Parameter(torch.log(A).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))

    def init_dt(self, dt_min=1e-3, dt_max=1e-1, dt_init_floor=1e-4):
        """mamba's (the code's; mamba_simple.py#L82-L110): dt_proj's bias softplus^-1(dt),
        dt ~ logU(dt_min, dt_max)."""
        with torch.no_grad():
            r = self.dt_rank ** -0.5
            nn.init.uniform_(self.dt_proj.weight, -r, r)
            dt = torch.exp(torch.rand(self.d_inner) * (math.log(dt_max) - math.log(dt_min))
                           + math.log(dt_min))
            dt = dt.clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def ssm_inputs(self, x, mask=None):
        """The S6 input x (b, di, T) -> x (post-conv), delta (b, di, T), A (di, N),
        B, C (b, N, T)."""
        T = x.shape[-1]
        if mask is not None:
            x = x * mask[:, None, :].to(x.dtype)  # pads = the zeros before a fresh start

        x = F.silu(self.conv1d(x)[..., :T])  # causal depthwise conv, width W

        # Eq. (5): Delta = softplus(S_Delta(x)), B = S_B(x), C = S_C(x)
        dbc = self.x_proj(x.transpose(1, 2))  # (b, T, R + 2N)
        dt, B, C = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(fp32(self.dt_proj(dt))).transpose(1, 2)  # (b, di, T)
        if mask is not None:
            delta = delta * mask[:, None, :]  # Delta = 0: the state passes pads as is
        A = -torch.exp(fp32(self.A_log))  # (di, N), fp32
        return x, delta, A, B.transpose(1, 2), C.transpose(1, 2)

    def ssm_step(self, x, cache):
        """One token of the S6 input (Sec. 3.2; mamba_simple.py#L208): x (b, di), cache ->
        (y (b, di) in fp32, before any gate; cache)."""
        conv_state, ssm_state = cache
        # roll x_t into the conv's last W inputs
        conv_state = torch.cat([conv_state[:, :, 1:], x[:, :, None].to(conv_state.dtype)], dim=-1)
        x = F.silu((conv_state * self.conv1d.weight[:, 0]).sum(-1) + self.conv1d.bias)  # (b, di)

        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(fp32(self.dt_proj(dt)))  # (b, di)

        # Eq. (5), one step, in fp32
        with torch.autocast(x.device.type, enabled=False):
            x, B, C = fp32(x), fp32(B), fp32(C)
            A = -torch.exp(fp32(self.A_log))
            A_bar = torch.exp(delta[..., None] * A)  # (b, di, N)
            ssm_state = A_bar * ssm_state + (delta * x)[..., None] * B[:, None, :]
            y = (ssm_state * C[:, None, :]).sum(-1) + self.D * x  # (b, di)
        return y, (conv_state, ssm_state)

    def hidden_attention(self, h, mask=None, last_row=False):
        """The S6 layer as an implicit attention (Sec. 3.3, Eq. 5; departure 9), per channel c:
            alpha[c]_{i,j} = sum_n C_i[n] exp(A[c,n] sum_{k=j+1..i} Delta_k[c]) Delta_j[c] B_j[n]
        for j <= i, else 0: y_i = sum_j alpha_{i,j} x_j, S6 without D skip and gate
        (AndssY/dema@05bd941 mamba/mamba_ssm/ops/selective_scan_interface.py#L394) -> (b, di, T, T)
        or the last row."""
        x, delta, A, B, C = self.ssm_inputs(self.s6_input(h), mask)
        B, C = fp32(B), fp32(C)

        T = x.shape[-1]
        S = delta.cumsum(-1)  # (b, di, T)
        rows = slice(T - 1, T) if last_row else slice(0, T)

        # seg[i, j] = sum_{k=j+1..i} Delta_k, never exp(+large) above the diagonal
        seg = S[:, :, rows, None] - S[:, :, None, :]  # (b, di, Ti, Tj)
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[rows]  # (Ti, Tj)
        seg = seg.masked_fill(~causal, 0.0)
        decay = torch.exp(seg[..., None] * A[None, :, None, None, :])  # (b, di, Ti, Tj, N), <= 1

        C_i = C.transpose(1, 2)[:, None, rows, None, :]  # (b, 1, Ti, 1, N)
        B_j = B.transpose(1, 2)[:, None, None, :, :]  # (b, 1, 1, Tj, N)
        alpha = (C_i * decay * B_j).sum(-1) * delta[:, :, None, :] * causal  # (b, di, Ti, Tj)
        return alpha[:, :, 0] if last_row else alpha


class Mamba(SelectiveSSM):
    """Mamba-1 mixer (mamba@12d8550 mamba_ssm/modules/mamba_simple.py#L31): in_proj -> x, z; the
    S6 layer on x -> * SiLU(z) -> out_proj."""

    def __init__(self, d_model, d_state=64, d_conv=4, expand=2, n_layer=1):
        super().__init__()
        self.d_model, self.expand = d_model, expand
        d_inner = expand * d_model
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.add_s6(d_inner, d_state, d_conv, dt_rank=math.ceil(d_model / 16))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

        # mamba's initialisation (the code's): out_proj / sqrt(n_layer) (mixer_seq_simple.py#L54)
        self.init_dt()
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
            self.out_proj.weight /= math.sqrt(n_layer)

    def s6_input(self, h):
        """h (b, T, D) -> x (b, di, T), the S6 layer's input."""
        return self.in_proj(h).chunk(2, dim=-1)[0].transpose(1, 2)

    def forward(self, h, mask=None, scan='auto', chunk=0):
        x, z = self.in_proj(h).chunk(2, dim=-1)  # (b, T, di) each
        x, delta, A, B, C = self.ssm_inputs(x.transpose(1, 2), mask)
        y = selective_scan(x, delta, A, B, C, D=self.D, z=z.transpose(1, 2), scan=scan,
                           chunk=chunk)  # (b, di, T)
        return self.out_proj(y.transpose(1, 2))  # (b, T, D)

    def step(self, h, cache):
        """One token (Sec. 3.2): h (b, D), cache -> (out (b, D), cache)."""
        x, z = self.in_proj(h).chunk(2, dim=-1)  # (b, di) each
        y, cache = self.ssm_step(x, cache)
        return self.out_proj((y * F.silu(fp32(z))).to(h.dtype)), cache


class S6(SelectiveSSM):
    """The S6 layer alone on D channels, ungated: the post block's mixer (departure 7), with the
    code's dt_rank (trajectory_gpt2.py#L288-L290)."""

    def __init__(self, d_model, d_state=64, d_conv=4, expand=2, n_layer=1):
        super().__init__()
        self.d_model, self.expand = d_model, expand
        self.add_s6(d_model, d_state, d_conv, dt_rank=math.ceil(int(d_model / expand) / 16))
        self.init_dt()

    def s6_input(self, h):
        return h.transpose(1, 2)  # (b, di = D, T)

    def forward(self, h, mask=None, scan='auto', chunk=0):
        x, delta, A, B, C = self.ssm_inputs(self.s6_input(h), mask)
        y = selective_scan(x, delta, A, B, C, D=self.D, scan=scan, chunk=chunk)  # (b, D, T)
        return y.transpose(1, 2)  # (b, T, D)

    def step(self, h, cache):
        y, cache = self.ssm_step(h, cache)
        return y.to(h.dtype), cache


class RMSNorm(nn.Module):
    """RMSNorm(v) = v / sqrt(mean(v^2) + eps) * w (the code: mamba's fused one, eps 1e-5, no bias;
    mamba@12d8550 mamba_ssm/ops/triton/layernorm.py#L481)."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


# The selective scan (S6, Sec. 3.2 Eq. 1-3 discretised, Eq. 5), as mamba's selective_scan_ref
# (mamba@12d8550 mamba_ssm/ops/selective_scan_interface.py#L91), on u, delta, z (b, di, L),
# A (di, N), B, C (b, N, L), D, delta_bias (di,):
#   h_t = exp(delta_t A) h_{t-1} + delta_t B_t u_t (A_bar by ZOH, B_bar by Euler as mamba's kernel)
#   y_t = (<C_t, h_t> + D u_t) silu(z_t);  h_0 = 0
# In fp32, the output cast back to u's dtype: under --amp only the projections and the convolution
# run in bf16.

def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   scan='auto', chunk=0):
    # auto: the loop on CPU, faster at DeMa's sizes (--bench-scan)
    if scan == 'auto':
        scan = 'parallel' if u.is_cuda and not chunk else 'sequential'

    # autocast off (meta, where train() sizes a step, has none)
    with torch.autocast("cpu" if u.device.type == "meta" else u.device.type, enabled=False):
        if scan == 'parallel':
            return selective_scan_parallel(u, delta, A, B, C, D, z, delta_bias, delta_softplus)
        return selective_scan_sequential(u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                         chunk)


def selective_scan_sequential(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                              delta_softplus=False, chunk=0):
    """The reference loop; autograd keeps ~2 states a token, or with chunk > 0 L / chunk + ~2
    chunk, each chunk recomputed in the backward (exact)."""
    dtype_in = u.dtype
    u, delta, A, B, C = _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus)
    batch, d_inner, L = u.shape
    h = u.new_zeros(batch, d_inner, A.shape[1])  # (b, di, N), h_0 = 0
    du = delta * u  # (b, di, L)

    step = chunk if chunk and torch.is_grad_enabled() else L
    ys = []
    for s in range(0, L, step):
        args = (h, delta[..., s:s + step], du[..., s:s + step], A, B[..., s:s + step],
                C[..., s:s + step])
        y, h = (torch.utils.checkpoint.checkpoint(_scan_loop, *args, use_reentrant=False)
                if step < L else _scan_loop(*args))
        ys.append(y)
    return _scan_finish(torch.cat(ys, dim=-1), u, D, z, dtype_in)


def _scan_loop(h, delta, du, A, B, C):
    """Eq. (5) from the state h (b, di, N) -> (y (b, di, L), the last h)."""
    ys = []
    # unbind: [..., t] would make autograd allocate a zero tensor per slice
    for delta_t, du_t, B_t, C_t in zip(delta.unbind(-1), du.unbind(-1), B.unbind(-1), C.unbind(-1)):
        A_bar = torch.exp(delta_t[:, :, None] * A)  # (b, di, N)  exp(Delta_t A)
        h = torch.addcmul(du_t[:, :, None] * B_t[:, None, :], A_bar, h)  # h_t = A_bar h + B_bar u_t
        ys.append((h * C_t[:, None, :]).sum(-1))  # (b, di)  y_t = <C_t, h_t>
    return torch.stack(ys, dim=-1), h  # (b, di, L), (b, di, N)


def selective_scan_parallel(u, delta, A, B, C, D=None, z=None, delta_bias=None,
                            delta_softplus=False):
    """The same recurrence by an associative scan, log2(L) rounds over (b, di, L, N) tensors; exp
    of non-positive numbers only (never exp(A S_i) exp(-A S_j))."""
    dtype_in = u.dtype
    u, delta, A, B, C = _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus)

    a = torch.exp(delta[..., None] * A[:, None, :])  # (b, di, L, N)  A_bar_t
    b = (delta * u)[..., None] * B.transpose(1, 2)[:, None]  # (b, di, L, N)  B_bar_t u_t
    h = _LinearScan.apply(a, b)  # (b, di, L, N)  all h_t
    y = (h * C.transpose(1, 2)[:, None]).sum(-1)  # (b, di, L)  y_t = <C_t, h_t>
    return _scan_finish(y, u, D, z, dtype_in)


class _LinearScan(torch.autograd.Function):
    """h = scan(a, b); the backward is a reverse scan with the same operator:
    g_t = dLoss/dh_t = gh_t + a_{t+1} g_{t+1}; dLoss/db_t = g_t; dLoss/da_t = g_t h_{t-1}."""

    @staticmethod
    def forward(ctx, a, b):
        h = _hillis_steele(a, b)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, gh):
        a, h = ctx.saved_tensors
        # a_{t+1} (1 past the end) and h_{t-1} (h_{-1} = 0)
        a_next = torch.cat([a[:, :, 1:], torch.ones_like(a[:, :, :1])], dim=2)
        h_prev = torch.cat([torch.zeros_like(h[:, :, :1]), h[:, :, :-1]], dim=2)
        g = _hillis_steele(a_next.flip(2), gh.flip(2)).flip(2)  # reverse scan

        return g * h_prev, g


def _hillis_steele(a, b):
    """Inclusive scan along dim 2 of h_t = a_t h_{t-1} + b_t, h_{-1} = 0, in ceil(log2 L) rounds of
    the kernel's operator (a0, b0) o (a1, b1) = (a1 a0, a1 b0 + b1)
    (mamba@12d8550 csrc/selective_scan/selective_scan_common.h#L111)."""
    a, b = a.clone(), b.clone()
    L, s = a.shape[2], 1

    while s < L:
        b[:, :, s:] += a[:, :, s:] * b[:, :, :-s]  # the right side is evaluated first
        a[:, :, s:] *= a[:, :, :-s].clone()  # clone: the slices overlap in memory
        s *= 2
    return b


def _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus):
    u, delta, A, B, C = (fp32(t) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(delta.dtype)[:, None]  # (b, di, L)
    if delta_softplus:
        delta = F.softplus(delta)  # threshold 20, as the CUDA kernel
    return u, delta, A, B, C


def _scan_finish(y, u, D, z, dtype_in):
    if D is not None:
        y = y + u * D.to(y.dtype)[:, None]  # skip connection D u
    if z is not None:
        y = y * F.silu(z.to(y.dtype))  # gate
    return y.to(dtype_in)


def fp32(t):
    """Upcast to float32 (float64 stays, for the tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))

# <<< model: end

# ---- the settings: Config (the paper's, then the run's flags) and PRESETS ----


def arg(default, help, in_name=True):
    """A Config field that is a flag; in_name=False: it changes nothing trained, so the run's
    variant name (its folder's) leaves it out."""
    return field(default=default, metadata={"help": help, "in_name": in_name})


@dataclass
class Config:
    # ---- the paper's settings (Table 8, D.1: hopper-medium; else paper_values) ----
    steps: int = arg(100_000, "gradient steps", in_name=False)  # the code: 10 iterations x 10k
    delayed_reward: bool = arg(False, "each episode's rewards paid at its last step (Table 13)")
    batch_size: int = arg(64, "windows (rnn mode: whole trajectories) per batch")
    context: int = arg(20, "K, the timesteps in a window (3K tokens); transformer mode")
    lr: float = arg(1e-4, "AdamW learning rate (per dataset: D.1)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (Atari: of the weights only)")
    beta2: float = arg(0.999, "AdamW's second-moment decay (Atari: 0.95)")
    warmup_steps: int = arg(10_000, "linear warmup, then constant (departure 4)")
    lr_decay_steps: int = arg(0, "0: constant after the warmup; N: the code's Atari cosine")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    n_embd: int = arg(256, "E, token-embedding width (D.1)")
    d_model: int = arg(64, "D, Mamba's residual width (D.1)")
    n_layer: int = arg(3, "Mamba blocks")
    d_state: int = arg(64, "N, SSM state size per channel")
    d_conv: int = arg(4, "W, width of the causal depthwise convolution")
    expand: int = arg(2, "d_inner = expand * D")
    dropout: float = arg(0.0, "on the tokens (Atari: 0.1) and after the post block's MLP")
    mode: str = arg("transformer", "transformer: K-step windows (the method) | rnn (Sec. 3.2)")
    token_layout: str = arg("b3ld", "b3ld: R_t, a_{t-1}, s_t, 3 tokens a step | bl3d: 1 (Sec. 4.1)")
    residual: str = arg("pre", "pre: Mamba's block (the method) | post: S6 in a transformer's")
    prev_action: bool = arg(True, "a_{t-1} in each step; --no-prev-action: the null a_{-1} = 0")
    timestep_embedding: bool = arg(False, "add DT's timestep embedding to every token (Table 17)")
    # departure 3: gym/decision_transformer/models/ssm.py#L109-L116, atari/models/mamba.py#L192-L199
    rtg_shift: bool = arg(False, "train on the code's (R_{t-1}, a_{t-1}, s_t) -> a_t (departure 3)")
    pad_mask: bool = arg(True, "left padding inert; --no-pad-mask: it enters the state (dep. 2)")
    inner_it: int = arg(1, "updates on each drawn batch (Table 10, RNN-like on Atari: 200)")
    # departure 8: trajectories drawn in proportion to length (gym/experiment.py#L254), left-padded
    # (the code right-pads: the same for a causal model). The code's Atari RNN-like path packs whole
    # trajectories by cu_seqlens for an unreleased kernel (App. C) that the vendored
    # MixerModel.forward does not take (mixer_seq_simple.py#L151), and feeds a_t, not a_{t-1},
    # beside s_t (atari/models/mamba.py#L195-L198). Atari here: Table 10's batch 8, lr 1e-4, 200
    # updates a batch, on the transformer's 39,060-step cosine (Frostbite's 50 epochs: --steps);
    # evaluation from a_{-1} = 0 with the full softmax, the code's from a random a_{-1}
    # (atari/mingpt/trainer_atari.py#L342) with top-3 sampling (#L364)
    rnn_max_len: int = arg(1000, "rnn mode: trajectories cut to their first N steps")
    # the code's MuJoCo evaluation. Departure 10: the code conditions on four targets (hopper:
    # 3600, 7200, 36000, 72000; gym/experiment.py#L128) and keeps each one's best over its 10
    # evaluations (#L489-L493); on Atari up to three (Breakout 90, 150, 180; Pong and Gopher one;
    # trainer_atari.py#L266), printing each; Asterix's 700 is not among its 900, 1000, 1100
    eval_every: int = arg(10_000, "evaluate and checkpoint every this many steps, and at the end",
                          in_name=False)
    eval_episodes: int = arg(100, "episodes per target return, run in parallel", in_name=False)
    greedy: bool = arg(False, "Atari: the likeliest action, not the code's softmax draw",
                       in_name=False)
    scan: str = arg("auto", "auto (CPU: sequential, CUDA: parallel) | sequential | parallel",
                    in_name=False)
    scan_chunk: int = arg(0, "N > 0: the backward recomputes the loop in N-token chunks",
                          in_name=False)

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
    attention: bool = arg(False, "Fig. 4: the hidden attention along an episode", in_name=False)
    s6_ablation: str = arg("", "Fig. 5: --s6-layers' S6 zero|random|swap, evaluated", in_name=False)
    s6_layers: str = arg("all", "--s6-ablation's layers: all, or 0-based indices (0,2)",
                         in_name=False)
    s6_donor: str = arg("", "swap: another DeMa's run folder or ckpt.pt (same sizes)",
                        in_name=False)
    bench_scan: bool = arg(False, "time the two scans (forward + backward)", in_name=False)
    params: bool = arg(False, "parameter counts at the paper's settings (Table 7)", in_name=False)


# Atari: Table 9 as the preset "" (departure 5), 10 epochs of 1% DQN-replay (3906 steps each);
# 512 x 20 warmup tokens are 3 steps of 128 x 30; the code's cosine ends at 2 len(data) 3K
# tokens (trainer_atari.py#L216; atari/run_atari.py#L169). Departure 5: E and N are the code's
# (atari/configs/config.py#L6-L8); Table 9's batch 128, lr 6e-4, weight decay 0.1, clip 1 and
# 512 x 20 warmup tokens are DT's (kzl/decision-transformer@e2d82e6 atari/run_dt_atari.py#L86),
# where the code's Mamba path has 8, 1e-4, 1e-4, 0.8 and 3000 x 32 (run_atari.py#L235-L252).
ATARI = dict(n_embd=128, d_model=128, d_state=128, n_layer=6, context=30, batch_size=128, lr=6e-4,
             beta2=0.95, weight_decay=0.1, grad_clip=1.0, dropout=0.1, warmup_steps=3,
             lr_decay_steps=23_432, steps=39_060, eval_every=3906, eval_episodes=10)
# --preset cpu: dt.py's budget; mazes: dt.py's setting; Atari: dt.py's windows, a cosine stopped
# where the return stops rising (README); --mode rnn: less memory (RESULTS.md)
ATARI_CPU = dict(n_embd=64, d_model=64, d_state=16, n_layer=2, context=8, batch_size=32, lr=6e-4,
                 warmup_steps=100, lr_decay_steps=4500, steps=3000, eval_every=1500,
                 eval_episodes=10)
PRESETS = {"": dict(atari=ATARI),
           "cpu": dict(n_embd=64, d_model=32, n_layer=2, d_state=16, context=10, batch_size=64,
                       lr=1e-3, warmup_steps=500, steps=6000, eval_every=2000, eval_episodes=10,
                       mazes=dict(context=1, dropout=0.0, prev_action=False, eval_episodes=50),
                       atari={**ATARI_CPU, "mode=rnn": dict(rnn_max_len=100, batch_size=4)})}


# ---- the paper's pieces: per-dataset settings, data, model, schedule, loss, policy ----

CHOICES = dict(mode=("transformer", "rnn"), token_layout=("b3ld", "bl3d"), residual=("pre", "post"),
               scan=("auto", "sequential", "parallel"), s6_ablation=("", "zero", "random", "swap"))
WINDOW = ("states", "actions", "rtg", "timesteps", "mask", "prev_action")  # DeMa.forward's order
S6_PARAMETERS = ("conv1d.weight", "conv1d.bias", "x_proj.weight", "dt_proj.weight", "dt_proj.bias",
                 "A_log", "D")


def paper_values(name, mode="transformer"):
    """The paper's per-dataset settings."""
    atari, name = data_lib.is_atari(name), name.lower()
    # Table 10, D.2: RNN-like
    if atari and mode == "rnn":
        return dict(batch_size=1 if "frostbite" in name else 8, lr=1e-4, inner_it=200)

    # D.2: K=8 for Qbert and Frostbite (Table 9's warmup stays 3 steps there, not 10)
    if atari:
        return dict(context=8) if re.search("qbert|frostbite", name) else {}

    # D.1
    if m := re.search(r"(halfcheetah|hopper|walker2d)[-/](medium-replay|medium-expert|medium|expert"
                      r"|simple)", name):
        env, level = m.groups()
        hopper_medium = env == "hopper" and level in ("medium", "medium-replay")
        # hopper: D.1's E=256, not gym/run.sh#L1's 128 (departure 13)
        return dict(n_embd=256 if hopper_medium else 128,
                    d_model=128 if level == "medium-expert" else 64,
                    lr=1e-4 if hopper_medium or (env, level) == ("walker2d", "medium") else 1e-3)

    # mazes, F.2's 50 evaluation episodes: Table 15 (maze2d; umaze: Table 8's), Table 14 (antmaze)
    maze_eval = dict(eval_episodes=50)
    if "pointmaze" in name or "maze2d" in name:
        if "umaze" in name:
            return dict(n_embd=128, d_model=64, lr=1e-4, **maze_eval)
        return dict(n_embd=256 if "medium" in name else 128, d_model=64, lr=2e-5, batch_size=32,
                    context=8 if "medium" in name else 20, dropout=0.1, **maze_eval)
    if "antmaze" in name:
        return dict(n_embd=128, d_model=128, lr=2e-5, batch_size=32, context=5, dropout=0.1,
                    **maze_eval)
    return {}


def paper_settings(cfg, given):
    """Config's defaults < PRESETS[""] (Atari) < paper_values' row < --preset < the flags."""
    name = cfg.dataset or cfg.env
    row = paper_values(name, cfg.mode)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in row.items() if k not in given})

    # this file's flags (check_flags: the shared ones)
    for f, ok in CHOICES.items():
        if getattr(cfg, f) not in ok:
            *rest, last = [c for c in ok if c]
            raise data_lib.DataError(f"unknown --{f.replace('_', '-')} '{getattr(cfg, f)}'; use "
                                     f"{', '.join(rest)} or {last}")
    for f in ("d_model", "d_state", "d_conv", "expand", "rnn_max_len", "inner_it"):
        if getattr(cfg, f) <= 0:
            raise data_lib.DataError(f"--{f.replace('_', '-')} must be a positive whole number, "
                                     f"got {getattr(cfg, f)}")

    for bad, why in (
            (cfg.lr_decay_steps < 0, f"--lr-decay-steps must be 0 (off) or more, got "
                                     f"{cfg.lr_decay_steps}"),
            (not 0 <= cfg.beta2 < 1, f"--beta2 must lie in [0, 1), got {cfg.beta2}"),
            (cfg.scan_chunk < 0, f"--scan-chunk must be 0 (off) or more, got {cfg.scan_chunk}"),
            (cfg.scan_chunk and cfg.scan == "parallel",
             "--scan-chunk needs the sequential scan; drop --scan parallel"),
            (cfg.mode == "rnn" and not cfg.pad_mask,
             "--mode rnn needs the pad mask (trajectories are padded); drop --no-pad-mask"),
            (cfg.mode == "rnn" and cfg.compile,
             "--compile with --mode rnn would recompile for each trajectory length; drop one"),
            (cfg.rtg_shift and cfg.mode == "transformer" and cfg.context < 2,
             f"--rtg-shift needs --context 2 or more (it trains on K-1 steps), got {cfg.context}"),
            (cfg.s6_layers != "all" and not re.fullmatch(r"\d+(,\d+)*", cfg.s6_layers),
             f"--s6-layers must be 'all' or 0-based indices such as 0,2; got '{cfg.s6_layers}'"),
            ((cfg.s6_ablation == "swap") != bool(cfg.s6_donor),
             "--s6-ablation swap and --s6-donor <another DeMa's run folder> go together")):
        if bad:
            raise data_lib.DataError(why)
    return cfg


def load_dataset(cfg):
    return data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)


def build_model(cfg, info):
    """DeMa for the data's spaces (discrete actions: Atari's)."""
    model_cfg = DeMaConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(DeMaConfig)})
    return DeMa(model_cfg, info["obs_dim"], info["act_dim"], info["max_ep_len"],
                discrete=info.get("discrete", False))


def param_groups(model, cfg):
    """AdamW's groups: the code decays all on MuJoCo; on Atari not biases, norms or *emb* names
    (R_t's and a_{t-1}'s embeddings, E -> D; mamba.py#L159; here the timestep table
    too)."""
    if not model.discrete:
        return [{"params": list(model.parameters())}]

    undecayed = ("embed_return.", "embed_action.", "embed_timestep.", "embedding.", "ln_f.")
    rest = {n for n, p in model.named_parameters()
            if n.endswith("bias") or "norm" in n or n.startswith(undecayed)}
    return [{"params": [p for n, p in model.named_parameters() if n not in rest]},
            {"params": [p for n, p in model.named_parameters() if n in rest], "weight_decay": 0.0}]


def lr_factor(s, cfg):
    """--lr's factor at step s: linear warmup, then constant (gym/experiment.py#L455-L458) or the
    code's cosine (--lr-decay-steps), floored at 0.1 and p unclamped: 0.1 from p = 0.8, rising past
    1.2 (trainer_atari.py#L222-L223)."""
    if s < cfg.warmup_steps or not cfg.lr_decay_steps:
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)

    p = (s - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    return max(0.1, 0.5 * (1.0 + math.cos(math.pi * p)))


def get_batch(d, n, cfg, rng, longest=False):
    """n windows of K steps (App. C); RNN-like: n whole trajectories (departure 8; longest: the
    longest, sizing the worst step)."""
    if cfg.mode != "rnn":
        return d.sample(n, cfg.context, rng)

    lengths = np.diff(np.append(d.ep_start, len(d.step_ep_start)))  # (n_episodes,)
    if longest:
        ep = np.full(n, lengths.argmax())
    else:
        ep = rng.choice(len(lengths), size=n, p=lengths / lengths.sum())
    steps = np.minimum(lengths[ep], cfg.rnn_max_len)
    start = d.ep_start[ep]
    return data_lib.gather_windows(d.flat, start, start + steps - 1, int(steps.max()))


def predict(model, b, cfg, training=False):
    """A data.py / evaluate.py window -> (predicted actions, targets, loss mask)."""
    states, actions, rtg, timesteps, mask, prev = (b[k] for k in WINDOW)
    if training and cfg.rtg_shift:
        # departure 3: the code's alignment, on MuJoCo (ssm.py#L109-L116) and Atari
        # (atari/models/mamba.py#L192-L199)
        states, actions, prev = states[:, 1:], actions[:, 1:], actions[:, 0]
        timesteps, rtg, mask = timesteps[:, :-1], rtg[:, :-1], mask[:, 1:] * mask[:, :-1]
    return model(states, actions, rtg, timesteps, mask, prev), actions, mask


def loss_fn(model, batch, cfg):
    pred, target, mask = predict(model, batch, cfg, training=True)  # (b, K, act) or logits
    if target.dtype == torch.int64:
        # Sec. 3.1, App. C: cross-entropy (Atari)
        err = F.cross_entropy(pred.float().flatten(0, 1), target.flatten(), reduction="none")
        err = err.view_as(mask)  # (b, K)
    else:
        # Sec. 3.1: MSE
        err = ((pred.float() - target) ** 2).mean(-1)  # (b, K)
    return (err * mask).sum() / mask.sum()  # App. C: the padding's loss is masked


def policy(model, cfg):
    """The actions (Atari: logits) for evaluate.py: transformer-like, or RNN-like (Sec. 3.2)."""
    if cfg.mode == "transformer":
        return lambda batch, live: predict(model, batch, cfg)[0][:, -1]

    caches = {}  # env index -> its per-layer cache

    def act_rnn(batch, live):
        # each live env's cache (zero at its first step)
        fresh = batch["timesteps"][:, -1] == 0
        zero = model.init_cache(1, batch["states"].device, fp32(model.embedding.weight).dtype)
        per_env = [zero if bool(fresh[j]) or int(i) not in caches else caches[int(i)]
                   for j, i in enumerate(live)]
        cache = [tuple(torch.cat([c[l][k] for c in per_env]) for k in range(2))
                 for l in range(len(zero))]

        # a step of the live envs; keep their caches
        prev = previous_actions(batch["actions"], batch["prev_action"])[:, -1]
        a, cache = model.step(batch["states"][:, -1], prev, batch["rtg"][:, -1],
                              batch["timesteps"][:, -1], cache)
        for j, i in enumerate(live):
            caches[int(i)] = [(c[j:j + 1], h[j:j + 1]) for c, h in cache]
        return a
    return act_rnn


def rollout(cfg):
    """How evaluate.py runs the policy: the context it keeps (RNN-like: one step); Atari: greedy or
    sampled actions."""
    return dict(context=cfg.context if cfg.mode == "transformer" else 1, greedy=cfg.greedy)


def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else DT's (Atari: Table 9's, dep. 10)."""
    if cfg.target_return is not None:
        return [cfg.target_return]

    if d.family == "atari":
        game = d.env_spec.id.split("/")[-1].split("-")[0]  # 'ALE/Breakout-v5' -> 'Breakout'
        return [data_lib.DEMA_ATARI_TARGETS.get(game, d.target_returns[0])]
    return d.target_returns


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
    """Train DeMa (Sec. 3.1) and evaluate it -> the first target's final evaluation.
    run: the evaluate.Run that keeps the folder, log and checkpoint (--resume: restores them)."""
    d = load_dataset(cfg) if d is None else d
    ev.check_data(cfg, d, atari=True)  # a context or target that means nothing for this data
    device, info = ev.pick_device(cfg.device), d.info()

    # one step's memory, from shapes alone, before anything is allocated
    need = ev.check_memory(lambda: build_model(cfg, info), lambda m, b: loss_fn(m, b, cfg),
                           get_batch(d, 2, cfg, np.random.default_rng(0), longest=True),
                           cfg.batch_size, device)

    # the model, the optimiser and the schedule
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(0.9, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    rng = np.random.default_rng(cfg.seed)  # draws the training windows

    # open the run, or with --resume restore all of the above as the run left it
    step = run.start(cfg, model, opt, sched, rng, d, info, need)
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)
    results = batch = None
    with ev.StopSignal(run.saves) as stop:  # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            # --inner-it > 1 (Table 10): each batch its own generator (a resumed run redraws it)
            if batch is None or step % cfg.inner_it == 0:
                seed = (cfg.seed, step // cfg.inner_it)
                own = rng if cfg.inner_it == 1 else np.random.default_rng(seed)
                batch = get_batch(d, cfg.batch_size, cfg, own)
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

            # log every --log-every steps; evaluate and checkpoint every --eval-every
            run.log(step, loss, sched.get_last_lr()[0])
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)
                run.save(step, model, opt, sched, rng, results)  # log.csv, ckpt.pt, curve.png

        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)

    # a run resumed at --steps evaluates its checkpoint; then the hidden attention (App. J)
    results = results or evaluate(model, d, cfg, device)
    if cfg.mode == "transformer":
        attention_figure(model, d, cfg, os.path.join(run.out, "attention.png"))
    return run.finish(results)

# ---- this file's analyses: they never train ----


def attention_figure(model, d, cfg, path, n_windows=64, seed=0):
    """App. J: each layer's last attention row (s_t's), mean |alpha| over channels and dataset
    windows (full ones first), by the key's distance."""
    b = d.sample((2 if d.discrete else 8) * n_windows, cfg.context, np.random.default_rng(seed))
    full = torch.nonzero(b["mask"].all(dim=1)).squeeze(1)
    keep = full[:n_windows] if len(full) else torch.arange(n_windows)
    b = {k: v[keep].to(next(model.parameters()).device) for k, v in b.items()}

    model.eval()
    with torch.no_grad():
        rows = model.hidden_attention(*(b[k] for k in WINDOW), last_row=True)  # layers x (b, di, T)
    model.train()

    # (n_layer, T) by the key's distance, and its kind (a: a_{t-1}; BL3D: 'step')
    prof = torch.stack([a.abs().mean(dim=(0, 1)) for a in rows]).flip(-1).cpu().numpy()
    T = prof.shape[1]
    dist = np.arange(T)
    kind = np.array(["s", "a", "R"] if model.n == 3 else ["step"])[dist % model.n]

    # the figure; the layers' mean at a few distances
    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.5, 4))
    ax = fig.subplots()
    for l, p in enumerate(list(prof) + [prof.mean(0)]):
        label = f"layer {l + 1}" if l < len(prof) else "mean of layers"
        line, = ax.plot(dist, p, "-", lw=1, label=label, color="k" if l == len(prof) else None)
        for k, mk in (("s", "o"), ("a", "^"), ("R", "s"), ("step", "o")):
            ax.plot(dist[kind == k], p[kind == k], mk, ms=3, color=line.get_color())
    xlabel = "token distance from the current s_t token"
    ax.set(yscale="log", ylabel="mean |alpha| over channels and windows",
           xlabel=xlabel + (" (o s, ^ a, [] R)" if model.n == 3 else " (steps)"),
           title=f"DeMa hidden attention, {d.dataset_id}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    ev.save_figure(fig, path, dpi=100)

    shown = sorted({i for i in (0, 1, 2, 3, 6, T - 1) if i < T})
    print(f"hidden attention -> {path}: mean |alpha| at distance {'/'.join(map(str, shown))}: "
          + " / ".join(f"{prof.mean(0)[i]:.3g}" for i in shown))


def attention_episode(cfg, given):
    """--attention (Fig. 4): one episode at the first target, each decision's last attention row
    per layer, mean |alpha| over channels -> attention_episode.npz and .png."""
    cfg, model, d, out = load_model(cfg, given)
    if cfg.mode != "transformer":
        raise data_lib.DataError("--attention needs transformer-like DeMa's window (Fig. 4); this "
                                 "run is --mode rnn")

    decide, steps = policy(model, cfg), []

    def act(batch, live):
        rows = model.hidden_attention(*(batch[k] for k in WINDOW), last_row=True)  # (1, di, T) each
        steps.append(torch.stack([a[0].abs().mean(0) for a in rows]).cpu())  # (n_layer, T)
        return decide(batch, live)

    res = ev.evaluate(act, d, 1, targets(cfg, d)[0], cfg.seed + 10_000,
                      device=next(model.parameters()).device, progress=False, **rollout(cfg))
    attn = torch.stack(steps).numpy()  # (steps, n_layer, T)
    def write(tmp):
        with open(tmp, "wb") as f:  # (np.savez appends .npz to a name, not to a file)
            np.savez(f, attention=attn, returns=res["returns"])
    ev.write_atomic(os.path.join(out, "attention_episode.npz"), write)

    # a heat map per layer and of their mean
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure
    panels = list(attn.transpose(1, 0, 2)) + [attn.mean(1)]  # (steps, T) each
    fig = Figure(figsize=(3.6 * len(panels), 3.8), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True)
    vmax = attn.max()
    vmin = max(attn[attn > 0].min(initial=vmax), vmax * 1e-6)
    norm = LogNorm(vmin=vmin, vmax=vmax) if vmax > 0 else None
    T = attn.shape[2]
    for i, (ax, p) in enumerate(zip(axes, panels)):
        im = ax.imshow(p.T, origin="lower", aspect="auto", cmap="turbo", norm=norm,
                       interpolation="nearest", extent=(-0.5, len(p) - 0.5, -0.5, T - 0.5))
        title = f"layer {i + 1}" if i < len(panels) - 1 else "mean of layers"
        ax.set(xlabel="decision step t of the episode", title=title)
    axes[0].set_ylabel(f"token position in the window ({T - 1} = s_t)")
    fig.colorbar(im, ax=axes.tolist(), label="mean |alpha| over channels (last row)")
    fig.suptitle(f"DeMa hidden attention along one episode, {d.dataset_id} "
                 f"(return {res['returns'][0]:.0f})")

    path = os.path.join(out, "attention_episode.png")
    ev.save_figure(fig, path, dpi=100)

    # s_t's attention to the previous step, and its period
    s_prev = attn.mean(1)[:, T - 1 - model.n]
    period = ""
    if len(s_prev) >= 16:
        spectrum = np.abs(np.fft.rfft(s_prev - s_prev.mean()))
        period = (f"; the previous step's score repeats every "
                  f"~{len(s_prev) / (1 + spectrum[1:].argmax()):.1f} steps")
    mean = attn.mean((0, 1))
    print(f"hidden attention along one episode ({len(attn)} steps, return "
          f"{res['returns'][0]:.1f}) -> {path}; mean |alpha| at distance 0/{model.n}: "
          f"{mean[-1]:.3g} / {mean[-1 - model.n]:.3g}" + period)


def ablate_s6(model, how, layers, donor=None, seed=0):
    """Sec. 4.2, Fig. 5: `layers`' S6 parameters in place: 'zero' (the residual alone), 'random'
    (Mamba's init from `seed`) or 'swap' (`donor`'s)."""
    with torch.no_grad():
        for l in layers:
            mixer = model.blocks[l].mixer
            source = donor.blocks[l].mixer if how == "swap" else None
            if how == "random":
                torch.manual_seed(seed + l)
                source = type(mixer)(mixer.d_model, mixer.d_state, mixer.d_conv, mixer.expand,
                                     n_layer=len(model.blocks))
            for name in S6_PARAMETERS:
                p = mixer.get_parameter(name)
                p.copy_(torch.zeros_like(p) if how == "zero" else source.get_parameter(name))


def s6_ablation(cfg, given):
    """--s6-ablation (Fig. 5): each target's scores, before and after ablate_s6."""
    cfg, model, d, out = load_model(cfg, given)
    n, device, donor = len(model.blocks), next(model.parameters()).device, None
    layers = (list(range(n)) if cfg.s6_layers == "all" else
              sorted({int(x) for x in cfg.s6_layers.split(",")}))

    if max(layers) >= n:
        raise data_lib.DataError(f"--s6-layers {cfg.s6_layers}: this run has {n} layers "
                                 f"(0..{n - 1})")

    # swap: the donor
    if cfg.s6_ablation == "swap":
        path = (os.path.join(cfg.s6_donor, "ckpt.pt") if os.path.isdir(cfg.s6_donor) else
                cfg.s6_donor)
        if not os.path.exists(path):
            raise data_lib.DataError(f"--s6-donor: no checkpoint at {path}")
        ck = ev.read_checkpoint(path, SCRIPT)
        names = {f.name for f in dataclasses.fields(Config)}
        donor = build_model(Config(**{k: v for k, v in ck["config"].items() if k in names}),
                            ck["info"])
        donor.load_state_dict(ck["model"])

        def shapes(m):
            return [[m.blocks[l].mixer.get_parameter(p).shape for p in S6_PARAMETERS]
                    for l in layers]
        if len(donor.blocks) <= max(layers) or shapes(donor) != shapes(model):
            raise data_lib.DataError(f"--s6-donor {path}: its layers {list(layers)} are missing or "
                                     f"not of this run's sizes (--d-model, --d-state, ...)")
        donor = donor.to(device)

    before = evaluate(model, d, cfg, device)
    ablate_s6(model, cfg.s6_ablation, layers, donor, seed=cfg.seed)
    after = evaluate(model, d, cfg, device)

    for (g, r0), (_, r1) in zip(before, after):
        print(f"s6 ablation {cfg.s6_ablation} of layers {','.join(map(str, layers))}, target {g}: "
              f"normalized_score={r1['normalized'].mean():.2f} (original "
              f"{r0['normalized'].mean():.2f}) return={r1['returns'].mean():.2f} (original "
              f"{r0['returns'].mean():.2f}) episodes={len(r1['returns'])}")


def time_scan(fn, b, d_inner, L, N, reps=3, seed=0):
    """Best-of-reps ms of a scan's forward + backward, fp32."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(b, d_inner, L, generator=g)
    delta = torch.randn(b, d_inner, L, generator=g) - 2.0
    A = -torch.exp(torch.log(torch.arange(1, N + 1.0)).repeat(d_inner, 1))  # the S4D-real init
    B, C = torch.randn(b, N, L, generator=g), torch.randn(b, N, L, generator=g)

    leaves = [t.requires_grad_() for t in (u, delta, A, B, C)]
    times = timeit.repeat(lambda: fn(*leaves, delta_softplus=True).sum().backward(), number=1,
                          repeat=reps + 1)
    return 1e3 * min(times[1:])  # the first run warms up


def bench_scan(cfg, given):
    """--bench-scan: the scans' forward + backward at the paper's size (batch 64, L=60, d_inner
    128, N 64), longer L and small states."""
    torch.set_flush_denormal(True)
    di, N = cfg.expand * cfg.d_model, cfg.d_state
    print(f"selective scan, forward + backward, fp32, {torch.get_num_threads()} thread(s), cpu")
    print(f"{'batch':>5} {'d_inner':>7} {'N':>3} {'L':>5} {'sequential ms':>14} {'parallel ms':>12}"
          f"  faster")

    cases = ([(64, di, N, L) for L in (60, 120)] + [(1, di, N, L) for L in (60, 300, 1000, 3000)]
             + [(b, 64, 16, L) for b in (1, 4, 64) for L in (15, 60, 300)]
             + [(1, 16, 4, L) for L in (60, 1000)])

    for b, d_inner, n, L in cases:
        ts = time_scan(selective_scan_sequential, b, d_inner, L, n)
        tp = time_scan(selective_scan_parallel, b, d_inner, L, n)
        faster = "sequential" if ts <= tp else "parallel"
        print(f"{b:5d} {d_inner:7d} {n:3d} {L:5d} {ts:14.1f} {tp:12.1f}  {faster}", flush=True)


def param_table(cfg, given):
    """--params: DeMa's (pre and post blocks). Hopper: Table 7's 175.5K / 500.0K, Table 17's
    431.5K, less departure 6's heads; Atari: Table 7's 1.7M (tests/test_dema.py counts DT's)."""
    hopper, atari = (11, 3, 1000, False), (4 * 84 * 84, 4, 1000, True)
    paper = dict(n_embd=256, d_model=64)  # hopper-medium's (D.1)
    sizes = {k: ATARI[k] for k in ("n_embd", "d_model", "d_state", "n_layer")}
    rows = [("E=256 D=64 N=64 (hopper-medium, Table 7)", paper, hopper),
            ("E=256 D=64 + timestep embedding (Table 17)", dict(paper, timestep_embedding=True),
             hopper),
            ("E=256 D=128 (Table 7)", dict(n_embd=256, d_model=128), hopper),
            ("E=128 D=64", dict(n_embd=128, d_model=64), hopper),
            ("E=256 D=64 --token-layout bl3d (Table 2)", dict(paper, token_layout="bl3d"), hopper),
            ("--preset cpu", ev.preset_values(PRESETS, "cpu", "hopper-medium"), hopper),
            ("Atari E=128 D=128 N=128, 6 layers (code; Table 7)", sizes, atari),
            ("Atari E=256 D=128 N=64 (Table 9 as printed)", dict(sizes, n_embd=256, d_state=64),
             atari),
            ("Atari --preset cpu", ev.preset_values(PRESETS, "cpu", "breakout-expert"), atari)]

    print(f"{'parameters':58s} {'pre (DeMa)':>12s} {'post (DeMa with post.)':>23s}")
    for label, kw, (obs, act, max_ep_len, discrete) in rows:
        n = [sum(p.numel() for p in DeMa(Config(**kw, residual=r), obs, act, max_ep_len,
                                         discrete).parameters()) for r in ("pre", "post")]
        print(f"{'dema ' + label:58s} {n[0]:>12,} {n[1]:>23,}")


ANALYSES = {"bench_scan": bench_scan, "params": param_table, "attention": attention_episode,
            "s6_ablation": s6_ablation}

# ---- what the plumbing needs that no paper says: the script, its log's columns, its tokens ----

SCRIPT = "dema"
LOG_COLUMNS = ()


def batch_tokens(cfg):
    """Tokens in one training batch, for --bench's tokens/s (RNN mode: of --bench's episodes)."""
    steps = min(max(200, 2 * cfg.context), cfg.rnn_max_len) if cfg.mode == "rnn" else cfg.context
    return (1 if cfg.token_layout == "bl3d" else 3) * steps * cfg.batch_size

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
