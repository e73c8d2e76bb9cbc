"""What the trials share, so that each check module holds one exercise's check: the models
they train, the batches, and the comparisons that word a mistake in the reader's terms.

* Chapters 01 and 02 train a small GPT with Adam on this rank's slice of each global
  batch beside the same GPT in one process (:func:`gpt_pair`, :func:`batches`,
  :func:`reference_grads`), and :func:`compare_grad` names what a wrong gradient is
  instead: this rank's own, the sum, the mean divided twice, the parameter's values.
* Chapters 03 and 04 train the book's MLP (4 square Linear layers of width 64) with
  SGD, cut into buckets (:func:`mlp_buckets`) or into units whose flat buffers are
  freed between uses (:func:`sharded_units`, :func:`gathered_units`).
* Chapters 03 to 05 name a flat element by its parameter and position
  (:func:`located`) and explain a shard that is off by a known factor
  (:func:`compare_shard`); they write bytes as KiB with :func:`zerolearn.tables.kib`.
* Chapter 06 writes counts and bytes as the paper's code does (:func:`e9`).
* A trial that hands the reader tensors, or reads the ones the reader returns, asks
  whether their storage still holds their bytes (:func:`allocated`) and where the
  reader's code freed it (:func:`watching_frees`), so that a freed buffer is named as
  such instead of crashing gloo or torch.

The check modules (``zerolearn/chapters/chNN/<exercise>_check.py``) import from here
and from :mod:`zerolearn.exercises.core`, never from one another. Like ``core``, this
file is the checker's machinery: an error raised in it is reported at the trial's line
that called it, not here.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from zerolearn import comm, data
from zerolearn import dist as zdist
from zerolearn.exercises.core import Wrong, first_difference, readers_line
from zerolearn.flat import FlatLayout
from zerolearn.models import GPTConfig, build_model

# ----- the GPT of chapters 01 and 02 -------------------------------------------------------

GPT = GPTConfig(seq_len=16, n_layer=2, n_head=2, d_model=32)
"""The trials' model: Psi = 42,368 parameters in 29 tensors (Nd = 3 leaves a remainder)."""
GPT_BATCH, ADAM_LR = 12, 1e-3  # 12 sequences per global batch: 6 per rank on 2, 4 on 3
RTOL, ATOL = 1e-5, 1e-6  # gradients: sums over ranks add in another order than one process does
# Parameters: Adam divides by sqrt(v) + eps, so a gradient that is rounding noise (the key
# projection's bias gets zero in exact arithmetic: softmax ignores a constant added to every
# key) moves by up to lr * noise / eps, about 1e-5 here, whatever the order of the sum.
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-5


def gpt_pair() -> tuple[nn.Module, nn.Module]:
    """Two identical GPTs (same seed): the rank's replica and the single-process reference."""
    return build_model("gpt", 0, gpt=GPT), build_model("gpt", 0, gpt=GPT)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``model`` on inputs ``x`` and targets ``y`` (b, s)."""
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def batches(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x, y) of this rank, (x, y) of the whole global batch)`` for ``step``."""
    ctx = zdist.context()
    x, y = data.gpt_batch(step, GPT_BATCH, GPT.seq_len, seed=0)
    return (data.rank_slice(x, ctx.rank, ctx.world_size), data.rank_slice(y, ctx.rank, ctx.world_size)), (x, y)


def reference_grads(ref: nn.Module, step: int) -> list[torch.Tensor]:
    """Leave the global batch's gradient in ``ref``'s ``.grad``; return ``ref``'s gradient
    on this rank's slice alone (what a rank holds before any averaging)."""
    (x, y), (gx, gy) = batches(step)
    params = list(ref.parameters())
    local = torch.autograd.grad(loss_of(ref, x, y), params)
    loss_of(ref, gx, gy).backward()
    return list(local)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), rtol=RTOL, atol=ATOL)


