"""
dema.py -- Decision Mamba (DeMa), one readable file.

Paper: Yang Dai, Oubo Ma, Longfei Zhang, Xingxing Liang, Shengchao Hu, Mengzhu Wang, Shouling Ji, Jincai Huang,
Li Shen, "Is Mamba Compatible with Trajectory Optimization in Offline Reinforcement Learning?" (NeurIPS 2024,
arXiv 2405.12094). Official code: github.com/AndssY/DeMa (it vendors state-spaces/mamba v1.2.0).

What DeMa is: Decision Transformer's GPT backbone replaced by a stack of plain Mamba-1 blocks
(pre-RMSNorm residual, no MLP, no position/timestep embedding). Each environment step t contributes three tokens
[R_t, a_{t-1}, s_t] (return-to-go, PREVIOUS action, state); the action a_t is read from the state token.
  * Transformer-like DeMa (the method, `--mode transformer`): train on random K-step windows; at every decision
    re-run the last K steps from a zero SSM/conv state.
  * RNN-like DeMa (`--mode rnn`): train on whole trajectories; at evaluation feed only the current triplet and
    carry the conv + SSM state through the episode (O(1) per decision).

What is in this file, top to bottom:
  Config, PRESETS              the paper's MuJoCo defaults (Table 8 + D.1; hopper-medium: E=256, D=64, N=64, lr 1e-4)
  selective_scan(...)          the signature and semantics of `selective_scan_ref` in state-spaces/mamba, two paths:
    selective_scan_sequential    a plain loop over time (the reference), line by line the recurrence of Eq. (5)
    selective_scan_parallel      a Hillis-Steele associative scan over time (the CUDA kernel's operator), with a
                                 hand-written backward that is the same scan run in reverse
    choose_scan                  `--scan auto`: which one is faster where (measured on CPU; see its docstring)
  RMSNorm, Mamba (S6 block: full-sequence forward, one-token `step`, `hidden_attention` = Eq. (5)-(6)), Block,
  DeMa (tokens [R_t, a_{t-1}, s_t], action head, recurrent `step`, per-layer hidden attention)
  ---- training section (numpy / data / evaluate) ----
  train(cfg), make_act (both modes), attention figure, scan benchmark, parameter table, main()

Run:
  python dema.py --env hopper-medium                        # the paper's config (100k steps; hours on a CPU)
  MINARI_DATASETS_PATH=../shared/datasets python dema.py --dataset replica/hopper/medium-v0 --preset cpu
  python dema.py --mode rnn ...                             # RNN-like DeMa
  python dema.py --bench-scan                               # sequential vs parallel scan, forward + backward
  python dema.py --params                                   # parameter counts next to dt.py's
  python dema.py --attention runs/dema/<env>/seed0/ckpt.pt  # hidden-attention figure of a checkpoint

Left padding (no attention mask exists in Mamba): windows shorter than K are left-padded by data.py and by
evaluate.py. By default (`pad_mask=True`) pads are made exactly inert inside every Mamba layer: the pre-conv input
is zeroed there (so the causal conv sees the zeros of a fresh start) and Delta is set to 0 (so A_bar = 1,
B_bar x = 0 and the SSM state stays exactly 0). The outputs at real steps then equal those of the unpadded shorter
sequence (to 1e-12 in fp64, tested), in training and evaluation alike, so an episode's first K-1 decisions see what
the official Atari code feeds (the available steps, unpadded). `--no-pad-mask` reproduces the official MuJoCo code, in
which pad tokens are ordinary tokens that enter the state. The a_{t-1} token of a window's first real step is
data.py's prev_action (the step before the window; the null action 0 at an episode's first step).
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # data and run (the same flags as dt.py)
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)")
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env")
    seed: int = arg(0, "seed for sampling, initialisation and evaluation")
    steps: int = arg(100_000, "gradient steps (official code: 10 iterations x 10k)")
    batch_size: int = arg(64, "windows (transformer mode) or whole trajectories (rnn mode) per batch")
    context: int = arg(20, "K, the number of timesteps the model sees (3K tokens); transformer mode")
    lr: float = arg(1e-4, "AdamW learning rate (D.1: 1e-4 hopper-medium(-replay), walker2d-medium; else 1e-3)")
    weight_decay: float = arg(1e-4, "AdamW weight decay; the official MuJoCo code decays every parameter")
    warmup_steps: int = arg(10_000, "linear warmup, then constant (code 1e4; the paper's text says 1e5)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    eval_every: int = arg(10_000, "evaluate (and checkpoint) every this many steps, and at the end")
    eval_episodes: int = arg(10, "episodes per target return, run in parallel")
    target_return: float = arg(None, "return-to-go prompt in raw return units; default: the dataset's targets")
    log_every: int = arg(100, "print and log the training loss every this many steps")
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, mps")
    out: str = arg("", "output folder; default runs/dema/<env>/seed<N>")
    resume: bool = arg(False, "continue from <out>/ckpt.pt")
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine")
    # model (paper Table 8 at hopper-medium; E and D are different widths, notes 7.1). For other datasets the
    # paper's per-dataset E / D / lr (D.1) are applied unless given on the command line (paper_settings)
    n_embd: int = arg(256, "E, token-embedding width (D.1: 256 hopper-medium/-medium-replay, else 128)")
    d_model: int = arg(64, "D, Mamba residual width (D.1: 128 for medium-expert, else 64)")
    n_layer: int = arg(3, "Mamba blocks")
    d_state: int = arg(64, "N, SSM state size per channel")
    d_conv: int = arg(4, "causal depthwise conv width")
    expand: int = arg(2, "d_inner = expand * d_model")
    embd_dropout: float = arg(0.0, "dropout on the token embeddings (MuJoCo 0: the official code never applies it)")
    mode: str = arg("transformer", "'transformer': K-step windows recomputed from a zero state at every decision "
                                   "(the method); 'rnn': whole trajectories, state carried through the episode")
    scan: str = arg("auto", "selective scan: auto | sequential | parallel (auto: the faster one on this device)")
    rtg_shift: bool = arg(False, "train on the official code's triplets (R_{t-1}, a_{t-1}, s_t); eval uses R_t")
    pad_mask: bool = arg(True, "make left padding inert inside Mamba (Delta = 0, zero conv input); "
                               "--no-pad-mask feeds pads as ordinary tokens, as the official code")
    rnn_max_len: int = arg(1000, "rnn mode: trajectories are cut to their first this many steps")
    # instead of training
    bench_scan: bool = arg(False, "time the sequential and parallel scans (forward + backward) and exit")
    params: bool = arg(False, "print parameter counts next to dt.py's and exit")
    attention: str = arg("", "path of a ckpt.pt: draw its hidden-attention figure and exit")


# A small DeMa for a 2-core CPU at dt.py's preset budget (same steps, batch, K, lr, warmup and evaluations). A small
# state (N=16) and two layers keep the scan cheap; ms/step in the README.
PRESETS = {"cpu": dict(n_embd=64, d_model=32, n_layer=2, d_state=16, context=10, batch_size=64, lr=1e-3,
                       warmup_steps=500, steps=6000, eval_every=2000, eval_episodes=10)}

# ----------------------------------------------------------------------------------------------------------------
# The selective scan (Mamba's S6 recurrence).  Semantics of `selective_scan_ref` (state-spaces/mamba v1.2.0):
#   u, delta, z: (batch, d_inner, L);  A: (d_inner, N);  B, C: (batch, N, L);  D, delta_bias: (d_inner,)
#   delta <- softplus(delta + delta_bias)                                 (if asked)
#   A_bar_t = exp(delta_t * A)             (ZOH)          B_bar_t u_t = delta_t * B_t * u_t   (Euler, as the code)
#   h_t = A_bar_t * h_{t-1} + B_bar_t u_t,  h_0 = 0       y_t = <C_t, h_t> + D * u_t,   y <- y * silu(z)
# Computation is in fp32 (fp64 stays fp64, for tests); the output is cast back to u's dtype.
# ----------------------------------------------------------------------------------------------------------------

def _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus):
    dtype = torch.promote_types(u.dtype, torch.float32)
    u, delta, A, B, C = (t.to(dtype) for t in (u, delta, A, B, C))
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)[:, None]                         # (b, d, L)
    if delta_softplus:
        delta = F.softplus(delta)                                            # threshold 20, as the CUDA kernel
    return u, delta, A, B, C


def _scan_finish(y, u, D, z, dtype_in):
    if D is not None:
        y = y + u * D.to(y.dtype)[:, None]                                   # skip connection D * u
    if z is not None:
        y = y * F.silu(z.to(y.dtype))                                        # gate
    return y.to(dtype_in)


def selective_scan_sequential(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The reference: a plain loop over time on a (batch, d_inner, N) state, paper Eq. (5) read left to right,
    differentiated by autograd. A_bar_t and B_bar_t u_t are formed inside the loop, one (b, d, n) slice at a time:
    building them for all t first (b, d, L, n) and slicing was 1.4-4x slower on CPU (memory traffic)."""
    dtype_in = u.dtype
    u, delta, A, B, C = _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus)
    batch, d_inner, L = u.shape
    h = u.new_zeros(batch, d_inner, A.shape[1])                              # (b, d, n), h_0 = 0
    du = delta * u                                                           # (b, d, L)
    ys = []
    # unbind hands out the time slices (indexing [..., t] would make autograd allocate a zero tensor per slice)
    for delta_t, du_t, B_t, C_t in zip(delta.unbind(-1), du.unbind(-1), B.unbind(-1), C.unbind(-1)):
        A_bar = torch.exp(delta_t[:, :, None] * A)                           # (b, d, n)   exp(Delta_t A)
        h = torch.addcmul(du_t[:, :, None] * B_t[:, None, :], A_bar, h)      # (b, d, n)   h_t = A_bar h + B_bar u_t
        ys.append((h * C_t[:, None, :]).sum(-1))                             # (b, d)      y_t = <C_t, h_t>
    y = torch.stack(ys, dim=-1)                                              # (b, d, L)
    return _scan_finish(y, u, D, z, dtype_in)


