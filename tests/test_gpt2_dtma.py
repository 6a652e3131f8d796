"""Tests for gpt2_dtma.py. Every check is against something independent of the code under test: a numpy GPT-2
written here from the HF layout, Hugging Face transformers when installed, files written by the `safetensors`
library, hand-computed Markov ratios, masked/shortened inputs, and a tiny CLI run. No network, no shared datasets."""
import json
import math
import os
import sys
import time

import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import gpt2_dtma as G  # noqa: E402

torch.set_num_threads(1)
TINY = dict(vocab_size=97, n_positions=32, n_embd=48, n_layer=2, n_head=12, layer_norm_epsilon=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# a tiny GPT-2 checkpoint in Hugging Face's format (Conv1D layout), and an independent numpy forward pass

def hf_tiny_state(seed=0, cfg=TINY):
    """Random tensors named and shaped exactly as HF GPT2LMHeadModel stores them (Conv1D weights are (in, out))."""
    g = np.random.default_rng(seed)
    C, V, P = cfg["n_embd"], cfg["vocab_size"], cfg["n_positions"]
    r = lambda *s: (0.2 * g.standard_normal(s)).astype(np.float32)
    sd = {"transformer.wte.weight": r(V, C), "transformer.wpe.weight": r(P, C),
          "transformer.ln_f.weight": 1 + r(C), "transformer.ln_f.bias": r(C)}
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}."
        sd.update({p + "ln_1.weight": 1 + r(C), p + "ln_1.bias": r(C), p + "ln_2.weight": 1 + r(C),
                   p + "ln_2.bias": r(C), p + "attn.c_attn.weight": r(C, 3 * C), p + "attn.c_attn.bias": r(3 * C),
                   p + "attn.c_proj.weight": r(C, C), p + "attn.c_proj.bias": r(C),
                   p + "mlp.c_fc.weight": r(C, 4 * C), p + "mlp.c_fc.bias": r(4 * C),
                   p + "mlp.c_proj.weight": r(4 * C, C), p + "mlp.c_proj.bias": r(C)})
    sd["lm_head.weight"] = sd["transformer.wte.weight"].copy()
    return sd


def numpy_gpt2(sd, ids, cfg=TINY):
    """GPT-2 forward in float64 numpy straight from the HF tensors: x @ W (Conv1D), tanh GELU, pre-LN."""
    sd = {k.replace("transformer.", ""): v.astype(np.float64) for k, v in sd.items()}
    C, N, T = cfg["n_embd"], cfg["n_head"], len(ids)
    D = C // N

    def ln(x, w, b):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + cfg["layer_norm_epsilon"]) * w + b

    x = sd["wte.weight"][ids] + sd["wpe.weight"][np.arange(T)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        u = ln(x, sd[p + "ln_1.weight"], sd[p + "ln_1.bias"])
        qkv = u @ sd[p + "attn.c_attn.weight"] + sd[p + "attn.c_attn.bias"]
        heads = []
        for h in range(N):
            q, k, v = (qkv[:, j * C + h * D: j * C + (h + 1) * D] for j in range(3))
            s = q @ k.T / math.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
            w = np.exp(s - s.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ v)
        x = x + np.concatenate(heads, -1) @ sd[p + "attn.c_proj.weight"] + sd[p + "attn.c_proj.bias"]
        u = ln(x, sd[p + "ln_2.weight"], sd[p + "ln_2.bias"])
        hdn = u @ sd[p + "mlp.c_fc.weight"] + sd[p + "mlp.c_fc.bias"]
        hdn = 0.5 * hdn * (1 + np.tanh(math.sqrt(2 / math.pi) * (hdn + 0.044715 * hdn ** 3)))
        x = x + hdn @ sd[p + "mlp.c_proj.weight"] + sd[p + "mlp.c_proj.bias"]
    return ln(x, sd["ln_f.weight"], sd["ln_f.bias"]) @ sd["wte.weight"].T


def write_hf_folder(folder, sd, cfg=TINY, prefix=True):
    from safetensors.numpy import save_file
    os.makedirs(folder, exist_ok=True)
    sd = {(k if prefix else k.replace("transformer.", "")): v for k, v in sd.items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(cfg, model_type="gpt2", activation_function="gelu_new"), f)
    return folder


@pytest.mark.parametrize("prefix", [True, False])
def test_gpt2_port_matches_numpy_reference(tmp_path, prefix):
    sd = hf_tiny_state(1)
    folder = write_hf_folder(str(tmp_path / "ckpt"), sd, prefix=prefix)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    ref = numpy_gpt2(sd, ids)
    for path in (folder, os.path.join(folder, "model.safetensors")):       # a folder or the file itself
        model = G.GPT2.from_pretrained(path).eval()
        assert model.cfg.n_embd == 48 and len(model.h) == 2                 # config.json was read
        out = model(torch.tensor(ids)[None])[0].detach().double().numpy()
        np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)
    # the explicit-probability path gives the same logits, and its probabilities are causal rows that sum to 1
    logits, probs = model(torch.tensor(ids)[None], need_probs=True)
    np.testing.assert_allclose(logits[0].detach().double().numpy(), ref, atol=1e-4, rtol=0)
    P = probs[0][0]
    assert torch.allclose(P.sum(-1), torch.ones_like(P.sum(-1))) and P.triu(1).abs().max() == 0


