"""vLLM's compilation_config["cudagraph_mode"]: which CUDA graphs a step may replay (whole-step graphs of decode and
verify steps, piecewise graphs of the others, both, none), from LLM's keyword, the CLI's -O / --compilation-config
(with_compilation_config), down to the runner."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from graphs.runner import ModelRunner
from hybrid.cli import build_parser
from hybrid.engine_config import cudagraph_mode_of, engine_config, with_compilation_config
from hybrid.errors import ConfigurationError
from hybrid.llm import LLM


def _config(compilation_config):
    return with_compilation_config(engine_config(device="cpu"), compilation_config)


@pytest.mark.parametrize("given, mode, full, piecewise", [
    (None, "FULL_AND_PIECEWISE", True, True),
    ({"level": 3}, "FULL_AND_PIECEWISE", True, True),
    ({"cudagraph_mode": "FULL_AND_PIECEWISE"}, "FULL_AND_PIECEWISE", True, True),
    ({"cudagraph_mode": "full_decode_only"}, "FULL_DECODE_ONLY", True, False),
    ({"cudagraph_mode": "PIECEWISE"}, "PIECEWISE", False, True),
    ({"cudagraph_mode": "FULL"}, "FULL_AND_PIECEWISE", True, True),  # mixed steps: piecewise (see cudagraph_mode_of)
])
def test_modes_map_to_the_graphs_a_step_may_replay(given, mode, full, piecewise):
    config = _config(given)
    assert config.cudagraph_mode == mode and not config.enforce_eager
    assert config.full_cuda_graphs is full and config.piecewise_cuda_graphs is piecewise


def test_mode_none_runs_eagerly():
    config = _config({"cudagraph_mode": "NONE"})
    assert config.enforce_eager and not config.full_cuda_graphs and not config.piecewise_cuda_graphs


def test_full_is_logged_as_what_runs(caplog):
    with caplog.at_level(logging.INFO, logger="hybrid"):
        assert cudagraph_mode_of({"cudagraph_mode": "full"}) == "FULL_AND_PIECEWISE"
    assert "FULL_AND_PIECEWISE" in caplog.text


@pytest.mark.parametrize("bad", ["FULLY", 2, ""])
def test_an_unknown_mode_is_refused_by_name(bad):
    with pytest.raises(ConfigurationError, match="cudagraph_mode must be one of .*PIECEWISE"):
        _config({"cudagraph_mode": bad})


def test_the_cli_builds_its_engine_with_the_mode(monkeypatch):
    import hybrid.llm
    from hybrid.cli import build_llm

    built = []
    monkeypatch.setattr(hybrid.llm.LLM, "from_engine_config", classmethod(lambda cls, config, **kw: built.append(config)))
    args = build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu", "--compilation-config",
                                      '{"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]}'])
    build_llm(args)
    assert built[0].cudagraph_mode == "PIECEWISE" and built[0].cuda_graph_sizes == (1, 2)
    with pytest.raises(ConfigurationError, match="cudagraph_mode"):
        build_llm(build_parser().parse_args(["generate", "--prompt", "x", "--device", "cpu",
                                             "-O", '{"cudagraph_mode": "sometimes"}']))


@pytest.mark.parametrize("mode, expected", [("FULL_AND_PIECEWISE", 512), ("PIECEWISE", 512),
                                            ("FULL_DECODE_ONLY", 0)])
def test_piecewise_bucket_limit_follows_the_mode(mode, expected, monkeypatch):
    monkeypatch.delenv("HYBRID_PIECEWISE_MAX_TOKENS", raising=False)
    config = _config({"cudagraph_mode": mode})
    on_cuda = SimpleNamespace(device=torch.device("cuda"), parallel=None)
    assert LLM._piecewise_max_tokens(on_cuda, config, 8192) == expected
    assert LLM._piecewise_max_tokens(on_cuda, config, 256) == min(expected, 256)


def test_llm_keyword_reaches_the_runner(tiny_ckpt, make_llm):
    path = tiny_ckpt("nemotron_h")
    ref = make_llm(path).generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids
    llm = make_llm(path, compilation_config={"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 2]})
    assert llm.engine_config.cudagraph_mode == "PIECEWISE" and llm.runner.capture_sizes == []
    assert llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids == ref


def _decode_batch(llm, n):
    from hybrid.batch import StepBatch

    width = llm.engine.max_pages_per_seq
    table = torch.zeros(n, width, dtype=torch.int32)
    table[:, 0] = torch.arange(1, n + 1, dtype=torch.int32)
    slots = list(range(n))
    return StepBatch(
        input_ids=torch.arange(4, 4 + n), positions=torch.full((n,), 2), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.full((n,), 3, dtype=torch.int32), page_table=table, kv_write_loc=table[:, 0].long() * 4 + 2,
        state_slot=torch.tensor(slots), has_initial_state=torch.ones(n, dtype=torch.bool), logits_indices=torch.arange(n),
        num_decodes=n, num_prefills=0, query_lens_cpu=[1] * n, seq_lens_cpu=[3] * n, state_slot_cpu=slots,
        has_initial_state_cpu=[True] * n)


def test_without_whole_step_graphs_decode_steps_go_piecewise(tiny_ckpt, make_llm):
    """PIECEWISE: no decode or verify buckets, so a decode step runs at its token bucket (padded eagerly here, as
    a replay of the pieces would on the device) instead of a decode graph's batch bucket."""
    llm = make_llm(tiny_ckpt("nemotron_h"), page_size=4, max_num_seqs=4)
    kw = dict(enforce_eager=True, max_num_seqs=4, max_model_len=llm.max_model_len, page_size=4,
              piecewise_max_tokens=8, pad_piecewise=True, pad_decode=True, num_speculative_tokens=3)
    batch = _decode_batch(llm, 3)
    both = ModelRunner(llm.model, llm.engine.runner.ctx, **kw)
    assert both.capture_sizes and both.verify_sizes
    both.execute(batch)
    assert both.stats["padded_eager"] == 1 and both.stats["padded_piecewise_eager"] == 0
    pieces = ModelRunner(llm.model, llm.engine.runner.ctx, full_graphs=False, **kw)
    assert pieces.capture_sizes == [] and pieces.verify_sizes == [] and pieces.bucket(batch) is None
    pieces.execute(batch)
    assert pieces.stats["padded_eager"] == 0 and pieces.stats["padded_piecewise_eager"] == 1


