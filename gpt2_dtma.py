"""
GPT2-DT and GPT2-DTMA (Zhao et al., "Unveiling Markov Heads in Pretrained Language Models for
Offline Reinforcement Learning"; [P-old]: its earlier version, "Enhancing Cross-domain Pre-Trained
Decision Transformers with Adaptive Attention", arXiv 2409.06985): a Decision Transformer on
pretrained GPT-2 small.

GPT-2's first layer holds Markov heads (Def. 4.1-4.2, Thms 4.3-4.5), which attend to the current
state s_t whatever the embeddings and fine-tuning: good on MuJoCo, bad on long-horizon mazes.
GPT2-DTMA's softmax gate over each layer's heads (Eqs. 6-8) lets fine-tuning turn them down.

    python gpt2_dtma.py --env hopper-medium               # GPT2-DTMA; fetches GPT-2 once
    python gpt2_dtma.py --env hopper-medium --preset cpu  # GPT-2's first block: a 2-core CPU
    python data.py make pointmaze-medium-dense            # a long-horizon maze, made offline
    python gpt2_dtma.py --dataset made/pointmaze/medium-dense-v0 --preset cpu
    python gpt2_dtma.py --sample "The meaning of life is" # proof that GPT-2's weights loaded
    python gpt2_dtma.py --out <run folder> --importance   # an analysis of a run
    python gpt2_dtma.py --out <run folder> --target-sweep # DT's Fig. 4 on a run

Glossary (paper symbol -> code name; R^_t, s_t, a_t: dt.py's R_t, s_t, a_t):
    a'_t            the predicted action (Eq. 2): DecisionTransformer()[0]
    K, 3K           the context in timesteps (Tabs. 5-6's k), in tokens: Config.context, T
    C, N, d_k       width, heads a layer, head width: n_embd, n_head, D = C // N
    W_g, G_i        the MoA gate (Eq. 7): gate_weight (N, C), gate_bias (N,); G (B, T, N)
    A_i             W_i^q (W_i^k)^T (Def. 4.2): head_qk_matrix()
    G_Markov        the Markov heads' layer-0 gate weight (Tabs. 5-6): markov_gate_mass()

Layout: dt.py's, plus Markov-head quantities and the pretrained weights. The papers publish no
code; GPT2-DT names LaMo (Shi et al. 2024) as its implementation: "LaMo" below is its
experiment-d4rl/ folder,
https://github.com/srzer/LaMo-2023/tree/3e4fcc8a7e68916882033a0cef110370c0144022/experiment-d4rl
and "kzl" is DT's code,
https://github.com/kzl/decision-transformer/tree/e2d82e68f330c00f763507b3b01d774740bee53f

Departures from the paper and the official code (the detail at the line that says "departure N"):
 1. Full fine-tuning with linear embeddings (App. F's GPT2-DT); LaMo's run.sh trains LoRA on
    c_attn, the rest frozen, with MLP embeddings (#L43-L46) and may co-train on WikiText
    (run_cotrain.sh#L52-L53), none of it in the paper.
 2. App. C's lr 1e-4 and weight decay 1e-4, none on the gate (it would pull it to uniform); LaMo's
    settings differ.
 3. The timestep embedding is added before embed_ln, as in kzl's DT; LaMo adds it after
    (decision_transformer/models/decision_transformer.py#L174-L176).
 4. The paper leaves the MoA gate's place, scale and init open; as in MoH (Jin et al. 2024), every
    layer's gate reads the LN1 output and scales each head, times N, before the pretrained c_proj,
    from zero: GPT2-DTMA equals GPT2-DT at step 0.
 5. Eq. 7's linear gate adds 0.13% parameters to GPT-2 small (12 x 9,228), not Sec. 5.2's 3%.
 6. Eq. 8's d_k is the head width, 64, as in GPT-2 (the paper's "dimension of the embedding layer"
    would change the pretrained function).
 7. Eq. 3's sum is a mean over the real steps (kzl's and LaMo's code); Eq. 9's G_Markov a mean over
    the batch's real tokens (the paper writes it for one input).
 8. Def. 4.1's r defaults to [P-old]'s 20, not the paper's 8 (only 20 explains Tab. 1's head 9);
    A_i is read both as C x C and as D x D (head_qk_matrix).
 9. Unstated in the paper: dropout 0.1 and gradient clip 0.25 (kzl's, LaMo's), K 20 on MuJoCo and
    50 on mazes, the data's target returns, GPT-2 small's shape for DT and DTMA (--init random).
10. CLIP-DT takes CLIP's text-tower layers and final LayerNorm only; GPTJ-DT (6B) is refused.
11. DT's embeddings and action head start, as new blocks do (--init random), from GPT-2's init as
    nanoGPT writes it; LaMo's and kzl's keep PyTorch's defaults there.
"""
import dataclasses
import glob
import json
import os
import shutil
import socket
import sys
import urllib.parse
from dataclasses import dataclass, field

import huggingface_hub.constants
import numpy as np
from huggingface_hub import hf_hub_download, try_to_load_from_cache

import data as data_lib
import evaluate as ev


# >>> model: begin (copy this block alone, to "model: end", into any file: it needs only torch)
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPT2Config:
    """The blocks' shape: GPT-2 small's (CLIP_TEXT below: CLIP's text tower's)."""
    vocab_size: int = 50257  # the language model's alone (GPT2)
    n_positions: int = 1024  # the language model's alone (GPT2)
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"  # the MLP's: GPT-2's tanh GELU, or CLIP's quick_gelu


class CausalSelfAttention(nn.Module):
    """GPT-2 causal self-attention, optionally with GPT2-DTMA's MoA gate (Sec. 4.2):
        Eq. 8  Head_i(e) = softmax((e W_i^q)(E W_i^k)^T / sqrt(d_k)) (E W_i^v)
        Eq. 7  G_i(e) = softmax_i(W_g e), a weight per head and token e
        Eq. 6  y(e) = sum_i G_i(e) Head_i(e); here times N, before c_proj (departure 4)"""

    def __init__(self, n_embd, n_head, dropout=0.0, moa=False):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head, self.dropout, self.moa = n_head, dropout, moa
        # W^q, W^k, W^v of all heads
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)

        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)
        if moa:
            # Eq. 7's W_g, b_g: zeros, no random draw (GPT2-DT and -DTMA of a seed share the rest)
            self.gate_weight = nn.Parameter(torch.zeros(n_head, n_embd))
            self.gate_bias = nn.Parameter(torch.zeros(n_head))

    def forward(self, x, attn_mask=None, need_probs=False):
        """x (B,T,C): the LN1 output; attn_mask (B,1,T,T) bool, True = may attend (None: causal)
        -> y (B,T,C) and aux: 'gate' (B,T,N) with MoA, 'probs' (B,N,T,T) with need_probs."""
        B, T, C = x.shape
        N = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = (z.view(B, T, N, C // N).transpose(1, 2) for z in (q, k, v))  # (B, N, T, D)

        p_drop = self.dropout if self.training else 0.0
        aux = {}
        if need_probs:
            # Eq. 8 written out, for the analyses
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // N)  # (B, N, T, T)
            allowed = (torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
                       if attn_mask is None else attn_mask)
            aux["probs"] = F.softmax(att.masked_fill(~allowed, float("-inf")), dim=-1)
            o = F.dropout(aux["probs"], p_drop, self.training) @ v  # (B, N, T, D)
        else:
            # Eq. 8 (departure 6)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p_drop,
                                               is_causal=attn_mask is None)  # (B, N, T, D)

        if self.moa:
            # Eq. 7, then Eq. 6 times N, before c_proj (departure 4: a literal Eq. 6 has no output
            # projection and shrinks every head to 1/N)
            g = aux["gate"] = F.softmax(F.linear(x, self.gate_weight, self.gate_bias), dim=-1)
            o = o * (N * g).transpose(1, 2).unsqueeze(-1)  # (B, N, T, D)

        y = o.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.c_proj(y)), aux


class QuickGELU(nn.Module):
    """CLIP's activation, x * sigmoid(1.702 x)."""

    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class MLP(nn.Module):
    """The 4x wide feed-forward layer: GPT-2's tanh GELU ('gelu_new'), or CLIP's 'quick_gelu'."""

    def __init__(self, n_embd, dropout=0.0, activation="gelu_new"):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = {"gelu_new": nn.GELU(approximate="tanh"), "quick_gelu": QuickGELU()}[activation]
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(self.act(self.c_fc(x))))  # (B, T, C)


