"""Incremental detokenization: the text grown token by token is always a prefix of the full decode,
never shows a partial UTF-8 character, and the final text equals the full decode."""
from __future__ import annotations

import os
import random

from hybrid.output_processor import OutputProcessor
from hybrid.request import Sequence
from hybrid.sampling import SamplingParams
from hybrid.tokenizer import Tokenizer

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid", "default_model")


def _texts() -> list[str]:
    rng = random.Random(0)
    noise = "".join(chr(c) for c in (rng.randint(32, 0x1F600) for _ in range(400)) if not 0xD800 <= c <= 0xDFFF)
    return ["And the LORD said unto Moses, Go in unto Pharaoh.\n" * 3,
            "héllo wörld ✓ 🤖 日本語のテキスト\n\ttabs and  double  spaces", noise]


def test_incremental_text_is_a_prefix_of_the_full_decode():
    tok = Tokenizer(DEFAULT_MODEL)
    outputs = OutputProcessor(tok, eos_token_ids=set(), max_model_len=1 << 20, stats={})
    for text in _texts():
        seq = Sequence("r", 0, [1], SamplingParams(max_tokens=8), None, 0)
        for token in tok.encode(text):
            seq.output_token_ids.append(token)
            outputs.update_text(seq)
            full = tok.decode(seq.output_token_ids)
            assert full.startswith(seq.text)
            assert "\ufffd" not in seq.text or "\ufffd" in text
        # only a held-back partial character can be missing at the end, and the text round-trips
        assert tok.decode(seq.output_token_ids) == text
        assert len(text) - len(seq.text) <= 2


def test_finished_text_equals_the_full_decode():
    from hybrid import LLM

    llm = LLM(None, max_num_seqs=2)
    outs = llm.generate(["And the LORD said unto Moses,", "In the beginning"],
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "length" and c.text == llm.tokenizer.decode(c.token_ids)
