"""
Decision Transformer (Chen et al. 2021, "Decision Transformer: Reinforcement Learning via Sequence Modeling"):
the baseline every other model file in this project is read against.

A trajectory is a sequence of tokens (R_1, s_1, a_1, R_2, s_2, a_2, ...) where R_t is the return-to-go. A causal
GPT-2-style transformer reads the last K steps (3K tokens) and predicts a_t from the hidden state of the s_t token.
At test time the model is prompted with a target return, and R_{t+1} = R_t - r_t after each step (paper Sec. 3).

    python dt.py --env hopper-medium                  # paper configuration: 100k steps, 128-d, 3 layers, K=20
    python dt.py --env hopper-medium --preset cpu     # small configuration for a 2-core laptop, ~10 minutes
    MINARI_DATASETS_PATH=../shared/datasets python dt.py --dataset replica/hopper/medium-v0 --preset cpu

Layout: Config -> model (needs only torch) -> train() -> main(). Outputs in runs/dt/<env>/seed<N>/.
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
    # data and run
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)")
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env")
    seed: int = arg(0, "seed for sampling, initialisation and evaluation")
    steps: int = arg(100_000, "gradient steps (kzl: 10 iterations x 10k)")
    batch_size: int = arg(64, "windows per batch")
    context: int = arg(20, "K, the number of timesteps the model sees (3K tokens)")
    lr: float = arg(1e-4, "AdamW learning rate")
    weight_decay: float = arg(1e-4, "AdamW weight decay")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (kzl)")
    lr_decay: bool = arg(False, "after warmup, cosine-decay the lr to a tenth by --steps (not in the paper; resume with the same --steps)")
    grad_clip: float = arg(0.25, "gradient-norm clip")
    eval_every: int = arg(10_000, "evaluate (and checkpoint) every this many steps, and at the end")
    eval_episodes: int = arg(10, "episodes per target return, run in parallel")
    target_return: float = arg(None, "return-to-go prompt in raw return units; default: the dataset's targets")
    log_every: int = arg(100, "print and log the training loss every this many steps")
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, mps")
    out: str = arg("", "output folder; default runs/dt/<env>/seed<N>")
    resume: bool = arg(False, "continue from <out>/ckpt.pt")
    preset: str = arg("", "'cpu': the small configuration for a 2-core machine")
    # model (paper Sec. 4 / kzl gym defaults)
    n_embd: int = arg(128, "token width")
    n_layer: int = arg(3, "transformer blocks")
    n_head: int = arg(1, "attention heads")
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals")
    bench_eval: bool = arg(False, "time batched vs sequential evaluation (10 episodes) and exit")


# A small DT that learns hopper-medium on 2 CPU cores in about ten minutes. Narrower, shallower, shorter context,
# a higher learning rate with a short warmup, decayed so that the last checkpoint (the one reported) is a settled
# one: with a constant 1e-3, one seed in three fell from 40 to 13 between its last two evaluations.
# The paper's configuration stays the default.
PRESETS = {"cpu": dict(n_embd=64, n_layer=2, n_head=1, context=10, batch_size=64, lr=1e-3, warmup_steps=500,
                       lr_decay=True, steps=6000, eval_every=2000, eval_episodes=10)}


# ----------------------------------------------------------------------------------------------------------------
# model: needs only torch

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
        self.embed_return = nn.Linear(1, C)                  # Sec. 3: a linear layer per modality
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
        The prediction at position t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only."""
        B, K, _ = states.shape
        time = self.embed_timestep(timesteps)                                   # (B, K, C)
        tokens = torch.stack([self.embed_return(rtg) + time,                   # R_t
                              self.embed_state(states) + time,                 # s_t
                              self.embed_action(actions) + time], dim=2)       # a_t      -> (B, K, 3, C)
        x = self.drop(self.embed_ln(tokens.reshape(B, 3 * K, -1)))             # (B, 3K, C): R_1, s_1, a_1, R_2, ... (Alg. 1)
        # causal mask, and no attention to left padding; a padding query may see itself (its output is never used),
        # so that no row of the softmax is empty
        real = mask.bool().repeat_interleave(3, dim=1)                          # (B, 3K)
        causal = torch.ones(3 * K, 3 * K, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(3 * K, dtype=torch.bool, device=x.device)
        attn_mask = (causal & (real[:, None, :] | eye))[:, None]               # (B, 1, 3K, 3K)
        for block in self.blocks:
            x = block(x, attn_mask)
        x = self.ln_f(x).reshape(B, K, 3, -1)                                   # (B, K, 3, C)
        return self.predict_action(x[:, :, 1])       # Sec. 3 / Alg. 1: a_t predicted from the s_t token: (B, K, act)


# ----------------------------------------------------------------------------------------------------------------
# training, evaluation and the command line (everything below needs numpy and the project's data/evaluate)

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


def make_act(model):
    """The evaluate() policy: a batch of contexts -> the action predicted at the last (current) position."""
    def act(batch, live):
        return model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[:, -1]
    return act


def lr_factor(s, cfg):
    """Multiplier of --lr at step s: linear warmup (kzl), then constant, or with --lr-decay a cosine down to 0.1."""
    if s < cfg.warmup_steps or not cfg.lr_decay:
        return min((s + 1) / cfg.warmup_steps, 1.0)
    progress = min((s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 1.0)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def loss_fn(model, batch):
    pred = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])  # (B, K, act)
    err = ((pred - batch["actions"]) ** 2).mean(-1)                                                     # (B, K)
    return (err * batch["mask"]).sum() / batch["mask"].sum()       # Sec. 3: MSE for continuous actions, real steps only


