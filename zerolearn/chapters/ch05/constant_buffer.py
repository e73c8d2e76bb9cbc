"""Exercise ``05.constant_buffer``: ZeRO-R's constant-size fused buffer, CB (paper Sec 6.2).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch05.constant_buffer_check`.
"""

import torch.distributed as dist


def constant_buffer(tensors, buffer, world_size):
    """Average ``tensors`` over the ranks through ``buffer``, a fused buffer of constant size (CB, Sec 6.2).

    Args:
        tensors: list of contiguous fp32 tensors of any shapes (here a model's gradients),
            n elements in all; n may be many times buffer.numel(). Averaged in place.
        buffer: fp32, 1-D, B elements: the fused buffer, the only scratch memory to use.
        world_size: the number of ranks.

    Lay the tensors' elements end to end, in list order, and take them B at a time:
    copy each run of B (the last may be shorter) into buffer (a tensor may span two
    runs, a run may hold pieces of several tensors), average the filled part over the
    ranks with one ``dist.all_reduce``, and copy it back into the tensors. Allocate
    nothing whose size grows with n (views and in-place copies allocate nothing).
    Returns None.
    """
    # BEGIN SOLUTION
    flats = [t.view(-1) for t in tensors]
    n, size = sum(f.numel() for f in flats), buffer.numel()
    for lo in range(0, n, size):  # one fill: elements lo ... hi - 1 of the tensors laid end to end
        hi = min(lo + size, n)
        pieces, offset = [], 0
        for f in flats:
            a, b = max(lo, offset), min(hi, offset + f.numel())
            if a < b:
                pieces.append((f[a - offset:b - offset], buffer[a - lo:b - lo]))
            offset += f.numel()
        for part, fused in pieces:
            fused.copy_(part)
        dist.all_reduce(buffer[:hi - lo])
        buffer[:hi - lo].div_(world_size)
        for part, fused in pieces:
            part.copy_(fused)
    # END SOLUTION
