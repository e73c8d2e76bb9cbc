"""Chapter 8's explorer: which of ZeRO's stages, alone or with its optimizer offloaded to
host memory (ZeRO-Offload) or to disk (ZeRO-Infinity), holds a model on the GPUs, host
memory and disk you have, and how long a step takes.

The bytes are :func:`zerolearn.memory.model.offload_state_bytes` (model states only:
activations and buffers come on top, chapters 0 and 5), the seconds
:func:`zerolearn.costmodel.offload_step_time`. Nothing is computed here. The view is an
HTML table, redrawn on every change without a figure: a refresh costs about a
millisecond.
"""

from __future__ import annotations

import ipywidgets as w

from zerolearn import figures
from zerolearn.costmodel import Hardware, HostSide, Job, offload_step_time
from zerolearn.errors import require_choice, require_real
from zerolearn.memory.model import GB, offload_state_bytes, stage_title
from zerolearn.widgets.base import STYLE, WIDE, Explorer, gb, html_table, nd_slider, psi_slider

__all__ = ["ASSUMED", "GPU_GB", "HOST_ADAM", "HOST_GB", "PCIE_GBPS", "TOKENS_PER_GPU", "BeyondExplorer"]

GPU_GB = [16, 24, 32, 40, 48, 80, 141, 192]
HOST_GB = [16, 32, 64, 128, 256, 512, 1024, 1536, 2048]
PCIE_GBPS = [4, 8, 12, 16, 25, 32, 64]
HOST_ADAM = [2.5e8, 5e8, 1e9, 2e9, 4e9]
ASSUMED = Hardware(tflops_achieved=40, intra_node_GBps=100, inter_node_GBps=12.5, gpus_per_node=8)
"""The device side: 40 TFLOP/s achieved per GPU, what ZeRO-Offload reports on one V100 for
a 10B model (Ren et al. 2021, abstract); 100 GB/s inside a node of 8 and 12.5 GB/s
(100 Gb/s) per GPU between nodes, assumptions for teaching."""
TOKENS_PER_GPU = 8192
"""Tokens each GPU computes per step (8 sequences of 1,024), an assumption for teaching."""
OFFLOADS = {None: "", "cpu": " + CPU offload", "disk": " + disk offload"}
LOCATIONS = ("device", "host", "disk")


