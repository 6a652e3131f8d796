"""
GPT2-DT and GPT2-DTMA (Zhao et al., "Unveiling Markov Heads in Pretrained Language Models for Offline Reinforcement
Learning"; [P-old] is its earlier version, "Enhancing Cross-domain Pre-Trained Decision Transformers with Adaptive
Attention", arXiv 2409.06985): a Decision Transformer whose body is pretrained GPT-2 small, a Mixture-of-Attention gate
over each layer's heads, and the Markov-head analysis.

GPT-2's first layer holds Markov heads (Def. 4.1-4.2, Thms 4.3-4.5): they attend to the current state s_t whatever
the embeddings and the fine-tuning, which helps MuJoCo and hurts long-horizon mazes. GPT2-DTMA's per-token softmax
gate weighs every layer's heads (Eqs. 6-8), so that fine-tuning can turn the Markov heads down.

    python gpt2_dtma.py --env hopper-medium                   # GPT2-DTMA; downloads GPT-2 small once (548 MB)
    python gpt2_dtma.py --env hopper-medium --preset cpu      # the first GPT-2 block, 300 steps: a 2-core CPU
    python gpt2_dtma.py --sample "The meaning of life is"     # proof that the real GPT-2 weights loaded
    python gpt2_dtma.py --env hopper-medium --importance      # an analysis of the run's checkpoint (never trains)
    python gpt2_dtma.py --out <run folder> --target-sweep     # DT's Fig. 4: the return achieved against the target

The paper's variants are flags, each help naming its tables: --no-moa (GPT2-DT), --init random (DT, DTMA), --init clip
--no-moa (CLIP-DT), --markov-penalty 0.1 (GPT2-P), --freeze-attention --no-moa (GPT2-DT (part)), --context; log.csv's
g_markov and gates.png give Fig. 9. Analyses of a run's checkpoint: --markov, --attention-maps, --attention-distance,
--importance; --sample and --text-attention check the loaded GPT-2 on real text.

Glossary (paper symbol -> code name, shape):
    R^_t        return-to-go (Eq. 2), times the return scale      rtg (B, K, 1)
    s_t, a_t    state (normalised), action in [-1, 1]             states (B, K, obs_dim), actions (B, K, act_dim)
    a'_t        predicted action (Eq. 2), from the s_t token      DecisionTransformer.forward(...)[0] (B, K, act_dim)
    K, T        context in timesteps (Tabs. 5-6's k), tokens 3K  Config.context, T
    e, E        one token's input to a head, the sequence         x (B, T, C): the LN1 output
    C, N, d_k   width (768), heads per layer (12), head width 64  n_embd, n_head, D = C // N
    W_i^q/k/v   head i's query/key/value projections              c_attn.weight rows [iD, (i+1)D) + 0, C, 2C (nn.Linear)
    Head_i(e)   head i's output (Eq. 8)                           o[:, i] (B, N, T, D) in CausalSelfAttention
    W_g, G_i(e) the MoA gate (Eq. 7): softmax over the N heads   gate_weight (N, C), gate_bias (N,); gate (B, T, N)
    A_i         W_i^q (W_i^k)^T (Def. 4.2)                        head_qk_matrix(...) (C, C), or (D, D) per Remark 4.7
    r           Def. 4.1 (ii)'s threshold (8 in the paper, 20 in [P-old])     Config.markov_r
    G_Markov    layer-0 gate weight of the Markov heads (Tabs. 5-6)          markov_gate_mass(...), log column g_markov
    alpha       GPT2-P's penalty weight (Eq. 9)                   Config.markov_penalty

Layout: Config -> the model (copy it alone) -> the Markov-head quantities -> the paper's pieces -> train() -> figures
and analyses -> the pretrained weights -> --bench and main(). Outputs: runs/gpt2_dtma/<env>/<variant>/seed<N>/.

The papers publish no code. GPT2-DT names LaMo (Shi et al. 2024) as its implementation; the lines marked LaMo follow
https://github.com/srzer/LaMo-2023/blob/3e4fcc8a7e68916882033a0cef110370c0144022/experiment-d4rl/decision_transformer/models/decision_transformer.py#L102-L199
and the order of the timestep embedding follows DT's
https://github.com/kzl/decision-transformer/blob/e2d82e68f330c00f763507b3b01d774740bee53f/gym/decision_transformer/models/decision_transformer.py#L68-L78

Departures from the paper and the official code:
 1. Full fine-tuning of GPT-2 with linear embeddings, as App. F states for GPT2-DT; LaMo's run.sh#L43-L46 trains
    LoRA on c_attn (the rest frozen) with MLP embeddings, and may co-train on WikiText: none of it is in the paper.
 2. One AdamW group at App. C's lr 1e-4 and weight decay 1e-4 (the gate without decay, which pulls it to uniform);
    LaMo gives the pretrained weights lr 1e-5 and no decay, AdamW eps 1e-6 (utils.py#L6-L62), warmup 2500.
 3. The timestep embedding is added before embed_ln, as in DT; LaMo adds it after (decision_transformer.py#L174-L176).
 4. The MoA gate's place, scale and init are open in the paper; here, as in MoH (Jin et al. 2024), it reads the LN1
    output and scales each head before the pretrained c_proj, times N, from zero: GPT2-DTMA equals GPT2-DT at step 0
    (a literal Eq. 6 has no output projection and would shrink every head to 1/N). Every layer is gated.
 5. Eq. 7's single linear gate adds 0.13% parameters to GPT-2 small (12 x 9,228), not Sec. 5.2's "approximately 3%".
 6. Eq. 8's d_k is the head width, 64, as in GPT-2 (the paper: "the dimension of the embedding layer", which would
    change the pretrained function).
 7. Eq. 3's sum is a mean over the real steps (the DT and LaMo code); Eq. 9's G_Markov is averaged over the real
    tokens of the batch (the paper writes it for one input).
 8. Def. 4.1's threshold r defaults to [P-old]'s 20, not the paper's 8 (only 20 explains Tab. 1's head 9); A_i is
    read both as C x C (Def. 4.1, Thm 4.3) and as D x D (Remark 4.7).
 9. Unstated in the paper: dropout 0.1 and gradient clip 0.25 (DT, LaMo), K 20 on MuJoCo and 50 on mazes (Tabs. 5-6's
    rows equal Tabs. 3-4), the dataset's target returns, and GPT-2 small's shape for DT and DTMA (--init random).
10. CLIP-DT takes CLIP's text-tower layers and final LayerNorm only; GPTJ-DT (6B parameters) is refused.
"""
import dataclasses
import glob
import json
import math
import os
import shutil
import socket
import sys
import urllib.parse
from dataclasses import dataclass, field

import huggingface_hub.constants
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from huggingface_hub import hf_hub_download, try_to_load_from_cache

import data as data_lib
import evaluate as ev

def arg(default, help, run=False):
    """A Config field that is also a command-line flag. run=True: it does not change what is trained (seed,
    evaluation, output, device...), so it is left out of the run folder's variant name and may differ on --resume."""
    return field(default=default, metadata={"help": help, "run": run})

@dataclass
class Config:
    # --- the paper's settings (what is trained): App. C's optimiser and batch, GPT-2 small's blocks, the MoA gate
    delayed_reward: bool = arg(False, "every reward paid at its episode's last step, in the data and in evaluation "
                                      "(DT Table 5, DeMa Table 13); the score is still the env's own return")
    batch_size: int = arg(64, "windows per batch (App. C)")
    context: int = arg(None, "K (Tabs. 5-6); default: 20 on MuJoCo, 50 on mazes (the rows that equal Tabs. 3-4)")
    lr: float = arg(1e-4, "AdamW learning rate (App. C)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (App. C); the MoA gate gets none")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (App. C, Remark 4.9)")
    grad_clip: float = arg(0.25, "gradient-norm clip (the DT and LaMo code; the paper is silent)")
    preset: str = arg("", "'cpu': the first GPT-2 block, batch 32, K=10, 300 steps: for a 2-core machine")
    amp: bool = arg(False, "bf16 autocast for the forward pass (for CUDA; the loss is reduced in fp32)")
    init: str = arg("gpt2", "'gpt2', 'clip' (CLIP ViT-B/32's text tower: CLIP-DT, Tab. 7), a model.safetensors or its "
                            "folder, or 'random' (DT / DTMA of Tabs. 3-4); 'gptj' (GPTJ-DT, 6B) is refused")
    n_layer: int = arg(None, "keep the first N blocks (layer 0 holds the Markov heads); default: all (12)")
    n_embd: int = arg(None, "width; default: the checkpoint's (768, also for --init random)")
    n_head: int = arg(None, "heads per layer; default: the checkpoint's (12, also for --init random)")
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals (DT, LaMo; the paper is silent)")
    moa: bool = arg(True, "the Mixture-of-Attention gate (GPT2-DTMA, Eqs. 6-7); --no-moa: GPT2-DT (Tabs. 2-4)")
    markov_penalty: float = arg(0.0, "alpha of Eq. 9: penalise the Markov heads' layer-0 gate (GPT2-P of Tab. 3: 0.1)")
    markov_r: float = arg(20.0, "Def. 4.1 (ii)'s r, for the Markov heads of checkpoints other than GPT-2 small's")
    freeze_attention: bool = arg(False, "fine-tune only the embeddings and FFNs (GPT2-DT (part): App. F, Tab. 8)")
    # --- the run (seed, data, evaluation, output, device, analyses): these do not change what is trained
    env: str = arg("hopper-medium", "short dataset name (see data.SHORT_NAMES)", run=True)
    dataset: str = arg("", "any Minari dataset id, local or remote; overrides --env", run=True)
    seed: int = arg(0, "seed for sampling, initialisation and evaluation", run=True)
    steps: int = arg(100_000, "gradient steps (App. C: 100K)", run=True)
    eval_every: int = arg(500, "evaluate (and checkpoint) every this many steps, and at the end (App. C)", run=True)
    eval_episodes: int = arg(20, "episodes per target return, run in parallel (App. C: 20)", run=True)
    target_return: float = arg(None, "return-to-go prompt, raw units; default: the dataset's targets", run=True)
    log_every: int = arg(100, "print and log the training loss and G_Markov every this many steps", run=True)
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, cuda:N, mps", run=True)
    out: str = arg("", "output folder; default runs/gpt2_dtma/<env>/<variant>/seed<N>", run=True)
    resume: bool = arg(False, "continue the run in the output folder (its settings come from its checkpoint)", run=True)
    compile: bool = arg(False, "torch.compile the model for training (same results within float tolerance)", run=True)
    bench: bool = arg(False, "time training steps (eager, compiled, AMP on CUDA) on synthetic data, and exit", run=True)
    keep_ckpt_at: int = arg(0, "also keep this step's checkpoint (ckpt_step<STEP>.pt, for Figs. 1/7)", run=True)
    # analyses (each reads the run's checkpoint, prints a table and writes a PNG in the run folder; none trains)
    markov: bool = arg(False, "Markov test of the layer-0 heads (Tab. 1, Fig. 3; CLIP: [P-old] Tab. 8); without a "
                              "run: --init's", run=True)
    attention_maps: bool = arg(False, "layer-0 attention before and after fine-tuning (Fig. 4)", run=True)
    attention_distance: bool = arg(False, "attention by token distance, early and late (Figs. 1/7)", run=True)
    importance: bool = arg(False, "head importance by zeroing each head during rollouts (Figs. 2, 8)", run=True)
    gif: bool = arg(False, "write episode.gif: one evaluation episode of the run's checkpoint", run=True)
    target_sweep: bool = arg(False, "target_sweep.png (DT's Fig. 4): the return achieved at 8 targets, from the "
                                    "data's lowest to above its best", run=True)
    # checks of the GPT-2 weights alone (no run needed)
    text_attention: str = arg("", "TEXT: GPT-2's layer-0 attention on real text, Markov heads marked", run=True)
    sample: str = arg("", "PROMPT: print GPT-2's continuation, the proof that the real weights loaded", run=True)