class Block(nn.Module):
    """GPT-2 block: pre-LN attention and MLP, each residual."""

    def __init__(self, n_embd, n_head, dropout=0.0, eps=1e-5, moa=False, activation="gelu_new"):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, moa)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = MLP(n_embd, dropout, activation)

    def forward(self, x, attn_mask=None, need_probs=False):
        a, aux = self.attn(self.ln_1(x), attn_mask, need_probs)
        x = x + a
        return x + self.mlp(self.ln_2(x)), aux


def _init_weights(m):
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, mean=0.0, std=0.02)
    if isinstance(m, nn.Linear) and m.bias is not None:
        nn.init.zeros_(m.bias)


class DecisionTransformer(nn.Module):
    """GPT2-DT(MA): DT's embeddings and action head around GPT-2 blocks of the shape gpt (a
    GPT2Config; build_model: the checkpoint's) (App. C), MoA-gated with moa (GPT2-DTMA)."""

    def __init__(self, gpt, obs_dim, act_dim, max_ep_len, dropout=0.1, moa=True):
        super().__init__()
        C, eps = gpt.n_embd, gpt.layer_norm_epsilon
        # LaMo's embeddings and head (decision_transformer.py#L102-L135); GPT-2's wpe, wte unused
        self.embed_timestep = nn.Embedding(max_ep_len, C)
        self.embed_return = nn.Linear(1, C)
        self.embed_state = nn.Linear(obs_dim, C)
        self.embed_action = nn.Linear(act_dim, C)
        self.embed_ln = nn.LayerNorm(C)
        self.drop = nn.Dropout(dropout)

        self.blocks = nn.ModuleList([Block(C, gpt.n_head, dropout, eps, moa, gpt.activation)
                                     for _ in range(gpt.n_layer)])
        self.ln_f = nn.LayerNorm(C, eps=eps)
        self.predict_action = nn.Sequential(nn.Linear(C, act_dim), nn.Tanh())  # actions in [-1, 1]

        # GPT-2's init as nanoGPT writes it (LaMo's for new blocks:
        # decision_transformer/models/trajectory_gpt2.py#L503-L538), on DT's embeddings and head
        # too. Departure 11: LaMo's embeddings and head keep PyTorch's defaults, the timestep
        # embedding N(0, 1) (decision_transformer/models/decision_transformer.py#L102-L113,
        # #L129-L135), as kzl's do (dt.py's departure 6). Kept: one rule for every weight that no
        # checkpoint gives, dt.py's, and the README's rows were measured with it.
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * gpt.n_layer))

    @torch.no_grad()
    def load_gpt2_blocks(self, sd):
        """Copy the blocks and ln_f from load_checkpoint's state dict."""
        for name, p in self.named_parameters():
            if name.startswith(("blocks.", "ln_f.")) and ".gate_" not in name:
                p.copy_(sd[name.replace("blocks.", "h.", 1)])

    def forward(self, states, actions, rtg, timesteps, mask, need_probs=False):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions
        (B,K,act) and aux: per layer 'gates' (B,3K,N) (MoA), 'probs' (B,N,3K,3K) (need_probs) or
        None. The prediction at t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} (Eq. 2)."""
        B, K, _ = states.shape
        # LaMo's decision_transformer.py#L159-L199, the timestep as in kzl's
        # gym/decision_transformer/models/decision_transformer.py#L68-L78 (departure 3)
        time = self.embed_timestep(timesteps)  # (B, K, C)
        tokens = [self.embed_return(rtg) + time,  # R_t
                  self.embed_state(states) + time,  # s_t
                  self.embed_action(actions) + time]  # a_t

        # the sequence R_1, s_1, a_1, R_2, ...
        x = torch.stack(tokens, dim=2).reshape(B, 3 * K, -1)  # (B, 3K, C)
        x = self.drop(self.embed_ln(x))  # (B, 3K, C)
        attn_mask = causal_padding_mask(mask, 3)  # (B, 1, 3K, 3K)

        gates, probs = [], []
        for block in self.blocks:
            x, aux = block(x, attn_mask, need_probs)
            gates.append(aux.get("gate"))
            probs.append(aux.get("probs"))
        x = self.ln_f(x).reshape(B, K, 3, -1)  # (B, K, 3, C)

        # Eq. 2: a'_t from the s_t token
        a_pred = self.predict_action(x[:, :, 1])  # (B, K, act)
        return a_pred, dict(gates=gates, probs=probs)


def causal_padding_mask(mask, n):
    """(B, K) real-step mask, n tokens per step -> (B, 1, nK, nK) attention mask: causal, blind to
    left padding; a padding query sees itself (unused), so no softmax row is empty."""
    real = mask.bool().repeat_interleave(n, dim=1)  # (B, nK)
    T = real.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=mask.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=mask.device)
    return (causal & (real[:, None, :] | eye))[:, None]  # (B, 1, nK, nK)


class GPT2(nn.Module):
    """GPT-2's language model (--sample, --text-attention): HF's names, nn.Linear weights."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg.n_embd, cfg.n_head, eps=cfg.layer_norm_epsilon,
                                      activation=cfg.activation) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, idx, need_probs=False):
        """idx (B,T) token ids -> logits (B,T,vocab); need_probs: and each layer's (B,N,T,T)."""
        T = idx.shape[1]
        assert T <= self.cfg.n_positions, f"{T} tokens, more than {self.cfg.n_positions} positions"
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))  # (B, T, C)

        probs = []
        for block in self.h:
            x, aux = block(x, need_probs=need_probs)
            probs.append(aux.get("probs"))

        logits = self.ln_f(x) @ self.wte.weight.t()  # (B, T, vocab): lm_head tied to wte
        return (logits, probs) if need_probs else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=40, generator=None):
        """nanoGPT's sampling: idx (1,T) -> (1,T+max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.n_positions:])[:, -1, :] / temperature  # (1, vocab)
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (1, 1): top k

            logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

# <<< model: end

# ---- the settings: Config (the paper's, then the run's flags) and PRESETS ----


def arg(default, help, in_name=True):
    """A Config field that is a flag; in_name=False: it changes nothing trained, so the run's
    variant name (its folder's) leaves it out."""
    return field(default=default, metadata={"help": help, "in_name": in_name})


@dataclass
class Config:
    # ---- the paper's settings (App. C; its variants are flags) ----
    delayed_reward: bool = arg(False, "each episode's rewards paid at its last step (DT's Table 5)")
    steps: int = arg(100_000, "gradient steps", in_name=False)
    batch_size: int = arg(64, "windows per batch (App. C)")
    # departure 9: Tabs. 5-6's rows equal Tabs. 3-4, whose K the paper does not give
    context: int = arg(None, "K (Tabs. 5-6); default: 20 on MuJoCo, 50 on mazes (departure 9)")
    # departure 2: LaMo has lr 1e-4, decay 1e-5, warmup 2500 (run.sh#L5-L9), AdamW eps 1e-6
    # (utils.py#L61); its GPT-2 lr 1e-5 without decay (utils.py#L24-L33) reaches no weight: it seeks
    # "transformers" in module types, and LaMo's GPT-2 class is its own
    # (decision_transformer/models/trajectory_gpt2.py#L1041)
    lr: float = arg(1e-4, "AdamW learning rate (App. C)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (App. C); the MoA gate gets none")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (App. C)")
    # departure 9: kzl's, and LaMo's decision_transformer/training/seq_trainer.py#L55
    grad_clip: float = arg(0.25, "gradient-norm clip (departure 9)")
    init: str = arg("gpt2", "gpt2, clip (CLIP ViT-B/32's text tower: CLIP-DT, Tab. 7), a "
                            "model.safetensors or its folder, or random (DT, DTMA)")
    n_layer: int = arg(None, "keep the first N blocks (default: all; layer 0 has the Markov heads)")
    n_embd: int = arg(None, "width (default: the checkpoint's; --init random: 768)")
    n_head: int = arg(None, "heads per layer (default: the checkpoint's; --init random: 12)")
    # departure 9: kzl's, and LaMo's run.sh#L8
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals (departure 9)")
    moa: bool = arg(True, "the MoA gate (GPT2-DTMA, Eqs. 6-7); --no-moa: GPT2-DT (Tabs. 2-4)")
    markov_penalty: float = arg(0.0, "alpha of Eq. 9 on the Markov heads' layer-0 gate (GPT2-P, "
                                     "Tab. 3: 0.1)")
    markov_r: float = arg(20.0, "Def. 4.1 (ii)'s r, for the Markov heads of other checkpoints")
    freeze_attention: bool = arg(False, "train only the embeddings and FFNs (GPT2-DT (part), "
                                        "Tab. 8)")
    # App. C
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
    # of a run's checkpoint
    keep_ckpt_at: int = arg(0, "also keep this step's checkpoint (Figs. 1/7)", in_name=False)
    markov: bool = arg(False, "Markov test of the layer-0 heads (Tab. 1, Fig. 3); without a run: "
                              "--init's", in_name=False)
    attention_maps: bool = arg(False, "layer-0 attention before and after fine-tuning (Fig. 4)",
                               in_name=False)
    attention_distance: bool = arg(False, "attention by distance, early and late (Figs. 1/7)",
                                   in_name=False)
    importance: bool = arg(False, "head importance, each zeroed in rollouts (Figs. 2, 8)",
                           in_name=False)
    # of the GPT-2 weights alone
    text_attention: str = arg("", "TEXT: GPT-2's layer-0 attention on real text", in_name=False)
    sample: str = arg("", "PROMPT: GPT-2's continuation, proof that its weights loaded",
                      in_name=False)


# --preset cpu: GPT-2's first block (its Markov heads) on 2 cores; mazes: K=1, no dropout (README)
PRESETS = {"cpu": dict(n_layer=1, batch_size=32, context=10, lr=3e-4, warmup_steps=50, steps=300,
                       eval_every=300, eval_episodes=10, log_every=25,
                       mazes=dict(context=1, dropout=0.0, eval_episodes=50))}

# ---- the paper's analysis quantities (torch alone) ----

MARKOV_HEADS = (1, 5, 10)  # GPT-2 small's layer-0 Markov heads (Tab. 1), Eq. 9's
# [P-old] Tab. 8: CLIP's layer-0 heads at init, (i) and (ii)'s ratio
CLIP_TAB8 = ((True, 2.26), (True, 1.67), (False, 5.89), (False, 6.49), (True, 2.49), (True, 2.25),
             (True, 2.99), (False, 7.49))


def head_qk_matrix(c_attn_weight, n_head, i, layout="model"):
    """A_i = W_i^q (W_i^k)^T of head i (Def. 4.2) from c_attn_weight (3C, C), biases and LN1 aside
    as in the paper: layout 'model' the C x C bilinear form q_i . k_j = x_i A x_j^T (Def. 4.1,
    Thm 4.3), 'head' the D x D Wq_i Wk_i^T (Remark 4.7's d = 64) (departure 8)."""
    C = c_attn_weight.shape[1]
    D = C // n_head
    Wq = c_attn_weight.detach()[i * D:(i + 1) * D].double()  # (D, C)
    Wk = c_attn_weight.detach()[C + i * D:C + (i + 1) * D].double()  # (D, C)
    return Wq.t() @ Wk if layout == "model" else Wq @ Wk.t()  # (C, C) or (D, D)


def markov_stats(A, r=20.0, eps=1e-8):
    """Def. 4.1: A is Markov iff (i) every A_ii > 0 and (ii) mean_i |A_ii| / mean_{i!=j} |A_ij| > r
    (eps: [P-old] Remark 3; r: departure 8)."""
    A = A.double()
    d = A.shape[0]
    diag = A.diagonal()

    mean_off = (A.abs().sum() - diag.abs().sum()) / (d * d - d)
    ratio = float(diag.abs().mean() / (mean_off + eps))

    cond_i = bool((diag > 0).all())
    return {"cond_i": cond_i, "ratio": ratio, "markov": cond_i and ratio > r}


def markov_table(c_attn_weight, n_head):
    """Per head of a layer, in both layouts: (i) and (ii)'s ratio."""
    rows = []
    for i in range(n_head):
        row = {"head": i}
        for layout in ("model", "head"):
            st = markov_stats(head_qk_matrix(c_attn_weight, n_head, i, layout))
            row[f"{layout}_i"], row[f"{layout}_ratio"] = st["cond_i"], st["ratio"]
        rows.append(row)
    return rows


def find_markov_heads(c_attn_weight, n_head, r=20.0):
    """A layer's Markov heads: Def. 4.1 on the C x C reading."""
    return tuple(i for i in range(n_head)
                 if markov_stats(head_qk_matrix(c_attn_weight, n_head, i), r)["markov"])


def markov_gate_mass(gates, mask, heads):
    """G_Markov (Tabs. 5-6, Eq. 9): layer 0's gate (B,3K,N) summed over the Markov heads,
    averaged over mask (B,K)'s real tokens; differentiable (GPT2-P's penalty)."""
    m = mask.repeat_interleave(3, dim=1).to(gates.dtype)  # (B, 3K)
    g = gates[..., list(heads)].sum(-1)  # (B, 3K)
    return (g * m).sum() / m.sum().clamp_min(1.0)


def diagonal_attention_mass(probs, mask=None):
    """The mean attention of a token to itself (Thm 4.3, Fig. 4), per head: probs (B,N,T,T) ->
    (N,); mask (B,T): the rows to average (not row 0, which sees only itself)."""
    d = probs.diagonal(dim1=-2, dim2=-1)[..., 1:]  # (B, N, T-1)
    m = torch.ones_like(d[:, :1]) if mask is None else mask[:, None, 1:].to(d.dtype)  # (B, 1, T-1)
    return (d * m).sum(dim=(0, 2)) / (m.sum() * 1.0).clamp_min(1.0)


def attention_by_distance(probs, query):
    """Figs. 1/7: token `query`'s attention to the tokens 0..query back, the mean of layers, windows
    and heads: probs (B,N,T,T) per layer -> (query+1,)."""
    P = torch.stack(list(probs))[..., query, :query + 1]  # (L, B, N, query+1): keys 0..query
    return P.flip(-1).mean(dim=(0, 1, 2))  # (query+1,): distance 0 = itself


@torch.no_grad()
def head_importance(model, batch):
    """Sec. 4.1.2 / Fig. 2: head (l, i)'s importance ||a' - a'_{-(l,i)}||_2, the last action's
    change when its output is zeroed, a batch mean -> (L, N) on the CPU."""
    model.eval()
    s, a, R, t, m = (batch[k] for k in ("states", "actions", "rtg", "timesteps", "mask"))
    base = model(s, a, R, t, m)[0][:, -1]  # (B, act)

    B, N = s.shape[0], model.blocks[0].attn.n_head
    D = model.blocks[0].attn.c_proj.in_features // N
    rep = lambda x: x.repeat(N, *([1] * (x.dim() - 1)))  # (N*B, ...)  # noqa: E731

    # replica h*B+b drops head h
    keep = (1.0 - torch.eye(N, device=s.device)).repeat_interleave(B, dim=0)  # (N*B, N)
    keep = keep.repeat_interleave(D, dim=1)[:, None, :]  # (N*B, 1, C)

    imp = torch.zeros(len(model.blocks), N)
    for layer, block in enumerate(model.blocks):
        hook = block.attn.c_proj.register_forward_pre_hook(
            lambda mod, args: (args[0] * keep.to(args[0].dtype),))
        try:
            abl = model(rep(s), rep(a), rep(R), rep(t), rep(m))[0][:, -1]  # (N*B, act)
        finally:
            hook.remove()

        imp[layer] = (abl.view(N, B, -1) - base[None]).norm(dim=-1).mean(dim=1).cpu()
    return imp

# ---- the paper's pieces: data, blocks, schedule, loss, policy ----

GPTJ_NAMES = ("gptj", "gpt-j", "gpt-j-6b", "eleutherai/gpt-j-6b")  # GPTJ-DT's (Tab. 7)


def paper_settings(cfg, given):
    """This file's flags checked against --init's config (no weight read) -> cfg; --bench:
    MuJoCo's K (hopper-shaped data)."""
    if cfg.init.lower() in GPTJ_NAMES:
        raise data_lib.DataError(f"--init {cfg.init}: GPT-J (6B parameters, 24 GB in fp32) is out "
                                 f"of a laptop's reach; this file does not load it")

    # the blocks' shape: --init random's (a GPT-2's bounds), else the checkpoint's
    random = cfg.init == "random"
    g = GPT2Config() if random else config_of(cfg.init, allow_download=False)
    n_embd, n_head, keep = cfg.n_embd or g.n_embd, cfg.n_head or g.n_head, cfg.keep_ckpt_at

    checks = [
        *((random and (getattr(cfg, k) or 0) > GPT2_LIMITS[k],
           f"--{k.replace('_', '-')} {getattr(cfg, k)}: a GPT-2 has at most {GPT2_LIMITS[k]}")
          for k in ("n_embd", "n_head", "n_layer")),
        (not random and (cfg.sample or cfg.text_attention) and g.activation == "quick_gelu",
         f"--{'sample' if cfg.sample else 'text-attention'} needs GPT-2's language model; CLIP's "
         f"text tower (--init {cfg.init}) has no language-model head"),
        (not random and cfg.n_embd not in (None, g.n_embd),
         f"--n-embd {cfg.n_embd}: the checkpoint's width is {g.n_embd}"),
        (not random and cfg.n_head not in (None, g.n_head),
         f"--n-head {cfg.n_head}: the checkpoint has {g.n_head} heads"),
        (not random and (cfg.n_layer or 0) > g.n_layer,
         f"--n-layer {cfg.n_layer}: the checkpoint has {g.n_layer} blocks"),
        (n_embd % n_head, f"--n-embd {n_embd} is not divisible by --n-head {n_head}"),

        # the variants' flags (ev.check_flags: the shared ones)
        (not cfg.markov_penalty >= 0, f"--markov-penalty must be >= 0, got {cfg.markov_penalty}"),
        (cfg.markov_penalty and not cfg.moa,
         "--markov-penalty penalises the MoA gate (Eq. 9): drop --no-moa"),
        (cfg.markov_penalty and random and n_head <= max(MARKOV_HEADS),
         f"--markov-penalty with --init random penalises heads 1, 5, 10: it needs more than 10 "
         f"heads, not {n_head}"),
        (cfg.freeze_attention and random,
         "--freeze-attention keeps the pretrained attention; with --init random there is none"),
        (not cfg.markov_r > 0, f"--markov-r must be > 0, got {cfg.markov_r}"),
        (keep and (keep < 0 or keep > cfg.steps or keep % max(1, cfg.eval_every)),
         f"--keep-ckpt-at {keep} must be a step that the run checkpoints: 0 to --steps "
         f"{cfg.steps}, a multiple of --eval-every {cfg.eval_every}")]
    if why := next((why for bad, why in checks if bad), None):
        raise data_lib.DataError(why)
    return dataclasses.replace(cfg, context=20) if cfg.bench and cfg.context is None else cfg


def load_dataset(cfg):
    return data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)


