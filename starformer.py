"""
StARformer (Shang & Ryoo, "StARformer: Transformer with State-Action-Reward Representations", ICLR 2022 submission;
later ECCV 2022 "...for Visual Reinforcement Learning"; official code github.com/elicassion/StARformer).

Each timestep's group (a_{t-1}, r_{t-1}, s_t) goes through a Step Transformer (no mask; one token per state
dimension, or per image patch), which makes a StAR representation g_t per layer. A causal Sequence Transformer reads
{g_1, h_1, ..., g_T, h_T}, where h_t is a whole-state token, keeps only the h tokens after each layer, and predicts
a_t from the last layer's h_t. It conditions on the previous step-wise reward r_{t-1}, not on a return-to-go: there
is no target return.

    python starformer.py --env hopper-medium                   # paper Table-6 sizes (3.9M parameters), 100k steps
    python starformer.py --env hopper-medium --preset code     # the official gym code's sizes (0.7M)
    MINARI_DATASETS_PATH=../shared/datasets python starformer.py --dataset replica/hopper/medium-v0 --preset cpu
    python starformer.py --preset cpu --bench                  # ms/step and parameters, random data

One layer l at one timestep t:
    Step Transformer   (no mask)   over G_t = {a_{t-1}, r_{t-1}, s_t^1 .. s_t^n}       -> Z_t^l      (Sec. 3.2.2)
    StAR representation            g_t^l = FC([Z_t^l]) + e_t^temporal                  -> (D,)       eq. (1)
    Sequence Transformer (causal)  over {g_1^l, h_1^{l-1}, ..., g_T^l, h_T^{l-1}}      -> keep h     eq. (2)
    action                         a_t = Tanh(FC(h_t^L)) (Gym) or logits (Atari)                     Sec. 3.3.3

Layout: Config (paper defaults) -> model (needs only torch: Block, StepSeqLayer, NatureCNN, StARformer,
step_inputs) -> train() -> analysis helpers (bench) -> main(). Outputs in runs/starformer/<env>/seed<N>/.
The image (Atari) variant is a model option (patch tokens + Nature-DQN encoder + discrete head), tested on random
frames; the DQN-Replay Atari data is not available here, so it is not trained by this script.
"""
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


