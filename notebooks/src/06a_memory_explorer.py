# %% [markdown]
# # Appendix 6a · The memory explorer on its own
#
# This page holds one explorer of chapter 6: the memory explorer, which draws the
# paper's Fig 1 for any setting. It runs in a second and needs no ranks, so it is the
# quickest place to get a feel for the formulas of Sec 5:
#
# | stage | bytes per GPU of model states (mixed-precision Adam, $K = 12$) |
# | --- | --- |
# | 0 DP | $(2 + 2 + K)\,\Psi$ |
# | 1 $P_{os}$ | $4\Psi + K\Psi / N_d$ |
# | 2 $P_{os+g}$ | $2\Psi + (2 + K)\,\Psi / N_d$ |
# | 3 $P_{os+g+p}$ | $(2 + 2 + K)\,\Psi / N_d$ |
#
# Run the notebook (Run > Run All Cells), then move the **Nd** slider or pick another
# **stage**: the table gives every stage's bytes by category, the sentence under it the
# selected stage's total against the device, and the figure the same as stacked bars.
# Sizes are in the paper's decimal GB (1 GB = $10^9$ bytes).

# %%
# %matplotlib inline
from IPython.display import display

from zerolearn import figures, widgets
from zerolearn.memory import GB, STAGE_NAMES, model_state_bytes

explorer = widgets.MemoryExplorer()  # Fig 1's setting: Psi = 7.5B, Nd = 64, stage 3, a 32 GB V100
display(explorer)

# %% [markdown]
# The explorer computes nothing of its own: its numbers are `zerolearn.memory`'s. This
# cell reads the explorer's current setting and recomputes the selected stage's bytes
# with `model_state_bytes` (Sec 5). Move a control, run the cell again, and the two
# still agree (with "add activations" ticked the explorer adds the activations of
# Sec 3.2 on top, which `model_state_bytes` does not count).

# %%
psi, nd, stage = explorer.value("psi"), explorer.value("nd"), explorer.value("stage")
formula = model_state_bytes(psi, nd, stage)["total"]
print(f"Psi = {psi / 1e9:g}B, Nd = {nd}, stage {stage} {STAGE_NAMES[stage]}")
print(f"explorer: {explorer.result['total'] / GB:,.3f} GB per GPU")
print(f"formula:  {formula / GB:,.3f} GB per GPU")

# %% [markdown]
# Without a running kernel (in the built book, say) the explorer above is not live.
# Its default view, as a static figure: Fig 1's 120, 31.4, 16.6 and 1.9 GB, with the
# selected stage outlined and the device's 32 GB as a dashed line.

# %%
figures.memory_figure()
