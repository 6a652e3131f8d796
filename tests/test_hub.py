"""The card's first networked run, proven offline: `python gpt2_dtma.py --env hopper-medium` (and dt.py, --init
clip) from empty caches through the real huggingface_hub and Minari clients, against a local Hub on 127.0.0.1 that
serves a tiny Hopper dataset in Minari's mujoco/hopper layout and tiny GPT-2 and CLIP checkpoints; then the failures
on the way (refused, 404, 500, a body cut half-way, Ctrl-C), each one sentence, nothing left that the next run trips
on, and the next run finishing the job.

LocalHub answers what the clients were seen to request (its `requests` log; the tests assert them):
    GET  /api/datasets?author=A&search=S                 Minari's list_datasets: [{"id": "A/repo"}]
    GET  /api/{models,datasets}/R/revision/main           repo_info: {"id", "sha", "siblings"}
    GET  /api/{models,datasets}/R/tree/SHA?recursive=true snapshot_download's listing: [{"type", "path", "size"}]
    HEAD /[datasets/]R/resolve/REV/PATH                  hf_hub_download's metadata: X-Repo-Commit, ETag, size
    GET  /[datasets/]R/resolve/REV/PATH                  the body (from an offset with Range)
404s carry X-Error-Code (RepoNotFound, EntryNotFound), as the Hub's do.
"""
import hashlib
import http.server
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "4c2e1d0a9b8f7e6d5c4b3a29180f7e6d5c4b3a29"
DATASET = "mujoco/hopper/medium-v0"


class LocalHub:
    """The Hub's HTTP protocol, the part huggingface_hub 2.x uses to download, for `repos`:
    {(kind, repo_id): {path: bytes}}, kind 'models' or 'datasets'. fault(pattern, what) makes the
    requests whose path matches answer `what`: an HTTP status (404, 500), 'cut' (half the body, then
    the connection closed) or a callable (called after half the body is sent; the body then stalls)."""

    def __init__(self, repos):
        self.repos, self.requests, self.faults = repos, [], []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub._answer(self, head=True)

            def do_GET(self):
                hub._answer(self, head=False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self):
        if getattr(self, "thread", None) is None:
            if self.server.socket.fileno() < 0:   # stopped: a new socket on the same port
                self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port),
                                                              self.server.RequestHandlerClass)
                self.server.daemon_threads = True
            self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
            self.thread.start()

    def stop(self):
        if getattr(self, "thread", None) is not None:
            self.server.shutdown()
            self.server.server_close()
            self.thread.join()
            self.thread = None

    def fault(self, pattern, what):
        self.faults.append((re.compile(pattern), what))

    def _answer(self, h, head):
        self.requests.append(f"{h.command} {h.path}")
        url = urllib.parse.urlparse(h.path)
        path = urllib.parse.unquote(url.path)

        def send(code, body=b"", headers=(), cut=None):
            h.send_response(code)
            for k, v in dict(headers).items():
                h.send_header(k, v)
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if head:
                return
            if cut is None:
                return h.wfile.write(body)
            h.wfile.write(body[:len(body) // 2])
            h.wfile.flush()
            if callable(cut):   # a Ctrl-C half-way: the child is told, the body stalls
                cut()
                time.sleep(2)
            h.close_connection = True

        what = next((w for p, w in self.faults if p.search(path)), None)
        if isinstance(what, int):
            return send(what, b"{}", {"X-Error-Code": "RepoNotFound"} if what == 404 else {})

        # the API: the datasets of an author, a repository's revision and its file tree
        if path == "/api/datasets":
            q = urllib.parse.parse_qs(url.query)
            author, search = q.get("author", [""])[0], q.get("search", [""])[0]
            hits = [{"id": r, "sha": COMMIT, "private": False} for k, r in self.repos
                    if k == "datasets" and r.startswith(author + "/") and search in r.split("/")[1]]
            return send(200, json.dumps(hits).encode(), {"Content-Type": "application/json"})
        if m := re.fullmatch(r"/api/(models|datasets)/(.+?)/(revision|tree)/[^/]+(/.*)?", path):
            files = self.repos.get((m[1], m[2]))
            if files is None:
                return send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            body = ({"id": m[2], "sha": COMMIT, "siblings": [{"rfilename": p} for p in files]}
                    if m[3] == "revision" else
                    [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                     for p, b in files.items()])
            return send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

        # a file: its metadata (HEAD) and body (GET), from a byte offset with Range
        if m := re.fullmatch(r"/(datasets/)?(.+?)/resolve/[^/]+/(.+)", path):
            files = self.repos.get(("datasets" if m[1] else "models", m[2]))
            if files is None:
                return send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            if (body := files.get(m[3])) is None:
                return send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha1(body).hexdigest()}"',
                       "Accept-Ranges": "bytes"}
            start = re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range", "") or "")
            if start and not head:
                n = int(start[1])
                headers["Content-Range"] = f"bytes {n}-{len(body) - 1}/{len(body)}"
                return send(206, body[n:], headers, cut=what)
            return send(200, body, headers, cut=None if head else what)
        return send(404, b"{}")


