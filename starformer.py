"""
StARformer (Shang & Ryoo, "StARformer: Transformer with State-Action-Reward Representations", ICLR 2022 submission;
later ECCV 2022 "...for Visual Reinforcement Learning"). Official code (atari_and_dmc/ for Atari, gym/ for Gym):
https://github.com/elicassion/StARformer/blob/c4a537e5eac5ff302b8447f5d7ed3bf8b99ee1f5/atari_and_dmc/starformer.py#L190

Each timestep's group (a_{t-1}, r_{t-1}, s_t) goes through a Step Transformer (no mask; one token per state
dimension, or per image patch), which makes a StAR representation g_t^l at every layer l. A causal Sequence
Transformer reads {g_1^l, h_1^{l-1}, ..., g_T^l, h_T^{l-1}}, where h_t is a whole-state token, keeps only the h tokens
after each layer, and predicts a_t from the last layer's h_t. It conditions on the previous step-wise reward r_{t-1},
not on a return-to-go: by default there is no target return.

    python starformer.py --env hopper-expert                   # paper Table-6 sizes (3.9M parameters), 100k steps
    python starformer.py --env hopper-expert --preset code     # the official gym code's sizes (0.7M)
    MINARI_DATASETS_PATH=<folder of local datasets> python starformer.py --dataset replica/hopper/medium-v0 --preset cpu
    python starformer.py --dataset dqn-replay/breakout/1pct-v0        # Atari: the image model, Table 6 + official code
    python starformer.py --out <run folder> --target-sweep     # a --reward-input rtg run: DT's Fig. 4 (never trains)

The paper's Gym numbers (Table 1) are on D4RL's expert data (its Hopper statistics, 3511 +- 328.6, are expert-v2's),
though its text says sub-optimal: compare with --env {hopper,halfcheetah,walker2d}-expert. Its variants, each a flag:
    --no-reward-token     Table 1, imitation: the Step group is (a_{t-1}, s_t), n = n_state + 1 tokens, no rewards
    --reward-input rtg    Table 2: R_t in the reward slot, with a target return; not the "SF RTG" row (departure 14)
    --state-token none    Table 3, "w/o conv": no h^0; h^l = F_seq^l(h^{l-1} + g^l) from h^0 = 0 (official 'xconv')
    --state-token patch   Table 3, "conv -> ViT": h^0 from a second patch embedding (official 'vit')
    --connection fusion   Table 4, "Fusion": h^l = F_seq^l(h^{l-1} + g^l), T tokens (official 'fusion')
    --connection stack    Table 4, "Stack": L Step layers, then g^L (beside h^0) through L Sequence layers
(Table 3 is in the imitation setting: add --no-reward-token. Table 5's "DT with ViT" is a DT variant, and Fig. 3 is
--context 10/20/30 on Atari, 5/10/15/20 on Gym.) Atari data (image states, discrete actions) gets the image model:
7x7 patches of the 4x84x84 frames, h^0 from DQN's conv torso, the action as an embedding, logits, cross-entropy.

Glossary (paper symbol -> code name, shape; B and mask as in dt.py):
    T          context: the timesteps the model sees                      Config.context
    L          layers of the Step and of the Sequence Transformer, paired Config.n_layer
    d, D       Step ("short-term") and Sequence ("long-term") widths      Config.step_embd, Config.n_embd
    s_t        state, normalised by the dataset's mean and std            states (B, T, obs_dim) [image: (B, T, c, H, W)
               (Atari: the last 4 84x84 frames, uint8, / 255 in the model)  uint8]
    a_{t-1}    previous action; a_0 = null (-10 per dim, or index |A|)    prev_a (B, T, act_dim) [discrete: (B, T) long]
    r_{t-1}    previous step-wise reward; r_0 = 0                         prev_r (B, T, 1)
    R_t        return-to-go (times return_scale), --reward-input rtg     rtg (B, T, 1)
    n_state    state tokens per group: obs_dim, or (H/p)(W/p) patches     n_state
    n          tokens per group: n_state + 2 (+ 1 without reward tokens)  n_tok
    z_{s_t^i}  state token of dimension/patch i, FC(s_t^i) + e_i^spatial  embed_patch(.) + e_spatial (B, T, n_state, d)
    z_{a_{t-1}}, z_{r_{t-1}}  action token FC(a), reward token Tanh(FC(r))  embed_action, embed_reward (B, T, 1, d)
    Z_t^l      group t's Step Transformer tokens after layer l (Z^0: input) Z (B, T, n, d)
    e^temporal learned temporal embedding, shared by g^l (all l) and h^0  e_temporal (T, D)
    g_t^l      StAR representation FC([Z_t^l]) + e_t^temporal            g (B, T, D)
    h_t^l      integrated state token; h_t^0 = FC(s_t) or Conv(s_t) + e_t h (B, T, D)
    phi        prediction head, a_t = phi(h_t^L)                          predict_action

One layer l at one timestep t:
    Step Transformer   (no mask)   over Z_t^{l-1} = {z_{a_{t-1}}, z_{r_{t-1}}, z_{s_t^1..n_state}} -> Z_t^l  Sec. 3.2.2
    StAR representation            g_t^l = FC([Z_t^l]) + e_t^temporal                     -> (D,)        Sec. 3.2.2
    Sequence Transformer (causal)  over {g_1^l, h_1^{l-1}, ..., g_T^l, h_T^{l-1}}         -> keep h      Eq. (2)
    action                         a_t = Tanh(FC(h_t^L)) (Gym) or logits (Atari)                         Sec. 3.3.3

Layout: Config -> the model (copy it alone) -> the paper's pieces -> train(), as in dt.py -> --gif, --bench, main().

Departures from the paper and the official code (#Lnn alone: a line of atari_and_dmc/starformer.py above):
 1. Gym: lr 1e-4, decay 1e-4, clip 0.25, 10k warmup, as the official gym code (gym/experiment.py#L365); Table 6's
    6e-4 / 0.1 / 1.0 are DT's Atari values (the paper keeps DT's settings otherwise, A.3) and serve Atari here.
 2. Gym sizes are Table 6's, which the paper does not limit to Atari; the official gym code's smaller ones
    (gym/experiment.py#L280) are --preset code.
 3. The Step group is (a, r, s^1..n) as the paper writes it; the code puts r last (#L112), permuting FC_l's weights.
 4. The null action and r_0 = 0 fill an episode's first group only, as in evaluation; the official Atari code gives
    them to every training window's first group (atari_and_dmc/run_star_atari.py#L138).
 5. Group t holds r_{t-1} in training as in evaluation; the official gym code trains on r_t, the consequence of the
    target a_t (gym/experiment.py#L184), and evaluates on r_{t-1}.
 6. e^temporal counts from a window's first real step and padding is masked out of the Sequence attention, so a
    left-padded window gives what the unpadded one gives; the code indexes e^temporal by window slot (#L115), and
    the gym code ignores the attention_mask it is given (gym/models/starformer.py#L345).
 7. The causal mask leaves out the code's loop mask[i, i-1] = 1 (#L153): besides no-ops it only sets mask[0, -1], in
    a g row that is dropped.
 8. g^l = LN(FC(LN(Z_t^l))) + e_t with the code's LayerNorms (#L173), where the paper writes FC alone: cheap, and
    they steady a 9,344 -> 192 projection at Atari sizes.
 9. h^0 = FC(s_t) is one Linear, as the gym code (gym/models/starformer.py#L156); the paper says "multiple
    fully-connected layers" (--state-mlp).
10. --connection fusion keeps g^l's e_t (Sec. 3.2.2); the code's 'fusion' adds e_t through h^0 only (#L175), so
    there the variant changes more than the connection.
11. --connection stack keeps h^0, which Fig. 4's caption names, and the LayerNorm before FC, so Table 4 changes the
    connection alone; the code's 'stack' drops both (#L303).
12. Weights are N(0, 0.02), biases 0, in every Linear, Conv2d and Embedding (minGPT's rule); the code draws Linear
    weights from trunc_normal_(std=0.02) cut at +-2 (100 std: the same) and keeps PyTorch's defaults for Conv2d and
    the Atari action Embedding, N(0, 1) (#L277).
13. Atari rewards enter as the data holds them in training (DQN-replay's are clipped to [-1, 1]) and raw in
    evaluation; the official Atari code clamps training rewards to [0, 1] (atari_and_dmc/run_star_atari.py#L390),
    erasing Pong's and Boxing's -1, and feeds raw rewards in evaluation (run_star_atari.py#L229).
14. --reward-input rtg is the true R_t with a target (Breakout 90); Table 2's "SF RTG" row is the official code's
    clamp(R_t, 0, 1) (run_star_atari.py#L390), summed one step into the next episode (utils.py#L195, an off-by-one),
    prompted with 0 (run_star_atari.py#L175): a different variant, which no flag here gives.
"""
import math
from dataclasses import dataclass, field

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
    # --- the paper's settings (what is trained): data, optimisation, the model (Table 6), the variants (Tables 1-4)
    delayed_reward: bool = arg(False, "rewards paid at an episode's last step, in data and evaluation (DT Table 5)")
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "T, the number of timesteps the model sees (Sec. 5.1: 20 for Gym, 30 for Atari)")
    # Gym: DT-Gym optimisation, as the official gym code (departure 1); Atari: ATARI below
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay (Linear and Conv weights only)")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant")
    lr_decay: bool = arg(False, "after warmup, a cosine to a tenth of --lr at --steps (official Atari code, as dt.py)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine; 'code': the official gym code's sizes")
    amp: bool = arg(False, "bf16 autocast for the forward pass (for CUDA; the loss is reduced in fp32)")
    # Table 6 (it labels both Transformers "long-term"; the code: Sequence 8 heads / 192, Step 4 heads / 64)
    n_layer: int = arg(6, "L, layers of the Step and of the Sequence Transformer (paired layer by layer)")
    n_embd: int = arg(192, "D, Sequence Transformer width")
    n_head: int = arg(8, "Sequence Transformer heads")
    step_embd: int = arg(64, "d, Step Transformer width")
    step_head: int = arg(4, "Step Transformer heads")
    dropout: float = arg(0.1, "dropout on tokens, attention and residuals")
    state_mlp: bool = arg(False, "h^0 = 2-layer MLP(s_t) (Sec. 3.3.1), not one Linear (code; departure 9)")
    reward_scale: float = arg(1.0, "the reward slot gets Tanh(FC(reward_scale * r)); 1 = raw rewards, as the code")
    patch_size: int = arg(7, "image states: p x p patches (7 on 4x84x84 -> 144 tokens, official Atari code)")
    reward_token: bool = arg(True, "r_{t-1} tokens; --no-reward-token: groups (a_{t-1}, s_t), Table 1's imitation")
    prev_action: bool = arg(True, "a_{t-1} in each group; --no-prev-action: every group gets the null action a_0")
    reward_input: str = arg("reward", "group t's reward slot: reward (r_{t-1}, the method) | rtg (R_t, departure 14)")
    state_token: str = arg("conv", "Table 3, h^0: conv (Conv(s_t) or FC(s_t), the method) | none ('w/o conv') | "
                                   "patch ('conv -> ViT')")
    connection: str = arg("layerwise", "Table 4, Step -> Sequence: layerwise (the method) | fusion | stack")
    # --- the run (seed, data, evaluation, output, device, analyses): these do not change what is trained
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)", run=True)
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env", run=True)
    seed: int = arg(0, "seed for sampling, initialisation and evaluation", run=True)
    steps: int = arg(100_000, "gradient steps (official gym code: 10 iterations x 10k)", run=True)
    eval_every: int = arg(10_000, "evaluate and checkpoint every this many steps and at the end (code: 10k)", run=True)
    eval_episodes: int = arg(100, "episodes per evaluation, run in parallel (official gym code: 100)", run=True)
    target_return: float = arg(None, "with --reward-input rtg: return-to-go prompt, raw units; default: the data's",
                               run=True)
    log_every: int = arg(100, "print and log the training loss every this many steps", run=True)
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", run=True)
    out: str = arg("", "output folder; default runs/starformer/<env>/<variant>/seed<N>", run=True)
    resume: bool = arg(False, "continue the run in the output folder (its settings come from its checkpoint)", run=True)
    compile: bool = arg(False, "torch.compile the model for training (same results within float tolerance)", run=True)
    bench: bool = arg(False, "time training steps (eager vs compiled, AMP on CUDA) on synthetic data; exit", run=True)
    gif: bool = arg(False, "write episode.gif: one evaluation episode of the checkpoint at its first target", run=True)
    target_sweep: bool = arg(False, "with --reward-input rtg: target_sweep.png (DT's Fig. 4), the return achieved at "
                                    "8 targets, from the data's lowest to above its best", run=True)
    greedy: bool = arg(False, "Atari: the argmax action, not a softmax draw as the code (greedy can stall)", run=True)