def arg(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # data and run
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)")
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env")
    seed: int = arg(0, "seed for sampling, initialisation and evaluation")
    steps: int = arg(100_000, "gradient steps (official gym code: 10 iterations x 10k)")
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "T, the number of timesteps the model sees (paper Sec. 5.1: 20 for Gym, 30 for Atari)")
    # DT-Gym optimisation, as the official gym code: Table 6's 6e-4 / 0.1 / 1.0 are DT's *Atari* values (notes 7.3)
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay (Linear weights only)")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant")
    lr_decay: bool = arg(False, "after warmup, cosine-decay the lr to a tenth by --steps (official Atari code; as dt.py)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    eval_every: int = arg(10_000, "evaluate (and checkpoint) every this many steps, and at the end")
    eval_episodes: int = arg(10, "episodes per evaluation, run in parallel")
    log_every: int = arg(100, "print and log the training loss every this many steps")
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, mps")
    out: str = arg("", "output folder; default runs/starformer/<env>/seed<N>")
    resume: bool = arg(False, "continue from <out>/ckpt.pt")
    preset: str = arg("", "'cpu': small configuration for a 2-core machine; 'code': the official gym code's sizes")
    # model: paper Table 6 (Step = "short-term", Sequence = "long-term")
    n_layer: int = arg(6, "L, layers of the Step and of the Sequence Transformer (paired layer by layer)")
    n_embd: int = arg(192, "D, Sequence Transformer width")
    n_head: int = arg(8, "Sequence Transformer heads")
    step_embd: int = arg(64, "d, Step Transformer width")
    step_head: int = arg(4, "Step Transformer heads")
    dropout: float = arg(0.1, "dropout on tokens, attention and residuals")
    state_mlp: bool = arg(False, "h^0 = 2-layer MLP(s_t) (paper: 'multiple FC layers') instead of Linear (code)")
    reward_scale: float = arg(1.0, "r_{t-1} enters as Tanh(FC(reward_scale * r)); 1 = raw rewards, as the code")
    patch_size: int = arg(7, "image states: p x p patches (7 on 4x84x84 -> 144 tokens, official Atari code)")
    bench: bool = arg(False, "time training steps on random data (this config), print ms/step and parameters, exit")


PRESETS = {
    # Small StARformer for a 2-core CPU, at the budget of dt.py's cpu preset (same steps, batch, context, lr, warmup):
    # 2 paired layers, D=64, d=16, T=10. No dropout: on CPU the Bernoulli masks cost ~27% of a step here, and
    # 6000 x 64 windows do not overfit a 300k-step dataset. Cosine decay so the reported last checkpoint is settled.
    "cpu": dict(n_layer=2, n_embd=64, n_head=1, step_embd=16, step_head=2, context=10, batch_size=64, lr=1e-3,
                warmup_steps=500, lr_decay=True, steps=6000, eval_every=2000, eval_episodes=10, dropout=0.0),
    # The official code's gym sizes (gym/experiment.py: embed_dim 128, n_layer 3, n_head 1, local_D 16 / 4 heads).
    "code": dict(n_layer=3, n_embd=128, n_head=1, step_embd=16, step_head=4),
}


# ----------------------------------------------------------------------------------------------------------------
# model: needs only torch


class Block(nn.Module):
    """Pre-LN transformer layer, paper Sec. 2.1: Z' = MSA(LN(X)) + X ; Z = MLP(LN(Z')) + Z' (GELU, 4x)."""

    def __init__(self, width, n_head, dropout):
        super().__init__()
        assert width % n_head == 0, f"width {width} is not divisible by {n_head} heads"
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width),
                                 nn.Dropout(dropout))
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x, attn_mask=None):        # x (N, S, W); attn_mask bool (N, 1, S, S), True = may attend
        N, S, W = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(W, dim=2)                       # 3 x (N, S, W)
        q, k, v = (t.view(N, S, self.n_head, W // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.dropout if self.training else 0.0)  # (N, H, S, W/H)
        y = y.transpose(1, 2).reshape(N, S, W)
        x = x + self.resid_drop(self.proj(y))
        return x + self.mlp(self.ln2(x))


class StepSeqLayer(nn.Module):
    """One Step Transformer layer paired with one Sequence Transformer layer (paper Fig. 2a)."""

    def __init__(self, n_tok, d, D, step_head, seq_head, dropout):
        super().__init__()
        self.step = Block(d, step_head, dropout)                    # full attention inside a step group
        self.ln_tok = nn.LayerNorm(d)                               # LNs around FC: official code (notes 7.5)
        self.fc = nn.Linear(n_tok * d, D)
        self.ln_g = nn.LayerNorm(D)
        self.seq = Block(D, seq_head, dropout)                      # causal over the interleaved 2T tokens

    def forward(self, Z, h, e_temp, seq_mask):   # Z (B,T,n,d), h (B,T,D), e_temp (B,T,D), seq_mask (B,1,2T,2T)
        B, T, n, d = Z.shape
        Z = self.step(Z.reshape(B * T, n, d)).reshape(B, T, n, d)             # Z_t^l = F_step^l(Z_t^{l-1})
        g = self.ln_g(self.fc(self.ln_tok(Z).reshape(B, T, n * d))) + e_temp  # eq. (1): g_t^l = FC([Z_t^l]) + e_t
        y = torch.stack([g, h], dim=2).reshape(B, 2 * T, -1)                  # eq. (2): g_1,h_1,g_2,h_2,... (B,2T,D)
        y = self.seq(y, seq_mask)                                             # F_seq^l, causal
        return Z, y[:, 1::2]                                                  # keep the h slots only (B,T,D)


class NatureCNN(nn.Module):
    """Mnih et al. (2015) encoder for integrated image-state tokens h^0 (paper Sec. 3.3.1; code ends in Tanh)."""

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


class StARformer(nn.Module):
    """
    obs_shape: int (vector states, one token per dimension) or (c, H, W) (image states, patch tokens).
    act_dim:   action dimension (continuous, Tanh head, MSE) or number of discrete actions (discrete=True,
               logits head, cross-entropy; the null action is the extra index act_dim, paper A.2).
    forward(states, prev_actions, prev_rewards, mask) -> (B, T, act_dim) actions (or logits) for every step t,
    where step t sees only s_1..s_t, a_0..a_{t-1}, r_0..r_{t-1}.
    """

    def __init__(self, cfg, obs_shape, act_dim, discrete=False):
        super().__init__()
        self.cfg, self.act_dim, self.discrete = cfg, act_dim, discrete
        self.image = not isinstance(obs_shape, int)
        d, D = cfg.step_embd, cfg.n_embd
        # Step-group tokens, Sec. 3.2.1
        if self.image:
            c, H, W = obs_shape
            p = cfg.patch_size
            assert H % p == 0 and W % p == 0, f"image {H}x{W} is not divisible into {p}x{p} patches"
            n_state = (H // p) * (W // p)
            self.state_tok = nn.Linear(c * p * p, d)                          # FC_patch, shared by all patches
            self.state_enc = NatureCNN(obs_shape, D)                          # integrated token, Sec. 3.3.1
            self.action_tok = nn.Embedding(act_dim + 1, d)                    # +1: null action (A.2)
        else:
            n_state = obs_shape
            self.state_tok = nn.Linear(1, d)                                  # FC_scalar: one token per state dim
            self.state_enc = (nn.Sequential(nn.Linear(obs_shape, D), nn.GELU(), nn.Linear(D, D))
                              if cfg.state_mlp else nn.Linear(obs_shape, D))
            self.action_tok = nn.Linear(act_dim, d)                           # one token for the whole action
        self.reward_tok = nn.Sequential(nn.Linear(1, d), nn.Tanh())           # z_r = Tanh(FC(r))
        self.e_spatial = nn.Parameter(torch.zeros(n_state, d))                # shared over t, zero-init (code)
        self.e_temporal = nn.Parameter(torch.zeros(cfg.context, D))           # shared by g^l (all l) and h^0
        self.drop_tok, self.drop_h = nn.Dropout(cfg.dropout), nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(StepSeqLayer(n_state + 2, d, D, cfg.step_head, cfg.n_head, cfg.dropout)
                                    for _ in range(cfg.n_layer))
        self.ln_head = nn.LayerNorm(D)
        self.head = nn.Linear(D, act_dim)                                     # phi, Sec. 3.3.3
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m):                        # minGPT / official code: N(0, 0.02) weights, zero biases
        if isinstance(m, (nn.Linear, nn.Conv2d, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def state_tokens(self, states):              # -> (B, T, n_state, d)
        if self.image:
            B, T, c, H, W = states.shape
            p = self.cfg.patch_size
            x = states.reshape(B * T, c, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)  # (BT,H/p,W/p,c,p,p)
            x = x.reshape(B, T, (H // p) * (W // p), c * p * p)                            # flatten patches
            return self.state_tok(x) + self.e_spatial
        return self.state_tok(states.unsqueeze(-1)) + self.e_spatial          # (B,T,C,1) -> (B,T,C,d)

    def forward(self, states, prev_actions, prev_rewards, mask=None):
        # states (B,T,C) or (B,T,c,H,W); prev_actions (B,T,A) float or (B,T) long; prev_rewards (B,T,1);
        # mask (B,T) 1 = real step, 0 = left padding (None: all real)
        B, T = states.shape[:2]
        if mask is None:
            mask = torch.ones(B, T, device=states.device)
        real = mask > 0                                                        # (B,T) bool
        # Temporal position counted from the first real step, so a left-padded window gives exactly what the
        # unpadded window gives (paper: tau starts at s_1; the code indexes by window slot and never pads Atari).
        pos = (real.long().cumsum(1) - 1).clamp(min=0)                         # (B,T)
        e_temp = self.e_temporal[pos]                                          # (B,T,D)
        # Step-group input Z^0_t = {z_{a_{t-1}}, z_{r_{t-1}}, z_{s_t^1..n}} (paper order; code puts r last)
        a_tok = self.action_tok(prev_actions).unsqueeze(2)                     # (B,T,1,d)
        r_tok = self.reward_tok(prev_rewards * self.cfg.reward_scale).unsqueeze(2)  # (B,T,1,d)
        Z = self.drop_tok(torch.cat([a_tok, r_tok, self.state_tokens(states)], dim=2))  # (B,T,n,d)
        # Integrated state tokens h^0_t = FC(s_t) (or Conv(s_t)) + e_t^temporal, Sec. 3.3.1
        if self.image:
            h = self.state_enc(states.reshape(B * T, *states.shape[2:])).reshape(B, T, -1)
        else:
            h = self.state_enc(states)
        h = self.drop_h(h + e_temp)                                            # (B,T,D)
        # Sequence mask over the 2T interleaved tokens: causal (paper Sec. 3.3.2: no token attends to a later
        # timestep) and no padded key; every token may see itself so padded rows are not all -inf (no NaN).
        # The official code's extra loop `mask[i, i-1] = 1` is left out: it only touches a discarded g row.
        causal = torch.tril(torch.ones(2 * T, 2 * T, dtype=torch.bool, device=states.device))  # (2T,2T)
        key_ok = real.repeat_interleave(2, dim=1)                              # (B,2T)
        eye = torch.eye(2 * T, dtype=torch.bool, device=states.device)
        seq_mask = ((causal & key_ok[:, None, :]) | eye).unsqueeze(1)          # (B,1,2T,2T)
        for layer in self.layers:
            Z, h = layer(Z, h, e_temp, seq_mask)
        out = self.head(self.ln_head(h))                                       # (B,T,act_dim)
        return out if self.discrete else torch.tanh(out)                      # Gym: actions in [-1, 1]

    def optim_groups(self, weight_decay):
        """Decay Linear/Conv weights only (minGPT / official code); not biases, LayerNorms, embeddings."""
        decay = {id(m.weight) for m in self.modules() if isinstance(m, (nn.Linear, nn.Conv2d))}
        params = list(self.parameters())
        return [{"params": [p for p in params if id(p) in decay], "weight_decay": weight_decay},
                {"params": [p for p in params if id(p) not in decay], "weight_decay": 0.0}]


NULL_ACTION = -10.0   # Gym null action a_0 in every dimension, following DT (paper A.2)


def step_inputs(actions, rewards, mask, timesteps, prev_action, prev_reward, n_actions=None):
    """
    The group inputs (a_{t-1}, r_{t-1}) of every step of a left-padded window (paper Sec. 2.2: group t is
    (a_{t-1}, r_{t-1}, s_t)). actions (B,T,A) [or (B,T) long], rewards (B,T,1): the window's own a_t, r_t;
    prev_action (B,A) [or (B,)], prev_reward (B,1): the step before the window's first real step.
    At an episode's first step (timesteps == 0) the group gets the null action and r_0 = 0 (paper fn. 1, A.2):
    -10 per dimension for continuous actions, the extra index n_actions for discrete ones.
    Returns prev_actions (B,T,A) [or (B,T) long], prev_rewards (B,T,1).
    """
    real = mask > 0                                                            # (B,T)
    first_real = real & ~torch.cat([torch.zeros_like(real[:, :1]), real[:, :-1]], dim=1)  # (B,T)
    shifted_a = torch.cat([prev_action.unsqueeze(1), actions[:, :-1]], dim=1)  # a_{t-1}: (B,T,...)
    shifted_r = torch.cat([prev_reward.unsqueeze(1), rewards[:, :-1]], dim=1)  # r_{t-1}: (B,T,1)
    fa = first_real.view(*first_real.shape, *([1] * (actions.dim() - 2)))
    prev_a = torch.where(fa, prev_action.unsqueeze(1).expand_as(shifted_a), shifted_a)
    prev_r = torch.where(first_real.unsqueeze(-1), prev_reward.unsqueeze(1).expand_as(shifted_r), shifted_r)
    start = real & (timesteps == 0)                                            # the episode's first step
    null = n_actions if n_actions is not None else NULL_ACTION
    prev_a = torch.where(start.view_as(fa), torch.full_like(prev_a, null), prev_a)
    prev_r = torch.where(start.unsqueeze(-1), torch.zeros_like(prev_r), prev_r)
    return prev_a, prev_r


# ----------------------------------------------------------------------------------------------------------------
# training, evaluation and the command line (everything below needs numpy and the project's data/evaluate)

import argparse  # noqa: E402
import math  # noqa: E402
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


def predict(model, batch):
    """A data.py / evaluate.py batch -> predicted a_t for every step (B, K, act). Training and evaluation both come
    through here, so step t is fed (a_{t-1}, r_{t-1}, s_t) in both (the official gym code trains on r_t instead)."""
    prev_a, prev_r = step_inputs(batch["actions"], batch["rewards"], batch["mask"], batch["timesteps"],
                                 batch["prev_action"], batch["prev_reward"])
    return model(batch["states"], prev_a, prev_r, batch["mask"])


def make_act(model):
    """The evaluate() policy: a batch of contexts -> the action predicted at the last (current) position. The
    current step's reward in the batch is 0 (unknown) and is never read: step t only uses r_{t-1}."""
    def act(batch, live):
        return predict(model, batch)[:, -1]
    return act


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup, then constant, or with --lr-decay a cosine down to 0.1."""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / cfg.warmup_steps, 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def loss_fn(model, batch):
    pred = predict(model, batch)                                               # (B, K, act)
    err = ((pred - batch["actions"]) ** 2).mean(-1)                            # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()   # MSE over real steps, averaged over T (Sec. 3.4)


LOG_FIELDS = ["step", "loss", "lr", "eval_return", "eval_return_std", "normalized_score", "normalized_score_std",
              "success_rate", "steps_to_goal", "wall_time"]


def plot_curve(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    train_rows = [r for r in rows if r.get("loss", "") != ""]
    ax1.plot([int(r["step"]) for r in train_rows], [float(r["loss"]) for r in train_rows])
    ax1.set(xlabel="step", ylabel="action MSE", yscale="log", title="training loss")
    ev = [r for r in rows if r.get("normalized_score", "") != ""]
    ax2.plot([int(r["step"]) for r in ev], [float(r["normalized_score"]) for r in ev], "o-")
    ax2.set(xlabel="step", ylabel="normalised score", title="evaluation")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_eval(model, d, cfg, device, seed):
    """StARformer has no return target: evaluate.py's rtg is built but never read (target_return=0)."""
    model.eval()
    res = eval_lib.evaluate(make_act(model), d, cfg.eval_episodes, 0.0, seed, cfg.context, device)
    model.train()
    return res


def train(cfg):
    device = pick_device(cfg.device)
    d = data_lib.load_data(cfg.dataset or cfg.env)
    name = (cfg.dataset or cfg.env).replace("/", "-")
    out = cfg.out or os.path.join("runs", "starformer", name, f"seed{cfg.seed}")
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "ckpt.pt")
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; "
          f"normalised with {d.ref_source}; device {device}")

    torch.manual_seed(cfg.seed)
    model = StARformer(cfg, d.obs_dim, d.act_dim).to(device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    opt = torch.optim.AdamW(model.optim_groups(cfg.weight_decay), lr=cfg.lr, betas=(0.9, 0.95))  # Table 6 betas
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))
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
                        state_std=torch.from_numpy(d.state_std), max_ep_len=d.max_ep_len,
                        dataset_id=d.dataset_id), ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)  # never leave a half-written checkpoint behind
        with open(os.path.join(out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS)
            w.writeheader()
            w.writerows(rows)

    last_eval, res = "", None
    t_log, losses = time.time(), []
    model.train()
    try:
        while step < cfg.steps:
            t0 = time.time()
            batch = {k: v.to(device) for k, v in d.sample(cfg.batch_size, cfg.context, rng).items()}
            loss = loss_fn(model, batch)
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
                rows.append(dict(step=step, loss=f"{np.mean(losses):.6f}", lr=f"{sched.get_last_lr()[0]:.3e}",
                                 wall_time=f"{wall:.1f}"))
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{ms:.1f} ms/step{last_eval}", flush=True)
                t_log, losses = time.time(), []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.time()
                res = run_eval(model, d, cfg, device, cfg.seed + 10_000)
                wall += time.time() - t0
                rows.append(dict(step=step, eval_return=f"{res['returns'].mean():.2f}",
                                 eval_return_std=f"{res['returns'].std():.2f}",
                                 normalized_score=f"{res['normalized'].mean():.2f}",
                                 normalized_score_std=f"{res['normalized'].std():.2f}",
                                 success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                                 steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                                 wall_time=f"{wall:.1f}"))
                print(f"eval step {step}: {eval_lib.summarize(res)} ({time.time() - t0:.0f}s)", flush=True)
                last_eval = f" | eval {res['normalized'].mean():.1f}"
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), f"starformer {d.dataset_id} seed {cfg.seed}")
                t_log = time.time()
    except KeyboardInterrupt:
        save()
        print(f"\ninterrupted at step {step}; checkpoint saved, continue with --resume")
        raise SystemExit(130)
    if res is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        res = run_eval(model, d, cfg, device, cfg.seed + 10_000)
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