def _hillis_steele(a, b):
    """Inclusive scan along dim 2 of h_t = a_t h_{t-1} + b_t, h_{-1} = 0, with the operator on pairs
        (a0, b0) o (a1, b1) = (a1 a0, a1 b0 + b1)            (the CUDA kernel's, notes 7.1)
    ceil(log2 L) vectorised rounds; after the round with shift s every position holds the composition of its
    last 2s terms. Works on copies; no autograd (the gradient is _LinearScan.backward)."""
    a, b = a.clone(), b.clone()
    L, s = a.shape[2], 1
    while s < L:
        b[:, :, s:] += a[:, :, s:] * b[:, :, :-s]    # the right side is evaluated into a temporary first
        a[:, :, s:] *= a[:, :, :-s].clone()          # clone: the slices overlap in memory
        s *= 2
    return b


class _LinearScan(torch.autograd.Function):
    """h = scan(a, b) with a hand-written backward, itself a reverse scan with the same operator:
        g_t = dLoss/dh_t (total) = gh_t + a_{t+1} g_{t+1},   dLoss/db_t = g_t,   dLoss/da_t = g_t h_{t-1}.
    (Letting autograd differentiate the Hillis-Steele rounds instead costs a full-size zero tensor per slice in
    the backward; that was 10x slower.)"""

    @staticmethod
    def forward(ctx, a, b):
        h = _hillis_steele(a, b)
        ctx.save_for_backward(a, h)
        return h

    @staticmethod
    def backward(ctx, gh):
        a, h = ctx.saved_tensors
        a_next = torch.cat([a[:, :, 1:], torch.ones_like(a[:, :, :1])], dim=2)     # a_{t+1}, 1 past the end
        g = _hillis_steele(a_next.flip(2), gh.flip(2)).flip(2)                     # reverse scan
        h_prev = torch.cat([torch.zeros_like(h[:, :, :1]), h[:, :, :-1]], dim=2)    # h_{t-1}, h_{-1} = 0
        return g * h_prev, g


