"""The fit solver and its CLI: which stage and how many GPUs a model needs (Sec 5, Fig 1, Table 1).

Expected numbers are the paper's or arithmetic done by hand in the comments, never
output copied from this code.
"""

import json
import re
import subprocess
import sys

import pytest

from zerolearn.dist import ConfigError
from zerolearn.memory.__main__ import main
from zerolearn.memory.fit import ActivationSpec, gpt_params, per_device_bytes, smallest_fit, table
from zerolearn.memory.model import FIGURE1_GB, GB, TABLE1_GB, activation_bytes

pytestmark = pytest.mark.quick

GPT2_1_5B = {"layers": 48, "hidden": 1600}  # the paper's 1.5B config (Sec 3.2)
GPT2_XL_PARAMS = 1_557_611_200  # GPT-2 XL's published parameter count (48 x 1600, tied embeddings)


def test_7b_on_80gb_needs_zero1_on_two_gpus_at_70gb():
    fit = smallest_fit(7e9, 80 * GB)
    # Nd = 1: every stage holds 16 x 7 = 112 GB > 80. Nd = 2: DP 112, P_os 4 x 7 + 12 x 7 / 2 = 70.
    assert (fit.stage, fit.nd, fit.gpus) == (1, 2, 2)
    assert fit.bytes_per_device == pytest.approx(70 * GB)
    assert fit.headroom_bytes == pytest.approx(10 * GB)
    assert fit.utilization == pytest.approx(0.875)


def test_fewest_gpus_beat_a_lower_stage():
    # 7.5B on 32 GB: P_os+g+p needs 120 / Nd <= 32, Nd = 4 (30 GB); P_os+g needs
    # 15 + 105 / Nd <= 32, Nd = 7; P_os needs 30 + 90 / Nd <= 32, Nd = 45. Fewest GPUs wins.
    fit = smallest_fit(7_500_000_000, 32 * GB)
    assert (fit.stage, fit.nd) == (3, 4)
    assert fit.bytes_per_device == 30 * GB


def test_lowest_stage_wins_at_the_same_gpu_count():
    # 1B at 16 bytes/param = 16 GB: every stage fits one 80 GB GPU; DP is the lowest.
    fit = smallest_fit(1_000_000_000, 80 * GB)
    assert (fit.stage, fit.nd) == (0, 1)


def test_a_trillion_parameters_need_500_gpus_of_32gb():
    # Only P_os+g+p keeps shrinking: 16e12 / Nd <= 32e9 at Nd = 500 (P_os+g keeps 2e12 bytes).
    assert smallest_fit(10**12, 32 * GB, max_nd=499) is None
    fit = smallest_fit(10**12, 32 * GB, max_nd=1024)
    assert (fit.stage, fit.nd) == (3, 500)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_per_device_bytes_reproduces_figure_1(stage):
    total = per_device_bytes(7_500_000_000, 64, stage)["total"]
    assert total / GB == pytest.approx(FIGURE1_GB[stage], abs=0.05)


def test_fp32_sgd_without_momentum_holds_only_params_and_grads():
    # fp32 needs no master copy and plain SGD no state: K = 0, 4 + 4 bytes per param.
    got = per_device_bytes(1000, 1, 0, optimizer="sgd", dtype="fp32", momentum=False)
    assert (got["params"], got["grads"], got["optimizer_states"], got["total"]) == (4000, 4000, 0, 8000)


def test_model_parallelism_divides_model_states_by_nm():
    alone = per_device_bytes(7_500_000_000, 4, 1)["total"]
    assert per_device_bytes(7_500_000_000, 4, 1, nm=16)["total"] == alone / 16


