"""Exercise ``08.dpu_step``: ZeRO-Offload's one-step delayed parameter update (Ren et al., arXiv 2101.06840).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch08.dpu_step_check`.
"""


def dpu_step(step, params, master, grad, host_step, pending, worker):
    """The end of training step ``step`` under DPU: publish the update that finished, start this one.

    ZeRO-Offload keeps the fp32 master parameters and Adam's moments in host memory and
    runs the optimizer step on the CPU. Without DPU the device waits for that step;
    with DPU the device goes on to the next forward and backward with the parameters it
    has, while the CPU applies this step's gradient: the forward of step t then uses
    the parameters updated through step t - 2's gradient, one step older than usual.
    The first step runs synchronously (a warm-up: the paper starts DPU only after the
    first steps, whose gradients change fastest).

    Args:
        step: the step just computed, 0-based (int).
        params: the parameters the device's next forward reads (1-D tensor; fp32 here,
            bf16 or fp16 on a GPU). Publish into it in place (``params.copy_(master)``).
        master: the host's fp32 master copy (1-D, as many elements as ``params``), which
            ``host_step`` updates in place.
        grad: this step's gradient, already in host memory (fp32, 1-D).
        host_step: ``host_step(grad)`` runs one optimizer step on ``master`` (the CPU's
            Adam; slow). Returns None.
        pending: what ``dpu_step`` returned at the previous step (None at step 0).
        worker: an executor with ``concurrent.futures``' interface: ``worker.submit(fn,
            *args)`` starts ``fn(*args)`` on the host's worker thread and returns a future
            whose ``result()`` waits until it has finished.

    Returns:
        The future of the update still running when this function returns (what the
        next call gets as ``pending``), or None when none is.

    At step 0: run ``host_step(grad)`` here and publish ``master``. From step 1: wait
    for the update in flight, if any, publish ``master``, then start
    ``host_step(grad)`` on the worker and return its future without waiting for it.
    """
    # BEGIN SOLUTION
    if step == 0:  # warm-up: the first update is applied before the next forward
        host_step(grad)
        params.copy_(master)
        return None
    if pending is not None:
        pending.result()  # the previous step's update must be whole before anyone reads master
    params.copy_(master)  # the device now holds the update of step - 1's gradient
    return worker.submit(host_step, grad)  # this step's update runs while the device computes the next
    # END SOLUTION