# Atari, the paper's setting (the preset ""): Table 6 (lr 6e-4, betas (0.9, 0.95), clip 1.0, decay 0.1; Config's
# sizes), T=30 (Sec. 5.1); where the paper is silent, the official Atari code: batch 64, 10 epochs over 1% DQN-replay's
# 500k steps (7,813 each) with 10 episodes after each, warmup over 512 x 20 tokens (6 steps of 64 x 30), a cosine to a
# tenth (the code clamps max(0.1, cos); lr_factor: 0.1 + 0.9 cos, as dt.py).
# elicassion/StARformer@c4a537e atari_and_dmc/run_star_atari.py#L415
ATARI = dict(context=30, batch_size=64, lr=6e-4, weight_decay=0.1, grad_clip=1.0, warmup_steps=6, lr_decay=True,
             steps=78_130, eval_every=7_813, eval_episodes=10)
# --preset cpu on Atari (replica/breakout/mixed-v0, one core, ~8 minutes): one Step head (SDPA's CPU kernel pays per
# head), no dropout, K=6; R_t in the reward slot (Table 2), as r_{t-1} cannot ask this mix of a controller and random
# play for the good episodes (it stayed below the data's median return). 2400 steps: 3600 scored 2 points more (30
# episodes of the last checkpoint, seeds 0-2: 34.6 against 32.4, within the noise) in half again the time.
ATARI_CPU = dict(n_layer=2, n_embd=64, n_head=4, step_embd=16, step_head=1, context=6, batch_size=32, lr=6e-4,
                 warmup_steps=100, steps=2400, eval_every=1200, eval_episodes=10, dropout=0.0, reward_input="rtg")
