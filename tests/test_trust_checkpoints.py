"""A checkpoint is trusted only as a whole: every field of the manifest is checked against
its schema and against every other field it can be checked against, the file hashed is
the file loaded, and a run resumes from the newest checkpoint that passes, whatever the
damage to a newer one, saying which and why. OUT never lands inside a checkpoint;
options that shape the model must match on resume, those of the optimisation may change
and are named."""

import contextlib
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

import jobs
from jobs import on_ranks
from zerolearn import checkpoint
from zerolearn.checkpoint import __main__ as checkpoint_cli
from zerolearn.config import TrainConfig
from zerolearn.dist import launch

pytestmark = pytest.mark.slow  # damaged checkpoints resumed on spawned ranks

RUN = TrainConfig(stage=2, steps=4, global_batch_size=4, seq_len=16, d_model=32, n_head=2, bucket_mb=0.01,
                  checkpoint_every=2, checkpoint_keep=0, quiet=True, checkpoint_dir="unset")
NEW, OLD = "step_00000004", "step_00000002"


def edit_manifest(d: Path, change) -> None:
    name = d / NEW / "manifest.json"
    man = json.loads(name.read_text())
    replaced = change(man, d / NEW)  # None: edited in place; a str: the file's new text
    name.write_text(replaced if isinstance(replaced, str) else json.dumps(man))


