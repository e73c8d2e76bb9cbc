"""Real text that every machine has, and global batches that depend only on (seed, step).

The corpus is the Python Language Reference and library topics that CPython ships
for ``help()`` (``pydoc_data.topics``, about 465 KB of English and code), read as
bytes: no download, no tokenizer.

Every rank builds the same *global* batch for a step from a generator seeded with
(seed, step), then keeps its slice. So the data a run sees never depends on the
world size or the ZeRO stage, and losses can be compared across both.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from zerolearn.dist import ConfigError


@lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """The corpus as a (n_bytes,) uint8 tensor, topics in sorted order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def gpt_batch(step: int, batch_size: int, seq_len: int, seed: int = 0, split: str = "train"):
    """Global batch for ``step``: inputs and next-byte targets, both (batch, seq) int64.

    ``split="train"`` samples windows from the first 90% of the corpus, ``"val"``
    from the last 10%.
    """
    data = corpus()
    cut = int(0.9 * len(data))
    lo, hi = (0, cut) if split == "train" else (cut, len(data))
    starts = torch.randint(lo, hi - seq_len - 1, (batch_size,), generator=_generator(seed, step))
    windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


def mlp_batch(step: int, batch_size: int, width: int, seed: int = 0):
    """Global batch for ``step`` of the MLP's regression task: x, y (batch, width) fp32.

    As in the seed experiment, inputs and targets are random: the MLP is there to
    show memory, not to learn.
    """
    g = _generator(seed, step)
    return torch.randn(batch_size, width, generator=g), torch.randn(batch_size, width, generator=g)


def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s equal slice of a global batch along dim 0.

    Raises:
        ConfigError: the batch size is not divisible by ``world_size``.
    """
    n = tensor.shape[0]
    if n % world_size:
        raise ConfigError(f"global batch size {n} is not divisible by world size {world_size}")
    per = n // world_size
    return tensor[rank * per:(rank + 1) * per]