PRESETS = {
    "": dict(atari=ATARI),
    # A small StARformer for 2 CPU cores (dt.py's cpu budget): no dropout (~27% of a step), cosine decay to a settled
    # last checkpoint. Mazes: no noisy a_{t-1} to copy (medium-dense, seed 0: 2% reach the goal with it, 92% without)
    "cpu": dict(n_layer=2, n_embd=64, n_head=1, step_embd=16, step_head=2, context=10, batch_size=64, lr=1e-3,
                warmup_steps=500, lr_decay=True, steps=6000, eval_every=2000, eval_episodes=10, dropout=0.0,
                mazes=dict(prev_action=False, eval_episodes=50), atari=ATARI_CPU),
    # The official code's gym sizes (embed_dim 128, n_layer 3, n_head 1, local_D 16 / 4 heads):
    # elicassion/StARformer@c4a537e gym/experiment.py#L280
    "code": dict(n_layer=3, n_embd=128, n_head=1, step_embd=16, step_head=4),
}

# >>> model: begin (needs only torch, math and dataclasses: copy this block, with Config and arg above, into your code)
# Under --amp (bf16 autocast) the matrix products run in bf16; nothing here is a recurrence or a long sum.

class SelfAttention(nn.Module):
    """Multi-head self-attention (Sec. 2.1), causal only through the mask it is given: the Step Transformer gives
    none (full attention inside a group), the Sequence Transformer a causal one."""

    def __init__(self, width, n_head, dropout):
        super().__init__()
        assert width % n_head == 0, f"width {width} is not divisible by {n_head} heads"
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):
        N, S, W = x.shape
        q, k, v = self.c_attn(x).split(W, dim=2)                          # 3 x (N, S, W)
        q, k, v = (z.view(N, S, self.n_head, W // self.n_head).transpose(1, 2) for z in (q, k, v))  # (N, nh, S, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,   # Sec. 2.1: softmax(Q K^T / sqrt(hs)) V
                                           dropout_p=self.dropout if self.training else 0.0)  # (N, nh, S, hs)
        y = y.transpose(1, 2).contiguous().view(N, S, W)                   # (N, S, W)
        return self.resid_drop(self.c_proj(y))

class Block(nn.Module):
    """Pre-LN transformer layer, Sec. 2.1: Z' = MSA(LN(X)) + X ; Z = MLP(LN(Z')) + Z' (GELU, Table 6; 4x, code).
    elicassion/StARformer@c4a537e atari_and_dmc/starformer.py#L117"""

    def __init__(self, width, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, n_head, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))

    def forward(self, x, attn_mask=None):        # x (N, S, W); attn_mask bool (N, 1, S, S), True = may attend
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))

