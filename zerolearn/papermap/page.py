"""The paper map as a page: every row in order, two boxes of notes, and :func:`render`,
the Markdown of ``book/paper_map.md`` (its table through :func:`zerolearn.tables.text_table`)."""

from __future__ import annotations

import functools

from zerolearn.memory.fit import ActivationSpec, gpt_params, per_device_bytes, smallest_fit
from zerolearn.memory.model import GB, comm_collectives_elements, comm_volume_elements
from zerolearn.papermap.base import GPT2_1_5B, REPRODUCED, SEQ, Row
from zerolearn.papermap.sec1_5 import memory_rows
from zerolearn.papermap.sec6_10 import scale_rows
from zerolearn.papermap.successors import glossary_note, successor_rows
from zerolearn.papermap.text import _fit_text, _gb, _sig, _states
from zerolearn.tables import text_table

__all__ = ["find", "render", "rows"]


@functools.lru_cache(maxsize=1)
def _paper_rows() -> tuple[Row, ...]:
    return tuple(memory_rows() + scale_rows())


@functools.lru_cache(maxsize=1)
def _successor_rows() -> tuple[Row, ...]:
    return tuple(successor_rows())


def rows() -> list[Row]:
    """Every row of the paper map, values computed once: the ZeRO paper's in its order (Sec 1-10,
    Tables 1-3), then its successors' (ZeRO-Offload, ZeRO-Infinity, ZeRO++)."""
    return list(_paper_rows() + _successor_rows())


def find(key: str) -> Row:
    """The row with ``key`` (e.g. "fig1"); KeyError if there is none."""
    for row in rows():
        if row.key == key:
            return row
    raise KeyError(key)


def _reduce_note(psi: float = 7.5e9, nd: int = 64) -> str:
    """The box on Sec 7's reduce + broadcast against zerolearn's reduce-scatter + all-gather."""
    calls = comm_collectives_elements(psi, 1)
    ring = psi * (nd - 1) / nd  # what one rank sends in a ring reduce-scatter (or all-gather) of psi elements
    naive = 2 * comm_collectives_elements(psi, 0)["all_reduce"] + psi  # all-reduce, then broadcast every shard
    return "\n".join([
        "```{admonition} Reduce and broadcast, or reduce-scatter and all-gather",
        ":class: note",
        "The paper describes the partitions' data movement in two ways. Sec 5.2 and 5.3 go partition by "
        "partition: the gradients of partition $i$ are *reduced* to rank $i$, its owner, which updates them, and "
        "an owner *broadcasts* its parameters to the others when they are needed (Sec 5.3, 7.2.2). Sec 5.1 ends "
        "the step with an all-gather, and Sec 7.2.1 counts $P_{os+g}$'s traffic as a reduce-scatter and an "
        "all-gather. zerolearn moves the data with one reduce-scatter and one all-gather per step. The two "
        "descriptions are the same movement: $N_d$ reduces, one to each owner of a $\\Psi/N_d$ chunk, are a "
        "reduce-scatter; $N_d$ broadcasts, one from each owner, are an all-gather. The collective runs all $N_d$ "
        "at once, over a ring, instead of one after another.",
        "",
        f"Per rank, on a ring, for $\\Psi$ = {psi / 1e9:g}B and $N_d$ = {nd}: the reduce-scatter sends "
        f"$\\Psi(N_d-1)/N_d$ = {ring / 1e9:.2f}B elements, the all-gather the same, {2 * ring / 1e9:.2f}B in all, "
        "about $2\\Psi$. `comm_collectives_elements` counts the logical tensors, "
        f"{calls['reduce_scatter'] / psi:g} $\\Psi$ + {calls['all_gather'] / psi:g} $\\Psi$, and "
        f"`comm_volume_elements` gives {comm_volume_elements(psi, 1) / psi:g} $\\Psi$ for $P_{{os}}$, the paper's "
        f"count, and {comm_volume_elements(psi, 0) / psi:g} $\\Psi$ for data parallelism: a ring all-reduce *is* "
        "a reduce-scatter followed by an all-gather (Sec 7.1), so DP and ZeRO-1/2 move the same bytes. Doing "
        f"ZeRO-1 as an all-reduce and then a broadcast of every shard moves {naive / psi:g} $\\Psi$ (ch. 2 "
        "measures both).",
        "```",
    ])


