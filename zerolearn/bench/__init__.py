"""The benchmark: zerolearn's stages against torch's and DeepSpeed's, on the same job.

``python -m zerolearn.bench`` (or ``make bench``) trains the same GPT on the same global
batches with fp32 Adam under zerolearn's stages 0-3, torch's DDP, DDP with
``ZeroRedundancyOptimizer``, FSDP2 (``fully_shard``, with and without resharding after
forward) and DeepSpeed's stages 0-3 when it is installed, interleaved in rounds on fresh
gloo ranks; it prints step times (median, spread), the loss check, the bytes of model
states each rank holds and peak memory, with each zerolearn stage's ratio to the
fastest peer at its stage. ``python -m zerolearn.bench scaling`` measures the stages
against world size and model size beside the paper's bytes (Sec 5) and traffic (Sec 7).

Modules: :mod:`~zerolearn.bench.spec` (what one run is), :mod:`~zerolearn.bench.systems`
(the systems, one interface), :mod:`~zerolearn.bench.harness` (rounds of fresh ranks),
:mod:`~zerolearn.bench.results` (the JSON and the table), :mod:`~zerolearn.bench.scaling`.
"""

from zerolearn.bench.spec import PEERS, STAGE, SYSTEMS, BenchSpec

__all__ = ["PEERS", "STAGE", "SYSTEMS", "BenchSpec"]