class StepSeqLayer(nn.Module):
    """One Step Transformer layer paired with one Sequence Transformer layer (Fig. 2a). project=False: a Step layer
    whose output reaches no Sequence layer (--connection stack, all but the last).
    elicassion/StARformer@c4a537e atari_and_dmc/starformer.py#L138"""

    def __init__(self, n_tok, d, D, step_head, seq_head, dropout, project=True):
        super().__init__()
        self.step = Block(d, step_head, dropout)                    # F_step^l: full attention inside a group
        if project:
            self.ln_tok = nn.LayerNorm(d)                           # the LayerNorms around FC: departure 8
            self.fc = nn.Linear(n_tok * d, D)                       # FC_l, one per layer: R^{n d} -> R^D
            self.ln_g = nn.LayerNorm(D)
        self.seq = Block(D, seq_head, dropout)                      # F_sequence^l: causal over the sequence

    def step_layer(self, Z):                     # Sec. 3.2.2: Z_t^l = F_step^l(Z_t^{l-1}), (B,T,n,d) -> (B,T,n,d)
        B, T, n, d = Z.shape
        return self.step(Z.reshape(B * T, n, d)).reshape(B, T, n, d)

    def star(self, Z, e_temp):                   # Sec. 3.2.2: g_t^l = FC([Z_t^l]) + e_t^temporal, -> (B,T,D)
        B, T, n, d = Z.shape
        return self.ln_g(self.fc(self.ln_tok(Z).reshape(B, T, n * d))) + e_temp

    def forward(self, Z, h, e_temp, seq_mask, interleave=True):  # Z (B,T,n,d), h (B,T,D), e_temp (B,T,D)
        Z = self.step_layer(Z)
        g = self.star(Z, e_temp)                                              # (B,T,D)
        if not interleave:      # Table 4 "Fusion" (and Table 3 "w/o conv", h^0 = 0): h^l = F_seq^l(h^{l-1} + g^l)
            return Z, self.seq(h + g, seq_mask)       # g^l keeps its e_t (departure 10); seq_mask (B,1,T,T)
        y = torch.stack([g, h], dim=2).reshape(g.shape[0], -1, g.shape[2])    # Eq. (2): g_1,h_1,g_2,h_2,... (B,2T,D)
        y = self.seq(y, seq_mask)                                             # Sec. 3.3.2: Y_out^l = F_seq^l(Y_in^l)
        return Z, y[:, 1::2]                    # Sec. 3.3.2: h_t^l = y_out;2t^l, the g slots are dropped (B,T,D)

class NatureCNN(nn.Module):
    """Mnih et al. (2015) encoder for integrated image-state tokens h^0 (Sec. 3.3.1; the code ends in Tanh).
    elicassion/StARformer@c4a537e atari_and_dmc/starformer.py#L91"""

    def __init__(self, image_shape, D):
        super().__init__()
        c, H, W = image_shape
        self.conv = nn.Sequential(nn.Conv2d(c, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                  nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, c, H, W)).shape[1]                # 3136 for 4x84x84
        self.fc = nn.Sequential(nn.Linear(flat, D), nn.Tanh())

    def forward(self, x):                        # (N, c, H, W) -> (N, D)
        return self.fc(self.conv(x))

class PatchState(nn.Module):
    """Table 3 "conv -> ViT": h^0 from a second patch embedding, not shared with the Step Transformer's (Sec. 5.4);
    as the official code's 'vit': each patch FC to d, the n_state tokens flattened, FC to D, Tanh.
    elicassion/StARformer@c4a537e atari_and_dmc/starformer.py#L83"""

    def __init__(self, patch_dim, n_state, d, D):
        super().__init__()
        self.embed = nn.Linear(patch_dim, d)
        self.fc = nn.Sequential(nn.Linear(n_state * d, D), nn.Tanh())

    def forward(self, patches):                  # (B, T, n_state, patch_dim) -> (B, T, D)
        return self.fc(self.embed(patches).flatten(2))

NULL_ACTION = -10.0   # Gym null action a_0 in every dimension, following DT (A.2)

