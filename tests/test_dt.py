"""dt.py: causality by perturbation, padding, overfitting, resume equality, the CLI on tiny Minari datasets."""
import csv
import json
import os

import pytest
import torch

import dt


def tiny_model(K=5, obs=4, act=2, **kw):
    cfg = dt.DTConfig(n_embd=32, n_layer=2, n_head=2, dropout=0.0, context=K, **kw)
    torch.manual_seed(0)
    return dt.DecisionTransformer(cfg, obs, act, max_ep_len=50).eval()


def random_batch(B=3, K=5, obs=4, act=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(states=torch.randn(B, K, obs, generator=g), actions=torch.rand(B, K, act, generator=g) * 2 - 1,
                rtg=torch.randn(B, K, 1, generator=g), timesteps=torch.arange(K).repeat(B, 1) + 3,
                mask=torch.ones(B, K))


def predict(model, b):
    return model(b["states"], b["actions"], b["rtg"], b["timesteps"], b["mask"])


def test_causal_future_does_not_change_the_past():
    model, b = tiny_model(), random_batch()
    base = predict(model, b)
    for t in range(5):
        p = {k: v.clone() for k, v in b.items()}
        p["states"][:, t + 1:] += 5.0
        p["rtg"][:, t + 1:] -= 3.0
        p["actions"][:, t:] = -p["actions"][:, t:]       # a_t itself must not influence the prediction of a_t
        p["timesteps"][:, t + 1:] += 7
        out = predict(model, p)
        assert torch.allclose(out[:, :t + 1], base[:, :t + 1], atol=1e-6)
        if t < 4:
            assert not torch.allclose(out[:, t + 1:], base[:, t + 1:], atol=1e-4)  # ...and the future does move


def test_left_padding_is_ignored():
    model, b = tiny_model(), random_batch()
    b["mask"][:, :2] = 0
    base = predict(model, b)
    p = {k: v.clone() for k, v in b.items()}
    p["states"][:, :2] = 100.0
    p["rtg"][:, :2] = -50.0
    p["timesteps"][:, :2] = 40
    assert torch.allclose(predict(model, p)[:, 2:], base[:, 2:], atol=1e-6)
    assert torch.isfinite(base).all()


@pytest.mark.slow
def test_overfits_one_batch():
    model, b = tiny_model(), random_batch(B=4, seed=1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = dt.loss_fn(model, b, dt.Config())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 2e-3, loss.item()


def test_paper_size_parameter_count():
    cfg = dt.DTConfig()
    n = sum(p.numel() for p in dt.DecisionTransformer(cfg, 11, 3, 1000).parameters())
    # kzl's gym DT on hopper has 727,695; we drop its vocab-1 wte (128) and the unused state (128*11+11) and
    # return (128+1) heads: 727,695 - 128 - 1,419 - 129 = 726,019
    assert n == 726_019


def test_lr_schedule_by_hand():
    cfg = dt.Config(warmup_steps=10, steps=110)
    assert [dt.lr_factor(s, cfg) for s in (0, 4, 9, 50, 109)] == [0.1, 0.5, 1.0, 1.0, 1.0]   # kzl: warmup, constant
    cfg = dt.Config(warmup_steps=10, steps=110, lr_decay=True)
    assert dt.lr_factor(9, cfg) == 1.0 and dt.lr_factor(10, cfg) == 1.0
    assert abs(dt.lr_factor(60, cfg) - 0.55) < 1e-12 and abs(dt.lr_factor(110, cfg) - 0.1) < 1e-12


def test_preset_then_explicit_flags():
    cfg = dt.parse_flags(["--preset", "cpu", "--n-embd", "48", "--resume"])[0]
    assert cfg.n_embd == 48 and cfg.n_layer == dt.PRESETS["cpu"]["n_layer"] and cfg.resume is True
    assert dt.parse_flags([])[0].n_embd == 128 and dt.parse_flags([])[0].steps == 100_000


def run_cli(args, out):
    dt.main(["--n-embd", "16", "--n-layer", "1", "--context", "4", "--batch-size", "8", "--eval-episodes", "2",
             "--log-every", "5", "--warmup-steps", "5", "--out", str(out), *args])


def final_line(capsys):
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("final:")]
    assert len(lines) == 1
    return lines[0]


@pytest.mark.slow
def test_cli_run_writes_outputs(tiny_hopper, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--steps", "10", "--eval-every", "5"], tmp_path)
    line = final_line(capsys)
    assert line.startswith("final: normalized_score=") and line.endswith("episodes=2")
    for f in ("config.json", "log.csv", "ckpt.pt", "curve.png"):
        assert os.path.getsize(tmp_path / f) > 0
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ck["step"] == 10 and ck["dataset_id"] == tiny_hopper and ck["state_mean"].shape == (11,)
    rows = list(csv.DictReader(open(tmp_path / "log.csv")))
    evals = [r for r in rows if r["target"]]
    assert sorted({float(r["target"]) for r in evals}) == [1800.0, 3600.0] and len(evals) == 4
    assert json.load(open(tmp_path / "config.json"))["steps"] == 10


@pytest.mark.slow
def test_cli_maze_reports_success(tiny_maze, tmp_path, capsys):
    run_cli(["--dataset", tiny_maze, "--steps", "5", "--eval-every", "5"], tmp_path)
    final_line(capsys)
    rows = [r for r in csv.DictReader(open(tmp_path / "log.csv")) if r["target"]]
    assert rows and rows[0]["success_rate"] != "" and float(rows[0]["steps_to_goal"]) <= 40


@pytest.mark.slow
def test_resume_gives_identical_weights(tiny_hopper, tmp_path, capsys):
    common = ["--dataset", tiny_hopper, "--eval-every", "1000", "--eval-episodes", "1", "--seed", "3"]
    run_cli(common + ["--steps", "20"], tmp_path / "straight")
    run_cli(common + ["--steps", "10"], tmp_path / "split")
    run_cli(common + ["--steps", "20", "--resume"], tmp_path / "split")
    a = torch.load(tmp_path / "straight" / "ckpt.pt", weights_only=True)
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    assert a["step"] == b["step"] == 20
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for k in a["optimizer"]["state"]:
        assert torch.equal(a["optimizer"]["state"][k]["exp_avg"], b["optimizer"]["state"][k]["exp_avg"])


@pytest.mark.slow
def test_resume_with_another_model_is_one_sentence(tiny_hopper, tmp_path, capsys):
    run_cli(["--dataset", tiny_hopper, "--steps", "2", "--eval-every", "1000", "--eval-episodes", "1"], tmp_path)
    with pytest.raises(SystemExit) as e:
        run_cli(["--dataset", tiny_hopper, "--steps", "4", "--resume", "--n-embd", "24"], tmp_path)
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "--n-embd 16 there, 24 here" in err and len(err.strip().splitlines()) == 1


def test_bench_eval_without_checkpoint_is_one_sentence(tiny_hopper, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        dt.main(["--dataset", tiny_hopper, "--bench-eval", "--out", str(tmp_path / "none")])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "no checkpoint at" in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------------------
# the paper's behaviour-cloning baselines (Sec. 5.3): BC drops the return token, %BC keeps the best episodes

def test_bc_has_no_return_token_and_ignores_returns():
    dt_model, bc = tiny_model(), tiny_model(return_token=False)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(dt_model) - n(bc) == 32 + 32                    # embed_return: Linear(1, C), weight and bias
    b = random_batch()
    p = {k: v.clone() for k, v in b.items()}
    p["rtg"] += 100.0
    assert torch.equal(predict(bc, b), predict(bc, p))
    assert not torch.allclose(predict(dt_model, b), predict(dt_model, p))
    for t in range(4):                                       # still causal with 2 tokens per step
        q = {k: v.clone() for k, v in b.items()}
        q["states"][:, t + 1:] += 5.0
        q["actions"][:, t:] = -q["actions"][:, t:]
        assert torch.allclose(predict(bc, q)[:, :t + 1], predict(bc, b)[:, :t + 1], atol=1e-6)


@pytest.mark.slow
def test_top_fraction_trains_on_the_best_episodes(tiny_hopper, tmp_path, capsys, monkeypatch):
    import data
    seen = []
    real = data.OfflineData.sample
    monkeypatch.setattr(data.OfflineData, "sample", lambda self, *a: seen.append(self) or real(self, *a))
    run_cli(["--dataset", tiny_hopper, "--steps", "3", "--eval-every", "3", "--top-fraction", "0.3",
             "--no-return-token"], tmp_path)
    full = data.load_data(tiny_hopper)
    kept = seen[-1]
    assert len(kept.episodes) < len(full.episodes)
    assert min(kept.episode_returns) >= max(r for r in full.episode_returns if r not in set(kept.episode_returns))
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert torch.equal(ck["state_mean"], torch.from_numpy(full.state_mean))   # statistics of the whole dataset
    assert "embed_return.weight" not in ck["model"]
    assert json.load(open(tmp_path / "config.json"))["variant"] == "batch-size8_context4_warmup-steps5_n-embd16_n-layer1_no-return-token_top-fraction0.3"


@pytest.mark.parametrize("atari", [False, True])
@pytest.mark.parametrize("return_token", [True, False])
def test_last_block_on_the_state_tokens_equals_the_whole_block(atari, return_token, monkeypatch):
    """The last block computes only the s_t tokens; against the block run on every token and the
    s_t rows taken after: the same actions and the same gradients, left padding included."""
    torch.manual_seed(0)
    cfg = dt.DTConfig(n_embd=16, n_layer=2, n_head=2, context=4, dropout=0.0, return_token=return_token)
    if atari:
        model = dt.AtariDecisionTransformer(cfg, n_actions=4, max_ep_len=50)
        b = dict(states=torch.randint(0, 256, (3, 4, 4, 84, 84), dtype=torch.uint8),
                 actions=torch.randint(0, 4, (3, 4)), rtg=torch.randn(3, 4, 1),
                 timesteps=torch.arange(4).repeat(3, 1), mask=torch.ones(3, 4))
    else:
        model = dt.DecisionTransformer(cfg, 4, 2, max_ep_len=50)
        b = random_batch(B=3, K=4)
    b["mask"][0, :2] = 0

    def out_and_grads():
        model.zero_grad()
        y = model(**b)
        (y.square().sum() if not atari else y.logsumexp(-1).sum()).backward()
        return y.detach(), [p.grad.clone() for p in model.parameters()]

    y, g = out_and_grads()
    whole = dt.Block.forward
    monkeypatch.setattr(dt.Block, "forward", lambda self, x, m, rows=slice(None): whole(self, x, m)[:, rows])
    y_ref, g_ref = out_and_grads()
    assert y.shape == y_ref.shape == (3, 4, 4 if atari else 2)
    assert torch.allclose(y, y_ref, atol=1e-6)
    assert all(torch.allclose(a, r, atol=1e-6, rtol=1e-5) for a, r in zip(g, g_ref))