@pytest.mark.parametrize("prefix", [True, False])
def test_gpt2_port_matches_transformers(tmp_path, prefix):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.GPT2Config(**{"vocab_size": 97, "n_positions": 32, "n_embd": 48, "n_layer": 2,
                                        "n_head": 12}, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    if not prefix:                                    # the bare GPT2Model layout (no 'transformer.' prefix)
        sd = G.read_safetensors(str(tmp_path / "model.safetensors"))
        from safetensors.torch import save_file
        save_file({k.replace("transformer.", ""): v.contiguous() for k, v in sd.items()},
                  str(tmp_path / "model.safetensors"))
    ids = torch.randint(0, 97, (2, 12))
    ours = G.GPT2.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the hand-written safetensors reader

def test_read_safetensors_roundtrip_against_library(tmp_path):
    from safetensors.torch import save_file
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, 2).half(),
               "d": torch.randn(5).to(torch.bfloat16), "e": torch.tensor([True, False]), "s": torch.tensor(2.5),
               "z": torch.zeros(0, 3)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"k": "v"})
    back = G.read_safetensors(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)


def _raw(header, data=b"", n=None):
    h = json.dumps(header).encode()
    return (len(h) if n is None else n).to_bytes(8, "little") + h + data


@pytest.mark.parametrize("blob, words", [
    (b"\x01\x02", "only 2 bytes"),
    ((2 ** 60).to_bytes(8, "little") + b"{}", "header length"),                      # absurd header length
    ((500).to_bytes(8, "little") + b"{}", "header length"),                          # longer than the file
    (_raw({}, n=2)[:8] + b"[]", "not a JSON object"),
    ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not valid JSON"),
    (_raw({"w": {"dtype": "F32", "shape": [2 ** 20, 2 ** 20], "data_offsets": [0, 16]}}, bytes(16)), "does not match"),
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)), "outside the data"),
    (_raw({"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)), "unknown dtype"),
    (_raw({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, bytes(16)), "invalid shape"),
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8, 4]}}, bytes(16)), "outside the data"),
    (_raw({"w": "x"}, bytes(16)), "malformed"),
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16)), "overlap"),
])
def test_read_safetensors_rejects_bad_files_fast(tmp_path, blob, words):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(blob)
    t0 = time.time()
    with pytest.raises(G.CheckpointError, match=words):
        G.read_safetensors(str(p))
    assert time.time() - t0 < 1.0


