"""
GPT2-DT and GPT2-DTMA: a Decision Transformer whose body is pretrained GPT-2 small, with a Mixture-of-Attention
(MoA) gate over each layer's heads, and the Markov-head analysis of

  [P-new] Zhao et al., "Unveiling Markov Heads in Pretrained Language Models for Offline Reinforcement Learning"
  [P-old] Zhao et al., "Enhancing Cross-domain Pre-Trained Decision Transformers with Adaptive Attention"
          (arXiv 2409.06985; the earlier version: GPT-DT, GPT-DTMA, GPT-DTMA-R)

What is in this file, top to bottom:
  Config                 the papers' settings (lr 1e-4, warmup 10K, wd 1e-4, 100K steps, batch 64, K=20 / 50 mazes)
  GPT-2                  nanoGPT-style GPT2 (Block, attention with an optional per-token MoA gate) that returns logits
  GPT-2 weights          read_safetensors (by hand, validated), GPT2.from_pretrained(path or 'gpt2'), cache/download
  DecisionGPT2           DT embeddings (RTG, state, action, timestep) -> the first N GPT-2 blocks -> action from the
                         state token. moa=True is GPT2-DTMA, moa=False is GPT2-DT; init='random' is the paper's DT/DTMA
  training               train(cfg): AdamW, warmup, MSE on actions, optional Markov-gate penalty (GPT2-P, Eq. 9),
                         G_Markov logged (Fig. 9), batched evaluation, checkpoint/--resume, curve.png
  analysis               Markov-matrix test (Def. 4.1, Tab. 1/2), W_q W_k^T heatmaps (Fig. 3), attention maps before /
                         after fine-tuning (Fig. 4), head importance by zeroing heads (Fig. 2), gate mass (Fig. 9),
                         Markov heads on real text (tiktoken), --sample
  main()                 the command line

How to run:
  python gpt2_dtma.py --env hopper-medium                  # GPT2-DTMA, downloads GPT-2 small once (548 MB)
  python gpt2_dtma.py --env hopper-medium --no-moa         # GPT2-DT
  python gpt2_dtma.py --env hopper-medium --markov-penalty 0.1   # GPT2-P ablation
  python gpt2_dtma.py --env hopper-medium --init random    # DTMA (same architecture, no pretraining)
  python gpt2_dtma.py --env hopper-medium --preset cpu     # first GPT-2 block, 300 steps: a 2-core CPU
  python gpt2_dtma.py --sample "The meaning of life is"    # proof that the real weights loaded
  python gpt2_dtma.py --markov                              # Markov-head test on GPT-2 (and on the run's ckpt.pt)
  python gpt2_dtma.py --env hopper-medium --attention-maps --importance   # analyses of the run's ckpt.pt
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
    steps: int = arg(100_000, "gradient steps ([P-new] App. C: 100K)")
    batch_size: int = arg(64, "windows per batch (App. C)")
    context: int = arg(0, "K; 0 = the papers' per task: 20 MuJoCo (Tab. 6), 50 mazes (Tab. 5)")
    lr: float = arg(1e-4, "AdamW learning rate (App. C)")
    weight_decay: float = arg(1e-4, "AdamW weight decay (App. C); the MoA gate gets none")
    warmup_steps: int = arg(10_000, "linear learning-rate warmup, then constant (App. C, Remark 4.9)")
    grad_clip: float = arg(0.25, "gradient-norm clip (DT / LaMo code; the papers are silent)")
    eval_every: int = arg(500, "evaluate (and checkpoint) every this many steps, and at the end (App. C: 500)")
    eval_episodes: int = arg(20, "episodes per target return, run in parallel (App. C: 20)")
    target_return: float = arg(None, "return-to-go prompt in raw return units; default: the dataset's targets")
    log_every: int = arg(100, "print and log the training loss and G_Markov every this many steps")
    device: str = arg("auto", "auto (cuda > mps > cpu), cpu, cuda, mps")
    out: str = arg("", "output folder; default runs/gpt2_dtma/<env>/seed<N>")
    resume: bool = arg(False, "continue from <out>/ckpt.pt")
    preset: str = arg("", "'cpu': the first GPT-2 block, batch 32, K=10, 300 steps: for a 2-core machine")
    # model
    init: str = arg("gpt2", "'gpt2' (Hugging Face cache, else downloaded once), a model.safetensors file or folder, "
                            "or 'random' (the papers' DT/DTMA control: same architecture, no pretraining)")
    layers: int = arg(12, "keep the first N GPT-2 blocks (layer 0 holds the Markov heads)")
    n_embd: int = arg(768, "width with --init random (a checkpoint brings its own)")
    n_head: int = arg(12, "heads with --init random (a checkpoint brings its own)")
    dropout: float = arg(0.1, "dropout on embeddings, attention and residuals (DT / LaMo)")
    moa: bool = arg(True, "the Mixture-of-Attention gate (GPT2-DTMA); --no-moa gives GPT2-DT")
    markov_penalty: float = arg(0.0, "alpha of [P-new] Eq. 9: penalise the Markov heads' gate (GPT2-P: 0.1)")
    # analysis (each writes a PNG in the run folder and prints a table; none of them trains)
    markov: bool = arg(False, "Markov-matrix test of the layer-0 heads (Def. 4.1, Tab. 1/2) + W_q W_k^T heatmaps "
                              "(Fig. 3), on --init and on the run's ckpt.pt when there is one")
    markov_r: float = arg(20.0, "threshold r of Def. 4.1 (ii); the table shows r=8 and r=20 either way")
    attention_maps: bool = arg(False, "layer-0 attention on dataset windows before / after fine-tuning (Fig. 4)")
    importance: bool = arg(False, "head importance by zeroing each head's output during rollouts (Fig. 2)")
    text_attention: str = arg("", "TEXT: layer-0 attention of GPT-2 on real text (tiktoken), Markov heads marked")
    sample: str = arg("", "PROMPT: print GPT-2's continuation (tiktoken), the proof that real weights loaded")
    bench: bool = arg(False, "time forward+backward steps (ms/step) for --layers/--batch-size/--context and exit")


# A configuration that learns something on 2 CPU cores in minutes: the first GPT-2 block only (at full width 768, so
# the pretrained weights still fit; layer 0 holds the Markov heads and its MoA gate), K=10 ([P-new] Tab. 6: 77.1 on
# hopper-medium with k=10), a short warmup and a higher lr, one evaluation at the end. A 768-wide block costs ~0.8 s
# per step at batch 32 on one core, so this is a demonstration, not a reproduction.
PRESETS = {"cpu": dict(layers=1, batch_size=32, context=10, lr=3e-4, warmup_steps=50, steps=300, eval_every=300,
                       eval_episodes=10, log_every=25)}


# ================================================================================================================
# GPT-2 (nanoGPT-style). Imports only torch, math, dataclasses: this part can be copied out alone.
# ================================================================================================================

@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    dropout: float = 0.0


class SelfAttention(nn.Module):
    """GPT-2 causal self-attention with an optional per-token Mixture-of-Attention gate over the heads.

    MoA ([P-new] Eqs. 6-8): y(e) = sum_i G_i(e) Head_i(e), G(e) = softmax(W_g e) over the layer's N heads.
    The papers leave placement, scale and init open (notes §2.3, §8.3); chosen here, as in MoH (Jin et al. 2024,
    which the paper cites): the gate reads the same LN1 output as the heads, multiplies each head's output before
    the pretrained c_proj, is scaled by N and zero-initialised, so a uniform gate gives N * 1/N = 1 and GPT2-DTMA
    equals GPT2-DT exactly at step 0 (a literal scale 1 would shrink every head to 1/12 of the pretrained function).
    """

    def __init__(self, n_embd, n_head, dropout=0.0, moa=False):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)     # q, k, v of all heads (HF Conv1D transposed)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)
        self.gate = None
        if moa:
            self.gate = nn.Linear(n_embd, n_head)         # W_g, b_g of Eq. 7
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)

    def forward(self, x, allowed=None, need_probs=False, head_mask=None):
        """x: (B,T,C) = LN1(h). allowed: (B,1,T,T) bool (True = may attend) or None for plain causal.
        head_mask: (N,) or (B,N) multiplier of each head's output (head importance). Returns y (B,T,C) and
        aux dict: 'probs' (B,N,T,T) when need_probs, 'gate' (B,T,N) softmax gate when MoA."""
        B, T, C = x.shape
        N, D = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)                       # 3 x (B,T,C)
        q = q.view(B, T, N, D).transpose(1, 2)                         # (B,N,T,D)
        k = k.view(B, T, N, D).transpose(1, 2)
        v = v.view(B, T, N, D).transpose(1, 2)
        p_drop = self.dropout if self.training else 0.0
        aux = {}
        if need_probs:
            # Eq. 8 written out, because the analysis plots the probabilities (SDPA does not return them)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D)             # (B,N,T,T); sqrt(64) as GPT-2 (notes §8.17)
            if allowed is None:
                allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~allowed, float("-inf"))
            probs = F.softmax(att, dim=-1)                             # (B,N,T,T)
            aux["probs"] = probs
            o = F.dropout(probs, p_drop, self.training) @ v            # (B,N,T,D)
        elif allowed is None:
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p_drop)
        if self.gate is not None:
            g = F.softmax(self.gate(x), dim=-1)                        # (B,T,N)  Eq. 7, per token
            aux["gate"] = g
            o = o * (N * g).transpose(1, 2).unsqueeze(-1)              # (B,N,T,D)  Eq. 6, scaled by N
        if head_mask is not None:
            hm = head_mask.to(o.dtype)
            o = o * (hm.view(1, N, 1, 1) if hm.dim() == 1 else hm.view(B, N, 1, 1))
        y = o.transpose(1, 2).reshape(B, T, C)                         # (B,T,C) heads side by side
        return self.resid_drop(self.c_proj(y)), aux


class MLP(nn.Module):
    def __init__(self, n_embd, dropout=0.0):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))   # GPT-2's 'gelu_new'


class Block(nn.Module):
    """Pre-LN transformer block: h = h + Attn(LN1(h)); h = h + MLP(LN2(h))."""

    def __init__(self, n_embd, n_head, dropout=0.0, eps=1e-5, moa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps)
        self.attn = SelfAttention(n_embd, n_head, dropout, moa)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x, allowed=None, need_probs=False, head_mask=None):
        a, aux = self.attn(self.ln_1(x), allowed, need_probs, head_mask)
        x = x + a
        return x + self.mlp(self.ln_2(x)), aux


class GPT2(nn.Module):
    """GPT-2 language model. Parameter names follow Hugging Face's GPT2LMHeadModel without the 'transformer.'
    prefix (wte, wpe, h.N.*, ln_f), with nn.Linear weights (HF's Conv1D stores them transposed)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg.n_embd, cfg.n_head, cfg.dropout, cfg.layer_norm_epsilon)
                               for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.apply(_init_weights)
        for name, p in self.named_parameters():          # GPT-2's scaled init of residual projections
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx, need_probs=False):
        """idx: (B,T) int64 token ids -> logits (B,T,vocab), plus the per-layer attention probabilities
        (list of (B,N,T,T)) when need_probs."""
        B, T = idx.shape
        assert T <= self.cfg.n_positions, f"sequence of {T} tokens is longer than n_positions={self.cfg.n_positions}"
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))                   # (B,T,C)
        probs = []
        for blk in self.h:
            x, aux = blk(x, need_probs=need_probs)
            probs.append(aux.get("probs"))
        logits = self.ln_f(x) @ self.wte.weight.t()                    # (B,T,vocab), lm_head tied to wte
        return (logits, probs) if need_probs else logits

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=40, generator=None):
        """nanoGPT sampling: idx (1,T) -> (1,T+max_new_tokens)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.n_positions:])[:, -1, :] / temperature   # (1,vocab)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    @classmethod
    def from_pretrained(cls, path_or_name="gpt2"):
        """'gpt2' (HF cache, else download once), a model.safetensors file, or a folder holding it (and config.json).
        See the 'GPT-2 weights' section below: it uses only the standard library."""
        cfg, sd = load_gpt2_checkpoint(path_or_name)
        model = cls(cfg)
        model.load_state_dict(sd, strict=True)
        return model


def _init_weights(m):
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, 0.0, 0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, 0.0, 0.02)


# ================================================================================================================
# GPT-2 weights: a hand-written safetensors reader and the name mapping. Standard library only.
# ================================================================================================================
import json  # noqa: E402  (kept with the loader so the module part above stays torch-only)
import os  # noqa: E402
import struct  # noqa: E402

SAFETENSORS_DTYPES = {"F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2),
                      "BF16": (torch.bfloat16, 2), "I64": (torch.int64, 8), "I32": (torch.int32, 4),
                      "I16": (torch.int16, 2), "I8": (torch.int8, 1), "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1)}
MAX_HEADER_BYTES = 100 * 1024 * 1024        # the format's own limit (safetensors rejects larger headers)
GPT2_URL = "https://huggingface.co/openai-community/gpt2/resolve/main/model.safetensors"
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class CheckpointError(Exception):
    """A checkpoint that cannot be used (missing, truncated, malformed, wrong names or shapes): one sentence."""


def read_safetensors(path):
    """Parse a .safetensors file by hand -> dict[str, torch.Tensor] (CPU, own memory).

    Layout: 8-byte little-endian u64 header length n; n bytes of JSON {name: {dtype, shape, data_offsets:[a,b]},
    optional "__metadata__": {str: str}}; then the raw little-endian tensor bytes, offsets relative to the data start.
    Everything is checked against the file size before a byte of tensor data is read, so a truncated or hostile
    file fails fast with CheckpointError and never allocates more than the file holds. Nothing is executed (no pickle).
    """
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    with f:
        if size < 8:
            raise CheckpointError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", f.read(8))
        if n < 2 or n > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {n} does not fit the file ({size} bytes); truncated or not "
                                  f"a safetensors file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
            raise CheckpointError(f"{path}: the header is not valid JSON; not a safetensors file") from None
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
                raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {info['dtype']!r}")
            shape, offs = info["shape"], info["data_offsets"]
            if not all(type(s) is int and 0 <= s < 2 ** 40 for s in shape) or len(shape) > 16:
                raise CheckpointError(f"{path}: tensor '{name}' has an invalid shape {shape}")
            if len(offs) != 2 or not all(type(o) is int for o in offs) or not 0 <= offs[0] <= offs[1] <= data_len:
                raise CheckpointError(f"{path}: tensor '{name}' has offsets {offs} outside the data ({data_len} "
                                      f"bytes); the file is truncated or corrupt")
            numel = math.prod(shape)
            if numel * SAFETENSORS_DTYPES[info["dtype"]][1] != offs[1] - offs[0]:
                raise CheckpointError(f"{path}: tensor '{name}' ({info['dtype']} {shape}) does not match its "
                                      f"{offs[1] - offs[0]} bytes of data")
            spans.append((offs[0], offs[1], name))
        spans.sort()
        for (a0, b0, n0), (a1, b1, n1) in zip(spans, spans[1:]):
            if a1 < b0:
                raise CheckpointError(f"{path}: tensors '{n0}' and '{n1}' overlap in the data")
        out = {}
        for a, b, name in spans:
            info = header[name]
            dtype = SAFETENSORS_DTYPES[info["dtype"]][0]
            f.seek(8 + n + a)
            buf = bytearray(f.read(b - a))
            if len(buf) != b - a:
                raise CheckpointError(f"{path}: file ended while reading '{name}'")
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            t = t.view(dtype) if dtype != torch.uint8 else t
            if not struct.pack("=H", 1) == struct.pack("<H", 1):      # big-endian host: data are little-endian
                t = t.view(torch.uint8).view(-1, t.element_size()).flip(-1).reshape(-1).view(dtype)
            out[name] = t.reshape(info["shape"])
        return out


def gpt2_state_from_hf(sd, cfg):
    """HF GPT-2 tensors (with or without the 'transformer.' prefix, Conv1D layout) -> GPT2 state dict. Checks every
    name and shape, so a checkpoint of another model is a CheckpointError, not a silent half-load."""
    out = {}
    for k, v in sd.items():
        k = k[len("transformer."):] if k.startswith("transformer.") else k
        if k == "lm_head.weight" or k.endswith(".attn.bias") or k.endswith(".attn.masked_bias"):
            continue                             # tied to wte / HF's causal-mask buffers
        if k.endswith(_CONV1D) and v.dim() == 2:
            v = v.t()                            # Conv1D (in, out) -> nn.Linear (out, in)
        out[k] = v.float().contiguous()
    C, V, P = cfg.n_embd, cfg.vocab_size, cfg.n_positions
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({p + "ln_1.weight": (C,), p + "ln_1.bias": (C,), p + "ln_2.weight": (C,), p + "ln_2.bias": (C,),
                       p + "attn.c_attn.weight": (3 * C, C), p + "attn.c_attn.bias": (3 * C,),
                       p + "attn.c_proj.weight": (C, C), p + "attn.c_proj.bias": (C,),
                       p + "mlp.c_fc.weight": (4 * C, C), p + "mlp.c_fc.bias": (4 * C,),
                       p + "mlp.c_proj.weight": (C, 4 * C), p + "mlp.c_proj.bias": (C,)})
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise CheckpointError(f"not a GPT-2 checkpoint with this config: {len(missing)} tensors missing "
                              f"(e.g. '{missing[0]}')")
    for k, s in shapes.items():
        if tuple(out[k].shape) != s:
            raise CheckpointError(f"tensor '{k}' has shape {tuple(out[k].shape)}, expected {s}")
    return {k: out[k] for k in shapes}


def gpt2_config_from_json(path):
    """HF config.json -> GPT2Config (GPT-2 small defaults for whatever it does not say)."""
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"{path}: activation '{act}' is not GPT-2's tanh GELU")
    d = GPT2Config()
    return GPT2Config(vocab_size=int(hf.get("vocab_size", d.vocab_size)),
                      n_positions=int(hf.get("n_positions", d.n_positions)),
                      n_embd=int(hf.get("n_embd", d.n_embd)), n_layer=int(hf.get("n_layer", d.n_layer)),
                      n_head=int(hf.get("n_head", d.n_head)),
                      layer_norm_epsilon=float(hf.get("layer_norm_epsilon", d.layer_norm_epsilon)))


def hf_cache_candidates():
    """model.safetensors files of GPT-2 small in the Hugging Face hub cache, newest snapshot first."""
    roots = []
    if os.environ.get("HF_HUB_CACHE"):
        roots.append(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        roots.append(os.path.join(os.environ["HF_HOME"], "hub"))
    roots.append(os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub"))
    found = []
    for root in roots:
        for repo in ("models--openai-community--gpt2", "models--gpt2"):
            snaps = os.path.join(root, repo, "snapshots")
            if os.path.isdir(snaps):
                for s in sorted(os.listdir(snaps), key=lambda s: -os.path.getmtime(os.path.join(snaps, s))):
                    p = os.path.join(snaps, s, "model.safetensors")
                    if os.path.isfile(p):
                        found.append(p)
    return found


def gpt2_cache_dir():
    return os.environ.get("GPT2_DTMA_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "gpt2_dtma"))


def download(url, dest):
    """Download url to dest once, with a progress line: written to dest + '.part', renamed when complete."""
    import sys
    import urllib.request
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    tmp = dest + ".part"
    print(f"downloading {url} -> {dest}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=30) as r, open(tmp, "wb") as f:
            total, done = int(r.headers.get("Content-Length") or 0), 0
            while chunk := r.read(1 << 20):
                f.write(chunk)
                done += len(chunk)
                pct = f"{100 * done / total:5.1f}%" if total else ""
                print(f"\r  {done / 2 ** 20:8.1f} MB {pct}", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        if total and done != total:
            raise OSError(f"got {done} of {total} bytes")
    except (OSError, ValueError) as e:                # urllib.error.URLError is an OSError
        if os.path.exists(tmp):
            os.remove(tmp)
        raise CheckpointError(f"GPT-2 weights are not in the Hugging Face cache and could not be downloaded "
                              f"({getattr(e, 'reason', e)}); with a network run `python gpt2_dtma.py --sample hi` "
                              f"once, or pass --init PATH to a local model.safetensors") from None
    os.replace(tmp, dest)
    return dest


def find_gpt2_weights(path_or_name="gpt2", allow_download=True):
    """'gpt2' -> HF cache, then our cache, then download once. A file or folder path -> its model.safetensors."""
    if path_or_name in ("gpt2", "openai-community/gpt2"):
        found = hf_cache_candidates()
        if found:
            return found[0]
        dest = os.path.join(gpt2_cache_dir(), "model.safetensors")
        if os.path.isfile(dest):
            return dest
        if not allow_download:
            raise CheckpointError("GPT-2 weights are not in the Hugging Face cache or " + gpt2_cache_dir())
        return download(GPT2_URL, dest)
    p = os.path.expanduser(path_or_name)
    if os.path.isdir(p):
        p = os.path.join(p, "model.safetensors")
    if not os.path.isfile(p):
        raise CheckpointError(f"no GPT-2 checkpoint at {path_or_name} (expected model.safetensors or a folder "
                              f"holding it, or the name 'gpt2')")
    return p


def load_gpt2_checkpoint(path_or_name="gpt2"):
    """-> (GPT2Config, state dict for GPT2). config.json next to the file is used when present."""
    path = find_gpt2_weights(path_or_name)
    cfg_path = os.path.join(os.path.dirname(path), "config.json")
    cfg = gpt2_config_from_json(cfg_path) if os.path.isfile(cfg_path) else GPT2Config()
    return cfg, gpt2_state_from_hf(read_safetensors(path), cfg)


# ================================================================================================================
# GPT2-DT / GPT2-DTMA (torch only)
# ================================================================================================================

class DecisionGPT2(nn.Module):
    """Decision Transformer with a GPT-2 body (LaMo / Wiki-RL structure, notes §2.1).

    tokens (R_1, s_1, a_1, ..., R_K, s_K, a_K): linear embeddings of RTG, state, action, plus a learned timestep
    embedding added to each (DT order: time before embed_ln; LaMo adds it after, we keep canonical DT), no GPT-2 wpe
    (DT/LaMo drop it: position comes from the timestep). Blocks: GPT-2's, moa=True adds the per-layer gate.
    Action: tanh(Linear(y_{s_t})), from the state token."""

    def __init__(self, obs_dim, act_dim, max_ep_len, n_embd=768, n_head=12, n_layer=12, dropout=0.1, moa=True,
                 eps=1e-5):
        super().__init__()
        self.arch = dict(obs_dim=obs_dim, act_dim=act_dim, max_ep_len=max_ep_len, n_embd=n_embd, n_head=n_head,
                         n_layer=n_layer, moa=moa, eps=eps)          # what model_from_checkpoint needs
        self.obs_dim, self.act_dim, self.max_ep_len = obs_dim, act_dim, max_ep_len
        self.n_embd, self.n_head, self.n_layer = n_embd, n_head, n_layer
        self.embed_timestep = nn.Embedding(max_ep_len, n_embd)
        self.embed_return = nn.Linear(1, n_embd)
        self.embed_state = nn.Linear(obs_dim, n_embd)
        self.embed_action = nn.Linear(act_dim, n_embd)
        self.embed_ln = nn.LayerNorm(n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, eps, moa) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=eps)
        self.predict_action = nn.Linear(n_embd, act_dim)
        self.apply(_init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))
            if ".attn.gate." in name:
                nn.init.zeros_(p)                     # zero gate: GPT2-DTMA == GPT2-DT at step 0

    @property
    def moa(self):
        return self.blocks[0].attn.gate is not None

    def load_gpt2_blocks(self, gpt2: GPT2):
        """Copy the first n_layer pretrained blocks and ln_f (the gates stay zero). Everything else is new."""
        assert gpt2.cfg.n_embd == self.n_embd and gpt2.cfg.n_head == self.n_head, "width/heads differ from GPT-2's"
        assert gpt2.cfg.n_layer >= self.n_layer, f"GPT-2 has only {gpt2.cfg.n_layer} blocks"
        for mine, theirs in zip(self.blocks, gpt2.h):
            missing, unexpected = mine.load_state_dict(theirs.state_dict(), strict=False)
            assert not unexpected and all(".gate." in f".{k}" for k in missing), (missing, unexpected)
        self.ln_f.load_state_dict(gpt2.ln_f.state_dict())
        return self

    def forward(self, states, actions, rtg, timesteps, mask=None, need_probs=False, head_mask=None):
        """states (B,K,obs_dim), actions (B,K,act_dim), rtg (B,K,1), timesteps (B,K) int64, mask (B,K) 1 = real.
        head_mask: (L,N) multipliers of each head's output (or None). Returns predicted actions (B,K,act_dim) and
        aux: 'gates' list of (B,3K,N) per layer (MoA), 'probs' list of (B,N,3K,3K) when need_probs."""
        B, K, _ = states.shape
        t = self.embed_timestep(timesteps.clamp(0, self.max_ep_len - 1))           # (B,K,C)
        tokens = torch.stack([self.embed_return(rtg) + t,
                              self.embed_state(states) + t,
                              self.embed_action(actions) + t], dim=2)              # (B,K,3,C)
        x = self.drop(self.embed_ln(tokens.reshape(B, 3 * K, self.n_embd)))        # (B,3K,C) R1 s1 a1 R2 ...
        allowed = None
        if mask is not None:
            T = 3 * K
            key_ok = mask.bool().repeat_interleave(3, dim=1)                       # (B,3K)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            # padded keys are hidden; every token may see itself, so a padded row never has an empty softmax
            allowed = (causal & (key_ok[:, None, :] | torch.eye(T, dtype=torch.bool, device=x.device)))[:, None]
        gates, probs = [], []
        for i, blk in enumerate(self.blocks):
            x, aux = blk(x, allowed, need_probs, None if head_mask is None else head_mask[i])
            gates.append(aux.get("gate"))
            probs.append(aux.get("probs"))
        y = self.ln_f(x).reshape(B, K, 3, self.n_embd)                              # (B,K,3,C)
        a_pred = torch.tanh(self.predict_action(y[:, :, 1]))                       # (B,K,act_dim) from s_t tokens
        return a_pred, {"gates": gates, "probs": probs}


def markov_gate_mass(gates, mask, heads=(1, 5, 10)):
    """G_Markov ([P-new] Tab. 5/6, Eq. 9): sum of the layer-0 gate weights of the Markov heads, averaged over the
    unpadded tokens. gates: (B,3K,N) softmax gate of layer 0; mask (B,K). Differentiable (the GPT2-P penalty)."""
    m = mask.repeat_interleave(3, dim=1).to(gates.dtype)                           # (B,3K)
    g = gates[..., list(heads)].sum(-1)                                            # (B,3K)
    return (g * m).sum() / m.sum().clamp_min(1.0)


# ================================================================================================================
# Training, evaluation and the command line (everything below needs numpy and the project's data/evaluate)
# ================================================================================================================
import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import data as data_lib  # noqa: E402
import evaluate as eval_lib  # noqa: E402

MARKOV_HEADS = (1, 5, 10)   # layer-0 heads of GPT-2 small ([P-new] Tab. 1, Eq. 9)


def pick_device(name):
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def build_model(cfg, obs_dim, act_dim, max_ep_len, init=None):
    """GPT2-DT(MA) with the first cfg.layers pretrained GPT-2 blocks, or the same shape from scratch (init='random').
    The DT embeddings and the head are drawn from torch's RNG: seed it first for a reproducible model."""
    init = cfg.init if init is None else init
    if init == "random":
        return DecisionGPT2(obs_dim, act_dim, max_ep_len, cfg.n_embd, cfg.n_head, cfg.layers, cfg.dropout, cfg.moa)
    gpt = GPT2.from_pretrained(init)
    if not 1 <= cfg.layers <= gpt.cfg.n_layer:
        raise CheckpointError(f"--layers {cfg.layers}: the checkpoint has {gpt.cfg.n_layer} blocks")
    model = DecisionGPT2(obs_dim, act_dim, max_ep_len, gpt.cfg.n_embd, gpt.cfg.n_head, cfg.layers, cfg.dropout,
                         cfg.moa, gpt.cfg.layer_norm_epsilon)
    return model.load_gpt2_blocks(gpt)