def test_activations_add_to_the_total_and_change_the_answer():
    spec = ActivationSpec(batch_per_gpu=8, seq_len=1024, **GPT2_1_5B)
    psi = gpt_params(**GPT2_1_5B)
    got = per_device_bytes(psi, 1, 0, activation=spec)
    assert got["activations"] == activation_bytes(1600, 8, 1024, 48)
    assert got["temporary_buffers"] == 4 * psi and got["recompute"] == 0  # fused fp32 buffer, Sec 3.2
    assert got["total"] == 16 * psi + got["activations"] + 4 * psi
    # Without activations 16 x 1.56e9 = 24.9 GB fits one 32 GB GPU under DP. Batch 8 adds
    # 12 x 8 x 1024 x 1600 x 48 x 2 = 15.1 GB (Sec 3.2) and the 6.2 GB buffer: 21.3 GB that
    # no stage divides. With 10.7 GB left for model states, P_os+g (2 Psi + 14 Psi / Nd)
    # and P_os+g+p (16 Psi / Nd) first fit at Nd = 3; P_os (4 Psi + 12 Psi / Nd) needs 5.
    assert (smallest_fit(psi, 32 * GB).stage, smallest_fit(psi, 32 * GB).nd) == (0, 1)
    fit = smallest_fit(psi, 32 * GB, activation=spec)
    assert (fit.stage, fit.nd) == (2, 3)
    cb = ActivationSpec(batch_per_gpu=8, seq_len=1024, constant_buffer_bytes=10**8, **GPT2_1_5B)
    assert per_device_bytes(psi, 1, 0, activation=cb)["temporary_buffers"] == 10**8  # CB, Sec 6.2


@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpt2_1_5b_at_batch_32_does_not_fit_a_32_gb_device_with_plain_dp(capsys, checkpointing):
    # Sec 3: 1.5B parameters are 3 GB of fp16 weights, yet DP cannot train them on a 32 GB
    # V100 at batch 32: model states take 24.9 GB and the residual states the rest.
    main(["--layers", "48", "--hidden", "1600", "--batch", "32", "--seq-len", "1024", "--device-gb", "32",
          "--nd", "1", "--json", *(["--checkpointing"] if checkpointing else [])])
    dp = json.loads(capsys.readouterr().out)["rows"][0]["stages"][0]
    assert not dp["fits"]
    psi = gpt_params(**GPT2_1_5B)
    parts = ("params", "grads", "optimizer_states", "activations", "recompute", "temporary_buffers")
    assert sum(dp[p] for p in parts) == dp["total"] > 32 * GB
    assert dp["params"] + dp["grads"] + dp["optimizer_states"] == 16 * psi < 32 * GB
    assert dp["activations"] == activation_bytes(1600, 32, 1024, 48, checkpointing=checkpointing)
    assert dp["recompute"] == (activation_bytes(1600, 32, 1024, 1) if checkpointing else 0)
    assert dp["temporary_buffers"] == 4 * psi


def test_checkpointing_keeps_twelve_times_fewer_activation_bytes():
    full = ActivationSpec(batch_per_gpu=32, seq_len=1024, **GPT2_1_5B)
    ckpt = ActivationSpec(batch_per_gpu=32, seq_len=1024, checkpointing=True, **GPT2_1_5B)
    a_full = per_device_bytes(1e9, 1, 0, activation=full)["activations"]
    assert a_full / GB == pytest.approx(60, rel=0.01)  # the paper's "about 60 GB" (Sec 3.2)
    assert per_device_bytes(1e9, 1, 0, activation=ckpt)["activations"] * 12 == a_full


def test_table_rows_follow_table_1():
    rows = table(7_500_000_000, [4, 16, 64])
    assert [row["nd"] for row in rows] == [4, 16, 64]
    for row in rows:
        printed = TABLE1_GB[7_500_000_000][row["nd"]]
        got = tuple(row["stages"][s]["total"] / GB for s in (1, 2, 3))
        assert got == pytest.approx(printed, rel=0.01)
        assert row["stages"][0]["total"] == 120 * GB  # DP never shrinks


def test_gpt_params_counts_gpt2_xl_exactly():
    assert gpt_params(**GPT2_1_5B) == GPT2_XL_PARAMS


def test_gpt_params_of_the_papers_100b_config_is_about_100b():
    assert gpt_params(layers=125, hidden=8192) == pytest.approx(100e9, rel=0.02)


def test_gpt_params_matches_the_books_gpt_parameter_by_parameter():
    from zerolearn.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=3, n_head=2, d_model=24)
    counted = sum(p.numel() for p in GPT(cfg).parameters())
    assert counted == gpt_params(3, 24, 256, 32, tied_embeddings=False)  # our GPT has an untied head


