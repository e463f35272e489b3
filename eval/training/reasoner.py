"""Train the tiny reasoner: a small GQA Llama that answers pointer-chasing queries hop by hop.

Recipe (what worked on this 2-core CPU; docs/training.md lists what did not):

1. **MHA curriculum with rehearsal.** A 3-layer Llama, d=128, 8 heads of 16 dims (MHA), FFN 2d,
   tied embeddings, AdamW lr 2e-3 (betas 0.9/0.98) with 200 warmup steps, no weight decay,
   batch 64. Every other batch is a *rehearsal* batch (:func:`rehearsal_batch`): the edges
   listed twice, the loss on each repeated ``v`` -- one lookup per edge, which is what moves
   the model off the plateau before the lookup (induction) step. The task batches follow a
   curriculum that advances when held-out exact-chain accuracy passes 95%: (1 hop, 4 chains)
   -> (1, 8) -> (2, 8) -> (3, 8) -> (4, 8) -> (4, 16) -> (4, 24), hop counts mixed 1..max with
   the distractor chains at the stage's longest length (so 1-hop queries keep working and see
   the same context lengths).
2. **GQA by query-head expansion.** When the curriculum is done (or at ``mha_fraction`` of the
   time box) :func:`to_gqa` gives each of the 8 KV heads a second query head whose output
   projection starts at zero -- the same function, now 16 query / 8 KV heads -- and training
   continues at lr 1e-3 on the final task alternated with the filler variant (and rehearsal).
   The shipped weights are the best GQA checkpoint by held-out accuracy on the final task.

Time-boxed, seeded, checkpointed; judged by held-out exact-chain accuracy (argmax correct at
every answer position under teacher forcing, which equals greedy decoding getting the whole
chain right) on fresh seeds.

The **long reasoner** (``--task long``, shipped in ``reasoner_long/``: 0.83-0.93 exact chains
held out, short of the short reasoner's 0.98) answers the same queries over 1016-1284-token
prompts: 64 chains of 4 hops with 1-2 filler tokens after every edge, 512 node tokens
(:func:`~tierattn.eval.evals.tasks.long_task`). It starts from the short reasoner (:func:`widen`:
the node embeddings grow to 512, the new rows drawn from the trained nodes' own covariance --
zero-shot 0.34 at 24 chains where per-dimension Gaussian rows give 0.05) and
follows :data:`LONG_CURRICULUM` with rehearsal on each stage's own prompts
(:func:`train_long`): more chains, then the fillers. Zero-shot the short reasoner scores 0.51
at 48 chains of its own vocabulary: it does not find edges past the distances it was trained
on; a reasoner trained to 64 chains without fillers (~770 tokens) scores 0.03 at 80 chains, so
every position of the long prompts has to be trained. Fillers break the edges' fixed 3-token
stride, which the lookup learned on regular prompts leans on: with rehearsal on 32-chain
prompts without fillers the final stage sat near 0.3 for 450 steps, so the rehearsal now lists
the stage's own prompts, fillers and all, then repeats their edges and asks queries in the
task's format. A constant rate then left it at 0.45-0.60 for ~330 steps (the sixth leg); the
seventh leg's rate, falling from 1e-3 to 1e-4 along a half cosine (``--lr-final``), took it
to 0.83-0.93 in 1013 steps (``training.json`` has every leg's figures).

    python -m tierattn.eval.training.reasoner --out DIR --minutes 30 --seed 1 --threads 1
    python -m tierattn.eval.training.reasoner --task long --out DIR --minutes 75 --threads 2
    python -m tierattn.eval.training.reasoner --task long --init DIR --out DIR2 --stop-at 0.97 \
        --lr-final 1e-4
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from tierattn.eval.evals.tasks import (ANSWER, EOS, LONG_VOCAB, PAD, QUERY, SEP, TaskConfig, Vocab,
                                 long_task, make_example)

__all__ = ["CURRICULUM", "LONG_CURRICULUM", "SHIPPED", "SHIPPED_LONG", "build_model", "evaluate",
           "load_reasoner", "to_gqa", "train", "train_long", "widen"]

#: where the trained weights ship inside the package (written by `--out` of this script)
SHIPPED = Path(__file__).resolve().parent.parent / "reasoner"
#: the long reasoner (``--task long``)
SHIPPED_LONG = Path(__file__).resolve().parent.parent / "reasoner_long"

#: (chains, fillers after each edge) per stage of the long curriculum (1..4 hops, distractors of
#: 4 hops); the last is the long task
LONG_CURRICULUM = [(24, (0, 0)), (32, (0, 0)), (48, (0, 0)), (64, (0, 0)), (64, (1, 2))]

#: (max hops, chains) per stage; the last stage is the shipped task.
CURRICULUM = [(1, 4), (1, 8), (2, 8), (3, 8), (4, 8), (4, 16), (4, 24)]


def final_task(vocab: Vocab) -> TaskConfig:
    """The shipped task: 1..4 hops, 24 chains of 4 hops (~290-token prompts)."""
    return TaskConfig(hops=(1, 4), chains=24, distractor_hops=4, vocab=vocab)


def filler_task(vocab: Vocab) -> TaskConfig:
    """The filler variant: 12 chains with 1..3 filler tokens after every edge (~290 tokens)."""
    return TaskConfig(hops=(1, 4), chains=12, distractor_hops=4, filler=(1, 3), vocab=vocab)


def build_model(vocab: Vocab, seed: int = 0, *, heads: int = 8, kv_heads: int = 8,
                tied: bool = True):
    """The reasoner's architecture (``heads`` query heads of 16 dims, ``kv_heads`` KV heads);
    ``tied``: the output layer shares the embedding matrix (copying a token is then the same
    direction in and out, which the lookup step needs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab.size, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=heads,
                         num_key_value_heads=kv_heads,
                         head_dim=16, max_position_embeddings=512, pad_token_id=PAD,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


@torch.no_grad()
def to_gqa(model, q_per_kv: int = 2, noise: float = 0.02, seed: int = 0):
    """GQA from a trained MHA model without changing its function: every KV head gets
    ``q_per_kv`` query heads, the original one and new ones whose output projection starts at
    zero (their query projection is the original's plus ``noise``), so the new model computes
    exactly what the old one did and training can then use the new heads.

    ``q_proj [H * D, d]`` becomes ``[H * q_per_kv * D, d]`` and ``o_proj [d, H * D]`` becomes
    ``[d, H * q_per_kv * D]``; in transformers' layout query head ``i`` reads KV head
    ``i // q_per_kv``. (Mean-pooling KV heads instead, as in Ainslie et al. 2023, destroyed this
    model's lookup heads: the loss went from 0.01 to 4.9 and had not recovered 5 minutes later.)
    """
    cfg = model.config
    h, dim = cfg.num_attention_heads, cfg.head_dim
    if cfg.num_key_value_heads != h:
        raise ValueError("to_gqa expands an MHA model (num_key_value_heads == "
                         f"num_attention_heads), got {cfg.num_key_value_heads} KV heads.")
    new = type(model)(type(cfg)(**{**cfg.to_dict(), "num_attention_heads": h * q_per_kv}))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, w in model.state_dict().items():
        if name.endswith("q_proj.weight"):  # [H*D, d] -> [H, q_per_kv, D, d]
            w = w.view(h, 1, dim, -1).repeat(1, q_per_kv, 1, 1)
            w[:, 1:] += noise * torch.randn(w[:, 1:].shape, generator=gen)
            w = w.reshape(h * q_per_kv * dim, -1)
        elif name.endswith("o_proj.weight"):  # [d, H*D] -> [d, H, q_per_kv, D]
            w = torch.cat([w.view(-1, h, 1, dim),
                           w.new_zeros(w.shape[0], h, q_per_kv - 1, dim)], dim=2)
            w = w.reshape(w.shape[0], -1)
        state[name] = w
    new.load_state_dict(state)
    return new


def stage_config(stage: int, vocab: Vocab) -> TaskConfig:
    hops, chains = CURRICULUM[stage]
    return TaskConfig(hops=(1, hops), chains=chains, distractor_hops=hops, vocab=vocab)


def batch(cfg: TaskConfig, n: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` right-padded; labels are -100 except on the answer tokens."""
    examples = [make_example(cfg, rng) for _ in range(n)]
    return _pad([e.prompt + e.target for e in examples],
                [[-100] * len(e.prompt) + e.target for e in examples])


def rehearsal_batch(cfg: TaskConfig, n: int, rng: random.Random, *,
                    max_edges: int | None = None, queries: int = 0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Training-only sequences that teach the lookup (induction) step directly: a prompt's
    edges ``u v ;`` (at least 8 chains, with ``cfg``'s fillers), then the same edges again in a
    new order and without fillers (at most ``max_edges`` of them), with the loss on every
    repeated ``v`` -- predictable only by finding ``u`` earlier in the context and copying what
    followed it. One lookup per edge instead of one per query is what moves the model off the
    plateau; with fillers the first listing's edges sit at irregular offsets, so the lookup
    must find ``u`` by content, where the answer of a filler prompt needs it.

    ``queries``: then that many queries in the task's own format, ``? u > ... <eos>`` from a
    random node of a random chain to the chain's end, the loss on every answer token -- the
    answer format's lookups (the first hop reads its node one position back) with many answers
    per prompt where a task sequence has one.
    """
    cfg = TaskConfig(hops=cfg.hops, chains=max(8, cfg.chains), distractor_hops=cfg.distractor_hops,
                     filler=cfg.filler, vocab=cfg.vocab)
    seqs, labels = [], []
    for _ in range(n):
        e = make_example(cfg, rng)
        prompt = e.prompt[:-3]  # without the query
        edges = [prompt[i:i + 3] for i in range(1, len(prompt) - 2) if prompt[i + 2] == SEP]
        rng.shuffle(edges)
        seq, lab = list(prompt), [-100] * len(prompt)
        for u, v, sep in edges[:max_edges]:
            seq += [u, v, sep]
            lab += [-100, v, -100]
        succ = {u: v for u, v, _ in edges}
        for u in rng.sample(sorted(succ), min(queries, len(succ))):
            answer = [succ[u]]
            while answer[-1] in succ:
                answer.append(succ[answer[-1]])
            seq += [QUERY, u, ANSWER] + answer + [EOS]
            lab += [-100, -100, -100] + answer + [EOS]
        seqs.append(seq)
        labels.append(lab)
    return _pad(seqs, labels)


def _pad(seqs: list[list[int]], labels: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    lab = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (x, y) in enumerate(zip(seqs, labels)):
        ids[i, :len(x)] = torch.tensor(x)
        lab[i, :len(y)] = torch.tensor(y)
    return ids, lab


@torch.no_grad()
def evaluate(model, cfg: TaskConfig, n: int, seed: int, chunk: int = 128) -> float:
    """Held-out exact-chain accuracy (fresh seed) under teacher forcing."""
    was_training = model.training
    model.eval()
    ids, labels = batch(cfg, n, random.Random(seed))
    ok = []
    for i in range(0, n, chunk):
        logits = model(input_ids=ids[i:i + chunk],
                       attention_mask=(ids[i:i + chunk] != PAD).long()).logits
        pred, target = logits[:, :-1].argmax(-1), labels[i:i + chunk, 1:]
        ok.append(((pred == target) | (target == -100)).all(dim=1))
    model.train(was_training)
    return float(torch.cat(ok).float().mean())


def _step(model, opt, sched, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One optimizer step on a batch (gradients clipped at norm 1); returns the loss."""
    loss = model(input_ids=ids, attention_mask=(ids != PAD).long(), labels=labels).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def _optimizer(model, lr: float, warmup: int, decay=lambda: 1.0):
    """AdamW with a linear warmup; ``decay()`` scales the rate after it (a time-based schedule
    reads the clock: the runs are time-boxed, so their step counts are not known ahead)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * decay())


def cosine_decay(start: float, seconds: float, floor: float):
    """``decay()`` for :func:`_optimizer`: 1 at ``start`` falling to ``floor`` at ``start +
    seconds`` along a half cosine, then ``floor``."""
    def decay() -> float:
        frac = min(1.0, max(0.0, (time.time() - start) / seconds))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * frac))
    return decay


def train(out: str | Path, *, minutes: float = 30.0, seed: int = 0, batch_size: int = 64,
          lr: float = 2e-3, warmup: int = 200, threshold: float = 0.95, eval_every: int = 100,
          q_per_kv: int = 2, mha_fraction: float = 0.7, tied: bool = True,
          threads: int | None = None) -> dict:
    """Run the recipe for ``minutes`` and write the best GQA checkpoint to ``out``.

    The MHA phase ends when the curriculum is done or ``mha_fraction`` of the time box has
    passed; :func:`to_gqa` then gives every KV head ``q_per_kv`` query heads."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    vocab = Vocab()
    model = build_model(vocab, seed, tied=tied)
    opt, sched = _optimizer(model, lr, warmup)
    rng = random.Random(seed)
    stage, step, history, phase, best = 0, 0, [], "mha", -1.0
    start = time.time()
    bar = tqdm(total=int(minutes * 60), unit="s", desc="training (time box)")
    model.train()
    while time.time() - start < minutes * 60:
        elapsed = time.time() - start
        if phase == "mha" and (elapsed > mha_fraction * minutes * 60 or stage == len(CURRICULUM)):
            model = to_gqa(model, q_per_kv, seed=seed).train()
            opt, sched = _optimizer(model, lr / 2, warmup // 2)
            phase = "gqa"
        done = stage == len(CURRICULUM)  # the curriculum is over: final task and filler
        cfg = stage_config(min(stage, len(CURRICULUM) - 1), vocab)
        if step % 2:
            ids, labels = rehearsal_batch(cfg, batch_size, rng)
        else:
            task = (final_task(vocab) if step % 4 == 0 else filler_task(vocab)) if done else cfg
            ids, labels = batch(task, batch_size, rng)
        loss = _step(model, opt, sched, ids, labels)
        step += 1
        if step % eval_every:
            continue
        judge = final_task(vocab) if done else stage_config(stage, vocab)
        acc = evaluate(model, judge, 256, seed=10_000 + step)
        value = float(loss.detach())
        history.append({"step": step, "phase": phase, "stage": stage, "loss": value,
                        "acc": acc, "minutes": (time.time() - start) / 60})
        bar.set_postfix(phase=phase, stage=stage, loss=f"{value:.3f}", acc=f"{acc:.3f}")
        bar.update(int(time.time() - start) - bar.n)
        if not done and acc >= threshold:
            stage += 1  # == len(CURRICULUM): the curriculum is over
        if phase == "gqa" and (done or stage == len(CURRICULUM)) and acc > best:
            best = acc  # the best final-task checkpoint is the one shipped
            save(model, vocab, out, {"history": history}, seed, final=False)
    bar.close()
    if best < 0:  # the curriculum did not finish in time: keep what there is, clearly labelled
        save(model if phase == "gqa" else to_gqa(model, q_per_kv, seed=seed), vocab, out,
             {"history": history}, seed, final=False)
    model, _ = load_reasoner(out)  # the best checkpoint
    report = {
        "steps": step, "minutes": (time.time() - start) / 60, "seed": seed, "lr": lr,
        "q_per_kv": q_per_kv, "mha_fraction": mha_fraction, "stage_reached": stage,
        "curriculum_finished": best >= 0, "best_heldout_during_training": best,
        "heldout_exact_chain": {
            f"hops{h}_chains24": evaluate(model, TaskConfig(hops=h, chains=24, distractor_hops=4,
                                                            vocab=vocab), 500, seed=99_000 + h)
            for h in (1, 2, 3, 4)},
        "heldout_exact_chain_filler": evaluate(model, filler_task(vocab), 500, seed=98_000),
        "history": history,
    }
    save(model, vocab, out, report, seed, final=True)
    return report


@torch.no_grad()
def widen(model, vocab: Vocab, new_vocab: Vocab, *, max_positions: int = 2048, seed: int = 0):
    """The same model over a larger node vocabulary (and a longer RoPE range in its config).

    Specials, fillers and the trained nodes keep their rows; every new node row is drawn from
    the trained node rows' mean and covariance (``mu + z @ (E - mu) / sqrt(n)``), so the new
    tokens start where the lookup circuits expect node tokens to lie. Tied embeddings only.
    """
    if new_vocab.num_fillers != vocab.num_fillers or new_vocab.num_nodes < vocab.num_nodes:
        raise ValueError(f"widen keeps the fillers and grows the nodes: {vocab} -> {new_vocab}.")
    if not model.config.tie_word_embeddings:
        raise ValueError("widen expects tied input/output embeddings.")
    emb = model.get_input_embeddings().weight
    nodes = emb[vocab.node(0):vocab.size]
    mean = nodes.mean(0)
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(new_vocab.num_nodes - vocab.num_nodes, nodes.shape[0], generator=gen)
    rows = torch.cat([emb, mean + z @ (nodes - mean) / nodes.shape[0] ** 0.5])
    cfg = type(model.config)(**{**model.config.to_dict(), "vocab_size": new_vocab.size,
                                "max_position_embeddings": max_positions})
    new = type(model)(cfg)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    state["model.embed_tokens.weight"] = rows
    new.load_state_dict(state, strict=False)
    new.tie_weights()
    return new


def train_long(out: str | Path, *, init: str | Path | None = None, minutes: float = 75.0,
               seed: int = 0, batch_size: int = 16, lr: float = 1e-3, warmup: int = 50,
               threshold: float = 0.95, eval_every: int = 50, rehearsal_edges: int = 96,
               rehearsal_queries: int = 16,
               heldout: int = 256, threads: int | None = None,
               stop_at: float | None = None, lr_final: float | None = None) -> dict:
    """Fine-tune a trained reasoner (default: the shipped short one) into the long reasoner.

    Every other batch is a rehearsal batch (:func:`rehearsal_batch`) on the stage's own prompts,
    fillers included, with at most ``rehearsal_edges`` edges repeated and ``rehearsal_queries``
    queries after them (one lookup per edge over the whole new vocabulary and every position of
    the stage: it is what teaches the new node rows, the positions past the short task's and,
    with fillers, the lookup by content); the task batches follow :data:`LONG_CURRICULUM`,
    advancing when held-out exact-chain accuracy passes ``threshold``. Each stage reached is
    checkpointed to ``out``; the shipped weights are the best checkpoint on the final stage.
    ``init`` may be an earlier run of this function (its vocabulary is already the long one):
    training resumes at the stage it reached, and the report lists the earlier legs.
    ``heldout``: items per hop count of the final report (the mid-run checks use at most 128 of
    the stage's mixed hop counts). ``stop_at``: a mid-run check on the final stage at or above
    it ends the run before the time box. ``lr_final``: the rate falls from ``lr`` to it over
    the time box along a half cosine (default: constant after the warmup).

    A run that resumes on the final stage first scores ``init``'s weights on the check items of
    step 0 and writes them to ``out``: a new checkpoint must beat that score (not the earlier
    leg's luckiest 128-item check), and ``out`` holds a reasoner whatever the new checks say.
    """
    if lr_final is not None and not 0 < lr_final <= lr:
        raise ValueError(f"lr_final={lr_final} must lie in (0, lr={lr}]: the rate falls to it.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if threads:
        torch.set_num_threads(threads)
    short, vocab = load_reasoner(init)
    model = widen(short, vocab, LONG_VOCAB, seed=seed).train()
    legs, stage, best = [], 0, -1.0
    records = [Path(init) / n for n in ("training.json", "training.partial.json")] \
        if init is not None and vocab == LONG_VOCAB else []
    records = [r for r in records if r.exists()]
    if records:  # a long run to resume: its newest record goes with its weights
        earlier = json.loads(max(records, key=lambda r: r.stat().st_mtime).read_text())
        legs = earlier.get("legs", []) + [{k: earlier.get(k) for k in (
            "init", "steps", "minutes", "stage_reached", "best_heldout_during_training")}]
        stage = min(earlier.get("stage_reached", 0), len(LONG_CURRICULUM) - 1)
    vocab = LONG_VOCAB
    step, history = 0, []
    last = len(LONG_CURRICULUM) - 1
    start = time.time()
    if records and stage == last:  # only a better checkpoint replaces the resumed weights
        chains, filler = LONG_CURRICULUM[stage]
        best = evaluate(model, long_task(vocab, chains=chains, filler=filler), min(128, heldout),
                        seed=10_000, chunk=32)
        history.append({"step": 0, "stage": stage, "chains": chains, "filler": filler,
                        "loss": None, "acc": best, "minutes": (time.time() - start) / 60})
        save(model, vocab, out, _partial(init, legs, step, start, stage, history), seed,
             final=False)
        start = time.time()  # the time box is for training
    floor = 1.0 if lr_final is None else lr_final / lr
    opt, sched = _optimizer(model, lr, warmup, cosine_decay(start, minutes * 60, floor))
    rng = random.Random(seed)
    bar = tqdm(total=int(minutes * 60), unit="s", desc="training long (time box)")
    while time.time() - start < minutes * 60:
        chains, filler = LONG_CURRICULUM[stage]
        cfg = long_task(vocab, chains=chains, filler=filler)
        if step % 2:  # lookups in the stage's own prompts
            ids, labels = rehearsal_batch(cfg, batch_size, rng, max_edges=rehearsal_edges,
                                          queries=rehearsal_queries)
        else:
            ids, labels = batch(cfg, batch_size, rng)
        loss = _step(model, opt, sched, ids, labels)
        step += 1
        if step % eval_every:
            continue
        acc = evaluate(model, cfg, min(128, heldout), seed=10_000 + step, chunk=32)
        value = float(loss.detach())
        history.append({"step": step, "stage": stage, "chains": chains, "filler": filler,
                        "loss": value, "acc": acc, "minutes": (time.time() - start) / 60})
        bar.set_postfix(chains=chains, filler=filler, loss=f"{value:.3f}", acc=f"{acc:.3f}")
        bar.update(int(time.time() - start) - bar.n)
        if stage == last and acc > best:
            best = acc
            save(model, vocab, out, _partial(init, legs, step, start, stage, history), seed,
                 final=False)
        elif stage < last and acc >= threshold:
            stage += 1  # checkpointed: a later run resumes here
            save(model, vocab, out, _partial(init, legs, step, start, stage, history), seed,
                 final=False)
        if history[-1]["stage"] == last and stop_at is not None and acc >= stop_at:
            break  # solved (on the final stage's items): even a check no better than the
            # run's best so far (the resumed weights' step-0 score included) ends the run
    bar.close()
    if best < 0:  # the curriculum did not reach the long task in time: keep what there is
        save(model, vocab, out, _partial(init, legs, step, start, stage, history), seed,
             final=False)
    model, _ = load_reasoner(out)
    report = {
        "task": "long", "init": str(init or SHIPPED), "legs": legs, "steps": step,
        "minutes": (time.time() - start) / 60, "seed": seed, "lr": lr,
        "lr_final": lr_final, "batch_size": batch_size, "rehearsal_edges": rehearsal_edges,
        "rehearsal_queries": rehearsal_queries, "stage_reached": stage,
        "curriculum_finished": best >= 0,
        "best_heldout_during_training": best,
        "heldout_exact_chain": {
            f"hops{h}_long": evaluate(model, long_task(vocab, hops=h), heldout,
                                      seed=99_000 + h, chunk=32)
            for h in (1, 2, 3, 4)},
        "history": history,
    }
    save(model, vocab, out, report, seed, final=True)
    return report


def _partial(init, legs, step, start, stage, history) -> dict:
    """The training record of a checkpoint taken mid-run (what a resumed run reads)."""
    return {"task": "long", "init": str(init or SHIPPED), "legs": legs, "steps": step,
            "minutes": (time.time() - start) / 60, "stage_reached": stage, "history": history}


def save(model, vocab: Vocab, out: Path, report, seed: int, *, final: bool) -> None:
    """Weights as safetensors, the HF config, the vocabulary, and the training record."""
    tied = model.config.tie_word_embeddings
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}  # the embeddings hold it
    save_file(state, str(out / "model.safetensors"), metadata={"seed": str(seed)})
    model.config.to_json_file(str(out / "config.json"))
    (out / "vocab.json").write_text(json.dumps(asdict(vocab)) + "\n")
    name = "training.json" if final else "training.partial.json"
    from tierattn.eval.report import provenance

    (out / name).write_text(json.dumps({**report, "provenance": provenance()}, indent=1) + "\n")


def load_reasoner(folder: str | Path | None = None):
    """``(model, vocab)`` of a trained reasoner (default: the one shipped in the package)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder) if folder is not None else SHIPPED
    if not (folder / "model.safetensors").exists():
        task = " --task long" if folder.resolve() == SHIPPED_LONG else ""
        raise FileNotFoundError(
            f"no trained reasoner in {folder}; train one with "
            f"`python -m tierattn.eval.training.reasoner{task} --out {folder}`.")
    vocab = Vocab(**json.loads((folder / "vocab.json").read_text()))
    model = LlamaForCausalLM(LlamaConfig.from_json_file(str(folder / "config.json")))
    missing, unexpected = model.load_state_dict(load_file(str(folder / "model.safetensors")),
                                                strict=False)
    tied = model.config.tie_word_embeddings
    if unexpected or any(not (tied and k == "lm_head.weight") for k in missing):
        raise ValueError(f"{folder}: weights do not match the config (missing {missing}, "
                         f"unexpected {unexpected}).")
    if tied:
        model.tie_weights()
    return model.eval(), vocab


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--task", choices=("short", "long"), default="short",
                   help="short: the shipped reasoner from scratch; long: fine-tune a reasoner "
                   "(--init, default the shipped one) on 1K-token prompts")
    p.add_argument("--init", default=None, help="--task long: the reasoner to start from (a "
                   "long run's folder: resume at the stage it reached)")
    p.add_argument("--threshold", type=float, default=0.95,
                   help="--task long: held-out accuracy that advances the curriculum")
    p.add_argument("--stop-at", type=float, default=None,
                   help="--task long: final-stage held-out accuracy that ends the run early")
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--q-per-kv", type=int, default=2, help="query heads per KV head of the "
                   "shipped GQA model")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default 2e-3; --task long 1e-3)")
    p.add_argument("--lr-final", type=float, default=None,
                   help="--task long: the rate falls to it over the time box (half cosine)")
    p.add_argument("--mha-fraction", type=float, default=0.7,
                   help="most of the time box spent on the MHA curriculum before GQA")
    p.add_argument("--untied", action="store_true", help="separate output embeddings")
    args = p.parse_args(argv)
    if args.task == "short" and args.lr_final is not None:
        p.error("--lr-final is a --task long option (the short recipe's rate is fixed).")
    for name in ("lr", "lr_final"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be a positive rate, got "
                    f"{getattr(args, name)}.")
    lr = args.lr if args.lr is not None else 1e-3 if args.task == "long" else 2e-3
    if args.task == "long":
        report = train_long(args.out, init=args.init, minutes=args.minutes, seed=args.seed,
                            threads=args.threads, threshold=args.threshold,
                            stop_at=args.stop_at, lr=lr, lr_final=args.lr_final)
        print(json.dumps(report["heldout_exact_chain"], indent=1))
        return 0
    report = train(args.out, minutes=args.minutes, seed=args.seed, q_per_kv=args.q_per_kv,
                   lr=lr, mha_fraction=args.mha_fraction, tied=not args.untied,
                   threads=args.threads)
    print(json.dumps({k: report[k] for k in ("heldout_exact_chain",
                                             "heldout_exact_chain_filler")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
