"""The command line: every user error is one line on stderr naming the flag and the fix, exit
status 2, no traceback, before any work starts (numeric flags checked at parse time)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tierattn.eval.cli import main

NO_CUDA = not torch.cuda.is_available()

CASES = [
    (["loop", "--layers", "0"], "--layers"),
    (["loop", "--hot-budget", "1.5"], "--hot-budget"),
    (["loop", "--kv-heads", "3", "--q-heads", "4"], "--q-heads"),
    (["loop", "--steps", "-1"], "--steps"),
    (["loop", "--batch", "two"], "--batch"),
    (["loop", "--out", "/nonexistent-folder/x.json"], "--out"),
    (["loop", "--preset", "bogus"], "--preset"),
    (["bench", "--smoke", "--contexts", "0"], "--contexts"),
    (["bench", "--modes", "bogus"], "--modes"),
    (["bench", "--budgets", "0,0.5"], "--budgets"),
    (["bench", "--hardware", "/nonexistent.json"], "--hardware"),
    (["eval", "reasoning", "--budgets", "1.5"], "--budgets"),
    (["eval", "fidelity", "--recall", "0"], "--recall"),
    (["eval", "reasoning", "--model", "/nonexistent"], "--model"),
    (["eval", "reasoning", "--data", "/nonexistent.jsonl"], "--data"),
    (["eval", "reasoning", "--n", "0"], "--n"),
    (["eval", "fidelity", "--full"], "--full"),
    (["eval", "keytier", "--teacher-forcing"], "--teacher-forcing"),
    (["eval", "bogus"], "what"),
    (["eval", "keytier", "--contexts", "100"], "--contexts"),
    (["eval", "keytier", "--contexts", "256", "--page-size", "100"], "--contexts"),
    (["eval", "keytier", "--segments", "0"], "--segments"),
    (["eval", "keytier", "--methods", "topk"], "--methods"),
    (["eval", "keytier", "--budgets", "0.25"], "--budgets"),
    (["demo", "--context", "64"], "--context"),
    (["demo", "--context", "0"], "--context"),
    (["demo", "--context", "-5"], "--context"),
    (["demo", "--page-size", "0"], "--page-size"),
    (["demo", "--hot-fraction", "2.0"], "--hot-fraction"),
    (["demo", "--device", "banana"], "--device"),
    (["demo", "--out", "/nonexistent-folder/demo.json"], "--out"),
    (["demo", "--out", "/tmp"], "--out"),
    (["models", "--types", "no_such_type"], "--types"),
    (["bench", "--serving", "--policies", "swap"], "--policies"),
    (["bench", "--serving", "--pools", "0"], "--pools"),
    (["bench", "--serving", "--requests", "0"], "--requests"),
    (["bench", "--serving", "--new-tokens", "128,64"], "--new-tokens"),
    (["bench", "--serving", "--new-tokens", "64"], "--new-tokens"),
    (["bench", "--serving", "--prompt-lengths", "0"], "--prompt-lengths"),
    (["serve", "--swap-tiers", "disk", "--", "m"], "--swap-disk"),
    *([(["bench", "--vllm"], "--vllm")] if importlib.util.find_spec("vllm") is None else []),
    (["serve", "--swap-tiers", "ssd", "--", "m"], "--swap-tiers"),
    (["serve", "--swap-tiers", "ddr,disk", "--swap-disk", "d", "--swap-capacity-gib", "1",
      "--", "m"], "--swap-capacity-gib"),
    (["serve", "--swap-policy", "always", "--", "m"], "--swap-policy"),
    (["serve", "--swap-calibration", "/nonexistent.json", "--", "m"], "--swap-calibration"),
    (["serve", "--swap-tiers", "disk,ddr", "--swap-disk", "d", "--", "m"], "SwapConfig.tiers"),
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
