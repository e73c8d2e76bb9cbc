"""ZeRO++ on the training command line (--node-size, --qwz, --qwz-block, --hpz, --qgz): bad
input refused with exit 2 before any work, and a run's intra- / inter-node bytes in its
report equal to the engine's, run directly with the same options, and to chapter 8's table
for the same model (Wang et al., arXiv 2306.10209 Sec 3; the link model of zerolearn.comm)."""

import functools
import json
import subprocess
import sys

import pytest
import torch.nn.functional as F

from jobs import on_ranks
from zerolearn import comm, data
from zerolearn.config import TrainConfig
from zerolearn.dist import ConfigError, free_port
from zerolearn.engines import Zero3Engine
from zerolearn.models import GPTConfig, build_model

pytestmark = pytest.mark.slow  # ZeRO++ from the command line on 4 ranks

TINY = TrainConfig(steps=2, global_batch_size=8, seq_len=16, n_layer=2, d_model=32, n_head=2, quiet=True)
# Chapter 8's ZeRO++ table trains this model (zerolearn.experiments.zeropp: small_gpt(64), bf16, Adam at lr 1e-2,
# batches of 8 sequences of 32 bytes): the command-line runs below train the same one.
CHAPTER = TrainConfig(steps=2, global_batch_size=8, seq_len=32, n_layer=2, d_model=64, n_head=2, dtype="bf16",
                      lr=1e-2, quiet=True)
WORLD, NODE = 4, 2  # 4 ranks in 2 "nodes" of 2 on this machine

BAD_INPUT = [  # (arguments of python -m zerolearn.train, what the message must say)
    (["--node-size", "3", "--simulate-world-size", "4"],
     "--node-size 3: must divide the world size 4 (every node holds the same number of ranks); "
     "allowed are 1, 2, 4"),
    (["--node-size", "0"], "--node-size 0: must be an integer >= 1"),
    (["--stage", "2", "--node-size", "1", "--hpz"], "--hpz with --stage 2: ZeRO++ options apply to --stage 3 only"),
    (["--stage", "1", "--node-size", "1", "--qgz"], "--qgz with --stage 1: ZeRO++ options apply to --stage 3 only"),
    (["--stage", "0", "--qwz"], "--qwz with --stage 0: ZeRO++ options apply to --stage 3 only"),
    (["--stage", "3", "--hpz"], "--hpz needs --node-size K"),
    (["--stage", "3", "--qgz"], "--qgz needs --node-size K"),
    (["--stage", "3", "--qwz", "--qwz-block", "0"], "--qwz-block 0: must be an integer >= 1"),
    (["--stage", "3", "--qwz", "--qwz-block", "-8"], "--qwz-block -8: must be an integer >= 1"),
    (["--stage", "3", "--qwz", "--qwz-block", "2.5"], "argument --qwz-block: invalid int value: '2.5'"),
    (["--stage", "3", "--qwz-block", "128"], "--qwz-block 128 needs --qwz"),
    (["--stage", "3", "--node-size", "1", "--hpz", "--tensor-parallel", "2", "--n-head", "2"],
     "--hpz with --tensor-parallel 2"),
]


def launch_cli(*args: str, timeout: float = 300, config: TrainConfig = TINY) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerolearn.launch", "--nproc-per-node", str(WORLD),
                           "--master-port", str(free_port()), "--", *config.to_argv(), *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory) -> dict:
    """Every BAD_INPUT command line, run in one process by tests/cli_driver.py."""
    from test_cli import bad_runs

    cases = [([*TINY.to_argv(), *args], {}) for args, _ in BAD_INPUT]
    out = bad_runs(cases, tmp_path_factory.mktemp("zeropp_cli"))
    return {tuple(args): r for (args, _), r in zip(BAD_INPUT, out, strict=True)}


@pytest.mark.parametrize("args, message", BAD_INPUT)
def test_bad_zeropp_input_exits_2_naming_it(args, message, bad_input_runs):
    code, stderr = bad_input_runs[tuple(args)]
    assert code == 2, stderr
    assert message in stderr and "Traceback" not in stderr


