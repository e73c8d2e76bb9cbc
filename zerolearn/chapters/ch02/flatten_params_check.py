"""Exercise ``02.flatten_params``'s check: parameters as views of one flat padded buffer, gradients
landing in a flat twin (paper Sec 5, Sec 5.1).

The trial hands every rank the book's GPT (Psi = 42,368 in 29 tensors: 3 ranks leave a
remainder) and looks at what the reader's function left: buffers of the padded length, every
parameter still the module's own ``nn.Parameter``, with its values, a view of ``flat`` at its
offset (one storage), its ``.grad`` a zeroed view of ``flat_grad`` at the same offset, both
paddings zeros. Then three SGD steps are taken through the flat buffers alone (backward, one
``dist.all_reduce`` of ``flat_grad``, ``flat -= lr * flat_grad``) against one process on the
whole batch: the gradient must land in ``flat_grad``, and the step must move the module.

This module holds the trial, the known bugs and the registration; the reader's function
(with its reference solution) is in :mod:`zerolearn.chapters.ch02.flatten_params`.
"""

from __future__ import annotations

import torch
from torch import nn

from zerolearn import dist as zdist
from zerolearn.chapters.ch02.flatten_params import flatten_params
from zerolearn.exercises.core import Bug, Exercise, Wrong, agree, edited, first_difference, register
from zerolearn.exercises.helpers import RTOL, SGD_LR, batches, compare_params, gpt_pair, loss_of, reference_grads

STEPS = 3


