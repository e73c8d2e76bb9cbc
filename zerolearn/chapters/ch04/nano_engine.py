"""Exercise ``04.nano_engine``: the reader's functions of chapters 1-4 assembled into one engine
that trains (paper Sec 5.1-5.3, Sec 7.2, Fig 1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch04.nano_engine_check`; the engine
itself is :class:`zerolearn.nano.NanoZero`.
"""

# The reference parts, found by name as the reader's are found in the notebook's namespace.
from zerolearn.chapters.ch01.bucket_hook import bucket_hook  # noqa: F401
from zerolearn.chapters.ch02.shard_range import shard_range  # noqa: F401
from zerolearn.chapters.ch02.zero1_step import zero1_step  # noqa: F401
from zerolearn.chapters.ch03.reduce_scatter_hook import reduce_scatter_hook  # noqa: F401
from zerolearn.chapters.ch04.gather_hooks import gather_hooks  # noqa: F401


def nano_engine(model, stage, lr):
    """Your ZeRO engine: ``zerolearn.nano.NanoZero`` made of your own functions.

    Args:
        model: an ``nn.Module``, the same on every rank (built from one seed), fp32.
        stage: 0 (DP), 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p), Sec 5.1-5.3.
        lr: Adam's learning rate.

    Returns:
        ``NanoZero(model, stage, lr, parts=...)``, where ``parts`` maps each function you
        wrote to its name: ``"bucket_hook"`` (chapter 1), ``"shard_range"`` and
        ``"zero1_step"`` (chapter 2), ``"reduce_scatter_hook"`` (chapter 3),
        ``"gather_hooks"`` or ``"prefetch"`` (chapter 4; pass ``prefetch=True`` to gather
        with ``prefetch``). A part you leave out is the book's solution. The engine is used
        as ``engine(x)``, ``engine.backward(loss)``, ``engine.step()``, ``engine.zero_grad()``.
    """
    # BEGIN SOLUTION
    from zerolearn.nano import NanoZero  # the engine; the parts are yours, where you wrote them

    mine = globals()
    parts = {name: mine[name] for name in ("bucket_hook", "shard_range", "zero1_step", "reduce_scatter_hook",
                                            "gather_hooks") if name in mine}
    return NanoZero(model, stage, lr, parts=parts)
    # END SOLUTION
