"""The pointer-chasing task generator: answers follow the edges, chains are disjoint, the oracle
positions point at the needed edges, lengths and seeds behave."""

from __future__ import annotations

import random

import pytest

from tierattn.eval.evals.tasks import ANSWER, BOS, EOS, QUERY, SEP, TaskConfig, Vocab, make_examples


def follow(prompt: list[int], start: int, hops: int) -> list[int]:
    edges = {}
    i = 1
    while prompt[i] != QUERY:
        if prompt[i + 2] == SEP and i + 2 < len(prompt):
            edges[prompt[i]] = prompt[i + 1]
            i += 3
        else:  # filler
            i += 1
    out, node = [], start
    for _ in range(hops):
        node = edges[node]
        out.append(node)
    return out


@pytest.mark.parametrize("cfg", [
    TaskConfig(hops=1, chains=4),
    TaskConfig(hops=4, chains=24),
    TaskConfig(hops=(1, 4), chains=8, filler=(0, 3)),
    TaskConfig(hops=3, chains=10, distractor_hops=1, vocab=Vocab(num_nodes=64, num_fillers=4)),
], ids=["1hop", "4hop-24chains", "mixed-filler", "short-distractors"])
def test_examples_are_well_formed(cfg):
    vocab = cfg.vocab
    for ex in make_examples(cfg, 50, seed=3):
        assert ex.prompt[0] == BOS and ex.prompt[-3:] == [QUERY, ex.chain[0], ANSWER]
        assert ex.target == ex.chain[1:] + [EOS]
        assert cfg.hop_range[0] <= ex.hops <= cfg.hop_range[1]
        assert follow(ex.prompt, ex.chain[0], ex.hops) == ex.chain[1:]  # the answer follows
        nodes = [t for t in ex.prompt[1:-3] if vocab.is_node(t)]
        assert len(nodes) == 2 * (len(set(nodes)) - cfg.chains)  # disjoint chains
        for i, (a, b) in enumerate(ex.needed_edges):
            assert ex.prompt[a:b] == [ex.chain[i], ex.chain[i + 1], SEP]


def test_default_contexts_are_long_enough_for_pages_to_matter():
    lengths = [len(ex.prompt) for ex in make_examples(TaskConfig(hops=4, chains=24), 20, 0)]
    assert min(lengths) >= 256


def test_same_seed_same_examples_other_seed_others():
    cfg = TaskConfig(hops=(1, 4), chains=8, filler=(0, 2))
    assert make_examples(cfg, 10, 7) == make_examples(cfg, 10, 7)
    assert make_examples(cfg, 10, 7) != make_examples(cfg, 10, 8)


def test_vocab_round_trip_and_errors():
    vocab = Vocab(num_nodes=16, num_fillers=2)
    ex = make_examples(TaskConfig(hops=2, chains=3, filler=(1, 1), vocab=vocab), 1, 0)[0]
    assert vocab.encode(vocab.decode(ex.prompt + ex.target)) == ex.prompt + ex.target
    assert vocab.size == 6 + 2 + 16
    with pytest.raises(ValueError, match="outside"):
        vocab.encode("n16")
    with pytest.raises(ValueError, match="unknown token"):
        vocab.encode("hello")


@pytest.mark.parametrize("kw,match", [
    (dict(hops=0), "hops"), (dict(hops=(3, 2)), "hops"), (dict(chains=0), "chains"),
    (dict(chains=40, hops=4), "distinct nodes"), (dict(filler=(2, 1)), "filler"),
])
def test_bad_task_configs(kw, match):
    with pytest.raises(ValueError, match=match):
        TaskConfig(**kw)


def test_every_edge_position_is_a_uniform_shuffle():
    # the queried chain's first edge lands anywhere in the prompt, not always first
    firsts = {ex.needed_edges[0][0] for ex in make_examples(TaskConfig(hops=2, chains=8),
                                                              200, random.randrange(1 << 30))}
    assert len(firsts) > 8