def model_from_checkpoint(ck):
    """A trained GPT2-DT(MA) from a ckpt.pt dict, without needing the GPT-2 weights again."""
    model = DecisionGPT2(**ck["arch"], dropout=0.0)
    model.load_state_dict(ck["model"])
    return model.eval()


def make_act(model):
    """The evaluate() policy: a batch of contexts -> the action predicted at the last (current) position."""
    def act(batch, live):
        return model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[0][:, -1]
    return act


def loss_fn(model, batch, markov_penalty=0.0, heads=MARKOV_HEADS):
    """Action MSE over real steps (Eq. 3 is a sum; the DT code's mean is only a scale) + GPT2-P's alpha * G_Markov
    ([P-new] Eq. 9), G the layer-0 gate of the Markov heads averaged over real tokens. -> (loss, G_Markov or None)."""
    pred, aux = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])
    err = ((pred - batch["actions"]) ** 2).mean(-1)                                  # (B,K)
    loss = (err * batch["mask"]).sum() / batch["mask"].sum()
    g = None
    if aux["gates"][0] is not None and model.n_head > max(heads):
        g = markov_gate_mass(aux["gates"][0], batch["mask"], heads)
        if markov_penalty:
            loss = loss + markov_penalty * g
    return loss, g


@torch.no_grad()
def gate_mass(model, batch, heads=MARKOV_HEADS):
    """G_Markov on a fixed batch in eval mode (Fig. 9, Tabs. 5/6); '' when the model has no gate or no such heads."""
    if not model.moa or model.n_head <= max(heads):
        return ""
    was = model.training
    model.eval()
    gates = model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[1]["gates"]
    model.train(was)
    return f"{markov_gate_mass(gates[0], batch['mask'], heads).item():.4f}"


