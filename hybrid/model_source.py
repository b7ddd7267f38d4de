"""Where a checkpoint comes from: a local directory, or a Hugging Face repo id already in the local
Hugging Face cache. Nothing is ever downloaded at run time.

    resolve_model(None).path                                   -> the bundled default model
    resolve_model("/path/to/checkpoint").path                  -> that directory
    resolve_model("ibm-granite/granite-4.0-h-tiny").path       -> its cached snapshot (revision "main")
    resolve_model("ibm-granite/granite-4.0-h-tiny@<rev>").path -> the snapshot of that branch, tag or commit

The cache is the one `hf download` / `huggingface-cli download` fills: HF_HUB_CACHE, else
HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub, read from the environment at call time (huggingface_hub reads its own
constants once, at import).
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

from hybrid.errors import CheckpointError

DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")

# A hub repo id: "name" or "owner/name" of [A-Za-z0-9_.-], at most 96 characters, not starting or
# ending with '-' or '.', no '--' or '..' (huggingface_hub's validate_repo_id), and an optional
# "@revision" (a branch, a tag or a commit hash; branches may hold '/').
_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_REPO_RE = re.compile(rf"^(?P<repo>(?:{_NAME}/)?{_NAME})(?:@(?P<rev>[^@\s]+))?$")


def hf_cache_dir() -> str:
    """The Hugging Face hub cache directory, from the environment as it is now."""
    env = os.environ
    path = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not path:
        home = env.get("HF_HOME") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
        path = os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(path))


def parse_repo_id(model: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) if `model` is spelled like a hub repo id ("owner/name[@rev]"),
    else None (a path: absolute, relative with ./ or ../, or with more than one '/')."""
    m = _REPO_RE.match(model)
    if m is None:
        return None
    repo = m.group("repo")
    if len(repo) > 96 or "--" in repo or ".." in repo or repo in (".", ".."):
        return None
    return repo, m.group("rev")


def download_hint(repo_id: str, revision: str | None = None) -> str:
    rev = f" --revision {revision}" if revision else ""
    return f"`hf download {repo_id}{rev}` (or `huggingface-cli download {repo_id}{rev}`)"


def cached_snapshot(repo_id: str, revision: str | None = None, cache_dir: str | None = None) -> str | None:
    """The directory of the cached snapshot of `repo_id` at `revision` (default "main"), or None
    when the cache does not have it. Local look-up only (huggingface_hub, local_files_only=True)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import HFValidationError, LocalEntryNotFoundError  # (also in .errors since 0.24)

    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache_dir or hf_cache_dir(),
                                 local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError):  # IncompleteSnapshotError is a LocalEntryNotFoundError
        return None


class ResolvedModel(NamedTuple):
    path: str  # the checkpoint directory
    repo_id: str | None = None  # the hub repo it is a cached snapshot of, if it was named so
    revision: str | None = None  # the revision asked for (None: "main")


def resolve_model(model: str | os.PathLike | None) -> ResolvedModel:
    """The checkpoint directory for `model`: None -> the bundled default model; an existing
    directory -> itself; otherwise a hub repo id ("owner/name" or "owner/name@revision") -> its
    snapshot in the local Hugging Face cache. CheckpointError, naming the repo and how to fetch
    it, when it is neither. Anything else is returned as given (load_config then says the
    directory is missing)."""
    if model is None:
        return ResolvedModel(DEFAULT_MODEL_DIR)
    model = os.fspath(model)
    if os.path.isdir(model):
        return ResolvedModel(model)
    parsed = parse_repo_id(model)
    if parsed is None:
        return ResolvedModel(model)
    repo_id, revision = parsed
    cache = hf_cache_dir()
    try:
        path = cached_snapshot(repo_id, revision, cache)
    except ImportError:  # huggingface_hub is a dependency; without it, say so rather than crash
        raise CheckpointError(
            f"checkpoint directory not found: {model}; to load the Hugging Face repo {repo_id!r} from "
            "the local cache, install huggingface_hub (pip install huggingface_hub)") from None
    at = f" at revision {revision!r}" if revision else ""
    if path is None:
        raise CheckpointError(
            f"checkpoint directory not found: {model}; nor is the Hugging Face repo {repo_id!r}{at} in the local "
            f"cache ({cache}: set HF_HUB_CACHE or HF_HOME to use another). Nothing is downloaded at run time: "
            f"fetch it first with {download_hint(repo_id, revision)}, or pass the checkpoint directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(
            f"the cached snapshot of the Hugging Face repo {repo_id!r}{at} ({path}) has no config.json: it is "
            f"incomplete; fetch the whole repo with {download_hint(repo_id, revision)}")
    return ResolvedModel(path, repo_id, revision)