def selective_scan_parallel(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """The same recurrence by an associative (Hillis-Steele) scan over time: O(L log L) work in log2(L) rounds, each
    reading and writing the full (batch, d_inner, L, N) tensors. Only exp of non-positive numbers is taken, so a
    large negative A*Delta underflows to 0 instead of overflowing (never exp(A S_i) * exp(-A S_j), S = cumsum)."""
    dtype_in = u.dtype
    u, delta, A, B, C = _scan_prepare(u, delta, A, B, C, delta_bias, delta_softplus)
    a = torch.exp(delta[..., None] * A[:, None, :])                          # (b, d, L, n)  A_bar_t
    b = (delta * u)[..., None] * B.transpose(1, 2)[:, None]                  # (b, d, L, n)  B_bar_t u_t
    h = _LinearScan.apply(a, b)                                              # (b, d, L, n)  all h_t
    y = torch.einsum('bdln,bnl->bdl', h, C)                                  # (b, d, L)     y_t = <C_t, h_t>
    return _scan_finish(y, u, D, z, dtype_in)


def choose_scan(device_type, L, state_numel):
    """`--scan auto`: the faster path, from the forward + backward timings of `bench_scan` (README, 1 CPU thread).
    A step of the loop is ~6 small ops forward and ~12 backward on the (batch, d_inner, N) state; the parallel scan
    does a few dozen ops in all, but each reads and writes the whole (batch, d_inner, L, N) tensor, log2(L) times
    (the materialisation that alxndrTL/mamba.py#57 discusses).
    So on CPU the loop wins once the state is large enough for those small ops to cost more than their launch
    overhead: at the paper's training size (64 x 128 x 64, L=60) the loop is ~10x faster, and for every state of
    8k+ elements measured (L = 15..3000). The parallel scan wins only for tiny states (up to ~2-4k elements, e.g.
    one environment, d_inner 64, N 16) where the loop is launch-bound; the measured boundary is
    state_numel * ceil(log2 L) ~ 2e4. On CUDA the loop is launch-bound at every size that fits (about 18 kernels
    per token per layer), and the log-depth scan is chosen; that is reasoned, not measured here (no GPU)."""
    if L <= 1:
        return "sequential"
    if device_type == "cuda":
        return "parallel"
    return "parallel" if state_numel * math.ceil(math.log2(L)) <= 20_000 else "sequential"


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, scan='auto'):
    if scan == 'auto':
        scan = choose_scan(u.device.type, u.shape[-1], u.shape[0] * u.shape[1] * A.shape[1])
    fn = {'sequential': selective_scan_sequential, 'parallel': selective_scan_parallel}[scan]
    return fn(u, delta, A, B, C, D=D, z=z, delta_bias=delta_bias, delta_softplus=delta_softplus)