LOG_FIELDS = ["step", "loss", "lr", "g_markov", "target", "eval_return", "eval_return_std", "normalized_score",
              "normalized_score_std", "success_rate", "steps_to_goal", "wall_time"]


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_curve(rows, path, title):
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    train_rows = [r for r in rows if r.get("loss", "") != ""]
    ax1.plot([int(r["step"]) for r in train_rows], [float(r["loss"]) for r in train_rows])
    ax1.set(xlabel="step", ylabel="loss", yscale="log", title="training loss")
    for target in sorted({r["target"] for r in rows if r.get("target", "") != ""}, key=float):
        ev = [r for r in rows if r.get("target", "") == target]
        ax2.plot([int(r["step"]) for r in ev], [float(r["normalized_score"]) for r in ev], "o-", label=f"target {target}")
    ax2.set(xlabel="step", ylabel="normalised score", title="evaluation")
    if ax2.lines:
        ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gates(rows, path, title):
    """[P-new] Fig. 9: the MoA weight of the Markov heads (sum of layer-0 gates of heads 1, 5, 10) vs the rest."""
    pts = [(int(r["step"]), float(r["g_markov"])) for r in rows if r.get("g_markov", "") != ""]
    if not pts:
        return False
    plt = _plt()
    s, g = zip(*pts)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(s, g, label="Markov heads 1, 5, 10", color="tab:red")
    ax.plot(s, [1 - x for x in g], label="other 9 heads", color="tab:blue")
    ax.axhline(0.25, ls=":", color="gray", label="uniform (3/12)")
    ax.set(xlabel="step", ylabel="layer-0 MoA weight", title=title, ylim=(0, 1))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_evals(model, d, cfg, device, seed):
    """Evaluate every target return; returns [(target, result dict)]."""
    targets = [cfg.target_return] if cfg.target_return is not None else d.target_returns
    model.eval()
    out = [(g, eval_lib.evaluate(make_act(model), d, cfg.eval_episodes, g, seed, cfg.context, device)) for g in targets]
    model.train()
    return out


