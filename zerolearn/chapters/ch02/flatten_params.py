"""Exercise ``02.flatten_params``: a model's parameters as views of one flat padded buffer, and
its gradients landing in a flat twin (paper Sec 5, Sec 5.1).

What the reader writes: this function, its body between ``# BEGIN SOLUTION`` and
``# END SOLUTION`` (the reader's copy has ``raise NotImplementedError`` there). Its
trial and known bugs are in :mod:`zerolearn.chapters.ch02.flat_params_check`. The
package does the same in :class:`zerolearn.flat.FlatLayout` (``flatten`` and ``bind``)
and in :class:`zerolearn.nano.Flat`.
"""

import torch


def flatten_params(model, world_size):
    """Lay ``model``'s parameters end to end in one flat buffer padded with zeros to a multiple
    of ``world_size``, make every parameter a view of it, and every gradient a view of a twin.

    Args:
        model: an ``nn.Module`` whose parameters (``model.parameters()``, in that order) all
            have one dtype (fp32 or bf16).
        world_size: the number of ranks, Nd; the buffers are padded up to the next multiple.

    Returns:
        ``(flat, flat_grad)``: two 1-D tensors of ``psi + padding`` elements in the parameters'
        dtype, ``psi`` the number of parameters and ``padding`` the fewest zeros that make the
        length a multiple of ``world_size``. The parameter of elements ``[o, o + n)`` (``o``
        the elements of the parameters before it) keeps its values and shape and is now
        ``flat[o:o + n].view_as(p)`` (set ``p.data``): it shares ``flat``'s storage, so a step
        written into ``flat`` is a step of the module. Its ``p.grad`` is
        ``flat_grad[o:o + n].view_as(p)``, zeros: autograd adds each backward's gradient
        into it in place, so after ``loss.backward()`` the whole gradient lies in
        ``flat_grad``, ready for one collective. Both paddings are zeros.
    """
    # BEGIN SOLUTION
    params = list(model.parameters())
    psi = sum(p.numel() for p in params)
    flat = torch.zeros(psi + -psi % world_size, dtype=params[0].dtype)  # zeros: the padding too
    flat_grad = torch.zeros_like(flat)
    o = 0
    for p in params:
        n = p.numel()
        flat[o:o + n].copy_(p.detach().reshape(-1))  # the values first, then the parameter moves in
        p.data = flat[o:o + n].view_as(p)
        p.grad = flat_grad[o:o + n].view_as(p)  # backward accumulates into the twin
        o += n
    return flat, flat_grad
    # END SOLUTION