# 2 CPU cores, minutes: the first GPT-2 block (768 wide, so the pretrained weights fit; layer 0 holds the Markov heads),
# K=10, a short warmup, one evaluation; mazes: dt.py's K=1 without dropout, 50 episodes. A demonstration only.
PRESETS = {"cpu": dict(n_layer=1, batch_size=32, context=10, lr=3e-4, warmup_steps=50, steps=300, eval_every=300,
                       eval_episodes=10, log_every=25, mazes=dict(context=1, dropout=0.0, eval_episodes=50))}

# >>> model: begin (needs only torch, math and dataclasses: copy this block, with Config and arg above, into your code)

class CausalSelfAttention(nn.Module):
    """GPT-2 causal self-attention with the optional Mixture-of-Attention gate of GPT2-DTMA (Sec. 4.2):
        Head_i(e) = softmax((e W_i^q)(E W_i^k)^T / sqrt(d_k)) (E W_i^v)                                     (Eq. 8)
        G_i(e)    = softmax_i(W_g e): a weight per head and token, summing to 1 over the layer's N heads      (Eq. 7)
        y(e)      = sum_i G_i(e) Head_i(e)                                                                  (Eq. 6)
    The gate reads the LN1 output and scales each head before the pretrained c_proj, times N, from zero (departure 4):
    N * 1/N = 1, so GPT2-DTMA equals GPT2-DT at step 0."""

    def __init__(self, n_embd, n_head, dropout=0.0, moa=False):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head, self.dropout, self.moa = n_head, dropout, moa
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)      # W^q, W^k, W^v of all heads (HF's Conv1D weight, transposed)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)
        if moa:  # W_g and b_g of Eq. 7, zero, made without drawing random numbers: GPT2-DT and GPT2-DTMA of one seed
            self.gate_weight = nn.Parameter(torch.zeros(n_head, n_embd))   # start from the same other weights
            self.gate_bias = nn.Parameter(torch.zeros(n_head))

    def forward(self, x, attn_mask=None, need_probs=False):
        """x (B,T,C): the LN1 output; attn_mask (B,1,T,T) bool, True = may attend, or None for plain causal.
        -> y (B,T,C) and aux: 'gate' (B,T,N) with MoA, 'probs' (B,N,T,T) with need_probs."""
        B, T, C = x.shape
        N = self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)                          # 3 x (B, T, C)
        q, k, v = (z.view(B, T, N, C // N).transpose(1, 2) for z in (q, k, v))  # (B, N, T, D)
        p_drop = self.dropout if self.training else 0.0
        aux = {}
        if need_probs:  # Eq. 8 written out for the analyses that plot the probabilities (SDPA does not return them)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(C // N)           # (B, N, T, T)
            allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() if attn_mask is None else attn_mask
            aux["probs"] = F.softmax(att.masked_fill(~allowed, float("-inf")), dim=-1)   # (B, N, T, T)
            o = F.dropout(aux["probs"], p_drop, self.training) @ v          # (B, N, T, D)
        else:  # Eq. 8, d_k = the head width as in GPT-2 (departure 6)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=p_drop,
                                               is_causal=attn_mask is None)   # (B, N, T, D)
        if self.moa:
            g = aux["gate"] = F.softmax(F.linear(x, self.gate_weight, self.gate_bias), dim=-1)   # (B, T, N) Eq. 7
            o = o * (N * g).transpose(1, 2).unsqueeze(-1)                 # (B, N, T, D)  Eq. 6, times N
        y = o.transpose(1, 2).contiguous().view(B, T, C)                   # (B, T, C): heads side by side
        return self.resid_drop(self.c_proj(y)), aux

class MLP(nn.Module):
    """The 4x wide feed-forward layer: 'gelu_new' (GPT-2's tanh GELU) or 'quick_gelu' (CLIP's x * sigmoid(1.702 x))."""

    def __init__(self, n_embd, dropout=0.0, activation="gelu_new"):
        super().__init__()
        assert activation in ("gelu_new", "quick_gelu"), activation
        self.activation = activation
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        h = self.c_fc(x)
        h = F.gelu(h, approximate="tanh") if self.activation == "gelu_new" else h * torch.sigmoid(1.702 * h)
        return self.drop(self.c_proj(h))

class Block(nn.Module):
    """GPT-2 block: pre-LN attention and MLP, each residual; with activation='quick_gelu', CLIP's text-tower layer."""

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
    """GPT2-DT / GPT2-DTMA: DT's embeddings and action head around GPT-2 blocks (App. C: "GPT2-small pretrained
    parameters to initialize DT transformer layer"), every layer gated with cfg.moa (Eqs. 6-7). cfg.n_embd and
    cfg.n_head must be set (build_model takes them from the checkpoint); activation='quick_gelu': CLIP-DT (Tab. 7)."""

    def __init__(self, cfg, obs_dim, act_dim, max_ep_len, eps=1e-5, activation="gelu_new"):
        super().__init__()
        C = cfg.n_embd
        # the paper only says GPT-2 initialises the transformer layers; the embeddings and the head are LaMo's
        # (srzer/LaMo-2023@3e4fcc8 experiment-d4rl/decision_transformer/models/decision_transformer.py#L102-L135): a
        # learned timestep embedding in place of GPT-2's wpe (unused, as are wte and CLIP's own embeddings)
        self.embed_timestep = nn.Embedding(max_ep_len, C)
        self.embed_return = nn.Linear(1, C)                  # a linear layer per modality
        self.embed_state = nn.Linear(obs_dim, C)
        self.embed_action = nn.Linear(act_dim, C)
        self.embed_ln = nn.LayerNorm(C)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(C, cfg.n_head, cfg.dropout, eps, cfg.moa, activation)
                                     for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(C, eps=eps)
        self.predict_action = nn.Sequential(nn.Linear(C, act_dim), nn.Tanh())  # actions live in [-1, 1]
        self.apply(_init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2 * n_layer)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @torch.no_grad()
    def load_gpt2_blocks(self, sd):
        """Copy the first len(self.blocks) blocks and ln_f of load_checkpoint's state dict; the rest stays new."""
        for name, p in self.named_parameters():
            if name.startswith(("blocks.", "ln_f.")) and ".gate_" not in name:
                p.copy_(sd[name.replace("blocks.", "h.", 1)])

    def forward(self, states, actions, rtg, timesteps, mask, need_probs=False):
        """states (B,K,obs), actions (B,K,act), rtg (B,K,1), timesteps (B,K), mask (B,K) -> actions (B,K,act), and
        aux: 'gates' per layer, (B,3K,N) with MoA else None; 'probs' per layer, (B,N,3K,3K) with need_probs else None.
        The prediction at position t sees R_1..R_t, s_1..s_t, a_1..a_{t-1} only (Eq. 2)."""
        B, K, _ = states.shape
        # srzer/LaMo-2023@3e4fcc8 experiment-d4rl/decision_transformer/models/decision_transformer.py#L159-L199, with
        # the timestep added before embed_ln as in DT:
        # kzl/decision-transformer@e2d82e6 gym/decision_transformer/models/decision_transformer.py#L68-L78
        time = self.embed_timestep(timesteps)                                   # (B, K, C)
        tokens = [self.embed_return(rtg) + time,                               # R_t
                  self.embed_state(states) + time,                             # s_t
                  self.embed_action(actions) + time]                           # a_t
        x = torch.stack(tokens, dim=2).reshape(B, 3 * K, -1)                   # (B, 3K, C): R_1, s_1, a_1, R_2, ...
        x = self.drop(self.embed_ln(x))                                         # (B, 3K, C)
        # causal mask, and no attention to left padding; a padding query may see itself (its output is never used),
        # so that no row of the softmax is empty
        real = mask.bool().repeat_interleave(3, dim=1)                          # (B, 3K)
        causal = torch.ones(3 * K, 3 * K, dtype=torch.bool, device=x.device).tril()
        eye = torch.eye(3 * K, dtype=torch.bool, device=x.device)
        attn_mask = (causal & (real[:, None, :] | eye))[:, None]               # (B, 1, 3K, 3K)
        gates, probs = [], []
        for block in self.blocks:
            x, aux = block(x, attn_mask, need_probs)
            gates.append(aux.get("gate"))
            probs.append(aux.get("probs"))
        x = self.ln_f(x).reshape(B, K, 3, -1)                                   # (B, K, 3, C)
        a_pred = self.predict_action(x[:, :, 1])   # Eq. 2: a'_t from the s_t token: (B, K, act)
        return a_pred, dict(gates=gates, probs=probs)

@dataclass
class GPT2Config:     # GPT-2 small's; CLIP_TEXT below holds CLIP's text tower under the same names
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    activation: str = "gelu_new"          # the MLP's (GPT-2: tanh GELU)

class GPT2(nn.Module):
    """The GPT-2 language model (inference only: --sample, --text-attention). Parameter names follow Hugging Face's
    GPT2LMHeadModel without the 'transformer.' prefix (wte, wpe, h.<i>.*, ln_f), with nn.Linear weights."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg.n_embd, cfg.n_head, eps=cfg.layer_norm_epsilon, activation=cfg.activation)
                                for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)

    def forward(self, idx, need_probs=False):
        """idx (B,T) token ids -> logits (B,T,vocab); with need_probs also each layer's probabilities (B,N,T,T)."""
        T = idx.shape[1]
        assert T <= self.cfg.n_positions, f"{T} tokens are more than n_positions={self.cfg.n_positions}"
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))      # (B, T, C)
        probs = []
        for block in self.h:
            x, aux = block(x, need_probs=need_probs)
            probs.append(aux.get("probs"))
        logits = self.ln_f(x) @ self.wte.weight.t()                           # (B, T, vocab): lm_head tied to wte
        return (logits, probs) if need_probs else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=40, generator=None):
        """nanoGPT sampling: idx (1,T) -> (1,T+max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.n_positions:])[:, -1, :] / temperature   # (1, vocab)
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]     # (1, 1): keep the top k
            logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
# <<< model: end

# ----------------------------------------------------------------------------------------------------------------
# the paper's analysis quantities (pure torch): Markov heads (Def. 4.1-4.2), G_Markov (Eq. 9, Tabs. 5-6), attention
# to the last token (Thm 4.3, Fig. 4), attention by distance (Figs. 1/7), head importance (Sec. 4.1.2, Fig. 2)

MARKOV_HEADS = (1, 5, 10)   # GPT-2 small's layer-0 Markov heads (Tab. 1; Eq. 9 penalises exactly these)
# [P-old] Tab. 8: CLIP's text tower at init, per layer-0 head: R.1 (condition (i)) and the R.2 ratio (condition (ii))
CLIP_TAB8 = ((True, 2.26), (True, 1.67), (False, 5.89), (False, 6.49), (True, 2.49), (True, 2.25), (True, 2.99),
             (False, 7.49))

def head_qk_matrix(c_attn_weight, n_head, i, layout="model"):
    """A_i = W_i^q (W_i^k)^T of head i (Def. 4.2) from c_attn_weight (3C, C), biases and the LN1 gain ignored as in the
    paper: layout 'model' the C x C bilinear form q_i . k_j = x_i A x_j^T (Def. 4.1, Thm 4.3), 'head' the D x D
    product Wq_i Wk_i^T (Remark 4.7's d = 64): the paper does not say which (departure 8)."""
    C = c_attn_weight.shape[1]
    D = C // n_head
    Wq = c_attn_weight.detach()[i * D:(i + 1) * D].double()                # (D, C)
    Wk = c_attn_weight.detach()[C + i * D:C + (i + 1) * D].double()        # (D, C)
    return Wq.t() @ Wk if layout == "model" else Wq @ Wk.t()               # (C, C) or (D, D)

def markov_stats(A, r=20.0, eps=1e-8):
    """Def. 4.1: A is Markov iff (i) every A_ii > 0 and (ii) mean_i |A_ii| / mean_{i!=j} |A_ij| > r; eps in the
    denominator as in [P-old] Remark 3; r = 20, [P-old]'s, not the paper's 8 (departure 8)."""
    A = A.double()
    d = A.shape[0]
    diag = A.diagonal()
    mean_off = (A.abs().sum() - diag.abs().sum()) / (d * d - d)
    ratio = float(diag.abs().mean() / (mean_off + eps))
    cond_i = bool((diag > 0).all())
    return {"cond_i": cond_i, "ratio": ratio, "markov": cond_i and ratio > r}

def markov_table(c_attn_weight, n_head):
    """Per head of one layer, for both layouts: condition (i) and the ratio of (ii). -> list of dict rows."""
    rows = []
    for i in range(n_head):
        row = {"head": i}
        for layout in ("model", "head"):
            st = markov_stats(head_qk_matrix(c_attn_weight, n_head, i, layout))
            row[f"{layout}_i"], row[f"{layout}_ratio"] = st["cond_i"], st["ratio"]
        rows.append(row)
    return rows

def find_markov_heads(c_attn_weight, n_head, r=20.0):
    """The Markov heads of a layer by Def. 4.1 on the C x C reading, threshold r. -> tuple of head indices."""
    return tuple(i for i in range(n_head) if markov_stats(head_qk_matrix(c_attn_weight, n_head, i), r)["markov"])

def markov_gate_mass(gates, mask, heads):
    """G_Markov (Tabs. 5-6, Eq. 9): the layer-0 gate weight of the Markov heads, summed over those heads and averaged
    over the real tokens. gates (B,3K,N) softmax gate of layer 0; mask (B,K). Differentiable (GPT2-P's penalty)."""
    m = mask.repeat_interleave(3, dim=1).to(gates.dtype)                    # (B, 3K)
    g = gates[..., list(heads)].sum(-1)                                     # (B, 3K)
    return (g * m).sum() / m.sum().clamp_min(1.0)

def diagonal_attention_mass(probs, mask=None):
    """Mean attention a token pays to itself (Thm 4.3, Fig. 4), per head: probs (B,N,T,T) -> (N,); mask (B,T): the
    rows to average. Row 0 is left out: a causal first token can only attend to itself."""
    d = probs.diagonal(dim1=-2, dim2=-1)[..., 1:]                           # (B, N, T-1)
    m = torch.ones_like(d[:, :1]) if mask is None else mask[:, None, 1:].to(d.dtype)   # (B, 1, T-1)
    return (d * m).sum(dim=(0, 2)) / (m.sum() * 1.0).clamp_min(1.0)

def attention_by_distance(probs, query):
    """Figs. 1/7: the attention of token `query` to the tokens 0..query back, averaged over layers, windows and heads.
    probs: list of (B,N,T,T) per layer. -> (query+1,), summing to 1."""
    P = torch.stack(list(probs))[..., query, :query + 1]                    # (L, B, N, query+1): keys 0..query
    return P.flip(-1).mean(dim=(0, 1, 2))                                   # (query+1,): distance 0 = itself

@torch.no_grad()
def head_importance(model, batch):
    """Sec. 4.1.2 / Fig. 2: the importance of head (l, i) is ||a' - a'_{-(l,i)}||_2, the change of the last step's
    action when that head's output is zeroed, averaged over the batch. -> (L, N) on the CPU. A layer's N ablations
    ride in one batch: replica h has head h zeroed by a forward pre-hook on c_proj (input: the heads side by side)."""
    model.eval()
    s, a, R, t, m = (batch[k] for k in ("states", "actions", "rtg", "timesteps", "mask"))
    base = model(s, a, R, t, m)[0][:, -1]                                   # (B, act)
    B, N = s.shape[0], model.blocks[0].attn.n_head
    D = model.blocks[0].attn.c_proj.in_features // N
    rep = lambda x: x.repeat(N, *([1] * (x.dim() - 1)))                     # (N*B, ...)  # noqa: E731
    keep = (1.0 - torch.eye(N, device=s.device)).repeat_interleave(B, dim=0)   # (N*B, N): replica h*B+b drops head h
    keep = keep.repeat_interleave(D, dim=1)[:, None, :]                     # (N*B, 1, C)
    imp = torch.zeros(len(model.blocks), N)
    for layer, block in enumerate(model.blocks):
        hook = block.attn.c_proj.register_forward_pre_hook(lambda mod, args: (args[0] * keep.to(args[0].dtype),))
        try:
            abl = model(rep(s), rep(a), rep(R), rep(t), rep(m))[0][:, -1]   # (N*B, act)
        finally:
            hook.remove()
        imp[layer] = (abl.view(N, B, -1) - base[None]).norm(dim=-1).mean(dim=1).cpu()
    return imp

# ----------------------------------------------------------------------------------------------------------------
# the paper's pieces: the blocks and their Markov heads, optimiser groups, context, loss, policy, G_Markov

SCRIPT = "gpt2_dtma"
GPTJ_NAMES = ("gptj", "gpt-j", "gpt-j-6b", "eleutherai/gpt-j-6b")   # GPTJ-DT ([P-new] Tab. 7): refused (check_model)

def check_model(cfg):
    """This file's own flags (evaluate.check_flags has the common ones): one sentence (DataError) about the first."""
    if cfg.init.lower() in GPTJ_NAMES:
        raise data_lib.DataError(f"--init {cfg.init}: GPT-J (6B parameters, 24 GB of fp32 weights, 28 layers of width "
                                 f"4096) is out of a laptop's reach, so this file does not load it")
    if cfg.init == "random":   # GPT-2 small's shape unless given, within the bounds a GPT-2 config.json is held to
        for name in ("n_embd", "n_head", "n_layer"):
            if (getattr(cfg, name) or 0) > GPT2_LIMITS[name]:
                raise data_lib.DataError(f"--{name.replace('_', '-')} {getattr(cfg, name)}: a GPT-2 has at most "
                                         f"{GPT2_LIMITS[name]} (the bound its config.json is held to)")
        g = GPT2Config()
    else:                      # a hub name's own config, else the checkpoint's config.json
        g = config_of(cfg.init, allow_download=False)
        if (cfg.sample or cfg.text_attention) and g.activation == "quick_gelu":      # CLIP's text tower
            raise data_lib.DataError(f"--{'sample' if cfg.sample else 'text-attention'} needs GPT-2's language model; "
                                     f"CLIP's text tower (--init {cfg.init}) has no language-model head: try --markov")
        if cfg.n_embd is not None and cfg.n_embd != g.n_embd:
            raise data_lib.DataError(f"--n-embd {cfg.n_embd}: the checkpoint's width is {g.n_embd}")
        if cfg.n_head is not None and cfg.n_head != g.n_head:
            raise data_lib.DataError(f"--n-head {cfg.n_head}: the checkpoint has {g.n_head} heads")
        if cfg.n_layer is not None and cfg.n_layer > g.n_layer:
            raise data_lib.DataError(f"--n-layer {cfg.n_layer}: the checkpoint has {g.n_layer} blocks")
    n_embd, n_head = cfg.n_embd or g.n_embd, cfg.n_head or g.n_head
    if n_embd % n_head:
        raise data_lib.DataError(f"--n-embd {n_embd} is not divisible by --n-head {n_head}")
    if cfg.markov_penalty < 0:
        raise data_lib.DataError(f"--markov-penalty must be >= 0, got {cfg.markov_penalty}")
    if cfg.markov_penalty and not cfg.moa:
        raise data_lib.DataError("--markov-penalty penalises the MoA gate (Eq. 9), so it needs the gate: drop --no-moa")
    if cfg.markov_penalty and cfg.init == "random" and n_head <= max(MARKOV_HEADS):
        raise data_lib.DataError(f"--markov-penalty with --init random penalises the paper's heads 1, 5, 10, which "
                                 f"needs more than 10 heads, not {n_head}")
    if cfg.freeze_attention and cfg.init == "random":
        raise data_lib.DataError("--freeze-attention keeps the pretrained attention; with --init random there is none")
    if cfg.markov_r <= 0:
        raise data_lib.DataError(f"--markov-r must be > 0, got {cfg.markov_r}")
    if cfg.keep_ckpt_at < 0 or cfg.keep_ckpt_at > cfg.steps or cfg.keep_ckpt_at % cfg.eval_every:
        raise data_lib.DataError(f"--keep-ckpt-at {cfg.keep_ckpt_at} must be a step that the run checkpoints: 0 to "
                                 f"--steps {cfg.steps}, a multiple of --eval-every {cfg.eval_every}")

def build_model(cfg, info):
    """GPT2-DT(MA) with the first n_layer blocks of --init, or their shape from scratch (--init random). A new build
    records in info what a rebuild (--resume, analyses) needs without the weights: the shape and the Markov heads."""
    sd = None
    if "shape" not in info:
        s = info["shape"] = shape_of(cfg)
        if cfg.init == "random":
            source, why = "random init", "the paper's, by definition: random weights have none"
            heads = MARKOV_HEADS if s["n_head"] > max(MARKOV_HEADS) else ()
        else:                                  # GPT-2's blocks, or CLIP's text tower mapped onto them
            g, sd = load_checkpoint(cfg.init)
            source = find_weights(cfg.init)
            if g.activation == "gelu_new" and (g.n_embd, g.n_head) == (768, 12):
                heads, why = MARKOV_HEADS, "GPT-2 small's, Tab. 1"
            else:
                heads = find_markov_heads(sd["h.0.attn.c_attn.weight"], g.n_head, cfg.markov_r)
                why = f"Def. 4.1 with r={cfg.markov_r:g} on these weights"
        info["markov_heads"] = list(heads)
        print(f"blocks from {source}: {s['n_layer']} of width {s['n_embd']} with {s['n_head']} heads "
              f"({s['activation']}); layer-0 Markov heads {label(heads)} ({why})")
        if cfg.markov_penalty and not heads:
            raise data_lib.DataError(f"--markov-penalty: Def. 4.1 (r={cfg.markov_r:g}) finds no Markov head in layer 0 "
                                     f"of {source}, so there is nothing to penalise; try a smaller --markov-r")
    s = info["shape"]
    model = DecisionTransformer(dataclasses.replace(cfg, n_embd=s["n_embd"], n_head=s["n_head"], n_layer=s["n_layer"]),
                                info["obs_dim"], info["act_dim"], info["max_ep_len"], eps=s["eps"],
                                activation=s.get("activation", "gelu_new"))   # runs from before CLIP-DT: GPT-2's
    if sd is not None:
        model.load_gpt2_blocks(sd)
    model.markov_heads = tuple(info["markov_heads"])
    # --freeze-attention (App. F, Tab. 8: GPT2-DT (part) "only fine-tune[s] the parameters in embedding layer and FFN
    # layer"): the pretrained attention (c_attn, c_proj) and LayerNorms (ln_1, ln_2, ln_f) keep their values
    frozen = ("ln_f.", ".attn.c_attn.", ".attn.c_proj.", ".ln_1.", ".ln_2.")
    for name, p in model.named_parameters():
        p.requires_grad_(not (cfg.freeze_attention and any(part in name for part in frozen)))
    return model

def shape_of(cfg):
    """A new run's blocks before any weight is read: --init's config ('random': GPT-2 small's), --n-layer of them."""
    g = (GPT2Config(n_embd=cfg.n_embd or 768, n_head=cfg.n_head or 12) if cfg.init == "random" else
         config_of(cfg.init, allow_download=False))
    return dict(n_embd=g.n_embd, n_head=g.n_head, n_layer=cfg.n_layer or g.n_layer, eps=g.layer_norm_epsilon,
                activation=g.activation)

def param_groups(model):
    """AdamW's groups over the trained parameters (App. C), the gate without weight decay: decay pulls W_g to 0, i.e.
    towards the uniform mixture that MoA is there to move away from."""
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [dict(params=[p for n, p in trained if ".gate_" not in n]),
              dict(params=[p for n, p in trained if ".gate_" in n], weight_decay=0.0)]
    return [g for g in groups if g["params"]]

def paper_context(cfg, d):
    """The paper's K when --context is not given: 20 on MuJoCo, 50 on the mazes (departure 9)."""
    return cfg if cfg.context is not None else dataclasses.replace(cfg, context=50 if d.goal_reaching else 20)

def loss_fn(model, batch, cfg):
    """Eq. 3's squared error over the real steps + GPT2-P's alpha * G_Markov (Eq. 9), both means (departure 7). Under
    --amp autocast keeps the LayerNorms and softmaxes in fp32, and the error is reduced in fp32."""
    pred, aux = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    # srzer/LaMo-2023@3e4fcc8 experiment-d4rl/decision_transformer/training/seq_trainer.py#L32-L44
    err = ((pred.float() - batch["actions"]) ** 2).mean(-1)                                       # (B, K)
    loss = (err * batch["mask"]).sum() / batch["mask"].sum()
    if cfg.markov_penalty:
        loss = loss + cfg.markov_penalty * markov_gate_mass(aux["gates"][0], batch["mask"], model.markov_heads)
    return loss

def policy(model):
    """The action for evaluate.evaluate: the live envs' contexts -> the action predicted at the current step."""
    def act(batch, live):
        return model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[0][:, -1]
    return act

def targets(cfg, d):
    """Return-to-go prompts, raw units: --target-return, else the dataset's (the paper does not give its targets)."""
    return [cfg.target_return] if cfg.target_return is not None else d.target_returns

def evaluate(model, d, cfg, device):
    """--eval-episodes episodes in parallel for each target, in the dataset's env. -> [(target, results)]"""
    model.eval()
    results = [(g, ev.evaluate(policy(model), d, cfg.eval_episodes, g, cfg.seed + 10_000, cfg.context, device))
               for g in targets(cfg, d)]
    model.train()
    return results

@torch.no_grad()
def g_markov(model, probe):
    """G_Markov (Fig. 9, Tabs. 5-6) on a fixed batch in eval mode, for log.csv; {} without a gate or Markov heads."""
    if not (model.blocks[0].attn.moa and model.markov_heads):
        return {}
    model.eval()
    gates = model(probe["states"], probe["actions"], probe["rtg"], probe["timesteps"], probe["mask"])[1]["gates"]
    model.train()
    return {"g_markov": f"{markov_gate_mass(gates[0], probe['mask'], model.markov_heads).item():.4f}"}

# ----------------------------------------------------------------------------------------------------------------
# training: dt.py's loop; GPT2-DTMA's own are the pretrained blocks, the optimiser groups, the loss's GPT2-P term, and
# G_Markov in the log (Fig. 9) with gates.png

def train(cfg, run, d=None):
    """Fine-tune GPT2-DT(MA) (or continue the run) and evaluate it in the env; `run` (evaluate.Run, or --bench's timer)
    keeps the folder, log and checkpoint. -> the first target's final evaluation (per-episode arrays)."""
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward) if d is None else d
    cfg = paper_context(cfg, d)                                     # K: 20 on MuJoCo, 50 on mazes (Tabs. 5-6)
    ev.check_data(cfg, d)                                           # a context or target that means nothing here
    device = ev.pick_device(cfg.device)
    info = run.ck["info"] if run.ck else d.info()                  # a resumed run is rebuilt without the GPT-2 file
    template = d.sample(2, cfg.context, np.random.default_rng(0))
    with torch.device("meta"):                                      # one step's memory, from shapes, before allocating
        meta = build_model(cfg, dict(info, shape=info.get("shape") or shape_of(cfg), markov_heads=[]))
        need = ev.check_memory(meta, lambda b: loss_fn(meta, b, cfg), template, cfg.batch_size, device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, info).to(device)                       # a new run: GPT-2's blocks loaded into it
    opt = torch.optim.AdamW(param_groups(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    # App. C's warmup, as srzer/LaMo-2023@3e4fcc8 experiment-d4rl/experiment.py#L397-L399
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / max(1, cfg.warmup_steps), 1.0))
    rng = np.random.default_rng(cfg.seed)                           # draws the training windows
    probe = d.sample(cfg.batch_size, cfg.context, np.random.default_rng(cfg.seed + 20_000))   # G_Markov's windows
    probe = {k: v.to(device) for k, v in probe.items()}
    step = run.start(cfg, model, opt, sched, rng, d, info, need)    # --resume: all of the above as the run left it
    if step == 0 and run.ck is None:
        run.add_row(step=0, wall_time="0.0", **g_markov(model, probe))   # G_Markov before fine-tuning (Fig. 9)
    fwd = torch.compile(model) if cfg.compile else model
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)   # --amp: bf16 forward pass
    results = None
    with ev.StopSignal() as stop:                                   # Ctrl-C: end this step, save, exit 130
        while step < cfg.steps and not stop.signum:
            batch = {k: v.to(device, non_blocking=True) for k, v in d.sample(cfg.batch_size, cfg.context, rng).items()}
            with autocast:
                loss = loss_fn(fwd, batch, cfg)
            # srzer/LaMo-2023@3e4fcc8 experiment-d4rl/decision_transformer/training/seq_trainer.py#L53-L56
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            logging = step % cfg.log_every == 0 or step == cfg.steps
            run.log(step, loss, sched.get_last_lr()[0], **(g_markov(model, probe) if logging else {}))
            if step % cfg.eval_every == 0 or step == cfg.steps:
                results = evaluate(model, d, cfg, device)           # the env, for each target
                run.save(step, model, opt, sched, rng, results)     # log.csv, then ckpt.pt, then curve.png
                plot_gates(run.rows, os.path.join(run.out, "gates.png"), model.markov_heads,
                           model.blocks[0].attn.n_head, f"{SCRIPT} {run.variant} {d.dataset_id} seed {cfg.seed}")
                if step == cfg.keep_ckpt_at:                        # the early checkpoint of Figs. 1/7
                    ev.write_atomic(os.path.join(run.out, f"ckpt_step{step}.pt"),
                                    lambda tmp: shutil.copyfile(os.path.join(run.out, "ckpt.pt"), tmp))
        if stop.signum and step < cfg.steps:
            run.save(step, model, opt, sched, rng)
            stop.exit(step, run.out)
    return run.finish(results or evaluate(model, d, cfg, device))   # resumed at --steps: evaluate the checkpoint

