"""
Decision Transformer (Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence Modeling"):
the baseline every other model file in this project is read against.

A trajectory is a sequence of tokens (R_1, s_1, a_1, R_2, s_2, a_2, ...) where R_t is the return-to-go. A causal
GPT-2-style transformer reads the last K steps (3K tokens) and predicts a_t from the hidden state of the s_t token.
At test time the model is prompted with a target return, and R_{t+1} = R_t - r_t after each step (paper Sec. 3).

    python dt.py --env hopper-medium                  # paper configuration: 100k steps, 128-d, 3 layers, K=20
    python dt.py --env hopper-medium --preset cpu     # small configuration for a 2-core laptop, ~10 minutes
    python dt.py --env hopper-medium --no-return-token                # behaviour cloning (the paper's BC row)
    python dt.py --env hopper-medium --no-return-token --top-fraction 0.1     # %BC: BC on the best 10%
    MINARI_DATASETS_PATH=<folder of local datasets> python dt.py --dataset replica/hopper/medium-v0 --preset cpu

Glossary (paper symbol -> code name):
    R_t     return-to-go, sum of the rewards from t to the episode's end      rtg (B, K, 1), times return_scale
    s_t     state (observation), normalised by the dataset's mean and std    states (B, K, obs_dim)
    a_t     action, in [-1, 1]                                                actions (B, K, act_dim)
    t       timestep inside the episode (one embedding per timestep)          timesteps (B, K)
    K       context: the number of timesteps the model sees (3K tokens)       Config.context
    B       batch size (windows per gradient step)                            Config.batch_size
    C       token width (the paper's embedding dimension, 128)                Config.n_embd
    mask    1 = a real step, 0 = left padding before an episode's start       mask (B, K)

Layout: docstring -> Config -> the model (only torch, math, dataclasses) -> what DT plugs into the harness
(data, loss, policy) -> the harness (identical in every model file) -> main(). Outputs go to
runs/dt/<env>/<variant>/seed<N>/.
"""
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


def arg(default, help, run=False):
    """A Config field that is also a command-line flag. run=True: it does not change what is trained (seed,
    evaluation, output, device...), so it is left out of the run folder's variant name and may differ on --resume."""
    return field(default=default, metadata={"help": help, "run": run})


@dataclass
class Config:
    # data and run
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)", run=True)
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env", run=True)
    seed: int = arg(0, "seed for sampling, initialisation and evaluation", run=True)
    steps: int = arg(100_000, "gradient steps (kzl: 10 iterations x 10k)", run=True)
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "K, the number of timesteps the model sees (3K tokens)")
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (kzl)")
    lr_decay: bool = arg(False, "after warmup, cosine-decay the lr to a tenth by --steps (not in the paper; resume with the same --steps)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    eval_every: int = arg(10_000, "evaluate (and checkpoint) every this many steps, and at the end (DT's gym code: "
                                  "every 10k-step iteration)", run=True)
    eval_episodes: int = arg(100, "episodes per target return, run in parallel (DT's gym code: 100)", run=True)
    target_return: float = arg(None, "return-to-go prompt in raw return units; default: the dataset's targets", run=True)
    log_every: int = arg(100, "print and log the training loss every this many steps", run=True)
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", run=True)
    out: str = arg("", "output folder; default runs/dt/<env>/<variant>/seed<N>", run=True)
    resume: bool = arg(False, "continue the run in the output folder (its settings come from its checkpoint)", run=True)
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine")
    compile: bool = arg(False, "torch.compile the model for training (same results within float tolerance)", run=True)
    amp: bool = arg(False, "bf16 autocast for the forward pass (for CUDA; the loss is reduced in fp32)")
    bench: bool = arg(False, "time training steps (eager vs compiled, and AMP on CUDA) on synthetic data, and exit", run=True)
    # model (paper Sec. 4 / kzl gym defaults)
    n_embd: int = arg(128, "token width")
    n_layer: int = arg(3, "transformer blocks")
    n_head: int = arg(1, "attention heads")
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals")
    # the paper's behaviour-cloning baselines (Sec. 5.3, Table 3)
    return_token: bool = arg(True, "R_t tokens; --no-return-token: (s, a) tokens only, i.e. behaviour cloning")
    top_fraction: float = arg(1.0, "train on the best episodes by return that hold this fraction of the steps (%BC)")
    # analysis (reads the run's checkpoint, never trains)
    bench_eval: bool = arg(False, "time batched vs sequential evaluation (10 episodes) of the run's checkpoint", run=True)


# A small DT that learns hopper-medium on 2 CPU cores in about ten minutes. Narrower, shallower, shorter context,
# a higher learning rate with a short warmup, decayed so that the last checkpoint (the one reported) is a settled
# one: with a constant 1e-3, one seed in three fell from 40 to 13 between its last two evaluations.
# The paper's configuration stays the default.
PRESETS = {"cpu": dict(n_embd=64, n_layer=2, n_head=1, context=10, batch_size=64, lr=1e-3, warmup_steps=500,
                       lr_decay=True, steps=6000, eval_every=2000, eval_episodes=10)}


# >>> model: begin (needs only torch, math and dataclasses: copy this block, with Config and arg above, into your code)

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, attn_mask):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)                          # 3 x (B, T, C)
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,   # softmax(q k^T / sqrt(hs)) v
                                           dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)                   # (B, T, C)
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """GPT-2 block: pre-LayerNorm attention and MLP, each with a residual connection."""

    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        # kzl's gym DT configures GPT-2 with activation_function='relu' (GPT-2 itself uses GELU)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.ReLU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd), nn.Dropout(cfg.dropout))

    def forward(self, x, attn_mask):
        x = x + self.attn(self.ln_1(x), attn_mask)
        return x + self.mlp(self.ln_2(x))


