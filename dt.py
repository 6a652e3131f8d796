"""
Decision Transformer (Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence
Modeling"): the baseline every other model file in this project is read against.

A trajectory is a sequence of tokens (R_1, s_1, a_1, R_2, s_2, a_2, ...) where R_t is the
return-to-go. A causal GPT-2-style transformer reads the last K steps (3K tokens) and predicts a_t
from the hidden state of the s_t token. At test time the model is prompted with a target return,
and R_{t+1} = R_t - r_t after each step (paper Sec. 3).

    python dt.py --env hopper-medium                  # the paper's configuration (a GPU)
    python dt.py --env hopper-medium --preset cpu     # small, for a 2-core laptop
    python dt.py --env hopper-medium --no-return-token                     # behaviour cloning (BC)
    python dt.py --env hopper-medium --no-return-token --top-fraction 0.1  # %BC: BC on the best 10%
    python data.py make breakout-mixed && python dt.py --dataset made/breakout/mixed-v0 --preset cpu
    python dt.py --out <run folder> --target-sweep    # Fig. 4: the return got against the target

Glossary (paper symbol -> code name):
    R_t   return-to-go, the sum of rewards from t to the episode's end   rtg (B, K, 1), scaled
    s_t   state, normalised by the dataset's mean and std                states (B, K, obs_dim)
    a_t   action, in [-1, 1]                                             actions (B, K, act_dim)
    t     timestep inside the episode (one embedding per timestep)       timesteps (B, K)
    K     context: the number of timesteps the model sees (3K tokens)    Config.context
    C     token width (the paper's embedding dimension, 128)             Config.n_embd
    mask  1 = a real step, 0 = left padding before an episode's start    mask (B, K)
  Atari (AtariDecisionTransformer, the official atari/ code):
    s_t   the last 4 frames, 84x84 grayscale, uint8 (/ 255 in the model) states (B, K, 4, 84, 84)
    a_t   one of the game's |A| actions                                  actions (B, K) int64

Layout: the model (torch alone: copy it) -> Config (the paper's settings, then the run's flags)
and PRESETS -> the paper's pieces -> train(), the loop -> the analyses, and the plumbing and main()
that every model file shares word for word; the run record is evaluate.py's. "kzl" below is the
official code, https://github.com/kzl/decision-transformer/tree/e2d82e68f330c00f763507b3b01d774740bee53f

Departures from the paper and the official code (the detail at the line that says "departure N"):
 1. Minari's mujoco/*-v0 data and gymnasium's MuJoCo v5 envs, not D4RL's -v2 data and mujoco-py
    (neither installs today); scores are normalised with D4RL's reference returns.
 2. A window ends at a uniformly drawn step, left-padded at an episode's start (data.py's sampler);
    kzl's gym window starts at a uniform step (gym/experiment.py#L129) and is left-padded when it
    runs past the episode's end, its padded actions -10 (#L147-L154; here 0).
 3. --lr-decay (a cosine to a tenth) and --preset cpu are not the paper's; the default is its
    configuration.
 4. Atari: the global time embedding reads the window's first timestep in training and evaluation
    alike; kzl's evaluation feeds the current one.
 5. Atari: the cosine reaches 0.1 at --steps; kzl's, max(0.1, (1 + cos) / 2), counts tokens.
 6. The gym model: GPT-2's init as nanoGPT writes it on every module; kzl's initialises its GPT-2
    blocks alone, without residual scaling. The Atari model follows kzl's atari/ code.
"""
from dataclasses import dataclass, field, fields

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
class DTConfig:
    """The model's settings, the paper's gym defaults (build_model fills it from Config)."""
    n_embd: int = 128  # C, the token width
    n_layer: int = 3
    n_head: int = 1
    dropout: float = 0.1  # on embeddings, attention and residuals
    return_token: bool = True  # False: (s, a) tokens only, behaviour cloning (Sec. 5.3)
    # Atari's model alone
    context: int = 30  # K: the per-token-position embedding holds 3K
    state_encoder: str = "conv"  # DQN's conv torso | patch (StARformer's "DT with ViT")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask, rows=slice(None)):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q[:, rows]  # (B, Tq, C): the queries asked for
        q, k, v = (z.view(B, z.shape[1], self.n_head, C // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (B, nh, Tq, hs), (B, nh, T, hs) x 2

        # softmax(q k^T / sqrt(hs)) v
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, :, rows],
                                           dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(B, q.shape[2], C)  # (B, Tq, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """GPT-2 block: pre-LayerNorm attention and MLP, each with a residual connection."""

    def __init__(self, cfg, gelu=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        # kzl's gym GPT-2 has ReLU (gym/experiment.py#L295), its atari/ minGPT GELU
        # (atari/mingpt/model_atari.py#L109)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd),
                                 nn.GELU() if gelu else nn.ReLU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x, attn_mask, rows=slice(None)):
        x = x[:, rows] + self.attn(self.ln_1(x), attn_mask, rows)
        return x + self.mlp(self.ln_2(x))


class DecisionTransformer(nn.Module):
    """DT on vector states (Sec. 3; kzl's gym DT): cfg a DTConfig, the spaces' sizes, and the
    longest episode (one timestep embedding each)."""

    def __init__(self, cfg, obs_dim, act_dim, max_ep_len):
        super().__init__()
        C = cfg.n_embd
        # Sec. 3: "an embedding for each timestep is learned and added to each token" (one timestep
        # = 3 tokens), in place of GPT's positional embedding
        # (kzl gym/decision_transformer/models/decision_transformer.py#L40-L50)
        self.embed_timestep = nn.Embedding(max_ep_len, C)

        # Sec. 3: a linear layer per modality, then a LayerNorm (kzl's gym DT)
        self.return_token = cfg.return_token  # False: (s, a) tokens, behaviour cloning (Sec. 5.3)
        if self.return_token:
            self.embed_return = nn.Linear(1, C)
        self.embed_state = nn.Linear(obs_dim, C)
        self.embed_action = nn.Linear(act_dim, C)
        self.embed_ln = nn.LayerNorm(C)
        self.drop = nn.Dropout(cfg.dropout)

        # GPT-2's blocks, and the action head
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(C)
        self.predict_action = nn.Sequential(nn.Linear(C, act_dim), nn.Tanh())  # actions in [-1, 1]

        # GPT-2's init as nanoGPT writes it, on every module, the residual projections scaled by
        # 1/sqrt(2 * n_layer). Departure 6: kzl's gym DT initialises its GPT-2 blocks alone,
        # N(0, 0.02) unscaled (gym/decision_transformer/models/trajectory_gpt2.py#L356-L366, called
        # at #L526); its embeddings and head
        # (gym/decision_transformer/models/decision_transformer.py#L40-L51) keep PyTorch's defaults,
        # the timestep embedding N(0, 1). Kept: gpt2_dtma.py gives its new weights the same rule,
        # and the README's dt.py rows were measured with it.
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, states, actions, rtg, timesteps, mask):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions
        (B,K,act). The prediction at t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only (BC: no R)."""
        B, K, _ = states.shape

        # the tokens of each step, each with its timestep's embedding
        time = self.embed_timestep(timesteps)  # (B, K, C)
        tokens = [self.embed_state(states) + time, self.embed_action(actions) + time]  # s_t, a_t
        if self.return_token:
            tokens.insert(0, self.embed_return(rtg) + time)  # R_t comes first in each step
        n = len(tokens)  # tokens per step: 3 (2 for BC)

        # the sequence R_1, s_1, a_1, R_2, ... (Alg. 1)
        x = torch.stack(tokens, dim=2).reshape(B, n * K, -1)  # (B, nK, C)
        x = self.drop(self.embed_ln(x))  # (B, nK, C)

        # causal attention over the 3K tokens; the last block computes the s_t tokens alone (the
        # only ones read below): the same outputs, for less work
        attn_mask = causal_padding_mask(mask, n)  # (B, 1, nK, nK)
        for block in self.blocks[:-1]:
            x = block(x, attn_mask)
        # Sec. 3 / Alg. 1: a_t predicted from the s_t token
        x = self.blocks[-1](x, attn_mask, rows=slice(n - 2, None, n))  # (B, K, C)
        return self.predict_action(self.ln_f(x))  # (B, K, act)


def causal_padding_mask(mask, n):
    """(B, K) real-step mask, n tokens per step -> (B, 1, nK, nK) attention mask: causal, and no
    attention to left padding; a padding query sees itself (its output is never used), so that no
    row of the softmax is empty."""
    real = mask.bool().repeat_interleave(n, dim=1)  # (B, nK)
    T = real.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=mask.device)
    return (causal & (real[:, None, :] | eye))[:, None]  # (B, 1, nK, nK)


class PatchEncoder(nn.Module):
    """StARformer's Table 5 "DT with ViT" state token: the 4 x 84 x 84 stack cut into 144 patches of
    7 x 7 x 4, each linear to d = 64 plus a learned spatial embedding (zeros at init), all 144
    flattened, linear to C, tanh."""

    def __init__(self, C, shape=(4, 84, 84), p=7, d=64):
        super().__init__()
        c, H, W = shape
        self.p, self.n = p, (H // p) * (W // p)
        self.embed_patch = nn.Linear(c * p * p, d)
        self.e_spatial = nn.Parameter(torch.zeros(self.n, d))
        self.proj = nn.Sequential(nn.Linear(self.n * d, C), nn.Tanh())

    def forward(self, x):
        N, c, H, W = x.shape  # (N, 4, 84, 84)
        p = self.p

        # 7 x 7 x 4 patches, row by row, each to d, with its place's embedding
        patches = x.reshape(N, c, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        patches = patches.reshape(N, self.n, c * p * p)  # (N, 144, 196)
        z = self.embed_patch(patches) + self.e_spatial  # (N, 144, d)
        return self.proj(z.flatten(1))  # (N, C)


class AtariDecisionTransformer(nn.Module):
    """DT on Atari (Sec. 5.1; kzl atari/mingpt/model_atari.py#L119-L157 and #L227-L266): the tokens
    (R_t, s_t, a_t) with s_t read by DQN's conv torso, a_t an embedding, logits for a_t from the s_t
    token; time is a learned embedding of the window's first timestep plus one per token position
    (the gym model adds one per timestep); minGPT's GELU blocks."""

    def __init__(self, cfg, n_actions, max_ep_len):
        super().__init__()
        C, self.return_token = cfg.n_embd, cfg.return_token
        self.n = 3 if cfg.return_token else 2  # tokens per step (2: BC, (s, a))
        self.pos_emb = nn.Parameter(torch.zeros(1, self.n * cfg.context, C))  # per token position
        self.global_pos_emb = nn.Parameter(torch.zeros(1, max_ep_len, C))  # per timestep
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg, gelu=True) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(C)
        self.head = nn.Linear(C, n_actions, bias=False)

        # minGPT's N(0, 0.02) (no residual scaling) reaches only the modules above (departure 6):
        # kzl applies it before building the embeddings below (atari/mingpt/model_atari.py#L143,
        # #L162-L169), which keep PyTorch's default init, all but the action table's N(0, 0.02)
        # (#L149-L157)
        self.apply(DecisionTransformer._init_weights)

        # DQN's torso (Mnih et al. 2015): 4 x 84 x 84 -> 64 x 7 x 7 -> C, tanh
        self.embed_state = PatchEncoder(C) if cfg.state_encoder == "patch" else nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(64 * 7 * 7, C),
            nn.Tanh())
        self.embed_return = nn.Sequential(nn.Linear(1, C), nn.Tanh()) if cfg.return_token else None
        self.embed_action = nn.Sequential(nn.Embedding(n_actions, C), nn.Tanh())
        nn.init.normal_(self.embed_action[0].weight, mean=0.0, std=0.02)

    def forward(self, states, actions, rtg, timesteps, mask):
        """states (B,K,4,84,84) uint8, actions (B,K) int64, rtg, timesteps, mask as above -> logits
        (B,K,|A|)."""
        B, K = actions.shape

        # the tokens: frames through the torso, actions and returns through their embeddings
        frames = states.reshape(B * K, *states.shape[2:]).float() / 255.0  # (BK, 4, 84, 84)
        # channels-last: the same values, and faster convolutions on CPU
        frames = frames.contiguous(memory_format=torch.channels_last)
        s = self.embed_state(frames).view(B, K, -1)  # (B, K, C)
        tokens = [s, self.embed_action(actions)]  # s_t, a_t: (B, K, C) each
        if self.return_token:
            tokens.insert(0, self.embed_return(rtg))  # R_t first in each step

        n = self.n
        x = torch.stack(tokens, dim=2).reshape(B, n * K, -1)  # (B, nK, C): R_1, s_1, a_1, ...

        # + the window's first timestep's embedding (departure 4; 0 for a left-padded window) + each
        # token position's. kzl's evaluation feeds the current timestep instead, and its
        # atari/create_dataset.py#L93-L99 gives an episode's first step the previous episode's
        # length; the frames are evaluate.py's (its docstring says how they differ from kzl's
        # atari/mingpt/trainer_atari.py#L243-L283)
        first = self.global_pos_emb[0, timesteps[:, 0]][:, None, :]  # (B, 1, C)
        x = self.drop(x + first + self.pos_emb[:, :n * K])  # (B, nK, C)

        # causal attention, then the logits for a_t from the s_t token
        attn_mask = causal_padding_mask(mask, n)  # (B, 1, nK, nK)
        for block in self.blocks[:-1]:
            x = block(x, attn_mask)
        x = self.blocks[-1](x, attn_mask, rows=slice(n - 2, None, n))  # (B, K, C): s_t tokens
        return self.head(self.ln_f(x))  # (B, K, |A|)