def build_model(cfg, info):
    """GPT2-DT(MA) on --init's first n_layer blocks (random: new ones); a new build keeps in info
    the shape and Markov heads, for a rebuild without weights."""
    sd = None
    if "shape" not in info:
        s = info["shape"] = shape_of(cfg)
        if cfg.init == "random":
            source, why = "random init", "the paper's"
            heads = MARKOV_HEADS if s["n_head"] > max(MARKOV_HEADS) else ()
        else:
            g, sd = load_checkpoint(cfg.init)
            source = find_weights(cfg.init)
            if g.activation == "gelu_new" and (g.n_embd, g.n_head) == (768, 12):
                heads, why = MARKOV_HEADS, "GPT-2 small's, Tab. 1"
            else:
                heads = find_markov_heads(sd["h.0.attn.c_attn.weight"], g.n_head, cfg.markov_r)
                why = f"Def. 4.1 with r={cfg.markov_r:g} on these weights"

        info["markov_heads"] = list(heads)
        print(f"blocks from {source}: {s['n_layer']} of width {s['n_embd']} with {s['n_head']} "
              f"heads ({s['activation']}); layer-0 Markov heads {label(heads)} ({why})")
        if cfg.markov_penalty and not heads:
            raise data_lib.DataError(f"--markov-penalty: Def. 4.1 (r={cfg.markov_r:g}) finds no "
                                     f"Markov head in layer 0 of {source}; lower --markov-r")

    # the model of that shape (a run from before CLIP-DT: GPT-2's activation)
    s = info["shape"]
    gpt = GPT2Config(n_embd=s["n_embd"], n_head=s["n_head"], n_layer=s["n_layer"],
                     layer_norm_epsilon=s["eps"], activation=s.get("activation", "gelu_new"))
    model = DecisionTransformer(gpt, info["obs_dim"], info["act_dim"], info["max_ep_len"],
                                dropout=cfg.dropout, moa=cfg.moa)
    if sd is not None:
        model.load_gpt2_blocks(sd)
    model.markov_heads = tuple(info["markov_heads"])

    # --freeze-attention (App. F's GPT2-DT (part))
    frozen = ("ln_f.", ".attn.c_attn.", ".attn.c_proj.", ".ln_1.", ".ln_2.")
    for name, p in model.named_parameters():
        p.requires_grad_(not (cfg.freeze_attention and any(part in name for part in frozen)))
    return model