# ----------------------------------------------------------------------------------------------------------------
# Mamba-1 block and the DeMa model
# ----------------------------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """RMSNorm(v) = v / sqrt(mean(v^2) + eps) * w  (official code: mamba's fused RMSNorm, eps 1e-5, no bias)."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Mamba(nn.Module):
    """Mamba-1 mixer (`mamba_simple.Mamba`, notes 2.4): in_proj -> causal depthwise conv + SiLU -> x_proj -> (dt, B, C)
    -> dt_proj + softplus -> selective scan with A = -exp(A_log) and the D skip -> * SiLU(z) -> out_proj."""

    def __init__(self, d_model, d_state=64, d_conv=4, expand=2, n_layer=1,
                 dt_min=1e-3, dt_max=1e-1, dt_init_floor=1e-4):
        super().__init__()
        self.d_inner = d_inner = expand * d_model
        self.d_state, self.d_conv = d_state, d_conv
        self.dt_rank = dt_rank = math.ceil(d_model / 16)                    # "auto"
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)
        # Mamba's initialisation (the paper states none; notes 7.14): dt_proj weight U(-R^-1/2, R^-1/2); its bias is
        # softplus^-1 of dt ~ logU(dt_min, dt_max); A_log = log(1..N) (S4D-real); out_proj rescaled by 1/sqrt(n_layer).
        with torch.no_grad():
            nn.init.uniform_(self.dt_proj.weight, -dt_rank ** -0.5, dt_rank ** -0.5)
            dt = torch.exp(torch.rand(d_inner) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
            dt = dt.clamp(min=dt_init_floor)
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            nn.init.kaiming_uniform_(self.out_proj.weight, a=math.sqrt(5))
            self.out_proj.weight /= math.sqrt(n_layer)

    def ssm_inputs(self, h, mask=None):
        """h (b, T, D) -> x (b, di, T) post-conv SSM input, z, delta (b, di, T), A (di, N), B, C (b, N, T)."""
        T = h.shape[1]
        x, z = self.in_proj(h).chunk(2, dim=-1)                              # (b, T, di) each
        x, z = x.transpose(1, 2), z.transpose(1, 2)                          # (b, di, T)
        if mask is not None:
            x = x * mask[:, None, :]                                         # pads = the zeros before a fresh start
        x = F.silu(self.conv1d(x)[..., :T])                                  # causal depthwise conv, width d_conv
        dbc = self.x_proj(x.transpose(1, 2))                                 # (b, T, R + 2N)
        dt, B, C = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt)).transpose(1, 2)                 # (b, di, T)  Delta = softplus(S_Delta(x))
        if mask is not None:
            delta = delta * mask[:, None, :]                                 # Delta = 0: state passes pads unchanged
        A = -torch.exp(self.A_log.float())                                   # (di, N), kept in fp32
        return x, z, delta, A, B.transpose(1, 2), C.transpose(1, 2)

    def forward(self, h, mask=None, scan='auto'):
        x, z, delta, A, B, C = self.ssm_inputs(h, mask)
        y = selective_scan(x, delta, A, B, C, D=self.D.float(), z=z, scan=scan)   # (b, di, T)
        return self.out_proj(y.transpose(1, 2))                              # (b, T, D)

    def init_state(self, batch, device=None):
        return (torch.zeros(batch, self.d_inner, self.d_conv, device=device),  # conv_state: last d_conv inputs
                torch.zeros(batch, self.d_inner, self.d_state, device=device))  # ssm_state h

    def step(self, h, state):
        """One token: h (b, D), state = (conv_state (b, di, d_conv), ssm_state (b, di, N)) -> (out (b, D), state)."""
        conv_state, ssm_state = state
        x, z = self.in_proj(h).chunk(2, dim=-1)                              # (b, di)
        conv_state = torch.cat([conv_state[:, :, 1:], x[:, :, None]], dim=-1)   # roll in x_t
        x = F.silu((conv_state * self.conv1d.weight[:, 0]).sum(-1) + self.conv1d.bias)  # (b, di)
        dt, B, C = self.x_proj(x).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        delta = F.softplus(self.dt_proj(dt))                                 # (b, di)
        A = -torch.exp(self.A_log.float())
        ssm_state = torch.exp(delta[..., None] * A) * ssm_state + (delta * x)[..., None] * B[:, None, :]  # Eq. (5)
        y = torch.bmm(ssm_state, C[..., None]).squeeze(-1) + self.D * x      # (b, di)
        y = y * F.silu(z)
        return self.out_proj(y), (conv_state, ssm_state)

    def hidden_attention(self, h, mask=None, last_row=False):
        """The S6 layer as an implicit attention (paper Eq. (5)-(6); exact per-channel form, notes 2.8):
            alpha[c]_{i,j} = sum_n C_i[n] exp(A[c,n] sum_{k=j+1..i} Delta_k[c]) Delta_j[c] B_j[n]   for j <= i, else 0
        so that y_i[c] = sum_j alpha[c]_{i,j} x_j[c] is the S6 output without the D skip and the gate (x = post-conv
        input, so the conv's own 4-token mixing is not in alpha). Returns (b, di, T, T), or (b, di, T) for the last
        query row only. Paper Eq. (6) is the ReLU approximation of softplus; the exact form is used here."""
        x, z, delta, A, B, C = self.ssm_inputs(h, mask)
        T = x.shape[-1]
        S = delta.cumsum(-1)                                                 # (b, di, T)
        rows = slice(T - 1, T) if last_row else slice(0, T)
        seg = S[:, :, rows, None] - S[:, :, None, :]                         # (b, di, Ti, Tj) = sum_{k=j+1..i} Delta_k
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).tril()[rows]   # (Ti, Tj)
        seg = seg.masked_fill(~causal, 0.0)                                  # never exp(+large) above the diagonal
        decay = torch.exp(seg[..., None] * A[None, :, None, None, :])        # (b, di, Ti, Tj, N), all <= 1
        alpha = torch.einsum('bni,bcijn,bnj->bcij', C[:, :, rows], decay, B) * delta[:, :, None, :]
        alpha = alpha * causal
        return alpha[:, :, 0] if last_row else alpha


class Block(nn.Module):
    """x + Mamba(RMSNorm(x)): the 'pre up-projection' residual block (paper 4.2, Fig. 1 right); no MLP."""

    def __init__(self, cfg):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model)
        self.mixer = Mamba(cfg.d_model, cfg.d_state, cfg.d_conv, cfg.expand, n_layer=cfg.n_layer)

    def forward(self, x, mask=None, scan='auto'):
        return x + self.mixer(self.norm(x), mask, scan)