# <<< model: end

# ---- the settings: Config (the paper's, then the run's flags) and PRESETS ----


def arg(default, help, in_name=True):
    """A Config field that is a flag; in_name=False: it changes nothing trained, so the run's
    variant name (its folder's) leaves it out."""
    return field(default=default, metadata={"help": help, "in_name": in_name})


@dataclass
class Config:
    # ---- the paper's settings (Sec. 4 and kzl's gym defaults; Atari: PRESETS below) ----
    steps: int = arg(100_000, "gradient steps", in_name=False)  # kzl: 10 iterations x 10k
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "K, the number of timesteps the model sees (3K tokens)")
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    beta2: float = arg(0.999, "AdamW's second-moment decay (Atari: 0.95)")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (kzl)")
    lr_decay: bool = arg(False, "after warmup, a cosine to a tenth of --lr at --steps (not DT's)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    n_embd: int = arg(128, "token width")
    n_layer: int = arg(3, "transformer blocks")
    n_head: int = arg(1, "attention heads")
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals")
    # behaviour cloning (Sec. 5.3, Table 3) and delayed rewards (Table 5)
    return_token: bool = arg(True, "R_t tokens; --no-return-token: (s, a) tokens only, i.e. BC")
    top_fraction: float = arg(1.0, "train on the best episodes holding this share of steps (%BC)")
    delayed_reward: bool = arg(False, "each episode's rewards paid at its last step (Table 5)")
    state_encoder: str = arg("conv", "Atari: conv (DQN's torso) | patch (StARformer's DT with ViT)")
    # the evaluation protocol: kzl's, every 10k steps, 100 episodes a target
    eval_every: int = arg(10_000, "evaluate and checkpoint every this many steps, and at the end",
                          in_name=False)
    eval_episodes: int = arg(100, "episodes per target return, run in parallel", in_name=False)
    greedy: bool = arg(False, "Atari: the likeliest action, not a softmax draw (kzl's)",
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
    bench_eval: bool = arg(False, "time batched vs sequential evaluation of the run", in_name=False)


# The paper's Atari settings: kzl's atari/run_dt_atari.py#L79-L87 (6 x 128, 8 heads, lr 6e-4,
# 512 x 20 warmup tokens = 3 steps) and atari/run.sh#L4: 5 epochs of 500k steps of 1% DQN-replay,
# 3906 steps an epoch, an evaluation after each; Pong (run.sh#L14) with K=50 and batch 512, 977
# steps an epoch. Departure 5: lr_decay's cosine is 0.1 + 0.9 * (1 + cos) / 2, reaching 0.1 at
# --steps; kzl's is max(0.1, (1 + cos) / 2), higher through the middle of training, counted in
# tokens and clipped from about step 18.6k of 19.5k (atari/mingpt/trainer_atari.py#L116-L124,
# atari/run_dt_atari.py#L85-L86). --preset cpu: hopper in minutes on 2 cores, the lr decayed so
# that the last checkpoint is settled; mazes at K=1 without dropout (noisy actions are a history to
# copy); Atari cut where the return stops rising (README).
PRESETS = {
    "": dict(atari=dict(n_layer=6, n_head=8, n_embd=128, context=30, batch_size=128, lr=6e-4,
                        beta2=0.95, weight_decay=0.1, grad_clip=1.0, warmup_steps=3, lr_decay=True,
                        steps=19_530, eval_every=3906, eval_episodes=10,
                        pong=dict(context=50, batch_size=512, warmup_steps=1, steps=4885,
                                  eval_every=977))),
    "cpu": dict(n_embd=64, n_layer=2, n_head=1, context=10, batch_size=64, lr=1e-3,
                warmup_steps=500, lr_decay=True, steps=6000, eval_every=2000, eval_episodes=10,
                mazes=dict(context=1, dropout=0.0, eval_episodes=50),
                atari=dict(n_embd=64, n_layer=2, n_head=4, context=8, batch_size=32, lr=6e-4,
                           warmup_steps=100, steps=4000, eval_every=2000, eval_episodes=10,
                           dropout=0.1)),
}

# ---- the paper's pieces: data, model, schedule, loss, policy ----


def paper_settings(cfg, given):
    """This file's flags checked (the paper's own rows are PRESETS) -> cfg."""
    if not 0 < cfg.top_fraction <= 1:
        raise data_lib.DataError(f"--top-fraction must lie in (0, 1], got {cfg.top_fraction}")
    if cfg.state_encoder not in ("conv", "patch"):
        raise data_lib.DataError(f"unknown --state-encoder '{cfg.state_encoder}'; use conv or "
                                 f"patch")
    return cfg


def load_dataset(cfg):
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    # %BC (Sec. 5.3): the best episodes by return, up to this share of the steps; the state
    # statistics stay the full data's
    return d.keep_top(cfg.top_fraction) if cfg.top_fraction < 1 else d


def build_model(cfg, info):
    """The model the data's spaces call for: Atari's for discrete actions, else the gym one."""
    model_cfg = DTConfig(**{f.name: getattr(cfg, f.name) for f in fields(DTConfig)})
    if info.get("discrete"):
        return AtariDecisionTransformer(model_cfg, info["act_dim"], info["max_ep_len"])
    return DecisionTransformer(model_cfg, info["obs_dim"], info["act_dim"], info["max_ep_len"])


def param_groups(model, cfg):
    """AdamW's parameter groups. kzl's gym code decays every parameter
    (gym/experiment.py#L237-L241); its Atari code only the weights of linear and conv layers
    (atari/mingpt/model_atari.py#L181-L214)."""
    if not isinstance(model, AtariDecisionTransformer):
        return [{"params": list(model.parameters())}]

    matrices = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
    decay = [p for p in model.parameters() if id(p) in matrices]
    rest = [p for p in model.parameters() if id(p) not in matrices]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0}]


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup, then constant (kzl gym/experiment.py#L242-L245),
    or with --lr-decay a cosine down to 0.1 (Atari: departure 5)."""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def loss_fn(model, batch, cfg):
    b = batch
    pred = model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])  # (B, K, act)

    if b["actions"].dtype == torch.int64:
        # Sec. 3: cross-entropy for discrete actions (Atari), on the logits
        err = F.cross_entropy(pred.float().flatten(0, 1), b["actions"].flatten(), reduction="none")
        err = err.view_as(b["mask"])  # (B, K)
    else:
        # Sec. 3: mean-squared error (kzl gym/decision_transformer/training/seq_trainer.py#L18-L25)
        err = ((pred.float() - b["actions"]) ** 2).mean(-1)  # (B, K)

    return (err * b["mask"]).sum() / b["mask"].sum()  # real steps only


def policy(model, cfg):
    """Alg. 1's action: the live envs' contexts -> the current step's action (Atari: logits)."""
    def act(b, live):
        return model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])[:, -1]
    return act