def step_inputs(actions, rewards, timesteps, prev_action, prev_reward, null_action=NULL_ACTION):
    """(a_{t-1}, r_{t-1}) of every group (Sec. 2.2) from data.py's window: actions (B,T,A) [discrete: (B,T) long] and
    rewards (B,T,1) are its own a_t, r_t; prev_action (B,A) [(B,)], prev_reward (B,1) the step before it. An episode's
    first step (timesteps == 0; left padding only precedes one) gets the null action (-10 per dimension, or index |A|:
    data.py's 0 is Atari's NOOP) and r_0 = 0 (fn. 1, A.2; departure 4). -> prev_a (B,T,A) [(B,T)], prev_r (B,T,1)"""
    prev_a = torch.cat([prev_action.unsqueeze(1), actions[:, :-1]], dim=1)   # a_{t-1}: (B,T,A) [(B,T)]
    prev_r = torch.cat([prev_reward.unsqueeze(1), rewards[:, :-1]], dim=1)   # r_{t-1}: (B,T,1)
    start = timesteps == 0                                                   # (B,T) an episode's first step
    prev_a = torch.where(start.view(*start.shape, *([1] * (actions.dim() - 2))), null_action, prev_a)
    prev_r = torch.where(start.unsqueeze(-1), 0.0, prev_r)
    return prev_a, prev_r

def sequence_mask(real, n):
    """(B,T) real-step mask, n Sequence tokens per step (2: g_t, h_t interleaved; 1: one stream) -> (B,1,nT,nT):
    causal (Sec. 3.3.2: no token attends to a later timestep) and no padded key (departures 6, 7); every token may
    see itself so that no softmax row is empty."""
    key_ok = real.repeat_interleave(n, dim=1)                               # (B,nT)
    causal = torch.ones(key_ok.shape[1], key_ok.shape[1], dtype=torch.bool, device=real.device).tril()
    eye = torch.eye(key_ok.shape[1], dtype=torch.bool, device=real.device)
    return ((causal & key_ok[:, None, :]) | eye)[:, None]                   # (B,1,nT,nT)