def _paper_bullets() -> list[str]:
    """Where other sources state the paper's own numbers differently."""
    return [
        "- **Fig 1's $P_{os+g+p}$ bar.** A structured summary of the paper gives 1.96 GB for 7.5B at $N_d$ = 64; "
        f"$16\\Psi/N_d$ is {_states(7.5e9, 64, 3) / GB:.3g} GB (Fig 1 prints 1.9, Table 1 1.88).",
        "- **Stage 3's traffic.** An interactive explainer (\"ZeRO: Data parallelism method to train large "
        "models\") says ZeRO moves the same total bytes at every stage, stage 3 only in more round trips; a "
        "glossary entry on ZeRO says stage 3 *doubles* the traffic, 3P against 2P. The paper says "
        f"$3\\Psi$ against $2\\Psi$ (Sec 7.2.2): {_sig(comm_volume_elements(1, 3) / comm_volume_elements(1, 0))}x, "
        "neither the same nor double. ch. 4 measures 3 $\\Psi$.",
    ]


def _blog_bullets() -> list[str]:
    """The blog reproduction's numbers against zerolearn's, and where the sources agree."""
    blog_psi = 6 * (10_000 * 10_000 + 10_000)  # the blog's MLP: 6 Linear layers 10,000 wide, with biases
    dp32, z1_32 = (per_device_bytes(blog_psi, 2, s, dtype="fp32")["total"] for s in (0, 1))
    mixed = 1 - _states(1, 2, 1) / _states(1, 2, 0)
    gpt2 = gpt_params(**GPT2_1_5B)
    ck = ActivationSpec(batch_per_gpu=32, seq_len=SEQ, checkpointing=True, **GPT2_1_5B)
    dp_ck = per_device_bytes(gpt2, 1, 0, dtype="fp16", activation=ck)["total"]
    blog_rs = 2 * comm_collectives_elements(1, 0)["all_reduce"] + 1
    return [
        "- **The blog's model size.** The blog reproduction (\"Understanding ZeRO: Memory-Efficient Training from "
        "Theory to Practice\") counts its MLP of 6 Linear layers 10,000 wide as 2,289,050,000 parameters (2.3B). "
        f"It has {blog_psi:,}, whose fp32 size is {blog_psi * 4 / 2**20:,.2f} MiB, the blog's 2,289.05 MB. It trains "
        f"in fp32 (K = 8, no master copy), where ZeRO-1 on 2 GPUs saves {_sig(100 * (1 - z1_32 / dp32))}% of model "
        f"states (`per_device_bytes`), not the {_sig(100 * mixed)}% of mixed precision it expects; it measured "
        "29.82% of peak memory.",
        "- **The blog's ZeRO-1 traffic.** It states $2\\Psi$ and reports 0.0% communication overhead, but its "
        f"ZeRO-1 all-reduces the gradients and then broadcasts every parameter: {blog_rs:g} $\\Psi$. zerolearn's "
        "ZeRO-1 measures 2 $\\Psi$ (reduce-scatter + all-gather) and the blog's pattern 3 $\\Psi$ (ch. 2).",
        "- **The blog's ZeRO-2 peak.** It measured 8,470 MB under ZeRO-2 against 8,090 MB under ZeRO-1. "
        "$P_{os+g}$ holds strictly less than $P_{os}$ (Sec 5.2); ch. 3 rebuilds its ZeRO-2 and finds the surplus "
        "in the implementation (full-size reduce-scatter inputs, gradients dropped only after backward). Its 48.6% "
        "and 97.0% communication overheads for ZeRO-2 and ZeRO-3 come from per-tensor, unbucketed, blocking "
        "collectives on 2 GPUs; the cost model gives ZeRO-3 1.5x DP's communication time (ch. 6).",
        "- **GPT-2 1.5B on one 32 GB GPU.** The blog's breakdown (3 + 3 + 18 GB of model states, 8 GB of "
        "checkpoints) totals 32.0 GB and \"barely fits\". With residual states counted (one checkpoint per block, "
        "one block's recompute, the fused fp32 gradient buffer), DP at batch 32 needs "
        f"{_gb(dp_ck)} (`per_device_bytes`): it does not fit, which is the paper's point (Sec 3).",
        "- **Where they agree.** The explainer's solver (7B on 80 GB: ZeRO-1 on 2 GPUs, 70 GB each) and its "
        "175B on 512 GPUs under ZeRO-3 at about 5.5 GB match `smallest_fit` "
        f"({_fit_text(smallest_fit(7e9, 80 * GB))}) and `model_state_bytes` ({_gb(_states(175e9, 512, 3))}); "
        "both count model states only.",
    ]


