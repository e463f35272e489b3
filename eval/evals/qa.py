"""Question answering with any local Hugging Face checkpoint and a JSONL file of
question/answer pairs (GSM8K style), through the same cells and metrics as the reasoning eval.

Each line is ``{"question": ..., "answer": ...}``; the gold answer is the number after ``####``
(GSM8K) or else the last number in the answer text, and a generation is correct when the same
extraction of its text gives the same number (or, for non-numeric answers, the same stripped
text after ``####``/at the end). Teacher forcing replays the full cache's own trace, so KL and
top-1 agreement measure each method against the full cache on identical inputs.

    tierattn eval reasoning --model DIR --data FILE.jsonl [--max-new-tokens 256]
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch

from tierattn.eval.evals.methods import METHODS, RECALL, evict_ratio, method_config
from tierattn.eval.evals.reasoning import TABLE_COLUMNS, Item, evaluate_items
from tierattn.eval.report import new_results_dir, results_summary, save_json, write_csv

__all__ = ["extract_answer", "load_jsonl", "run_qa"]

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def _norm_number(text: str) -> str:
    text = text.replace(",", "").replace("$", "").rstrip(".")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text


def extract_answer(text: str) -> str | None:
    """The answer in ``text``: the number after ``####`` (GSM8K), else the last number, else the
    stripped text after ``####``; None when there is nothing to compare."""
    tail = text.split("####", 1)[1] if "####" in text else None
    source = tail if tail is not None else text
    numbers = _NUMBER.findall(source)
    if numbers:
        return _norm_number(numbers[0] if tail is not None else numbers[-1])
    if tail is not None and tail.strip():
        return tail.strip().splitlines()[0].strip()
    return None


def load_jsonl(path: str | Path, question_key: str = "question",
               answer_key: str = "answer") -> list[dict]:
    """Read question/answer pairs; a bad line raises ``ValueError`` naming the line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON ({e.msg}).") from None
        if not isinstance(row, dict) or question_key not in row or answer_key not in row:
            raise ValueError(f"{path}:{i}: each line needs the keys {question_key!r} and "
                             f"{answer_key!r} (pass --question-key/--answer-key otherwise).")
        if extract_answer(str(row[answer_key])) is None:
            raise ValueError(f"{path}:{i}: no answer could be extracted from "
                             f"{str(row[answer_key])[:60]!r}.")
        rows.append({"question": str(row[question_key]), "answer": str(row[answer_key])})
    if not rows:
        raise ValueError(f"{path}: no question/answer pairs.")
    return rows


def _prompt(tok, question: str, style: str) -> list[int]:
    if style == "chat" or (style == "auto" and getattr(tok, "chat_template", None)):
        return tok.apply_chat_template([{"role": "user", "content": question}],
                                       add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return tok(f"Question: {question}\nAnswer:").input_ids


def run_qa(model_dir: str | Path, data: str | Path, *, budgets=(0.25, 0.5),
           methods=tuple(m for m in METHODS if m != "oracle"), n: int | None = None,
           max_new_tokens: int = 256, page_size: int = 16, prompt_style: str = "auto",
           batch_size: int = 8, backend: str = "auto", seed: int = 0, recall: float = RECALL,
           out_root: str | Path | None = "results", question_key: str = "question",
           answer_key: str = "answer") -> dict:
    """Run full + ``methods`` x ``budgets`` on the JSONL's questions with greedy decoding."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "oracle" in methods:
        raise ValueError("methods: the oracle needs to know which tokens an answer uses; it "
                         "exists only for the pointer-chasing task.")
    rows = load_jsonl(data, question_key, answer_key)[:n]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    eos = model.generation_config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    if eos is None:
        eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    items = []
    for r in rows:
        gold = extract_answer(r["answer"])
        items.append(Item(_prompt(tok, r["question"], prompt_style), [],
                          lambda trace, gold=gold: extract_answer(tok.decode(
                              trace, skip_special_tokens=True)) == gold))
    longest = max(len(it.prompt) for it in items) + max_new_tokens + page_size
    max_context = -(-longest // page_size) * page_size
    runs = [{"method": "full", "hbm": 1.0, "evict": 0.0, "config": None}] + [
        {"method": m, "hbm": b, "evict": evict_ratio(m, b),
         "config": method_config(m, b, page_size=page_size, max_context=max_context,
                                 backend=backend, seed=seed, recall=recall)}
        for m in methods for b in budgets]
    started = time.time()
    cells = evaluate_items(model, items, runs, steps=max_new_tokens, eos_id=eos, pad_id=pad,
                           batch_size=batch_size, desc="qa")
    result = {"model": str(model_dir), "data": str(data), "n": len(items),
              "max_new_tokens": max_new_tokens, "page_size": page_size,
              "budgets": list(budgets), "torch": torch.__version__,
              "minutes": (time.time() - started) / 60,
              "cells": [{"section": "qa", **c} for c in cells]}
    if out_root:
        out = new_results_dir(out_root, f"qa-{Path(model_dir).name}-{Path(data).stem}-"
                              f"n{len(items)}-ps{page_size}")
        result["out"] = str(out)
        save_json(result, out / "results.json", quiet=True)
        write_csv(result["cells"], out / "cells.csv")
    return result


def summary(result: dict) -> str:
    """The printed table and the paths of the files and plots."""
    return results_summary(result, TABLE_COLUMNS)
