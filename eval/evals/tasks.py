"""Multi-hop pointer chasing with chain-of-thought: the synthetic reasoning task of the tiny
reasoner (DESIGN.md, Evaluation, level 1).

A prompt lists the edges ``u v ;`` of several disjoint chains in random order (the queried chain
plus distractors, optionally separated by filler tokens), then asks ``? v0 >``; the answer writes
the queried chain hop by hop, ``v1 v2 ... vH``, then ``<eos>``. The edge needed at hop ``i+1``
becomes important only after hop ``i`` was generated, which is what makes prefill-time eviction
fail while offloading keeps the answer reachable.

Token ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``;``, 4 ``?``, 5 ``>``, then the filler
tokens ``f0..``, then the node tokens ``n0..``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Example", "LONG_VOCAB", "TaskConfig", "Vocab", "long_task", "make_example",
           "make_examples"]

SPECIALS = ("<pad>", "<bos>", "<eos>", ";", "?", ">")
PAD, BOS, EOS, SEP, QUERY, ANSWER = range(len(SPECIALS))


@dataclass(frozen=True)
class Vocab:
    """Token ids of the task: specials, ``num_fillers`` filler tokens, ``num_nodes`` nodes."""

    num_nodes: int = 128
    num_fillers: int = 16

    @property
    def size(self) -> int:
        return len(SPECIALS) + self.num_fillers + self.num_nodes

    def node(self, i: int) -> int:
        return len(SPECIALS) + self.num_fillers + i

    def filler(self, i: int) -> int:
        return len(SPECIALS) + i

    def is_node(self, token: int) -> bool:
        return len(SPECIALS) + self.num_fillers <= token < self.size

    def token_str(self, token: int) -> str:
        if token < len(SPECIALS):
            return SPECIALS[token]
        if token < len(SPECIALS) + self.num_fillers:
            return f"f{token - len(SPECIALS)}"
        return f"n{token - len(SPECIALS) - self.num_fillers}"

    def decode(self, tokens: list[int]) -> str:
        return " ".join(self.token_str(t) for t in tokens)

    def encode(self, text: str) -> list[int]:
        lookup = {s: i for i, s in enumerate(SPECIALS)}
        out = []
        for word in text.split():
            if word in lookup:
                out.append(lookup[word])
            elif word[0] in "fn" and word[1:].isdigit():
                i = int(word[1:])
                limit = self.num_fillers if word[0] == "f" else self.num_nodes
                if not 0 <= i < limit:
                    raise ValueError(f"token {word!r} is outside this vocabulary.")
                out.append(self.filler(i) if word[0] == "f" else self.node(i))
            else:
                raise ValueError(f"unknown token {word!r}.")
        return out


@dataclass(frozen=True)
class TaskConfig:
    """Parameters of one task distribution.

    Attributes:
        hops: edges to follow (answer length before ``<eos>``); an int, or a ``(low, high)``
            range sampled per example (mixed hop counts keep 1-hop queries working).
        chains: chains in the prompt (the queried one plus ``chains - 1`` distractors).
        distractor_hops: length of each distractor chain (default: the same as ``hops``).
        filler: ``(low, high)`` filler tokens inserted after each edge (0 disables).
        vocab: the vocabulary (``num_nodes`` must cover every chain's nodes).
    """

    hops: int | tuple[int, int] = 4
    chains: int = 24
    distractor_hops: int | None = None
    filler: tuple[int, int] = (0, 0)
    vocab: Vocab = field(default_factory=Vocab)

    def __post_init__(self) -> None:
        low, high = self.hop_range
        if not 1 <= low <= high:
            raise ValueError(f"hops must be >= 1 (or a range low <= high), got {self.hops!r}.")
        if self.chains < 1:
            raise ValueError(f"chains must be >= 1, got {self.chains}.")
        longest = max(high, self.distractor_hops or high)
        if self.chains * (longest + 1) > self.vocab.num_nodes:
            raise ValueError(
                f"{self.chains} chains of up to {longest} hops need {self.chains * (longest + 1)}"
                f" distinct nodes but the vocabulary has num_nodes={self.vocab.num_nodes}.")
        f_low, f_high = self.filler
        if not 0 <= f_low <= f_high or (f_high and not self.vocab.num_fillers):
            raise ValueError(f"filler must be a range 0 <= low <= high with filler tokens in the "
                             f"vocabulary, got {self.filler!r}.")

    @property
    def hop_range(self) -> tuple[int, int]:
        return (self.hops, self.hops) if isinstance(self.hops, int) else tuple(self.hops)


#: the long task's vocabulary (the long reasoner's): 512 node tokens
LONG_VOCAB = Vocab(num_nodes=512)


def long_task(vocab: Vocab = LONG_VOCAB, *, hops: int | tuple[int, int] = (1, 4),
              chains: int = 64, filler: tuple[int, int] = (1, 2)) -> TaskConfig:
    """The long task: ``hops`` among ``chains`` chains of 4 hops with ``filler`` tokens after
    every edge -- by default 64 chains (253-256 edges) and 1-2 fillers, prompts of 1016-1284
    tokens (~1150 on average, a third filler) where 10% of the prompt is ~14 pages of 8 and the
    answer needs 1-4 edges."""
    return TaskConfig(hops=hops, chains=chains, distractor_hops=4, filler=filler, vocab=vocab)


@dataclass(frozen=True)
class Example:
    """One query.

    Attributes:
        prompt: token ids ``<bos> edges... ? v0 >``.
        target: ``v1 ... vH <eos>``.
        chain: the queried chain's node tokens ``v0 .. vH``.
        needed_edges: ``(start, end)`` prompt positions of the queried chain's edges, in hop
            order (what an oracle must keep).
    """

    prompt: list[int]
    target: list[int]
    chain: list[int]
    needed_edges: list[tuple[int, int]]

    @property
    def hops(self) -> int:
        return len(self.chain) - 1


def make_example(cfg: TaskConfig, rng: random.Random) -> Example:
    """Draw one example of ``cfg`` with ``rng``."""
    vocab = cfg.vocab
    hops = rng.randint(*cfg.hop_range)
    lengths = [hops] + [cfg.distractor_hops or hops for _ in range(cfg.chains - 1)]
    nodes = rng.sample(range(vocab.num_nodes), sum(n + 1 for n in lengths))
    chains, pos = [], 0
    for n in lengths:
        chains.append([vocab.node(i) for i in nodes[pos:pos + n + 1]])
        pos += n + 1
    edges = [(c[i], c[i + 1], k, i) for k, c in enumerate(chains) for i in range(len(c) - 1)]
    rng.shuffle(edges)
    prompt, needed = [BOS], {}
    for u, v, k, i in edges:
        if k == 0:
            needed[i] = (len(prompt), len(prompt) + 3)
        prompt += [u, v, SEP]
        prompt += [vocab.filler(rng.randrange(vocab.num_fillers))
                   for _ in range(rng.randint(*cfg.filler))] if cfg.filler[1] else []
    query = chains[0]
    prompt += [QUERY, query[0], ANSWER]
    return Example(prompt=prompt, target=query[1:] + [EOS], chain=query,
                   needed_edges=[needed[i] for i in range(hops)])


def make_examples(cfg: TaskConfig, n: int, seed: int) -> list[Example]:
    """``n`` examples from a seeded generator (the same seed gives the same examples)."""
    rng = random.Random(seed)
    return [make_example(cfg, rng) for _ in range(n)]