def test_max_capture_size_caps_both_kinds_of_graph(monkeypatch):
    """vLLM's max_cudagraph_capture_size (max_capture_size before 0.11): the largest decode graph's batch size and
    the largest piecewise bucket's token count."""
    monkeypatch.delenv("HYBRID_PIECEWISE_MAX_TOKENS", raising=False)
    on_cuda = SimpleNamespace(device=torch.device("cuda"), parallel=None)
    config = _config({"max_cudagraph_capture_size": 24})
    assert config.max_cuda_graph_size == 24
    assert LLM._graph_sizes(config, 256) == (1, 2, 4, 8, 16, 24)
    assert LLM._piecewise_max_tokens(on_cuda, config, 8192) == 24
    assert _config({"max_capture_size": 1024}).max_cuda_graph_size == 1024
    assert LLM._piecewise_max_tokens(on_cuda, _config({"max_capture_size": 1024}), 8192) == 1024
    # with explicit sizes: those up to it; none below it: batch 1 alone
    sized = with_compilation_config(engine_config(device="cpu", cuda_graph_sizes=[4, 32, 64]),
                                    {"max_cudagraph_capture_size": 40})
    assert LLM._graph_sizes(sized, 256) == (4, 32)
    assert LLM._graph_sizes(_config({"max_cudagraph_capture_size": 1}), 8) == (1,)
    # not given: the configured sizes as they were (None: the runner's default)
    assert LLM._graph_sizes(_config(None), 256) is None
    assert LLM._graph_sizes(engine_config(device="cpu", cuda_graph_sizes=[2, 8]), 256) == (2, 8)
    for bad in (0, "512", 2.5, True):
        with pytest.raises(ConfigurationError, match="max_cudagraph_capture_size must be an integer >= 1"):
            _config({"max_cudagraph_capture_size": bad})