def test_the_same_checks_in_python():
    with pytest.raises(ConfigError, match="--qwz-block 1.5: must be an integer >= 1"):
        TINY.replace(stage=3, qwz=True, qwz_block=1.5)
    with pytest.raises(ConfigError, match="--hpz needs --node-size"):
        TINY.replace(stage=3, hpz=True)
    config = TINY.replace(stage=3, node_size=2, qwz=True, qwz_block=64, hpz=True, qgz=True)
    assert TrainConfig.from_argv(config.to_argv()) == config
    with pytest.raises(ConfigError, match="--node-size 2: must divide the world size 3"):
        config.validate(3)
    assert config.validate(4) == 4


@pytest.mark.slow
def test_a_node_size_that_does_not_divide_the_launched_world_exits_2_before_any_worker():
    done = launch_cli("--stage", "3", "--node-size", "3", timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--node-size 3: must divide the world size 4" in done.stderr
    assert "allowed are 1, 2, 4" in done.stderr and "ChildFailedError" not in done.stderr


# ----- the bytes per node boundary, against the engine run directly ------------------------------
def engine_bytes_by_link(config: TrainConfig, engine_options: dict, node_ranks: int) -> dict:
    """On every rank: ``config``'s model and batches through a Zero3Engine built here with
    ``engine_options`` (its own keywords, not the CLI's translation), under the ledger's
    link model with nodes of ``node_ranks``: this rank's ``{"intra", "inter", "by_work"}``
    bytes over all steps, as the report's ``comm_by_link``."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    gpt = GPTConfig(seq_len=config.seq_len, n_layer=config.n_layer, n_head=config.n_head, d_model=config.d_model)
    engine = Zero3Engine(build_model("gpt", config.seed, gpt=gpt), lr=config.lr, dtype=config.dtype, **engine_options)
    previous = comm.node_ranks()
    comm.set_nodes(node_ranks)
    comm.LEDGER.reset()
    try:
        for step in range(config.steps):
            x, y = (data.rank_slice(t, rank, world)
                    for t in data.gpt_batch(step, config.global_batch_size, config.seq_len, config.seed))
            engine.backward(F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten()))
            engine.step()
            engine.zero_grad()
        by_work = {doing: dict(moved) for doing, moved in sorted(comm.LEDGER.links.items())}
        return {**comm.LEDGER.by_link(), "by_work": by_work}
    finally:
        comm.set_nodes(previous)


RUNS = {  # the CLI's options -> the engine's keywords for the same run, and chapter 8's row for it
    "node size only": ([], {}, "ZeRO-3"),
    "qwZ": (["--qwz", "--qwz-block", "256"], {"qwz_block": 256}, "qwZ"),
    "hpZ": (["--hpz"], {"node_ranks": NODE, "hpz": True}, "hpZ"),
    "qgZ": (["--qgz"], {"node_ranks": NODE, "qgz": True}, "qgZ"),
    "all three": (["--qwz", "--hpz", "--qgz"], {"node_ranks": NODE, "qwz_block": 256, "hpz": True, "qgz": True},
                  "qwZ+hpZ+qgZ"),
}


# Launched from the command line: plain ZeRO-3 and every option at once (each flag's
# translation into the engine's keywords); each option alone runs on the engine directly.
ON_THE_COMMAND_LINE = ("node size only", "all three")


@functools.cache
def rank0_by_work(name: str) -> dict:
    """Rank 0's bytes per link and kind of work over the run of RUNS[name], run directly."""
    return on_ranks(engine_bytes_by_link, WORLD, CHAPTER, RUNS[name][1], NODE)[0]["by_work"]


@pytest.fixture(scope="module")
def cli_reports(tmp_path_factory) -> dict:
    """The report of each ON_THE_COMMAND_LINE run: python -m zerolearn.launch, 4 ranks,
    --stage 3 --node-size 2, chapter 8's model."""
    out = {}
    for name in ON_THE_COMMAND_LINE:
        args = RUNS[name][0]
        path = tmp_path_factory.mktemp("zeropp") / "run.json"
        done = launch_cli("--stage", "3", "--node-size", str(NODE), *args, "--report", str(path), config=CHAPTER)
        assert done.returncode == 0, done.stderr
        out[name] = (json.loads(path.read_text()), done.stdout)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ON_THE_COMMAND_LINE)