@pytest.mark.parametrize(("call", "message"), [
    (lambda: per_device_bytes(-1, 1, 0), "psi -1"),
    (lambda: per_device_bytes(1e9, 0, 0), "nd 0"),
    (lambda: per_device_bytes(1e9, 1, 4), "stage 4"),
    (lambda: per_device_bytes(1e9, 1, 0, dtype="fp8"), "'fp8'"),
    (lambda: per_device_bytes(1e9, 1, 0, optimizer="lamb"), "'lamb'"),
    (lambda: per_device_bytes(1e9, 1, 0, nm=0), "nm 0"),
    (lambda: per_device_bytes(1e9, 1, 0, activation=ActivationSpec(1600, 48, 0, 1024)), "batch_per_gpu 0"),
    (lambda: smallest_fit(1e9, 0), "device_bytes 0"),
    (lambda: smallest_fit(1e9, 80 * GB, max_nd=0), "max_nd 0"),
    (lambda: table(1e9, []), "nds []"),
    (lambda: gpt_params(0, 1600), "layers 0"),
])
def test_bad_input_raises_config_error_naming_the_value(call, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        call()


def test_config_error_names_what_is_allowed():
    with pytest.raises(ConfigError, match="bf16"):
        per_device_bytes(1e9, 1, 0, dtype="fp8")
    assert issubclass(ConfigError, ValueError)


# --- the CLI ---------------------------------------------------------------------------

def test_cli_prints_figure_1_for_7_5b_at_nd_64(capsys):
    assert main(["--params", "7.5e9", "--nd", "64"]) == 0
    out = capsys.readouterr().out
    for printed in ("120.0", "31.4", "16.6", "1.9"):  # Fig 1, in GB
        assert printed in out


def test_cli_as_a_module_in_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "zerolearn.memory", "--params", "7.5e9", "--nd", "64"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert all(printed in done.stdout for printed in ("120.0", "31.4", "16.6", "1.9"))


def test_cli_finds_zero1_on_two_gpus_for_7b_on_80gb(capsys):
    assert main(["--params", "7e9", "--device-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "P_os (stage 1) on 2 GPUs" in out and "70.0 GB per device" in out


def test_cli_json_has_bytes(capsys):
    assert main(["--params", "7.5e9", "--nd", "64", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stages = report["rows"][0]["stages"]
    assert stages[0]["total"] == 16 * 7_500_000_000  # 120e9 bytes
    assert stages[3]["total"] == 16 * 7_500_000_000 // 64
    assert report["smallest_fit"]["stage"] == 3 and report["smallest_fit"]["nd"] == 4


def test_cli_batch_adds_activations_and_changes_the_fit(capsys):
    base = ["--layers", "48", "--hidden", "1600", "--device-gb", "32", "--json"]
    main(base)
    without = json.loads(capsys.readouterr().out)
    main([*base, "--batch", "8", "--seq-len", "1024"])
    with_acts = json.loads(capsys.readouterr().out)
    assert without["rows"][0]["stages"][0]["activations"] == 0
    assert with_acts["rows"][0]["stages"][0]["activations"] == activation_bytes(1600, 8, 1024, 48)
    assert (without["smallest_fit"]["stage"], without["smallest_fit"]["nd"]) == (0, 1)
    assert (with_acts["smallest_fit"]["stage"], with_acts["smallest_fit"]["nd"]) == (2, 3)  # as in the test above


@pytest.mark.parametrize(("argv", "message"), [
    (["--params", "-1"], "--params -1.0: must be a finite number > 0"),
    (["--params", "1e9", "--nd", "0"], "--nd 0: must be an integer >= 1"),
    (["--params", "1e9", "--device-gb", "0"], "--device-gb 0.0: must be a finite number > 0"),
    (["--params", "1e9", "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
    (["--params", "1e9", "--optimizer", "lamb"], "argument --optimizer: invalid choice: 'lamb'"),
    ([], "give the model size"),
    (["--layers", "48"], "--layers and --hidden go together"),
    (["--params", "1e9", "--batch", "8"], "--batch needs --layers and --hidden"),
    (["--params", "1e9", "--checkpointing"], "--checkpointing needs --batch"),
])
def test_cli_bad_input_exits_2_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