class DecisionTransformer(nn.Module):
    def __init__(self, cfg, obs_dim, act_dim, max_ep_len):
        super().__init__()
        C = cfg.n_embd
        # Sec. 3: "an embedding for each timestep is learned and added to each token" (one timestep = 3 tokens), in
        # place of GPT's positional embedding
        self.embed_timestep = nn.Embedding(max_ep_len, C)
        self.return_token = cfg.return_token                 # False: (s, a) tokens only, behaviour cloning (Sec. 5.3)
        if self.return_token:
            self.embed_return = nn.Linear(1, C)              # Sec. 3: a linear layer per modality
        self.embed_state = nn.Linear(obs_dim, C)
        self.embed_action = nn.Linear(act_dim, C)
        self.embed_ln = nn.LayerNorm(C)                      # kzl's gym DT normalises the token embeddings
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(C)
        self.predict_action = nn.Sequential(nn.Linear(C, act_dim), nn.Tanh())  # actions live in [-1, 1]
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, states, actions, rtg, timesteps, mask):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions (B,K,act).
        The prediction at position t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only (rtg is unused without return tokens)."""
        B, K, _ = states.shape
        time = self.embed_timestep(timesteps)                                   # (B, K, C)
        tokens = [self.embed_state(states) + time,                             # s_t
                  self.embed_action(actions) + time]                           # a_t
        if self.return_token:
            tokens.insert(0, self.embed_return(rtg) + time)                     # R_t comes first in each step
        n = len(tokens)                                                         # tokens per step: 3 (2 for BC)
        x = torch.stack(tokens, dim=2).reshape(B, n * K, -1)                   # (B, nK, C): R_1, s_1, a_1, R_2, ... (Alg. 1)
        x = self.drop(self.embed_ln(x))                                         # (B, nK, C)
        # causal mask, and no attention to left padding; a padding query may see itself (its output is never used),
        # so that no row of the softmax is empty
        real = mask.bool().repeat_interleave(n, dim=1)                          # (B, nK)
        causal = torch.ones(n * K, n * K, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(n * K, dtype=torch.bool, device=x.device)
        attn_mask = (causal & (real[:, None, :] | eye))[:, None]               # (B, 1, nK, nK)
        for block in self.blocks:
            x = block(x, attn_mask)
        x = self.ln_f(x).reshape(B, K, n, -1)                                   # (B, K, n, C)
        return self.predict_action(x[:, :, n - 2])   # Sec. 3 / Alg. 1: a_t predicted from the s_t token: (B, K, act)
# <<< model: end


# ----------------------------------------------------------------------------------------------------------------
# what DT plugs into the harness below: data, optimiser, loss, policy (needs numpy and the project's data/evaluate)

import data as data_lib  # noqa: E402
import evaluate as eval_lib  # noqa: E402

SCRIPT = "dt"
LOG_EXTRA = []          # extra log.csv columns (none for DT)


def check_model(cfg):
    """A one-sentence problem with DT's own flags, or None."""
    if not 0 < cfg.top_fraction <= 1:
        return f"--top-fraction must lie in (0, 1], got {cfg.top_fraction}"
    return None


