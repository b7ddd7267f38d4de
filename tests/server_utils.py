"""Helpers for the HTTP server tests: a tiny checkpoint with a tokenizer and chat template, and a
real uvicorn server on a free loopback port, run in a background thread."""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_tiny_chat_checkpoint(path) -> Path:
    """A tiny random GraniteMoeHybrid (dense) + a character BPE tokenizer + a chat template."""
    from tiny_checkpoints import build_granite_hybrid, write_char_bpe_tokenizer

    vocab = 192
    p = build_granite_hybrid(path, moe=False, vocab_size=vocab, seed=11)
    write_char_bpe_tokenizer(p, vocab)
    cfg_path = p / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return p


# Nemotron 3's way: the generation prompt opens a thought, or with enable_thinking false writes an
# empty one; an earlier reply's thought is rendered from reasoning_content; tool calls and results
THINKING_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}{{ m['content'] }}"
    "{% for tc in m.tool_calls or [] %}<call {{ tc.function.name }} {{ tc.function.arguments | tojson }}>{% endfor %}"
    "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>\n{% endif %}"
    "{% endif %}"
)


def build_thinking_checkpoint(path) -> Path:
    """A tiny random model whose tokenizer has <think> (id 192) and </think> (id 193) as special
    tokens, with THINKING_TEMPLATE."""
    from tokenizers import Tokenizer

    from tiny_checkpoints import build_granite_hybrid, write_char_bpe_tokenizer

    p = build_granite_hybrid(path, moe=False, vocab_size=194, seed=5)
    write_char_bpe_tokenizer(p, 192)
    tok = Tokenizer.from_file(str(p / "tokenizer.json"))
    tok.add_special_tokens(["<think>", "</think>"])
    tok.save(str(p / "tokenizer.json"))
    assert tok.token_to_id("<think>") == 192 and tok.token_to_id("</think>") == 193
    cfg = json.loads((p / "tokenizer_config.json").read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    (p / "tokenizer_config.json").write_text(json.dumps(cfg))
    return p


def thinking_server(ckpt) -> "ServerThread":
    """A server for build_thinking_checkpoint's model on CPU: the nemotron_v3 reasoning parser and
    the hermes tool-call parser (use as a context manager)."""
    import torch

    from hybrid import LLM
    from hybrid.server import build_app

    torch.set_num_threads(1)
    llm = LLM(str(ckpt), device="cpu", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=128)
    return ServerThread(build_app(llm, reasoning_parser="nemotron_v3", enable_auto_tool_choice=True,
                                  tool_call_parser="hermes"))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


def wait_until(pred, timeout: float = 10.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


_CKPT_CACHE: dict[str, Path] = {}


def shared_tiny_chat_checkpoint(tmp_path_factory) -> Path:
    """build_tiny_chat_checkpoint once per test session, for the server test modules that share it."""
    if "ckpt" not in _CKPT_CACHE:
        _CKPT_CACHE["ckpt"] = build_tiny_chat_checkpoint(tmp_path_factory.mktemp("shared_server_ckpt") / "tiny-chat")
    return _CKPT_CACHE["ckpt"]


def metric(base_url: str, name: str, **headers) -> float:
    """One sample of the server's /metrics (0.0 if absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", headers=headers).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    return 0.0
