"""Exercise ``08.quantized_all_gather``: ZeRO++'s qwZ, an all-gather of int8 blocks (Wang et al., arXiv 2306.10209).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch08.quantized_all_gather_check`.
"""

import torch
import torch.distributed as dist


def quantized_all_gather(out, shard, block, world_size):
    """Gather every rank's ``shard`` into ``out``, sending int8 values and one scale per block.

    ZeRO-3 all-gathers the parameters before each unit's forward and backward. qwZ sends
    them as int8: the shard is cut into blocks of ``block`` elements, each with its own
    scale, so one large value spoils only its own block's precision.

    Args:
        out: fp32, 1-D, ``world_size * shard.numel()`` elements: on return, every rank's
            shard, dequantized, in rank order.
        shard: fp32, 1-D, n elements (the same n on every rank): this rank's parameters.
        block: elements per quantization block (int > 0).
        world_size: the number of ranks, Nd.

    Pad the shard with zeros to ``nb = ceil(n / block)`` whole blocks. For each block,
    ``scale = max |x| / 127`` (a block of zeros takes scale 1) and ``q = round(x / scale)``,
    an int8 in [-127, 127]. All-gather the int8 values (``world_size * nb * block``) and
    the fp32 scales (``world_size * nb``) with ``dist.all_gather_single(output, input)``, then
    write each rank's ``q * scale``, its first n elements, into ``out``. Returns None.
    """
    # BEGIN SOLUTION
    n = shard.numel()
    nb = -(-n // block)  # ceil: the last block is padded with zeros
    x = torch.zeros(nb * block)
    x[:n] = shard
    x = x.view(nb, block)
    scales = x.abs().amax(dim=1) / 127
    scales[scales == 0] = 1.0  # a block of zeros: any scale gives q = 0
    q = torch.round(x / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    all_q = torch.empty(world_size * nb * block, dtype=torch.int8)
    all_scales = torch.empty(world_size * nb)
    dist.all_gather_single(all_q, q.view(-1))
    dist.all_gather_single(all_scales, scales)
    values = all_q.view(world_size, nb, block).float() * all_scales.view(world_size, nb, 1)  # rank r with r's scales
    out.copy_(values.view(world_size, nb * block)[:, :n].reshape(-1))
    # END SOLUTION
