"""A real client nobody here wrote (issue 14): lm-evaluation-harness against `hybrid serve`.

lm-eval's `local-completions` model (loglikelihood: token-id prompts with echo + logprobs and
max_tokens 1, the prompt's logprobs summed over the continuation; generate_until: token-id prompts
with stop) and `local-chat-completions` (generate_until, the server's chat template) run the two
local tasks in tests/data/lm_eval_tasks/ (10 multiple-choice items, 5 greedy generations) against
the server, and lm-eval's own `hf` model (transformers, fp32 on CPU) runs them on the same
checkpoint. Both backends must give the same metrics (exact), the same per-document
loglikelihoods (1e-4 abs), the same is-greedy flags and the same generated texts (exact); with
the bundled model and with a tiny random checkpoint. No download: the datasets are local json.
"""
from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm-eval's hf model imports it
pytest.importorskip("lm_eval")

from server_utils import ServerThread, shared_tiny_chat_checkpoint  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS_DIR = os.path.join(REPO, "tests", "data", "lm_eval_tasks")
LL_ABS_TOL = 1e-4
MAX_LEN = 256


def _metrics(results: dict) -> dict:
    return {task: {k: v for k, v in r.items() if "," in k and "stderr" not in k}
            for task, r in results["results"].items()}


def _samples(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


@pytest.mark.parametrize("which", ["bundled", "tiny_chat"])
def test_lm_eval_served_equals_hf(which, tmp_path_factory, monkeypatch):
    import torch

    # datasets' cache (the json files become arrow tables) stays out of the home directory;
    # offline: nothing may be fetched
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(REPO)  # the task YAMLs name their data files relative to the repo root
    import lm_eval
    import lm_eval.tasks

    from hybrid import LLM
    from hybrid.model_source import DEFAULT_MODEL_DIR
    from hybrid.server import build_app

    torch.set_num_threads(2)
    if which == "bundled":
        path = DEFAULT_MODEL_DIR
        llm = LLM(None, device="cpu", max_num_seqs=4, max_model_len=MAX_LEN)  # what `hybrid serve` loads
    else:
        path = str(shared_tiny_chat_checkpoint(tmp_path_factory))
        llm = LLM(path, device="cpu", max_num_seqs=4, max_model_len=MAX_LEN)
    tm = lm_eval.tasks.TaskManager(include_path=TASKS_DIR)
    run = dict(task_manager=tm, log_samples=True, random_seed=0, numpy_random_seed=0, torch_random_seed=0)

    with ServerThread(build_app(llm)) as srv:
        name = httpx.get(srv.base_url + "/v1/models").json()["data"][0]["id"]
        # completions: the client tokenizes with the checkpoint's tokenizer and sends token ids
        # (tokenized_requests=True, its default); chat: it sends the messages, the server renders
        # them with the checkpoint's template; 4 requests in flight (batched by the engine);
        # max_length as the hf run's
        common = (f"model={name},tokenizer_backend=huggingface,tokenizer={path},"
                  f"num_concurrent=4,max_retries=1,max_length={MAX_LEN}")
        completions = f"base_url={srv.base_url}/v1/completions,{common},tokenized_requests=True"
        chat_completions = f"base_url={srv.base_url}/v1/chat/completions,{common},tokenized_requests=False"
        api = lm_eval.simple_evaluate(model="local-completions", model_args=completions,
                                      tasks=["hybrid_mc", "hybrid_gen"], **run)
        chat = lm_eval.simple_evaluate(model="local-chat-completions", model_args=chat_completions,
                                       tasks=["hybrid_gen"], apply_chat_template=True, **run)
    hf_args = f"pretrained={path},device=cpu,dtype=float32,max_length={MAX_LEN},batch_size=1"
    hf = lm_eval.simple_evaluate(model="hf", model_args=hf_args, tasks=["hybrid_mc", "hybrid_gen"], **run)
    hf_chat = lm_eval.simple_evaluate(model="hf", model_args=hf_args, tasks=["hybrid_gen"],
                                      apply_chat_template=True, **run)

    # metrics: exact (acc / acc_norm are means over 10 documents, exact_match over 5)
    assert _metrics(api) == _metrics(hf), (_metrics(api), _metrics(hf))
    assert _metrics(chat) == _metrics(hf_chat)
    assert _metrics(api)["hybrid_mc"]["acc,none"] is not None

    # per-document loglikelihoods of every choice, and the is-greedy flags
    mc_api, mc_hf = _samples(api, "hybrid_mc"), _samples(hf, "hybrid_mc")
    assert len(mc_api) == len(mc_hf) == 10
    worst = 0.0
    for a, b in zip(mc_api, mc_hf):
        assert a["doc_id"] == b["doc_id"] and a["arguments"] == b["arguments"]
        assert len(a["resps"]) == len(b["resps"]) == 4
        for (ll_a, greedy_a), (ll_b, greedy_b) in ((ra[0], rb[0]) for ra, rb in zip(a["resps"], b["resps"])):
            assert abs(ll_a - ll_b) <= LL_ABS_TOL, (a["doc_id"], ll_a, ll_b)
            assert greedy_a == greedy_b, (a["doc_id"], ll_a, ll_b)
            worst = max(worst, abs(ll_a - ll_b))
        assert (a["acc"], a["acc_norm"]) == (b["acc"], b["acc_norm"])
    print(f"{which}: max |loglikelihood(served) - loglikelihood(hf)| = {worst:.2e}")

    # greedy generations: the same text, plain and through the chat template
    for served, ref in ((api, hf), (chat, hf_chat)):
        gen_s, gen_r = _samples(served, "hybrid_gen"), _samples(ref, "hybrid_gen")
        assert len(gen_s) == len(gen_r) == 5
        for a, b in zip(gen_s, gen_r):
            assert a["doc_id"] == b["doc_id"]
            assert a["resps"] == b["resps"] and a["resps"][0][0], (a["doc_id"], a["resps"], b["resps"])