@pytest.mark.parametrize("level, mode", [(0, "NONE"), (1, "PIECEWISE"), (2, "FULL_AND_PIECEWISE"),
                                         (3, "FULL_AND_PIECEWISE")])
def test_optimization_levels_imply_a_mode(level, mode):
    config = with_compilation_config(engine_config(device="cpu"), None, level)
    assert config.cudagraph_mode == mode and config.enforce_eager is (mode == "NONE")
    # a cudagraph_mode given takes precedence over the level's
    given = with_compilation_config(engine_config(device="cpu"), {"cudagraph_mode": "FULL_DECODE_ONLY"}, level)
    assert given.cudagraph_mode == "FULL_DECODE_ONLY" and not given.enforce_eager


@pytest.mark.parametrize("bad", [4, -1, "2", True])
def test_a_bad_optimization_level_is_refused(bad):
    with pytest.raises(ConfigurationError, match="optimization_level must be 0, 1, 2 or 3"):
        with_compilation_config(engine_config(device="cpu"), None, bad)


def _cli(*argv):
    from hybrid.cli import normalize_flag_names

    return build_parser().parse_args(normalize_flag_names(["generate", "--prompt", "x", *argv]))


def test_the_cli_takes_vllms_level_and_config_spellings():
    for argv, level in ((["-O3"], 3), (["-O", "1"], 1), (["-O0"], 0), (["--optimization-level", "2"], 2), ([], None)):
        args = _cli(*argv)
        assert args.optimization_level == level and args.compilation_config is None, argv
    assert _cli("-cc", '{"cudagraph_mode": "NONE"}').compilation_config == {"cudagraph_mode": "NONE"}
    assert _cli("-O", '{"cudagraph_mode": "NONE"}').compilation_config == {"cudagraph_mode": "NONE"}
    with pytest.raises(SystemExit):
        _cli("-O7")


def test_the_cli_folds_dotted_json_keys():
    """vLLM's `--json-flag.key value` / `-cc.key=value` (nested keys, JSON values where they parse), merged over
    the flag's whole-JSON form; the prompt and other values are left alone."""
    args = _cli("-cc.cudagraph_mode=PIECEWISE", "--compilation-config.max_cudagraph_capture_size", "64")
    assert args.compilation_config == {"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 64}
    args = _cli("-O.cudagraph_mode", "FULL_DECODE_ONLY", "-O", '{"cudagraph_mode": "NONE", "level": 3}',
                "-cc.pass_config.fuse=true", "-cc.pass_config.sizes=[1,2]")
    assert args.compilation_config == {"cudagraph_mode": "FULL_DECODE_ONLY", "level": 3,
                                       "pass_config": {"fuse": True, "sizes": [1, 2]}}
    args = _cli("--speculative_config.method", "ngram", "--speculative-config.num_speculative_tokens=3")
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    assert args.prompt == ["x"] and args.compilation_config is None
    with pytest.raises(SystemExit, match="needs a value"):
        _cli("-cc.cudagraph_mode")
    with pytest.raises(SystemExit, match="a JSON object is needed"):
        _cli("-cc.cudagraph_mode=NONE", "-cc", "3")


def test_the_cli_builds_its_engine_with_the_level(monkeypatch):
    import hybrid.llm
    from hybrid.cli import build_llm

    built = []
    monkeypatch.setattr(hybrid.llm.LLM, "from_engine_config", classmethod(lambda cls, config, **kw: built.append(config)))
    build_llm(_cli("--device", "cpu", "-O1"))
    build_llm(_cli("--device", "cpu", "-O0", "-cc.cudagraph_mode=FULL_DECODE_ONLY"))
    assert [c.cudagraph_mode for c in built] == ["PIECEWISE", "FULL_DECODE_ONLY"]


def test_llm_takes_optimization_level(tiny_ckpt, make_llm):
    llm = make_llm(tiny_ckpt("nemotron_h"), optimization_level=0)
    assert llm.engine_config.cudagraph_mode == "NONE" and llm.engine_config.enforce_eager
    with pytest.raises(ConfigurationError, match="optimization_level"):
        make_llm(tiny_ckpt("nemotron_h"), optimization_level=9)