def shape_of(cfg):
    """A new run's blocks, no weight read: --init's config (a hub name's downloaded first; random:
    GPT-2 small's), --n-layer."""
    g = (GPT2Config(n_embd=cfg.n_embd or 768, n_head=cfg.n_head or 12) if cfg.init == "random"
         else config_of(cfg.init))
    return dict(n_embd=g.n_embd, n_head=g.n_head, n_layer=cfg.n_layer or g.n_layer,
                eps=g.layer_norm_epsilon, activation=g.activation)


def param_groups(model):
    """AdamW's groups of trained parameters, the gate's without decay (departure 2)."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [dict(params=[p for n, p in trained if ".gate_" not in n]),
              dict(params=[p for n, p in trained if ".gate_" in n], weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def lr_factor(s, cfg):
    """--lr's factor at step s: App. C's warmup, then constant (LaMo's experiment.py#L397-L399)."""
    return min((s + 1) / max(1, cfg.warmup_steps), 1.0)


def paper_context(cfg, d):
    """The paper's K unless --context is given (departure 9)."""
    if cfg.context is not None:
        return cfg
    return dataclasses.replace(cfg, context=50 if d.goal_reaching else 20)


def loss_fn(model, batch, cfg):
    """Eq. 3's error + GPT2-P's alpha * G_Markov (Eq. 9), both means (departure 7)."""
    b = batch
    pred, aux = model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])
    # the real steps (LaMo's seq_trainer.py#L32-L44), their mean squared error (experiment.py#L413)
    err = ((pred.float() - b["actions"]) ** 2).mean(-1)  # (B, K)
    loss = (err * b["mask"]).sum() / b["mask"].sum()

    if cfg.markov_penalty:
        loss = loss + cfg.markov_penalty * markov_gate_mass(aux["gates"][0], b["mask"],
                                                            model.markov_heads)
    return loss


def policy(model, cfg):
    """Eq. 2's action: the live envs' contexts -> the current step's action."""
    def act(b, live):
        return model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])[0][:, -1]
    return act


def rollout(cfg):
    """How evaluate.py runs the policy: the context it keeps."""
    return dict(context=cfg.context)


def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the data's (departure 9)."""
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


@torch.no_grad()
def g_markov(model, probe):
    """G_Markov (Fig. 9) on a fixed batch for log.csv; {} without it, a gate or Markov heads."""
    if not (probe and model.blocks[0].attn.moa and model.markov_heads):
        return {}
    model.eval()
    b = probe
    gates = model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])[1]["gates"]
    model.train()
    return {"g_markov": f"{markov_gate_mass(gates[0], b['mask'], model.markov_heads).item():.4f}"}

# ---- training ----