def load_dataset(cfg):
    d = data_lib.load_data(cfg.dataset or cfg.env)
    # %BC (Sec. 5.3): the best episodes by return up to this share of the steps; state statistics stay the full data's
    return d.keep_top(cfg.top_fraction) if cfg.top_fraction < 1 else d


def configure(cfg, d):
    """Settings that depend on the data (none for DT)."""
    return cfg


def eval_targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the DT paper's two per environment (data.py)."""
    return [cfg.target_return] if cfg.target_return is not None else d.target_returns


def build_model(cfg, info):
    return DecisionTransformer(cfg, info["obs_dim"], info["act_dim"], info["max_ep_len"])


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup (kzl), then constant, or with --lr-decay a cosine down to 0.1."""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / max(1, cfg.warmup_steps), 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model, cfg):
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return opt, lambda s: lr_factor(s, cfg)


def get_batch(d, cfg, rng):
    return d.sample(cfg.batch_size, cfg.context, rng)


def loss_fn(model, batch, cfg):
    pred = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])  # (B, K, act)
    err = ((pred.float() - batch["actions"]) ** 2).mean(-1)                                             # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()       # Sec. 3: MSE for continuous actions, real steps only


def make_act(model, cfg):
    """The evaluate() policy: a batch of contexts -> the action predicted at the last (current) position."""
    def act(batch, live):
        return model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[:, -1]
    return act


def log_extra(model, probe, cfg):
    """Extra log.csv values at each log step (LOG_EXTRA); none for DT."""
    return {}


def after_eval(model, d, cfg, out, rows, final):
    """Extra figures after each evaluation (final=True: after training); none for DT."""


def tokens_per_step(cfg):
    return 3 if cfg.return_token else 2


def bench_eval(cfg, run):
    """--bench-eval: 10 episodes of the run's checkpoint, batched vs sequential evaluation (same returns expected)."""
    d = load_dataset(cfg)
    cfg = configure(cfg, d)
    act, g = make_act(run["model"].cpu(), cfg), eval_targets(cfg, d)[0]
    t0 = time.time()
    rb = eval_lib.evaluate(act, d, 10, g, cfg.seed, cfg.context, progress=False)
    tb = time.time() - t0
    t0 = time.time()
    rs = eval_lib.evaluate_sequential(act, d, 10, g, cfg.seed, cfg.context)
    ts = time.time() - t0
    print(f"10 episodes, {rb['lengths'].sum()} env steps (lengths {rb['lengths'].tolist()}): batched {tb:.2f}s, "
          f"sequential {ts:.2f}s, speed-up {ts / tb:.1f}x; same returns: {np.allclose(rb['returns'], rs['returns'])}")


ANALYSES = {"bench_eval": bench_eval}   # flag -> fn(cfg, run): reads the run's checkpoint, never trains


# >>> harness: begin ==============================================================================================
# The run harness: flags, input checks, run folder, lock, checkpoint, exact resume, logging, curves, benchmark.
# IDENTICAL in dt.py, gpt2_dtma.py, lsdt.py, starformer.py and dema.py (tests/test_harness.py compares the copies):
# fix it in one file and copy the block to the others. It uses these names from the file around it:
#   SCRIPT, Config (fields made with arg(..., run=True) do not change what is trained), PRESETS, LOG_EXTRA,
#   check_model(cfg) -> problem or None, load_dataset(cfg) -> data, configure(cfg, data) -> cfg,
#   eval_targets(cfg, data), build_model(cfg, info), make_optimizer(model, cfg) -> (optimizer, lr factor of step),
#   get_batch(data, cfg, rng), loss_fn(model, batch, cfg), make_act(model, cfg), log_extra(model, probe, cfg),
#   after_eval(model, data, cfg, out, rows, final), tokens_per_step(cfg), ANALYSES {flag: fn(cfg, run)}.
import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

DataError = data_lib.DataError   # a problem the user can fix: main() prints it as one sentence and exits 1
LOG_FIELDS = ["step", "loss", "lr", *LOG_EXTRA, "target", "eval_return", "eval_return_std", "normalized_score",
              "normalized_score_std", "success_rate", "steps_to_goal", "wall_time"]