# ----------------------------------------------------------------------------------------------------------------
# analysis helpers

def bench(cfg, obs_dim=11, act_dim=3, n=20):
    """--bench: ms per training step (forward, backward, AdamW) and per batched eval forward (10 envs), on random
    Hopper-shaped data; parameter counts beside dt.py's Decision Transformer at its paper size."""
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.device)
    model = StARformer(cfg, obs_dim, act_dim).to(device)
    B, T = cfg.batch_size, cfg.context
    s, a = torch.randn(B, T, obs_dim, device=device), torch.rand(B, T, act_dim, device=device) * 2 - 1
    r, mask = torch.randn(B, T, 1, device=device), torch.ones(B, T, device=device)
    opt = torch.optim.AdamW(model.optim_groups(cfg.weight_decay), lr=cfg.lr)
    times, cpu_times = [], []          # wall and process CPU time: on a shared machine the second is the honest one
    for i in range(n + 3):
        t0, c0 = time.time(), time.process_time()
        loss = ((model(s, a, r, mask) - a) ** 2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t0)
        cpu_times.append(time.process_time() - c0)
    model.eval()
    with torch.no_grad():
        t0 = time.time()
        for _ in range(n):
            model(s[:10], a[:10], r[:10], mask[:10])
        t_eval = (time.time() - t0) / n
    import dt
    dt_params = sum(p.numel() for p in dt.DecisionTransformer(dt.Config(), obs_dim, act_dim, 1000).parameters())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"starformer L={cfg.n_layer} D={cfg.n_embd}/{cfg.n_head}h d={cfg.step_embd}/{cfg.step_head}h T={T} B={B}: "
          f"{n_params:,} parameters ({n_params / dt_params:.1f}x dt.py's paper-size DT, {dt_params:,}); "
          f"train {1e3 * np.median(times[3:]):.1f} ms/step (CPU time {1e3 * np.median(cpu_times[3:]):.1f} ms), "
          f"eval forward (10 envs) {1e3 * t_eval:.1f} ms "
          f"[device {device}, {torch.get_num_threads()} threads]")