def _disagreements_note() -> str:
    """The box on numbers the book's other sources state differently from the paper or from zerolearn."""
    return "\n".join([
        "```{admonition} Where the paper and other sources disagree",
        ":class: note",
        "Numbers from the explainers and the blog reproduction this book started from, and what zerolearn gives.",
        "",
        *_paper_bullets(),
        *_blog_bullets(),
        "```",
    ])


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render() -> str:
    """The Markdown page ``book/paper_map.md``: intro, the claim table, the two boxes. Deterministic."""
    head = [
        "# Paper map",
        "",
        "<!-- Generated by `make paper-map` (python -m zerolearn.papermap) from zerolearn/papermap/. "
        "Do not edit by hand. -->",
        "",
        "Each numbered claim of the ZeRO paper (Rajbhandari et al., SC'20, arXiv 1910.02054), what zerolearn "
        "computes for it with its own cited functions (`zerolearn.memory`, `zerolearn.costmodel`), where the book "
        "shows or measures it (chapter and scale: gloo ranks on CPU, or rank 0 of a simulated world size, which "
        "measures rank 0's real tensors) and its status. GB are the paper's decimal GB (10^9 bytes); K = 12 "
        "(mixed-precision Adam) unless said.",
        "",
        "**The status rule.** A row says **reproduced** only when the package's computation, at the paper's own "
        "stated inputs (its model, batch, sequence, $N_d$, $N_m$), lands within the tolerance the row states of "
        "every number the paper gives for the claim: 10% for the paper's \"about\", 2.5% for a number printed "
        "to two or three digits, 3% for a round number the paper derives, 0 for exact counts, or a bound the "
        "paper states (\"under 10%\"). Where the book changes an input or the scheme (a batch, a "
        "checkpointing scheme, a shape the paper gives only in a table image), the row says **reproduced in "
        "shape only**, names the change and gives the reason; so does a row whose mechanism is measured but "
        "whose numbers need the paper's scale. Where the paper's own numbers disagree, the row names a *paper "
        "inconsistency*. **Not reproducible here** says what is missing. `tests/test_papermap.py` applies the "
        "rule to every row with a computation.",
        "",
    ]
    table = _table(_paper_rows(), "paper")
    beyond = [
        "## Beyond the paper",
        "",
        "The headline claims of ZeRO's successors, built on the same engines in chapter 8: ZeRO-Offload (Ren et "
        "al., USENIX ATC 2021, arXiv 2101.06840), ZeRO-Infinity (Rajbhandari et al., SC'21, arXiv 2104.07857) "
        "and ZeRO++ (Wang et al., arXiv 2306.10209). Same columns and statuses; bytes in bf16 with K = 12 "
        "unless said, traffic in the ZeRO++ paper's units (M: the model's size in fp16).",
        "",
        _table(_successor_rows(), "source"),
        "",
        glossary_note(),
    ]
    return "\n".join([*head, table, "", _reduce_note(), "", _disagreements_note(), "", *beyond, ""])


def _status(r: Row) -> str:
    """The status cell: the status, the tolerance it was tested to or what the book changed and why, and a
    paper inconsistency named as such."""
    text = f"**{r.status}**"
    if r.status == REPRODUCED and r.paper:
        text += " (" + "; ".join(dict.fromkeys(s.text() for s in r.paper.values())) + ")"
    reasons = ([f"the book changes {r.changed}"] if r.changed else []) + ([r.why] if r.why else [])
    if reasons:
        text += ": " + "; ".join(reasons)
    if r.inconsistency:
        text += f". *Paper inconsistency*: {r.inconsistency}"
    return text


def _table(chosen, first: str) -> str:
    body = [[_cell(x) for x in (r.section, r.claim, r.computed, r.where, _status(r))] for r in chosen]
    return text_table([first, "claim", "zerolearn computes", "where", "status"], body, fmt="pipe", align="left")