def _returned(got, psi: int, ws: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two buffers the reader returned, checked for kind, length and dtype."""
    if not (isinstance(got, (tuple, list)) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        raise Wrong(f"your function returned {type(got).__name__}; expected a tuple (flat, flat_grad) of two tensors")
    flat, flat_grad = got
    want = psi + -psi % ws
    for what, t in (("flat", flat), ("flat_grad", flat_grad)):
        if t.dim() != 1:
            raise Wrong(f"{what} has shape {tuple(t.shape)}; expected a 1-D buffer of {want:,} elements")
        if t.numel() == psi and psi != want:
            raise Wrong(f"{what} has {psi:,} elements, Psi, which {ws} ranks cannot split equally: pad it with "
                        f"zeros up to the next multiple of world_size, {want:,} elements")
        if t.numel() != want:
            raise Wrong(f"{what} has {t.numel():,} elements; Psi = {psi:,} padded to the next multiple of "
                        f"world_size = {ws} is {want:,}")
        if t.dtype != torch.float32:
            raise Wrong(f"{what} is {t.dtype}; the model's parameters are torch.float32, and so are their buffers")
    return flat, flat_grad


def _views(named, before, flat: torch.Tensor, flat_grad: torch.Tensor) -> int:
    """Every parameter a view of ``flat`` at its offset with its values, its gradient a zeroed view of
    ``flat_grad`` at the same offset; returns Psi."""
    size, o = flat.element_size(), 0
    for (name, p), b in zip(named, before, strict=True):
        n = b.numel()
        if p.shape != b.shape:
            raise Wrong(f"parameter {name!r} has shape {tuple(p.shape)}, it had {tuple(b.shape)}: view_as(p) keeps it")
        if p.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr():
            raise Wrong(f"parameter {name!r} does not share flat's storage: a step written into flat would not "
                        "reach it. Make it a view, p.data = flat[o:o + n].view_as(p), not a copy")
        at = (p.data_ptr() - flat.data_ptr()) // size
        if at != o:
            raise Wrong(f"parameter {name!r} is a view of flat from element {at}, not {o}: the parameters lie end to "
                        "end in model.parameters() order from element 0, and the padding comes after them")
        if not torch.equal(p.detach(), b):
            raise Wrong(f"parameter {name!r} lost its values: copy them into flat[o:o + n] before pointing "
                        "p.data at the view (the new buffer holds zeros)")
        if p.grad is None:
            raise Wrong(f"{name}.grad is None: make it flat_grad[o:o + n].view_as(p), so that backward adds the "
                        "gradient into flat_grad")
        if p.grad.untyped_storage().data_ptr() != flat_grad.untyped_storage().data_ptr() or \
                (p.grad.data_ptr() - flat_grad.data_ptr()) // size != o:
            raise Wrong(f"{name}.grad is not a view of flat_grad at element {o}: backward would fill another tensor; "
                        "set p.grad = flat_grad[o:o + n].view_as(p)")
        if p.grad.count_nonzero():
            raise Wrong(f"{name}.grad is not zeros: backward adds into it, so it must start at zero")
        o += n
    for what, t in (("flat", flat), ("flat_grad", flat_grad)):
        if t[o:].count_nonzero():
            raise Wrong(f"the padding of {what} (its last {t.numel() - o} elements) is not zeros: a reduce-scatter "
                        "or a norm over the buffer would read it")
    return o


def _flat_trial(fn) -> str:
    """The reader's buffers on the GPT, then three SGD steps through them against one process."""
    ctx = zdist.context()
    ws, rank = ctx.world_size, ctx.rank
    model, ref = gpt_pair()
    named = list(model.named_parameters())
    before = [p.detach().clone() for _, p in named]
    got = fn(model, ws)
    if [id(p) for p in model.parameters()] != [id(p) for _, p in named]:
        raise Wrong("model.parameters() are new nn.Parameter objects: keep each parameter and set p.data to its "
                    "view (an optimizer built before would still hold the old ones)")
    flat, flat_grad = _returned(got, sum(b.numel() for b in before), ws)
    psi = _views(named, before, flat, flat_grad)
    agree(0, "layout")  # every rank's buffers are right before any collective
    for step in range(STEPS):
        (x, y), _ = batches(step)
        loss_of(model, x, y).backward()
        local = reference_grads(ref, step)  # this rank's own gradient; the global one left in ref
        o = 0
        for (name, _), g in zip(named, local, strict=True):
            n = g.numel()
            first_difference(f"flat_grad[{o}:{o + n}] after backward, {name}'s gradient",
                             flat_grad[o:o + n].view_as(g), g, step=step, rtol=RTOL, atol=1e-6)
            o += n
        with torch.no_grad():  # a step through the flat buffers only: one collective, one update
            torch.distributed.all_reduce(flat_grad)
            flat_grad /= ws
            flat -= SGD_LR * flat_grad
            flat_grad.zero_()
            for q in ref.parameters():
                q -= SGD_LR * q.grad
                q.grad = None
        compare_params(model, ref, step)
        agree(step)
    return (f"{len(named)} parameters are views of flat ({psi:,} + {flat.numel() - psi} padding elements on {ws} "
            f"ranks, rank {rank}'s), their gradients of flat_grad; {STEPS} SGD steps through the flat buffers "
            "equal one process")


_no_padding = edited(
    flatten_params, {"torch.zeros(psi + -psi % world_size,": "torch.zeros(psi,"}, name="_no_padding",
    doc="Psi elements and no padding: equal shards only when world_size divides Psi (2 ranks here, not 3).")

_copies = edited(
    flatten_params, {"        p.data = flat[o:o + n].view_as(p)\n": ""}, name="_copies",
    doc="""A flat copy of the parameters (torch.cat): the module keeps its own tensors, so a step
    written into the buffer never reaches it.""")

_values_lost = edited(
    flatten_params,
    {"        flat[o:o + n].copy_(p.detach().reshape(-1))  # the values first, then the parameter moves in\n": ""},
    name="_values_lost",
    doc="Each parameter pointed at its view of a new zero buffer without copying its values in first.")

_grads_elsewhere = edited(
    flatten_params, {"        p.grad = flat_grad[o:o + n].view_as(p)  # backward accumulates into the twin\n": ""},
    name="_grads_elsewhere",
    doc="""Parameters as views, but ``p.grad`` left None: backward makes each gradient a tensor of its
    own, and the flat twin stays zeros.""")


def _new_parameters(model, world_size):
    """New ``nn.Parameter`` objects put in the modules over the views: the storage is right, but an
    optimizer (or a hook) holding the old parameters no longer trains the model."""
    flat, flat_grad = flatten_params(model, world_size)
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                new = nn.Parameter(p.data)
                new.grad = p.grad
                module._parameters[name] = new
    return flat, flat_grad


register(Exercise(
    "02.flatten_params", "Parameters as views of one flat padded buffer, gradients in a flat twin",
    flatten_params, _flat_trial,
    {"no_padding": Bug(_no_padding, "a buffer of Psi elements: fine on 2 ranks, unequal shards on 3",
                       "next multiple of world_size"),
     "copies": Bug(_copies, "torch.cat of the parameters: a copy, not views", "does not share flat's storage"),
     "values_lost": Bug(_values_lost, "views of a new buffer, values never copied in", "lost its values"),
     "grads_elsewhere": Bug(_grads_elsewhere, "p.grad left to autograd: gradients outside the twin", ".grad is None"),
     "new_parameters": Bug(_new_parameters, "new nn.Parameter objects over the views", "new nn.Parameter objects")}))