def test_report_bytes_per_link_equal_the_engine_run_directly(name, cli_reports):
    report, stdout = cli_reports[name]
    assert report["node_size"] == NODE and report["world_size"] == WORLD
    expected = on_ranks(engine_bytes_by_link, WORLD, CHAPTER, RUNS[name][1], NODE)
    for entry, want in zip(report["ranks"], expected, strict=True):
        assert entry["comm_by_link"] == want, (entry["rank"], entry["comm_by_link"], want)
        assert entry["comm_by_link"]["inter"] > 0  # some traffic crosses nodes under every option
    steps = len(report["losses"])
    rank0 = report["ranks"][0]["comm_by_link"]
    line = [s for s in stdout.splitlines() if s.startswith(f"nodes of {NODE} rank(s)")]
    assert line and f"rank 0 {rank0['intra'] / steps / 1024:,.1f} / {rank0['inter'] / steps / 1024:,.1f}" in line[0]


@pytest.mark.slow
def test_the_link_split_follows_the_paper(cli_reports):
    plain = cli_reports["node size only"][0]
    for entry in plain["ranks"]:
        # Plain ZeRO-3 (Sec 7.2.2): every byte moves in all_gather and reduce_scatter over all W
        # ranks of padded buckets, a piece of B / W per peer: k - 1 peers inside the node,
        # W - k outside (1 and 2 here), (W - 1) / W of the ledger's bytes in all.
        moved, link = entry["comm"], entry["comm_by_link"]
        assert link["intra"] * (WORLD - NODE) == link["inter"] * (NODE - 1)
        assert (link["intra"] + link["inter"]) * WORLD == (WORLD - 1) * (
            moved["all_gather"]["bytes"] + moved["reduce_scatter"]["bytes"])
    hpz = rank0_by_work("hpZ")
    assert hpz["backward: gather"]["inter"] == 0 < hpz["backward: gather"]["intra"]  # Sec 3.2: inside the node
    plain_work = plain["ranks"][0]["comm_by_link"]["by_work"]
    qwz = rank0_by_work("qwZ")
    # Sec 3.1: int8 of bf16, with one fp32 scale per 256 values: half the bytes, and 1.6% more
    assert qwz["forward: gather"]["inter"] < 0.52 * plain_work["forward: gather"]["inter"]
    qgz = rank0_by_work("qgZ")
    assert qgz["backward: reduce"]["inter"] < plain_work["backward: reduce"]["inter"] / 4  # Sec 3.3: int4, 2 hops


@pytest.fixture(scope="module")
def chapter_table() -> dict:
    """Chapter 8's ZeRO++ table (one step; bytes per step do not change from step to step), by option."""
    from zerolearn.experiments.zeropp import zeropp_table

    return {row["option"]: row for row in zeropp_table(WORLD, NODE, steps=1, d_model=CHAPTER.d_model)}


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_report_bytes_per_link_equal_chapter_8s_table(name, cli_reports, chapter_table):
    from zerolearn.experiments.zeropp import WORK

    if name in cli_reports:
        report = cli_reports[name][0]
        steps, by_work = len(report["losses"]), report["ranks"][0]["comm_by_link"]["by_work"]
    else:
        steps, by_work = CHAPTER.steps, rank0_by_work(name)
    row = chapter_table[RUNS[name][2]]
    for work, doing in WORK.items():
        for link in ("intra", "inter"):
            assert by_work[doing][link] == steps * row[f"{work} {link} B"], (work, link)
    assert sum(by_work[doing]["inter"] for doing in WORK.values()) == steps * row["inter B"]