# ----------------------------------------------------------------------------------------------------------------
# figures and analyses: each reads a run's checkpoint (load_model) and never trains; --markov without a run,
# --text-attention and --sample need only the GPT-2 weights

def plt_agg():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt

def save_figure(fig, path, say=True):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt_agg().close(fig)
    if say:
        print(f"wrote {path}")

def heatmap(fig, ax, A, cbar="attention probability", cmap="viridis", vmin=0, vmax=1, **labels):
    """The matrix A (numpy) on ax with its colour bar; labels go to ax.set (xlabel, title, ticks...)."""
    fig.colorbar(ax.imshow(A, cmap=cmap, vmin=vmin, vmax=vmax), ax=ax, fraction=0.046, label=cbar)
    ax.set(**labels)

def table(header, rows, fmt=".3f"):
    """Print a markdown table, float cells in format fmt."""
    print("| " + " | ".join(map(str, header)) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(f"{x:{fmt}}" if isinstance(x, float) else str(x) for x in row) + " |")

def label(heads):
    return "{" + ", ".join(map(str, heads)) + "}"

def plot_gates(rows, path, heads, n_head, title):
    """Fig. 9: the layer-0 MoA weight of the Markov heads (G_Markov) and of the other heads over training."""
    pts = [(int(r["step"]), float(r["g_markov"])) for r in rows if r.get("g_markov", "") != ""]
    if not pts:
        return
    s, g = zip(*pts)
    fig, ax = plt_agg().subplots(figsize=(6.5, 3.8))
    ax.plot(s, g, color="tab:red", label=f"Markov heads {label(heads)}")
    ax.plot(s, [1 - x for x in g], color="tab:blue", label=f"the other {n_head - len(heads)} heads")
    ax.axhline(len(heads) / n_head, ls=":", color="gray", label=f"uniform gate ({len(heads)}/{n_head})")
    ax.set(xlabel="gradient step", ylabel="layer-0 MoA weight\n(sum over the heads)", ylim=(0, 1))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    save_figure(fig, path, say=False)