class DeMa(nn.Module):
    """Tokens [R_t, a_{t-1}, s_t] per step (paper 4.1 'B3LD', official MuJoCo order), E-wide embeddings, Linear E->D,
    n_layer Mamba blocks, final RMSNorm, action = tanh(Linear(out at the s_t token)).
    No timestep/position embedding (paper Table 17), no LayerNorm on the embeddings.
    The official model also has unused `predict_state` / `predict_return` heads (780 parameters at hopper): left out."""

    def __init__(self, cfg, obs_dim, act_dim):
        super().__init__()
        self.cfg = cfg
        E, D = cfg.n_embd, cfg.d_model
        self.embed_return = nn.Linear(1, E)
        self.embed_action = nn.Linear(act_dim, E)
        self.embed_state = nn.Linear(obs_dim, E)
        self.drop = nn.Dropout(cfg.embd_dropout)
        self.embedding = nn.Linear(E, D)              # official MixerModel.embedding (nn.Embedding -> nn.Linear)
        nn.init.zeros_(self.embedding.bias)           # mamba's _init_weights zeroes every Linear bias in the backbone
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.norm_f = RMSNorm(D)
        self.predict_action = nn.Sequential(nn.Linear(D, act_dim), nn.Tanh())

    def tokens(self, rtg, prev_actions, states):
        """rtg (b, K, 1), prev_actions (b, K, act_dim) = a_{t-1}, states (b, K, obs_dim) -> (b, 3K, D)."""
        b, K, _ = states.shape
        e = torch.stack([self.embed_return(rtg), self.embed_action(prev_actions), self.embed_state(states)], dim=2)
        return self.embedding(self.drop(e.reshape(b, 3 * K, -1)))          # (b, 3K, D)  R_0 a_-1 s_0 R_1 a_0 s_1 ...

    def forward(self, rtg, prev_actions, states, mask=None, scan='auto'):
        """-> predicted actions (b, K, act_dim), a_t read from the s_t token. mask (b, K): 1 real, 0 pad."""
        x = self.tokens(rtg, prev_actions, states)
        tmask = None if mask is None else mask.repeat_interleave(3, dim=1)  # (b, 3K)
        for blk in self.blocks:
            x = blk(x, tmask, scan)
        x = self.norm_f(x)
        return self.predict_action(x[:, 2::3])                               # (b, K, act_dim)

    def init_state(self, batch, device=None):
        return [blk.mixer.init_state(batch, device) for blk in self.blocks]

    def step(self, rtg, prev_action, state_obs, state):
        """RNN-like DeMa: one environment step = three tokens through every layer, carrying conv + SSM states.
        rtg (b, 1), prev_action (b, act_dim), state_obs (b, obs_dim) -> (action (b, act_dim), new state)."""
        toks = self.tokens(rtg[:, None], prev_action[:, None], state_obs[:, None])   # (b, 3, D)
        state = list(state)
        for i in range(3):
            x = toks[:, i]
            for l, blk in enumerate(self.blocks):
                out, state[l] = blk.mixer.step(blk.norm(x), state[l])
                x = x + out
        return self.predict_action(self.norm_f(x)), state                   # x is the s_t token's output

    def hidden_attention(self, rtg, prev_actions, states, mask=None, last_row=False):
        """Per-layer implicit attention (Mamba.hidden_attention) of the S6 layer inside each block."""
        x = self.tokens(rtg, prev_actions, states)
        tmask = None if mask is None else mask.repeat_interleave(3, dim=1)
        attn = []
        for blk in self.blocks:
            hn = blk.norm(x)
            attn.append(blk.mixer.hidden_attention(hn, tmask, last_row))
            x = x + blk.mixer(hn, tmask)
        return attn


# ----------------------------------------------------------------------------------------------------------------
# training, evaluation, analysis and the command line (everything below needs numpy and the project's data/evaluate)

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import data as data_lib  # noqa: E402
import evaluate as eval_lib  # noqa: E402


def paper_settings(name):
    """Per-dataset E / D / lr of paper D.1 (MuJoCo) and Tables 14-15 (mazes); {} when the paper has none."""
    name = name.lower()
    m = re.search(r"(halfcheetah|hopper|walker2d)[-/](medium-replay|medium-expert|medium|expert|simple)", name)
    if m:
        env, level = m.groups()
        return dict(n_embd=256 if env == "hopper" and level in ("medium", "medium-replay") else 128,
                    d_model=128 if level == "medium-expert" else 64,
                    lr=1e-4 if (env, level) in {("hopper", "medium"), ("hopper", "medium-replay"),
                                                ("walker2d", "medium")} else 1e-3)
    if "pointmaze" in name or "maze2d" in name:   # Table 15 (maze2d); medium: K=8, E=256; umaze: Table 8 values
        if "umaze" in name:
            return dict(n_embd=128, d_model=64, lr=1e-4)
        return dict(n_embd=256 if "medium" in name else 128, d_model=64, lr=2e-5, batch_size=32,
                    context=8 if "medium" in name else 20, embd_dropout=0.1)
    if "antmaze" in name:                         # Table 14
        return dict(n_embd=128, d_model=128, lr=2e-5, batch_size=32, context=5, embd_dropout=0.1)
    return {}


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def prev_actions(batch):
    """a_{t-1} at every position of a window: cat(prev_action, actions[:, :-1]). With left padding the first real
    step's previous action is prev_action (the null action 0 at an episode's first step), see data.py."""
    return torch.cat([batch["prev_action"][:, None], batch["actions"][:, :-1]], dim=1)   # (B, K, act_dim)