LOG_FIELDS = ["step", "loss", "lr", "target", "eval_return", "eval_return_std", "normalized_score",
              "normalized_score_std", "success_rate", "steps_to_goal", "wall_time"]


def plot_curve(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    train = [r for r in rows if r["loss"] != ""]
    ax1.plot([int(r["step"]) for r in train], [float(r["loss"]) for r in train])
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
    """Evaluate every target return; returns [(target, result dict)]."""
    targets = [cfg.target_return] if cfg.target_return is not None else d.target_returns
    model.eval()
    out = []
    for g in targets:
        t0 = time.time()
        res = eval_lib.evaluate(make_act(model), d, cfg.eval_episodes, g, seed, cfg.context, device)
        out.append((g, res | {"seconds": time.time() - t0}))
    model.train()
    return out


def train(cfg):
    device = pick_device(cfg.device)
    d = data_lib.load_data(cfg.dataset or cfg.env)
    name = (cfg.dataset or cfg.env).replace("/", "-")
    out = cfg.out or os.path.join("runs", "dt", name, f"seed{cfg.seed}")
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "ckpt.pt")
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; "
          f"normalised with {d.ref_source}; targets {d.target_returns}; device {device}")

    torch.manual_seed(cfg.seed)
    model = DecisionTransformer(cfg, d.obs_dim, d.act_dim, d.max_ep_len).to(device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
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
                rows.append(dict.fromkeys(LOG_FIELDS, "") | dict(step=step, loss=f"{np.mean(losses):.6f}", lr=f"{sched.get_last_lr()[0]:.3e}",
                                 wall_time=f"{wall:.1f}"))
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{ms:.1f} ms/step{last_eval}", flush=True)
                t_log, losses = time.time(), []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.time()
                results = run_evals(model, d, cfg, device, cfg.seed + 10_000)
                wall += time.time() - t0
                for g, res in results:
                    rows.append(dict.fromkeys(LOG_FIELDS, "") | dict(step=step, target=g, eval_return=f"{res['returns'].mean():.2f}",
                                     eval_return_std=f"{res['returns'].std():.2f}",
                                     normalized_score=f"{res['normalized'].mean():.2f}",
                                     normalized_score_std=f"{res['normalized'].std():.2f}",
                                     success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                                     steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                                     wall_time=f"{wall:.1f}"))
                    print(f"eval step {step} target {g:g}: {eval_lib.summarize(res)} ({res['seconds']:.0f}s)")
                final = results[0]
                last_eval = f" | eval {final[1]['normalized'].mean():.1f}"
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), f"dt {d.dataset_id} seed {cfg.seed}")
                t_log = time.time()
    except KeyboardInterrupt:
        save()
        print(f"\ninterrupted at step {step}; checkpoint saved, continue with --resume")
        raise SystemExit(130)
    if final is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        final = run_evals(model, d, cfg, device, cfg.seed + 10_000)[0]
    res = final[1]
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


def bench_eval(cfg):
    """10 episodes with the paper-size DT (untrained, or <out>/ckpt.pt with --resume), batched vs sequential."""
    d = data_lib.load_data(cfg.dataset or cfg.env)
    torch.manual_seed(cfg.seed)
    model = DecisionTransformer(cfg, d.obs_dim, d.act_dim, d.max_ep_len).eval()
    if cfg.resume:  # a trained policy keeps the hopper up, so episodes are long enough to time
        ckpt_path = os.path.join(cfg.out, "ckpt.pt")
        if not os.path.exists(ckpt_path):
            raise data_lib.DataError(f"--bench-eval --resume needs a checkpoint at {ckpt_path}; pass --out <run folder>")
        model.load_state_dict(torch.load(ckpt_path, weights_only=True)["model"])
    act, g = make_act(model), d.target_returns[0]
    t0 = time.time()
    rb = eval_lib.evaluate(act, d, 10, g, cfg.seed, cfg.context, progress=False)
    tb = time.time() - t0
    t0 = time.time()
    rs = eval_lib.evaluate_sequential(act, d, 10, g, cfg.seed, cfg.context)
    ts = time.time() - t0
    print(f"10 episodes, {rb['lengths'].sum()} env steps (lengths {rb['lengths'].tolist()}): batched {tb:.2f}s, "
          f"sequential {ts:.2f}s, speed-up {ts / tb:.1f}x; same returns: {np.allclose(rb['returns'], rs['returns'])}")


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


def main(argv=None):
    cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        bench_eval(cfg) if cfg.bench_eval else train(cfg)
    except data_lib.DataError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