def run_dir(cfg):
    name = (cfg.dataset or cfg.env).replace("/", "-")
    return cfg.out or os.path.join("runs", "gpt2_dtma", name, f"seed{cfg.seed}")


def resolve_context(cfg, d):
    if not cfg.context:   # the papers' K: 20 on MuJoCo (Tab. 6 k=20 = Tab. 3), 50 on PointMaze (Tab. 5 k=50 = Tab. 4)
        cfg.context = 50 if d.goal_reaching else 20
    return cfg


def variant_name(cfg):
    base = "DT" if cfg.init == "random" else "GPT2-DT"
    return (base + ("MA" if cfg.moa else "")) + (f"-P(α={cfg.markov_penalty:g})" if cfg.markov_penalty else "")


def train(cfg):
    device = pick_device(cfg.device)
    data_lib.resolve(cfg.dataset or cfg.env)  # an unknown name fails first,
    if cfg.init != "random":
        find_gpt2_weights(cfg.init)            # then a missing checkpoint (or it downloads), before the data load
    d = data_lib.load_data(cfg.dataset or cfg.env)
    resolve_context(cfg, d)
    if cfg.markov_penalty and not cfg.moa:
        raise CheckpointError("--markov-penalty penalises the MoA gate; it needs the gate (drop --no-moa)")
    out = run_dir(cfg)
    os.makedirs(out, exist_ok=True)
    ckpt_path = os.path.join(out, "ckpt.pt")
    print(f"data: {d.dataset_id}, {len(d.episodes)} episodes, {len(d.flat['rewards']):,} steps; "
          f"normalised with {d.ref_source}; targets {d.target_returns}; K={cfg.context}; device {device}")

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, d.obs_dim, d.act_dim, d.max_ep_len).to(device)
    n_gate = sum(p.numel() for n, p in model.named_parameters() if ".gate." in n)
    print(f"{variant_name(cfg)}: {model.n_layer} blocks of width {model.n_embd}, {model.n_head} heads, init "
          f"'{cfg.init}'; parameters: {sum(p.numel() for p in model.parameters()):,} (MoA gates {n_gate:,})")
    # no weight decay on the gate: decay pulls W_g to 0, i.e. towards the uniform mixture MoA is there to move away from
    groups = [{"params": [p for n, p in model.named_parameters() if ".gate." not in n]},
              {"params": [p for n, p in model.named_parameters() if ".gate." in n], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / cfg.warmup_steps, 1.0))
    rng = np.random.default_rng(cfg.seed)
    probe = {k: v.to(device) for k, v in d.sample(64, cfg.context, np.random.default_rng(cfg.seed + 20_000)).items()}
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
    if step == 0 and not rows:
        rows.append(dict(step=0, g_markov=gate_mass(model, probe), wall_time="0.0"))   # Fig. 9 starts at 0.25

    def save():
        torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(), scheduler=sched.state_dict(), step=step,
                        wall_time=wall, numpy_rng=json.dumps(rng.bit_generator.state), torch_rng=torch.get_rng_state(),
                        config=dataclasses.asdict(cfg), state_mean=torch.from_numpy(d.state_mean),
                        state_std=torch.from_numpy(d.state_std), return_scale=d.return_scale,
                        max_ep_len=d.max_ep_len, dataset_id=d.dataset_id, arch=model.arch), ckpt_path + ".tmp")
        os.replace(ckpt_path + ".tmp", ckpt_path)  # never leave a half-written checkpoint behind
        with open(os.path.join(out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, LOG_FIELDS, restval="")
            w.writeheader()
            w.writerows(rows)

    last_eval, final = "", None
    t_log, losses = time.time(), []
    model.train()
    title = f"{variant_name(cfg)} {d.dataset_id} seed {cfg.seed}"
    try:
        while step < cfg.steps:
            t0 = time.time()
            batch = {k: v.to(device) for k, v in d.sample(cfg.batch_size, cfg.context, rng).items()}
            loss, _ = loss_fn(model, batch, cfg.markov_penalty)
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
                g = gate_mass(model, probe)
                rows.append(dict(step=step, loss=f"{np.mean(losses):.6f}", lr=f"{sched.get_last_lr()[0]:.3e}",
                                 g_markov=g, wall_time=f"{wall:.1f}"))
                print(f"step {step:6d} | loss {np.mean(losses):.5f} | lr {sched.get_last_lr()[0]:.2e} | "
                      f"{ms:.1f} ms/step" + (f" | G_Markov {g}" if g else "") + last_eval, flush=True)
                t_log, losses = time.time(), []
            if step % cfg.eval_every == 0 or step == cfg.steps:
                t0 = time.time()
                results = run_evals(model, d, cfg, device, cfg.seed + 10_000)
                wall += time.time() - t0
                for tg, res in results:
                    rows.append(dict(step=step, target=tg, eval_return=f"{res['returns'].mean():.2f}",
                                     eval_return_std=f"{res['returns'].std():.2f}",
                                     normalized_score=f"{res['normalized'].mean():.2f}",
                                     normalized_score_std=f"{res['normalized'].std():.2f}",
                                     success_rate=f"{res['success'].mean():.3f}" if "success" in res else "",
                                     steps_to_goal=f"{res['steps_to_goal'].mean():.1f}" if "success" in res else "",
                                     wall_time=f"{wall:.1f}"))
                    print(f"eval step {step} target {tg:g}: {eval_lib.summarize(res)} ({time.time() - t0:.0f}s)")
                final = results[0]
                last_eval = f" | eval {final[1]['normalized'].mean():.1f}"
                save()
                plot_curve(rows, os.path.join(out, "curve.png"), title)
                plot_gates(rows, os.path.join(out, "gates.png"), title)
                t_log = time.time()
    except KeyboardInterrupt:
        save()
        print(f"\ninterrupted at step {step}; checkpoint saved, continue with --resume")
        raise SystemExit(130)
    if final is None:  # resumed at or past --steps: evaluate what the checkpoint holds
        final = run_evals(model, d, cfg, device, cfg.seed + 10_000)[0]
    res = final[1]
    if "success" in res:  # the papers' maze metric: steps to the goal (lower is better), the horizon when missed
        print(f"maze: steps_to_goal={res['steps_to_goal'].mean():.1f} success_rate={res['success'].mean():.3f}")
    print(f"final: normalized_score={res['normalized'].mean():.2f} return={res['returns'].mean():.2f} "
          f"episodes={len(res['returns'])}")
    return model, res


# ================================================================================================================
# Analysis: Markov heads (Def. 4.1), W_q W_k^T heatmaps (Fig. 3), attention maps (Fig. 4), head importance (Fig. 2),
# MoA gate mass (Fig. 9), Markov heads on real text. Each function is checked on inputs with a known answer.
# ================================================================================================================

def head_qk_matrix(c_attn_weight, n_head, i, layout="model"):
    """A_i = W_q^i (W_k^i)^T of head i ([P-new] Def. 4.2), biases and the LN gain ignored as in the papers.
    c_attn_weight: (3C, C) in nn.Linear layout, so q_i = x @ Wq_i.T with Wq_i (D, C).
    layout 'model': the C x C bilinear form with q_i . k_j = x_i A x_j^T (Def. 4.1 / Thm 4.3 read literally);
    layout 'head' : the D x D product Wq_i Wk_i^T (Remark 4.7's "d = 64" reading). Notes §8.1: both are shown."""
    C = c_attn_weight.shape[1]
    D = C // n_head
    Wq = c_attn_weight.detach()[i * D:(i + 1) * D].double()                # (D,C)
    Wk = c_attn_weight.detach()[C + i * D:C + (i + 1) * D].double()        # (D,C)
    return Wq.t() @ Wk if layout == "model" else Wq @ Wk.t()      # (C,C) or (D,D)


def markov_stats(A, r=20.0, eps=1e-8):
    """Def. 4.1: A is Markov iff (i) every A_ii > 0 and (ii) mean_i|A_ii| / mean_{i!=j}|A_ij| > r.
    eps in the denominator: [P-old] Remark 3. r: [P-new] says 8 (Remark 4.7), [P-old] 20; [P-old] Tab. 2 gives head 9
    a ratio of 15.37 yet [P-new] Tab. 1 marks its (ii) as failed, which only r = 20 explains: default 20."""
    A = A.double()
    d = A.shape[0]
    diag = A.diagonal()
    mean_diag = diag.abs().mean()
    mean_off = (A.abs().sum() - diag.abs().sum()) / (d * d - d)
    ratio = float(mean_diag / (mean_off + eps))
    cond_i = bool((diag > 0).all())
    return {"cond_i": cond_i, "ratio": ratio, "cond_ii": ratio > r, "markov": cond_i and ratio > r}


def markov_table(c_attn_weight, n_head, rs=(8.0, 20.0)):
    """Per head of one layer: (i), ratio and Markov-ness for both layouts and each r. -> list of dict rows."""
    rows = []
    for i in range(n_head):
        row = {"head": i}
        for layout in ("model", "head"):
            st = markov_stats(head_qk_matrix(c_attn_weight, n_head, i, layout))
            row[f"{layout}_i"], row[f"{layout}_ratio"] = st["cond_i"], st["ratio"]
            for r in rs:
                row[f"{layout}_markov_r{r:g}"] = st["cond_i"] and st["ratio"] > r
        rows.append(row)
    return rows


def format_markov_table(tables, rs=(8.0, 20.0)):
    """tables: {label: rows of markov_table} -> a markdown table, one column group per label."""
    labels = list(tables)
    head = "| head | " + " | ".join(f"{lab} {lay} (i) | ratio | Markov r={'/'.join(f'{r:g}' for r in rs)}"
                                     for lab in labels for lay in ("CxC", "DxD")) + " |"
    lines = [head, "|" + "---|" * (1 + 3 * 2 * len(labels))]
    for i in range(len(tables[labels[0]])):
        cells = [str(i)]
        for lab in labels:
            row = tables[lab][i]
            for lay in ("model", "head"):
                cells += ["✓" if row[f"{lay}_i"] else "×", f"{row[f'{lay}_ratio']:.2f}",
                          "/".join("✓" if row[f"{lay}_markov_r{r:g}"] else "×" for r in rs)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def diagonal_attention_mass(probs, mask=None):
    """Mean attention a token pays to itself, per head: probs (B,N,T,T) -> (N,). A Markov head with random
    embeddings attends to the last input token, i.e. the diagonal (Thm 4.3, Fig. 4). mask (B,T): rows to average."""
    d = probs.diagonal(dim1=-2, dim2=-1)                                           # (B,N,T)
    if mask is None:
        return d.mean(dim=(0, 2))
    m = mask.to(d.dtype)[:, None, :]                                               # (B,1,T)
    return (d * m).sum(dim=(0, 2)) / (m.sum() * 1.0).clamp_min(1.0)


@torch.no_grad()
def head_importance(model, batch):
    """[P-new] §4.1.2 / Fig. 2: importance of head (l, i) = || a - a_{-(l,i)} ||_2, the change of the predicted
    action at the current (last) step when that head's output is replaced by zeros (before c_proj), on the same
    context, averaged over the batch. -> (L, N). One forward per layer: the N ablations ride in the batch."""
    model.eval()
    s, a, R, t, m = (batch[k] for k in ("states", "actions", "rtg", "timesteps", "mask"))
    base = model(s, a, R, t, m)[0][:, -1]                                          # (B,act_dim)
    B, L, N = s.shape[0], model.n_layer, model.n_head
    rep = lambda x: x.repeat(N, *([1] * (x.dim() - 1)))                            # (N*B, ...) replica h = head h off
    imp = torch.zeros(L, N)
    for layer in range(L):
        hm = torch.ones(L, N * B, N, device=s.device)
        hm[layer] = 1.0 - torch.eye(N, device=s.device).repeat_interleave(B, dim=0)   # (N*B, N)
        abl = model(rep(s), rep(a), rep(R), rep(t), rep(m), head_mask=hm)[0][:, -1]    # (N*B, act_dim)
        imp[layer] = (abl.view(N, B, -1) - base[None]).norm(dim=-1).mean(dim=1).cpu()
    return imp


def tiktoken_gpt2():
    try:
        import tiktoken
        return tiktoken.get_encoding("gpt2")
    except Exception as e:   # offline: tiktoken fetches its BPE files once (requests / urllib errors, by version)
        raise CheckpointError(f"tiktoken's GPT-2 encoding is not available ({type(e).__name__}: it downloads its BPE "
                              f"files once; run with a network, or set TIKTOKEN_CACHE_DIR to a folder holding "
                              f"them)") from None


def load_lm(cfg):
    return GPT2.from_pretrained("gpt2" if cfg.init == "random" else cfg.init).eval()


def sample_text(cfg, max_new_tokens=40):
    model, enc = load_lm(cfg), tiktoken_gpt2()
    ids = enc.encode(cfg.sample) or [enc.eot_token]
    g = torch.Generator().manual_seed(cfg.seed)
    out = model.generate(torch.tensor([ids]), max_new_tokens, generator=g)           # (1, T + new)
    print(cfg.sample + enc.decode(out[0, len(ids):].tolist()))


def _markov_label(heads):
    return "{" + ", ".join(map(str, heads)) + "}"


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    print(f"wrote {path}")


def text_attention(cfg):
    """GPT-2 layer 0 on real text: how much each head attends to the current token itself (the 'last input token'
    of Thm 4.3) and to the previous one. The papers' Markov heads are 1, 5 and 10."""
    model, enc = load_lm(cfg), tiktoken_gpt2()
    ids = enc.encode(cfg.text_attention)[: model.cfg.n_positions]
    if len(ids) < 2:
        raise CheckpointError("--text-attention needs a text of at least two tokens")
    with torch.no_grad():
        probs = model(torch.tensor([ids]), need_probs=True)[1][0]                    # (1,N,T,T) layer 0
    P = probs[0]
    self_mass = diagonal_attention_mass(probs)                                     # (N,)
    prev_mass = P.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)                   # (N,) attention to token t-1
    first_mass = P[:, 1:, 0].mean(-1)                                              # (N,) to the first token
    print(f"GPT-2 layer 0 on {len(ids)} tokens: mean attention to the token itself / previous / first token")
    print("| head | self | previous | first | paper's Markov head |\n|---|---|---|---|---|")
    for h in range(P.shape[0]):
        print(f"| {h} | {self_mass[h]:.3f} | {prev_mass[h]:.3f} | {first_mass[h]:.3f} | "
              f"{'yes' if h in MARKOV_HEADS else ''} |")
    plt = _plt()
    heads = [h for h in (*MARKOV_HEADS, 0) if h < P.shape[0]]
    fig, axes = plt.subplots(1, len(heads), figsize=(3.2 * len(heads), 3.4))
    toks = [enc.decode([i]) for i in ids]
    for ax, h in zip(np.atleast_1d(axes), heads):
        ax.imshow(P[h].numpy(), cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"head {h}" + (" (GPT-2 Markov)" if h in MARKOV_HEADS else ""))
        if len(ids) <= 24:
            ax.set_xticks(range(len(ids)), toks, rotation=90, fontsize=6)
            ax.set_yticks(range(len(ids)), toks, fontsize=6)
    out = cfg.out or os.path.join("runs", "gpt2_dtma", "gpt2")
    os.makedirs(out, exist_ok=True)
    _save(fig, os.path.join(out, "text_attention.png"))


def _init_attn_weight(cfg, ck=None):
    """Layer 0's c_attn weight before fine-tuning: GPT-2's, or the seeded random init of --init random (exactly the
    run's own starting point when its checkpoint is there)."""
    if cfg.init == "random":
        torch.manual_seed(cfg.seed)
        a = ck["arch"] if ck else dict(obs_dim=1, act_dim=1, max_ep_len=1)
        m = build_model(cfg, a["obs_dim"], a["act_dim"], a["max_ep_len"])
        return m.blocks[0].attn.c_attn.weight.detach(), m.n_head
    gpt = GPT2.from_pretrained(cfg.init)
    return gpt.h[0].attn.c_attn.weight.detach(), gpt.cfg.n_head


def _ckpt_config(ck, cfg):
    """The Config a checkpoint was trained with (analyses rebuild its starting point from it)."""
    if ck is None:
        return cfg
    return Config(**{k: v for k, v in ck["config"].items() if k in Config.__dataclass_fields__})


def _load_ckpt(cfg, required):
    path = os.path.join(run_dir(cfg), "ckpt.pt")
    if not os.path.exists(path):
        if required:
            raise CheckpointError(f"no trained run at {path}: train first with the same --env/--dataset, --seed and "
                                  f"--out")
        return None
    return torch.load(path, map_location="cpu", weights_only=True)


def markov_analysis(cfg):
    """Def. 4.1 on every layer-0 head, before (--init) and after fine-tuning (the run's ckpt.pt), for both readings
    of the matrix (C x C and D x D) and r = 8 and 20; Fig. 3 heatmaps of W_q W_k^T. Expected on GPT-2 ([P-old]
    Tab. 2): heads 1, 5, 10 Markov, ratios 23.61 / 29.67 / 23.7; head 9 passes (ii) at r = 8 (15.37) but fails (i)."""
    ck = _load_ckpt(cfg, required=False)
    W0, n_head = _init_attn_weight(_ckpt_config(ck, cfg), ck)
    tables, weights = {"init": markov_table(W0, n_head)}, {"init": W0}
    if ck is not None:
        W1 = ck["model"]["blocks.0.attn.c_attn.weight"]
        if W1.shape == W0.shape:
            tables["fine-tuned"], weights["fine-tuned"] = markov_table(W1, n_head), W1
    print(f"Markov-matrix test of layer-0 heads (init = {_ckpt_config(ck, cfg).init}" +
          (f"; fine-tuned = {os.path.join(run_dir(cfg), 'ckpt.pt')})" if len(tables) > 1 else ")"))
    print(format_markov_table(tables))
    for lab, rows in tables.items():
        for lay, name in (("model", "C x C"), ("head", "D x D")):
            sets = {r: [x["head"] for x in rows if x[f"{lay}_markov_r{r:g}"]] for r in (8.0, 20.0)}
            mine = [x["head"] for x in rows if x[f"{lay}_i"] and x[f"{lay}_ratio"] > cfg.markov_r]
            print(f"{lab}, {name}: Markov heads r=8 {_markov_label(sets[8.0])}, r=20 {_markov_label(sets[20.0])}, "
                  f"--markov-r {cfg.markov_r:g} {_markov_label(mine)}")
    C = W0.shape[1]
    print(f"Remark 4.7's bound r > ln(d-1)+1: {math.log(C // n_head - 1) + 1:.2f} for d={C // n_head}, "
          f"{math.log(C - 1) + 1:.2f} for d={C}; the paper's Markov heads: {_markov_label(MARKOV_HEADS)}")
    plt = _plt()
    heads = [0, 1] if n_head > 1 else [0]
    fig, axes = plt.subplots(len(weights), 2 * len(heads), figsize=(3.2 * 2 * len(heads), 3.2 * len(weights)),
                             squeeze=False)
    for row, (lab, W) in enumerate(weights.items()):
        for j, h in enumerate(heads):
            for k, (lay, crop) in enumerate((("model", 64), ("head", None))):
                A = head_qk_matrix(W, n_head, h, lay)[:crop, :crop].numpy()
                v = np.percentile(np.abs(A), 99)
                ax = axes[row, 2 * j + k]
                ax.imshow(A, cmap="RdBu_r", vmin=-v, vmax=v)
                ax.set_title(f"{lab} head {h} {'C×C[:64,:64]' if lay == 'model' else 'D×D'}\nratio "
                             f"{tables[lab][h][lay + '_ratio']:.2f}", fontsize=8)
                ax.set_xticks([])
                ax.set_yticks([])
    os.makedirs(run_dir(cfg), exist_ok=True)
    _save(fig, os.path.join(run_dir(cfg), "markov_heads.png"))
    return tables


def _full_windows(d, n, K, seed):
    """n training windows without left padding (for attention maps), from a fixed RNG."""
    rng = np.random.default_rng(seed)
    got = []
    while sum(len(b["mask"]) for b in got) < n:
        b = d.sample(4 * n, K, rng)
        keep = b["mask"].all(dim=1)
        got.append({k: v[keep] for k, v in b.items()})
    return {k: torch.cat([b[k] for b in got])[:n] for k in got[0]}


def attention_maps(cfg):
    """[P-new] Fig. 4: layer-0 attention probabilities on dataset windows (3K x 3K, averaged over 32 windows) of
    the model before fine-tuning (pretrained body + fresh DT embeddings, the 'random embedding' premise of Thm 4.3)
    and after (the run's ckpt.pt). A Markov head shows a bright diagonal."""
    ck = _load_ckpt(cfg, required=False)
    ccfg = _ckpt_config(ck, cfg)
    d = data_lib.load_data(ccfg.dataset or ccfg.env)
    resolve_context(ccfg, d)
    torch.manual_seed(ccfg.seed)                     # exactly the model train() starts from
    models = {"before": build_model(ccfg, d.obs_dim, d.act_dim, d.max_ep_len).eval()}
    if ck:
        models["after"] = model_from_checkpoint(ck)
    else:
        print(f"no checkpoint in {run_dir(cfg)}: showing the model before fine-tuning only")
    b = _full_windows(d, 32, ccfg.context, ccfg.seed + 30_000)
    P = {}
    for lab, m in models.items():
        with torch.no_grad():
            aux = m(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"], need_probs=True)[1]
        P[lab] = aux["probs"][0].mean(0)                                           # (N,3K,3K)
    n_head = P["before"].shape[0]
    print(f"layer-0 attention of each token to itself (diagonal mass), {len(b['mask'])} windows of K={ccfg.context}")
    print("| head | " + " | ".join(P) + " | paper's Markov head |\n|---|" + "---|" * (len(P) + 1))
    for h in range(n_head):
        print(f"| {h} | " + " | ".join(f"{diagonal_attention_mass(p[None])[h]:.3f}" for p in P.values()) +
              f" | {'yes' if h in MARKOV_HEADS else ''} |")
    heads = [h for h in (*MARKOV_HEADS, 0) if h < n_head]
    plt = _plt()
    fig, axes = plt.subplots(len(P), len(heads), figsize=(3 * len(heads), 3 * len(P)), squeeze=False)
    for r, (lab, p) in enumerate(P.items()):
        for c, h in enumerate(heads):
            axes[r, c].imshow(p[h].numpy(), cmap="viridis")
            axes[r, c].set_title(f"{lab}: head {h}" + (" (GPT-2 Markov)" if h in MARKOV_HEADS else ""), fontsize=9)
            axes[r, c].set_xticks([])
            axes[r, c].set_yticks([])
    _save(fig, os.path.join(run_dir(cfg), "attention_maps.png"))
    return P


def importance_analysis(cfg, n_contexts=64):
    """[P-new] Fig. 2: roll the fine-tuned model out in the env, keep the contexts it acted on, then zero each of the
    L x N heads in turn on those same contexts and measure || a - a_{-head} ||_2 (notes §3.3)."""
    ck = _load_ckpt(cfg, required=True)
    ccfg = _ckpt_config(ck, cfg)
    d = data_lib.load_data(ck["dataset_id"])
    model = model_from_checkpoint(ck)
    seen = []

    def act(batch, live):
        seen.append({k: v.clone() for k, v in batch.items()})
        return model(batch["states"], batch["actions"], batch["rtg"], batch["timesteps"], batch["mask"])[0][:, -1]
    target = ccfg.target_return if ccfg.target_return is not None else d.target_returns[0]
    with torch.no_grad():
        eval_lib.evaluate(act, d, min(cfg.eval_episodes, 5), target, cfg.seed + 40_000, ccfg.context)
    allc = {k: torch.cat([s[k] for s in seen]) for k in seen[0]}
    pick = torch.from_numpy(np.random.default_rng(cfg.seed).permutation(len(allc["mask"]))[:n_contexts])
    imp = head_importance(model, {k: v[pick] for k, v in allc.items()})           # (L,N)
    L, N = imp.shape
    print(f"head importance ||a - a_-head||_2 on {len(pick)} rollout contexts (rows: layers, columns: heads)")
    print("| layer | " + " | ".join(map(str, range(N))) + " |\n|---|" + "---|" * N)
    for layer in range(L):
        print(f"| {layer} | " + " | ".join(f"{x:.4f}" for x in imp[layer].tolist()) + " |")
    top = torch.topk(imp.flatten(), min(5, imp.numel())).indices.tolist()
    print("most important heads (layer, head): " + ", ".join(f"({i // N}, {i % N})" for i in top))
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(6, 0.12 * L * N), 3.5))
    colors = ["tab:red" if (i // N == 0 and i % N in MARKOV_HEADS) else "tab:blue" for i in range(L * N)]
    ax.bar(range(L * N), imp.flatten().numpy(), color=colors)
    ax.set_xticks([layer * N + N / 2 - 0.5 for layer in range(L)], [f"L{layer}" for layer in range(L)])
    ax.set(ylabel="||a - a_-head||₂", title="head importance (red: layer-0 heads 1, 5, 10)")
    _save(fig, os.path.join(run_dir(cfg), "head_importance.png"))
    return imp


def bench(cfg, n_steps=None):
    """ms per training step (forward + backward + AdamW) on random hopper-shaped windows; no data needed."""
    n_steps = n_steps or (3 if cfg.layers <= 2 else 2)     # a 12-layer step takes tens of seconds on one CPU core
    K = cfg.context or 20
    torch.manual_seed(cfg.seed)
    model = build_model(dataclasses.replace(cfg, init="random"), 11, 3, 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    g = torch.Generator().manual_seed(0)
    B = cfg.batch_size
    b = dict(states=torch.randn(B, K, 11, generator=g), actions=torch.rand(B, K, 3, generator=g) * 2 - 1,
             rtg=torch.randn(B, K, 1, generator=g), timesteps=torch.randint(0, 1000, (B, K), generator=g),
             mask=torch.ones(B, K))
    times = []
    for i in range(n_steps + 1):
        t0 = time.time()
        loss, _ = loss_fn(model, b)
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.time() - t0)
    with torch.no_grad():
        model.eval()
        t0 = time.time()
        model(b["states"][:10], b["actions"][:10], b["rtg"][:10], b["timesteps"][:10], b["mask"][:10])
        t_act = time.time() - t0
    print(f"{variant_name(cfg)} {model.n_layer} blocks x {model.n_embd}: {sum(p.numel() for p in model.parameters()):,}"
          f" parameters; batch {B}, K={K}, {torch.get_num_threads()} thread(s): "
          f"{1e3 * float(np.median(times[1:])):.0f} ms/step (median of {n_steps} after 1 warm-up); "
          f"one eval act() for 10 envs {1e3 * t_act:.0f} ms")


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
        if cfg.sample:
            sample_text(cfg)
        elif cfg.text_attention:
            text_attention(cfg)
        elif cfg.bench:
            bench(cfg)
        elif cfg.markov or cfg.attention_maps or cfg.importance:
            if cfg.markov:
                markov_analysis(cfg)
            if cfg.attention_maps:
                attention_maps(cfg)
            if cfg.importance:
                importance_analysis(cfg)
        else:
            train(cfg)
    except (data_lib.DataError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