def train(cfg, run, d=None):
    """Fine-tune GPT2-DT(MA) and evaluate it -> the first target's final evaluation.
    run: the evaluate.Run that keeps the folder, log and checkpoint (--resume: restores them)."""
    d = load_dataset(cfg) if d is None else d
    cfg = paper_context(cfg, d)
    ev.check_data(cfg, d)  # a context or target that means nothing for this data
    # a resumed run is rebuilt without the GPT-2 file
    device, info = ev.pick_device(cfg.device), run.ck["info"] if run.ck else d.info()

    # one step's memory, from shapes alone, before anything is allocated
    shape = dict(info, shape=info.get("shape") or shape_of(cfg), markov_heads=[])
    need = ev.check_memory(lambda: build_model(cfg, shape), lambda m, b: loss_fn(m, b, cfg),
                           d.sample(2, cfg.context, np.random.default_rng(0)), cfg.batch_size,
                           device)

    # the model (a new run's: GPT-2's blocks), the optimiser and the schedule
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)
    opt = torch.optim.AdamW(param_groups(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg))

    rng = np.random.default_rng(cfg.seed)  # draws the training windows
    # G_Markov's windows
    probe = d.sample(cfg.batch_size, cfg.context, np.random.default_rng(cfg.seed + 20_000))
    probe = {k: v.to(device) for k, v in probe.items()}

    # open the run, or with --resume restore all of the above as the run left it
    step = run.start(cfg, model, opt, sched, rng, d, info, need)
    if step == 0 and run.ck is None:
        run.add_row(step=0, wall_time="0.0", **g_markov(model, probe))  # before fine-tuning

    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)
    results = None
    with ev.StopSignal(run.saves) as stop:  # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = d.sample(cfg.batch_size, cfg.context, rng)
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}

            # forward, backward, clip the gradient, step the optimiser and the schedule (LaMo's
            # seq_trainer.py#L53-L56)
            with autocast:
                loss = loss_fn(fwd, batch, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1

            # log with G_Markov; evaluate and checkpoint, with gates.png (Fig. 9) and the early
            # checkpoint (Figs. 1/7)
            logged = step % cfg.log_every == 0 or step == cfg.steps
            run.log(step, loss, sched.get_last_lr()[0], **g_markov(model, logged and probe))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)
                run.save(step, model, opt, sched, rng, results)  # log.csv, ckpt.pt, curve.png
                plot_gates(run.rows, os.path.join(run.out, "gates.png"), model.markov_heads,
                           model.blocks[0].attn.n_head,
                           f"{SCRIPT} {run.variant} {d.dataset_id} seed {cfg.seed}")
                if step == cfg.keep_ckpt_at:
                    ev.write_atomic(os.path.join(run.out, f"ckpt_step{step}.pt"),
                                    lambda tmp: shutil.copyfile(os.path.join(run.out, "ckpt.pt"),
                                                                tmp))

        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)

    # a run resumed at --steps evaluates its checkpoint
    return run.finish(results or evaluate(model, d, cfg, device))

# ---- this file's analyses: they never train ----


def save_figure(fig, path, say=True):
    fig.tight_layout()
    ev.save_figure(fig, path, dpi=100)
    if say:
        print(f"wrote {path}")


def heatmap(fig, ax, A, cbar="attention probability", cmap="viridis", vmin=0, vmax=1, **labels):
    """A (numpy) on ax, with a colour bar; labels: ax.set's."""
    fig.colorbar(ax.imshow(A, cmap=cmap, vmin=vmin, vmax=vmax), ax=ax, fraction=0.046, label=cbar)
    ax.set(**labels)


def table(header, rows, fmt=".3f"):
    """Print a markdown table."""
    print("| " + " | ".join(map(str, header)) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{x:{fmt}}" if isinstance(x, float) else str(x) for x in row)
              + " |")


def label(heads):
    return "{" + ", ".join(map(str, heads)) + "}"


def plot_gates(rows, path, heads, n_head, title):
    """Fig. 9: layer 0's MoA weight of the Markov heads (G_Markov) and the others in training."""
    pts = [(int(r["step"]), float(r["g_markov"])) for r in rows if r.get("g_markov", "") != ""]
    if not pts:
        return
    s, g = zip(*pts)

    from matplotlib.figure import Figure
    fig = Figure(figsize=(6.5, 3.8))
    ax = fig.subplots()
    ax.plot(s, g, color="tab:red", label=f"Markov heads {label(heads)}")
    ax.plot(s, [1 - x for x in g], color="tab:blue", label=f"the other {n_head - len(heads)} heads")
    ax.axhline(len(heads) / n_head, ls=":", color="gray",
               label=f"uniform gate ({len(heads)}/{n_head})")

    ax.set(xlabel="gradient step", ylabel="layer-0 MoA weight\n(sum over the heads)", ylim=(0, 1))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, say=False)


def start_model(cfg, info, device="cpu"):
    """The run's model before fine-tuning, as train() builds it."""
    torch.manual_seed(cfg.seed)
    fresh = {k: info[k] for k in ("obs_dim", "act_dim", "max_ep_len", "goal_dim")}
    return build_model(cfg, fresh).to(device).eval()


def markov_analysis(cfg, given):
    """--markov: Def. 4.1 on the layer-0 heads at the start and after fine-tuning (Tab. 1, [P-old]
    Tabs. 2, 8); Fig. 3."""
    # the run's, if there is one: an --out given holds one, unless --init names the weights alone
    # (--out: the figure's folder)
    ran = ("out" in given and "init" not in given) or os.path.exists(
        os.path.join(ev.run_folder(SCRIPT, cfg, PRESETS), "ckpt.pt"))
    if ran:
        cfg, model, d, out = load_model(cfg, given)

    # the start: the run's random init (no run: the default shape), else --init's
    clip = False
    if cfg.init == "random":
        start = start_model(cfg, d.info() if ran else dict(obs_dim=1, act_dim=1, max_ep_len=1,
                                                           goal_dim=0))
        W0, n_head = start.blocks[0].attn.c_attn.weight.detach(), start.blocks[0].attn.n_head
    else:
        g, sd = load_checkpoint(cfg.init)
        W0, n_head = sd["h.0.attn.c_attn.weight"], g.n_head  # W0 (3C, C)
        clip = g.activation == "quick_gelu"

    weights = {"init": W0}
    if ran:
        weights["fine-tuned"] = model.blocks[0].attn.c_attn.weight.detach().cpu()
    tables = {lab: markov_table(W, n_head) for lab, W in weights.items()}

    # per head and layout: (i), the ratio, Markov at r = 8 / 20
    print(f"Markov-matrix test of the layer-0 heads (Def. 4.1) of {cfg.init}"
          + (f", at the start and after fine-tuning ({out})" if ran else ""))
    header, cells, found = ["head"], [[h] for h in range(n_head)], []
    for lab, rows in tables.items():
        for lay, name in (("model", "C x C"), ("head", "D x D")):
            markov = {r: [x["head"] for x in rows if x[f"{lay}_i"] and x[f"{lay}_ratio"] > r]
                      for r in (8, 20, cfg.markov_r)}
            header += [f"{lab} {name.replace(' ', '')} (i)", "ratio", "Markov r=8/20"]
            for h, row in enumerate(rows):
                cells[h] += ["✓" if row[f"{lay}_i"] else "×", f"{row[f'{lay}_ratio']:.2f}",
                             "/".join("✓" if h in markov[r] else "×" for r in (8, 20))]
            found.append(f"{lab}, {name}: Markov heads r=8 {label(markov[8])}, r=20 "
                         f"{label(markov[20])}, --markov-r {cfg.markov_r:g} "
                         f"{label(markov[cfg.markov_r])}")

    table(header, cells)
    print("\n".join(found))

    C = W0.shape[1]
    print(f"Remark 4.7's bound r > ln(d-1)+1: {math.log(C // n_head - 1) + 1:.2f} for "
          f"d={C // n_head}, {math.log(C - 1) + 1:.2f} for d={C}; GPT-2 small's Markov heads "
          f"(Tab. 1): {label(MARKOV_HEADS)}")
    if clip and n_head == len(CLIP_TAB8):
        print("[P-old] Tab. 8, CLIP's text tower at init, (i) and ratio per head: "
              + ", ".join(f"{h} {'✓' if i else '×'} {r}" for h, (i, r) in enumerate(CLIP_TAB8))
              + "; no Markov head")

    # Fig. 3: the ratio per head; A of a non-Markov and a Markov head (at init)
    marked = find_markov_heads(W0, n_head, cfg.markov_r)
    shown = [next((h for h in range(n_head) if h not in marked), 0), *marked[:1]]
    cols = 1 + 2 * len(shown)
    from matplotlib.figure import Figure
    fig = Figure(figsize=(4 * cols, 3.6 * len(weights)))
    axes = fig.subplots(len(weights), cols, squeeze=False)
    for row, (lab, W) in enumerate(weights.items()):
        ax = axes[row, 0]
        ax.bar(range(n_head), [x["model_ratio"] for x in tables[lab]],
               color=["tab:red" if h in marked else "tab:blue" for h in range(n_head)])
        ax.axhline(cfg.markov_r, ls=":", color="gray", label=f"r = {cfg.markov_r:g}")
        ax.set(xlabel="layer-0 head", ylabel="mean|A_ii| / mean|A_ij| (C x C)", yscale="log",
               xticks=range(n_head))
        ax.set_title(f"{lab}: Def. 4.1 (ii) ratio per head\n"
                     + ("red: Markov at init" if marked else "no head is Markov at init")
                     + f" (r = {cfg.markov_r:g})", fontsize=9)
        ax.legend(fontsize=7)
        for j, h in enumerate(shown):
            for k, (lay, crop) in enumerate((("model", 64), ("head", None))):
                A = head_qk_matrix(W, n_head, h, lay)[:crop, :crop].numpy()
                v = np.percentile(np.abs(A), 99) or 1.0
                ax = axes[row, 1 + 2 * j + k]
                heatmap(fig, ax, A, "A_ij", "RdBu_r", -v, v, xlabel="key dimension j",
                        ylabel="query dimension i")
                ax.set_title(f"{lab}, head {h}{' (Markov)' if h in marked else ''}: "
                             f"{'C×C, its first 64' if lay == 'model' else 'D×D'}\n"
                             f"ratio {tables[lab][h][lay + '_ratio']:.2f}", fontsize=9)

    if not ran:
        out = cfg.out or os.path.join("runs", SCRIPT, "clip" if clip else "gpt2")
    os.makedirs(out, exist_ok=True)
    save_figure(fig, os.path.join(out, "markov_heads.png"))
    return tables


