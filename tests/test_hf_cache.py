"""A model named by its Hugging Face repo id (issue 14 item 3): resolved in the local HF cache
(HF_HUB_CACHE / HF_HOME, read at call time), never downloaded; a clear error naming the repo and
the download command when it is not there. The cache here is a fake one in the real layout:
models--owner--name/{blobs/<sha>, snapshots/<commit>/<file> -> ../../blobs/<sha>, refs/main}."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from hybrid import LLM, CheckpointError, SamplingParams
from hybrid.model_source import DEFAULT_MODEL_DIR, hf_cache_dir, parse_repo_id, resolve_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "test-owner/tiny-bible"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_snapshot(cache, repo: str, commit: str, src_dir: str, refs=("main",), skip=()) -> str:
    """Put the files of `src_dir` into `cache` as `hf download` lays them out; returns the snapshot dir."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snap = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        if name in skip:
            continue
        data = open(os.path.join(src_dir, name), "rb").read()
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob.name), snap / name)
    (storage / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (storage / "refs" / ref).write_text(commit)
    return str(snap)


@pytest.fixture(scope="module")
def fake_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    snap = add_snapshot(cache, REPO, COMMIT, DEFAULT_MODEL_DIR, refs=("main", "v1"))
    old = add_snapshot(cache, REPO, OLD_COMMIT, DEFAULT_MODEL_DIR, refs=())
    partial = add_snapshot(cache, "test-owner/partial", COMMIT, DEFAULT_MODEL_DIR, skip=("config.json",))
    return cache, snap, old, partial


@pytest.fixture
def hub_env(monkeypatch, fake_cache):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(fake_cache[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing may reach the network
    return fake_cache


def test_parse_repo_id():
    assert parse_repo_id("ibm-granite/granite-4.0-h-tiny") == ("ibm-granite/granite-4.0-h-tiny", None)
    assert parse_repo_id("ibm-granite/granite-4.0-h-tiny@main") == ("ibm-granite/granite-4.0-h-tiny", "main")
    assert parse_repo_id(f"a/b@{COMMIT}") == ("a/b", COMMIT)
    assert parse_repo_id("a/b@refs/pr/1") == ("a/b", "refs/pr/1")
    assert parse_repo_id("gpt2") == ("gpt2", None)
    for path in ("/abs/path", "./rel", "../up", "a/b/c", "a//b", "a/b@", "a--b/c", "a/b..c", ".", "-a/b",
                 "a/b.", "x" * 97, "with space/x"):
        assert parse_repo_id(path) is None, path


def test_cache_dir_from_the_environment_now(monkeypatch, tmp_path):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_cache_dir() == os.path.join(str(tmp_path), ".cache", "huggingface", "hub")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_cache_dir() == os.path.join(str(tmp_path / "xdg"), "huggingface", "hub")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == os.path.join(str(tmp_path / "home"), "hub")
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(tmp_path / "legacy"))
    assert hf_cache_dir() == str(tmp_path / "legacy")
    monkeypatch.setenv("HF_HUB_CACHE", "~/hubcache")
    assert hf_cache_dir() == os.path.join(str(tmp_path), "hubcache")


def test_resolves_revisions(hub_env):
    _, snap, old, _ = hub_env
    r = resolve_model(REPO)
    assert (r.path, r.repo_id, r.revision) == (snap, REPO, None)
    assert resolve_model(f"{REPO}@main").path == snap
    assert resolve_model(f"{REPO}@v1").path == snap  # a tag in refs/
    assert resolve_model(f"{REPO}@{OLD_COMMIT}").path == old  # a commit hash, in snapshots/
    assert os.path.isfile(os.path.join(snap, "model.safetensors"))


def test_hf_home_is_used_without_hf_hub_cache(monkeypatch, fake_cache):
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(fake_cache[0].parent))  # .../hub is the cache
    assert resolve_model(REPO).path == fake_cache[1]


def test_local_directories_win(hub_env, tmp_path, monkeypatch):
    assert resolve_model(None).path == DEFAULT_MODEL_DIR
    assert resolve_model(DEFAULT_MODEL_DIR) == (DEFAULT_MODEL_DIR, None, None)
    # a relative directory spelled like a repo id is the directory
    (tmp_path / REPO).mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model(REPO).path == REPO
    # a path that is not a repo id is returned as given: load_config says it is missing
    assert resolve_model("/no/such/dir").path == "/no/such/dir"


def test_missing_repo_names_it_and_how_to_fetch_it(hub_env):
    with pytest.raises(CheckpointError) as e:
        resolve_model("ibm-granite/granite-4.0-h-tiny")
    msg = str(e.value)
    assert "'ibm-granite/granite-4.0-h-tiny'" in msg and str(hub_env[0]) in msg
    assert "hf download ibm-granite/granite-4.0-h-tiny" in msg and "huggingface-cli download" in msg
    assert "Nothing is downloaded" in msg
    with pytest.raises(CheckpointError, match=r"revision 'v9'.*hf download test-owner/tiny-bible --revision v9"):
        resolve_model(f"{REPO}@v9")


def test_incomplete_snapshot(hub_env):
    with pytest.raises(CheckpointError, match=r"test-owner/partial.*no config.json.*incomplete.*hf download"):
        resolve_model("test-owner/partial")


def test_llm_from_a_repo_id(hub_env):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    llm = LLM(REPO, device="cpu")
    assert llm.model_dir == hub_env[1] and llm.hf_repo_id == REPO
    [got] = llm.generate("In the beginning", params, use_tqdm=False)
    [want] = LLM(None, device="cpu").generate("In the beginning", params, use_tqdm=False)
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert llm.tokenizer.chat_template  # tokenizer_config.json came through the symlinks too


def test_llm_missing_repo(hub_env):
    with pytest.raises(CheckpointError, match="hf download nobody/nothing"):
        LLM("nobody/nothing", device="cpu")


def _cli(args, cache) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HOME", "HUGGINGFACE_HUB_CACHE")}
    env.update(PYTHONPATH=ROOT, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "hybrid", "generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def test_cli_generate_with_a_repo_id(fake_cache, tmp_path):
    proc = _cli(["--model", REPO, "--prompt", "Blessed", "--max-tokens", "4", "--device", "cpu"], fake_cache[0])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Blessed")
    proc = _cli(["--model", "nobody/nothing", "--prompt", "Blessed", "--device", "cpu"], fake_cache[0])
    assert proc.returncode == 2 and "hf download nobody/nothing" in proc.stderr, proc.stderr


def test_download_dir_is_a_cache_to_look_in(fake_cache, monkeypatch, tmp_path):
    """vLLM's download_dir (LLM keyword, CLI flag): a hub cache where a repo id's snapshot is found before the
    default cache is asked (which here is empty)."""
    from hybrid.cli import build_parser, engine_kwargs, normalize_flag_names

    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache, snap = fake_cache[0], fake_cache[1]
    llm = LLM(REPO, device="cpu", download_dir=str(cache))
    assert llm.model_dir == snap
    with pytest.raises(CheckpointError, match="hf download"):  # not there: the default cache's error
        LLM(REPO, device="cpu", download_dir=str(tmp_path / "elsewhere"))
    args = build_parser().parse_args(normalize_flag_names(["generate", "--prompt", "x", "--model", REPO,
                                                           "--download-dir", str(cache)]))
    assert engine_kwargs(args)["model"] == snap