class BeyondExplorer(Explorer):
    """Every stage 1-3 with no offload, CPU offload or disk offload: bytes per GPU on the
    device, in host memory and on disk, whether it fits, and its step time.

    Controls: ``psi`` parameters, ``nd`` GPUs, ``gpu_gb`` device memory and ``host_gb``
    host memory per GPU (decimal GB), ``disk_GBps`` and ``pcie_GBps`` per GPU (decimal
    GB/s), ``host_adam`` (elements per second the CPU's Adam updates for one GPU) and
    ``dpu`` (ZeRO-Offload's delayed parameter update for the offloaded rows). Disk
    capacity is taken as enough. bf16 working dtype, Adam (K = 12).

    ``result``: ``rows`` (one dict per configuration: ``stage``, ``offload``,
    ``bytes`` (:func:`offload_state_bytes`), ``totals`` per location, ``fits``,
    ``time`` (:class:`~zerolearn.costmodel.OffloadStepTime`)) and ``best`` (the fastest
    row that fits, or None).

    The defaults are ZeRO-Offload's setting: 13B parameters on one 32 GB GPU.
    Raises ConfigError (a ValueError) naming a value not on its slider.
    """

    def __init__(self, psi: float = 13e9, nd: int = 1, gpu_gb: int = 32, host_gb: int = 256,
                 disk_GBps: float = 3.0, pcie_GBps: int = 12, host_adam: float = 1e9, dpu: bool = True):
        require_real("psi", psi)
        for name, value, allowed in (("nd", nd, figures.NDS), ("gpu_gb", gpu_gb, GPU_GB),
                                     ("host_gb", host_gb, HOST_GB), ("pcie_GBps", pcie_GBps, PCIE_GBPS),
                                     ("host_adam", host_adam, HOST_ADAM)):
            require_choice(name, value, allowed)
        require_real("disk_GBps", disk_GBps)
        box = {"style": STYLE, "layout": WIDE}
        super().__init__({
            "psi": psi_slider(psi), "nd": nd_slider(nd),
            "gpu_gb": w.SelectionSlider(options=GPU_GB, value=gpu_gb, description="GPU memory (GB)", **box),
            "host_gb": w.SelectionSlider(options=HOST_GB, value=host_gb, description="host memory/GPU (GB)", **box),
            "disk_GBps": w.FloatLogSlider(value=disk_GBps, base=10, min=-1, max=2, step=0.05, readout_format=".3g",
                                          description="disk GB/s per GPU", continuous_update=False, **box),
            "pcie_GBps": w.SelectionSlider(options=PCIE_GBPS, value=pcie_GBps, description="PCIe GB/s per GPU",
                                           **box),
            "host_adam": w.SelectionSlider(options=HOST_ADAM, value=host_adam, description="CPU Adam elem/s",
                                           **box),
            "dpu": w.Checkbox(value=dpu, description="DPU (delayed parameter update)", **box)})
        self.view.layout.display = "none"  # no figure: the table is the view

    def refresh(self) -> None:
        self.result = self.compute()
        self.summary.value = self.describe(self.result)

    def compute(self) -> dict:
        psi, nd = self.value("psi"), self.value("nd")
        host = HostSide(pcie_GBps=self.value("pcie_GBps"), host_adam_elements_per_s=self.value("host_adam"),
                        disk_GBps=self.value("disk_GBps"))
        rows = []
        for offload in OFFLOADS:
            for stage in (1, 2, 3):
                placed = offload_state_bytes(psi, nd, stage, offload)
                totals = {where: sum(placed[where].values()) for where in LOCATIONS}
                fits = totals["device"] <= self.value("gpu_gb") * GB and totals["host"] <= self.value("host_gb") * GB
                job = Job(psi=psi, tokens_per_gpu=TOKENS_PER_GPU, stage=stage, nd=nd)
                time = offload_step_time(job, ASSUMED, host, offload, dpu=self.value("dpu") and offload is not None)
                rows.append({"stage": stage, "offload": offload, "bytes": placed, "totals": totals, "fits": fits,
                             "time": time})
        fitting = [r for r in rows if r["fits"]]
        return {"rows": rows, "best": min(fitting, key=lambda r: r["time"].step_s) if fitting else None}

    @staticmethod
    def name(row: dict) -> str:
        return f"{stage_title(row['stage'])}{OFFLOADS[row['offload']]}"

    def describe(self, r: dict) -> str:
        body = [[self.name(row), *(gb(row["totals"][where]) for where in LOCATIONS),
                 "fits" if row["fits"] else "no", f"{row['time'].step_s:,.3g} s",
                 f"{row['time'].host_s:,.3g} s" if row["offload"] else "-"] for row in r["rows"]]
        table = html_table(["configuration", "device", "host", "disk", "fits", "step", "host part"], body)
        best = r["best"]
        if best is None:
            verdict = (f"<b>Nothing fits</b> {self.value('gpu_gb')} GB GPUs with {self.value('host_gb')} GB of host "
                       "memory each: add GPUs (Nd), host memory, or put the optimizer states on disk.")
        else:
            t = best["time"]
            hidden = " (DPU hides the host's step behind the device's)" if t.dpu and t.host_s <= t.device_s else ""
            verdict = (f"Fastest that fits: <b>{self.name(best)}</b>, {gb(best['totals']['device'])} on each GPU, "
                       f"<b>{t.step_s:,.3g} s</b> a step{hidden}.")
        return (table + f"<p>{verdict}</p><p>Model states only (bf16, Adam, K = 12); step times from the cost "
                f"model with {ASSUMED.tflops_achieved:g} TFLOP/s per GPU and {TOKENS_PER_GPU:,} tokens per GPU "
                "a step (assumptions, not measurements).</p>")