def windows_and_start(cfg, model, d, n=32):
    """n windows of the run's data without padding, and the run's start."""
    rng, got = np.random.default_rng(cfg.seed + 30_000), []
    while sum(len(b["mask"]) for b in got) < n:
        b = d.sample(4 * n, cfg.context, rng)
        keep = b["mask"].all(dim=1)
        got.append({k: v[keep] for k, v in b.items()})

    windows = {k: torch.cat([b[k] for b in got])[:n] for k in got[0]}
    return windows, start_model(cfg, d.info(), next(model.parameters()).device)


@torch.no_grad()
def attention_probs(model, b):
    """Each layer's attention (B,N,3K,3K) of model on windows b, on the CPU."""
    dev = next(model.parameters()).device
    keys = ("states", "actions", "rtg", "timesteps", "mask")
    aux = model(*(b[k].to(dev) for k in keys), need_probs=True)[1]
    return [p.cpu() for p in aux["probs"]]


def attention_maps(cfg, given):
    """--attention-maps, Fig. 4: layer-0 attention before fine-tuning (Thm 4.3's random
    embeddings) and after; a Markov head's diagonal is bright."""
    cfg, model, d, out = load_model(cfg, given)
    b, start = windows_and_start(cfg, model, d)
    P = {lab: attention_probs(m, b)[0].mean(0) for lab, m in (("before", start), ("after", model))}
    heads, n_head = model.markov_heads, P["before"].shape[0]  # P: (N, 3K, 3K) of layer 0

    diag = {lab: diagonal_attention_mass(p[None]).tolist() for lab, p in P.items()}
    print(f"layer-0 attention of each token to itself, {len(b['mask'])} windows of K={cfg.context}"
          f"; Markov heads {label(heads)}")
    table(["head", "before", "after", "Markov head"],
          [[h, diag["before"][h], diag["after"][h], "yes" if h in heads else ""]
           for h in range(n_head)])

    # the maps of the Markov heads and one other (ticks: R_t)
    shown = [*heads, next((h for h in range(n_head) if h not in heads), 0)]
    ticks = range(0, 3 * cfg.context, 3 * max(1, cfg.context // 8))

    from matplotlib.figure import Figure
    fig = Figure(figsize=(3.6 * len(shown), 6.6))
    axes = fig.subplots(2, len(shown), squeeze=False)
    for r, (lab, p) in enumerate(P.items()):
        for c, h in enumerate(shown):
            heatmap(fig, axes[r, c], p[h].numpy(), xlabel="key token (R_1, s_1, a_1, R_2, ...)",
                    ylabel="query token", xticks=ticks, yticks=ticks,
                    title=f"{lab} fine-tuning: head {h}" + (" (Markov)" if h in heads else ""))
    save_figure(fig, os.path.join(out, "attention_maps.png"))
    return P


def attention_distance(cfg, given):
    """--attention-distance, Figs. 1/7: s_K's attention by distance at step 0, --keep-ckpt-at
    and the end."""
    cfg, model, d, out = load_model(cfg, given)
    b, start = windows_and_start(cfg, model, d)

    # the models by step
    models = {0: start}
    for path in glob.glob(os.path.join(out, "ckpt_step*.pt")):
        ck = ev.read_checkpoint(path, SCRIPT)
        m = build_model(cfg, ck["info"])
        m.load_state_dict(ck["model"])
        models[ck["step"]] = m.to(next(start.parameters()).device).eval()
    last = torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True,
                      mmap=True)["step"]

    models[last] = model

    # s_K is the last state token
    query = 3 * cfg.context - 2

    curves = {step: attention_by_distance(attention_probs(m, b), query)
              for step, m in sorted(models.items())}

    shown = min(query + 1, 16)
    print(f"attention of s_K by distance in tokens (0 = itself, 1 = R_K, 2 = a_(K-1), ...), the "
          f"mean of heads, layers and {len(b['mask'])} windows")
    table(["step", *range(shown)], [[step, *c[:shown].tolist()] for step, c in curves.items()])

    from matplotlib.figure import Figure
    fig = Figure(figsize=(6, 3.8))
    ax = fig.subplots()
    for step, c in curves.items():
        ax.plot(range(len(c)), c.numpy(), "o-", ms=3, label=f"step {step}")
    ax.set(xlabel="distance from s_K (tokens; 3 = one timestep)", ylabel="attention probability",
           title=f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}: attention of the last state token")
    ax.legend(fontsize=8)
    save_figure(fig, os.path.join(out, "attention_distance.png"))
    return curves


def importance_analysis(cfg, given, n_contexts=64):
    """--importance, Figs. 2, 8: head_importance on the contexts of rollouts."""
    cfg, model, d, out = load_model(cfg, given)
    seen, decide = [], policy(model, cfg)

    def act(batch, live):
        seen.append({k: v.clone() for k, v in batch.items()})
        return decide(batch, live)

    # n_contexts from a few rollouts
    with torch.no_grad():
        ev.evaluate(act, d, min(cfg.eval_episodes, 5), targets(cfg, d)[0], cfg.seed + 40_000,
                    device=next(model.parameters()).device, **rollout(cfg))
    allc = {k: torch.cat([s[k] for s in seen]) for k in seen[0]}
    pick = np.random.default_rng(cfg.seed).permutation(len(allc["mask"]))[:n_contexts]
    pick = torch.from_numpy(pick)

    imp = head_importance(model, {k: v[pick.to(v.device)] for k, v in allc.items()})  # (L, N)

    # the table, the top five, the bars by layer
    L, N = imp.shape
    print(f"head importance ||a' - a'_-head||_2 on {len(pick)} rollout contexts (layer x head)")
    table(["layer", *range(N)], [[layer, *imp[layer].tolist()] for layer in range(L)], fmt=".4f")

    top = torch.topk(imp.flatten(), min(5, imp.numel())).indices.tolist()
    print("most important heads (layer, head): " + ", ".join(f"({i // N}, {i % N})" for i in top))

    from matplotlib.figure import Figure
    fig = Figure(figsize=(max(6, 0.16 * L * N), 3.8))
    ax = fig.subplots()
    ax.bar(range(L * N), imp.flatten().numpy(),
           color=["tab:red" if i // N == 0 and i % N in model.markov_heads else "tab:blue"
                  for i in range(L * N)])
    ax.set_xticks(range(L * N), [str(i % N) for i in range(L * N)], fontsize=6)
    for layer in range(L):
        if layer:
            ax.axvline(layer * N - 0.5, color="gray", lw=0.5)
        ax.text(layer * N + N / 2 - 0.5, 1.0, f"layer {layer}", transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7)
    ax.set(xlabel="head (grouped by layer)", ylabel="||a' - a'_-head||_2 (action units)")
    ax.set_title(f"head importance (red: layer-0 Markov heads {label(model.markov_heads)})", pad=14)
    save_figure(fig, os.path.join(out, "head_importance.png"))
    return imp


def sample_text(cfg, given, max_new_tokens=40):
    """--sample PROMPT: GPT-2's continuation."""
    model, enc = load_gpt2_lm(cfg.init), tiktoken_gpt2()
    ids = enc.encode(cfg.sample) or [enc.eot_token]
    out = model.generate(torch.tensor([ids]), max_new_tokens,
                         generator=torch.Generator().manual_seed(cfg.seed))
    print(cfg.sample + enc.decode(out[0, len(ids):].tolist()))


def text_attention(cfg, given):
    """--text-attention TEXT: layer 0's attention on real text (Thm 4.3: the last input token)."""
    model, enc = load_gpt2_lm(cfg.init), tiktoken_gpt2()

    ids = enc.encode(cfg.text_attention)[:model.cfg.n_positions]
    if len(ids) < 2:
        raise data_lib.DataError("--text-attention needs a text of at least two tokens")

    with torch.no_grad():
        probs = model(torch.tensor([ids]), need_probs=True)[1][0]  # (1, N, T, T): layer 0

    # each head's attention to itself, to t-1, to token 0
    P = probs[0]
    mass = torch.stack([diagonal_attention_mass(probs),
                        P.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1),
                        P[:, 1:, 0].mean(-1)], dim=1).tolist()  # (N, 3)

    markov = MARKOV_HEADS if (model.cfg.n_embd, model.cfg.n_head) == (768, 12) else ()
    print(f"GPT-2 layer 0 on {len(ids)} tokens: mean attention to the token itself / the previous "
          f"/ the first")
    table(["head", "self", "previous", "first", "GPT-2 small's Markov head"],
          [[h, *mass[h], "yes" if h in markov else ""] for h in range(P.shape[0])])

    # the maps
    heads = [h for h in (*MARKOV_HEADS, 0) if h < P.shape[0]]
    toks = [enc.decode([i]) for i in ids]
    from matplotlib.figure import Figure
    fig = Figure(figsize=(3.8 * len(heads), 3.8))
    axes = fig.subplots(1, len(heads), squeeze=False)

    for ax, h in zip(axes[0], heads):
        heatmap(fig, ax, P[h].numpy(), xlabel="key token", ylabel="query token",
                title=f"head {h}" + (" (GPT-2 small's Markov head)" if h in markov else ""))
        if len(ids) <= 24:
            ax.set_xticks(range(len(ids)), toks, rotation=90, fontsize=6)
            ax.set_yticks(range(len(ids)), toks, fontsize=6)

    out = cfg.out or os.path.join("runs", SCRIPT, "gpt2")
    os.makedirs(out, exist_ok=True)
    save_figure(fig, os.path.join(out, "text_attention.png"))


