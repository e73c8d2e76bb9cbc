"""Exercise ``01.bucket_hook``: bucketed gradient averaging from autograd hooks (paper Sec 5.2, 7.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch01.bucket_hook_check`.
"""

import torch
import torch.distributed as dist


def bucket_hook(buckets, world_size):
    """Average gradients in buckets, each launched from an autograd hook during backward.

    Args:
        buckets: the model's trainable parameters (fp32 ``nn.Parameter``), split into a
            list of buckets, each a list of parameters; every parameter is in exactly one.
        world_size: the number of ranks, Nd.

    Register a hook on every parameter with ``p.register_post_accumulate_grad_hook(hook)``;
    autograd calls ``hook(p)`` with the *parameter* once ``p.grad`` is complete. When
    the last gradient of a bucket has arrived, copy the bucket's gradients into one flat
    fp32 buffer and launch ``dist.all_reduce(buffer, async_op=True)`` at once, without
    waiting: it runs while backward goes on. One all-reduce per bucket per step.

    Returns:
        ``finish()``, which the caller runs after ``loss.backward()``: it waits for
        every launched all-reduce (``handle.wait()``), divides by ``world_size`` and
        copies each parameter's averaged gradient back into ``p.grad``. The hooks
        stay registered: the next backward uses them again.
    """
    # BEGIN SOLUTION
    bucket_of = {id(p): i for i, bucket in enumerate(buckets) for p in bucket}
    arrived = [0] * len(buckets)
    in_flight = []  # (handle, flat buffer, bucket), in launch order: the same on every rank

    def hook(p):  # receives the parameter; its gradient is p.grad
        i = bucket_of[id(p)]
        arrived[i] += 1
        if arrived[i] == len(buckets[i]):  # the bucket's last gradient: launch it now
            arrived[i] = 0
            buffer = torch.cat([q.grad.flatten() for q in buckets[i]])
            in_flight.append((dist.all_reduce(buffer, async_op=True), buffer, buckets[i]))

    for bucket in buckets:
        for p in bucket:
            p.register_post_accumulate_grad_hook(hook)

    def finish():
        for handle, buffer, bucket in in_flight:
            handle.wait()
            buffer.div_(world_size)
            offset = 0
            for q in bucket:
                q.grad.copy_(buffer[offset:offset + q.numel()].view_as(q))
                offset += q.numel()
        in_flight.clear()

    return finish
    # END SOLUTION
