"""A vLLM user's `serve` command line: parsed into our engine arguments and gateway options (no
process started), vLLM's value spellings, the flags refused with one line, no abbreviations, and
every flag of every command with its help and default."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from services.common.config import VllmConfig
from services.common.flag_values import human_readable_int, max_model_len_value
from services.common.secret_check import join_api_keys, split_api_keys
from services.entrypoints.arg_parser import shown_help
from services.entrypoints.cli import build_parser
from services.entrypoints.engine_args import engine_kwargs
from services.entrypoints.model_source import resolve_model
from services.entrypoints.topology import GATEWAY, WORKER, LocalPlacement, Topology, processes
from services.entrypoints.vllm_compat import LIMITED, REFUSED, model_of
from services.gateway.options import gateway_options

ACCEPTANCE = ("serve models/SmolLM2-135M-Instruct --dtype half --max-model-len 4k --enable-prefix-caching "
              "--generation-config auto --uvicorn-log-level info --served-model-name a b --api-key k1 k2").split()


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line `myvllm` exits 2 with."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_the_acceptance_command_line_becomes_engine_args_and_gateway_options() -> None:
    args = parse(ACCEPTANCE)
    config = VllmConfig.from_engine_args(**engine_kwargs(args))
    assert (config.model_config.model, config.model_config.dtype, config.model_config.max_model_len,
            config.cache_config.enable_prefix_caching) == ("models/SmolLM2-135M-Instruct", "float16", 4000, True)
    options = gateway_options(args)
    assert (options.api_keys, options.generation_config, options.uvicorn_log_level) == (("k1", "k2"), "auto", "info")
    assert args.served_model_name == ["a", "b"]


def test_serve_forwards_the_gateway_flags_and_keeps_vllm_only_flags_to_itself(smollm2_dir: str) -> None:
    args = parse([*ACCEPTANCE, "--tokenizer", smollm2_dir, "--max-logprobs", "5", "--allowed-origins",
                  '["https://a.example"]', "--revision", "main", "--trust-remote-code", "--no-enable-prefix-caching",
                  "--uvicorn-log-level", "debug", "--disable-log-stats"])
    placement = LocalPlacement("127.0.0.1", 8000, [[1]], [2])
    specs = {spec.role: spec for spec in processes(args, smollm2_dir, Topology(), placement)}
    gateway = list(specs[GATEWAY].argv)
    i = gateway.index("--served-model-name")
    assert gateway[i + 1:i + 3] == ["a", "b"]
    # (info, in ACCEPTANCE, is the default: the value given last, debug, is the one forwarded)
    for flag, value in (("--tokenizer", smollm2_dir), ("--max-logprobs", "5"), ("--uvicorn-log-level", "debug"),
                        ("--allowed-origins", '["https://a.example"]')):
        assert gateway[gateway.index(flag) + 1] == value
    assert "--disable-log-stats" in gateway
    assert "--api-key" not in gateway  # (a secret: it goes by the environment)
    worker = list(specs[WORKER].argv)
    assert "--no-enable-prefix-caching" not in worker and "--revision" not in worker
    assert worker[worker.index("--dtype") + 1] == "float16"
    scheduler = [s for s in processes(args, smollm2_dir, Topology(), placement) if s.role == "scheduler"][0].argv
    assert "--no-enable-prefix-caching" in scheduler


@pytest.mark.parametrize("flag", [f for f in REFUSED], ids=lambda f: f.options[0])
def test_each_refused_flag_exits_2_with_one_line_naming_it_and_why(flag, capsys) -> None:
    value = [] if flag.nargs == 0 else ["x"]
    line = refusal(["serve", flag.options[0], *value], capsys)
    assert f"argument {flag.options[0]}: {flag.reason}" in line and "unrecognized" not in line


@pytest.mark.parametrize("limited", LIMITED, ids=lambda f: f.option)
def test_limited_flags_take_their_values_and_refuse_others_with_the_reason(limited, capsys) -> None:
    for value in limited.allowed:
        assert getattr(parse(["serve", limited.option, value]), limited.option[2:].replace("-", "_")) == value
    line = refusal(["serve", limited.option, "fp8"], capsys)
    assert limited.option in line and limited.reason in line


def test_chunked_prefill_is_accepted_and_its_negation_says_it_is_always_on(capsys) -> None:
    assert parse(["serve", "--enable-chunked-prefill"]).enable_chunked_prefill
    assert "chunked prefill is always on" in refusal(["serve", "--no-enable-chunked-prefill"], capsys)


def test_trust_remote_code_is_accepted_and_logged_as_having_no_effect(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="myvllm.flags"):
        assert parse(["serve", "--trust-remote-code"]).trust_remote_code
    assert "--trust-remote-code has no effect" in caplog.text


def _parsers(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*prefix, name))


def test_no_parser_takes_abbreviations(capsys) -> None:
    for prefix, parser in _parsers(build_parser()):
        assert parser.allow_abbrev is False, prefix
    with pytest.raises(SystemExit):  # (not --max-model-len)
        parse(["serve", "--max-model", "100"])
    assert "unrecognized arguments: --max-model" in capsys.readouterr().err


def test_tokenizer_is_a_flag_of_its_own_not_the_pool_size() -> None:
    for command in ("serve", "gateway"):
        args = parse([command, "--tokenizer", "/tok"])
        assert (args.tokenizer, args.tokenizer_pool_size) == ("/tok", 2)


def test_every_flag_of_every_command_has_help_and_shows_its_default() -> None:
    missing = []
    for prefix, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = f"{' '.join(prefix)} {action.option_strings[0] if action.option_strings else action.dest}"
            text = shown_help(action)
            if not action.help:
                missing.append(f"{name}: no help")
            elif not action.required and action.default is not argparse.SUPPRESS and "default" not in text.lower():
                # (a required flag has no default, nor has a refused one: it never takes a value)
                missing.append(f"{name}: no default in {text!r}")
    assert not missing, "\n".join(missing)


def test_help_shows_the_defaults() -> None:
    serve = dict(_parsers(build_parser()))[("serve",)]
    text = " ".join(serve.format_help().split())
    for needle in ("(default: 8000)", "(default: auto)", "(default: 20)", "(default: assistant)", '(default: ["*"])'):
        assert needle in text


@pytest.mark.parametrize(("given", "dtype"), [("half", "float16"), ("float16", "float16"), ("bfloat16", "bfloat16"),
                                              ("float", "float32"), ("float32", "float32"), ("auto", "auto")])
def test_dtype_takes_vllms_spellings(given: str, dtype: str) -> None:
    assert parse(["serve", "--dtype", given]).dtype == dtype
    assert VllmConfig.from_engine_args(dtype=given).model_config.dtype == dtype  # LLM(dtype="half") too


def test_dtype_refuses_others(capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--dtype", "fp8"])
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize(("given", "length"), [("4096", 4096), ("4k", 4000), ("4K", 4096), ("25.6k", 25600),
                                               ("1m", 10**6), ("1M", 2**20), ("auto", None), ("-1", None)])
def test_max_model_len_takes_vllms_spellings(given: str, length: int | None) -> None:
    assert max_model_len_value(given) == length
    assert parse(["serve", "--max-model-len", given]).max_model_len == length


@pytest.mark.parametrize("given", ["4.5K", "lots", "0"])
def test_max_model_len_refuses_what_vllm_refuses(given: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse(["serve", "--max-model-len", given])
    assert "--max-model-len" in capsys.readouterr().err


def test_human_readable_int_suffixes() -> None:
    assert [human_readable_int(t) for t in ("1g", "1G", "2t", " 7 ")] == [10**9, 2**30, 2 * 10**12, 7]


def test_api_keys_travel_in_one_variable_one_per_line() -> None:
    assert split_api_keys(join_api_keys(["k1", "k2"])) == ["k1", "k2"]
    assert (join_api_keys("only"), split_api_keys(None), join_api_keys(None)) == ("only", None, None)


def test_positional_model_is_model(capsys) -> None:
    assert parse(["serve", "/m"]).model == "/m"
    assert parse(["serve", "/m", "--model", "/m"]).model == "/m"
    assert not hasattr(parse(["serve", "/m"]), "model_tag")
    line = refusal(["serve", "/m", "--model", "/other"], capsys)
    assert "MODEL" in line and "--model /other" in line


def test_enable_prefix_caching_has_both_spellings() -> None:
    assert parse(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert parse(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parse(["serve"]).enable_prefix_caching is True


def test_gpu_memory_utilization_is_an_engine_argument_checked_for_range() -> None:
    args = parse(["serve", "--gpu-memory-utilization", "0.5"])
    assert VllmConfig.from_engine_args(**engine_kwargs(args)).cache_config.gpu_memory_utilization == 0.5
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        VllmConfig.from_engine_args(gpu_memory_utilization=1.5)


def _cached_snapshot(cache: Path, repo: str, revision: str = "main") -> Path:
    """A model in huggingface_hub's cache layout: refs/<revision> names a snapshot directory."""
    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / revision).write_text(commit)
    return snapshot


def test_a_model_that_is_no_directory_is_looked_up_in_the_local_hf_cache(tmp_path: Path) -> None:
    snapshot = _cached_snapshot(tmp_path, "org/tiny", revision="v1")
    assert resolve_model("org/tiny", revision="v1", download_dir=str(tmp_path)) == str(snapshot)
    args = parse(["serve", "org/tiny", "--revision", "v1", "--download-dir", str(tmp_path)])
    assert model_of(args) == str(snapshot)
    with pytest.raises(FileNotFoundError, match=r"not a directory and not in the local Hugging Face cache \(HF_HOME="):
        resolve_model("org/absent", download_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        resolve_model(str(tmp_path / "no" / "such" / "dir"))

