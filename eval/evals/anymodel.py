"""Any model: every causal-LM type of the installed transformers, tried as a user would.

For each model type in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config is
text-only and whose tiny random model builds in seconds, greedy generation with
``tierattn.patch`` in exact mode (``attend="all"``, an 8-token hot budget on 4-token pages, so
pages leave HBM every few tokens) is compared with the model's own attention (sdpa, or eager
where the model has no sdpa path) at batch 1 and at batch 3 left-padded by 0/5/11 tokens. Each
type ends as one row:

* ``identical``: the same tokens at both batch sizes;
* ``refused``: ``patch`` (or the first forward's guard) refused it with a structural reason
  (:mod:`tierattn.models.hf.support`; never a name);
* ``differs`` / ``failed``: a bug -- other tokens, or an error that is not a refusal;
* ``skipped``: not a text-only decoder that builds from a config in seconds, or its own
  reference generation fails (the reason says which).

``tierattn models`` writes the table as ``models.json``, ``models.csv`` and ``models.md`` (a
summary grouped by result and reason, then the row of every type).
"""

from __future__ import annotations

import copy
import csv
import json
import os
import signal
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a tiny config never needs the hub

import torch  # noqa: E402

__all__ = ["Row", "TINY", "causal_lm_types", "check_type", "survey", "tiny_model",
           "write_table"]

#: the sizes of a tiny model; only the keys a model type's config has are set
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, n_embd=64, n_layer=2, n_head=4, d_model=64,
            n_positions=256, num_layers=2, num_heads=4, ffn_dim=128, n_inner=128,
            num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            n_routed_experts=4, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, qk_head_dim=16, v_head_dim=16, sliding_window=8,
            rotary_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2)
#: the layer-count keys: a config whose per-layer lists fix its depth builds without them
_DEPTH = ("num_hidden_layers", "n_layer", "num_layers")
PROMPT, NEW_TOKENS, PADS = 29, 12, (0, 5, 11)
BUILD_LIMIT_S = 30.0


@dataclass
class Row:
    model_type: str
    status: str  # identical | refused | differs | failed | skipped
    reason: str = ""
    seconds: float = 0.0


def causal_lm_types() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _Timeout(Exception):
    pass


class _Multimodal(ValueError):
    pass


def _alarm(*_) -> None:
    raise _Timeout


def tiny_model(model_type: str, attn: str | None = None, *, mha: bool = False):
    """A tiny random ``AutoModelForCausalLM`` of ``model_type`` (seed 0), in eval mode, with
    ``attn`` (default: sdpa where the model has it, else eager); ``mha``: as many KV heads as
    query heads (for families that need it). Raises ``ValueError`` for a multimodal config,
    ``TimeoutError`` if building takes over ``BUILD_LIMIT_S``."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    if default.get_text_config() is not default:
        raise _Multimodal("its text model is a sub-config")
    tiny = {**TINY, "num_key_value_heads": TINY["num_attention_heads"]} if mha else TINY
    kw = {k: v for k, v in tiny.items() if hasattr(default, k) and
          (k != "sliding_window" or getattr(default, k) is not None)}
    first: Exception | None = None
    for sizes in (kw, {k: v for k, v in kw.items() if k not in _DEPTH}):
        try:
            model = _build(model_type, dict(sizes))
            break
        except TimeoutError:
            raise
        except Exception as e:
            first = first or e
    else:
        raise first
    attn = attn or ("sdpa" if getattr(model, "_supports_sdpa", False) else "eager")
    model.set_attn_implementation(attn)
    return model.eval()


def _build(model_type: str, sizes: dict):
    """The model of ``model_type`` with ``sizes`` (a size a config exposes as a read-only
    property is left to the config), built within ``BUILD_LIMIT_S``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for _ in range(len(sizes) + 1):
        try:
            config = AutoConfig.for_model(model_type, **sizes)
            break
        except AttributeError as e:  # "property 'head_dim' of ... has no setter"
            name = str(e).split("'")[1] if "no setter" in str(e) else None
            if name not in sizes:
                raise
            del sizes[name]
    torch.manual_seed(0)
    use_alarm = hasattr(signal, "SIGALRM")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, BUILD_LIMIT_S)
    try:
        return AutoModelForCausalLM.from_config(copy.deepcopy(config))
    except _Timeout:
        raise TimeoutError(f"building took over {BUILD_LIMIT_S:.0f} s") from None
    finally:
        if use_alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)


def _inputs(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, PROMPT), generator=torch.Generator().manual_seed(batch))
    mask = torch.ones_like(ids)
    for b, pad in enumerate(PADS[:batch]):
        ids[b, :pad], mask[b, :pad] = 0, 0
    return ids, mask


