"""The tiny-reasoner training script: a few seconds of training write loadable weights whose
logits match the trained model, and the accuracy metric means exact chains."""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from tierattn.eval.evals.tasks import TaskConfig, Vocab
from tierattn.eval.evals.tasks import LONG_VOCAB, long_task
from tierattn.eval.training.reasoner import (LONG_CURRICULUM, SHIPPED_LONG, batch, build_model,
                                          cosine_decay, evaluate, load_reasoner, main,
                                          rehearsal_batch, save, to_gqa, train, train_long,
                                          widen)


def test_short_training_run_writes_loadable_weights(tmp_path):
    report = train(tmp_path, minutes=0.05, batch_size=8, eval_every=5, threads=1)
    assert report["steps"] > 0 and set(report["heldout_exact_chain"]) == {
        "hops1_chains24", "hops2_chains24", "hops3_chains24", "hops4_chains24"}
    assert json.loads((tmp_path / "training.json").read_text())["steps"] == report["steps"]
    model, vocab = load_reasoner(tmp_path)
    ids, _ = batch(TaskConfig(hops=2, chains=4, vocab=vocab), 2, random.Random(0))
    again, _ = load_reasoner(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, again(input_ids=ids).logits)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_exact_chain_metric_is_all_answer_tokens():
    vocab = Vocab()
    model = build_model(vocab)
    cfg = TaskConfig(hops=2, chains=4, vocab=vocab)
    assert evaluate(model, cfg, 32, seed=1) < 0.5  # an untrained model gets chains wrong


@pytest.mark.parametrize("filler, max_edges", [((0, 0), None), ((1, 2), 5)])
def test_rehearsal_labels_are_lookups_into_the_context(filler, max_edges):
    vocab = Vocab()
    cfg = TaskConfig(hops=(1, 3), chains=4, distractor_hops=3, filler=filler, vocab=vocab)
    ids, labels = rehearsal_batch(cfg, 3, random.Random(0), max_edges=max_edges)
    for row, lab in zip(ids.tolist(), labels.tolist()):
        marked = [i for i, y in enumerate(lab) if y != -100]
        listed = row.count(3) - len(marked)  # 3 is ';': the first listing's edges
        assert listed >= 7 * 3 + 1  # every edge of the (at least 8) chains
        assert len(marked) == (listed if max_edges is None else max_edges)
        fillers = sum(vocab.filler(0) <= t < vocab.node(0) for t in row)
        assert (fillers >= listed) == bool(filler[1])  # the first listing keeps the fillers
        start = marked[0] - 1  # the repeats: edges of 3 tokens, no fillers
        assert all(row[i] == 3 for i in range(start + 2, marked[-1] + 2, 3))
        for i in marked:
            u, v = row[i - 1], row[i]
            assert lab[i] == v
            # the first listing taught u -> v: u at an edge's start, v after it
            assert any(row[j:j + 3] == [u, v, 3] for j in range(1, start))


def test_gqa_expansion_preserves_the_function():
    # the new query heads start with a zero output projection, so the GQA model computes what
    # the trained MHA model did, and every KV head now serves two query heads
    vocab = Vocab()
    mha = build_model(vocab, seed=1).eval()
    gqa = to_gqa(mha, 2).eval()
    assert (gqa.config.num_attention_heads, gqa.config.num_key_value_heads) == (16, 8)
    ids, _ = batch(TaskConfig(hops=2, chains=4, vocab=vocab), 2, random.Random(0))
    with torch.no_grad():
        assert torch.allclose(mha(input_ids=ids).logits, gqa(input_ids=ids).logits, atol=1e-5)
    with pytest.raises(ValueError, match="expands an MHA model"):
        to_gqa(gqa, 2)


def test_shipped_reasoner_meets_the_target_on_fresh_items():
    # the package's own weights: >= 95% exact chains at 3 and 4 hops with 23 distractor chains
    # (~290-token prompts), on items no training or eval seed produced
    model, vocab = load_reasoner()
    assert (model.config.num_attention_heads, model.config.num_key_value_heads) == (16, 8)
    for hops in (3, 4):
        cfg = TaskConfig(hops=hops, chains=24, distractor_hops=4, vocab=vocab)
        assert evaluate(model, cfg, 200, seed=424_242 + hops) >= 0.95


