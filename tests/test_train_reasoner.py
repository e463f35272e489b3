"""The tiny-reasoner training script: a few seconds of training write loadable weights whose
logits match the trained model, and the accuracy metric means exact chains."""

from __future__ import annotations

import json
import random

import torch

from tierattn.eval.tasks import TaskConfig, Vocab
from tierattn.eval.train_reasoner import batch, build_model, evaluate, load_reasoner, train


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