def predict(model, batch, cfg, training=False):
    """Model inputs from a data.py / evaluate.py window -> (predicted actions, target actions, loss mask)."""
    rtg, prev, states, mask = batch["rtg"], prev_actions(batch), batch["states"], batch["mask"]
    target = batch["actions"]
    if training and cfg.rtg_shift:
        # The official code's training triplet is (R_{t-1}, a_{t-1}, s_t) -> a_t over K-1 steps (it drops s_0), while
        # its evaluation feeds (R_t, a_{t-1}, s_t) (notes 2.2, 7.2). Default here: (R_t, a_{t-1}, s_t) in both, over
        # K steps, which keeps the DT convention that the prompt return belongs to the current state.
        rtg, prev, states, target = rtg[:, :-1], prev[:, 1:], states[:, 1:], target[:, 1:]
        mask = mask[:, 1:]
    pred = model(rtg, prev, states, mask if cfg.pad_mask else None, cfg.scan)       # (B, K, act_dim)
    return pred, target, mask


def loss_fn(model, batch, cfg):
    pred, target, mask = predict(model, batch, cfg, training=True)
    err = ((pred - target) ** 2).mean(-1)                                           # (B, K)
    return (err * mask).sum() / mask.sum()                                          # MSE over real steps


def sample_trajectories(d, batch_size, max_len, rng):
    """RNN-like training batch: whole trajectories (their first max_len steps), drawn in proportion to length. They
    are cut by data.gather_windows and so LEFT-padded to the longest one; with the inert pad mask this is exactly
    the official code's right padding (a causal model is unaffected by either)."""
    lengths = np.diff(np.append(d.ep_start, len(d.step_ep_start)))                 # (n_episodes,)
    ep = rng.choice(len(lengths), size=batch_size, p=lengths / lengths.sum())
    n = np.minimum(lengths[ep], max_len)
    start = d.ep_start[ep]
    return data_lib.gather_windows(d.flat, start, start + n - 1, int(n.max()))


def make_act(model, cfg):
    """The evaluate() policy. Transformer-like: re-run the window from a zero state, action at the last position.
    RNN-like: feed only the current triplet (R_t, a_{t-1}, s_t), carrying each env's conv + SSM states; the states
    are zeroed when timesteps[:, -1] == 0 (a fresh episode)."""
    if cfg.mode == "transformer":
        def act(batch, live):
            return predict(model, batch, cfg)[0][:, -1]
        return act
    states = {}                                                                     # env index -> per-layer states

    def act_rnn(batch, live):
        B = len(live)
        fresh = batch["timesteps"][:, -1] == 0
        init = model.init_state(1, batch["states"].device)
        per_env = [init if bool(fresh[j]) or int(i) not in states else states[int(i)] for j, i in enumerate(live)]
        st = [tuple(torch.cat([s[l][k] for s in per_env]) for k in range(2)) for l in range(len(init))]
        a, st = model.step(batch["rtg"][:, -1], prev_actions(batch)[:, -1], batch["states"][:, -1], st)
        for j, i in enumerate(live):
            states[int(i)] = [(c[j:j + 1], h[j:j + 1]) for c, h in st]
        assert a.shape[0] == B
        return a
    return act_rnn


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


def run_evals(model, d, cfg, device, seed):
    """Evaluate every target return; returns [(target, result dict)]. RNN mode needs only the current step."""
    targets = [cfg.target_return] if cfg.target_return is not None else d.target_returns
    K = cfg.context if cfg.mode == "transformer" else 1
    model.eval()
    out = []
    for g in targets:
        t0 = time.time()
        res = eval_lib.evaluate(make_act(model, cfg), d, cfg.eval_episodes, g, seed, K, device)
        out.append((g, res | {"seconds": time.time() - t0}))
    model.train()
    return out


def count_params(model):
    return sum(p.numel() for p in model.parameters())


def dt_params(d, preset):
    """Parameters of dt.py's model on the same data, for the line printed next to ours ('n/a' without dt.py, e.g.
    when this file was copied into another project)."""
    try:
        import dt
    except ImportError:
        return "n/a"
    dcfg = dt.Config(**(dt.PRESETS["cpu"] if preset == "cpu" else {}))
    return f"{count_params(dt.DecisionTransformer(dcfg, d.obs_dim, d.act_dim, d.max_ep_len)):,}"