def start_model(cfg, info, device="cpu"):
    """The model the run started from ('before fine-tuning'), rebuilt as train() builds it: same seed and weights."""
    torch.manual_seed(cfg.seed)
    fresh = {k: info[k] for k in ("obs_dim", "act_dim", "max_ep_len", "goal_dim")}
    return build_model(cfg, fresh).to(device).eval()

def markov_analysis(cfg, run=None):
    """--markov: Def. 4.1 on every layer-0 head at the start (--init) and, with a run, after fine-tuning, for A read
    as C x C and D x D and r = 8 and 20 (Tab. 1, [P-old] Tab. 2's ratios; --init clip: [P-old] Tab. 8); Fig. 3."""
    clip = False
    if cfg.init == "random":   # the run's own random start (without a run: a random init of the default shape)
        start = start_model(cfg, run["ck"]["info"] if run else dict(obs_dim=1, act_dim=1, max_ep_len=1, goal_dim=0))
        W0, n_head = start.blocks[0].attn.c_attn.weight.detach(), start.blocks[0].attn.n_head
    else:
        g, sd = load_checkpoint(cfg.init)                   # GPT-2's blocks, or CLIP's text tower mapped onto them
        W0, n_head, clip = sd["h.0.attn.c_attn.weight"], g.n_head, g.activation == "quick_gelu"   # W0 (3C, C)
    weights = {"init": W0}
    if run is not None:
        weights["fine-tuned"] = run["model"].blocks[0].attn.c_attn.weight.detach().cpu()
    tables = {lab: markov_table(W, n_head) for lab, W in weights.items()}
    print(f"Markov-matrix test of the layer-0 heads (Def. 4.1) of {cfg.init}" +
          (f", at the start and after fine-tuning ({run['out']})" if run else ""))
    header, cells, found = ["head"], [[h] for h in range(n_head)], []
    for lab, rows in tables.items():
        for lay, name in (("model", "C x C"), ("head", "D x D")):
            rs = (8, 20, cfg.markov_r)
            markov = {r: [x["head"] for x in rows if x[f"{lay}_i"] and x[f"{lay}_ratio"] > r] for r in rs}
            header += [f"{lab} {name.replace(' ', '')} (i)", "ratio", "Markov r=8/20"]
            for h, row in enumerate(rows):
                cells[h] += ["✓" if row[f"{lay}_i"] else "×", f"{row[f'{lay}_ratio']:.2f}",
                             "/".join("✓" if h in markov[r] else "×" for r in (8, 20))]
            found.append(f"{lab}, {name}: Markov heads r=8 {label(markov[8])}, r=20 {label(markov[20])}, "
                         f"--markov-r {cfg.markov_r:g} {label(markov[cfg.markov_r])}")
    table(header, cells)
    print("\n".join(found))
    C = W0.shape[1]
    print(f"Remark 4.7's bound r > ln(d-1)+1: {math.log(C // n_head - 1) + 1:.2f} for d={C // n_head}, "
          f"{math.log(C - 1) + 1:.2f} for d={C}; GPT-2 small's Markov heads (Tab. 1): {label(MARKOV_HEADS)}")
    if clip and n_head == len(CLIP_TAB8):
        print("[P-old] Tab. 8, CLIP's text tower at init, (i) and ratio per head: " +
              ", ".join(f"{h} {'✓' if i else '×'} {r}" for h, (i, r) in enumerate(CLIP_TAB8)) + "; no Markov head")
    # Fig. 3: the ratio per head, and A of a non-Markov and a Markov head (at init, --markov-r)
    marked = find_markov_heads(W0, n_head, cfg.markov_r)
    shown = [next((h for h in range(n_head) if h not in marked), 0), *marked[:1]]
    cols = 1 + 2 * len(shown)
    fig, axes = plt_agg().subplots(len(weights), cols, figsize=(4 * cols, 3.6 * len(weights)), squeeze=False)
    for row, (lab, W) in enumerate(weights.items()):
        ax = axes[row, 0]
        ax.bar(range(n_head), [x["model_ratio"] for x in tables[lab]],
               color=["tab:red" if h in marked else "tab:blue" for h in range(n_head)])
        ax.axhline(cfg.markov_r, ls=":", color="gray", label=f"r = {cfg.markov_r:g}")
        ax.set(xlabel="layer-0 head", ylabel="mean|A_ii| / mean|A_ij| (C x C)", yscale="log", xticks=range(n_head))
        ax.set_title(f"{lab}: Def. 4.1 (ii) ratio per head\n" + ("red: Markov at init" if marked else
                     "no head is Markov at init") + f" (r = {cfg.markov_r:g})", fontsize=9)
        ax.legend(fontsize=7)
        for j, h in enumerate(shown):
            for k, (lay, crop) in enumerate((("model", 64), ("head", None))):
                A = head_qk_matrix(W, n_head, h, lay)[:crop, :crop].numpy()
                v = np.percentile(np.abs(A), 99) or 1.0
                ax = axes[row, 1 + 2 * j + k]
                heatmap(fig, ax, A, "A_ij", "RdBu_r", -v, v, xlabel="key dimension j", ylabel="query dimension i")
                ax.set_title(f"{lab}, head {h}{' (Markov)' if h in marked else ''}: "
                             f"{'C×C, first 64 rows/cols' if lay == 'model' else 'D×D'}\n"
                             f"ratio {tables[lab][h][lay + '_ratio']:.2f}", fontsize=9)
    out = run["out"] if run else cfg.out or os.path.join("runs", SCRIPT, "clip" if clip else "gpt2")
    os.makedirs(out, exist_ok=True)
    save_figure(fig, os.path.join(out, "markov_heads.png"))
    return tables

