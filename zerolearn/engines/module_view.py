"""The engine read as the module it wraps (``engine.train()``, ``engine.state_dict()``, ...,
as torch DDP's and FSDP's wrappers answer), and its parameters read or changed between steps:
a change made outside the engine reaches the fp32 masters through the working buffer's
version counter (stages 0-2) or inside :meth:`ModuleView.summon_full_params` (ZeRO-3)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from zerolearn.errors import ConfigError


class ModuleView:
    """The wrapped model's face of the engine (mixed into :class:`zerolearn.engines.base.Engine`)."""

    @property
    def module(self) -> nn.Module:
        """The wrapped model (torch DDP's and FSDP's name for it)."""
        return self.model

    @property
    def training(self) -> bool:
        """The model's ``training`` flag."""
        return self.model.training

    def train(self, mode: bool = True):
        """``model.train(mode)`` (dropout on, BatchNorm updates its statistics); returns the engine."""
        self.model.train(mode)
        return self

    def eval(self):
        """``model.eval()``; returns the engine."""
        return self.train(False)

    def named_parameters(self, *args, **kwargs):
        """The model's ``named_parameters``; at ZeRO-3 valued only inside :meth:`summon_full_params`."""
        return self.model.named_parameters(*args, **kwargs)

    def parameters(self, *args, **kwargs):
        """The model's ``parameters`` (see :meth:`named_parameters`)."""
        return self.model.parameters(*args, **kwargs)

    def named_buffers(self, *args, **kwargs):
        """The model's ``named_buffers``."""
        return self.model.named_buffers(*args, **kwargs)

    def buffers(self, *args, **kwargs):
        """The model's ``buffers``."""
        return self.model.buffers(*args, **kwargs)

    def modules(self):
        """The model's ``modules()``: the model first (torch DDP's wrapper lists itself first)."""
        return self.model.modules()

    def named_modules(self, *args, **kwargs):
        """The model's ``named_modules``."""
        return self.model.named_modules(*args, **kwargs)

    def children(self):
        """The model's ``children()``."""
        return self.model.children()

    def apply(self, fn):
        """``model.apply(fn)`` (every module, children first); returns the engine."""
        self.model.apply(fn)
        return self

    def to(self, *args, **kwargs):
        """``engine.to(device)`` on the model's device (and dtype) returns the engine, as torch
        DDP's wrapper does after ``model.to``.

        Raises:
            ConfigError: another device or dtype (the buffers stay where the model was wrapped).
        """
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if (device is not None and torch.device(device).type != self.device.type) or \
                (dtype is not None and dtype != self.dtype):
            raise ConfigError(f"engine.to({', '.join(map(repr, args))}): the engine holds its buffers on "
                              f"{self.device} in {str(self.dtype).removeprefix('torch.')}; move or cast the model "
                              "before wrapping it (model.to(device), then the engine)")
        return self

    def state_dict(self, *args, **kwargs) -> dict:
        """The model's ``state_dict`` in the working dtype: at stages 0-2 the model's own (sharing
        the parameters' memory); at ZeRO-3 copies gathered inside :meth:`summon_full_params` (call
        on every rank). :meth:`full_state_dict` gives the fp32 masters."""
        if self.stage != 3:
            return self.model.state_dict(*args, **kwargs)
        with self.summon_full_params(writeback=False):
            return {k: v.detach().clone() if torch.is_tensor(v) else v
                    for k, v in self.model.state_dict(*args, **kwargs).items()}

    @contextlib.contextmanager
    def summon_full_params(self, writeback: bool = True):
        """A block in which every trainable parameter holds its full working values, to read or
        change between steps, as FSDP's ``summon_full_params``. At ZeRO-3 they are gathered on
        entry (an all_gather per bucket: call on every rank) and freed on exit. With
        ``writeback``, elements changed inside become the fp32 master's (and ZeRO-3 shard's)
        values on exit: make the same change on every rank. A DPU update in flight lands first.

        Raises:
            ConfigError: (on entry) a parameter replaced or cast since wrapping
                (:class:`zerolearn.engines.bindings.Bindings`).
        """
        self._bindings.check("summon_full_params block")
        self.finish_dpu()
        self._summon()
        try:
            yield
        finally:
            try:
                if writeback:
                    with torch.no_grad(), self.offload_resident():
                        for b in self.buckets:
                            self._write_back(b)
            finally:
                self._unsummon()
                self._versions = self._full_versions()

    def load_state_dict(self, state_dict: dict, strict: bool = True):
        """``model.load_state_dict(state_dict, strict)`` inside :meth:`summon_full_params` (at
        ZeRO-3 call on every rank with the same dict); the optimizer's state is kept
        (:mod:`zerolearn.checkpoint` restores both). Returns ``(missing_keys, unexpected_keys)``."""
        with self.summon_full_params():
            return self.model.load_state_dict(state_dict, strict=strict)

    def _summon(self) -> None:
        """Make every parameter hold its full values (stages 0-2: they do)."""

    def _unsummon(self) -> None:
        """Undo :meth:`_summon`."""

    def _write_back(self, b) -> None:
        """Elements of ``b``'s working parameters that differ from the master (rounded) become its."""
        work = b.full if b.master.numel() == b.layout.padded_numel else b.layout.shard_of(b.full)
        if b.shard is not None:  # ZeRO-3 keeps a working shard (in fp32 without offload, the master)
            b.shard.copy_(work)
            work = b.shard
        master = b.master.data
        if work.untyped_storage()._cdata == master.untyped_storage()._cdata:
            return  # the master is the working buffer (fp32 stage 0) or the shard itself
        work = work.to(master.device)
        changed = work != master.to(work.dtype)
        if bool(changed.any()):
            master[changed] = work[changed].to(master.dtype)

    def _full_versions(self) -> list[int] | None:
        """Version counters of the working buffers (stages 0-2 without offload; else None)."""
        if self._offload is not None or self.stage not in (0, 1, 2):
            return None
        return [b.full._version for b in self.buckets]

    def _absorb_changes(self) -> None:
        """Changes to working parameters since the last publish (``p.clamp_()`` under no_grad,
        outside :meth:`summon_full_params`) go to the master, as they would stay in torch."""
        if self._versions is None:
            return
        for b, version in zip(self.buckets, self._versions, strict=True):
            if b.full._version != version:
                with torch.no_grad():
                    self._write_back(b)
        self._versions = self._full_versions()