def clean_copy_named_in_the_manifest(man: dict, ckpt: Path) -> None:
    # The manifest's entry for rank 0 names an untouched copy; the file rank 0's
    # reader opens, rank_00000.pt, is altered (one byte).
    shutil.copyfile(ckpt / "rank_00000.pt", ckpt / "clean_00000.pt")
    data = bytearray((ckpt / "rank_00000.pt").read_bytes())
    data[len(data) // 2] ^= 0x10
    (ckpt / "rank_00000.pt").write_bytes(bytes(data))
    man["files"][0]["file"] = "clean_00000.pt"


def shift_offsets(man: dict, ckpt: Path) -> None:
    man["groups"][0]["offsets"] = [o + 1 for o in man["groups"][0]["offsets"]]


def drop_rank_1s_piece(man: dict, ckpt: Path) -> None:
    man["groups"][0]["pieces"] = [p for p in man["groups"][0]["pieces"] if p[0] != 1]


def set_(path: str, value):
    """An edit that sets ``man[path...]`` (keys separated by '/') to ``value``, or deletes it
    for ``value`` is DELETE."""
    def change(man: dict, ckpt: Path) -> None:
        *keys, last = [int(k) if k.isdigit() else k for k in path.split("/")]
        obj = man
        for k in keys:
            obj = obj[k]
        if value is DELETE:
            del obj[last]
        else:
            obj[last] = value
    return change


DELETE = object()

# (edit of the step-4 manifest, what info, consolidate and resume must name)
TAMPER = {
    "file_points_at_a_clean_copy": (clean_copy_named_in_the_manifest,
                                    r"files\[0\]\.file: 'clean_00000.pt', but rank 0's shard is 'rank_00000.pt'"),
    "step_4_to_3": (set_("step", 3), r"step: 3, but the folder step_00000004 holds step 4"),
    "step_4_to_minus_5": (set_("step", -5), r"step: -5, must be an integer >= 0"),
    "offsets_shifted_by_one": (shift_offsets, r"groups\[0\]\.offsets\[0\]: 1, but the shapes before it imply 0"),
    "numel": (set_("groups/0/numel", 7), r"groups\[0\]\.numel: 7, but its shapes hold \d+ elements"),
    "uncovered": (drop_rank_1s_piece, r"groups\[0\]\.pieces: elements \d+.. of group 0 .*in no rank's shard"),
    "files_missing": (set_("files", DELETE), r"files: missing"),
    "files_wrong_type": (set_("files", {"rank": 0}), r"files: dict .*, must be a list"),
    "file_entry_key_missing": (set_("files/1/bytes", DELETE), r"files\[1\]\.bytes: missing"),
    "sha256_wrong_type": (set_("files/1/sha256", 5), r"files\[1\]\.sha256: int 5, must be 64 lower-case hex"),
    "owner_stage": (set_("files/1/stage", 3), r"files\[1\]\.stage: 3, but the manifest's stage is 2"),
    "groups_missing": (set_("groups", DELETE), r"groups: missing"),
    "groups_wrong_type": (set_("groups", "all"), r"groups: str 'all', must be a list"),
    "extra_wrong_type": (set_("extra", []), r"extra: list \[\], must be an object"),
    "extra_missing": (set_("extra", DELETE), r"extra: missing"),
    "scaler_missing": (set_("scaler", DELETE), r"scaler: missing"),
    "scaler_wrong_type": (set_("scaler/scale", "big"), r"scaler\.scale: 'big', must be a finite number > 0"),
    "piece_index_out_of_range": (set_("groups/0/pieces/1/3", 7),
                                 r"groups\[0\]\.pieces: rank 1's piece of group 0 has index 7"),
    "piece_index_wrong_type": (set_("groups/0/pieces/0/3", "0"),
                               r"groups\[0\]\.pieces\[0\]\[3\]: '0', must be an integer"),
    "not_an_object": (lambda man, ckpt: "[]", r"the manifest: list \[\], must be an object"),
    "nested_too_deep": (lambda man, ckpt: "[" * 100_000 + "]" * 100_000,
                        r"cannot be read as JSON \(RecursionError"),
    "piece_rank_out_of_range": (set_("groups/0/pieces/1/0", 2),
                                r"groups\[0\]\.pieces\[1\]\[0\]: 2, must be an integer from 0 to 1"),
}


@contextlib.contextmanager
def stderr_into(path: Path):
    """Send this process's file descriptor 2 (and the spawned ranks', which inherit it) to ``path``."""
    sys.stderr.flush()
    saved, fd = os.dup(2), os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """2 ranks at stage 2 train 4 steps, saving after steps 2 and 4. Then, on 2 ranks
    again, runs resume to step 6 from copies: one holding only the step-2 checkpoint
    (the reference), copies whose step-4 checkpoint is tampered, one with another
    --n-head, one with another weight decay and clipping."""
    root = tmp_path_factory.mktemp("trust")
    d = root / "ck"
    first = on_ranks(jobs.train_jobs, 2, [RUN.replace(checkpoint_dir=str(d))])[0][0]
    copies = {}
    for name in ("older_only", "file_points_at_a_clean_copy", "offsets_shifted_by_one", "files_missing",
                 "n_head", "optimisation"):
        copies[name] = root / name
        shutil.copytree(d, copies[name])
    shutil.rmtree(copies["older_only"] / NEW)
    for name in ("file_points_at_a_clean_copy", "offsets_shifted_by_one", "files_missing"):
        edit_manifest(copies[name], TAMPER[name][0])
    shutil.rmtree(copies["n_head"] / NEW)
    shutil.rmtree(copies["optimisation"] / NEW)
    resumed = RUN.replace(steps=6)
    configs = [resumed.replace(checkpoint_dir=str(copies[n])) for n in copies]
    configs[-2] = configs[-2].replace(n_head=4)  # same shapes, another function
    configs[-1] = configs[-1].replace(weight_decay=0.1, max_grad_norm=1.0)
    with stderr_into(root / "stderr.txt"):
        reports = launch(jobs.train_jobs, 2, configs)[0]
    return {"dir": d, "first": first, "copies": copies, "reports": dict(zip(copies, reports, strict=True)),
            "stderr": (root / "stderr.txt").read_text()}


def tampered(saved, tmp_path, case: str) -> Path:
    d = tmp_path / "ck"
    shutil.copytree(saved["dir"], d)
    edit_manifest(d, TAMPER[case][0])
    return d


@pytest.mark.parametrize("case", TAMPER)
def test_info_and_consolidate_exit_2_naming_file_and_field_and_resume_skips_it(saved, tmp_path, capsys, case):
    d = tampered(saved, tmp_path, case)
    named = re.escape(str(d / NEW / "manifest.json")) + ": " + TAMPER[case][1]
    out = tmp_path / "model.pt"
    for argv in (["info", str(d)], ["consolidate", str(d), str(out)]):
        with pytest.raises(SystemExit) as info:
            checkpoint_cli.main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2, (argv, err)
        assert re.search(named, err), err
        assert "Traceback" not in err
    assert not out.exists() and not Path(str(out) + ".part").exists()
    # Resume's choice: the step-2 checkpoint, the step-4 one skipped with the same reason.
    path, note, skipped = checkpoint.choose(str(d))
    assert path == str(d / OLD) and note is None
    assert skipped[0][0] == str(d / NEW) and re.search(named, skipped[0][1]), skipped


def test_the_file_hashed_is_the_file_loaded(saved, tmp_path):
    # The same tampering with the manifest rebuilt around the clean copy's name cannot
    # pass either: rank 0's reader opens rank_00000.pt, which is what verify hashes.
    d = tampered(saved, tmp_path, "file_points_at_a_clean_copy")
    man = json.loads((d / NEW / "manifest.json").read_text())
    man["files"][0]["file"] = "rank_00000.pt"
    (d / NEW / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(checkpoint.CheckpointError, match=r"step_00000004/rank_00000.pt: SHA-256 .* differs"):
        checkpoint.verify(str(d / NEW))


@pytest.mark.parametrize("case", ["file_points_at_a_clean_copy", "offsets_shifted_by_one", "files_missing"])
def test_resume_from_a_tampered_newest_ends_like_an_untampered_run_from_the_older(saved, case):
    reference = saved["reports"]["older_only"]
    assert reference["first_step"] == 2 and len(reference["losses"]) == 4
    assert reference["losses"][:2] == saved["first"]["losses"][2:]  # resumed exactly
    report = saved["reports"][case]
    assert report["first_step"] == 2
    assert report["losses"] == reference["losses"]  # the same final loss, bit for bit
    d = saved["copies"][case]
    line = f"checkpoint {d / NEW} fails verification, resuming from {d / OLD} instead: "
    assert saved["stderr"].count(line) == 1, saved["stderr"]
    said = saved["stderr"].split(line)[1].splitlines()[0]
    assert re.search(TAMPER[case][1], said), said
    checkpoint.verify(str(d / NEW))  # step 4 saved again, whole


def test_every_option_that_shapes_the_model_must_match_on_resume(saved):
    message = saved["reports"]["n_head"]
    assert isinstance(message, str), message  # the ConfigError's message: nothing trained
    assert "holds a checkpoint of a run with other options: this run has --n-head 4 (the checkpoint's run: 2)" \
        in message
    assert not (saved["copies"]["n_head"] / NEW).exists()


def test_options_of_the_optimisation_may_change_on_resume_and_are_named(saved):
    report = saved["reports"]["optimisation"]
    assert report["first_step"] == 2 and len(report["losses"]) == 4
    d = saved["copies"]["optimisation"]
    line = (f"resuming from {d / OLD} with changed options: --weight-decay 0.1 (the checkpoint's run: 0.0), "
            "--max-grad-norm 1.0 (the checkpoint's run: None)")
    assert saved["stderr"].count(line) == 1, saved["stderr"]


@pytest.mark.parametrize("out", ["ck", "ck/step_00000004/manifest.json", "ck/step_00000004/rank_00001.pt",
                                 "ck/model.pt", "ck/step_00000002/model.pt", "ck/step_00000004/"])
def test_consolidate_refuses_an_out_inside_a_checkpoint_and_changes_nothing(saved, tmp_path, capsys, out,
                                                                            monkeypatch):
    d = tmp_path / "ck"
    shutil.copytree(saved["dir"], d)
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    monkeypatch.chdir(tmp_path)
    for source in ("ck", "ck/step_00000004"):
        with pytest.raises(SystemExit) as info:
            checkpoint_cli.main(["consolidate", source, out])
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert re.search(r"error: OUT .*(inside the checkpoint directory|a folder; give a file name)", err), err
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before
    # Beside the checkpoint directory, not in it, is fine.
    assert checkpoint_cli.main(["consolidate", "ck", "model.pt"]) == 0
    assert (tmp_path / "model.pt").is_file()


def load_unverified(path: str) -> str | None:
    """(launched, 1 rank) Load ``path`` into a fresh engine without verifying it first, as
    ranks do after rank 0 verified it: the CheckpointError's message, or None."""
    from zerolearn import train
    from zerolearn.engines import make_engine

    engine = make_engine(2, train.build(RUN), optimizer=RUN.optimizer, lr=RUN.lr, bucket_mb=RUN.bucket_mb)
    try:
        checkpoint.load(engine, path, verify_files=False)
    except checkpoint.CheckpointError as e:
        return str(e)
    return None


def test_a_shard_changed_after_it_was_verified_is_caught_by_the_reader_itself(saved, tmp_path):
    # verify passes, then a byte of a tensor changes on disk before the ranks read the file
    # (a race with another program, a flaky disk): the reader hashes the bytes it loads.
    d = tmp_path / "ck"
    shutil.copytree(saved["dir"], d)
    checkpoint.verify(str(d / NEW))
    shard = d / NEW / "rank_00001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    message = on_ranks(load_unverified, 1, str(d / NEW))[0]
    assert message is not None and re.search(r"step_00000004/rank_00001.pt: the bytes read \(\d+\) are not those "
                                             r"the manifest records .*: the file changed after it was verified",
                                             message), message