def windows_and_start(cfg, run, n=32):
    """n windows of the run's dataset without left padding (a fixed draw), and the run's starting model."""
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    rng, got = np.random.default_rng(cfg.seed + 30_000), []
    while sum(len(b["mask"]) for b in got) < n:
        b = d.sample(4 * n, cfg.context, rng)
        keep = b["mask"].all(dim=1)
        got.append({k: v[keep] for k, v in b.items()})
    windows = {k: torch.cat([b[k] for b in got])[:n] for k in got[0]}
    return windows, start_model(cfg, run["ck"]["info"], next(run["model"].parameters()).device)

@torch.no_grad()
def attention_probs(model, b):
    """The per-layer attention probabilities of `model` on the windows b: list of (B,N,3K,3K) on the CPU."""
    dev = next(model.parameters()).device
    aux = model(*(b[k].to(dev) for k in ("states", "actions", "rtg", "timesteps", "mask")), need_probs=True)[1]
    return [p.cpu() for p in aux["probs"]]

def attention_maps(cfg, run):
    """--attention-maps, Fig. 4: layer-0 attention (3K x 3K, mean of 32 windows) before fine-tuning (fresh DT
    embeddings: Thm 4.3's 'random embedding') and after. A Markov head shows a bright diagonal."""
    b, start = windows_and_start(cfg, run)
    P = {lab: attention_probs(m, b)[0].mean(0) for lab, m in (("before", start), ("after", run["model"]))}
    heads, n_head = run["model"].markov_heads, P["before"].shape[0]                  # P: (N, 3K, 3K) of layer 0
    diag = {lab: diagonal_attention_mass(p[None]).tolist() for lab, p in P.items()}
    print(f"layer-0 attention of each token to itself (rows 1.. of the diagonal), {len(b['mask'])} windows of "
          f"K={cfg.context}; Markov heads {label(heads)}")
    table(["head", "before", "after", "Markov head"],
          [[h, diag["before"][h], diag["after"][h], "yes" if h in heads else ""] for h in range(n_head)])
    shown = [*heads, next((h for h in range(n_head) if h not in heads), 0)]
    ticks = range(0, 3 * cfg.context, 3 * max(1, cfg.context // 8))    # at R_t tokens
    fig, axes = plt_agg().subplots(2, len(shown), figsize=(3.6 * len(shown), 6.6), squeeze=False)
    for r, (lab, p) in enumerate(P.items()):
        for c, h in enumerate(shown):
            heatmap(fig, axes[r, c], p[h].numpy(), xlabel="key token (R_1, s_1, a_1, R_2, ...)", ylabel="query token",
                    title=f"{lab} fine-tuning: head {h}" + (" (Markov)" if h in heads else ""), xticks=ticks,
                    yticks=ticks)
    save_figure(fig, os.path.join(run["out"], "attention_maps.png"))
    return P

def attention_distance(cfg, run):
    """--attention-distance, Figs. 1/7: the attention of the last state token s_K by distance, mean of heads, layers
    and 32 windows, at step 0, at each --keep-ckpt-at checkpoint and at the end (GPT2-DT is local early, DT later)."""
    b, start = windows_and_start(cfg, run)
    models = {0: start}
    for path in glob.glob(os.path.join(run["out"], "ckpt_step*.pt")):
        ck = ev.read_checkpoint(path, SCRIPT)
        m = build_model(cfg, ck["info"])
        m.load_state_dict(ck["model"])
        models[ck["step"]] = m.to(next(start.parameters()).device).eval()
    models[run["ck"]["step"]] = run["model"]
    query = 3 * cfg.context - 2                                             # s_K: the last state token
    curves = {step: attention_by_distance(attention_probs(m, b), query) for step, m in sorted(models.items())}
    shown = min(query + 1, 16)
    print(f"attention of s_K by distance in tokens (0 = itself, 1 = R_K, 2 = a_(K-1), 3 = s_(K-1), ...), mean over "
          f"heads, layers and {len(b['mask'])} windows")
    table(["step", *range(shown)], [[step, *c[:shown].tolist()] for step, c in curves.items()])
    fig, ax = plt_agg().subplots(figsize=(6, 3.8))
    for step, c in curves.items():
        ax.plot(range(len(c)), c.numpy(), "o-", ms=3, label=f"step {step}")
    ax.set(xlabel="distance from s_K (tokens; 3 = one timestep)", ylabel="attention probability",
           title=f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}: attention of the last state token")
    ax.legend(fontsize=8)
    save_figure(fig, os.path.join(run["out"], "attention_distance.png"))
    return curves

def importance_analysis(cfg, run, n_contexts=64):
    """--importance, Fig. 2 / Fig. 8: roll the fine-tuned model out in the env (on --device), keep the contexts it
    acted on, then zero each of the L x N heads in turn on those same contexts and measure ||a' - a'_{-head}||_2."""
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    model = run["model"]
    seen, decide = [], policy(model)

    def act(batch, live):
        seen.append({k: v.clone() for k, v in batch.items()})
        return decide(batch, live)
    with torch.no_grad():
        ev.evaluate(act, d, min(cfg.eval_episodes, 5), targets(cfg, d)[0], cfg.seed + 40_000, cfg.context,
                    next(model.parameters()).device)
    allc = {k: torch.cat([s[k] for s in seen]) for k in seen[0]}
    pick = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(len(allc["mask"]))[:n_contexts])
    imp = head_importance(model, {k: v[pick.to(v.device)] for k, v in allc.items()})   # (L, N)
    L, N = imp.shape
    print(f"head importance ||a' - a'_-head||_2 on {len(pick)} rollout contexts (rows: layers, columns: heads)")
    table(["layer", *range(N)], [[layer, *imp[layer].tolist()] for layer in range(L)], fmt=".4f")
    top = torch.topk(imp.flatten(), min(5, imp.numel())).indices.tolist()
    print("most important heads (layer, head): " + ", ".join(f"({i // N}, {i % N})" for i in top))
    fig, ax = plt_agg().subplots(figsize=(max(6, 0.16 * L * N), 3.8))
    ax.bar(range(L * N), imp.flatten().numpy(),
           color=["tab:red" if i // N == 0 and i % N in model.markov_heads else "tab:blue" for i in range(L * N)])
    ax.set_xticks(range(L * N), [str(i % N) for i in range(L * N)], fontsize=6)
    for layer in range(L):
        if layer:
            ax.axvline(layer * N - 0.5, color="gray", lw=0.5)
        ax.text(layer * N + N / 2 - 0.5, 1.0, f"layer {layer}", transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", fontsize=7)
    ax.set(xlabel="head (grouped by layer)", ylabel="||a' - a'_-head||_2 (action units)")
    ax.set_title(f"head importance (red: layer-0 Markov heads {label(model.markov_heads)})", pad=14)
    save_figure(fig, os.path.join(run["out"], "head_importance.png"))
    return imp

def gif(cfg, run):
    """--gif: one evaluation episode of the run's checkpoint at its first target -> episode.gif (never trains)."""
    model = run["model"]
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    ev.episode_gif(policy(model), d, targets(cfg, d)[0], cfg.seed + 10_000, cfg.context,
                   next(model.parameters()).device, run["out"], f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}")

def target_sweep(cfg, run):
    """--target-sweep (DT's Fig. 4): the run's checkpoint at 8 targets from the data's lowest return to above its best,
    --eval-episodes each -> target_sweep.png and .csv (never trains)."""
    model = run["model"]
    d = data_lib.load_data(cfg.dataset or cfg.env, delayed_reward=cfg.delayed_reward)
    ev.target_sweep(policy(model), d, cfg.eval_episodes, cfg.seed + 10_000, cfg.context,
                    next(model.parameters()).device, run["out"], f"{SCRIPT} {ev.variant_name(cfg, PRESETS)}")

def sample_text(cfg, max_new_tokens=40):
    """--sample PROMPT: GPT-2's continuation, the proof that the real weights loaded."""
    model, enc = load_gpt2_lm(cfg.init), tiktoken_gpt2()
    ids = enc.encode(cfg.sample) or [enc.eot_token]
    out = model.generate(torch.tensor([ids]), max_new_tokens, generator=torch.Generator().manual_seed(cfg.seed))
    print(cfg.sample + enc.decode(out[0, len(ids):].tolist()))

def text_attention(cfg):
    """--text-attention TEXT: GPT-2's layer 0 on real text: how much each head attends to the token itself (the
    'last input token' of Thm 4.3), to the previous one and to the first one; GPT-2 small's Markov heads marked."""
    model, enc = load_gpt2_lm(cfg.init), tiktoken_gpt2()
    ids = enc.encode(cfg.text_attention)[: model.cfg.n_positions]
    if len(ids) < 2:
        raise data_lib.DataError("--text-attention needs a text of at least two tokens")
    with torch.no_grad():
        probs = model(torch.tensor([ids]), need_probs=True)[1][0]                    # (1, N, T, T) layer 0
    P = probs[0]
    mass = torch.stack([diagonal_attention_mass(probs),                            # (N, 3): to the token itself,
                        P.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1),          # to token t-1,
                        P[:, 1:, 0].mean(-1)], dim=1).tolist()                     # to the first token
    markov = MARKOV_HEADS if (model.cfg.n_embd, model.cfg.n_head) == (768, 12) else ()   # GPT-2 small's
    print(f"GPT-2 layer 0 on {len(ids)} tokens: mean attention to the token itself / the previous / the first token")
    table(["head", "self", "previous", "first", "GPT-2 small's Markov head"],
          [[h, *mass[h], "yes" if h in markov else ""] for h in range(P.shape[0])])
    heads = [h for h in (*MARKOV_HEADS, 0) if h < P.shape[0]]
    toks = [enc.decode([i]) for i in ids]
    fig, axes = plt_agg().subplots(1, len(heads), figsize=(3.8 * len(heads), 3.8), squeeze=False)
    for ax, h in zip(axes[0], heads):
        heatmap(fig, ax, P[h].numpy(), xlabel="key token", ylabel="query token",
                title=f"head {h}" + (" (GPT-2 small's Markov head)" if h in markov else ""))
        if len(ids) <= 24:
            ax.set_xticks(range(len(ids)), toks, rotation=90, fontsize=6)
            ax.set_yticks(range(len(ids)), toks, fontsize=6)
    out = cfg.out or os.path.join("runs", SCRIPT, "gpt2")
    os.makedirs(out, exist_ok=True)
    save_figure(fig, os.path.join(out, "text_attention.png"))

def load_model(cfg, given):
    """An analysis's run: its settings, and dict(model in eval mode, checkpoint, folder), from its checkpoint."""
    cfg, ck = ev.load_run(SCRIPT, cfg, given, PRESETS)
    model = build_model(cfg, ck["info"])
    model.load_state_dict(ck["model"])
    return cfg, dict(model=model.to(ev.pick_device(cfg.device)).eval(), ck=ck, out=ev.run_folder(SCRIPT, cfg, PRESETS))

ANALYSES = {"markov": markov_analysis, "attention_maps": attention_maps, "attention_distance": attention_distance,
            "importance": importance_analysis, "gif": gif, "target_sweep": target_sweep}   # flag -> fn(cfg, run)

# ----------------------------------------------------------------------------------------------------------------
# pretrained weights (GPT-2, and CLIP's text tower for CLIP-DT): huggingface_hub finds them in its cache or downloads
# them once; a hand-written safetensors reader and config.json parser check them; the names are mapped onto the blocks

# CLIP ViT-B/32's text tower (12 causal pre-LN layers, width 512, 8 heads, QuickGELU: Hugging Face's CLIPTextConfig
# defaults) under GPT2Config's names, so that it builds the same blocks
CLIP_TEXT = GPT2Config(vocab_size=49408, n_positions=77, n_embd=512, n_layer=12, n_head=8, activation="quick_gelu")
# --init's hub names (the key or a repo): the repos are looked up in the cache under each, downloaded from the first
HUB = {"gpt2": dict(repos=("gpt2", "openai-community/gpt2"), what="GPT-2 small", config=GPT2Config()),
       "clip": dict(repos=("openai/clip-vit-base-patch32",), what="CLIP ViT-B/32", config=CLIP_TEXT)}   # [P-new] Tab. 7

class CheckpointError(data_lib.DataError):
    """A GPT-2 or CLIP checkpoint that cannot be used (missing, truncated, malformed, wrong names, dtypes or shapes)."""

def hub(init):
    """The HUB entry that --init names, else None (a path, or 'random')."""
    return next((h for name, h in HUB.items() if init == name or init in h["repos"]), None)

def find_weights(init="gpt2", allow_download=True):
    """--init -> its model.safetensors: a path's (the file, or its folder), a hub name's from the Hugging Face cache,
    else downloaded once into it with its config.json (offline: one sentence), or None if not allow_download."""
    if h := hub(init):
        for repo in h["repos"]:
            path = try_to_load_from_cache(repo, "model.safetensors")
            if isinstance(path, str):
                return path
        if not allow_download:
            return None
        repo = h["repos"][0]
        how = f"`hf download {repo} model.safetensors config.json`"
        print(f"downloading {h['what']} ({repo}) once into the Hugging Face cache", flush=True)
        offline = huggingface_hub.constants.HF_HUB_OFFLINE
        try:
            if not offline:             # no network: fail now, not after a minute of retries
                socket.getaddrinfo(urllib.parse.urlparse(huggingface_hub.constants.ENDPOINT).hostname, 443)
            hf_hub_download(repo, "config.json")
            return hf_hub_download(repo, "model.safetensors")      # beside config.json, in the same snapshot
        except OSError as e:            # huggingface_hub's errors (offline, HTTP) are OSErrors too
            why = ("HF_HUB_OFFLINE is set" if offline else
                   "no network" if isinstance(e, socket.gaierror) else type(e).__name__)
            raise CheckpointError(f"{h['what']} weights are not in the Hugging Face cache and could not be "
                                  f"downloaded ({why}); with a network run {how} once, or pass --init PATH to a "
                                  f"local model.safetensors") from None
    p = os.path.expanduser(init)
    if os.path.isdir(p):
        p = os.path.join(p, "model.safetensors")
    if not os.path.isfile(p):
        raise CheckpointError(f"no GPT-2 or CLIP checkpoint at {init} (expected model.safetensors or a folder holding "
                              f"it, or the name 'gpt2' or 'clip')")
    return p

def config_of(init, allow_download=True):
    """The config of --init's checkpoint: the config.json beside it, else the hub name's own (GPT-2 small's for a file
    without one). allow_download=False (flag checks, a run's shape): a hub name not on disk yet gives its own."""
    path = find_weights(init, allow_download)                   # None: a hub name not on disk yet
    cfg_path = os.path.join(os.path.dirname(path), "config.json") if path else ""
    if os.path.isfile(cfg_path):
        return config_from_json(cfg_path)
    return hub(init)["config"] if hub(init) else GPT2Config()

def load_checkpoint(init="gpt2"):
    """-> (config, the blocks' state dict: names h.<i>.*, ln_f.*, nn.Linear layout), checked name by name and shape by
    shape: GPT-2's (also wte and wpe), or CLIP's text tower mapped onto the same names."""
    cfg, path = config_of(init), find_weights(init)
    if cfg.activation == "quick_gelu":            # CLIP's text tower
        return cfg, clip_state_from_hf(read_safetensors(path, keep=CLIP_TEXT_BLOCKS), cfg)
    return cfg, gpt2_state_from_hf(read_safetensors(path), cfg)

def load_gpt2_lm(init="gpt2"):
    """The GPT-2 language model with its pretrained weights ('random': GPT-2 small's), in eval mode."""
    cfg, sd = load_checkpoint("gpt2" if init == "random" else init)
    if cfg.activation == "quick_gelu":
        raise CheckpointError(f"{init} is CLIP's text tower, which has no language-model head: GPT-2's text checks "
                              f"need a GPT-2 checkpoint")
    with torch.device("meta"):                  # no init work: the weights are assigned
        model = GPT2(cfg)
    model.load_state_dict(sd, strict=True, assign=True)
    return model.eval()

def tiktoken_gpt2():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:   # offline: tiktoken fetches its BPE files once (requests / urllib errors, by version)
        raise CheckpointError(f"tiktoken's GPT-2 encoding is not available ({type(e).__name__}); it downloads its BPE "
                              f"files once: run with a network, or set TIKTOKEN_CACHE_DIR to their folder") from None

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}
MAX_HEADER_BYTES = 100 * 1024 * 1024        # the format's own limit (safetensors rejects larger headers)
# config.json: each GPT-2 field with the largest value accepted (a whole number from 1), checked before any allocation
GPT2_LIMITS = dict(vocab_size=1_000_000, n_positions=65_536, n_embd=12_288, n_layer=96, n_head=256)
CLIP_KEYS = dict(vocab_size="vocab_size", n_positions="max_position_embeddings", n_embd="hidden_size",
                 n_layer="num_hidden_layers", n_head="num_attention_heads",   # CLIP's config.json names, same limits
                 layer_norm_epsilon="layer_norm_eps")

def read_safetensors(path, keep=""):
    """Parse a .safetensors file by hand -> dict[str, torch.Tensor] (CPU), only the names that start with keep (every
    entry is checked all the same). Layout: u64 little-endian header length n; n bytes of JSON {name: {dtype, shape,
    data_offsets: [a, b]}, "__metadata__"?}; the raw little-endian tensor bytes, offsets from the data start. All is
    checked against the file size first: a hostile file fails fast and allocates no more than the file holds."""
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    with f:
        if size < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        n = int.from_bytes(f.read(8), "little")
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated or not "
                                  f"a safetensors file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: bad JSON, or an int of > 4300 digits
            raise CheckpointError(f"{path}: the header is not valid JSON (or holds an absurdly long number); not a "
                                  f"safetensors file") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        data_len = size - 8 - n
        spans = []
        for name, info in header.items():
            if not (isinstance(info, dict) and isinstance(info.get("dtype"), str)
                    and isinstance(info.get("shape"), list) and isinstance(info.get("data_offsets"), list)):
                raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry")
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {str(info['dtype'])[:20]!r}")
            shape, offs = info["shape"], info["data_offsets"]
            if len(shape) > 16 or not all(type(s) is int and 0 <= s < 2 ** 40 for s in shape):   # bools are not ints
                raise CheckpointError(f"{path}: tensor '{name}' has an invalid shape {str(shape)[:60]}")
            if len(offs) != 2 or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1] <= data_len:
                raise CheckpointError(f"{path}: tensor '{name}' has offsets {str(offs)[:60]} outside the data "
                                      f"({data_len} bytes); the file is truncated or corrupt")
            if math.prod(shape) * SAFETENSORS_DTYPES[info["dtype"]].itemsize != offs[1] - offs[0]:
                raise CheckpointError(f"{path}: tensor '{name}' ({info['dtype']} {shape}) does not match its "
                                      f"{offs[1] - offs[0]} bytes of data")
            spans.append((offs[0], offs[1], name))
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise CheckpointError(f"{path}: tensors '{n0}' and '{n1}' overlap in the data")
        out = {}
        for a, b, name in spans:
            if not name.startswith(keep):
                continue
            dtype = SAFETENSORS_DTYPES[header[name]["dtype"]]
            f.seek(8 + n + a)
            buf = bytearray(f.read(b - a))
            if len(buf) != b - a:
                raise CheckpointError(f"{path}: file ended while reading '{name}'")
            t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
            if sys.byteorder == "big":      # the data are little-endian
                t = t.view(torch.uint8).view(-1, t.element_size()).flip(-1).reshape(-1).view(dtype)
            out[name] = t.reshape(header[name]["shape"])
        return out

def check_tensors(sd, shapes, what):
    """Every tensor of `shapes` is in sd, floating-point and of its shape, else a CheckpointError, not a half-load."""
    missing = sorted(set(shapes) - set(sd))
    if missing:
        clip = what == "GPT-2" and any(k.endswith("encoder.layers.0.layer_norm1.weight") for k in sd)
        raise CheckpointError(f"not a {what} checkpoint with this config: {len(missing)} tensors missing (e.g. "
                              f"'{missing[0]}')" + ("; its tensors look like CLIP's text tower, whose config.json "
                                                    "(model_type clip) must sit beside it" if clip else ""))
    for k, s in shapes.items():
        if not sd[k].is_floating_point():
            raise CheckpointError(f"tensor '{k}' has dtype {str(sd[k].dtype).replace('torch.', '')}, expected "
                                  f"floating-point weights")
        if tuple(sd[k].shape) != s:
            raise CheckpointError(f"tensor '{k}' has shape {tuple(sd[k].shape)}, expected {s}")

def block_shapes(cfg):
    """The tensors load_checkpoint returns for the blocks (names h.<i>.*, ln_f.*, nn.Linear layout) -> shape."""
    C = cfg.n_embd
    shapes = {"ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        for part, weight in (("ln_1", (C,)), ("ln_2", (C,)), ("attn.c_attn", (3 * C, C)), ("attn.c_proj", (C, C)),
                             ("mlp.c_fc", (4 * C, C)), ("mlp.c_proj", (C, 4 * C))):
            shapes[f"h.{i}.{part}.weight"], shapes[f"h.{i}.{part}.bias"] = weight, weight[:1]   # (out, in), (out,)
    return shapes

def gpt2_state_from_hf(sd, cfg):
    """HF GPT-2 tensors (with or without the 'transformer.' prefix) -> GPT2's state dict, checked name by name, dtype
    and shape. HF's Conv1D weights are (in, out): transposed to nn.Linear's (out, in)."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd = {k.removeprefix("transformer."): v.t() if k.endswith(conv1d) and v.dim() == 2 else v for k, v in sd.items()}
    shapes = {"wte.weight": (cfg.vocab_size, cfg.n_embd), "wpe.weight": (cfg.n_positions, cfg.n_embd)}
    shapes.update(block_shapes(cfg))            # lm_head is tied to wte; HF's attn.bias buffers are not read
    check_tensors(sd, shapes, "GPT-2")
    return {k: sd[k].float().contiguous() for k in shapes}

# the tensors CLIP-DT reads from a CLIP file (CLIPModel's names or CLIPTextModel's): the text tower's layers and final
# LayerNorm; not its embeddings (DT replaces them, as GPT-2's wte and wpe), text_projection, the vision tower
CLIP_TEXT_BLOCKS = ("text_model.encoder.layers.", "text_model.final_layer_norm.", "encoder.layers.",
                    "final_layer_norm.")
# the blocks' names -> HF CLIPEncoderLayer's (whose nn.Linear layout is the blocks': nothing is transposed)
CLIP_TO_BLOCK = {"ln_1": "layer_norm1", "ln_2": "layer_norm2", "attn.c_proj": "self_attn.out_proj",
                 "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}

def clip_names(name):
    """A tensor of block_shapes -> the CLIP text-tower tensors it is made of (c_attn: q_proj, k_proj, v_proj)."""
    if name.startswith("ln_f."):
        return ["final_layer_norm." + name.removeprefix("ln_f.")]
    _, i, part = name.split(".", 2)                                     # h, <i>, e.g. attn.c_attn.weight
    part, x = part.rsplit(".", 1)
    if part == "attn.c_attn":
        return [f"encoder.layers.{i}.self_attn.{q}_proj.{x}" for q in "qkv"]
    return [f"encoder.layers.{i}.{CLIP_TO_BLOCK[part]}.{x}"]

def clip_state_from_hf(sd, cfg):
    """HF CLIP text-tower tensors (CLIPModel's 'text_model.' prefix or CLIPTextModel's bare names) -> the blocks' state
    dict (as gpt2_state_from_hf makes it), checked name by name, dtype and shape."""
    sd = {k.removeprefix("text_model."): v for k, v in sd.items()}
    shapes = {}
    for name, (rows, *cols) in block_shapes(cfg).items():
        for theirs in clip_names(name):
            shapes[theirs] = (rows // len(clip_names(name)), *cols)       # c_attn's 3C rows: C each of q, k, v
    check_tensors(sd, shapes, "CLIP text-tower")
    return {name: torch.cat([sd[k] for k in clip_names(name)]).float().contiguous() for name in block_shapes(cfg)}

def config_from_json(path):
    """HF config.json -> GPT2Config: GPT-2's, or CLIP's text tower where its model_type says so (CLIPModel's
    text_config, or a CLIPTextModel's own fields), GPT-2 small's or CLIP_TEXT's values where it is silent. Types,
    ranges and sane upper bounds are checked before anything is allocated (n_layer 10**9 is refused at once)."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError, RecursionError) as e:   # ValueError: bad JSON, or an int of > 4300 digits
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}); not a GPT-2 or CLIP config.json") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    clip = hf.get("model_type") in ("clip", "clip_text_model")     # CLIPModel's (text_config) / CLIPTextModel's
    if clip:
        hf = (hf.get("text_config") or {}) if hf["model_type"] == "clip" else hf
        if not isinstance(hf, dict):
            raise CheckpointError(f"{path}: text_config is not a JSON object")
        if hf.get("hidden_act", "quick_gelu") != "quick_gelu":
            raise CheckpointError(f"{path}: hidden_act {str(hf['hidden_act'])[:30]!r} is not OpenAI CLIP's quick_gelu")
    elif hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: activation {str(hf['activation_function'])[:30]!r} is not GPT-2's tanh GELU")
    default, keys = (CLIP_TEXT, CLIP_KEYS) if clip else (GPT2Config(), {})     # keys: our field -> the file's name
    values = {}
    for name, top in GPT2_LIMITS.items():
        key = keys.get(name, name)
        v = hf.get(key, getattr(default, name))
        if type(v) is not int or not 1 <= v <= top:
            raise CheckpointError(f"{path}: {key} must be a whole number from 1 to {top:,}, got {str(v)[:30]}")
        values[name] = v
    key = keys.get("layer_norm_epsilon", "layer_norm_epsilon")
    eps = hf.get(key, default.layer_norm_epsilon)
    if type(eps) not in (int, float) or not (math.isfinite(eps) and 0 < eps < 1):
        raise CheckpointError(f"{path}: {key} must be a small positive number, got {str(eps)[:30]}")
    if values["n_embd"] % values["n_head"]:
        raise CheckpointError(f"{path}: {keys.get('n_embd', 'n_embd')} {values['n_embd']} is not divisible by "
                              f"{keys.get('n_head', 'n_head')} {values['n_head']}")
    if clip and hf.get("intermediate_size", 4 * values["n_embd"]) != 4 * values["n_embd"]:
        raise CheckpointError(f"{path}: intermediate_size {str(hf['intermediate_size'])[:30]} is not 4 x hidden_size "
                              f"{values['n_embd']}, the blocks' MLP width")
    return dataclasses.replace(default, **values, layer_norm_epsilon=float(eps))