# ---- the repositories' files ----------------------------------------------------------------------------------

def hopper_dataset_files(tmp):
    """A tiny mujoco/hopper/medium-v0 (6 random-policy Hopper-v5 episodes), written by Minari's own writer, as
    {path in farama-minari/mujoco: bytes}, with the namespace metadata Minari's remote reads."""
    import gymnasium as gym
    import minari
    from conftest import rollout
    from minari.data_collector import EpisodeBuffer

    env = gym.make("Hopper-v5")
    buffers = [EpisodeBuffer(id=i, observations=e["observations"], actions=e["actions"].astype(np.float32),
                             rewards=list(map(float, e["rewards"])), terminations=list(map(bool, e["terminations"])),
                             truncations=list(map(bool, e["truncations"])), infos={})
               for i, e in enumerate(rollout(env, 6, 60, seed=3))]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINARI_DATASETS_PATH", str(tmp))
        minari.create_dataset_from_buffers(DATASET, buffers, env=env, algorithm_name="test", author="tests",
                                           author_email="tests@example.org", description="a local Hub's")
    files = {}
    for folder, _, names in os.walk(tmp / DATASET):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, tmp / "mujoco")] = open(path, "rb").read()
    files["namespace_metadata.json"] = json.dumps({"datasets": [DATASET],
                                                   "namespaces": ["mujoco/hopper"]}).encode()
    files["hopper/namespace_metadata.json"] = json.dumps({"display_name": "Hopper"}).encode()
    return files