def rollout(cfg):
    """How evaluate.py runs the policy: the context it keeps; Atari: greedy or sampled actions."""
    return dict(context=cfg.context, greedy=cfg.greedy)


def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the paper's (BC: none)."""
    if not cfg.return_token:
        return [None]
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
    ev.check_data(cfg, d, atari=True)  # a context or target that means nothing for this data
    device, info = ev.pick_device(cfg.device), d.info()

    # one step's memory, from shapes alone, before anything is allocated
    need = ev.check_memory(lambda: build_model(cfg, info), lambda m, b: loss_fn(m, b, cfg),
                           d.sample(2, cfg.context, np.random.default_rng(0)), cfg.batch_size,
                           device)

    # the model, the optimiser and the schedule
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(param_groups(model, cfg), lr=cfg.lr, betas=(0.9, cfg.beta2),
                            weight_decay=cfg.weight_decay, fused=True)  # one kernel, not a loop
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    rng = np.random.default_rng(cfg.seed)  # draws the training windows

    # open the run, or with --resume restore all of the above as the run left it
    step = run.start(cfg, model, opt, sched, rng, d, info, need)
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)
    results = None
    with ev.StopSignal(run.saves) as stop:  # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = d.sample(cfg.batch_size, cfg.context, rng)
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


def bench_eval(cfg, given):
    """--bench-eval: 10 episodes of the run's checkpoint, batched against sequential."""
    cfg, model, d, _ = load_model(cfg, given)
    act = policy(model.cpu(), cfg)
    ev.compare_with_sequential(act, d, 10, targets(cfg, d)[0], cfg.seed, cfg.context)


ANALYSES = {"bench_eval": bench_eval}

# ---- what the plumbing needs that no paper says: the script, its log's columns, its tokens ----

SCRIPT = "dt"
LOG_COLUMNS = ()


def batch_tokens(cfg):
    """Tokens in one training batch, for --bench's tokens/s."""
    return (3 if cfg.return_token else 2) * cfg.context * cfg.batch_size

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
