"""Train the tiny reasoner: a small GQA Llama that answers pointer-chasing queries hop by hop.

Recipe (DESIGN.md measured the MHA version; this one uses GQA with 2 query heads per KV head):
3 layers, d=128, 8 query / 4 KV heads, FFN 2d, AdamW lr 1e-3 with 200 warmup steps and no weight
decay, batch 64, and a curriculum that advances when held-out exact-chain accuracy passes 95%:
(1 hop, 4 chains) -> (1, 8) -> (2, 8) -> (3, 8) -> (4, 8) -> (4, 16) -> (4, 24), with mixed hop
counts (1..max) in every stage after the first so 1-hop queries keep working. Time-boxed, seeded,
checkpointed; judged by held-out exact-chain accuracy (argmax correct at every answer position
under teacher forcing, which equals greedy decoding getting the whole chain right).

    python -m tierattn.eval.train_reasoner --out DIR --minutes 30 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tierattn.eval.tasks import PAD, TaskConfig, Vocab, make_example

__all__ = ["CURRICULUM", "SHIPPED", "build_model", "evaluate", "load_reasoner", "train"]

#: where the trained weights ship inside the package (written by `--out` of this script)
SHIPPED = Path(__file__).resolve().parent / "reasoner"

#: (max hops, chains) per stage; the last stage is the shipped task.
CURRICULUM = [(1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (4, 16), (4, 24)]


def build_model(vocab: Vocab, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab.size, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=16, max_position_embeddings=512, pad_token_id=PAD,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def stage_config(stage: int, vocab: Vocab) -> TaskConfig:
    hops, chains = CURRICULUM[stage]
    return TaskConfig(hops=(1, hops), chains=chains, vocab=vocab)


def batch(cfg: TaskConfig, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` right-padded; labels are -100 except on the answer tokens."""
    examples = [make_example(cfg, rng) for _ in range(n)]
    width = max(len(e.prompt) + len(e.target) for e in examples)
    ids = torch.full((n, width), PAD, dtype=torch.long)
    labels = torch.full((n, width), -100, dtype=torch.long)
    for i, e in enumerate(examples):
        seq = e.prompt + e.target
        ids[i, :len(seq)] = torch.tensor(seq)
        labels[i, len(e.prompt):len(seq)] = torch.tensor(e.target)
    return ids, labels


@torch.no_grad()
def evaluate(model, cfg: TaskConfig, n: int, seed: int) -> float:
    """Held-out exact-chain accuracy (fresh seed) under teacher forcing."""
    model.eval()
    ids, labels = batch(cfg, n, random.Random(seed))
    logits = model(input_ids=ids, attention_mask=(ids != PAD).long()).logits
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    ok = ((pred == target) | (target == -100)).all(dim=1)
    model.train()
    return float(ok.float().mean())


def train(out: str | Path, *, minutes: float = 30.0, seed: int = 0, batch_size: int = 64,
          lr: float = 1e-3, warmup: int = 200, threshold: float = 0.95, eval_every: int = 100,
          threads: int | None = None) -> dict:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    vocab = Vocab()
    model = build_model(vocab, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(seed)
    stage, step, history = 0, 0, []
    start = time.time()
    bar = tqdm(total=int(minutes * 60), unit="s", desc="training (time box)")
    model.train()
    while time.time() - start < minutes * 60:
        cfg = stage_config(stage, vocab)
        ids, labels = batch(cfg, batch_size, rng)
        loss = model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        if step % eval_every == 0:
            acc = evaluate(model, cfg, 256, seed=10_000 + step)
            history.append({"step": step, "stage": stage, "loss": float(loss.detach()), "acc": acc,
                            "minutes": (time.time() - start) / 60})
            bar.set_postfix(stage=f"{stage}{CURRICULUM[stage]}", loss=f"{float(loss.detach()):.3f}",
                            acc=f"{acc:.3f}")
            bar.update(int(time.time() - start) - bar.n)
            if acc >= threshold and stage < len(CURRICULUM) - 1:
                stage += 1
            if step % (eval_every * 10) == 0:
                save(model, vocab, out, history, seed, final=False)
    bar.close()
    report = {
        "steps": step, "minutes": (time.time() - start) / 60, "stage_reached": stage,
        "heldout_exact_chain": {
            f"hops{h}_chains24": evaluate(model, TaskConfig(hops=h, chains=24, vocab=vocab), 500,
                                          seed=99_000 + h) for h in (1, 2, 3, 4)},
        "history": history,
    }
    save(model, vocab, out, report, seed, final=True)
    return report


def save(model, vocab: Vocab, out: Path, report, seed: int, *, final: bool) -> None:
    """Weights as safetensors, the HF config, the vocabulary, and the training record."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if k != "lm_head.weight"}  # tied to the embeddings
    save_file(state, str(out / "model.safetensors"), metadata={"seed": str(seed)})
    model.config.to_json_file(str(out / "config.json"))
    (out / "vocab.json").write_text(json.dumps(asdict(vocab)) + "\n")
    name = "training.json" if final else "training.partial.json"
    (out / name).write_text(json.dumps(report, indent=1) + "\n")


def load_reasoner(folder: str | Path | None = None):
    """``(model, vocab)`` of a trained reasoner (default: the one shipped in the package)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder) if folder is not None else SHIPPED
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(
            f"no trained reasoner in {folder}; train one with "
            f"`python -m tierattn.eval.train_reasoner --out {folder}`.")
    vocab = Vocab(**json.loads((folder / "vocab.json").read_text()))
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(folder / "config.json")))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")),
                                                strict=False)
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise ValueError(f"{folder}: weights do not match the config (missing {missing}, "
                         f"unexpected {unexpected}).")
    model.tie_weights()
    return model.eval(), vocab


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    report = train(args.out, minutes=args.minutes, seed=args.seed, threads=args.threads)
    print(json.dumps(report["heldout_exact_chain"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