CKPT_KEYS = {"script", "model", "optimizer", "scheduler", "step", "wall_time", "config", "dataset_id", "info", "rows",
             "pending_losses", "numpy_rng", "torch_rng"}


def parse_flags(argv):
    """Every Config field is a flag (--batch-size for batch_size). --preset applies first, explicit flags win.
    -> (cfg, the names of the fields the command line set, the preset's included)."""
    p = data_lib.FlagParser(prog=f"{SCRIPT}.py", description=__doc__.split("\n\n")[1],
                            formatter_class=argparse.RawTextHelpFormatter)   # a bad flag: one sentence, exit 1
    for f in dataclasses.fields(Config):
        flag, text = "--" + f.name.replace("_", "-"), f.metadata["help"].replace("%", "%%")   # argparse %-formats help
        typ = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str, "bool": bool}[f.type]
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        else:
            p.add_argument(flag, type=typ, default=argparse.SUPPRESS, metavar=f.name.upper(),
                           help=f"{text} (default: {f.default})")
    given = vars(p.parse_args(argv))
    preset = given.get("preset", "")
    if preset and preset not in PRESETS:
        p.error(f"unknown preset '{preset}'; known: {', '.join(PRESETS)}")
    values = {**PRESETS.get(preset, {}), **given}
    if values.get("dataset"):
        values["env"] = ""   # --dataset names the data; config.json must not record the default --env beside it
    return Config(**values), set(values)


def parse_args(argv):
    return parse_flags(argv)[0]


def device_problem(name):
    kind, _, index = name.partition(":")
    if name in ("auto", "cpu"):
        return None
    if kind == "cuda":
        if not torch.cuda.is_available():
            return f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}); use --device cpu"
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            return f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 ...)"
        return None
    if name == "mps":
        return None if torch.backends.mps.is_available() else "--device mps: MPS is not available here; use --device cpu"
    return f"unknown --device '{name}'; use auto, cpu, cuda, cuda:N or mps"


