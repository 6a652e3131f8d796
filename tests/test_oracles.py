"""Outside oracles: dt.py's gym DecisionTransformer against transformers' DecisionTransformerModel
(a port of the official gym DT) and dema.py's Mamba against transformers' MambaMixer (mamba's
parameter names; its pure torch path), on copied weights: the outputs and the gradients agree, and
perturbing any copied tensor breaks the agreement.

What cannot match, and is not compared:
- dt.py: the outputs at left-padding steps. dt.py lets a padding query attend to itself (so that
  no softmax row is empty); transformers masks the whole row. No real step reads those outputs.
- dt.py: the behaviour-cloning variant (return_token=False) and the Atari model: transformers' DT
  always has R_t tokens and vector states.
- dema.py: a padding step inside a sequence. dema.py's Mamba sets Delta = 0 there, so the state
  passes it as is; transformers zeroes the SSM input but keeps Delta = softplus(dt_proj(0)), so the
  state decays by exp(Delta A). After left padding (the state still 0) the two agree: compared.
"""
import pytest
import torch

import dema
import dt

transformers = pytest.importorskip("transformers")


def randomise(model, seed, scale=0.1):
    """Every parameter moved off its initial value (LayerNorm weights off 1, biases off 0), so
    that a tensor copied to the wrong place cannot hide behind the init."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def perturbed_outputs(hf, forward, names):
    """forward() with each named parameter of hf in turn moved by 0.05 N(0, 1), then restored."""
    g = torch.Generator().manual_seed(7)
    params = dict(hf.named_parameters())
    outs = {}
    for name in names:
        p = params[name]
        saved = p.detach().clone()
        with torch.no_grad():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            outs[name] = forward()
            p.copy_(saved)
    return outs


# ------------------------------------------------------------------------------------------------
# dt.py's DecisionTransformer against transformers.DecisionTransformerModel

OBS, ACT, C, LAYERS, HEADS, MAX_EP_LEN = 5, 3, 32, 2, 4, 60


def dt_to_hf(sd):
    """dt.py's state dict -> transformers' names: blocks.i -> encoder.h.i, the MLP's two Linears ->
    c_fc and c_proj, ln_f under encoder; GPT-2's Conv1D weight is (in, out), Linear's (out, in)."""
    out = {}
    for k, v in sd.items():
        if k.startswith("blocks."):
            k = "encoder.h." + k[len("blocks."):]
            k = k.replace(".mlp.0.", ".mlp.c_fc.").replace(".mlp.2.", ".mlp.c_proj.")
            if k.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight")):
                v = v.t()
        elif k.startswith("ln_f."):
            k = "encoder." + k
        out[k] = v
    return out


def dt_pair():
    """(dt.py's model, transformers' with its weights) in eval mode (dropout 0.1 in both, off in
    eval), in float64: the two differ in their order of operations alone."""
    torch.manual_seed(0)
    cfg = dt.DTConfig(n_embd=C, n_layer=LAYERS, n_head=HEADS, dropout=0.1)
    ours = dt.DecisionTransformer(cfg, OBS, ACT, max_ep_len=MAX_EP_LEN)
    randomise(ours, seed=1).eval()
    # eager: GPT-2's own softmax(q k^T / sqrt(hs) + mask) v, not the SDPA kernel dt.py calls
    hc = transformers.DecisionTransformerConfig(
        state_dim=OBS, act_dim=ACT, hidden_size=C, n_layer=LAYERS, n_head=HEADS,
        max_ep_len=MAX_EP_LEN, n_positions=64, action_tanh=True, bos_token_id=None,
        eos_token_id=None, attn_implementation="eager")
    hf = transformers.DecisionTransformerModel(hc).eval()

    # what transformers has and dt.py has not: the vocab-1 wte (inputs_embeds are given), the state
    # and return heads (unused for actions), and GPT-2's positional embedding, which DT replaces by
    # the timestep's: zeroed, since every token reads its row 0 (DT passes position_ids 0)
    mapped, own = dt_to_hf(ours.state_dict()), hf.state_dict()
    assert set(own) - set(mapped) == {"encoder.wte.weight", "encoder.wpe.weight",
                                      "predict_state.weight", "predict_state.bias",
                                      "predict_return.weight", "predict_return.bias"}
    wpe = {"encoder.wpe.weight": torch.zeros_like(own["encoder.wpe.weight"])}
    hf.load_state_dict(own | mapped | wpe, strict=True)
    return ours.double(), hf.double()


def dt_batch(B=4, K=7):
    """Random inputs, rows 1 and 2 left-padded (3 and 6 of K steps), timesteps anywhere."""
    g = torch.Generator().manual_seed(2)
    b = dict(states=torch.randn(B, K, OBS, generator=g, dtype=torch.float64),
             actions=torch.rand(B, K, ACT, generator=g, dtype=torch.float64) * 2 - 1,
             rtg=torch.randn(B, K, 1, generator=g, dtype=torch.float64),
             timesteps=torch.randint(0, MAX_EP_LEN - K, (B, 1), generator=g) + torch.arange(K),
             mask=torch.ones(B, K, dtype=torch.float64))
    b["mask"][1, :3] = 0
    b["mask"][2, :6] = 0
    return b


def dt_forward(model, b):
    return model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])  # (B, K, act)


def hf_forward(hf, b):
    return hf(states=b["states"], actions=b["actions"], returns_to_go=b["rtg"],
              timesteps=b["timesteps"], attention_mask=b["mask"]).action_preds  # (B, K, act)


def test_dt_matches_transformers_decision_transformer():
    ours, hf = dt_pair()
    b = dt_batch()
    real = b["mask"].bool()  # (B, K)
    with torch.no_grad():
        x, y = dt_forward(ours, b), hf_forward(hf, b)
    assert torch.allclose(x[real], y[real], atol=1e-12, rtol=0), (x - y)[real].abs().max()
    assert x[real].std() > 0.1  # not a saturated tanh or a constant

    # every copied tensor takes part: each one perturbed in transformers' copy moves an action
    names = [n for n, _ in dt_to_hf(dict(ours.named_parameters())).items()]
    moved = perturbed_outputs(hf, lambda: hf_forward(hf, b), names)
    for name, out in moved.items():
        assert (out[real] - y[real]).abs().max() > 1e-4, name


def test_dt_gradients_match_transformers():
    """The summed action prediction over real steps: its gradient w.r.t. the states and w.r.t.
    every copied parameter (Conv1D's transposed back)."""
    ours, hf = dt_pair()
    b = dt_batch()
    real = b["mask"].bool()
    grads = []
    for model, forward in ((ours, dt_forward), (hf, hf_forward)):
        model.zero_grad()
        states = b["states"].clone().requires_grad_()
        forward(model, b | {"states": states})[real].sum().backward()
        grads.append(states.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-12, rtol=0)
    # padding reaches nothing
    assert grads[0][real].abs().max() > 1e-2 and (grads[0][~real] == 0).all()

    hf_params = dict(hf.named_parameters())
    for name, g in dt_to_hf({n: p.grad for n, p in ours.named_parameters()}).items():
        assert torch.allclose(g, hf_params[name].grad, atol=1e-12, rtol=0), name


@pytest.mark.parametrize("how", ["untransposed", "wpe kept"])
def test_dt_oracle_can_fail(how):
    """The two mistakes a copy invites: attn.c_proj's square (C, C) weight left as nn.Linear's
    (c_attn's and the MLP's are not square and would not load), or a random wpe left in place."""
    ours, hf = dt_pair()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if how == "untransposed" and name.endswith("attn.c_proj.weight"):
                p.copy_(p.t().clone())
            if how == "wpe kept" and name == "encoder.wpe.weight":
                p.normal_(0.0, 0.02)  # GPT-2's init
    b = dt_batch()
    real = b["mask"].bool()
    with torch.no_grad():
        assert (dt_forward(ours, b)[real] - hf_forward(hf, b)[real]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------
# dema.py's Mamba against transformers.MambaMixer (its pure torch path: no mamba_ssm here)

D_MODEL, D_STATE, D_CONV = 20, 8, 4
# float32's rounding, not float64's: transformers takes A, B and D in float32 even in a float64
# model (A_log.float(), B.float(), D.float(); D's gradient comes back through the cast)
MAMBA_TOL = dict(atol=1e-9, rtol=1e-7)


def mamba_pair():
    """(dema.py's Mamba, transformers' MambaMixer loaded from its state dict, strict), float64."""
    torch.manual_seed(0)
    ours = dema.Mamba(D_MODEL, d_state=D_STATE, d_conv=D_CONV, expand=2, n_layer=2)
    randomise(ours, seed=3)
    hc = transformers.MambaConfig(hidden_size=D_MODEL, state_size=D_STATE, conv_kernel=D_CONV,
                                  expand=2, num_hidden_layers=1, use_conv_bias=True, use_bias=False)
    hf = transformers.models.mamba.modeling_mamba.MambaMixer(hc, layer_idx=0)
    # the same names and shapes: strict loading fails on a missing, unexpected or misshapen tensor
    hf.load_state_dict(ours.state_dict(), strict=True)
    return ours.double().eval(), hf.double().eval()


def mamba_batch(B=3, T=13):
    """Random inputs, rows 1 and 2 left-padded (4 and 9 of T tokens)."""
    g = torch.Generator().manual_seed(4)
    mask = torch.ones(B, T, dtype=torch.float64)
    mask[1, :4] = 0
    mask[2, :9] = 0
    return torch.randn(B, T, D_MODEL, generator=g, dtype=torch.float64), mask


@pytest.mark.parametrize("scan", ["sequential", "parallel"])
def test_mamba_matches_transformers_mamba_mixer(scan):
    ours, hf = mamba_pair()
    x, mask = mamba_batch()
    real = mask.bool()  # (B, T)
    with torch.no_grad():
        y = hf(x, attention_mask=mask)  # (B, T, D)
        assert torch.allclose(ours(x, scan=scan), hf(x), **MAMBA_TOL)  # no padding
        out = ours(x, mask=mask, scan=scan)
    assert torch.allclose(out[real], y[real], **MAMBA_TOL), (out - y)[real].abs().max()
    assert out[real].std() > 0.01

    # every tensor takes part: each one perturbed in transformers' copy moves a real token's output
    names = [n for n, _ in ours.named_parameters()]
    moved = perturbed_outputs(hf, lambda: hf(x, attention_mask=mask), names)
    for name, o in moved.items():
        assert (o[real] - y[real]).abs().max() > 1e-6, name

    # the one difference (the module docstring): a padding step inside a sequence
    inner = mask.clone()
    inner[0, 6] = 0
    with torch.no_grad():
        gap = (ours(x, mask=inner, scan=scan) - hf(x, attention_mask=inner))[0, 7:].abs().max()
    assert gap > 1e-7


def test_mamba_gradients_match_transformers():
    """A weighted sum of the real tokens' outputs: its gradient w.r.t. the input and each
    parameter."""
    ours, hf = mamba_pair()
    x, mask = mamba_batch()
    w = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grads = []
    for model, kw in ((ours, {"mask": mask}), (hf, {"attention_mask": mask})):
        h = x.clone().requires_grad_()
        (model(h, **kw) * w * mask[..., None]).sum().backward()
        grads.append(h.grad)
    assert torch.allclose(grads[0], grads[1], **MAMBA_TOL)
    assert grads[0].abs().max() > 1e-2

    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.allclose(p.grad, hf_params[name].grad, **MAMBA_TOL), name
