"""
StARformer (Shang & Ryoo, "StARformer: Transformer with State-Action-Reward Representations", ICLR
2022 submission; later ECCV 2022, "... for Visual Reinforcement Learning"). The official code ("the
code"; atari_and_dmc/ for Atari, gym/ for Gym):
https://github.com/elicassion/StARformer/blob/c4a537e5eac5ff302b8447f5d7ed3bf8b99ee1f5/atari_and_dmc/starformer.py#L190

Each timestep's group (a_{t-1}, r_{t-1}, s_t) goes through a Step Transformer (no mask; one token
per state dimension, or per image patch), which makes a StAR representation g_t^l at every layer l.
A causal Sequence Transformer reads {g_1^l, h_1^{l-1}, ..., g_T^l, h_T^{l-1}}, where h_t is a
whole-state token, keeps only the h tokens after each layer, and predicts a_t from the last layer's
h_t. It conditions on the step-wise reward r_{t-1}, not on a return-to-go: by default there is no
target.

    python starformer.py --env hopper-expert                # Table 6's sizes (3.9M parameters)
    python starformer.py --env hopper-expert --preset code  # the official gym code's sizes (0.7M)
    python starformer.py --env hopper-medium --preset cpu   # a small configuration for 2 cores
    python data.py make breakout-mixed                      # Atari data: made/breakout/mixed-v0
    python starformer.py --dataset made/breakout/mixed-v0 --preset cpu   # the image model
    python starformer.py --out <run folder> --target-sweep  # a --reward-input rtg run: DT's Fig. 4

The paper's Gym numbers (Table 1) are on D4RL's expert data (its Hopper statistics, 3511 +- 328.6,
are expert-v2's), though its text says sub-optimal: compare with --env hopper-expert (halfcheetah-,
walker2d-). Its variants, each a flag:
    --no-reward-token    Table 1, imitation: the group is (a_{t-1}, s_t), n = n_state + 1 tokens
    --reward-input rtg   Table 2: R_t in the reward slot, with a target; not "SF RTG" (departure 14)
    --state-token none   Table 3, "w/o conv": no h^0; h^l = F_seq^l(h^{l-1} + g^l) from h^0 = 0
    --state-token patch  Table 3, "conv -> ViT": h^0 from a second patch embedding
    --connection fusion  Table 4, "Fusion": h^l = F_seq^l(h^{l-1} + g^l), T tokens
    --connection stack   Table 4, "Stack": L Step layers, then g^L (beside h^0) through L others
(the code's 'xconv', 'vit', 'fusion', 'stack'; Table 3 is imitation: add --no-reward-token. Table
5's "DT with ViT" is dt.py --state-encoder patch; Fig. 3 is --context 10/20/30 on Atari, 5/10/15/20
on Gym.) Atari data (image states, discrete actions) gets the image model: 7x7 patches of the
4x84x84 frames, h^0 from DQN's conv torso, the action an embedding, logits, cross-entropy.

Glossary (paper symbol -> code name, shape; B and mask as in dt.py):
    T          context: the timesteps the model sees            Config.context
    L          layers of the Step and the Sequence Transformer  Config.n_layer
    d, D       Step and Sequence widths                         Config.step_embd, Config.n_embd
    s_t        state, normalised by the data's mean and std     states (B, T, obs_dim)
               Atari: the last 4 84x84 frames, uint8 (/ 255)    states (B, T, 4, 84, 84)
    a_{t-1}    previous action; a_0 = null (-10s; Atari: |A|)   prev_a (B, T, act_dim) [(B, T)]
    r_{t-1}    previous step-wise reward; r_0 = 0               prev_r (B, T, 1)
    R_t        return-to-go (scaled), --reward-input rtg        rtg (B, T, 1)
    n_state    state tokens: obs_dim, or (H/p)(W/p) patches     n_state
    n          tokens per group: n_state + 2 (without r: + 1)   n_tok
    z_{s_t^i}  state token i, FC(s_t^i) + e_i^spatial           (B, T, n_state, d)
    z_a, z_r   action token FC(a), reward token Tanh(FC(r))     embed_action, embed_reward
    Z_t^l      group t's Step tokens after layer l (Z^0: input) Z (B, T, n, d)
    e^temporal temporal embedding, on g^l (every l) and h^0     e_temporal (T, D)
    g_t^l      StAR representation FC([Z_t^l]) + e_t^temporal   g (B, T, D)
    h_t^l      integrated state token; h^0 = Conv(s) or FC(s)   h (B, T, D)
    phi        prediction head, a_t = phi(h_t^L)                predict_action

Layout: as dt.py's.

Departures from the paper and the official code (the detail at the line that says "departure N";
paths at the commit above; run_star_atari.py and
utils.py are atari_and_dmc/'s; a bare #Lnn is a line of the file named last in its item, else of
atari_and_dmc/starformer.py):
 1. Gym: lr 1e-4, decay 1e-4, 10k warmup (gym/experiment.py#L365-L367) and clip 0.25
    (gym/training/seq_trainer.py#L28), as the official gym code; Table 6's 6e-4 / 0.1 / 1.0 are
    DT's Atari values (the paper keeps DT's settings otherwise, A.3) and serve Atari here.
 2. Gym sizes are Table 6's, which the paper does not limit to Atari; the official gym code's
    smaller ones are --preset code (PRESETS).
 3. The Step group is (a, r, s^1..n) as the paper writes it; the code puts r last (#L112),
    permuting FC_l's weights.
 4. The null action and r_0 = 0 fill an episode's first group only, as in evaluation; the official
    Atari code gives them to every training window's first group (run_star_atari.py#L138-L139).
 5. Group t holds r_{t-1} in training as in evaluation; the official gym code trains on r_t, the
    consequence of the target a_t (gym/experiment.py#L184), and evaluates on r_{t-1}
    (gym/evaluation/evaluate_episodes.py#L133).
 6. e^temporal counts from a window's first real step and padding is masked out of the Sequence
    attention; the code indexes e^temporal by window slot (#L115), and the gym code ignores the
    attention_mask it is given (gym/models/starformer.py#L345).
 7. The causal mask leaves out the code's loop mask[i, i-1] = 1 (#L153-L154): besides no-ops it
    only sets mask[0, -1], in a g row that is dropped.
 8. g^l = LN(FC(LN(Z_t^l))) + e_t with the code's LayerNorms (#L173-L174, #L158-L161), where the
    paper writes FC alone: cheap, and they steady a 9,344 -> 192 projection at Atari sizes.
 9. h^0 = FC(s_t) is one Linear, as the gym code (gym/models/starformer.py#L156); the paper says
    "multiple fully-connected layers" (--state-mlp).
10. --connection fusion keeps g^l's e_t (Sec. 3.2.2); the code's 'fusion' adds e_t through h^0
    only (#L175-L178), so there the variant changes more than the connection.
11. --connection stack keeps h^0, which Fig. 4's caption names, and the LayerNorm before FC, so
    Table 4 changes the connection alone; the code's 'stack' drops both (#L104-L105, #L309).
12. Weights are N(0, 0.02), biases 0, in every Linear, Conv2d and Embedding (minGPT's rule); the
    code draws Linear weights from trunc_normal_(std=0.02) cut at +-2 (100 std: the same) and
    keeps PyTorch's defaults for Conv2d and the Atari action Embedding, N(0, 1) (#L277-L284).
13. Atari rewards enter as the data holds them in training (DQN-replay's are clipped to [-1, 1])
    and raw in evaluation; the official Atari code clamps training rewards to [0, 1]
    (run_star_atari.py#L390), erasing Pong's and Boxing's -1.
14. --reward-input rtg is the true R_t in group t, in training and evaluation, with a target
    (Breakout 90); Table 2's "SF RTG" row is the official code's clamped, shifted R_t, a variant
    that no flag here gives.
15. Atari: the window sampler and the evaluation frames are data.py's and evaluate.py's, which say
    how they differ from DT's official code (StARformer's copies: run_star_atari.py#L378-L393,
    #L261-L330).
"""
import math
from dataclasses import dataclass, field, fields

