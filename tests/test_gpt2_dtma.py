"""Tests for gpt2_dtma.py. Every check is against something independent of the code under test: a numpy GPT-2
written here from the HF layout, Hugging Face transformers when installed, files written by the `safetensors`
library, hand-computed Markov ratios, attention and distance masses, masked/shortened inputs, weights compared tensor
by tensor, parameter counts by hand, and short CLI runs. No network, no shared datasets."""
import csv
import json
import math
import os
import re
import shutil
import socket
import sys
import time

import huggingface_hub
import huggingface_hub.constants
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
    r = lambda *s: (0.2 * g.standard_normal(s)).astype(np.float32)  # noqa: E731
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


def write_hf_folder(folder, sd, cfg=TINY, prefix=True, **config_json):
    from safetensors.numpy import save_file
    os.makedirs(folder, exist_ok=True)
    sd = {(k if prefix else k.replace("transformer.", "")): v for k, v in sd.items() if k != "lm_head.weight"}
    save_file(sd, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(dict(cfg, model_type="gpt2", activation_function="gelu_new") | config_json, f)
    return folder


@pytest.mark.parametrize("prefix", [True, False])
def test_gpt2_port_matches_numpy_reference(tmp_path, prefix):
    sd = hf_tiny_state(1)
    folder = write_hf_folder(str(tmp_path / "ckpt"), sd, prefix=prefix)
    ids = np.array([3, 14, 15, 92, 65, 35, 89, 79, 32, 38])
    ref = numpy_gpt2(sd, ids)
    for path in (folder, os.path.join(folder, "model.safetensors")):       # a folder or the file itself
        model = G.load_gpt2_lm(path).eval()
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
    ours = G.load_gpt2_lm(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# the hand-written safetensors reader and the config.json checks

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
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return (len(h) if n is None else n).to_bytes(8, "little") + h + data


def _entry(offsets, shape=(4,)):
    return {"w": {"dtype": "F32", "shape": list(shape), "data_offsets": offsets}}


@pytest.mark.parametrize("blob, words", [
    (b"\x01\x02", "only 2 bytes"),
    ((2 ** 60).to_bytes(8, "little") + b"{}", "header length"),                      # absurd header length
    ((500).to_bytes(8, "little") + b"{}", "header length"),                          # longer than the file
    (_raw({}, n=2)[:8] + b"[]", "not a JSON object"),
    ((4).to_bytes(8, "little") + b"\xff\xfe{}", "not valid JSON"),
    (_raw({"w": {"dtype": "F32", "shape": [2 ** 20, 2 ** 20], "data_offsets": [0, 16]}}, bytes(16)), "does not match"),
    (_raw(_entry([0, 16]), bytes(8)), "outside the data"),
    (_raw({"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}, bytes(16)), "unknown dtype"),
    (_raw(_entry([0, 16], shape=[-4]), bytes(16)), "invalid shape"),
    (_raw(_entry([0, 16], shape=[True, 4]), bytes(16)), "invalid shape"),            # a bool is not a size
    (_raw(_entry([8, 4]), bytes(16)), "outside the data"),
    (_raw(_entry([-16, 0]), bytes(16)), "outside the data"),                         # negative offset
    (_raw(_entry([False, 16]), bytes(16)), "outside the data"),                      # bool offset
    (_raw(_entry([0.0, 16]), bytes(16)), "outside the data"),                        # float offset
    (_raw(_entry(["0", 16]), bytes(16)), "outside the data"),                        # string offset
    (_raw(_entry([0, 2 ** 80]), bytes(16)), "outside the data"),                     # huge offset
    (_raw(b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", bytes(16)),
     "not valid JSON"),                                                             # a 5000-digit offset
    (_raw({"w": "x"}, bytes(16)), "malformed"),
    (_raw({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
           "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, bytes(16)), "overlap"),
])
def test_read_safetensors_rejects_bad_files_fast(tmp_path, blob, words):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(blob)
    t0 = time.time()
    with pytest.raises(G.CheckpointError, match=words) as e:
        G.read_safetensors(str(p))
    assert time.time() - t0 < 1.0 and "\n" not in str(e.value) and len(str(e.value)) < 300


@pytest.mark.parametrize("change, words", [
    (dict(n_layer="2"), "n_layer must be a whole number"),               # a string
    (dict(n_layer=True), "n_layer must be a whole number"),              # a bool is not an int here
    (dict(n_layer=2.0), "n_layer must be a whole number"),
    (dict(n_layer=0), "n_layer must be a whole number"),
    (dict(n_head=-12), "n_head must be a whole number"),
    (dict(n_layer=10 ** 9), "from 1 to 96"),                             # refused before anything is allocated
    (dict(n_embd=10 ** 6), "from 1 to 12,288"),
    (dict(vocab_size=10 ** 7), "from 1 to 1,000,000"),
    (dict(n_positions=10 ** 6), "from 1 to 65,536"),
    (dict(n_embd=50), "not divisible by n_head 12"),
    (dict(layer_norm_epsilon="1e-5"), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=0), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=-1e-5), "layer_norm_epsilon"),
    (dict(layer_norm_epsilon=float("nan")), "layer_norm_epsilon"),       # json writes NaN, json reads it back
    (dict(layer_norm_epsilon=True), "layer_norm_epsilon"),
    (dict(activation_function="relu"), "not GPT-2's tanh GELU"),
])
def test_config_json_is_validated_before_any_allocation(tmp_path, change, words):
    folder = write_hf_folder(str(tmp_path / "c"), hf_tiny_state(0), **change)
    t0 = time.time()
    with pytest.raises(G.CheckpointError, match=words):
        G.load_gpt2_lm(folder)
    assert time.time() - t0 < 1.0
    (tmp_path / "c" / "config.json").write_text('{"n_layer": ' + "9" * 5000 + "}")      # > 4300 digits
    with pytest.raises(G.CheckpointError, match="cannot read"):
        G.config_from_json(str(tmp_path / "c" / "config.json"))


def test_truncated_real_checkpoint_and_wrong_model_are_clear_errors(tmp_path):
    folder = write_hf_folder(str(tmp_path / "ok"), hf_tiny_state(0))
    blob = (tmp_path / "ok" / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(G.CheckpointError, match="truncated"):
        G.load_gpt2_lm(str(tmp_path / "cut"))
    from safetensors.torch import save_file
    (tmp_path / "other").mkdir()
    save_file({"encoder.weight": torch.zeros(3)}, str(tmp_path / "other" / "model.safetensors"))
    with pytest.raises(G.CheckpointError, match="missing"):
        G.load_gpt2_lm(str(tmp_path / "other"))
    with pytest.raises(G.CheckpointError, match="no GPT-2 or CLIP checkpoint"):
        G.load_gpt2_lm(str(tmp_path / "nowhere"))
    assert G.load_gpt2_lm(folder).cfg.n_layer == 2


def hub_snapshot(monkeypatch, cache, repo, commit="abc123"):
    """A Hugging Face cache at `cache` holding `repo` at `commit` (refs/main names it), made the cache huggingface_hub
    reads (it reads HF_HUB_CACHE once, at import) -> the snapshot folder, for the files."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return folder / "snapshots" / commit


def test_gpt2_name_finds_hf_cache_downloads_once_and_offline_is_one_sentence(tmp_path, monkeypatch):
    for repo in ("openai-community/gpt2", "gpt2"):                 # the cache under either of the hub's names
        snap = write_hf_folder(str(hub_snapshot(monkeypatch, tmp_path / repo, repo)), hf_tiny_state(2))
        assert G.find_weights("gpt2", allow_download=False) == os.path.join(snap, "model.safetensors")
        assert G.load_gpt2_lm("gpt2").cfg.n_embd == 48                # its config.json was read
    # not cached: both files downloaded once into the cache (a stand-in for the hub), then found there
    hub, fetched = write_hf_folder(str(tmp_path / "hub"), hf_tiny_state(2)), []

    def download(repo, filename):
        fetched.append((repo, filename))
        dest = hub_snapshot(monkeypatch, tmp_path / "fresh", repo) / filename
        shutil.copyfile(os.path.join(hub, filename), dest)
        return str(dest)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)    # never the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "fresh"))
    monkeypatch.setattr(G, "hf_hub_download", download)
    assert G.load_gpt2_lm("gpt2").cfg.n_embd == 48 and G.load_gpt2_lm("gpt2").cfg.n_layer == 2
    assert fetched == [("openai-community/gpt2", "config.json"), ("openai-community/gpt2", "model.safetensors")]
    # not cached and offline (huggingface_hub itself, never the network): one sentence that says what to run
    monkeypatch.setattr(G, "hf_hub_download", huggingface_hub.hf_hub_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(G.CheckpointError) as e:
        G.load_gpt2_lm("gpt2")
    msg = str(e.value)
    assert "GPT-2 small weights are not in the Hugging Face cache and could not be downloaded" in msg, msg
    assert "`hf download openai-community/gpt2 model.safetensors config.json`" in msg and "\n" not in msg
    assert not [f for f in (tmp_path / "empty").rglob("*") if f.is_file()]        # nothing half-written left behind

    def no_network(*a, **kw):   # not offline, but no network: one sentence at once, not after huggingface_hub's retries
        raise socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(G.socket, "getaddrinfo", no_network)
    monkeypatch.setattr(G, "hf_hub_download", lambda *a, **kw: pytest.fail("went on to the download"))
    with pytest.raises(G.CheckpointError, match=r"could not be downloaded \(no network\); with a network run `hf"):
        G.load_gpt2_lm("gpt2")


# ---------------------------------------------------------------------------------------------------------------
# GPT2-DT / GPT2-DTMA

def small_dt(seed=0, moa=True, **shape):
    torch.manual_seed(seed)
    gpt = G.GPT2Config(**(dict(n_layer=2, n_head=12, n_embd=48) | shape))
    return G.DecisionTransformer(gpt, 5, 2, 50, dropout=0.0, moa=moa)


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


def test_dt_and_dtma_of_one_seed_share_every_weight_but_the_gate():
    """Paired runs: GPT2-DT and GPT2-DTMA built with one seed start from the same weights apart from the gate, so the
    gate is the only difference (zero gate * N == 1: the same function too)."""
    dt, dtma = small_dt(moa=False).eval(), small_dt(moa=True).eval()
    a, b = dt.state_dict(), dtma.state_dict()
    gate = {k for k in b if ".gate_" in k}
    assert len(gate) == 2 * 2 and set(a) == set(b) - gate
    for k in a:
        assert torch.equal(a[k], b[k]), k
    batch = rand_batch(pad=[0, 2, 5, 0])
    a_dt, a_ma = fwd(dt, batch)[0], fwd(dtma, batch)[0]
    assert torch.equal(a_dt, a_ma)
    g0 = fwd(dtma, batch)[1]["gates"][0]
    assert torch.allclose(g0, torch.full_like(g0, 1 / 12))
    with torch.no_grad():
        dtma.blocks[0].attn.gate_bias[3] = 2.0                      # a non-uniform gate changes the function
    assert (fwd(dtma, batch)[0] - a_dt).abs().max() > 1e-4


def test_paired_pretrained_builds_share_every_weight_but_the_gate(tmp_path):
    folder = write_hf_folder(str(tmp_path / "c"), hf_tiny_state(3))
    info = lambda: dict(obs_dim=5, act_dim=2, max_ep_len=50, goal_dim=0)  # noqa: E731
    torch.manual_seed(7)
    dt = G.build_model(G.Config(init=folder, moa=False), info())
    torch.manual_seed(7)
    dtma = G.build_model(G.Config(init=folder, moa=True), info())
    b = dtma.state_dict()
    for k, v in dt.state_dict().items():
        assert torch.equal(v, b[k]), k


def test_gate_parameters_by_hand():
    """Eq. 7 adds N*C + N parameters per layer: 9,228 for GPT-2 small, 12 x 9,228 = 110,736 = 0.13% of its 85.06M
    block parameters, far from Sec. 5.2's '~3%'."""
    dt, dtma = small_dt(moa=False), small_dt(moa=True)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(dtma) - count(dt) == 2 * (12 * 48 + 12)
    C, L = 768, 12
    block = 4 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)   # 2 LN, attn, MLP
    assert L * block == 85_054_464 and round(100 * L * (12 * C + 12) / (L * block), 2) == 0.13


def test_load_gpt2_blocks_uses_pretrained_weights(tmp_path):
    folder = write_hf_folder(str(tmp_path / "c"), hf_tiny_state(3))
    gpt = G.load_gpt2_lm(folder)
    torch.manual_seed(0)
    info = dict(obs_dim=5, act_dim=2, max_ep_len=50, goal_dim=0)
    dt = G.build_model(G.Config(init=folder, n_layer=1), info)     # --n-layer 1: keep block 0 only
    assert len(dt.blocks) == 1
    assert info["shape"] == dict(n_embd=48, n_head=12, n_layer=1, eps=1e-5, activation="gelu_new")
    for k, v in gpt.h[0].state_dict().items():
        assert torch.equal(dt.blocks[0].state_dict()[k], v), k
    assert torch.equal(dt.ln_f.weight, gpt.ln_f.weight)
    assert torch.equal(dt.blocks[0].attn.gate_weight, torch.zeros(12, 48))
    # a rebuild from info (resume, analyses) needs no GPT-2 file: same shape, no pretrained weights loaded
    os.remove(os.path.join(folder, "model.safetensors"))
    again = G.build_model(G.Config(init=folder, n_layer=1), info)
    assert {k: v.shape for k, v in again.state_dict().items()} == {k: v.shape for k, v in dt.state_dict().items()}


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


@pytest.mark.slow
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
    assert abs(G.markov_gate_mass(gates, b["mask"], (1, 5, 10)).item() - 3 / 12) < 1e-6   # uniform: 3 of 12 heads
    g = torch.zeros(1, 3, 12)
    g[0, 0, 1] = 1.0                             # token 0 puts all weight on head 1; tokens 1, 2 on head 0
    g[0, 1:, 0] = 1.0
    assert abs(G.markov_gate_mass(g, torch.ones(1, 1), (1, 5, 10)).item() - 1 / 3) < 1e-6
    assert G.markov_gate_mass(g, torch.zeros(1, 1), (1, 5, 10)).item() == 0.0
    # GPT2-P (Eq. 9): descending the penalty lowers the Markov heads' gate mass
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"], (1, 5, 10)).item()
    for _ in range(3):
        pen = G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"], (1, 5, 10))
        opt.zero_grad()
        pen.backward()
        opt.step()
    assert G.markov_gate_mass(fwd(m, b)[1]["gates"][0], b["mask"], (1, 5, 10)).item() < before - 0.01


def test_freeze_attention_trains_only_embeddings_ffn_and_new_layers(tmp_path):
    """App. F's GPT2-DT (part): the pretrained attention and LayerNorms get no gradient, are left out of the optimiser
    and do not move over steps; the embeddings, FFNs, action head and gate do."""
    folder = write_hf_folder(str(tmp_path / "c"), hf_tiny_state(3))
    cfg = G.Config(init=folder, freeze_attention=True, lr=1e-2, warmup_steps=0, dropout=0.0)
    torch.manual_seed(0)
    m = G.build_model(cfg, dict(obs_dim=5, act_dim=2, max_ep_len=50, goal_dim=0))
    pattern = r"ln_f\.|blocks\.\d+\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj)\."     # written here, not from the code
    frozen = {n for n, _ in m.named_parameters() if re.match(pattern, n)}
    assert len(frozen) == 2 + 2 * 8                                # ln_f + per block: ln_1, ln_2, c_attn, c_proj (w, b)
    opt = torch.optim.AdamW(G.param_groups(m), lr=cfg.lr, weight_decay=cfg.weight_decay)   # as train() does
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    named = dict(m.named_parameters())
    assert in_opt == {id(p) for n, p in named.items() if n not in frozen}
    before = {n: p.detach().clone() for n, p in named.items()}
    b = rand_batch(B=8, K=4)
    for _ in range(3):
        loss = G.loss_fn(m, b, cfg)
        opt.zero_grad()
        loss.backward()
        assert all(named[n].grad is None for n in frozen)
        opt.step()
    for n, p in named.items():
        assert torch.equal(p, before[n]) == (n in frozen), n         # frozen kept, everything else moved


def test_markov_heads_of_the_model():
    """GPT-2 small keeps Tab. 1's {1, 5, 10}; another checkpoint gets Def. 4.1 on its own layer-0 weights; random
    weights get {1, 5, 10} only with more than 10 heads."""
    W = torch.randn(3 * 48, 48, generator=torch.Generator().manual_seed(0))
    for h in (2, 7):                                   # plant: W_k^h = 3 W_q^h gives the PSD form 3 Wq^T Wq
        W[48 + 4 * h:48 + 4 * h + 4] = 3 * W[4 * h:4 * h + 4]
    assert G.find_markov_heads(W, 12, r=1.5) == (2, 7)
    info = lambda: dict(obs_dim=5, act_dim=2, max_ep_len=50, goal_dim=0)  # noqa: E731
    assert G.build_model(G.Config(init="random", n_embd=24, n_layer=1), info()).markov_heads == (1, 5, 10)
    assert G.build_model(G.Config(init="random", n_embd=24, n_head=8, n_layer=1), info()).markov_heads == ()


# ---------------------------------------------------------------------------------------------------------------
# analysis quantities on inputs with known answers

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
    att = G.CausalSelfAttention(48, 12)
    W = att.c_attn.weight
    x, y = torch.randn(48), torch.randn(48)
    for i in (0, 5, 11):
        q = (W[i * 4:(i + 1) * 4] @ x).double()                     # head i's query of x, bias-free
        k = (W[48 + i * 4:48 + (i + 1) * 4] @ y).double()
        A = G.head_qk_matrix(W, 12, i, "model")
        assert A.shape == (48, 48) and torch.allclose(x.double() @ A @ y.double(), q @ k, atol=1e-8)
        assert G.head_qk_matrix(W, 12, i, "head").shape == (4, 4)
    with torch.no_grad():                             # plant a Markov head: W_k^1 = 3 W_q^1
        W[48 + 4:48 + 8] = W[4:8] * 3.0
    rows = G.markov_table(W, 12)
    assert rows[1]["model_i"] and rows[1]["head_i"]                 # (i) holds for the planted head
    assert not any(r["model_i"] for r in rows if r["head"] != 1)   # 48 random diagonal signs are never all +
    assert rows[1]["head_ratio"] > max(r["head_ratio"] for r in rows if r["head"] != 1)


def test_diagonal_attention_mass_leaves_out_row_0():
    P = torch.zeros(1, 2, 3, 3)
    P[0, 0] = torch.eye(3)                                          # head 0 attends to itself only
    P[0, 1, :, 0] = 1.0                                             # head 1 attends to the first token only
    # rows 1 and 2: head 0 = 1, head 1 = 0 (row 0, always 1 under a causal mask, is not counted)
    assert torch.allclose(G.diagonal_attention_mass(P), torch.tensor([1.0, 0.0]))
    P[0, 1, 2] = torch.tensor([0.5, 0.0, 0.5])                      # head 1, row 2: half on itself
    assert torch.allclose(G.diagonal_attention_mass(P), torch.tensor([1.0, 0.25]))
    assert torch.allclose(G.diagonal_attention_mass(P, torch.tensor([[1.0, 0.0, 1.0]])), torch.tensor([1.0, 0.5]))


def test_attention_by_distance_hand_made():
    P = torch.zeros(1, 2, 4, 4)                                     # one window, two heads, four tokens
    P[0, 0, 3] = torch.tensor([0.1, 0.2, 0.3, 0.4])                 # head 0, query 3: keys 0..3
    P[0, 1, 3] = torch.tensor([0.0, 0.0, 0.0, 1.0])                 # head 1: itself only
    P[0, :, 2, :3] = torch.tensor([0.5, 0.25, 0.25])                # query 2 (another row): not counted for query 3
    d = G.attention_by_distance([P], query=3)                       # distance 0 = key 3, ..., 3 = key 0
    assert torch.allclose(d, torch.tensor([(0.4 + 1) / 2, 0.3 / 2, 0.2 / 2, 0.1 / 2]))
    assert torch.allclose(G.attention_by_distance([P, torch.zeros_like(P)], query=3), d / 2)   # mean over layers
    assert torch.allclose(G.attention_by_distance([P], query=2), torch.tensor([0.25, 0.25, 0.5]))


def test_head_importance_zero_for_a_dead_head_and_matches_a_hand_ablation():
    m = small_dt(n_layer=2).eval()
    with torch.no_grad():                                           # head 4 of layer 1 outputs exactly zero
        m.blocks[1].attn.c_attn.weight[96 + 16:96 + 20] = 0
        m.blocks[1].attn.c_attn.bias[96 + 16:96 + 20] = 0
    b = rand_batch(pad=[0, 2, 0, 4])
    imp = G.head_importance(m, b)
    assert imp.shape == (2, 12) and imp[1, 4] == 0 and (imp[0] > 0).all()
    # by hand: head 7 of layer 0 removed by zeroing its 4 input columns of c_proj, in a copy of the model
    import copy
    cut = copy.deepcopy(m)
    with torch.no_grad():
        cut.blocks[0].attn.c_proj.weight[:, 28:32] = 0
    by_hand = (fwd(m, b)[0][:, -1] - fwd(cut, b)[0][:, -1]).norm(dim=-1).mean()
    assert torch.allclose(imp[0, 7], by_hand, atol=1e-6)
    assert all(not blk.attn.c_proj._forward_pre_hooks for blk in m.blocks)   # the hooks are gone afterwards


# ---------------------------------------------------------------------------------------------------------------
# the command line on the tiny datasets of conftest.py

TINY_RUN = ["--init", "random", "--n-layer", "2", "--n-embd", "24", "--n-head", "12", "--batch-size", "4",
            "--context", "4", "--eval-episodes", "1", "--log-every", "2", "--warmup-steps", "2", "--lr", "1e-3"]


def cli(capsys, *args):
    G.main([str(a) for a in args])
    return capsys.readouterr()


def log(folder):
    with open(folder / "log.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_cli_train_resume_and_analyses(tiny_hopper, tmp_path, capsys):
    full, part = tmp_path / "full", tmp_path / "part"
    out = cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--steps", 6, "--eval-every", 3, "--keep-ckpt-at", 3,
              "--out", full).out
    last = out.strip().splitlines()[-1]
    assert last.startswith("final: normalized_score=") and last.endswith("episodes=1"), last
    assert "| g_markov 0.2" in out and "Markov heads {1, 5, 10}" in out       # logged with the loss (Fig. 9)
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png", "gates.png", "ckpt_step3.pt"):
        assert (full / f).exists(), f
    rows = log(full)
    assert rows[0]["step"] == "0" and abs(float(rows[0]["g_markov"]) - 0.25) < 1e-6
    assert json.loads((full / "config.json").read_text())["info"]["markov_heads"] == [1, 5, 10]
    kept = torch.load(full / "ckpt_step3.pt", weights_only=True)
    # --resume: 3 steps, stop, 3 more == 6 steps in one go; the kept step-3 checkpoint is that step's
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--steps", 3, "--eval-every", 3, "--out", part)
    mid = torch.load(part / "ckpt.pt", weights_only=True)
    assert kept["step"] == mid["step"] == 3 and all(torch.equal(kept["model"][k], v) for k, v in mid["model"].items())
    cli(capsys, "--out", part, "--resume", "--steps", 6)
    a, b = torch.load(full / "ckpt.pt", weights_only=True), torch.load(part / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 6
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    # analyses of the trained run (its settings come from its checkpoint): each prints its table and writes its PNG
    before = (full / "ckpt.pt").read_bytes()
    for flag, words, png in (("--markov", "fine-tuned CxC (i)", "markov_heads.png"),
                             ("--attention-maps", "| head | before | after | Markov head |", "attention_maps.png"),
                             ("--importance", "most important heads", "head_importance.png"),
                             ("--attention-distance", "| step | 0 | 1 |", "attention_distance.png")):
        out = cli(capsys, "--out", full, flag, "--device", "cpu").out
        assert words in out and (full / png).exists(), (flag, out)
    assert "\n| 0 | " in out and "\n| 3 | " in out and "\n| 6 | " in out    # step 0, the kept step 3, the end
    assert (full / "ckpt.pt").read_bytes() == before                            # never retrained


@pytest.mark.slow
def test_cli_maze_reports_steps_to_goal_and_gpt2_p(tiny_maze, tmp_path, capsys):
    out = cli(capsys, "--dataset", tiny_maze, *TINY_RUN, "--steps", 2, "--eval-every", 2, "--markov-penalty", "0.1",
              "--out", tmp_path / "m").out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("maze: steps_to_goal=") and lines[-1].startswith("final: normalized_score=")
    assert "markov-penalty0.1" in out
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    assert cfg["markov_penalty"] == 0.1 and cfg["context"] == 4


def test_default_context_is_the_papers_per_task():
    class D:
        goal_reaching = True
    assert G.paper_context(G.Config(), D()).context == 50
    D.goal_reaching = False
    assert G.paper_context(G.Config(), D()).context == 20
    assert G.paper_context(G.Config(context=7), D()).context == 7
    assert G.Config().context is None                               # so the variant name leaves it out unless given


@pytest.mark.slow
def test_fewer_than_11_random_heads_log_no_g_markov(tiny_hopper, tmp_path, capsys):
    """The paper's Markov heads 1, 5, 10 do not exist with 8 heads: no G_Markov, no gates.png (and --markov-penalty
    is refused, below)."""
    args = [a if a != "12" else "8" for a in TINY_RUN]
    out = cli(capsys, "--dataset", tiny_hopper, *args, "--steps", 2, "--eval-every", 2, "--out", tmp_path / "r").out
    assert "Markov heads {}" in out and "g_markov" not in out
    assert all(r["g_markov"] == "" for r in log(tmp_path / "r")) and not (tmp_path / "r" / "gates.png").exists()


@pytest.mark.slow
def test_markov_heads_of_another_checkpoint_come_from_its_weights(tiny_hopper, tmp_path, capsys):
    sd = hf_tiny_state(4)
    W = sd["transformer.h.0.attn.c_attn.weight"]                     # Conv1D (C, 3C): head h's query columns 4h..
    W[:, 48 + 8:48 + 12] = 3 * W[:, 8:12]                            # plant a Markov head at 2
    folder = write_hf_folder(str(tmp_path / "ckpt"), sd)
    out = cli(capsys, "--dataset", tiny_hopper, "--init", folder, "--n-layer", 1, "--markov-r", 1.5, "--batch-size", 4,
              "--context", 4, "--steps", 2, "--eval-every", 2, "--eval-episodes", 1, "--log-every", 1,
              "--markov-penalty", 0.1, "--out", tmp_path / "r").out
    assert "Markov heads {2} (Def. 4.1 with r=1.5" in out
    assert json.loads((tmp_path / "r" / "config.json").read_text())["info"]["markov_heads"] == [2]
    assert all(r["g_markov"] != "" for r in log(tmp_path / "r") if r["loss"])
    # no Markov head at r=20 in random weights: GPT2-P has nothing to penalise, one sentence
    with pytest.raises(SystemExit) as e:
        G.main(["--dataset", tiny_hopper, "--init", folder, "--n-layer", "1", "--markov-penalty", "0.1",
                "--steps", "2", "--out", str(tmp_path / "none")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "finds no Markov head" in err and "\n" not in err, err


@pytest.mark.parametrize("args, words", [
    (["--env", "no-such-env", "--init", "random"], "unknown environment"),
    (["--dataset", "TINY", "--init", "/no/such/ckpt"], "no GPT-2 or CLIP checkpoint"),
    (["--sample", "hi", "--init", "/no/such/ckpt"], "no GPT-2 or CLIP checkpoint"),
    (["--importance", "--out", "/no/such/run"], "no checkpoint"),
    (["--dataset", "TINY", "--init", "CKPT", "--n-embd", "24"], "checkpoint's width is 48"),
    (["--dataset", "TINY", "--init", "CKPT", "--n-head", "8"], "checkpoint has 12 heads"),
    (["--dataset", "TINY", "--init", "CKPT", "--n-layer", "3"], "checkpoint has 2 blocks"),
    (["--dataset", "TINY", "--init", "BADCKPT"], "n_layer must be a whole number"),
    (["--init", "random", "--n-embd", "40"], "not divisible by --n-head 12"),
    (["--markov-penalty", "-1"], "--markov-penalty must be >= 0"),
    (["--markov-penalty", "0.1", "--no-moa"], "drop --no-moa"),
    (["--init", "random", "--n-embd", "24", "--n-head", "8", "--markov-penalty", "0.1"], "more than 10 heads"),
    (["--init", "random", "--freeze-attention"], "with --init random there is none"),
    (["--markov-r", "0"], "--markov-r must be > 0"),
    (["--keep-ckpt-at", "-1"], "--keep-ckpt-at -1"),
    (["--keep-ckpt-at", "700", "--eval-every", "500"], "a multiple of --eval-every 500"),
    (["--keep-ckpt-at", "500", "--steps", "400", "--eval-every", "100"], "0 to --steps 400"),
    (["--sample", "hi", "--text-attention", "ho"], "choose one of --sample, --text-attention"),
    (["--sample", "hi", "--importance"], "choose one of"),
    (["--text-attention", "hi", "--steps", "0"], "--steps must be a positive"),
])
def test_cli_bad_input_is_one_sentence(args, words, capsys, tiny_hopper, tmp_path):
    ckpt = write_hf_folder(str(tmp_path / "ckpt"), hf_tiny_state(0))
    bad = write_hf_folder(str(tmp_path / "bad"), hf_tiny_state(0), n_layer="2")
    subst = dict(TINY=tiny_hopper, CKPT=ckpt, BADCKPT=bad)
    with pytest.raises(SystemExit) as e:
        G.main([subst.get(a, a) for a in args] + ["--out", str(tmp_path / "run")] * ("--out" not in args))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error:") and words in err and "\n" not in err, err
    assert not (tmp_path / "run").exists() or words == "unknown environment"


@pytest.mark.slow
def test_cli_init_from_local_checkpoint_keeps_the_pretrained_blocks(tiny_hopper, tmp_path, capsys):
    folder = write_hf_folder(str(tmp_path / "ckpt"), hf_tiny_state(4))
    cli(capsys, "--dataset", tiny_hopper, "--init", folder, "--n-layer", 1, "--batch-size", 4, "--context", 4,
        "--steps", 1, "--eval-every", 1, "--eval-episodes", 1, "--lr", 1e-9, "--out", tmp_path / "r")
    ck = torch.load(tmp_path / "r" / "ckpt.pt", weights_only=True)
    gpt = G.load_gpt2_lm(folder)
    assert ck["info"]["shape"] == dict(n_embd=48, n_head=12, n_layer=1, eps=1e-5, activation="gelu_new")
    assert torch.allclose(ck["model"]["blocks.0.mlp.c_fc.weight"], gpt.h[0].mlp.c_fc.weight, atol=1e-6)
    assert "blocks.1.mlp.c_fc.weight" not in ck["model"]


@pytest.mark.slow
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
    out = cli(capsys, "--markov", "--init", folder, "--out", tmp_path / "m").out       # no run: the weights alone
    assert "| head | init CxC (i)" in out and "fine-tuned" not in out and (tmp_path / "m" / "markov_heads.png").exists()


@pytest.mark.slow
def test_analyses_rebuild_the_runs_exact_starting_point(tiny_hopper, tmp_path, capsys):
    """With lr 1e-12 training changes nothing that shows, so 'before fine-tuning' (rebuilt from the seed) must equal
    'after'."""
    out = tmp_path / "lr0"
    cli(capsys, "--dataset", tiny_hopper, *TINY_RUN, "--lr", 1e-12, "--steps", 1, "--eval-every", 1, "--seed", 3,
        "--out", out)
    cfg, given = G.parse_flags(["--out", str(out)])                  # the run's flags come from its checkpoint
    tables = G.markov_analysis(cfg, given)
    ratios = {lab: [r["model_ratio"] for r in rows] for lab, rows in tables.items()}
    assert ratios["init"] == pytest.approx(ratios["fine-tuned"], rel=1e-6)
    P = G.attention_maps(cfg, given)
    assert torch.allclose(P["before"], P["after"], atol=1e-6)
    capsys.readouterr()


# ---------------------------------------------------------------------------------------------------------------
# CLIP-DT ([P-new] Tab. 7, [P-old] Tabs. 3 and 8): CLIP's text tower as the blocks, against transformers' CLIPTextModel

CLIP_TINY = dict(vocab_size=99, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=16)


def hf_tiny_clip(folder, seed=0, full=False, **text):
    """A random CLIP text tower saved by transformers (save_pretrained, safetensors) -> its CLIPTextModel. full: saved
    as a whole CLIPModel, as the hub's openai/clip-vit-base-patch32 is (names 'text_model.*', a vision tower and the
    projections beside it; config.json of model_type 'clip' with a text_config); else a bare CLIPTextModel."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    tc = transformers.CLIPTextConfig(**(CLIP_TINY | text), pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if full:
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                      patch_size=16)
        m = transformers.CLIPModel(transformers.CLIPConfig(text_config=tc.to_dict(), vision_config=vision,
                                                           projection_dim=16))
    else:
        m = transformers.CLIPTextModel(tc)
    with torch.no_grad():        # HF starts biases at 0 and LayerNorms at 1: give every tensor a value to get wrong
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    m.eval().save_pretrained(folder, safe_serialization=True)
    return m.text_model if full else m


def clip_dt(folder, **kw):
    return G.build_model(G.Config(init=folder, dropout=0.0, **kw), dict(obs_dim=5, act_dim=2, max_ep_len=50,
                                                                        goal_dim=0)).eval()


def blocks_forward(model, x, **kw):
    for block in model.blocks:
        x = block(x, **kw)[0]
    return model.ln_f(x)


@pytest.mark.parametrize("full", [False, True])
def test_clip_text_tower_matches_transformers(tmp_path, full):
    """The same input embeddings through CLIP's text tower in transformers and through the DT's blocks + ln_f loaded by
    our reader: equal within 1e-4, on the SDPA path, the explicit-probability path and the DT's own boolean mask."""
    hf = hf_tiny_clip(str(tmp_path), full=full)
    dt = clip_dt(str(tmp_path))
    assert len(dt.blocks) == 2 and dt.blocks[0].attn.n_head == 4 and isinstance(dt.blocks[0].mlp.act, G.QuickGELU)
    ids = torch.randint(0, 99, (3, 16), generator=torch.Generator().manual_seed(1))
    T = ids.shape[1]
    additive = torch.full((T, T), float("-inf")).triu(1)[None, None]          # HF's form of the causal mask
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(3, 1, T, T)   # the DT's form
    with torch.no_grad():
        x = hf.embeddings(input_ids=ids)                  # CLIP's own token + position embeddings, fed to both
        refs = [hf(input_ids=ids).last_hidden_state,     # transformers' whole tower, its own causal mask
                hf.final_layer_norm(hf.encoder(inputs_embeds=x, attention_mask=additive).last_hidden_state)]
        r = torch.randn(3, T, 64, generator=torch.Generator().manual_seed(2))   # any hidden-state sequence
        ref_r = hf.final_layer_norm(hf.encoder(inputs_embeds=r, attention_mask=additive).last_hidden_state)
        ours = [blocks_forward(dt, x), blocks_forward(dt, x, need_probs=True), blocks_forward(dt, x, attn_mask=allowed)]
        diff = max((o - ref).abs().max().item() for o in ours for ref in refs)
        diff = max(diff, (blocks_forward(dt, r) - ref_r).abs().max().item())
        assert diff < 1e-4, diff
        # the test can fail: GPT-2's GELU in the same blocks, or no causal mask in transformers, is far off
        gelu = clip_dt(str(tmp_path))
        for block in gelu.blocks:
            block.mlp.act = torch.nn.GELU(approximate="tanh")
        assert (blocks_forward(gelu, x) - refs[0]).abs().max() > 1e-3
        no_mask = hf.final_layer_norm(hf.encoder(inputs_embeds=x).last_hidden_state)
        assert (no_mask - refs[0]).abs().max() > 1e-3


def test_clip_weights_land_where_they_belong(tmp_path):
    """Tensor by tensor: q, k, v stacked as c_attn's rows (nn.Linear layout, not transposed), out_proj, fc1, fc2, the
    LayerNorms and final_layer_norm as ln_f; nothing of CLIP's embeddings, projections or vision tower is read."""
    hf = hf_tiny_clip(str(tmp_path), full=True)
    g, sd = G.load_checkpoint(str(tmp_path))
    assert (g.n_embd, g.n_layer, g.n_head, g.activation) == (64, 2, 4, "quick_gelu")
    assert set(sd) == {"ln_f.weight", "ln_f.bias"} | {f"h.{i}.{n}.{x}" for i in range(2) for x in ("weight", "bias")
                                                      for n in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj",
                                                                "mlp.c_fc", "mlp.c_proj")}
    layer = hf.encoder.layers[1]
    assert torch.equal(sd["h.1.attn.c_attn.weight"][64:128], layer.self_attn.k_proj.weight.detach())
    assert torch.equal(sd["h.1.attn.c_attn.bias"][128:], layer.self_attn.v_proj.bias.detach())
    assert torch.equal(sd["h.1.mlp.c_proj.weight"], layer.mlp.fc2.weight.detach())     # (64, 256): not transposed
    assert torch.equal(sd["h.1.ln_2.weight"], layer.layer_norm2.weight.detach())
    assert torch.equal(sd["ln_f.bias"], hf.final_layer_norm.bias.detach())


def _rewrite(path, edit):
    """Re-encode a safetensors file with its JSON header changed by edit(header, data_len)."""
    blob = open(path, "rb").read()
    n = int.from_bytes(blob[:8], "little")
    header, data = json.loads(blob[8:8 + n]), blob[8 + n:]
    edit(header, len(data))
    h = json.dumps(header).encode()
    open(path, "wb").write(len(h).to_bytes(8, "little") + h + data)


def _save_with(folder, name, value):
    from safetensors.torch import load_file, save_file
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    sd[name] = value
    save_file(sd, path)


Q0 = "text_model.encoder.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("damage, words", [
    (lambda f: open(f, "r+b").write((2 ** 60).to_bytes(8, "little")), "header length"),      # absurd header length
    (lambda f: _rewrite(f, lambda h, n: h[Q0].update(data_offsets=[n - 8, n + 16376])), "outside the data"),
    (lambda f: _rewrite(f, lambda h, n: h[Q0].update(dtype="F33")), "unknown dtype"),
    (lambda f: _save_with(os.path.dirname(f), Q0, torch.zeros(64, 64, dtype=torch.int32)), "dtype int32, expected"),
    (lambda f: _save_with(os.path.dirname(f), Q0, torch.zeros(64, 63)), "shape (64, 63), expected (64, 64)"),
    (lambda f: _save_with(os.path.dirname(f), "text_model.encoder.layers.1.mlp.fc1.weight", torch.zeros(255, 64)),
     "expected (256, 64)"),
    (lambda f: open(f, "r+b").truncate(os.path.getsize(f) // 2), "truncated"),
    (lambda f: os.remove(f), "no GPT-2 or CLIP checkpoint"),
])
def test_clip_hostile_files_are_refused_in_one_sentence(tmp_path, capsys, damage, words):
    hf_tiny_clip(str(tmp_path / "c"), full=True)
    capsys.readouterr()                                             # transformers' own progress line
    damage(str(tmp_path / "c" / "model.safetensors"))
    t0 = time.time()
    with pytest.raises(G.CheckpointError, match=re.escape(words)):
        G.load_checkpoint(str(tmp_path / "c"))
    assert time.time() - t0 < 1.0
    with pytest.raises(SystemExit) as e:
        G.main(["--markov", "--init", str(tmp_path / "c"), "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and err.startswith("error:") and words in err and "\n" not in err, err


@pytest.mark.parametrize("change, words", [
    (dict(num_hidden_layers=10 ** 9), "num_hidden_layers must be a whole number from 1 to 96"),
    (dict(num_attention_heads="8"), "num_attention_heads must be a whole number"),
    (dict(num_attention_heads=5), "hidden_size 64 is not divisible by num_attention_heads 5"),
    (dict(layer_norm_eps=-1), "layer_norm_eps must be a small positive number"),
    (dict(hidden_act="gelu"), "not OpenAI CLIP's quick_gelu"),
    (dict(intermediate_size=100), "intermediate_size 100 is not 4 x hidden_size 64"),
])
def test_clip_config_json_is_validated_before_any_allocation(tmp_path, change, words):
    hf_tiny_clip(str(tmp_path), full=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(G.CheckpointError, match=re.escape(words)):
        G.load_checkpoint(str(tmp_path))


@pytest.mark.parametrize("init", ["gptj", "GPT-J", "EleutherAI/gpt-j-6B"])
def test_init_gptj_is_one_sentence_before_any_work(tmp_path, capsys, monkeypatch, init):
    def no_work(*a, **kw):
        raise AssertionError("work began")
    monkeypatch.setattr(G.data_lib, "load_data", no_work)
    monkeypatch.setattr(G, "find_weights", no_work)
    for extra in ([], ["--markov"], ["--no-moa", "--preset", "cpu"]):
        with pytest.raises(SystemExit) as e:
            G.main(["--init", init, "--out", str(tmp_path / "run"), *extra])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and "out of a laptop's reach" in err and "\n" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("n_head", [4, 8])
@pytest.mark.slow
def test_markov_analysis_on_clip_layer0_heads(tmp_path, capsys, n_head):
    """--markov --init <CLIP> tests the config's n_head layer-0 heads of width 64 / n_head; the ratios equal Def. 4.1
    computed here in numpy from transformers' own q_proj and k_proj; [P-old] Tab. 8 is printed beside 8 heads."""
    hf = hf_tiny_clip(str(tmp_path / "c"), full=True, num_attention_heads=n_head)
    out = cli(capsys, "--markov", "--init", tmp_path / "c", "--out", tmp_path / "m").out
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \| ", line)]
    assert len(rows) == n_head and (tmp_path / "m" / "markov_heads.png").exists(), out
    assert ("[P-old] Tab. 8" in out) == (n_head == 8)
    tables = G.markov_analysis(G.Config(init=str(tmp_path / "c"), out=str(tmp_path / "m")), set())
    attn = hf.encoder.layers[0].self_attn
    Wq, Wk = (w.detach().double().numpy() for w in (attn.q_proj.weight, attn.k_proj.weight))   # (C, C): rows = heads
    D = 64 // n_head
    for h, row in enumerate(tables["init"]):
        for layout, A in (("model", Wq[h * D:(h + 1) * D].T @ Wk[h * D:(h + 1) * D]),        # C x C
                          ("head", Wq[h * D:(h + 1) * D] @ Wk[h * D:(h + 1) * D].T)):       # D x D
            d = A.shape[0]
            ratio = np.abs(np.diag(A)).mean() / ((np.abs(A).sum() - np.abs(np.diag(A)).sum()) / (d * d - d) + 1e-8)
            assert row[f"{layout}_ratio"] == pytest.approx(ratio, rel=1e-9)
            assert row[f"{layout}_i"] == bool((np.diag(A) > 0).all())
    capsys.readouterr()


@pytest.mark.slow
def test_cli_clip_dt_from_the_hub_name_offline(tiny_hopper, tmp_path, capsys, monkeypatch):
    """--init clip finds openai/clip-vit-base-patch32 in the Hugging Face cache (a tiny one planted there), trains
    CLIP-DT in a run folder named after the init, keeps CLIP's blocks and QuickGELU in the checkpoint, and --markov on
    the run shows its heads at the start and after fine-tuning. Not cached and offline: one sentence."""
    hf = hf_tiny_clip(str(hub_snapshot(monkeypatch, tmp_path / "hf", "openai/clip-vit-base-patch32")), full=True)
    monkeypatch.chdir(tmp_path)
    args = ["--dataset", tiny_hopper, "--init", "clip", "--no-moa", "--n-layer", 1, "--batch-size", 4, "--context", 4,
            "--steps", 2, "--eval-every", 2, "--eval-episodes", 1, "--log-every", 1]
    out = cli(capsys, *args).out
    assert "1 of width 64 with 4 heads (quick_gelu)" in out
    (run,) = (tmp_path / "runs" / "gpt2_dtma").glob("*/*/seed0")
    assert "_initclip_" in run.parent.name and run.parent.name.endswith("_no-moa"), run
    ck = torch.load(run / "ckpt.pt", weights_only=True)
    assert ck["info"]["shape"] == dict(n_embd=64, n_head=4, n_layer=1, eps=1e-5, activation="quick_gelu")
    start = G.start_model(G.Config(init="clip", moa=False, n_layer=1), ck["info"])   # the run's start, rebuilt
    assert torch.equal(start.blocks[0].mlp.c_fc.weight, hf.encoder.layers[0].mlp.fc1.weight.detach())
    out = cli(capsys, "--out", run, "--markov").out
    assert "fine-tuned CxC (i)" in out and len([x for x in out.splitlines() if re.match(r"\| \d+ \| ", x)]) == 4
    # --sample / --text-attention are GPT-2's language model on GPT-2's tokens: refused for CLIP in one sentence
    with pytest.raises(SystemExit) as e:
        G.main(["--sample", "hi", "--init", "clip"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "no language-model head" in err and "\n" not in err, err
    # not cached, and offline (huggingface_hub itself, never the network): one sentence, nothing left half-written
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(SystemExit) as e:
        G.main(["--markov", "--init", "clip", "--out", str(tmp_path / "m")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and "CLIP ViT-B/32 weights are not in the Hugging Face cache" in err, err
    assert "`hf download openai/clip-vit-base-patch32 model.safetensors config.json`" in err and "\n" not in err
    assert not [f for f in (tmp_path / "empty").rglob("*") if f.is_file()]