ANALYSES = {"markov": markov_analysis, "attention_maps": attention_maps,
            "attention_distance": attention_distance, "importance": importance_analysis,
            "sample": sample_text, "text_attention": text_attention}

# ---- the pretrained weights (GPT-2's, CLIP's text tower), read and checked by hand ----

# CLIP ViT-B/32's text tower (HF CLIPTextConfig's defaults)
CLIP_TEXT = GPT2Config(vocab_size=49408, n_positions=77, n_embd=512, n_layer=12, n_head=8,
                       activation="quick_gelu")
# --init's hub names (a key or a repo): cached under each repo, fetched from the first
HUB = {"gpt2": dict(repos=("openai-community/gpt2", "gpt2"), what="GPT-2 small",
                    config=GPT2Config()),
       "clip": dict(repos=("openai/clip-vit-base-patch32",), what="CLIP ViT-B/32",
                    config=CLIP_TEXT)}


class CheckpointError(data_lib.DataError):
    """A GPT-2 or CLIP checkpoint that cannot be used."""


def hub(init):
    """--init's HUB entry, else None."""
    return next((h for name, h in HUB.items() if init == name or init in h["repos"]), None)


def find_weights(init="gpt2", allow_download=True):
    """--init -> its model.safetensors: a path's, or a hub name's, cached or downloaded once."""
    if h := hub(init):
        for repo in h["repos"]:
            path = try_to_load_from_cache(repo, "model.safetensors")
            if isinstance(path, str):
                return path
        if not allow_download:
            return None

        repo = h["repos"][0]
        print(f"downloading {h['what']} ({repo}) once into the Hugging Face cache", flush=True)

        # (HF_ENDPOINT: a mirror's)
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        endpoint = huggingface_hub.constants.ENDPOINT
        try:
            if not offline:  # no network: fail now, not after retries
                socket.getaddrinfo(urllib.parse.urlparse(endpoint).hostname, 443)
            hf_hub_download(repo, "config.json")
            return hf_hub_download(repo, "model.safetensors")
        except Exception as e:  # huggingface_hub's errors (offline, HTTP), httpx's, socket's
            why, missing = data_lib.download_failure(e, endpoint)
            why = f"{endpoint} does not hold {repo}" if missing else why
            raise CheckpointError(f"{h['what']} weights are not in the Hugging Face cache and "
                                  f"could not be downloaded ({why}); with a network run `hf "
                                  f"download {repo} model.safetensors config.json` once, pass "
                                  f"--init PATH to a local model.safetensors, or train from "
                                  f"random weights with --init random") from None

    # a path: the file, or its folder
    p = os.path.expanduser(init)
    if os.path.isdir(p):
        p = os.path.join(p, "model.safetensors")
    if not os.path.isfile(p):
        raise CheckpointError(f"no GPT-2 or CLIP checkpoint at {init} (a model.safetensors or its "
                              f"folder, or gpt2 or clip)")
    return p


def config_of(init, allow_download=True):
    """--init's config: the config.json beside its weights, else the hub name's."""
    path = find_weights(init, allow_download)  # None: a hub name not on disk yet
    cfg_path = os.path.join(os.path.dirname(path), "config.json") if path else ""
    if os.path.isfile(cfg_path):
        return config_from_json(cfg_path)
    return hub(init)["config"] if hub(init) else GPT2Config()


def load_checkpoint(init="gpt2"):
    """-> (config, the blocks' state dict: h.<i>.*, ln_f.*, nn.Linear layout), GPT-2's (and wte,
    wpe) or CLIP's text tower's, checked."""
    cfg, path = config_of(init), find_weights(init)
    if cfg.activation == "quick_gelu":  # CLIP's text tower
        return cfg, clip_state_from_hf(read_safetensors(path, keep=CLIP_TEXT_BLOCKS), cfg)
    return cfg, gpt2_state_from_hf(read_safetensors(path), cfg)