import numpy as np

import data as data_lib
import evaluate as ev


# >>> model: begin (copy this block alone, to "model: end", into any file: it needs only torch)
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class StARConfig:
    """The model's settings: Table 6's sizes, the method's choices (build_model: from Config)."""
    context: int = 20  # T: the rows of e^temporal (Sec. 5.1; Atari: 30)
    n_layer: int = 6  # L, Step and Sequence layers, paired
    n_embd: int = 192  # D, the Sequence Transformer's width
    n_head: int = 8  # the Sequence Transformer's heads
    step_embd: int = 64  # d, the Step Transformer's width
    step_head: int = 4
    dropout: float = 0.1  # on tokens, attention and residuals
    state_mlp: bool = False  # h^0 = a 2-layer MLP(s_t), not one Linear (departure 9)
    reward_scale: float = 1.0  # the reward slot gets Tanh(FC(reward_scale * r)); 1: raw (code)
    patch_size: int = 7  # image states: p x p patches
    # the variants (Tables 1-4)
    reward_token: bool = True  # False: Table 1's imitation, the group (a_{t-1}, s_t)
    prev_action: bool = True  # False: the null action in every group
    reward_input: str = "reward"  # the reward slot: reward (r_{t-1}) | rtg (Table 2's R_t)
    state_token: str = "conv"  # Table 3, h^0: conv (the method) | none | patch
    connection: str = "layerwise"  # Table 4: layerwise (the method) | fusion | stack