def parse_args(argv, config_cls=Config, presets=PRESETS):
    """Every Config field is a flag (--batch-size for batch_size). --preset applies first, explicit flags win."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    for f in dataclasses.fields(config_cls):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=f.metadata["help"])
        else:
            typ = {"int": int, "float": float, "str": str}.get(f.type, f.type) if f.default is not None else float
            p.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{f.metadata['help']} (default: {f.default})")
    given = vars(p.parse_args(argv))
    preset = given.get("preset", "")
    if preset and preset not in presets:
        p.error(f"unknown preset '{preset}'; known: {', '.join(presets)}")
    return config_cls(**({**presets.get(preset, {}), **given}))


def check_config(cfg):
    """Bad values -> one sentence (DataError), before anything is built."""
    for k in ("steps", "batch_size", "context", "eval_every", "eval_episodes", "log_every", "n_layer", "n_embd",
              "n_head", "step_embd", "step_head", "patch_size"):
        if getattr(cfg, k) <= 0:
            raise data_lib.DataError(f"--{k.replace('_', '-')} must be positive (got {getattr(cfg, k)})")
    if cfg.warmup_steps < 0 or cfg.lr <= 0 or not 0 <= cfg.dropout < 1:
        raise data_lib.DataError("--warmup-steps must be >= 0, --lr > 0 and --dropout in [0, 1)")
    for w, h, name in ((cfg.n_embd, cfg.n_head, "n-embd/n-head"), (cfg.step_embd, cfg.step_head, "step-embd/step-head")):
        if w % h:
            raise data_lib.DataError(f"--{name}: width {w} is not divisible by {h} heads")
    cfg.warmup_steps = max(cfg.warmup_steps, 1)


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_config(cfg)
        bench(cfg) if cfg.bench else train(cfg)
    except data_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