def test_shipped_long_reasoner_holds_its_recorded_accuracy():
    # the long reasoner's weights as shipped (its record says 0.83-0.93 exact chains on 256
    # held-out items per hop count); fresh items, 1016-1284-token prompts
    model, vocab = load_reasoner(SHIPPED_LONG)
    assert vocab == LONG_VOCAB and model.config.num_key_value_heads == 8
    record = json.loads((SHIPPED_LONG / "training.json").read_text())
    assert record["stage_reached"] == len(LONG_CURRICULUM) - 1
    for hops in (1, 4):
        recorded = record["heldout_exact_chain"][f"hops{hops}_long"]
        got = evaluate(model, long_task(vocab, hops=hops), 128, seed=525_252 + hops, chunk=32)
        assert got >= recorded - 0.15  # 128 items: a standard error of ~4.4 points


def test_widen_keeps_the_function_on_the_old_tokens():
    """More node tokens, the same logits for sequences of the old ones (over the old vocabulary),
    new rows drawn from the trained nodes' spread; the fillers must stay, the nodes not shrink."""
    vocab = Vocab()
    small = build_model(vocab, seed=2, heads=16, kv_heads=8).eval()
    big = widen(small, vocab, LONG_VOCAB).eval()
    assert big.config.vocab_size == LONG_VOCAB.size and big.config.max_position_embeddings == 2048
    assert big.lm_head.weight.data_ptr() == big.model.embed_tokens.weight.data_ptr()
    ids, _ = batch(TaskConfig(hops=2, chains=4, vocab=vocab), 2, random.Random(0))
    with torch.no_grad():
        torch.testing.assert_close(big(input_ids=ids).logits[..., :vocab.size],
                                   small(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    old = small.model.embed_tokens.weight[vocab.node(0):]
    new = big.model.embed_tokens.weight[vocab.size:]
    assert new.shape[0] == LONG_VOCAB.num_nodes - vocab.num_nodes
    assert 0.5 < float(new.norm(dim=1).mean() / old.norm(dim=1).mean()) < 2.0
    with pytest.raises(ValueError, match="fillers"):
        widen(small, vocab, Vocab(num_nodes=64))


def test_long_task_prompts_are_over_1k_tokens():
    cfg = long_task()
    assert cfg.hop_range == (1, 4)
    # the shortest prompt: a 1-hop query among 63 distractors of 4 hops, one filler per edge
    shortest = 1 + (1 + 63 * 4) * (3 + cfg.filler[0]) + 3
    assert shortest == 1016 >= 1000
    ids, _ = batch(cfg, 64, random.Random(0))
    assert int((ids != 0).sum(1).min()) >= shortest + 2  # prompt and answer, no padding


def test_short_long_training_run_starts_from_a_reasoner(tmp_path):
    init = tmp_path / "short"  # an (untrained) short reasoner's folder
    init.mkdir()
    save(build_model(Vocab(), heads=16, kv_heads=8), Vocab(), init, {}, 0, final=True)
    report = train_long(tmp_path / "long", init=init, minutes=0.05, batch_size=2,
                        eval_every=2, heldout=2, threads=1)
    assert report["steps"] > 0 and report["init"] == str(init)
    assert set(report["heldout_exact_chain"]) == {f"hops{h}_long" for h in (1, 2, 3, 4)}
    model, vocab = load_reasoner(tmp_path / "long")
    assert vocab == LONG_VOCAB and model.config.vocab_size == LONG_VOCAB.size
    # a second leg resumes from the first: the same vocabulary, the first leg on record
    again = train_long(tmp_path / "long2", init=tmp_path / "long", minutes=0.02, batch_size=2,
                       eval_every=2, heldout=2, threads=1)
    assert [leg["steps"] for leg in again["legs"]] == [report["steps"]]
    assert again["stage_reached"] >= report["stage_reached"]


def test_long_training_stops_early_on_the_final_stage(tmp_path):
    """``stop_at`` ends a run at the first final-stage check that reaches it, long before the
    time box; the stop still writes the final report and the best weights."""
    init = tmp_path / "final"  # a long run that reached the final stage
    init.mkdir()
    save(widen(build_model(Vocab(), heads=16, kv_heads=8), Vocab(), LONG_VOCAB), LONG_VOCAB,
         init, {"task": "long", "steps": 3, "stage_reached": len(LONG_CURRICULUM) - 1}, 0,
         final=True)
    report = train_long(tmp_path / "out", init=init, minutes=10, batch_size=2, eval_every=2,
                        heldout=2, threads=1, stop_at=0.0)
    assert report["steps"] == 2 and report["minutes"] < 5
    assert report["stage_reached"] == len(LONG_CURRICULUM) - 1 and report["curriculum_finished"]
    assert (tmp_path / "out" / "training.json").exists()


def test_resumed_final_stage_run_keeps_its_start_unless_a_check_beats_it(tmp_path):
    """A run resumed on the final stage scores its starting weights first and writes them to
    ``out``: with an earlier record claiming a best no check can reach, ``out`` still ends with a
    loadable reasoner and the whole report (it used to hold nothing and the final load failed)."""
    init = tmp_path / "final"
    init.mkdir()
    start = widen(build_model(Vocab(), heads=16, kv_heads=8), Vocab(), LONG_VOCAB)
    save(start, LONG_VOCAB, init, {"task": "long", "steps": 3, "best_heldout_during_training": 1.5,
                                   "stage_reached": len(LONG_CURRICULUM) - 1}, 0, final=True)
    report = train_long(tmp_path / "out", init=init, minutes=0.02, batch_size=2, eval_every=1,
                        heldout=2, threads=1, lr_final=1e-4)
    assert report["history"][0]["step"] == 0 and report["history"][0]["loss"] is None
    assert len(report["history"]) > 1  # checks ran after step 0
    assert report["best_heldout_during_training"] == max(h["acc"] for h in report["history"])
    assert report["legs"][-1]["best_heldout_during_training"] == 1.5
    load_reasoner(tmp_path / "out")
    # with no check after step 0 nothing can beat the start: trained steps are not shipped
    report = train_long(tmp_path / "kept", init=init, minutes=0.02, batch_size=2,
                        eval_every=10**6, heldout=2, threads=1)
    assert report["steps"] > 0 and [h["step"] for h in report["history"]] == [0]
    model, _ = load_reasoner(tmp_path / "kept")
    for k, v in start.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v)
    with pytest.raises(ValueError, match="lr_final"):
        train_long(tmp_path / "bad", init=init, minutes=0.01, lr=1e-3, lr_final=2e-3)


def test_lr_final_is_refused_for_the_short_recipe(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--lr-final", "1e-4", "--out", str(tmp_path)])
    assert "--lr-final is a --task long option" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--lr", "--lr-final"])
@pytest.mark.parametrize("value", ["0", "-1e-3"])
def test_a_rate_that_is_not_positive_is_refused_by_name(tmp_path, capsys, flag, value):
    # (a zero --lr used to fall back to the task's default rate without a word)
    with pytest.raises(SystemExit):
        main(["--task", "long", f"{flag}={value}", "--out", str(tmp_path)])
    assert f"{flag} must be a positive rate" in capsys.readouterr().err
    assert not (tmp_path / "training.json").exists()


def test_cosine_decay_falls_from_one_to_its_floor():
    now = time.time()
    assert cosine_decay(now, 100.0, 0.1)() == pytest.approx(1.0, abs=1e-3)
    assert cosine_decay(now - 50, 100.0, 0.1)() == pytest.approx(0.55, abs=1e-2)
    assert cosine_decay(now - 500, 100.0, 0.1)() == pytest.approx(0.1)


def test_rehearsal_queries_follow_their_chain_to_its_end():
    """The queries after the repeated edges have the task's format, ``? u > v ... <eos>``, and
    each answer walks the prompt's edges from ``u`` until no edge leaves the last node."""
    vocab = Vocab()
    cfg = TaskConfig(hops=(1, 3), chains=8, distractor_hops=3, filler=(1, 2), vocab=vocab)
    ids, labels = rehearsal_batch(cfg, 2, random.Random(1), max_edges=0, queries=5)
    for row, lab in zip(ids.tolist(), labels.tolist()):
        row = [t for t in row if t != 0]
        first = row.index(4)  # 4 is '?': the queries follow the prompt (no edge repeated)
        succ = {row[j]: row[j + 1] for j in range(1, first - 2) if row[j + 2] == 3}
        tail, tail_lab = row[first:], lab[first:len(row)]
        starts = [i for i, t in enumerate(tail) if t == 4]
        assert len(starts) == 5
        for s, e in zip(starts, starts[1:] + [len(tail)]):
            u, answer = tail[s + 1], tail[s + 3:e]
            assert tail[s + 2] == 5 and answer[-1] == 2  # '>' then ... '<eos>'
            walk = [succ[u]]
            while walk[-1] in succ:
                walk.append(succ[walk[-1]])
            assert answer[:-1] == walk and tail_lab[s + 3:e] == answer
            assert tail_lab[s:s + 3] == [-100] * 3