def compare_grad(what: str, got, want: torch.Tensor, local: torch.Tensor, param: torch.Tensor,
                 world_size: int, step: int) -> None:
    """Raise :class:`Wrong` when gradient ``got`` is not ``want``, naming what it is instead
    when it is one of the known mistakes: this rank's own gradient, the sum, the mean
    divided twice, or the parameter's values."""
    if got is None:
        raise Wrong(f"{what} is None: your function must leave the averaged gradient in .grad", step)
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not _close(got, want):
        if _close(got, local):
            raise Wrong(f"{what} is still this rank's own gradient: it was not averaged over the ranks "
                        "(a parameter and its .grad are two tensors: reduce p.grad; a post-accumulate-grad "
                        "hook receives the parameter p, not its gradient)", step)
        if _close(got, param.detach()):
            raise Wrong(f"{what} holds the parameter's values, not its gradient: a post-accumulate-grad hook "
                        "receives the parameter p; its gradient is p.grad", step)
        if _close(got, want * world_size):
            raise Wrong(f"{what} is the sum over the {world_size} ranks, not their mean: divide by "
                        "world_size once", step)
        if _close(got, want / world_size):
            raise Wrong(f"{what} is the mean divided by world_size once more: you divided twice", step)
    first_difference(what, got, want, step=step, rtol=RTOL, atol=ATOL)


def compare_params(model: nn.Module, ref: nn.Module, step: int, rtol: float = PARAM_RTOL,
                   atol: float = PARAM_ATOL) -> None:
    """Every parameter of ``model`` against ``ref`` after ``step``'s optimizer step."""
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        first_difference(f"parameter {name!r} after the optimizer step", p, q, step=step, rtol=rtol, atol=atol)


def psi_per_step(elements: int, psi: int) -> str:
    """Elements moved in one step as a multiple of Psi, to the tenth the paper states (2.0, 3.0)."""
    return f"{elements / psi:.1f} Psi"


# ----- the MLP of chapters 03 and 04 -------------------------------------------------------

WIDTH, LAYERS, SGD_LR = 64, 4, 0.1  # 4 Linear(64, 64): 4,160 fp32 parameters each, 16,640 in all
CPU = torch.device("cpu")
# 03's buckets, in the order backward completes them; the middle one spans two layers.
BUCKETS = (("layers.3",), ("layers.1", "layers.2"), ("layers.0",))


def mlp() -> nn.Module:
    """The book's MLP, always from seed 0: every rank's replica and the reference are equal."""
    return build_model("mlp", 0, mlp_width=WIDTH, mlp_layers=LAYERS)