def train(cfg):
    if cfg.mode not in ("transformer", "rnn"):
        raise data_lib.DataError(f"unknown --mode '{cfg.mode}'; use transformer or rnn")
    if cfg.scan not in ("auto", "sequential", "parallel"):
        raise data_lib.DataError(f"unknown --scan '{cfg.scan}'; use auto, sequential or parallel")
    if cfg.mode == "rnn" and not cfg.pad_mask:
        raise data_lib.DataError("--mode rnn needs the pad mask (whole trajectories are padded to equal length)")
    device = pick_device(cfg.device)
    d = data_lib.load_data(cfg.dataset or cfg.env)
    name = (cfg.dataset or cfg.env).replace("/", "-")
    out = cfg.out or os.path.join("runs", "dema", name, f"seed{cfg.seed}")
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "ckpt.pt")
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; "
          f"normalised with {d.ref_source}; targets {d.target_returns}; device {device}; mode {cfg.mode}; "
          f"scan {cfg.scan}")
    if cfg.scan == "auto" and cfg.mode == "transformer":
        state = cfg.batch_size * cfg.expand * cfg.d_model * cfg.d_state
        print(f"scan auto: {choose_scan(torch.device(device).type, 3 * cfg.context, state)} for training batches")

    torch.manual_seed(cfg.seed)
    model = DeMa(cfg, d.obs_dim, d.act_dim).to(device)
    print(f"parameters: {count_params(model):,} (E={cfg.n_embd}, D={cfg.d_model}, N={cfg.d_state}, "
          f"{cfg.n_layer} layers); dt.py{' --preset cpu' if cfg.preset == 'cpu' else ''} on this data: "
          f"{dt_params(d, cfg.preset)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / cfg.warmup_steps, 1.0))
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
        json.dump(dataclasses.asdict(cfg) | {"dataset_id": d.dataset_id, "device": device}, f, indent=2)

    def save():
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step,
                        wall_time=wall, numpy_rng=json.dumps(rng.bit_generator.state), torch_rng=torch.get_rng_state(),
                        config=dataclasses.asdict(cfg), state_mean=torch.from_numpy(d.state_mean),
                        state_std=torch.from_numpy(d.state_std), return_scale=d.return_scale,
                        max_ep_len=d.max_ep_len, dataset_id=d.dataset_id, obs_dim=d.obs_dim, act_dim=d.act_dim),
                   ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)  # never leave a half-written checkpoint behind
        with open(os.path.join(out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(rows)

    def get_batch():
        if cfg.mode == "rnn":
            b = sample_trajectories(d, cfg.batch_size, cfg.rnn_max_len, rng)
        else:
            b = d.sample(cfg.batch_size, cfg.context, rng)
        return {k: v.to(device) for k, v in b.items()}

    last_eval, final = "", None
    t_log, losses = time.time(), []
    model.train()
    try:
        while step < cfg.steps:
            t0 = time.time()
            loss = loss_fn(model, get_batch(), cfg)
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
                                                                 lr=f"{sched.get_last_lr()[0]:.3e}", wall_time=f"{wall:.1f}"))
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{ms:.1f} ms/step{last_eval}", flush=True)
                t_log, losses = time.time(), []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.time()
                results = run_evals(model, d, cfg, device, cfg.seed + 10_000)
                wall += time.time() - t0
                for g, res in results:
                    rows.append(dict.fromkeys(LOG_FIELDS, "") | dict(
                        step=step, target=g, eval_return=f"{res['returns'].mean():.2f}",
                        eval_return_std=f"{res['returns'].std():.2f}", normalized_score=f"{res['normalized'].mean():.2f}",
                        normalized_score_std=f"{res['normalized'].std():.2f}",
                        success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                        steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                        wall_time=f"{wall:.1f}"))
                    print(f"eval step {step} target {g:g}: {eval_lib.summarize(res)} ({res['seconds']:.0f}s)")
                final = results[0]
                last_eval = f" | eval {final[1]['normalized'].mean():.1f}"
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), f"dema {d.dataset_id} seed {cfg.seed}")
                t_log = time.time()
    except KeyboardInterrupt:
        save()
        print(f"\ninterrupted at step {step}; checkpoint saved, continue with --resume")
        raise SystemExit(130)
    if final is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        final = run_evals(model, d, cfg, device, cfg.seed + 10_000)[0]
    if cfg.mode == "transformer":
        attention_figure(model, d, cfg, os.path.join(out, "attention.png"), device)
    res = final[1]
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


# ----------------------------------------------------------------------------------------------------------------
# analysis: hidden attention figure, scan benchmark, parameter table

def attention_profile(model, batch, cfg):
    """Paper Fig. 4 reduced to one curve per layer: |alpha| of the LAST query row (the current state token s_t, whose
    output is the action) averaged over channels and windows, as a function of the key's distance from it."""
    with torch.no_grad():
        rows = model.hidden_attention(batch["rtg"], prev_actions(batch), batch["states"],
                                      batch["mask"] if cfg.pad_mask else None, last_row=True)
    prof = torch.stack([a.abs().mean(dim=(0, 1)) for a in rows])                  # (n_layer, T), key position j
    return prof.flip(-1).cpu().numpy()                                             # (n_layer, T), distance T-1-j