def _generate(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def check_type(model_type: str) -> Row:
    """The row of one model type (see the module docstring)."""
    import tierattn
    from tierattn.errors import UnsupportedModelError
    from transformers import AutoConfig

    from tierattn.models.hf.support import config_reason, unsupported_reason

    t0 = time.perf_counter()

    def row(status: str, reason: str = "") -> Row:
        return Row(model_type, status, reason, round(time.perf_counter() - t0, 2))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:  # the released config's structure first: a refusal needs no model
            default = AutoConfig.for_model(model_type)
            why = None if default.get_text_config() is not default else config_reason(default)
        except Exception as e:
            return row("skipped", f"its config is not usable as one text model: {_short(e)}")
        if why is not None:
            return row("refused", why)
        try:
            model = tiny_model(model_type)
        except _Multimodal as e:
            return row("skipped", f"multimodal: {e}")
        except Exception as e:
            return row("skipped", f"does not build from a tiny config: {_short(e)}")
        why = unsupported_reason(model)
        if why is not None:
            return row("refused", why)
        try:  # a family whose tiny GQA model does not run its own generate may need MHA
            _generate(model, *_inputs(1))
        except Exception:
            try:
                model = tiny_model(model_type, mha=True)
            except Exception as e:
                return row("skipped", f"does not build from a tiny config: {_short(e)}")
        config = tierattn.TierConfig(page_size=4, hot_budget=8, max_context=128, backend="torch")
        moved = 0
        for batch in (1, 3):
            ids, mask = _inputs(batch)
            try:
                ref = _generate(model, ids, mask)
            except Exception as e:
                return row("skipped", f"its own generate fails: {_short(e)}")
            try:
                with tierattn.patch(model, config) as handle:
                    out = _generate(model, ids, mask)
                    total = handle.stats()["total"]
                    moved += total["demoted_pages"] + total["window_dropped_tokens"]
            except UnsupportedModelError as e:  # the first-call guard
                return row("refused", str(e).removeprefix("tierattn: "))
            except Exception as e:
                return row("failed", f"batch {batch}: {_short(e)}")
            if not torch.equal(out, ref):
                return row("differs", f"batch {batch}: other tokens")
    if not moved:  # exact mode must have moved pages, or the comparison proves nothing
        return row("failed", "no page left HBM: the budget did not bind")
    return row("identical", "batch 1 and batch 3 left-padded")


def survey(types: list[str] | None = None, *, progress: bool = True) -> list[Row]:
    """The rows of ``types`` (default: every causal-LM type)."""
    import transformers
    from tqdm import tqdm

    transformers.logging.set_verbosity_error()
    types = types or causal_lm_types()
    return [check_type(t) for t in tqdm(types, desc="model types", disable=not progress)]


STATUSES = ("identical", "refused", "differs", "failed", "skipped")


def summary_markdown(rows: list[Row]) -> str:
    """The survey's table (``models.md``): types by result, refusals and skips grouped by reason."""
    import transformers

    by = {s: [r for r in rows if r.status == s] for s in STATUSES}
    lines = [f"transformers {transformers.__version__}, {len(rows)} causal-LM types: "
             + ", ".join(f"{len(v)} {s}" for s, v in by.items()), "",
             "| result | types | reason |", "|---|---|---|"]
    for status in STATUSES:
        groups: dict[str, list[str]] = {}
        for r in by[status]:
            reason = r.reason if status != "skipped" else r.reason.split(":")[0]
            groups.setdefault(reason if status != "identical" else "", []).append(r.model_type)
        for reason, types in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            text = reason or "batch 1 and batch 3 left-padded, pages offloaded"
            lines.append(f"| {status} ({len(types)}) | {', '.join(types)} | "
                         f"{text.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_table(rows: list[Row], out_dir: Path) -> list[Path]:
    """``models.json``, ``models.csv`` and ``models.md`` (the survey's table, linked from
    docs/huggingface.md) in ``out_dir``."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {s: sum(r.status == s for r in rows) for s in STATUSES}
    from tierattn.eval.report import provenance

    meta = {"transformers": transformers.__version__, "torch": torch.__version__,
            "counts": counts, "provenance": provenance()}
    paths = [out_dir / "models.json", out_dir / "models.csv", out_dir / "models.md"]
    paths[0].write_text(json.dumps({**meta, "rows": [asdict(r) for r in rows]}, indent=1))
    with paths[1].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        w.writeheader()
        w.writerows(asdict(r) for r in rows)
    lines = ["", "| model type | result | reason | seconds |", "|---|---|---|---|"]
    lines += [f"| {r.model_type} | {r.status} | {r.reason.replace('|', '/')} | {r.seconds} |"
              for r in rows]
    paths[2].write_text(summary_markdown(rows) + "\n".join(lines) + "\n")
    return paths