def checkpoint_files(tmp, clip=False):
    """A tiny GPT-2 (or CLIP) saved by transformers: {config.json, model.safetensors: bytes}."""
    import torch
    import transformers
    torch.manual_seed(0)
    if clip:   # the whole CLIPModel, as openai/clip-vit-base-patch32 holds it (text_config inside its config.json)
        text = dict(vocab_size=99, hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=77)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=32,
                      patch_size=16)
        model = transformers.CLIPModel(transformers.CLIPConfig(text_config=text, vision_config=vision,
                                                               projection_dim=16))
    else:
        cfg = transformers.GPT2Config(vocab_size=99, n_positions=64, n_embd=32, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(tmp, safe_serialization=True)
    return {name: open(tmp / name, "rb").read() for name in ("config.json", "model.safetensors")}


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hub_files")
    for sub in ("minari", "gpt2", "clip"):
        (tmp / sub).mkdir()
    return {("datasets", "farama-minari/mujoco"): hopper_dataset_files(tmp / "minari"),
            ("models", "openai-community/gpt2"): checkpoint_files(tmp / "gpt2"),
            ("models", "openai/clip-vit-base-patch32"): checkpoint_files(tmp / "clip", clip=True)}


@pytest.fixture
def hub(repos):
    h = LocalHub({k: dict(v) for k, v in repos.items()})
    yield h
    h.stop()


# ---- the child: empty caches, the Hub at HF_ENDPOINT, huggingface.co unresolvable ------------------------------

NO_HF_CO = """import socket
_getaddrinfo = socket.getaddrinfo
def getaddrinfo(host, *args, **kwargs):  # huggingface.co does not resolve here (a mirror's user)
    if str(host).rstrip(".").endswith("huggingface.co"):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    return _getaddrinfo(host, *args, **kwargs)
socket.getaddrinfo = getaddrinfo

import sys, time
_sleep = time.sleep
def sleep(seconds):  # huggingface_hub's retry backoff shortened (its retries still happen)
    _sleep(min(seconds, 0.05) if sys._getframe(1).f_globals.get("__name__", "").startswith("huggingface_hub")
           else seconds)
time.sleep = sleep
"""


@pytest.fixture
def home(tmp_path, hub):
    """The child's environment: an empty datasets folder and Hugging Face cache, HF_ENDPOINT at the local Hub."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(NO_HF_CO)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "MINARI_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf"), MINARI_DATASETS_PATH=str(tmp_path / "minari"),
               MINARI_REMOTE="hf://farama-minari", PYTHONPATH=str(tmp_path / "site"), OMP_NUM_THREADS="1",
               HF_HUB_DISABLE_TELEMETRY="1", NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        env.pop(k, None)
    return dict(env=env, root=tmp_path, runs=0)


SHORT = ["--steps", "2", "--eval-every", "2", "--eval-episodes", "1", "--batch-size", "4", "--context", "5",
         "--warmup-steps", "1", "--log-every", "1", "--device", "cpu"]


def run(home, script, *args, interrupt=None):
    """`python script --env hopper-medium SHORT args` in `home`, its own run folder -> (rc, stdout, stderr).
    interrupt: (hub, path pattern): Ctrl-C (SIGINT) the child half-way through that file's body."""
    home["runs"] += 1
    out = home["root"] / f"run{home['runs']}"
    cmd = [sys.executable, os.path.join(ROOT, script), "--env", "hopper-medium", *SHORT, "--out", str(out), *args]
    p = subprocess.Popen(cmd, env=home["env"], cwd=home["root"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    if interrupt:
        hub, pattern = interrupt
        hub.fault(pattern, lambda: os.kill(p.pid, signal.SIGINT))
    try:
        stdout, stderr = p.communicate(timeout=240)
    finally:
        p.kill()
    return p.returncode, stdout, stderr


def one_sentence(stderr):
    """The child's last line, where a one-sentence error stands, checked free of tracebacks."""
    assert "Traceback" not in stderr, stderr
    return stderr.strip().splitlines()[-1]


# ---- the card's command end to end --------------------------------------------------------------------------

def leftovers(home):
    """What a failed run may not leave: a download's hidden folder, a dataset folder without its data/, run
    folders (huggingface_hub's own .incomplete blobs may stay: its next download resumes them)."""
    root, minari = home["root"], home["root"] / "minari"
    left = [str(p.relative_to(root)) for p in minari.rglob(".data.py-download-*")]
    left += [str(p.relative_to(root)) for p in minari.glob("*/*/*") if p.is_dir() and not (p / "data").is_dir()]
    return left + [p.name for p in root.glob("run*")]


def downloaded(home):
    """What a later run would find: the dataset's data/ and the cached checkpoints' snapshot files."""
    root = home["root"]
    return sorted(str(p.relative_to(root)) for p in [*(root / "minari").glob("mujoco/hopper/medium-v0/data/*"),
                                                     *(root / "hf").glob("hub/models--*/snapshots/*/*")])


@pytest.mark.slow
def test_card_command_downloads_both_then_runs_from_the_local_copies(hub, home):
    rc, out, err = run(home, "gpt2_dtma.py")
    assert rc == 0, err
    assert f"downloading {DATASET} (once)" in out and "downloading GPT-2 small (openai-community/gpt2) once" in out
    assert "blocks from " in out and "2 of width 32 with 4 heads" in out      # sized by the served config.json
    assert "final: normalized_score=" in out
    # what the clients asked for: Minari's listing and namespaces, the snapshot's tree, both files' bodies
    asked = "\n".join(hub.requests)
    for request in ("GET /api/datasets?author=farama-minari",
                    "GET /datasets/farama-minari/mujoco/resolve/main/namespace_metadata.json",
                    "GET /api/datasets/farama-minari/mujoco/revision/main",
                    "GET /api/datasets/farama-minari/mujoco/tree/",
                    "/hopper/medium-v0/data/main_data.hdf5",
                    "GET /openai-community/gpt2/resolve/main/config.json",
                    "GET /openai-community/gpt2/resolve/main/model.safetensors"):
        assert request in asked, asked
    assert not any("huggingface.co" in r for r in hub.requests)
    files = downloaded(home)
    assert "minari/mujoco/hopper/medium-v0/data/main_data.hdf5" in files and len(files) == 4, files

    # huggingface.co never resolved in the child: the network checks asked the endpoint's host
    probe = subprocess.run([sys.executable, "-c", "import socket; socket.getaddrinfo('huggingface.co', 443)"],
                           env=home["env"], capture_output=True, text=True)
    assert probe.returncode == 1 and "gaierror" in probe.stderr

    # the server gone: both from the local copies, nothing downloaded; dt.py too
    hub.stop()
    for script in ("gpt2_dtma.py", "dt.py"):
        rc, out, err = run(home, script)
        assert rc == 0 and "downloading" not in out and "final: normalized_score=" in out, err
    assert downloaded(home) == files


@pytest.mark.slow
def test_dt_and_clip_from_empty_caches_then_offline(hub, home):
    rc, out, err = run(home, "dt.py")
    assert rc == 0 and f"downloading {DATASET} (once)" in out and "final: normalized_score=" in out, err
    rc, out, err = run(home, "gpt2_dtma.py", "--init", "clip")
    assert rc == 0, err
    assert "downloading CLIP ViT-B/32 (openai/clip-vit-base-patch32) once" in out and "downloading mujoco" not in out
    assert "2 of width 32 with 4 heads (quick_gelu)" in out and "final: normalized_score=" in out
    hub.stop()
    rc, out, err = run(home, "gpt2_dtma.py", "--init", "clip")
    assert rc == 0 and "downloading" not in out and "final: normalized_score=" in out, err


# ---- failures on the way: one sentence, exit 1 (Ctrl-C 130), nothing left, the next run finishes --------------

def fails(home, script, *args, code=1, interrupt=None):
    """A failing run: its one sentence (or Ctrl-C's line), checked, and nothing half-written left."""
    rc, out, err = run(home, script, *args, interrupt=interrupt)
    line = one_sentence(err)
    assert rc == code and line.startswith("error: " if code == 1 else "interrupted"), (rc, err)
    assert leftovers(home) == [], leftovers(home)
    return line


def broken_bodies(hub, home, pattern, script):
    """The file `pattern` answered with 500, then cut half-way at every try, then Ctrl-C'd half-way: each run fails."""
    for fault, why in ((500, f"({hub.url} answered HTTP 500)"),
                       ("cut", f"(the connection to {hub.url} broke off in a file)")):
        hub.faults = [(re.compile(pattern), fault)]
        assert why in fails(home, script)
    hub.faults = []
    fails(home, script, code=130, interrupt=(hub, pattern))
    hub.faults = []


@pytest.mark.slow
def test_download_failures_leave_nothing_and_the_next_run_finishes(hub, home):
    # the dataset: refused, an id the remote does not hold, then broken bodies
    hub.stop()
    line = fails(home, "dt.py")
    assert f"dataset '{DATASET}' is not in" in line and f"({hub.url} cannot be reached)" in line
    hub.start()
    line = fails(home, "dt.py", "--dataset", "mujoco/hopper/expert-v0")
    assert "'mujoco/hopper/expert-v0' is not in" in line, line
    assert f"not on Minari's remote (hf://farama-minari at {hub.url})" in line
    broken_bodies(hub, home, "main_data", "dt.py")
    assert not (home["root"] / "minari" / DATASET / "data").exists()

    # the weights (the dataset downloaded on the way: the failures above left nothing in its way): a model id the
    # Hub does not hold, refused, then broken bodies
    clip = hub.repos.pop(("models", "openai/clip-vit-base-patch32"))
    line = fails(home, "gpt2_dtma.py", "--init", "clip")
    assert f"({hub.url} does not hold openai/clip-vit-base-patch32)" in line, line
    assert (home["root"] / "minari" / DATASET / "data" / "main_data.hdf5").exists()
    hub.repos[("models", "openai/clip-vit-base-patch32")] = clip
    hub.stop()
    assert f"({hub.url} cannot be reached)" in fails(home, "gpt2_dtma.py")
    hub.start()
    broken_bodies(hub, home, "model.safetensors", "gpt2_dtma.py")

    # the server back: the next run finishes the job
    rc, out, err = run(home, "gpt2_dtma.py")
    assert rc == 0 and "downloading GPT-2 small" in out and "final: normalized_score=" in out, err


# ---- in-process (the quick tier): the network check asks the endpoint's host --------------------------------

def test_the_network_check_asks_the_mirror_not_huggingface_co(tmp_path, monkeypatch):
    import huggingface_hub.constants

    import data
    asked = []

    def getaddrinfo(host, *args, **kwargs):   # no network at all: the check fails at once, and says which host
        asked.append(host)
        raise data.socket.gaierror(-2, "Name or service not known")
    monkeypatch.setattr(data.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "https://hub-mirror.example.org")
    monkeypatch.setenv("MINARI_REMOTE", "hf://farama-minari")
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path))
    monkeypatch.setattr("minari.download_dataset", lambda *a, **kw: pytest.fail("went on to the download"))
    with pytest.raises(data.DataError) as e:
        data.load_data("hopper-medium")
    assert asked == ["hub-mirror.example.org"]
    assert "could not be downloaded (no network); with a network run `minari download mujoco/hopper/medium-v0`" in str(e.value)
    assert os.listdir(tmp_path) == []                                      # the hidden download folder is gone