def check_config(cfg):
    """Every flag, before any work is done: raises DataError with one sentence about the first bad value."""
    for f in dataclasses.fields(cfg):
        v, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if isinstance(v, float) and not math.isfinite(v):
            raise DataError(f"{flag} must be a finite number, got {v}")
        if f.name.endswith("dropout") and not 0 <= v < 1:
            raise DataError(f"{flag} must lie in [0, 1), got {v}")
    for name in ("steps", "batch_size", "context", "eval_every", "eval_episodes", "log_every", "n_layer", "n_embd",
                 "n_head"):
        v = getattr(cfg, name, None)
        if v is not None and v <= 0:
            raise DataError(f"--{name.replace('_', '-')} must be a positive whole number, got {v}")
    for name, v, ok, rule in (("lr", cfg.lr, cfg.lr > 0, "> 0"), ("grad-clip", cfg.grad_clip, cfg.grad_clip > 0, "> 0"),
                              ("weight-decay", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0"),
                              ("warmup-steps", cfg.warmup_steps, cfg.warmup_steps >= 0, ">= 0")):
        if not ok:
            raise DataError(f"--{name} must be {rule}, got {v}")
    if getattr(cfg, "n_head", None) and getattr(cfg, "n_embd", None) and cfg.n_embd % cfg.n_head:
        raise DataError(f"--n-head {cfg.n_head} does not divide --n-embd {cfg.n_embd}")
    chosen = [name for name in ANALYSES if getattr(cfg, name)] + (["bench"] if cfg.bench else [])
    if len(chosen) > 1:
        raise DataError(f"choose one of {', '.join('--' + c.replace('_', '-') for c in chosen)} per command")
    problem = device_problem(cfg.device) or check_model(cfg)
    if problem:
        raise DataError(problem)
    data_lib.resolve(cfg.dataset or cfg.env)   # an unknown --env: one sentence before any folder is made
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise DataError(f"--out {cfg.out} is a file, not a folder")


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def variant_name(cfg):
    """The run folder's variant: the preset, then every flag that changes what is trained and differs from its
    default (the preset's value where the preset sets it), e.g. 'default', 'cpu', 'cpu_no-return-token_context5'."""
    base = {f.name: f.default for f in dataclasses.fields(Config)} | PRESETS.get(cfg.preset, {})
    parts = [cfg.preset] if cfg.preset else []
    for f in dataclasses.fields(Config):
        v, flag = getattr(cfg, f.name), f.name.replace("_", "-")
        if f.metadata["run"] or f.name == "preset" or v == base[f.name]:
            continue
        parts.append(flag if v is True else f"no-{flag}" if v is False else f"{flag}{v:g}" if isinstance(v, float)
                     else f"{flag}{v}")
    return "_".join(parts).replace("/", "-").replace(" ", "") or "default"


def run_folder(cfg):
    return cfg.out or os.path.join("runs", SCRIPT, (cfg.dataset or cfg.env).replace("/", "-"), variant_name(cfg),
                                   f"seed{cfg.seed}")


def read_checkpoint(path):
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, empty file...: torch raises several types
        raise DataError(f"{path} cannot be read as a checkpoint ({type(e).__name__}; truncated, or not a torch file); "
                        f"move it away or pass another --out") from None
    if not isinstance(ck, dict) or ck.get("script") != SCRIPT or not CKPT_KEYS <= set(ck):
        raise DataError(f"{path} is not a checkpoint of {SCRIPT}.py; move it away or pass another --out")
    return ck


def settings_from_checkpoint(cfg, given, ck, path):
    """The run's own settings, with the flags given now on top. A flag that would change what is trained (or the
    dataset, or the seed) and differs from the checkpoint is refused in one sentence that names it."""
    saved = {k: v for k, v in ck["config"].items() if k in {f.name for f in dataclasses.fields(Config)}}
    differ = [f"--{f.name.replace('_', '-')} {saved[f.name]} there, {getattr(cfg, f.name)} here"
              for f in dataclasses.fields(Config)
              if f.name in given and f.name in saved and (not f.metadata["run"] or f.name == "seed")
              and f.name != "preset" and getattr(cfg, f.name) != saved[f.name]]
    if given & {"env", "dataset"} and data_lib.resolve(cfg.dataset or cfg.env) != ck["dataset_id"]:
        differ.append(f"dataset {ck['dataset_id']} there, {data_lib.resolve(cfg.dataset or cfg.env)} here")
    if differ:
        raise DataError(f"{path} was written with other settings ({'; '.join(differ)}); drop those flags to use the "
                        f"run's own, or pass a fresh --out")
    return Config(**(saved | {k: getattr(cfg, k) for k in given if k != "preset"}))


def lock_folder(out):
    """Hold <out>/.lock for this process's life. The OS releases it when the process ends, even by kill -9, so a
    crashed run never leaves its folder locked."""
    try:
        f = open(os.path.join(out, ".lock"), "a+")
    except OSError as e:
        raise DataError(f"cannot write to the output folder {out} ({e.strerror})") from None
    try:
        if os.name == "nt":
            import msvcrt
            msvcrt.locking(f.fileno(), msvcrt.LK_NBLCK, 1)
        else:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        pid = f.read().strip() or "?"
        f.close()
        raise DataError(f"{out} is in use by another run (process {pid}); wait for it, or pass another --out") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def open_run(cfg, given):
    """-> (cfg, out folder, checkpoint or None, lock). Never replaces a run: a folder that holds one is continued
    only with --resume (with the run's settings), and a folder in use by another process is refused."""
    out = run_folder(cfg)
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the output folder {out} ({e.strerror})") from None
    lock = lock_folder(out)
    try:
        ckpt_path = os.path.join(out, "ckpt.pt")
        if not cfg.resume and (os.path.exists(ckpt_path) or os.path.exists(os.path.join(out, "log.csv"))):
            raise DataError(f"{out} already holds a run; continue it with --resume, or pass a fresh --out")
        ck = read_checkpoint(ckpt_path) if cfg.resume and os.path.exists(ckpt_path) else None
        if ck is not None:
            cfg = settings_from_checkpoint(cfg, given, ck, ckpt_path)
        elif cfg.resume:
            print(f"no checkpoint at {ckpt_path}; starting from scratch")
        return cfg, out, ck, lock
    except BaseException:
        lock.close()
        raise


def load_run(cfg, given):
    """For the analyses: the trained model of a run folder (its settings from its checkpoint), never retrained."""
    out = run_folder(cfg)
    ckpt_path = os.path.join(out, "ckpt.pt")
    if not os.path.exists(ckpt_path):
        raise DataError(f"no checkpoint at {ckpt_path}; train the run first, or pass --out <run folder>")
    ck = read_checkpoint(ckpt_path)
    cfg = settings_from_checkpoint(cfg, given, ck, ckpt_path)
    model = build_model(cfg, ck["info"])
    try:
        model.load_state_dict(ck["model"])
    except RuntimeError:
        raise DataError(f"{ckpt_path} does not fit {SCRIPT}.py's model with the run's settings") from None
    model.to(pick_device(cfg.device)).eval()
    return cfg, dict(model=model, ck=ck, out=out)


def write_atomic(path, write):
    """write(tmp) then rename over `path`: a crash or a full disk leaves the previous file whole, and no .tmp."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if isinstance(e, (OSError, RuntimeError)):  # torch.save reports a failed write as RuntimeError
            reason = getattr(e, "strerror", None) or str(e).strip().splitlines()[-1][:100]
            raise DataError(f"could not write {path} ({reason}); the previous copy is kept") from None
        raise


def write_csv(path, rows):
    def write(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS, restval="")
            w.writeheader()
            w.writerows(rows)
    write_atomic(path, write)


def write_json(path, obj):
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2)
    write_atomic(path, write)


def log_row(**values):
    return dict.fromkeys(LOG_FIELDS, "") | values


class StopSignal:
    """Ctrl-C (SIGINT) or SIGTERM during training: finish the current step (and its evaluation), save, exit 128 +
    signal (130 for Ctrl-C). A second signal quits at once; the last checkpoint stays as it was."""

    def __init__(self):
        self.signum, self.previous = 0, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self.previous[s] = signal.signal(s, self.handle)
        return self

    def handle(self, signum, frame):
        if self.signum:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this step (and evaluation) to save; again to quit "
              f"without saving", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def finite_losses(pending, step):
    """The losses of the steps since the last log line (one device sync), or one sentence at the first non-finite."""
    values = torch.stack(pending).float().tolist() if pending else []
    for i, v in enumerate(values):
        if not math.isfinite(v):
            raise DataError(f"the training loss is {v} at step {step - len(values) + i + 1}, so the run stops there "
                            f"(its last checkpoint is kept); lower --lr or check the data")
    return values


def train_step(fwd, model, opt, sched, batch, cfg, autocast):
    """One gradient step: the loss (bf16 autocast if --amp; reductions stay fp32), backward, clip, AdamW, lr."""
    with autocast:
        loss = loss_fn(fwd, batch, cfg)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    sched.step()
    return loss.detach()


def run_evals(model, d, cfg, device):
    """Evaluate every target return on cfg.eval_episodes parallel episodes; -> [(target, result dict)]."""
    model.eval()
    results = []
    for g in eval_targets(cfg, d):
        t0 = time.time()
        res = eval_lib.evaluate(make_act(model, cfg), d, cfg.eval_episodes, g, cfg.seed + 10_000, cfg.context, device)
        results.append((g, res | {"seconds": time.time() - t0}))
    model.train()
    return results


def plot_curve(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    losses = [r for r in rows if r["loss"] != ""]
    ax1.plot([int(r["step"]) for r in losses], [float(r["loss"]) for r in losses])
    ax1.set(xlabel="gradient step", ylabel="training loss (mean over the log interval)", yscale="log",
            title="training loss")
    for target in dict.fromkeys(r["target"] for r in rows if r["normalized_score"] != ""):
        ev = [r for r in rows if r["normalized_score"] != "" and r["target"] == target]
        ax2.plot([int(r["step"]) for r in ev], [float(r["normalized_score"]) for r in ev], "o-",
                 label=f"target {target}" if target != "" else None)
    ax2.set(xlabel="gradient step", ylabel="normalised score (100 = expert)", title="evaluation")
    if any(line.get_label()[:1] != "_" for line in ax2.lines):
        ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train(cfg, given=frozenset()):
    """Train (or with --resume continue) the run in cfg's run folder. -> (model, the final evaluation's results)."""
    cfg, out, ck, lock = open_run(cfg, given)
    try:
        return _train(cfg, out, ck)
    finally:
        lock.close()


def _train(cfg, out, ck):
    device = pick_device(cfg.device)
    # the variant of the flags as given, as the run folder's name is (before configure's data-dependent values)
    variant = ck.get("variant", variant_name(cfg)) if ck else variant_name(cfg)
    d = load_dataset(cfg)
    cfg = configure(cfg, d)
    info = ck["info"] if ck else dict(obs_dim=d.obs_dim, act_dim=d.act_dim, max_ep_len=d.max_ep_len,
                                      goal_dim=d.goal_dim)
    ckpt_path = os.path.join(out, "ckpt.pt")
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; normalised with "
          f"{d.ref_source}; targets {eval_targets(cfg, d)}; device {device}", flush=True)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt, lr_factor_of_step = make_optimizer(model, cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor_of_step)
    rng = np.random.default_rng(cfg.seed)
    probe = {k: v.to(device) for k, v in get_batch(d, cfg, np.random.default_rng(cfg.seed + 20_000)).items()}
    step, wall0, rows, pending = 0, 0.0, [], []
    if ck is not None:
        try:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
        except (RuntimeError, ValueError, KeyError):
            raise DataError(f"{ckpt_path} does not fit this model and data; pass another --out") from None
        sched.load_state_dict(ck["scheduler"])
        step, wall0, rows = ck["step"], ck["wall_time"], list(ck["rows"])
        pending = [torch.tensor(v) for v in ck["pending_losses"]]   # float32, exactly the values saved
        rng.bit_generator.state = json.loads(ck["numpy_rng"])
        torch.set_rng_state(ck["torch_rng"])
        if ck.get("cuda_rng") is not None and torch.device(device).type == "cuda":
            torch.cuda.set_rng_state_all(ck["cuda_rng"])
        print(f"resumed from {ckpt_path} at step {step} of {cfg.steps}")
    print(f"{SCRIPT} {variant}: {sum(p.numel() for p in model.parameters()):,} parameters; run folder {out}",
          flush=True)
    write_json(os.path.join(out, "config.json"), dataclasses.asdict(cfg) | dict(
        script=SCRIPT, variant=variant, dataset_id=d.dataset_id, device=device, info=info))
    extra = log_extra(model, probe, cfg)
    if not rows and any(v != "" for v in extra.values()):   # e.g. GPT2-DTMA's G_Markov at step 0
        rows.append(log_row(step=0, wall_time="0.0", **extra))

    def save():
        write_csv(os.path.join(out, "log.csv"), rows)  # the log first: it always covers the checkpoint's steps
        state = dict(script=SCRIPT, model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(),
                     step=step, wall_time=wall(), config=dataclasses.asdict(cfg), variant=variant, dataset_id=d.dataset_id,
                     info=info,
                     rows=rows, pending_losses=finite_losses(pending, step), numpy_rng=json.dumps(rng.bit_generator.state),
                     torch_rng=torch.get_rng_state(),
                     cuda_rng=torch.cuda.get_rng_state_all() if torch.device(device).type == "cuda" else None,
                     state_mean=torch.from_numpy(d.state_mean), state_std=torch.from_numpy(d.state_std),
                     return_scale=d.return_scale)
        write_atomic(ckpt_path, lambda tmp: torch.save(state, tmp))

    t_start = t_log = time.time()
    wall = lambda: wall0 + time.time() - t_start  # noqa: E731
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=cfg.amp)
    evals, final, n_log, first_step = [r for r in rows if r["normalized_score"] != ""], None, 0, step
    model.train()
    with StopSignal() as stop:
        while step < cfg.steps and not stop.signum:
            batch = {k: v.to(device, non_blocking=True) for k, v in get_batch(d, cfg, rng).items()}
            pending.append(train_step(fwd, model, opt, sched, batch, cfg, autocast))
            step, n_log = step + 1, n_log + 1
            if step == first_step + 1 and step % cfg.log_every:   # a first sign of life, before the first log line
                print(f"step {step:6d} | loss {pending[-1].item():.5f} | first step {time.time() - t_log:.1f} s", flush=True)
            if step % cfg.log_every == 0 or step == cfg.steps:
                losses = finite_losses(pending, step)
                extra = log_extra(model, probe, cfg)
                rows.append(log_row(step=step, loss=f"{np.mean(losses):.6f}", lr=f"{sched.get_last_lr()[0]:.3e}",
                                    wall_time=f"{wall():.1f}", **extra))
                last = [r for r in evals if r["step"] == evals[-1]["step"]][:1]   # the first (headline) target's
                last = f" | eval {float(last[0]['normalized_score']):.1f}" if last else ""
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{1e3 * (time.time() - t_log) / n_log:.1f} ms/step"
                      + "".join(f" | {k} {v}" for k, v in extra.items() if v != "") + last, flush=True)
                pending, t_log, n_log = [], time.time(), 0
                write_csv(os.path.join(out, "log.csv"), rows)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                final = run_evals(model, d, cfg, device)
                for g, res in final:
                    rows.append(log_row(
                        step=step, target="" if g is None else g, eval_return=f"{res['returns'].mean():.2f}",
                        eval_return_std=f"{res['returns'].std():.2f}", normalized_score=f"{res['normalized'].mean():.2f}",
                        normalized_score_std=f"{res['normalized'].std():.2f}",
                        success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                        steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                        wall_time=f"{wall():.1f}"))
                    evals.append(rows[-1])
                    print(f"eval step {step} target {g}: {eval_lib.summarize(res)} ({res['seconds']:.0f}s)", flush=True)
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), f"{SCRIPT} {variant} {d.dataset_id} seed {cfg.seed}")
                after_eval(model, d, cfg, out, rows, final=False)
                t_log, n_log = time.time(), 0
        if stop.signum and step < cfg.steps:
            save()
            print(f"stopped at step {step}; checkpoint saved in {out}; continue with --resume", flush=True)
            raise SystemExit(128 + stop.signum)
    if final is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        final = run_evals(model, d, cfg, device)
    after_eval(model, d, cfg, out, rows, final=True)
    res = final[0][1]
    if "success" in res:  # goal-reaching data: steps to the goal (the horizon when missed) and success rate
        print(f"maze: steps_to_goal={res['steps_to_goal'].mean():.1f} success_rate={res['success'].mean():.3f}")
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


def bench(cfg):
    """--bench: ms per training step and tokens/s at this configuration (the preset's with --preset), eager against
    torch.compile (and compiled + bf16 autocast on CUDA), on synthetic data of hopper's shape. Timed steps:
    min(--steps, 20), after 3 warm-up steps; the compiled row also gives the time of its first step (the compile)."""
    device = pick_device(cfg.device)
    d = data_lib.synthetic_data(obs_dim=11, act_dim=3, episodes=16, length=max(200, 2 * (cfg.context or 0)))
    cfg = configure(cfg, d)
    info = dict(obs_dim=d.obs_dim, act_dim=d.act_dim, max_ep_len=d.max_ep_len, goal_dim=d.goal_dim)
    n = min(cfg.steps, 20)
    tokens = cfg.batch_size * cfg.context * tokens_per_step(cfg)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    modes = [("eager", False, False), ("compiled", True, False)]
    modes += [("compiled + amp", True, True)] if torch.device(device).type == "cuda" else []
    print(f"bench {SCRIPT} {variant_name(cfg)} on {device} (torch {torch.__version__}): batch {cfg.batch_size}, "
          f"K={cfg.context}, {tokens:,} tokens per batch, {n} timed steps", flush=True)
    eager_ms = None
    for label, compiled, amp in modes:
        torch.manual_seed(cfg.seed)
        model = build_model(cfg, info).to(device).train()
        opt, lr_factor_of_step = make_optimizer(model, cfg)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor_of_step)
        fwd = torch.compile(model) if compiled else model
        autocast = torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=amp)
        rng = np.random.default_rng(cfg.seed)
        step = lambda: train_step(fwd, model, opt, sched, {k: v.to(device) for k, v in get_batch(d, cfg, rng).items()},  # noqa: E731
                                  cfg, autocast)
        t0 = time.time()
        step()
        sync()
        first = time.time() - t0
        for _ in range(3):
            step()
        sync()
        t0 = time.time()
        for _ in range(n):
            step()
        sync()
        ms = 1e3 * (time.time() - t0) / n
        eager_ms = eager_ms or ms
        print(f"  {label:15s} {ms:9.2f} ms/step {1e3 * tokens / ms:12,.0f} tokens/s   {eager_ms / ms:5.2f}x eager"
              + (f"   (first step, with compilation: {first:.1f} s)" if compiled else f"   ({sum(p.numel() for p in model.parameters()):,} parameters)"),
              flush=True)


def main(argv=None):
    try:
        cfg, given = parse_flags(sys.argv[1:] if argv is None else argv)
        check_config(cfg)
        analysis = next((name for name in ANALYSES if getattr(cfg, name)), None)
        if cfg.bench:
            bench(cfg)
        elif analysis:
            ANALYSES[analysis](*load_run(cfg, given))
        else:
            train(cfg, given)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; nothing was saved since the last checkpoint", file=sys.stderr)
        raise SystemExit(130)
# <<< harness: end ================================================================================================


if __name__ == "__main__":
    main()
