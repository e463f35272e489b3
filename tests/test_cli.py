"""The command line: every user error is one line on stderr naming the flag and the fix, exit
status 2, no traceback, before any work starts (numeric flags checked at parse time)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tierattn.eval.cli import BENCHES, main

NO_CUDA = not torch.cuda.is_available()

CASES = [
    (["loop", "--layers", "0"], "--layers"),
    (["loop", "--hot-budget", "1.5"], "--hot-budget"),
    (["loop", "--kv-heads", "3", "--q-heads", "4"], "--q-heads"),
    (["loop", "--steps", "-1"], "--steps"),
    (["loop", "--batch", "two"], "--batch"),
    (["loop", "--out", "/nonexistent-folder/x.json"], "--out"),
    (["loop", "--preset", "bogus"], "--preset"),
    (["bench", "kv", "--smoke", "--contexts", "0"], "--contexts"),
    (["bench", "kv", "--modes", "bogus"], "--modes"),
    (["bench", "kv", "--budgets", "0,0.5"], "--budgets"),
    (["bench", "kv", "--hardware", "/nonexistent.json"], "--hardware"),
    (["eval", "reasoning", "--budgets", "1.5"], "--budgets"),
    (["eval", "fidelity", "--recall", "0"], "--recall"),
    (["eval", "reasoning", "--model", "/nonexistent"], "--model"),
    (["eval", "qa", "--model", "/nonexistent", "--data", "pyproject.toml"], "--model"),
    (["eval", "reasoning", "--n", "0"], "--n"),
    (["eval", "fidelity", "--full"], "--full"),
    (["eval", "keytier", "--teacher-forcing"], "--teacher-forcing"),
    (["eval", "bogus"], "reasoning,qa,fidelity,keytier"),
    (["eval", "keytier", "--contexts", "100"], "--contexts"),
    (["eval", "keytier", "--contexts", "256", "--page-size", "100"], "--contexts"),
    (["eval", "keytier", "--segments", "0"], "--segments"),
    (["eval", "keytier", "--methods", "topk"], "--methods"),
    (["eval", "keytier", "--budgets", "0.25"], "--budgets"),
    (["eval", "qa", "--data", "pyproject.toml"], "--model"),
    (["bench", "disk", "--serving"], "--serving"),
    (["bench", "host", "--modes", "topk"], "--modes"),
    (["bench", "host", "--budgets", "1.0"], "--budgets"),
    (["demo", "--context", "64"], "--context"),
    (["demo", "--context", "0"], "--context"),
    (["demo", "--context", "-5"], "--context"),
    (["demo", "--page-size", "0"], "--page-size"),
    (["demo", "--hot-fraction", "2.0"], "--hot-fraction"),
    (["demo", "--device", "banana"], "--device"),
    (["demo", "--out", "/nonexistent-folder/demo.json"], "--out"),
    (["demo", "--out", "/tmp"], "--out"),
    (["models", "--types", "no_such_type"], "--types"),
    (["bench", "serving", "--policies", "swap"], "--policies"),
    (["bench", "serving", "--pools", "0"], "--pools"),
    (["bench", "serving", "--requests", "0"], "--requests"),
    (["bench", "serving", "--new-tokens", "128,64"], "--new-tokens"),
    (["bench", "serving", "--new-tokens", "64"], "--new-tokens"),
    (["bench", "serving", "--prompt-lengths", "0"], "--prompt-lengths"),
    (["serve", "--swap-tiers", "disk", "--", "m"], "--swap-disk"),
    *([(["bench", "vllm"], "bench vllm")] if importlib.util.find_spec("vllm") is None else []),
    (["serve", "--swap-tiers", "ssd", "--", "m"], "--swap-tiers"),
    (["serve", "--swap-tiers", "ddr,disk", "--swap-disk", "d", "--swap-capacity-gib", "1",
      "--", "m"], "--swap-capacity-gib"),
    (["serve", "--swap-policy", "always", "--", "m"], "--swap-policy"),
    (["serve", "--swap-calibration", "/nonexistent.json", "--", "m"], "--swap-calibration"),
    (["serve", "--swap-tiers", "disk,ddr", "--swap-disk", "d", "--", "m"], "SwapConfig.tiers"),
    (["serve", "--swap-remote-master", "127.0.0.1:50051", "--", "m"], "--swap-remote-metadata"),
    (["serve", "--swap-remote-master", "localhost", "--swap-remote-metadata",
      "http://127.0.0.1:8080/metadata", "--", "m"], "remote master"),
    (["autotune", "--kernel", "bogus"], "--kernel"),
    (["autotune", "--kernel", "decode", "--seconds", "0"], "--seconds"),
]
if NO_CUDA:
    CASES.append((["demo", "--device", "cuda"], "--device"))


@pytest.mark.parametrize("argv,flag", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_user_errors_are_one_line_naming_the_flag_exit_2(argv, flag, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert flag in lines[0], lines[0]


@pytest.mark.parametrize("old,new", [
    (["bench"], ["bench", "kv"]),
    (["bench", "--smoke", "--contexts", "1024"], ["bench", "kv", "--smoke", "--contexts", "1024"]),
    (["bench", "--host"], ["bench", "hostcost"]),
    (["bench", "--smoke", "--host-attn"], ["bench", "host", "--smoke"]),
    (["bench", "--disk", "--pages", "64"], ["bench", "disk", "--pages", "64"]),
    (["bench", "--serving"], ["bench", "serving"]),
    (["bench", "--vllm"], ["bench", "vllm"]),
    (["bench", "--vllm-hotset", "--smoke"], ["bench", "vllm-hotset", "--smoke"]),
    (["eval", "reasoning", "--model", "m", "--data", "d"], ["eval", "qa", "--model", "m", "--data",
                                                           "d"]),
])
def test_the_previous_spellings_still_run_with_a_deprecation_message(old, new, capsys):
    from tierattn.eval.cli import _deprecated

    assert _deprecated(old) == new
    err = capsys.readouterr().err
    assert "deprecated" in err and f"tierattn {new[0]} {new[1]}" in err, err


@pytest.mark.parametrize("argv", [["bench", "disk", "--smoke"], ["eval", "reasoning", "--full"],
                                  ["demo"], ["bench", "--help"], ["bench", "gpu", "--out", "d"]])
def test_current_spellings_are_left_alone(argv, capsys):
    from tierattn.eval.cli import _deprecated

    assert _deprecated(argv) == argv and capsys.readouterr().err == ""


def test_a_deprecated_spelling_with_a_bad_flag_says_both(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--disk", "--pages", "0"])
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "deprecated" in lines[0] and "--pages" in lines[1] and len(lines) == 2


@pytest.mark.parametrize("argv", [["eval", "reasoning"], ["eval", "qa"], ["eval", "fidelity"],
                                  ["eval", "keytier"], *[["bench", b] for b in BENCHES],
                                  ["train"]])
def test_every_subcommand_has_its_own_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith(f"usage: tierattn {' '.join(argv)}"), out[:200]


def test_serve_flags_make_the_swap_config_remote_store_included():
    from tierattn.eval.cli import build_parser
    from tierattn.eval.commands import swap_config

    args = build_parser().parse_args([
        "serve", "--swap-tiers", "ddr", "--swap-capacity-gib", "2", "--swap-policy", "swap",
        "--swap-remote-master", "10.0.0.5:50051", "--swap-remote-metadata",
        "http://10.0.0.5:8080/metadata", "--swap-remote-host", "10.0.0.7", "--", "m"])
    config = swap_config(args)
    assert config.kinds == ("ddr", "remote") and config.policy == "swap"
    assert config.tiers[0].capacity_gib == 2
    assert (config.remote.master, config.remote.local_host, config.remote.segment_gib) == \
        ("10.0.0.5:50051", "10.0.0.7", 0.0)
    assert swap_config(build_parser().parse_args(["serve", "--", "m"])).remote is None