def mlp_grads(ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """``ref``'s gradient of the mean squared error on ``(x, y)``, by parameter name (copies)."""
    ref.zero_grad()
    F.mse_loss(ref(x), y).backward()
    return {n: p.grad.clone() for n, p in ref.named_parameters()}


def mlp_buckets(world_size: int, rank: int):
    """The MLP, its :data:`BUCKETS` as [[(name, param)]] and their layouts for this rank."""
    model = mlp()
    named = dict(model.named_parameters())
    buckets = [[(n, p) for n, p in named.items() if n.rsplit(".", 1)[0] in b] for b in BUCKETS]
    layouts = [FlatLayout.of([n for n, _ in b], [p.shape for _, p in b], world_size, rank) for b in buckets]
    return model, buckets, layouts


def sgd_on_shards(buckets, layouts, shards, ref: nn.Module) -> None:
    """Each rank updates its shard of the parameters and all-gathers them; ``ref`` steps in one process."""
    with torch.no_grad():
        for b, layout, shard in zip(buckets, layouts, shards, strict=True):
            full = layout.flatten([p for _, p in b], torch.float32, CPU)
            updated = layout.shard_of(full) - SGD_LR * shard
            comm.all_gather(full, updated)
            for (_, p), view in zip(b, layout.views(full), strict=True):
                p.copy_(view)
        for p in ref.parameters():
            p -= SGD_LR * p.grad


def sharded_units(world_size: int, rank: int):
    """The MLP with each Linear a unit: (model, layouts, flats freed to 0 bytes, shards)."""
    model = mlp()
    layouts, flats, shards = [], [], []
    for i, unit in enumerate(model.layers):
        named = list(unit.named_parameters(prefix=f"layers.{i}"))
        layout = FlatLayout.of([n for n, _ in named], [p.shape for _, p in named], world_size, rank)
        flat = layout.flatten([p for _, p in named], torch.float32, CPU)
        shards.append(layout.shard_of(flat).clone())
        layout.bind([p for _, p in named], flat)
        flat.untyped_storage().resize_(0)
        layouts.append(layout)
        flats.append(flat)
    return model, layouts, flats, shards


def gathered_units(flats) -> list[int]:
    """Which units' flat buffers hold their parameters now (storage not freed to 0 bytes)."""
    return [i for i, f in enumerate(flats) if f.untyped_storage().nbytes() > 0]


# ----- wording a wrong shard: chapters 03 to 05 --------------------------------------------

def located(layout: FlatLayout, index: int) -> str:
    """The parameter and position of element ``index`` of a flat buffer: ``"layers.1.weight[3, 5]"``."""
    for name, shape, offset in zip(layout.names, layout.shapes, layout.offsets, strict=True):
        if index < offset + math.prod(shape):
            position = torch.unravel_index(torch.tensor(index - offset), shape)
            return f"{name}[{', '.join(str(int(i)) for i in position)}]"
    return "the padding"


def close_to(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape and equal to a shard's tolerance (rtol 1e-4, atol 1e-6)."""
    return got.shape == want.shape and torch.allclose(got, want, rtol=1e-4, atol=1e-6)


def compare_shard(what: str, got, want: torch.Tensor, layout: FlatLayout | None, step: int,
                  factors: dict[float, str] | None = None, reference: str = "single-process training") -> None:
    """Raise :class:`Wrong` at the first element of a shard that differs from ``want``.

    A shard that is ``want`` times one of ``factors`` gets that factor's explanation
    instead; otherwise the message names the first differing element's parameter and
    position (from ``layout``, which lays out the flat buffer the shard is cut from).
    """
    if isinstance(got, torch.Tensor) and got.shape == want.shape and not close_to(got, want):
        for factor, why in (factors or {}).items():
            if close_to(got, factor * want):
                times = f"1/{round(1 / factor)} of" if factor < 1 else f"{factor:g} times"
                raise Wrong(f"{what} is {times} the {reference} gradient: {why}", step)
        if layout is not None:
            bad = ~torch.isclose(got.double(), want.double(), rtol=1e-5, atol=1e-6)
            where = located(layout, layout.shard_range[0] + int(bad.nonzero()[0]))
            what = f"{what} (first difference at {where})"
    first_difference(what, got, want, step=step, reference=reference)


# ----- numbers as the paper writes them: chapter 06 ----------------------------------------

def e9(x: float) -> str:
    """A count or a byte size as the paper writes it in code: ``"32e9"``, ``"1.5e9"``, ``"10000e9"``."""
    return f"{x / 1e9:g}e9"


# ----- freed storage -----------------------------------------------------------------------

def allocated(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds every byte ``t`` views (False once it was resized to 0 bytes,
    or for a tensor made over a storage never allocated). Anything but a tensor counts as allocated."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return True
    extent = t.storage_offset() + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True))
    return t.untyped_storage().nbytes() >= extent * t.element_size()


@contextlib.contextmanager
def watching_frees():
    """Inside this block, every ``untyped_storage().resize_(0)`` is recorded with the reader's line
    that called it: yields a dict from a storage (``t.untyped_storage()._cdata``) to that line,
    ``" (line N: code)"``, so that a trial can say where a buffer it finds freed was freed."""
    cls = torch.UntypedStorage
    had = cls.__dict__.get("resize_")
    resize = cls.resize_
    freed: dict[int, str] = {}

    def watched(self, size):
        if size == 0:
            freed[self._cdata] = readers_line()
        return resize(self, size)

    cls.resize_ = watched
    try:
        yield freed
    finally:
        if had is None:
            del cls.resize_
        else:
            cls.resize_ = had


def freed_where(t, freed: dict[int, str]) -> str:
    """The reader's line that freed ``t``'s storage, from :func:`watching_frees`'s record, as
    ``" (line N: code)"``; ``""`` when it was not freed inside the watched block."""
    return freed.get(t.untyped_storage()._cdata, "") if isinstance(t, torch.Tensor) else ""


def settled(read, small_enough, timeout: float = comm.RELEASE_TIMEOUT) -> int:
    """``read()`` (bytes alive, say) once ``small_enough(value)`` holds, or after ``timeout``
    seconds (s), whichever comes first.

    gloo runs a collective on a worker thread that lets go of its tensors a moment after
    the caller's ``wait()`` returns (:mod:`zerolearn.comm` waits for that in its own calls;
    a reader's ``dist.*`` calls do not). A buffer the reader dropped right after a
    collective is therefore freed at a time that depends on thread scheduling. A check
    that measures what a reader's code keeps alive reads it again until the measurement
    passes or the worker has had ``timeout`` to let go: code that truly keeps the memory
    still fails, code that dropped it is never blamed for gloo's thread.
    """
    start = time.perf_counter()
    value = read()
    while not small_enough(value) and time.perf_counter() - start < timeout:
        time.sleep(1e-3)  # the worker thread needs the GIL to let go
        value = read()
    return value