# ----------------------------------------------------------------------------------------------------------------
# --bench (times train() on synthetic data) and main()

def bench(cfg):
    """--bench: train()'s own steps timed, eager against torch.compile (and compiled + bf16 autocast on CUDA), on
    synthetic data of hopper's shape; nothing is written."""
    cfg = dataclasses.replace(cfg, context=cfg.context or 20)
    d = data_lib.synthetic_data(obs_dim=11, act_dim=3, episodes=16, length=max(200, 2 * cfg.context))
    for mode_cfg, timer in ev.bench_modes(cfg, SCRIPT, ev.variant_name(cfg, PRESETS), 3 * cfg.context * cfg.batch_size):
        with timer:
            train(mode_cfg, timer, d)

def parse_flags(argv=None):
    return ev.parse_flags(Config, PRESETS, argv, f"{SCRIPT}.py", __doc__.split("\n\n")[1])

def main(argv=None):
    with ev.one_sentence_errors():
        cfg, given = parse_flags(None if argv is None else [str(a) for a in argv])
        ev.check_flags(cfg, "bench", "sample", "text_attention", *ANALYSES)   # every flag, before any work
        check_model(cfg)
        if cfg.sample or cfg.text_attention:                        # GPT-2 alone, on real text
            return sample_text(cfg) if cfg.sample else text_attention(cfg)
        if cfg.bench:
            return bench(cfg)
        if cfg.markov and not os.path.exists(os.path.join(ev.run_folder(SCRIPT, cfg, PRESETS), "ckpt.pt")):
            return markov_analysis(cfg)                             # no run: the --init weights alone
        if analysis := next((name for name in ANALYSES if getattr(cfg, name)), None):
            return ANALYSES[analysis](*load_model(cfg, given))
        with ev.Run(SCRIPT, cfg, given, PRESETS, columns=["g_markov"]) as run:   # --resume: run.cfg is the run's own
            return train(run.cfg, run)

if __name__ == "__main__":
    main()