class StARformer(nn.Module):
    """obs_shape: int (vector states, one token per dimension) or (c, H, W) (image states, uint8 frames, patch tokens).
    act_dim: action dimension (continuous: Tanh head, MSE) or number of discrete actions (discrete=True: logits head,
    cross-entropy; the null action is the extra index act_dim, A.2). Sec. 5.4's ablations (cfg.state_token, Table 3;
    cfg.connection, Table 4) are a few lines each, marked below."""

    def __init__(self, cfg, obs_shape, act_dim, discrete=False):
        super().__init__()
        self.image = not isinstance(obs_shape, int)
        self.reward_token, self.reward_input, self.reward_scale = cfg.reward_token, cfg.reward_input, cfg.reward_scale
        self.patch_size = cfg.patch_size
        self.null_action = act_dim if discrete else NULL_ACTION
        self.prev_action = cfg.prev_action
        self.state_token, self.connection = cfg.state_token, cfg.connection
        d, D = cfg.step_embd, cfg.n_embd
        # Sec. 3.2.1: state tokens z_{s_t^i} = FC(s_t^i) + e_i^spatial, one FC shared by all patches and all t
        if self.image:
            c, H, W = obs_shape
            p = cfg.patch_size
            assert H % p == 0 and W % p == 0, f"image {H}x{W} is not divisible into {p}x{p} patches"
            n_state, patch_dim = (H // p) * (W // p), c * p * p
            self.embed_patch = nn.Linear(patch_dim, d)                        # FC(Flatten(s_t^i)): R^{hwC} -> R^d
            self.embed_action = nn.Embedding(act_dim + 1, d)                  # FC on one-hot a; +1: null action (A.2)
        else:
            n_state, patch_dim = obs_shape, 1
            self.embed_patch = nn.Linear(1, d)                                # FC(s_t^i): R^1 -> R^d, per dimension
            self.embed_action = nn.Linear(act_dim, d)                         # Sec. 3.2.1: z_a = FC(a), whole action
        # Sec. 3.3.1: the integrated state token h^0 = Conv(s_t) (image) or FC(s_t) (vector) + e_t; Table 3's
        # ablations replace it by a second patch embedding ('patch') or drop it ('none': no embed_state)
        if self.state_token == "patch":
            self.embed_state = PatchState(patch_dim, n_state, d, D)
        elif self.state_token == "conv" and self.image:
            self.embed_state = NatureCNN(obs_shape, D)
        elif self.state_token == "conv":
            # one Linear, as the gym code; --state-mlp: the paper's "multiple fully-connected layers" (departure 9)
            self.embed_state = (nn.Sequential(nn.Linear(obs_shape, D), nn.GELU(), nn.Linear(D, D))
                                if cfg.state_mlp else nn.Linear(obs_shape, D))
        if self.reward_token:                                                 # absent in imitation (Table 1)
            self.embed_reward = nn.Sequential(nn.Linear(1, d), nn.Tanh())     # Sec. 3.2.1: z_r = Tanh(FC(r))
        self.n_tok = n_state + 1 + int(self.reward_token)                     # n: a, (r), n_state state tokens
        self.e_spatial = nn.Parameter(torch.zeros(n_state, d))                # shared over t, zero-init (code)
        # Sec. 3.3.1: "exactly the same" e^temporal on g^l (every l) and h^0; indexed by position in the window (code)
        self.e_temporal = nn.Parameter(torch.zeros(cfg.context, D))
        self.drop = nn.Dropout(cfg.dropout)                                   # on Z^0 and h^0 (code)
        # Table 4 "Stack": only the last Step layer's output is projected to g (one FC, not one per layer)
        stack = self.connection == "stack"
        self.blocks = nn.ModuleList(StepSeqLayer(self.n_tok, d, D, cfg.step_head, cfg.n_head, cfg.dropout,
                                                 project=not stack or i == cfg.n_layer - 1)
                                    for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(D)                                           # the code's LayerNorm before the head
        # Sec. 3.3.3, A.1: phi = Linear, then Tanh into [-1, 1] for continuous actions; logits for discrete ones
        self.predict_action = nn.Sequential(nn.Linear(D, act_dim), *([] if discrete else [nn.Tanh()]))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):   # N(0, 0.02), zero biases (minGPT); the code: trunc-normal 0.02 on Linear only, Conv2d at
        # PyTorch's default, the action Embedding N(0, 1) (departure 12)
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def patches(self, states):                   # Sec. 3.2.1: s_t -> its n_state patches, (B,T,n_state,patch_dim)
        if not self.image:
            return states.unsqueeze(-1)                                        # one "patch" per dimension (B,T,C,1)
        B, T, c, H, W = states.shape
        p = self.patch_size
        x = states.reshape(B * T, c, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)      # (BT,H/p,W/p,c,p,p)
        return x.reshape(B, T, (H // p) * (W // p), c * p * p)                            # flattened patches

    def forward(self, states, actions, rewards, rtg, timesteps, mask, prev_action, prev_reward):
        """One data.py window (its keys, in its order; model(**batch) works): states (B,T,obs) [or (B,T,c,H,W) uint8
        frames], actions (B,T,act) [discrete: (B,T) long], rewards (B,T,1), rtg (B,T,1) (read only with
        --reward-input rtg), timesteps, mask (B,T), prev_action (B,act) [(B,)], prev_reward (B,1) -> a_t for every t
        (B,T,act) (logits when discrete). Position t sees s_1..s_t, a_0..a_{t-1}, r_0..r_{t-1} (or R_1..R_t) only:
        a_t and r_t enter group t + 1."""
        B, T = states.shape[:2]
        if self.image:
            states = states.float() / 255.0                                    # uint8 frames -> [0, 1] (as the code)
        real = mask > 0                                                        # (B,T)
        # Temporal position counted from the first real step, so a left-padded window gives exactly what the
        # unpadded window gives (the paper's tau starts at s_1; departure 6)
        pos = (real.long().cumsum(1) - 1).clamp(min=0)                         # (B,T)
        e_temp = self.e_temporal[pos]                                          # (B,T,D)
        # Sec. 3.2.1: Z_t^0 = {z_{a_{t-1}}, z_{r_{t-1}}, z_{s_t^1..n}} (the paper's order; departure 3)
        prev_a, prev_r = step_inputs(actions, rewards, timesteps, prev_action, prev_reward, self.null_action)
        if not self.prev_action:   # --no-prev-action: every group holds the null action of an episode's first step
            prev_a = torch.full_like(prev_a, self.null_action)
        tokens = [self.embed_action(prev_a).unsqueeze(2)]                      # (B,T,1,d)
        if self.reward_token:
            # r as the data holds it; the official Atari code: training r clamped to [0, 1], raw in evaluation (dep. 13)
            r = rtg if self.reward_input == "rtg" else prev_r                  # Table 2 (not its row: departure 14)
            tokens.append(self.embed_reward(self.reward_scale * r).unsqueeze(2))  # (B,T,1,d)
        patches = self.patches(states)                                         # (B,T,n_state,patch_dim)
        Z = self.drop(torch.cat([*tokens, self.embed_patch(patches) + self.e_spatial], dim=2))   # (B,T,n,d)
        # Sec. 3.3.1: integrated state tokens h^0_t = Conv(s_t) (or FC(s_t)) + e_t^temporal
        if self.state_token == "none":   # Table 3 "w/o conv": no h^0; the Sequence stream starts at 0 (code 'xconv')
            h = torch.zeros_like(e_temp)
        elif self.state_token == "patch":                                      # Table 3 "conv -> ViT"
            h = self.drop(self.embed_state(patches) + e_temp)
        elif self.image:
            frames = states.reshape(B * T, *states.shape[2:]).contiguous(memory_format=torch.channels_last)
            h = self.drop(self.embed_state(frames).reshape(B, T, -1) + e_temp)  # (B,T,D); channels-last: faster convs
        else:
            h = self.drop(self.embed_state(states) + e_temp)                   # (B,T,D)
        # Eq. (2) interleaves g^l with h^{l-1}; without h^0 (Table 3 "w/o conv") and in Table 4's "Fusion" g is
        # summed into the one stream of h tokens instead (official code: 'xconv', 'fusion')
        interleave = self.state_token != "none" and self.connection != "fusion"
        seq_mask = sequence_mask(real, 2 if interleave else 1)                 # (B,1,2T,2T) or (B,1,T,T)
        if self.connection == "stack":
            # Table 4 "Stack" (Fig. 4b): all L Step layers first, then g^L enters the first Sequence layer only,
            # beside h^0 (departure 11), and L Sequence layers keep all 2T tokens
            for block in self.blocks:
                Z = block.step_layer(Z)
            y = self.blocks[-1].star(Z, e_temp)                                # g^L (B,T,D)
            if interleave:
                y = torch.stack([y, h], dim=2).reshape(B, 2 * T, -1)           # {g_1^L, h_1^0, ..., g_T^L, h_T^0}
            for block in self.blocks:
                y = block.seq(y, seq_mask)
            h = y[:, 1::2] if interleave else y                                # (B,T,D)
        else:
            for block in self.blocks:          # layer-wise (Fig. 2a): Step layer l feeds Sequence layer l
                Z, h = block(Z, h, e_temp, seq_mask, interleave)
        return self.predict_action(self.ln_f(h))                               # Sec. 3.3.3: a_t = phi(h_t^L) (B,T,act)

    def optim_groups(self, weight_decay):
        """Decay Linear/Conv weights only (minGPT / official code); not biases, LayerNorms, embeddings.
        elicassion/StARformer@c4a537e atari_and_dmc/starformer.py#L231"""
        decay = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        params = list(self.parameters())
        return [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]
# <<< model: end

# ----------------------------------------------------------------------------------------------------------------
# the paper's pieces: data, learning-rate schedule, loss, policy

SCRIPT = "starformer"
CHOICES = dict(reward_input=("reward", "rtg"), state_token=("conv", "none", "patch"),   # Tables 2, 3
               connection=("layerwise", "fusion", "stack"))                             # Table 4

def check_model(cfg):
    """StARformer's own flags (evaluate.check_flags has the common ones): one sentence about the first bad one."""
    for name in ("step_embd", "step_head", "patch_size"):
        if getattr(cfg, name) <= 0:
            raise data_lib.DataError(f"--{name.replace('_', '-')} must be a positive whole number, got "
                                     f"{getattr(cfg, name)}")
    for name, ok in CHOICES.items():
        if getattr(cfg, name) not in ok:
            raise data_lib.DataError(f"--{name.replace('_', '-')} must be one of {', '.join(ok)}, got "
                                     f"'{getattr(cfg, name)}'")
    for bad, why in (
            (cfg.step_embd % cfg.step_head, f"--step-head {cfg.step_head} does not divide --step-embd {cfg.step_embd}"),
            (cfg.reward_scale <= 0, f"--reward-scale must be > 0, got {cfg.reward_scale} (--no-reward-token drops the "
                                    f"rewards)"),
            # (the cpu preset's Atari setting reads R_t; its --no-reward-token run simply has no reward slot to fill)
            (cfg.reward_input == "rtg" and not cfg.reward_token and ev.preset_values(
                PRESETS, cfg.preset, cfg.dataset or cfg.env).get("reward_input") != "rtg",
             "--reward-input rtg needs the reward token; drop --no-reward-token"),
            (cfg.target_return is not None and (cfg.reward_input != "rtg" or not cfg.reward_token),
             "--target-return is read only with --reward-input rtg and the reward token (StARformer conditions on "
             "r_{t-1}, not on a target)"),
            (cfg.state_mlp and cfg.state_token != "conv", f"--state-mlp shapes the FC(s_t) of --state-token conv; "
                                                          f"--state-token {cfg.state_token} has none")):
        if bad:
            raise data_lib.DataError(why)

def check_model_data(cfg, d):
    """StARformer's flags that the data's kind rules out, in one sentence before the run folder is touched."""
    if d.family == "atari" and cfg.state_mlp:
        raise data_lib.DataError("--state-mlp shapes h^0 = FC(s_t) of vector states; on Atari h^0 is the DQN conv "
                                 "torso (Sec. 3.3.1)")
    if d.family == "atari" and (d.obs_shape[1] % cfg.patch_size or d.obs_shape[2] % cfg.patch_size):
        raise data_lib.DataError(f"--patch-size {cfg.patch_size} does not divide the {d.obs_shape[1]}x"
                                 f"{d.obs_shape[2]} frames into whole patches")

def build_model(cfg, info):
    """The model the data's spaces call for: the image model where info says discrete (Atari), else the vector one."""
    if info.get("discrete"):
        return StARformer(cfg, tuple(info["obs_shape"]), info["act_dim"], discrete=True)
    return StARformer(cfg, info["obs_dim"], info["act_dim"])

def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup, then constant, or with --lr-decay a cosine down to 0.1.
    elicassion/StARformer@c4a537e atari_and_dmc/run_star_atari.py#L156, gym/experiment.py#L309"""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

def predict(model, b):
    """A data.py / evaluate.py batch -> the predicted a_t at every position (B, K, act). Training and evaluation
    both come through here, so group t holds (a_{t-1}, r_{t-1}, s_t) in both (departure 5)."""
    return model(b["states"], b["actions"], b["rewards"], b["rtg"], b["timesteps"], b["mask"], b["prev_action"],
                 b["prev_reward"])

def loss_fn(model, batch, cfg):
    pred = predict(model, batch)                                                        # (B, K, act)
    if batch["actions"].dtype == torch.int64:     # Sec. 3.4: cross-entropy for a discrete action space, on the logits
        err = F.cross_entropy(pred.float().flatten(0, 1), batch["actions"].flatten(), reduction="none")  # (B * K,)
        err = err.view_as(batch["mask"])                                                                  # (B, K)
    else:                                         # Sec. 3.4: MSE for a continuous one
        err = ((pred.float() - batch["actions"]) ** 2).mean(-1)                                         # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()   # Sec. 3.4: averaged over the T (real) predictions

def policy(model):
    """For evaluate.evaluate: contexts -> the current step's action (Atari: logits, sampled, or argmax with --greedy).
    Group t holds r_{t-1} (Sec. 3.4): the current step's reward in the batch (0, unknown) is never read.
    elicassion/StARformer@c4a537e atari_and_dmc/run_star_atari.py#L62"""
    def act(batch, live):
        return predict(model, batch)[:, -1]
    return act

def targets(cfg, d):
    """--reward-input rtg: return-to-go prompts in raw units (--target-return, else DT's two per environment).
    With r_{t-1} input there is no target: [None] (log.csv's target column stays empty)."""
    if cfg.reward_input == "rtg" and cfg.reward_token:
        return [cfg.target_return] if cfg.target_return is not None else d.target_returns
    return [None]

def evaluate(model, d, cfg, device):
    """--eval-episodes episodes in parallel for each target (one, None, with r_{t-1} input). -> [(target, results)]"""
    model.eval()
    results = [(g, ev.evaluate(policy(model), d, cfg.eval_episodes, g, cfg.seed + 10_000, cfg.context, device,
                               greedy=cfg.greedy)) for g in targets(cfg, d)]
    model.train()
    return results

# ----------------------------------------------------------------------------------------------------------------
# training: dt.py's loop; StARformer's own are the model, AdamW's parameter groups and betas, and predict()

def train(cfg, run, d=None):
    """Train StARformer (or continue the run) and evaluate it. `run`: evaluate.Run (folder, log, checkpoint), or
    --bench's timer with synthetic data `d`. -> the first target's final evaluation (per-episode arrays)"""
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward) if d is None else d
    ev.check_data(cfg, d, atari=True)                               # a context or target that means nothing here
    check_model_data(cfg, d)
    device, info = ev.pick_device(cfg.device), d.info()
    template = d.sample(2, cfg.context, np.random.default_rng(0))
    with torch.device("meta"):                                      # one step's memory, from shapes, before allocating
        meta = build_model(cfg, info)
        need = ev.check_memory(meta, lambda b: loss_fn(meta, b, cfg), template, cfg.batch_size, device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(model.optim_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))   # Table 6 betas
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
    rng = np.random.default_rng(cfg.seed)                           # draws the training windows
    step = run.start(cfg, model, opt, sched, rng, d, info, need)    # --resume: all of the above as the run left it
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)   # --amp: bf16 forward pass
    results = None
    with ev.StopSignal() as stop:                                   # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = {k: v.to(device, non_blocking=True) for k, v in d.sample(cfg.batch_size, cfg.context, rng).items()}
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
# --gif and --target-sweep (read a run's checkpoint, never train), --bench (train() timed, synthetic data), main()

def load_model(cfg, given):
    """An analysis's run, from its checkpoint -> (its settings, its model in eval mode, its data, its folder)."""
    cfg, ck = ev.load_run(SCRIPT, cfg, given, PRESETS)
    model = build_model(cfg, ck["info"])
    model.load_state_dict(ck["model"])
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    return cfg, model.to(ev.pick_device(cfg.device)).eval(), d, ev.run_folder(SCRIPT, cfg, PRESETS)

def gif(cfg, given):
    """--gif: one evaluation episode of the run's checkpoint at its first target -> episode.gif (never trains)."""
    cfg, model, d, out = load_model(cfg, given)
    ev.episode_gif(policy(model), d, targets(cfg, d)[0], cfg.seed + 10_000, cfg.context,
                   next(model.parameters()).device, out, f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}", greedy=cfg.greedy)

def target_sweep(cfg, given):
    """--target-sweep (DT's Fig. 4), a --reward-input rtg run: its checkpoint at 8 targets from the data's lowest return
    to above its best, --eval-episodes each -> target_sweep.png and .csv (never trains)."""
    run_cfg = ev.load_run(SCRIPT, cfg, given, PRESETS)[0]
    if run_cfg.reward_input != "rtg" or not run_cfg.reward_token:
        raise data_lib.DataError("this run's model reads no return-to-go (it was trained without --reward-input rtg), "
                                 "so there is no target to sweep")
    cfg, model, d, out = load_model(cfg, given)
    device = next(model.parameters()).device
    ev.target_sweep(policy(model), d, cfg.eval_episodes, cfg.seed + 10_000, cfg.context, device, out,
                    f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}", greedy=cfg.greedy)

def bench(cfg):
    """--bench: train()'s steps timed, eager vs compiled (and + bf16 on CUDA), on synthetic data of hopper's shape, or
    Atari's where the dataset is Atari (the image model). Tokens: the Sequence Transformer's (g_t, h_t) per step."""
    length = max(200, 2 * cfg.context)
    d = (data_lib.synthetic_atari(length=length) if data_lib.is_atari(cfg.dataset or cfg.env) else
         data_lib.synthetic_data(obs_dim=11, act_dim=3, episodes=16, length=length))
    for mode_cfg, timer in ev.bench_modes(cfg, SCRIPT, ev.variant_name(cfg, PRESETS), 2 * cfg.context * cfg.batch_size):
        with timer:
            train(mode_cfg, timer, d)

def parse_flags(argv=None):
    return ev.parse_flags(Config, PRESETS, argv, f"{SCRIPT}.py", __doc__.split("\n\n")[1])

def main(argv=None):
    with ev.one_sentence_errors():
        cfg, given = parse_flags(argv)
        ev.check_flags(cfg, "bench", "gif", "target_sweep")         # every flag, before any work
        check_model(cfg)
        if cfg.bench:
            return bench(cfg)
        if cfg.gif or cfg.target_sweep:
            return (gif if cfg.gif else target_sweep)(cfg, given)
        with ev.Run(SCRIPT, cfg, given, PRESETS) as run:            # --resume: the run's own settings, in run.cfg
            return train(run.cfg, run)

if __name__ == "__main__":
    main()