def test_truncated_real_checkpoint_and_wrong_model_are_clear_errors(tmp_path):
    folder = write_hf_folder(str(tmp_path / "ok"), hf_tiny_state(0))
    blob = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(G.CheckpointError, match="truncated"):
        G.GPT2.from_pretrained(str(tmp_path / "cut"))
    from safetensors.torch import save_file
    (tmp_path / "other").mkdir()
    save_file({"encoder.weight": torch.zeros(3)}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(G.CheckpointError, match="missing"):
        G.GPT2.from_pretrained(str(tmp_path / "other"))
    with pytest.raises(G.CheckpointError, match="no GPT-2 checkpoint"):
        G.GPT2.from_pretrained(str(tmp_path / "nowhere"))
    assert G.GPT2.from_pretrained(folder).cfg.n_layer == 2


def test_gpt2_name_finds_hf_cache_and_download_is_atomic(tmp_path, monkeypatch):
    snap = tmp_path / "hf" / "hub" / "models--openai-community--gpt2" / "snapshots" / "abc123"
    write_hf_folder(str(snap), hf_tiny_state(2))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    assert G.find_gpt2_weights("gpt2", allow_download=False) == str(snap / "model.safetensors")
    assert G.GPT2.from_pretrained("gpt2").cfg.n_embd == 48
    # download(): a file:// URL stands in for the hub; the result is complete and no .part file is left behind
    dest = str(tmp_path / "cache" / "model.safetensors")
    G.download("file://" + str(snap / "model.safetensors"), dest)
    assert open(dest, "rb").read() == (snap / "model.safetensors").read_bytes()
    assert os.listdir(tmp_path / "cache") == ["model.safetensors"]
    with pytest.raises(G.CheckpointError, match="could not be downloaded"):
        G.download("file://" + str(tmp_path / "missing.bin"), str(tmp_path / "c2" / "model.safetensors"))
    assert not os.path.exists(tmp_path / "c2" / "model.safetensors.part")


# ---------------------------------------------------------------------------------------------------------------
# GPT2-DT / GPT2-DTMA

def small_dt(moa=True, seed=0, n_layer=2, n_head=12, n_embd=48, dropout=0.0):
    torch.manual_seed(seed)
    return G.DecisionGPT2(5, 2, 50, n_embd=n_embd, n_head=n_head, n_layer=n_layer, dropout=dropout, moa=moa)


def rand_batch(B=4, K=6, seed=0, pad=None):
    g = torch.Generator().manual_seed(seed)
    b = dict(states=torch.randn(B, K, 5, generator=g), actions=torch.rand(B, K, 2, generator=g) * 2 - 1,
             rtg=torch.randn(B, K, 1, generator=g), timesteps=torch.randint(0, 40, (B, K), generator=g),
             mask=torch.ones(B, K))
    if pad is not None:                      # left padding, as data.py makes it
        for i, p in enumerate(pad):
            b["mask"][i, :p] = 0
            for k in ("states", "actions", "rtg"):
                b[k][i, :p] = 0
            b["timesteps"][i, :p] = 0
    return b


def fwd(model, b, **kw):
    return model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"], **kw)


def test_dtma_equals_dt_at_init_and_gate_matters():
    dt, dtma = small_dt(moa=False).eval(), small_dt(moa=True).eval()
    missing, unexpected = dtma.load_state_dict(dt.state_dict(), strict=False)
    assert not unexpected and missing and all(".gate." in k for k in missing)
    b = rand_batch(pad=[0, 2, 5, 0])
    a_dt, a_ma = fwd(dt, b)[0], fwd(dtma, b)[0]
    assert torch.equal(a_dt, a_ma)                                  # zero gate * N == 1 exactly
    g0 = fwd(dtma, b)[1]["gates"][0]
    assert torch.allclose(g0, torch.full_like(g0, 1 / 12))
    with torch.no_grad():
        dtma.blocks[0].attn.gate.bias[3] = 2.0                      # a non-uniform gate changes the function
    assert (fwd(dtma, b)[0] - a_dt).abs().max() > 1e-4


def test_load_gpt2_blocks_uses_pretrained_weights(tmp_path):
    gpt = G.GPT2.from_pretrained(write_hf_folder(str(tmp_path / "c"), hf_tiny_state(3)))
    dt = small_dt(n_layer=1).load_gpt2_blocks(gpt)                  # --layers 1: keep block 0 only
    assert torch.equal(dt.blocks[0].attn.c_attn.weight, gpt.h[0].attn.c_attn.weight)
    assert torch.equal(dt.ln_f.weight, gpt.ln_f.weight)
    assert torch.equal(dt.blocks[0].attn.gate.weight, torch.zeros(12, 48))


def test_explicit_attention_equals_sdpa_and_rows_sum_to_one():
    m = small_dt().eval()
    b = rand_batch(pad=[0, 3, 5, 1])
    a1, _ = fwd(m, b)
    a2, aux = fwd(m, b, need_probs=True)
    assert torch.allclose(a1, a2, atol=1e-5)
    P = aux["probs"][0]                                             # (B,N,3K,3K)
    assert torch.allclose(P.sum(-1), torch.ones_like(P.sum(-1)), atol=1e-5)
    assert P[1, :, 9:, :9].abs().max() == 0                         # real tokens never attend to padded keys


def test_causal_action_ignores_the_future():
    m = small_dt().eval()
    b = rand_batch(K=6)
    a0 = fwd(m, b)[0]
    t = 2
    c = {k: v.clone() for k, v in b.items()}
    c["actions"][:, t:] += 5.0                                      # a_t itself is predicted from s_t: unseen
    c["states"][:, t + 1:] += 5.0
    c["rtg"][:, t + 1:] += 5.0
    a1 = fwd(m, c)[0]
    assert torch.allclose(a1[:, :t + 1], a0[:, :t + 1], atol=1e-6)
    assert (a1[:, t + 1:] - a0[:, t + 1:]).abs().max() > 1e-3       # and the future does change later steps


def test_left_padding_equals_the_shorter_window():
    """No position embedding (timesteps carry time): a left-padded window must give, at its real steps, exactly
    what the model gives on the real steps alone."""
    m = small_dt().eval()
    b = rand_batch(B=1, K=6, pad=[2])
    short = {k: v[:, 2:] for k, v in b.items()}
    assert torch.allclose(fwd(m, b)[0][:, 2:], fwd(m, short)[0], atol=1e-5)


def test_overfits_a_tiny_batch():
    m = small_dt(n_layer=1)
    b = rand_batch(B=8, K=4, seed=3)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(150):
        loss = ((fwd(m, b)[0] - b["actions"]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.02, loss.item()


def test_markov_gate_mass_and_penalty_gradient():
    m = small_dt()
    b = rand_batch(pad=[0, 3, 0, 0])
    gates = fwd(m, b)[1]["gates"][0]
    assert abs(G.markov_gate_mass(gates, b["mask"]).item() - 3 / 12) < 1e-6   # uniform gate: 3 of 12 heads
    g = torch.zeros(1, 3, 12)
    g[0, 0, 1], g[0, 0, 0] = 1.0, 0.0            # token 0 puts all weight on head 1; tokens 1, 2 on head 0
    g[0, 1:, 0] = 1.0
    assert abs(G.markov_gate_mass(g, torch.ones(1, 1)).item() - 1 / 3) < 1e-6
    assert G.markov_gate_mass(g, torch.zeros(1, 1)).item() == 0.0
    # GPT2-P (Eq. 9): descending the penalty lowers the Markov heads' gate mass
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"]).item()
    for _ in range(3):
        pen = G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"])
        opt.zero_grad()
        pen.backward()
        opt.step()
    assert G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"]).item() < before - 0.01


# ---------------------------------------------------------------------------------------------------------------
# analysis on inputs with known answers

def test_markov_stats_hand_computed():
    A = torch.tensor([[4.0, 1.0, -1.0], [0.5, 2.0, 0.0], [0.0, -0.5, 3.0]])
    st = G.markov_stats(A, r=2.0)
    assert st["cond_i"] and abs(st["ratio"] - (9 / 3) / (3 / 6)) < 1e-6 and st["markov"]      # 3 / 0.5 = 6
    assert not G.markov_stats(A, r=6.5)["markov"]                   # (ii) fails above the ratio
    B = A.clone()
    B[1, 1] = -2.0
    assert not G.markov_stats(B, r=2.0)["cond_i"] and not G.markov_stats(B, r=2.0)["markov"]   # (i) fails
    g = torch.Generator().manual_seed(0)
    D = 30 * torch.eye(64) + 0.1 * torch.randn(64, 64, generator=g)   # diagonal-dominant: Markov
    R = torch.randn(64, 64, generator=g)                              # a random matrix: not
    assert G.markov_stats(D)["markov"] and not G.markov_stats(R)["markov"]


def test_head_qk_matrix_is_the_bilinear_form_of_the_attention_scores():
    torch.manual_seed(0)
    att = G.SelfAttention(48, 12)
    W = att.c_attn.weight
    x, y = torch.randn(48), torch.randn(48)
    for i in (0, 5, 11):
        q = (W[i * 4:(i + 1) * 4] @ x).double()                     # head i's query of x, bias-free
        k = (W[48 + i * 4:48 + (i + 1) * 4] @ y).double()
        A = G.head_qk_matrix(W, 12, i, "model")
        assert A.shape == (48, 48) and torch.allclose(x.double() @ A @ y.double(), q @ k, atol=1e-8)
        assert G.head_qk_matrix(W, 12, i, "head").shape == (4, 4)
    # plant a Markov head: with W_k^i = c W_q^i the C x C form is c Wq^T Wq (psd, positive diagonal)
    with torch.no_grad():
        W[48 + 4:48 + 8] = W[4:8] * 3.0
    rows = G.markov_table(W, 12)
    assert rows[1]["model_i"] and rows[1]["head_i"]                 # (i) holds for the planted head
    assert not any(r["model_i"] for r in rows if r["head"] != 1)   # 48 random diagonal signs are never all +
    assert rows[1]["head_ratio"] > max(r["head_ratio"] for r in rows if r["head"] != 1)


def test_diagonal_attention_mass():
    P = torch.zeros(1, 2, 3, 3)
    P[0, 0] = torch.eye(3)                                          # head 0 attends to itself only
    P[0, 1, :, 0] = 1.0                                             # head 1 attends to the first token only
    assert torch.allclose(G.diagonal_attention_mass(P), torch.tensor([1.0, 1 / 3]))
    assert torch.allclose(G.diagonal_attention_mass(P, torch.tensor([[0.0, 1.0, 1.0]])), torch.tensor([1.0, 0.0]))


def test_head_importance_zero_for_a_dead_head():
    m = small_dt(n_layer=2).eval()
    with torch.no_grad():                                           # head 4 of layer 1 outputs exactly zero
        m.blocks[1].attn.c_attn.weight[96 + 16:96 + 20] = 0
        m.blocks[1].attn.c_attn.bias[96 + 16:96 + 20] = 0
    b = rand_batch(pad=[0, 2, 0, 4])
    imp = G.head_importance(m, b)
    assert imp.shape == (2, 12) and imp[1, 4] == 0 and (imp[0] > 0).all()
    # and it matches one ablation done by hand
    hm = torch.ones(2, 12)
    hm[0, 7] = 0
    by_hand = (fwd(m, b)[0][:, -1] - fwd(m, b, head_mask=hm)[0][:, -1]).norm(dim=-1).mean()
    assert torch.allclose(imp[0, 7], by_hand, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# the command line on the tiny datasets of conftest.py

TINY_RUN = ["--init", "random", "--layers", "2", "--n-embd", "24", "--n-head", "12", "--batch-size", "4",
            "--context", "4", "--eval-episodes", "2", "--log-every", "2", "--warmup-steps", "2", "--lr", "1e-3"]


def cli(capsys, *args):
    G.main([str(a) for a in args])
    return capsys.readouterr()


def test_cli_train_resume_and_analyses(tiny_hopper, tmp_path, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    out = cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--steps", 6, "--eval-every", 3, "--out", full).out
    last = out.strip().splitlines()[-1]
    assert last.startswith("final: normalized_score=") and last.endswith("episodes=2"), last
    assert "| G_Markov 0.2" in out                                  # logged with the loss (Fig. 9)
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png", "gates.png"):
        assert (full / f).exists(), f
    rows = list(__import__("csv").DictReader(open(full / "log.csv")))
    assert rows[0]["step"] == "0" and abs(float(rows[0]["g_markov"]) - 0.25) < 1e-6
    # --resume: 3 steps, stop, 3 more == 6 steps in one go (dropout RNG, data RNG and optimiser restored)
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--steps", 3, "--eval-every", 3, "--out", part)
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--steps", 6, "--eval-every", 3, "--out", part, "--resume")
    a = torch.load(full / "ckpt.pt", weights_only=True)
    b = torch.load(part / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # analyses of the trained run: each prints its table and writes its PNG
    out = cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--out", full, "--markov", "--attention-maps",
              "--importance").out
    assert "| head | init CxC (i)" in out and "fine-tuned CxC (i)" in out
    assert "| head | before | after |" in out and "most important heads" in out
    for f in ("markov_heads.png", "attention_maps.png", "head_importance.png"):
        assert (full / f).exists(), f


def test_cli_maze_reports_steps_to_goal_and_gpt2_p(tiny_maze, tmp_path, capsys):
    out = cli(capsys, "--dataset", tiny_maze, *TINY_RUN, "--steps", 2, "--eval-every", 2, "--markov-penalty", "0.1",
              "--out", tmp_path / "m").out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("maze: steps_to_goal=") and lines[-1].startswith("final: normalized_score=")
    assert "DTMA-P(α=0.1)" in out
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    assert cfg["markov_penalty"] == 0.1 and cfg["context"] == 4


def test_default_context_is_the_papers_per_task():
    class D:
        goal_reaching = True
    assert G.resolve_context(G.Config(), D()).context == 50
    D.goal_reaching = False
    assert G.resolve_context(G.Config(), D()).context == 20
    assert G.resolve_context(G.Config(context=7), D()).context == 7


@pytest.mark.parametrize("args, words", [
    (["--env", "no-such-env", "--init", "random"], "unknown environment"),
    (["--dataset", "TINY", "--init", "/no/such/ckpt"], "no GPT-2 checkpoint"),
    (["--sample", "hi", "--init", "/no/such/ckpt"], "no GPT-2 checkpoint"),
    (["--importance", "--out", "/no/such/run"], "no trained run"),
])
def test_cli_bad_input_is_one_sentence(args, words, capsys, tiny_hopper):
    with pytest.raises(SystemExit) as e:
        G.main([tiny_hopper if a == "TINY" else a for a in args])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error:") and words in err and "\n" not in err, err


def test_cli_init_from_local_checkpoint_keeps_the_pretrained_blocks(tiny_hopper, tmp_path, capsys):
    folder = write_hf_folder(str(tmp_path / "ckpt"), hf_tiny_state(4))
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--init", folder, "--layers", 1, "--steps", 0,
        "--eval-episodes", 1, "--out", tmp_path / "r")
    sd = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)["model"] if (tmp_path / "r" / "ckpt.pt").exists() \
        else None
    gpt = G.GPT2.from_pretrained(folder)
    torch.manual_seed(0)
    cfg = G.Config(init=folder, layers=1)
    m = G.build_model(cfg, 11, 3, 1000)
    assert m.n_embd == 48 and m.n_layer == 1
    assert torch.equal(m.blocks[0].mlp.c_fc.weight, gpt.h[0].mlp.c_fc.weight)
    assert sd is None or torch.equal(sd["blocks.0.mlp.c_fc.weight"], gpt.h[0].mlp.c_fc.weight)


def test_sample_and_text_attention_plumbing_with_a_stand_in_tokenizer(tmp_path, monkeypatch, capsys):
    """The real tokenizer needs its BPE files (network); a stand-in checks everything around it."""
    class Enc:
        eot_token = 0
        encode = staticmethod(lambda s: [ord(c) % 97 for c in s])
        decode = staticmethod(lambda ids: "".join(chr(65 + i % 26) for i in ids))
    monkeypatch.setattr(G, "tiktoken_gpt2", lambda: Enc)
    folder = write_hf_folder(str(tmp_path / "ckpt"), hf_tiny_state(5))
    out = cli(capsys, "--sample", "abc", "--init", folder).out
    assert out.startswith("abc") and len(out.strip()) == 3 + 40
    out = cli(capsys, "--text-attention", "hello world", "--init", folder, "--out", tmp_path / "t").out
    assert "| head | self | previous | first |" in out and (tmp_path / "t" / "text_attention.png").exists()


def test_analyses_rebuild_the_runs_exact_starting_point(tiny_hopper, tmp_path, capsys):
    """With lr 0 training changes nothing, so 'before fine-tuning' (rebuilt from the seed) must equal 'after'."""
    out = tmp_path / "lr0"
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--lr", 0, "--steps", 1, "--eval-every", 1, "--seed", 3,
        "--eval-episodes", 1, "--out", out)
    cfg = G.parse_args(["--dataset", tiny_hopper, "--out", str(out)])   # flags of the run come from its ckpt
    tables = G.markov_analysis(cfg)
    assert [r["model_ratio"] for r in tables["init"]] == [r["model_ratio"] for r in tables["fine-tuned"]]
    P = G.attention_maps(cfg)
    assert torch.allclose(P["before"], P["after"], atol=1e-6)
    capsys.readouterr()


def test_bench_prints_ms_per_step(capsys):
    out = cli(capsys, "--bench", "--init", "random", "--layers", 1, "--n-embd", 24, "--batch-size", 2,
              "--context", 3).out
    assert "1 blocks x 24" in out and "ms/step" in out and "parameters" in out
