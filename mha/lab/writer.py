"""A model that writes (section 4.4): the course's prose as text to learn, a small character-level
decoder built around *any* causal self-attention layer, its training loop, a decode loop over the
layer's own KV cache, and where its heads look.

The attention layer is the learner's: a class ``Layer(E, H)`` with four ``nn.Linear(E, E)``
projections named ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` (as in section 3.1) and a
``forward(x, real=None, cache=None)``: ``x`` is ``(B, L, E)``; ``real``, optional, is a ``(B, S)``
bool mask, True for a real token and False for padding; ``cache``, optional, is a dict that the
layer reads its past keys and values from (``cache["k"]``, ``cache["v"]``, each ``(B, H, S, D)``)
and appends the new ones to. Everything here only uses that layer; nothing calls ``mha``'s
attention.

The text, ``mha/data/course_prose.txt``, is built by ``tools/writer_text.py`` from the course's
own pages and shares the repository's licence (MIT).
"""

from __future__ import annotations

import contextlib
import importlib.resources
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

TEXT = "course_prose.txt"


def load_text() -> str:
    """The course's English prose (about 250 kB of printable ASCII), read from the package."""
    return importlib.resources.files("mha.data").joinpath(TEXT).read_text(encoding="ascii")


class Chars:
    """A character vocabulary: ``encode`` a string to a 1-D tensor of ids, ``decode`` back."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: Tensor | list[int]) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else ids
        return "".join(self.chars[i] for i in ids)


class Block(nn.Module):
    """A pre-norm Transformer block around a causal self-attention layer (section 3.4)."""

    def __init__(self, attn: nn.Module, E: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(E), attn
        self.norm2 = nn.LayerNorm(E)
        self.mlp = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))

    def forward(self, x: Tensor, cache: dict | None = None) -> Tensor:
        x = x + self.attn(self.norm1(x), cache=cache)  # (B, L, E)
        return x + self.mlp(self.norm2(x))


class CharModel(nn.Module):
    """Characters in, the next character's logits out: embeddings of the character and of its
    position, ``blocks`` pre-norm blocks built on ``Layer(E, H)``, a final norm and a linear map
    to the vocabulary."""

    def __init__(
        self, Layer: Callable[[int, int], nn.Module], vocab: int, E: int = 64, H: int = 4,
        blocks: int = 2, context: int = 128,
    ) -> None:  # fmt: skip
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, E)  # what the character is
        self.pos = nn.Embedding(context, E)  # where it is: a learned vector per position
        self.blocks = nn.ModuleList(Block(Layer(E, H), E) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(E), nn.Linear(E, vocab)

    def forward(self, ids: Tensor, caches: list[dict] | None = None) -> Tensor:
        """``ids`` (B, L) -> logits (B, L, vocab). With ``caches`` (one dict per block), the ids
        continue the cached ones: their positions start after them."""
        start = caches[0]["k"].shape[-2] if caches and "k" in caches[0] else 0
        positions = torch.arange(start, start + ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(positions)  # (B, L, E)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if caches is None else caches[i])
        return self.head(self.norm(x))  # (B, L, vocab)


def batches(
    data: Tensor, steps: int, batch: int, length: int, generator: torch.Generator
) -> Tensor:
    """``(steps, batch, length + 1)`` windows of ``data`` at random starts: inputs and, shifted
    by one, targets."""
    starts = torch.randint(len(data) - length - 1, (steps, batch), generator=generator)
    return data[starts[..., None] + torch.arange(length + 1)]


@dataclass
class Run:
    """What :func:`train` did: the loss at every step and how long it took."""

    losses: list[float]
    seconds: float


def train(
    model: nn.Module, data: Tensor, *, steps: int, batch: int = 16, length: int = 64,
    lr: float = 3e-3, seed: int = 0, device: str | torch.device = "cpu",
) -> Run:  # fmt: skip
    """Train ``model`` to predict the next character of windows of ``data`` (AdamW, cross-entropy,
    the learning rate decayed linearly to a tenth); the windows are drawn on the CPU from a
    generator seeded with ``seed``."""
    windows = batches(data, steps, batch, length, torch.Generator().manual_seed(seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - 0.9 * s / steps)
    model.train()
    losses, began = [], time.perf_counter()
    for window in windows.to(device):
        logits = model(window[:, :-1])  # (B, L, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    model.eval()
    return Run(losses, time.perf_counter() - began)


@torch.no_grad()
def loss_on(model: nn.Module, data: Tensor, *, length: int = 64, windows: int = 64) -> float:
    """The mean next-character cross-entropy (nats) of ``model`` on ``windows`` evenly spaced
    windows of ``data``."""
    device = next(model.parameters()).device
    starts = torch.linspace(0, len(data) - length - 1, windows).long()
    w = data[starts[:, None] + torch.arange(length + 1)].to(device)
    logits = model(w[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten()).item()


@torch.no_grad()
def head_weights(model: CharModel, ids: Tensor, block: int = 0) -> Tensor:
    """The causal attention weights ``(H, L, L)`` of every head of ``block`` on one sequence
    ``ids`` (L,), recomputed from the layer's ``q_proj`` and ``k_proj``."""
    x = model.tok(ids[None]) + model.pos(torch.arange(len(ids), device=ids.device))
    for b in model.blocks[:block]:
        x = b(x)
    layer: Block = model.blocks[block]  # type: ignore[assignment]
    attn: Any = layer.attn  # the learner's layer
    h = layer.norm1(x)  # (1, L, E)
    H, L = _heads(attn), len(ids)
    q, k = (p(h).view(1, L, H, -1).transpose(1, 2) for p in (attn.q_proj, attn.k_proj))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (1, H, L, L)
    future = torch.ones(L, L, dtype=torch.bool, device=ids.device).triu(1)
    return scores.masked_fill(future, -math.inf).softmax(-1)[0]


def _heads(attn: nn.Module) -> int:
    """The number of heads of a layer: its ``num_heads`` (or ``H``, ``heads``) attribute."""
    for name in ("num_heads", "H", "heads", "n_heads"):
        value = getattr(attn, name, None)
        if isinstance(value, int):
            return value
    raise AttributeError(f"{type(attn).__name__} should keep its number of heads as num_heads")


def previous_char_weight(weights: Tensor) -> Tensor:
    """``(H,)``: each head's mean weight on the key just before its query (queries 1..L-1)."""
    return weights.diagonal(offset=-1, dim1=-2, dim2=-1).mean(-1)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One CPU thread: a training run on the CPU repeats exactly, and a busy machine slows it
    least. The previous setting comes back on the way out."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def baselines(train: Tensor, held_out: Tensor, vocab: int) -> dict[str, float]:
    """Held-out losses (nats) of models without attention: guessing uniformly, the characters'
    frequencies (unigram), and the next character from the current one (bigram), both counted on
    ``train`` with add-one smoothing."""
    ones = torch.ones(len(train) - 1)
    pairs = torch.ones(vocab, vocab).index_put_((train[:-1], train[1:]), ones, accumulate=True)
    unigram = torch.ones(vocab).index_put_((train,), torch.ones(len(train)), accumulate=True)
    bigram = (pairs / pairs.sum(1, keepdim=True)).log()[held_out[:-1], held_out[1:]]
    return {
        "uniform": math.log(vocab),
        "unigram": -(unigram / unigram.sum()).log()[held_out].mean().item(),
        "bigram": -bigram.mean().item(),
    }