def attention_figure(model, d, cfg, path, device="cpu", n_windows=64, seed=0):
    """Hidden attention on full (unpadded) dataset windows: mean |alpha| vs token distance per layer (log y), one
    marker per token type. The paper plots the same last-row quantity along one evaluation episode (Fig. 4)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rng = np.random.default_rng(seed)
    b = d.sample(8 * n_windows, cfg.context, rng)
    full = torch.nonzero(b["mask"].all(dim=1)).squeeze(1)[:n_windows]               # windows with no padding
    b = {k: v[full].to(device) for k, v in b.items()}
    was_training = model.training
    model.eval()
    prof = attention_profile(model, b, cfg)                                         # (n_layer, T)
    model.train(was_training)
    T = prof.shape[1]
    dist = np.arange(T)
    kind = np.array(["s", "a", "R"])[dist % 3]        # distance 0 is s_t, 1 is a_{t-1}, 2 is R_t, 3 is s_{t-1}, ...
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for l, p in enumerate(list(prof) + [prof.mean(0)]):
        label = f"layer {l + 1}" if l < len(prof) else "mean of layers"
        line, = ax.plot(dist, p, "-", lw=1, label=label, color="k" if l == len(prof) else None)
        for k, mk in (("s", "o"), ("a", "^"), ("R", "s")):
            sel = kind == k
            ax.plot(dist[sel], p[sel], mk, ms=3, color=line.get_color())
    ax.set(yscale="log", xlabel="token distance from the current state token (o s, ^ a, [] R)",
           ylabel="mean |alpha| over channels and windows", title=f"DeMa hidden attention, {d.dataset_id}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    # slope of log(mean over layers) over state tokens: exponential decay rate per environment step
    s_idx = dist[kind == "s"]
    slope = np.polyfit(s_idx / 3, np.log(prof.mean(0)[s_idx] + 1e-30), 1)[0]
    print(f"hidden attention -> {path}: mean |alpha| at distance 0/1/2/3/6/{T - 1}: "
          + " / ".join(f"{prof.mean(0)[i]:.3g}" for i in (0, 1, 2, 3, 6, T - 1))
          + f"; state tokens decay x{np.exp(slope):.3f} per step")
    return prof


def attention_from_checkpoint(cfg):
    if not os.path.exists(cfg.attention):
        raise data_lib.DataError(f"no checkpoint at {cfg.attention}")
    ck = torch.load(cfg.attention, map_location="cpu", weights_only=True)
    mcfg = Config(**{k: v for k, v in ck["config"].items() if k in {f.name for f in dataclasses.fields(Config)}})
    d = data_lib.load_data(ck["dataset_id"])
    model = DeMa(mcfg, d.obs_dim, d.act_dim)
    model.load_state_dict(ck["model"])
    attention_figure(model, d, mcfg, os.path.join(os.path.dirname(cfg.attention), "attention.png"))


def time_scan(fn, b, d_inner, L, N, reps=3, seed=0):
    """Best-of-reps wall time (ms) of forward + backward of one selective scan, fp32."""
    g = torch.Generator().manual_seed(seed)
    u, delta = torch.randn(b, d_inner, L, generator=g), torch.randn(b, d_inner, L, generator=g) - 2.0
    A = -torch.exp(torch.log(torch.arange(1, N + 1.0)).repeat(d_inner, 1))        # the S4D-real init
    B, C = torch.randn(b, N, L, generator=g), torch.randn(b, N, L, generator=g)
    leaves = [t.requires_grad_() for t in (u, delta, A, B, C)]
    best = float("inf")
    for r in range(reps + 1):                                                       # first run: warm-up
        t0 = time.perf_counter()
        fn(*leaves, delta_softplus=True).sum().backward()
        if r:
            best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def bench_scan(cfg):
    """Forward + backward of one scan: the paper's MuJoCo size (batch 64, K=20 -> L=60, d_inner=2*64, N=64) and
    longer L, then smaller states (one env, the cpu preset's d_inner 64 / N 16) where the loop is launch-bound."""
    torch.set_flush_denormal(True)
    di, N = cfg.expand * cfg.d_model, cfg.d_state
    print(f"selective scan, forward + backward, fp32, {torch.get_num_threads()} thread(s), cpu")
    print(f"{'batch':>5} {'d_inner':>7} {'N':>3} {'L':>5} {'sequential ms':>14} {'parallel ms':>12}  faster      auto")
    cases = [(64, di, N, L) for L in (60, 120)] + [(1, di, N, L) for L in (60, 300, 1000, 3000)] + \
            [(b, 64, 16, L) for b in (1, 4, 64) for L in (15, 60, 300)] + [(1, 16, 4, L) for L in (60, 1000)]
    for b, d_inner, n, L in cases:
        ts = time_scan(selective_scan_sequential, b, d_inner, L, n)
        tp = time_scan(selective_scan_parallel, b, d_inner, L, n)
        faster = "sequential" if ts <= tp else "parallel"
        print(f"{b:5d} {d_inner:7d} {n:3d} {L:5d} {ts:14.1f} {tp:12.1f}  {faster:10s}  "
              f"{choose_scan('cpu', L, b * d_inner * n)}", flush=True)


def print_params():
    """Our counts at the paper's settings, next to the official model's (which has 780 unused heads) and dt.py's."""
    import dt
    rows = []
    for label, kw, official in [("hopper E=256 D=64 N=64 (hopper-medium)", dict(n_embd=256, d_model=64), 175_503),
                                ("hopper E=256 D=128", dict(n_embd=256, d_model=128), 499_983),
                                ("hopper E=128 D=64", dict(n_embd=128, d_model=64), 165_007),
                                ("hopper --preset cpu", PRESETS["cpu"], None)]:
        cfg = Config(**{**dataclasses.asdict(Config()), **kw})
        n = count_params(DeMa(cfg, 11, 3))
        unused = (11 * cfg.d_model + 11) + (cfg.d_model + 1)                        # predict_state, predict_return
        note = "" if official is None else \
            f"official {official:,} = {n:,} + {unused} unused heads ({'ok' if n + unused == official else 'MISMATCH'})"
        rows.append((f"dema {label}", n, note))
    for label, kw in [("dt paper (H=128)", {}), ("dt --preset cpu", dt.PRESETS["cpu"])]:
        rows.append((label, count_params(dt.DecisionTransformer(dt.Config(**kw), 11, 3, 1000)), ""))
    for label, n, note in rows:
        print(f"{label:45s} {n:>10,}  {note}")
    return rows


def parse_args(argv):
    """Every Config field is a flag. Order: Config defaults < the paper's per-dataset settings < --preset < flags."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=f.metadata["help"])
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type) if f.default is not None else float
            p.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{f.metadata['help']} (default: {f.default})")
    given = vars(p.parse_args(argv))
    preset = given.get("preset", "")
    if preset and preset not in PRESETS:
        p.error(f"unknown preset '{preset}'; known: {', '.join(PRESETS)}")
    paper = paper_settings(given.get("dataset") or given.get("env") or Config.env)
    return Config(**{**paper, **PRESETS.get(preset, {}), **given})


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if cfg.bench_scan:
            bench_scan(cfg)
        elif cfg.params:
            print_params()
        elif cfg.attention:
            attention_from_checkpoint(cfg)
        else:
            train(cfg)
    except data_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
