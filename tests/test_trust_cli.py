"""Bad input to every command line is exit 2 before any work, paths included: a report
path ending in a separator, a missing folder, a loop of symbolic links, a component that
is a file, an integer out of range. All in this process: nothing is trained."""

import errno
import os

import pytest

from zerolearn import cli
from zerolearn.bench import __main__ as bench_cli
from zerolearn.checkpoint import __main__ as checkpoint_cli
from zerolearn.memory import __main__ as memory_cli
from zerolearn.timeline import __main__ as timeline_cli

pytestmark = pytest.mark.quick


@pytest.fixture
def paths(tmp_path, monkeypatch) -> dict:
    """A loop of symbolic links, a plain file and a missing folder, in a fresh working folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "file").write_text("not a folder")
    return {"loop": str(tmp_path / "loop"), "file": str(tmp_path / "file"), "missing": str(tmp_path / "no" / "x")}


def refused(main, argv: list[str], capsys) -> str:
    """Run ``main(argv)``: it must exit 2; its stderr, which must hold no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


TRAIN = [
    (["--report", "newdir/"], "--report newdir/: ends in a path separator; give a file name"),
    (["--report", "{missing}"], "--report {missing}: cannot write a file there (the folder must exist"),
    (["--report", "{loop}"], "--report {loop}: cannot be reached (Too many levels of symbolic links"),
    (["--report", "{file}/run.json"], "--report {file}/run.json: cannot be reached (Not a directory"),
    (["--checkpoint-dir", "{loop}"], "--checkpoint-dir {loop}: cannot be reached (Too many levels of symbolic"),
    (["--checkpoint-dir", "{loop}/sub"], "--checkpoint-dir {loop}/sub: cannot be reached"),
    (["--checkpoint-dir", "{file}"], "--checkpoint-dir {file}: not a writable folder"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: too large; allowed are up to 4294967295"),
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--steps", "99999999999999999999"], "--steps 99999999999999999999: too large; allowed are up to"),
    (["--timeout", "1e300"], "--timeout 1e+300: too large; allowed are up to 2147483647"),
]


@pytest.mark.parametrize("argv, message", TRAIN)
def test_train_refuses_bad_paths_and_numbers_with_exit_2_before_any_work(argv, message, paths, capsys):
    argv = [a.format(**paths) for a in argv]
    err = refused(cli.main, [*argv, "--steps", "1"] if "--steps" not in argv else argv, capsys)
    assert message.format(**paths) in err, err
    assert sorted(os.listdir(".")) == ["file", "loop"]  # nothing written


@pytest.mark.parametrize("argv, message", [
    (["--out", "{file}"], "--out {file}: not a writable folder"),
    (["--out", "{loop}"], "--out {loop}: cannot be reached (Too many levels of symbolic links"),
    (["--out", "{file}/sub"], "--out {file}/sub: cannot be reached (Not a directory"),
    (["--out", "o", "--traces", "{loop}"], "--traces {loop}: cannot be reached"),
    (["--out", "o", "--world-size", "99999999999999999999"], "--world-size 99999999999999999999: allowed are 1 to"),
    (["--out", "o", "--repeats", "0"], "--repeats 0: allowed are 1 to"),
])
def test_timeline_refuses_bad_paths_and_numbers_with_exit_2_before_any_work(argv, message, paths, capsys):
    err = refused(timeline_cli.main, [a.format(**paths) for a in argv], capsys)
    assert message.format(**paths) in err, err
    assert not os.path.exists("o")


def test_timeline_makes_its_folders_before_recording_and_names_one_it_cannot_make(paths, capsys, monkeypatch):
    def cannot(path, exist_ok=False):  # a read-only file system, say, that the checks above let through
        raise OSError(errno.EROFS, "Read-only file system", path)

    def record_all(*args):
        raise AssertionError("recorded before the output folder was made")

    monkeypatch.setattr(timeline_cli.os, "makedirs", cannot)
    monkeypatch.setattr(timeline_cli.timeline, "record_all", record_all)
    err = refused(timeline_cli.main, ["--out", "o"], capsys)
    assert "--out o: cannot be created (Read-only file system: o)" in err, err


@pytest.mark.parametrize("argv, message", [
    (["--out", "newdir/"], "--out newdir/: ends in a path separator"),
    (["--out", "{loop}"], "--out {loop}: cannot be reached"),
    (["--out", "{missing}"], "--out {missing}: cannot write a file there"),
    (["--seed", "99999999999999999999"], "--seed 99999999999999999999: too large"),
])
def test_bench_refuses_bad_paths_and_numbers_with_exit_2_before_any_rank(argv, message, paths, capsys):
    err = refused(bench_cli.main, ["--quick", *[a.format(**paths) for a in argv]], capsys)
    assert message.format(**paths) in err, err


def test_memory_refuses_a_device_too_large_to_count_in_bytes(capsys):
    err = refused(memory_cli.main, ["--params", "7e9", "--device-gb", "1e300"], capsys)
    assert "--device-gb 1e+300: too large" in err


@pytest.mark.parametrize("argv, message", [
    (["info", "{loop}"], "{loop}: no complete checkpoint"),
    (["info", "{missing}"], "{missing}: no complete checkpoint"),
    (["consolidate", "{missing}", "out/"], "OUT 'out/': a folder; give a file name"),
    (["consolidate", "{missing}", "{file}/model.pt"], "OUT {file}/model.pt: {file} is not a folder"),
    (["consolidate", "{missing}", "{loop}/model.pt"], "OUT {loop}/model.pt: its folder {loop} cannot be reached "
                                                      "(Too many levels of symbolic links)"),
])
def test_checkpoint_cli_refuses_bad_paths_with_exit_2(argv, message, paths, capsys):
    err = refused(checkpoint_cli.main, [a.format(**paths) for a in argv], capsys)
    assert message.format(**paths) in err, err


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size 0: must be an integer >= 1"),
    (["--world-size", "99999999999999999999"], "--global-batch-size 16 is not divisible by world size 999999"),
    (["--steps", "0"], "--steps 0: must be an integer >= 1"),
    (["--report", "x/"], "--report x/: ends in a path separator"),
])
def test_tour_refuses_what_its_ranks_would_refuse_before_any_rank_starts(argv, message, capsys):
    from zerolearn import tour

    assert message in refused(tour.main, argv, capsys)