class SelfAttention(nn.Module):
    """Multi-head self-attention (Sec. 2.1), masked only by the mask it is given."""

    def __init__(self, width, n_head, dropout):
        super().__init__()
        assert width % n_head == 0, f"width {width} is not divisible by {n_head} heads"
        self.n_head, self.dropout = n_head, dropout
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):
        N, S, W = x.shape
        q, k, v = self.c_attn(x).split(W, dim=2)  # 3 x (N, S, W)
        q, k, v = (z.view(N, S, self.n_head, W // self.n_head).transpose(1, 2)
                   for z in (q, k, v))  # (N, nh, S, hs)

        # Sec. 2.1: softmax(Q K^T / sqrt(hs)) V
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout)
        y = y.transpose(1, 2).contiguous().view(N, S, W)  # (N, S, W)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """Pre-LN layer, Sec. 2.1: Z' = MSA(LN(X)) + X; Z = MLP(LN(Z')) + Z', the MLP 4x wide with GELU
    (Table 6; the code's #L117-L135)."""

    def __init__(self, width, n_head, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = SelfAttention(width, n_head, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x, attn_mask=None):
        """x (N, S, W); attn_mask bool (N, 1, S, S), True: may attend."""
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class Interleave:
    """Eq. (2): the Sequence Transformer reads g_1, h_1, g_2, h_2, ...; Sec. 3.3.2 keeps h_t, the
    output's 2t-th token, and drops the g slots."""
    n = 2  # Sequence tokens per step

    @staticmethod
    def join(g, h):
        return torch.stack([g, h], dim=2).flatten(1, 2)  # (B, T, D) x 2 -> (B, 2T, D)

    @staticmethod
    def split(y):
        return y[:, 1::2]  # (B, 2T, D) -> (B, T, D)


class StepSeqLayer(nn.Module):
    """One Step Transformer layer paired with one Sequence Transformer layer (Fig. 2a; the code's
    #L138-L186); tokens: how g^l meets h^{l-1} (Interleave or Fuse). project=False: a Step layer
    whose output reaches no Sequence layer (--connection stack, all but the last)."""

    def __init__(self, n_tok, d, D, step_head, seq_head, dropout, tokens=Interleave, project=True):
        super().__init__()
        self.tokens = tokens
        self.step = Block(d, step_head, dropout)  # F_step^l: full attention inside a group
        if project:
            self.ln_tok = nn.LayerNorm(d)  # the LayerNorms around FC: departure 8
            self.fc = nn.Linear(n_tok * d, D)  # FC_l, one per layer: R^{n d} -> R^D
            self.ln_g = nn.LayerNorm(D)
        self.seq = Block(D, seq_head, dropout)  # F_sequence^l: causal over the sequence

    def step_layer(self, Z):
        """Sec. 3.2.2: Z_t^l = F_step^l(Z_t^{l-1}), (B, T, n, d) -> (B, T, n, d)."""
        B, T, n, d = Z.shape
        return self.step(Z.reshape(B * T, n, d)).reshape(B, T, n, d)

    def star(self, Z, e_temp):
        """Sec. 3.2.2: g_t^l = FC([Z_t^l]) + e_t^temporal, (B, T, n, d) -> (B, T, D)."""
        B, T, n, d = Z.shape
        return self.ln_g(self.fc(self.ln_tok(Z).reshape(B, T, n * d))) + e_temp

    def forward(self, Z, h, e_temp, seq_mask):
        """Z (B, T, n, d), h and e_temp (B, T, D), seq_mask (B, 1, S, S) -> Z^l, h^l."""
        Z = self.step_layer(Z)
        g = self.star(Z, e_temp)  # (B, T, D)

        # Sec. 3.3.2: h^l = F_seq^l(g^l, h^{l-1}) joined as Eq. (2) (or Fusion) says
        return Z, self.tokens.split(self.seq(self.tokens.join(g, h), seq_mask))  # (B, T, D)


class NatureCNN(nn.Module):
    """Mnih et al. (2015)'s encoder for image h^0 (Sec. 3.3.1), ending in Tanh as the code's
    #L91-L94; one frame stack per timestep."""

    def __init__(self, image_shape, D):
        super().__init__()
        c, H, W = image_shape
        self.conv = nn.Sequential(nn.Conv2d(c, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2),
                                  nn.ReLU(), nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.Flatten())
        with torch.no_grad():
            flat = self.conv(torch.zeros(1, c, H, W)).shape[1]  # 3136 for 4x84x84
        self.fc = nn.Sequential(nn.Linear(flat, D), nn.Tanh())

    def forward(self, frames):
        """(B, T, c, H, W) in [0, 1] -> (B, T, D)."""
        B, T = frames.shape[:2]
        # channels-last: the same values, faster convolutions
        x = frames.reshape(B * T, *frames.shape[2:]).contiguous(memory_format=torch.channels_last)
        return self.fc(self.conv(x)).reshape(B, T, -1)  # (B, T, D)


NULL_ACTION = -10.0  # Gym's null action a_0 in every dimension, following DT (A.2)


def step_inputs(actions, rewards, timesteps, prev_action, prev_reward, null_action=NULL_ACTION):
    """(a_{t-1}, r_{t-1}) of every group (Sec. 2.2) from data.py's window: actions (B, T, A)
    [discrete: (B, T) long] and rewards (B, T, 1) are its a_t, r_t; prev_action (B, A) [(B,)] and
    prev_reward (B, 1) the step before it. An episode's first step (timesteps == 0; left padding
    only precedes one) gets the null action (index |A| on Atari, whose 0 is NOOP) and r_0 = 0
    (fn. 1, A.2; departure 4). -> prev_a (B, T, A) [(B, T)], prev_r (B, T, 1)"""
    prev_a = torch.cat([prev_action.unsqueeze(1), actions[:, :-1]], dim=1)  # a_{t-1}
    prev_r = torch.cat([prev_reward.unsqueeze(1), rewards[:, :-1]], dim=1)  # r_{t-1}: (B, T, 1)

    # an episode's first step
    start = timesteps == 0  # (B, T)
    prev_a = torch.where(start.view(*start.shape, *([1] * (actions.dim() - 2))), null_action,
                         prev_a)
    prev_r = torch.where(start.unsqueeze(-1), 0.0, prev_r)
    return prev_a, prev_r


def sequence_mask(real, n):
    """(B, T) real-step mask, n Sequence tokens per step (2: g_t, h_t interleaved; 1: one stream) ->
    (B, 1, nT, nT): causal (Sec. 3.3.2: no token attends to a later timestep) and no padded key
    (departures 6, 7); every token may see itself so that no softmax row is empty."""
    key_ok = real.repeat_interleave(n, dim=1)  # (B, nT)
    S = key_ok.shape[1]
    causal = torch.ones(S, S, dtype=torch.bool, device=real.device).tril()
    eye = torch.eye(S, dtype=torch.bool, device=real.device)
    return ((causal & key_ok[:, None, :]) | eye)[:, None]  # (B, 1, nT, nT)


class StARformer(nn.Module):
    """cfg: a StARConfig. obs_shape: int (vector states, one token per dimension) or (c, H, W)
    (image states, uint8 frames, patch tokens). act_dim: the action dimension (continuous: Tanh
    head, MSE) or the number of actions (discrete=True: logits, cross-entropy)."""

    def __init__(self, cfg, obs_shape, act_dim, discrete=False):
        super().__init__()
        self.image = not isinstance(obs_shape, int)
        self.reward_token, self.reward_input = cfg.reward_token, cfg.reward_input
        self.reward_scale, self.patch_size = cfg.reward_scale, cfg.patch_size
        self.null_action = act_dim if discrete else NULL_ACTION
        self.prev_action = cfg.prev_action
        d, D = cfg.step_embd, cfg.n_embd

        # Sec. 3.2.1: state tokens z_{s_t^i} = FC(s_t^i) + e_i^spatial, one FC for all patches and t
        if self.image:
            c, H, W = obs_shape
            p = cfg.patch_size
            assert H % p == 0 and W % p == 0, f"image {H}x{W} is not divisible into {p}x{p} patches"
            n_state, patch_dim = (H // p) * (W // p), c * p * p
            self.embed_patch = nn.Linear(patch_dim, d)  # FC(Flatten(s_t^i)): R^{hwC} -> R^d
            self.embed_action = nn.Embedding(act_dim + 1, d)  # FC of one-hot a; +1: null (A.2)
        else:
            n_state, patch_dim = obs_shape, 1
            self.embed_patch = nn.Linear(1, d)  # FC(s_t^i): R^1 -> R^d, per dimension
            self.embed_action = nn.Linear(act_dim, d)  # Sec. 3.2.1: z_a = FC(a), the whole action

        # Sec. 3.3.1: h^0's encoder; Table 3 replaces it ('patch') or drops it ('none')
        if cfg.state_token == "patch":
            self.embed_state = PatchState(patch_dim, n_state, d, D)
        elif cfg.state_token == "conv" and self.image:
            self.embed_state = NatureCNN(obs_shape, D)
        elif cfg.state_token == "conv":
            # one Linear, or --state-mlp (departure 9)
            self.embed_state = (nn.Sequential(nn.Linear(obs_shape, D), nn.GELU(), nn.Linear(D, D))
                                if cfg.state_mlp else nn.Linear(obs_shape, D))
        h0 = dict(conv=self.h0_conv, patch=self.h0_patch, none=self.h0_none)  # forward's h^0
        self.initial_h = h0[cfg.state_token]

        # the reward token, absent in imitation (Table 1), and the embeddings
        if self.reward_token:
            self.embed_reward = nn.Sequential(nn.Linear(1, d), nn.Tanh())  # z_r = Tanh(FC(r))
        self.n_tok = n_state + 1 + int(self.reward_token)  # n: a, (r), n_state state tokens
        self.e_spatial = nn.Parameter(torch.zeros(n_state, d))  # shared over t, zeros (code)
        # Sec. 3.3.1: "exactly the same" e^temporal on g^l and h^0
        self.e_temporal = nn.Parameter(torch.zeros(cfg.context, D))
        self.drop = nn.Dropout(cfg.dropout)  # on Z^0 and h^0 (code)

        # the layers: Eq. (2) interleaves g^l with h^{l-1}, Table 3's "w/o conv" and Table 4's
        # "Fusion" sum them; Table 4's "Stack" runs all Step layers before the Sequence layers
        fuse = cfg.state_token == "none" or cfg.connection == "fusion"
        self.tokens = Fuse if fuse else Interleave
        stack = cfg.connection == "stack"
        self.blocks = nn.ModuleList(
            StepSeqLayer(self.n_tok, d, D, cfg.step_head, cfg.n_head, cfg.dropout, self.tokens,
                         project=not stack or i == cfg.n_layer - 1) for i in range(cfg.n_layer))
        self.run_layers = self.stacked if stack else self.layerwise

        # the code's LayerNorm, then phi (Sec. 3.3.3, A.1): Linear, then Tanh for continuous actions
        self.ln_f = nn.LayerNorm(D)
        self.predict_action = nn.Sequential(nn.Linear(D, act_dim),
                                            *([] if discrete else [nn.Tanh()]))
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):
        # departure 12
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def patches(self, states):
        """Sec. 3.2.1: s_t -> its n_state patches; vectors: one per dimension."""
        if not self.image:
            return states.unsqueeze(-1)  # (B, T, C, 1)
        B, T, c, H, W = states.shape
        p = self.patch_size
        x = states.reshape(B * T, c, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, T, (H // p) * (W // p), c * p * p)  # (B, T, n_state, patch_dim)

    def forward(self, states, actions, rewards, rtg, timesteps, mask, prev_action, prev_reward):
        """One data.py window, its keys in its order (model(**batch) works; shapes as in
        step_inputs, rtg (B, T, 1)) -> a_t for every t, (B, T, act) (discrete: logits). Position t
        sees s_1..s_t, a_0..a_{t-1}, r_0..r_{t-1} (or R_1..R_t) only."""
        if self.image:
            states = states.float() / 255.0  # uint8 frames -> [0, 1], as the code
        real = mask > 0  # (B, T)
        # e^temporal counts from the first real step (the paper's tau starts at s_1; departure 6),
        # so a left-padded window gives what the unpadded one gives
        pos = (real.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        e_temp = self.e_temporal[pos]  # (B, T, D)

        # Sec. 3.2.1: Z_t^0 = {z_{a_{t-1}}, z_{r_{t-1}}, z_{s_t^1..n}} (the paper's order, dep. 3)
        prev_a, prev_r = step_inputs(actions, rewards, timesteps, prev_action, prev_reward,
                                     self.null_action)
        if not self.prev_action:  # --no-prev-action: the null action in every group
            prev_a = torch.full_like(prev_a, self.null_action)
        tokens = [self.embed_action(prev_a).unsqueeze(2)]  # (B, T, 1, d)
        if self.reward_token:
            # r as the data holds it (departure 13: the official Atari code clamps training
            # rewards to [0, 1] and feeds raw ones in evaluation, run_star_atari.py#L229); Table 2's
            # R_t (departure 14). The official code's "SF RTG" is clamp(R_t, 0, 1)
            # (run_star_atari.py#L390), summed one step into the next episode (utils.py#L195-L198,
            # an off-by-one), fed one step late in training (group t gets R_{t-1}, #L139) but not
            # in evaluation (#L211, #L249), prompted with 0 (#L175)
            r = rtg if self.reward_input == "rtg" else prev_r
            tokens.append(self.embed_reward(self.reward_scale * r).unsqueeze(2))  # (B, T, 1, d)

        # with the state tokens (Sec. 3.2.1), Z^0
        patches = self.patches(states)  # (B, T, n_state, patch_dim)
        Z = torch.cat([*tokens, self.embed_patch(patches) + self.e_spatial], dim=2)
        Z = self.drop(Z)  # (B, T, n, d)

        # Sec. 3.3.1: the integrated state tokens h^0 (Table 3: from patches, or none)
        h = self.initial_h(states, patches, e_temp)  # (B, T, D)

        # Sec. 3.3.2: L layers, the Sequence Transformer causal over the steps
        seq_mask = sequence_mask(real, self.tokens.n)  # (B, 1, 2T, 2T), Fuse: (B, 1, T, T)
        h = self.run_layers(Z, h, e_temp, seq_mask)  # h^L (B, T, D)

        # Sec. 3.3.3: a_t = phi(h_t^L)
        return self.predict_action(self.ln_f(h))  # (B, T, act)

    def h0_conv(self, states, patches, e_temp):
        """Sec. 3.3.1: h_t^0 = Conv(s_t) (vectors: FC(s_t)) + e_t^temporal."""
        return self.drop(self.embed_state(states) + e_temp)  # (B, T, D)

    def h0_patch(self, states, patches, e_temp):
        """Table 3 "conv -> ViT": h^0 from a second patch embedding."""
        return self.drop(self.embed_state(patches) + e_temp)  # (B, T, D)

    def h0_none(self, states, patches, e_temp):
        """Table 3 "w/o conv": no h^0, the Sequence stream starts at 0."""
        return torch.zeros_like(e_temp)  # (B, T, D)

    def layerwise(self, Z, h, e_temp, seq_mask):
        """Fig. 2a: Step layer l feeds Sequence layer l (Table 4 "Fusion" too, with Fuse)."""
        for block in self.blocks:
            Z, h = block(Z, h, e_temp, seq_mask)
        return h  # (B, T, D)

    def stacked(self, Z, h, e_temp, seq_mask):
        """Table 4 "Stack" (Fig. 4b): all L Step layers, then g^L beside h^0 (departure 11) through
        the L Sequence layers, no token dropped between them."""
        for block in self.blocks:
            Z = block.step_layer(Z)
        y = self.tokens.join(self.blocks[-1].star(Z, e_temp), h)  # g_1^L, h_1^0, ...: (B, 2T, D)
        for block in self.blocks:
            y = block.seq(y, seq_mask)
        return self.tokens.split(y)  # (B, T, D)

    def optim_groups(self, weight_decay):
        """AdamW's groups: decay on Linear and Conv2d weights only, not on biases, LayerNorms or
        embeddings (minGPT's rule, the code's #L240-L259)."""
        decay = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        params = list(self.parameters())
        return [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]


# ---- Tables 3-4's variants: g^l summed into h^{l-1} (Table 4 "Fusion", Table 3 "w/o conv"),
# and h^0 from a second patch embedding (Table 3 "conv -> ViT") ----

class Fuse:
    """Table 4 "Fusion" (and Table 3 "w/o conv", h^0 = 0): the Sequence Transformer reads
    h^{l-1} + g^l, T tokens, g^l with its e_t (departure 10)."""
    n = 1

    @staticmethod
    def join(g, h):
        return h + g  # (B, T, D)

    @staticmethod
    def split(y):
        return y  # (B, T, D)


class PatchState(nn.Module):
    """Table 3 "conv -> ViT": h^0 from a second patch embedding, not the Step Transformer's (Sec.
    5.4); as the code's 'vit' (#L83-L89): each patch FC to d, all flattened, FC to D, Tanh."""

    def __init__(self, patch_dim, n_state, d, D):
        super().__init__()
        self.embed = nn.Linear(patch_dim, d)
        self.fc = nn.Sequential(nn.Linear(n_state * d, D), nn.Tanh())

    def forward(self, patches):
        return self.fc(self.embed(patches).flatten(2))  # (B, T, n_state, patch_dim) -> (B, T, D)

# <<< model: end

# ---- the settings: Config (the paper's, then the run's flags) and PRESETS ----


def arg(default, help, in_name=True):
    """A Config field that is a flag; in_name=False: it changes nothing trained, so the run's
    variant name (its folder's) leaves it out."""
    return field(default=default, metadata={"help": help, "in_name": in_name})


@dataclass
class Config:
    # ---- the paper's settings (Table 6, Sec. 5.1, the code's gym defaults; Atari: PRESETS) ----
    steps: int = arg(100_000, "gradient steps", in_name=False)  # the gym code: 10 iterations x 10k
    delayed_reward: bool = arg(False, "each episode's rewards paid at its last step (DT's Table 5)")
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "T, the number of timesteps the model sees (Sec. 5.1; Atari: 30)")
    # Gym: as the gym code (departure 1)
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay (Linear and Conv weights only)")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant")
    lr_decay: bool = arg(False, "after warmup, a cosine to a tenth of --lr at --steps (Atari's)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    # Table 6 labels both Transformers "long-term"; the code's Sequence has 8 heads of 192, its
    # Step 4 of 64 (run_star_atari.py#L410-L411)
    n_layer: int = arg(6, "L, layers of the Step and of the Sequence Transformer, paired")
    n_embd: int = arg(192, "D, Sequence Transformer width")
    n_head: int = arg(8, "Sequence Transformer heads")
    step_embd: int = arg(64, "d, Step Transformer width")
    step_head: int = arg(4, "Step Transformer heads")
    dropout: float = arg(0.1, "dropout on tokens, attention and residuals")
    state_mlp: bool = arg(False, "h^0 = a 2-layer MLP(s_t) (Sec. 3.3.1), not one Linear (dep. 9)")
    reward_scale: float = arg(1.0, "the reward slot gets Tanh(FC(reward_scale * r)); 1: raw (code)")
    patch_size: int = arg(7, "image states: p x p patches (the code's 7: 144 of 4x84x84)")
    # the variants (Tables 1-4)
    reward_token: bool = arg(True, "r_{t-1} tokens; --no-reward-token: Table 1's imitation")
    prev_action: bool = arg(True, "a_{t-1} in each group; --no-prev-action: the null action in all")
    reward_input: str = arg("reward", "the reward slot: reward (r_{t-1}, the method) | rtg (R_t)")
    state_token: str = arg("conv", "Table 3, h^0: conv (the method) | none | patch")
    connection: str = arg("layerwise", "Table 4: layerwise (the method) | fusion | stack")
    # evaluation as the gym code's: every 10k steps, 100 episodes a target
    eval_every: int = arg(10_000, "evaluate and checkpoint every this many steps, and at the end",
                          in_name=False)
    eval_episodes: int = arg(100, "episodes per target return, run in parallel", in_name=False)
    greedy: bool = arg(False, "Atari: the argmax action, not the code's softmax draw",
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


# The paper's Atari settings: Table 6 (lr 6e-4, clip 1.0, decay 0.1; Config's sizes), T=30 (Sec.
# 5.1); where it is silent, the code's (atari_and_dmc/run.sh#L4): batch 64, 10 epochs of 500k steps
# of 1% DQN-replay (7,813 steps each), 10 episodes after each (run_star_atari.py#L199), warmup over
# 512 x 20 tokens (#L416: 6 steps of 64 x 30), then a cosine to a tenth (lr_factor). --preset cpu:
# dt.py's 2-core budget without dropout; mazes without a_{t-1}, a noisy history to copy; Atari with
# one Step head and Table 2's R_t, which finds the good episodes of the made mix (README).
PRESETS = {
    "": dict(atari=dict(context=30, batch_size=64, lr=6e-4, weight_decay=0.1, grad_clip=1.0,
                        warmup_steps=6, lr_decay=True, steps=78_130, eval_every=7_813,
                        eval_episodes=10)),
    "cpu": dict(n_layer=2, n_embd=64, n_head=1, step_embd=16, step_head=2, context=10,
                batch_size=64, lr=1e-3, warmup_steps=500, lr_decay=True, steps=6000,
                eval_every=2000, eval_episodes=10, dropout=0.0,
                mazes=dict(prev_action=False, eval_episodes=50),
                atari=dict(n_layer=2, n_embd=64, n_head=4, step_embd=16, step_head=1, context=6,
                           batch_size=32, lr=6e-4, warmup_steps=100, steps=2400, eval_every=1200,
                           eval_episodes=10, dropout=0.0, reward_input="rtg")),
    # the official gym code's sizes (gym/experiment.py#L281, #L360-L362)
    "code": dict(n_layer=3, n_embd=128, n_head=1, step_embd=16, step_head=4),
}

# ---- the paper's pieces: data, model, schedule, loss, policy ----

CHOICES = dict(reward_input=("reward", "rtg"), state_token=("conv", "none", "patch"),  # Tables 2, 3
               connection=("layerwise", "fusion", "stack"))  # Table 4


def paper_settings(cfg, given):
    """This file's flags checked (the paper's own rows are PRESETS) -> cfg."""
    for name in ("step_embd", "step_head", "patch_size"):
        if getattr(cfg, name) <= 0:
            raise data_lib.DataError(f"--{name.replace('_', '-')} must be a positive whole number, "
                                     f"got {getattr(cfg, name)}")

    for name, ok in CHOICES.items():
        if getattr(cfg, name) not in ok:
            raise data_lib.DataError(f"--{name.replace('_', '-')} must be one of {', '.join(ok)}, "
                                     f"got '{getattr(cfg, name)}'")

    # the settings together (the cpu preset's Atari R_t stands, unread, with --no-reward-token)
    rtg = cfg.reward_input == "rtg"
    for bad, why in (
            (cfg.step_embd % cfg.step_head,
             f"--step-head {cfg.step_head} does not divide --step-embd {cfg.step_embd}"),
            (cfg.reward_scale <= 0, f"--reward-scale must be > 0, got {cfg.reward_scale} "
                                    f"(--no-reward-token drops the rewards)"),
            (rtg and not cfg.reward_token and ev.preset_values(
                PRESETS, cfg.preset, cfg.dataset or cfg.env).get("reward_input") != "rtg",
             "--reward-input rtg needs the reward token; drop --no-reward-token"),
            (cfg.target_return is not None and not (rtg and cfg.reward_token),
             "--target-return is read only with --reward-input rtg and the reward token "
             "(StARformer conditions on r_{t-1}, not on a target)"),
            (cfg.state_mlp and cfg.state_token != "conv",
             f"--state-mlp shapes the FC(s_t) of --state-token conv; --state-token "
             f"{cfg.state_token} has none")):
        if bad:
            raise data_lib.DataError(why)
    return cfg


def check_model_data(cfg, d):
    """This file's flags that the data's kind rules out, before the run folder is touched."""
    if d.family == "atari" and cfg.state_mlp:
        raise data_lib.DataError("--state-mlp shapes h^0 = FC(s_t) of vector states; on Atari h^0 "
                                 "is the DQN conv torso (Sec. 3.3.1)")

    if d.family == "atari" and (d.obs_shape[1] % cfg.patch_size or d.obs_shape[2] % cfg.patch_size):
        raise data_lib.DataError(f"--patch-size {cfg.patch_size} does not divide the "
                                 f"{d.obs_shape[1]}x{d.obs_shape[2]} frames into whole patches")


def load_dataset(cfg):
    return data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)


def build_model(cfg, info):
    """The model the data's spaces call for: Atari's for discrete actions, else the gym one."""
    model_cfg = StARConfig(**{f.name: getattr(cfg, f.name) for f in fields(StARConfig)})
    if info.get("discrete"):
        return StARformer(model_cfg, tuple(info["obs_shape"]), info["act_dim"], discrete=True)
    return StARformer(model_cfg, info["obs_dim"], info["act_dim"])


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup, then constant (gym/experiment.py#L309-L312),
    or with --lr-decay a cosine down to 0.1 (dt.py's; the Atari code's is max(0.1, (1 + cos) / 2),
    run_star_atari.py#L156-L162)."""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def predict(model, b):
    """A data.py / evaluate.py batch -> a_t at every position (B, K, act): training and evaluation
    alike, so group t holds r_{t-1} in both (departure 5)."""
    return model(b["states"], b["actions"], b["rewards"], b["rtg"], b["timesteps"], b["mask"],
                 b["prev_action"], b["prev_reward"])


def loss_fn(model, batch, cfg):
    b = batch
    pred = predict(model, b)  # (B, K, act)
    if b["actions"].dtype == torch.int64:
        # Sec. 3.4: cross-entropy for discrete actions (Atari)
        err = F.cross_entropy(pred.float().flatten(0, 1), b["actions"].flatten(), reduction="none")
        err = err.view_as(b["mask"])  # (B, K)
    else:
        # Sec. 3.4: mean-squared error for continuous ones
        err = ((pred.float() - b["actions"]) ** 2).mean(-1)  # (B, K)
    return (err * b["mask"]).sum() / b["mask"].sum()  # Sec. 3.4: over the T (real) predictions


def policy(model, cfg):
    """The live envs' contexts -> the current step's action (Atari: logits, drawn from as the
    code's run_star_atari.py#L71-L72, #L247). Group t holds r_{t-1} (Sec. 3.4): the current
    step's reward in the batch (0, unknown) is never read."""
    def act(b, live):
        return predict(model, b)[:, -1]
    return act


def rollout(cfg):
    """How evaluate.py runs the policy: the context it keeps; Atari: greedy or sampled actions."""
    return dict(context=cfg.context, greedy=cfg.greedy)


def targets(cfg, d):
    """Return-to-go prompts, raw units, with --reward-input rtg: --target-return, else DT's; with
    r_{t-1} none: [None]."""
    if cfg.reward_input == "rtg" and cfg.reward_token:
        return [cfg.target_return] if cfg.target_return is not None else d.target_returns
    return [None]


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
    """Train the model of Sec. 3 and evaluate it (Sec. 3.4) -> the first target's final evaluation.
    run: the evaluate.Run that keeps the folder, log and checkpoint (--resume: restores them)."""
    d = load_dataset(cfg) if d is None else d
    ev.check_data(cfg, d, atari=True)  # a context or target that means nothing for this data
    check_model_data(cfg, d)
    device, info = ev.pick_device(cfg.device), d.info()

    # one step's memory, from shapes alone, before anything is allocated
    need = ev.check_memory(lambda: build_model(cfg, info), lambda m, b: loss_fn(m, b, cfg),
                           d.sample(2, cfg.context, np.random.default_rng(0)), cfg.batch_size,
                           device)

    # the model, the optimiser (Table 6's betas) and the schedule
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(model.optim_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))
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

            # log every --log-every steps; evaluate (Sec. 3.4) and checkpoint every --eval-every
            run.log(step, loss, sched.get_last_lr()[0])
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)
                run.save(step, model, opt, sched, rng, results)  # log.csv, ckpt.pt, curve.png

        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)

    # a run resumed at --steps evaluates its checkpoint
    return run.finish(results or evaluate(model, d, cfg, device))

# ---- this file's analyses: none beyond the shared ones ----

ANALYSES = {}

# ---- what the plumbing needs that no paper says: the script, its log's columns, its tokens ----

SCRIPT = "starformer"
LOG_COLUMNS = ()


def batch_tokens(cfg):
    """Tokens in one training batch, for --bench's tokens/s: the Sequence Transformer's g_t, h_t."""
    return 2 * cfg.context * cfg.batch_size

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