def load_gpt2_lm(init="gpt2"):
    """GPT-2's language model (random: GPT-2 small's), in eval mode."""
    cfg, sd = load_checkpoint("gpt2" if init == "random" else init)
    if cfg.activation == "quick_gelu":
        raise CheckpointError(f"{init} is CLIP's text tower, which has no language-model head")
    with torch.device("meta"):  # no init work: the weights are assigned
        model = GPT2(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()


def tiktoken_gpt2():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken fetches its BPE files once (errors vary by version)
        raise CheckpointError(f"tiktoken's GPT-2 encoding is not available ({type(e).__name__}); "
                              f"run once with a network, or set TIKTOKEN_CACHE_DIR") from None


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
# config.json: each GPT-2 field's largest value
GPT2_LIMITS = dict(vocab_size=1_000_000, n_positions=65_536, n_embd=12_288, n_layer=96,
                   n_head=256)
# CLIP's config.json names
CLIP_KEYS = dict(vocab_size="vocab_size", n_positions="max_position_embeddings",
                 n_embd="hidden_size", n_layer="num_hidden_layers", n_head="num_attention_heads",
                 layer_norm_epsilon="layer_norm_eps")


def read_safetensors(path, keep=""):
    """-> {name: tensor} of the names that start with keep, read by hand: u64 header length n,
    n bytes of JSON {name: {dtype, shape, data_offsets}}, little-endian data; all checked
    against the file's size first."""
    def bad(why):
        return CheckpointError(f"{path}: {why}")

    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    with f:
        # the header
        if size < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        n = int.from_bytes(f.read(8), "little")
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise bad(f"header length {n} does not fit the file ({size} bytes); truncated or not a "
                      f"safetensors file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: > 4300 digits too
            raise bad("the header is not valid JSON; not a safetensors file") from None
        if not isinstance(header, dict):
            raise bad("the header is not a JSON object")
        header.pop("__metadata__", None)

        # every entry's dtype, shape and offsets (a bool is not an int here)
        data_len = size - 8 - n
        spans = []
        for name, info in header.items():
            if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                    and isinstance(info.get("shape"), list)
                    and isinstance(info.get("data_offsets"), list)):
                raise bad(f"tensor '{name}' has a malformed header entry")
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise bad(f"tensor '{name}' has unknown dtype {str(info['dtype'])[:20]!r}")
            shape, offs = info["shape"], info["data_offsets"]
            if len(shape) > 16 or not all(type(s) is int and 0 <= s < 2 ** 40 for s in shape):
                raise bad(f"tensor '{name}' has an invalid shape {str(shape)[:60]}")
            if (len(offs) != 2 or not all(type(o) is int for o in offs)
                    or not 0 <= offs[0] <= offs[1] <= data_len):
                raise bad(f"tensor '{name}' has offsets {str(offs)[:60]} outside the data "
                          f"({data_len} bytes); the file is truncated or corrupt")
            if math.prod(shape) * SAFETENSORS_DTYPES[info["dtype"]].itemsize != offs[1] - offs[0]:
                raise bad(f"tensor '{name}' ({info['dtype']} {shape}) does not match its "
                          f"{offs[1] - offs[0]} bytes of data")
            spans.append((offs[0], offs[1], name))

        # no two overlapping
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise bad(f"tensors '{n0}' and '{n1}' overlap in the data")

        # the tensors kept
        out = {}
        for a, b, name in spans:
            if not name.startswith(keep):
                continue
            dtype = SAFETENSORS_DTYPES[header[name]["dtype"]]
            f.seek(8 + n + a)
            buf = bytearray(f.read(b - a))
            if len(buf) != b - a:
                raise bad(f"file ended while reading '{name}'")

            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            if sys.byteorder == "big":
                t = t.view(torch.uint8).view(-1, t.element_size()).flip(-1).reshape(-1).view(dtype)
            out[name] = t.reshape(header[name]["shape"])
        return out


def check_tensors(sd, shapes, what):
    """Every tensor of `shapes` in sd, floating-point, of its shape; else a CheckpointError."""
    missing = sorted(set(shapes) - set(sd))
    if missing:
        clip = what == "GPT-2" and any(
            k.endswith("encoder.layers.0.layer_norm1.weight") for k in sd)
        raise CheckpointError(f"not a {what} checkpoint with this config: {len(missing)} tensors "
                              f"missing (e.g. '{missing[0]}')" + (
                                  "; it looks like CLIP's text tower, whose config.json must sit "
                                  "beside it" if clip else ""))

    for k, s in shapes.items():
        if not sd[k].is_floating_point():
            raise CheckpointError(f"tensor '{k}' has dtype {str(sd[k].dtype).replace('torch.', '')}"
                                  f", expected floating-point weights")
        if tuple(sd[k].shape) != s:
            raise CheckpointError(f"tensor '{k}' has shape {tuple(sd[k].shape)}, expected {s}")


def block_shapes(cfg):
    """load_checkpoint's tensors -> shape."""
    C = cfg.n_embd
    shapes = {"ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        for part, weight in (("ln_1", (C,)), ("ln_2", (C,)), ("attn.c_attn", (3 * C, C)),
                             ("attn.c_proj", (C, C)), ("mlp.c_fc", (4 * C, C)),
                             ("mlp.c_proj", (C, 4 * C))):
            # (out, in), (out,)
            shapes[f"h.{i}.{part}.weight"], shapes[f"h.{i}.{part}.bias"] = weight, weight[:1]
    return shapes


def gpt2_state_from_hf(sd, cfg):
    """HF GPT-2 tensors -> GPT2's state dict, checked; HF's Conv1D weights (in, out) transposed
    to nn.Linear's (out, in)."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd = {k.removeprefix("transformer."): v.t() if k.endswith(conv1d) and v.dim() == 2 else v
          for k, v in sd.items()}
    shapes = {"wte.weight": (cfg.vocab_size, cfg.n_embd),
              "wpe.weight": (cfg.n_positions, cfg.n_embd)}
    shapes.update(block_shapes(cfg))

    check_tensors(sd, shapes, "GPT-2")
    return {k: sd[k].float().contiguous() for k in shapes}


# what CLIP-DT reads of a CLIP file (CLIPModel's or CLIPTextModel's)
CLIP_TEXT_BLOCKS = ("text_model.encoder.layers.", "text_model.final_layer_norm.",
                    "encoder.layers.", "final_layer_norm.")
# the blocks' names -> HF CLIPEncoderLayer's (nn.Linear's layout already)
CLIP_TO_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.c_proj": "self_attn.out_proj",
                 "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def clip_names(name):
    """A tensor of block_shapes -> the CLIP tensors it is made of (c_attn: q, k, v_proj)."""
    if name.startswith("ln_f."):
        return ["final_layer_norm." + name.removeprefix("ln_f.")]
    _, i, part = name.split(".", 2)  # h, <i>, e.g. attn.c_attn.weight
    part, x = part.rsplit(".", 1)
    if part == "attn.c_attn":
        return [f"encoder.layers.{i}.self_attn.{q}_proj.{x}" for q in "qkv"]
    return [f"encoder.layers.{i}.{CLIP_TO_BLOCK[part]}.{x}"]


def clip_state_from_hf(sd, cfg):
    """HF CLIP text-tower tensors -> the blocks' state dict, checked."""
    sd = {k.removeprefix("text_model."): v for k, v in sd.items()}

    shapes = {}
    for name, (rows, *cols) in block_shapes(cfg).items():
        for theirs in clip_names(name):
            # c_attn's 3C rows: C each of q, k, v
            shapes[theirs] = (rows // len(clip_names(name)), *cols)

    check_tensors(sd, shapes, "CLIP text-tower")
    return {name: torch.cat([sd[k] for k in clip_names(name)]).float().contiguous()
            for name in block_shapes(cfg)}


def config_from_json(path):
    """HF config.json -> GPT2Config (omitted fields: GPT-2 small's or CLIP_TEXT's), checked before
    anything is allocated."""
    def bad(why):
        return CheckpointError(f"{path}: {why}")

    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # ValueError: > 4300 digits too
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}); not a GPT-2 or CLIP "
                              f"config.json") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} is not a JSON object")

    # the model type: CLIPModel's (text_config) or CLIPTextModel's, else GPT-2's
    clip = hf.get("model_type") in ("clip", "clip_text_model")
    if clip:
        hf = (hf.get("text_config") or {}) if hf["model_type"] == "clip" else hf
        if not isinstance(hf, dict):
            raise bad("text_config is not a JSON object")
        if hf.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise bad(f"hidden_act {str(hf['hidden_act'])[:30]!r} is not OpenAI CLIP's quick_gelu")
    elif hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise bad(f"activation {str(hf['activation_function'])[:30]!r} is not GPT-2's tanh GELU")

    # each field a whole number in its bounds (keys: ours -> the file's)
    default, keys = (CLIP_TEXT, CLIP_KEYS) if clip else (GPT2Config(), {})
    values = {}
    for name, top in GPT2_LIMITS.items():
        key = keys.get(name, name)
        v = values[name] = hf.get(key, getattr(default, name))
        if type(v) is not int or not 1 <= v <= top:
            raise bad(f"{key} must be a whole number from 1 to {top:,}, got {str(v)[:30]}")

    key = keys.get("layer_norm_epsilon", "layer_norm_epsilon")
    eps = hf.get(key, default.layer_norm_epsilon)
    if type(eps) not in (int, float) or not (math.isfinite(eps) and 0 < eps < 1):
        raise bad(f"{key} must be a small positive number, got {str(eps)[:30]}")
    C, N = values["n_embd"], values["n_head"]
    if C % N:
        raise bad(f"{keys.get('n_embd', 'n_embd')} {C} is not divisible by "
                  f"{keys.get('n_head', 'n_head')} {N}")
    if clip and hf.get("intermediate_size", 4 * C) != 4 * C:
        raise bad(f"intermediate_size {str(hf['intermediate_size'])[:30]} is not 4 x hidden_size "
                  f"{C}")
    return dataclasses.replace(default, **values, layer_norm_epsilon=float(eps))

# ---- what the plumbing needs that no paper says: the script, its log's columns, its tokens ----

SCRIPT = "gpt2_dtma"
LOG_COLUMNS = ("g_markov",)


def batch_tokens(cfg):
    """Tokens in one training batch, for --bench's tokens/s."""
    return 3 * cfg.context * cfg.batch_size

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
