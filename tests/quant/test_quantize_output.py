"""`quant-serve quantize` never harms what it did not write (issue 39): --overwrite replaces only a checkpoint this
tool wrote, never the source model or a directory holding it; debris of killed runs is cleaned (only ours, only
stale); files get the umask's modes; unwritable targets and full disks end in one line and exit 2, with nothing
half-written left behind."""
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors import SafetensorError

from quant_serve.quant import output as output_mod
from quant_serve.quant import quantize as quantize_mod
from quant_serve.quant.output import MARKER, OWNER
from quant_serve.server.cli.main import main as cli


def linked_copy(model, path):
    path.mkdir(parents=True)
    for f in model.iterdir():
        (path / f.name).symlink_to(f)
    return path


def rtn(src, out, *flags):
    return cli(["quantize", str(src), str(out), "--method", "rtn", "--device", "cpu", *flags])


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_overwrite_replaces_only_our_checkpoints(tmp_path, capsys, random_model):
    lab = tmp_path / "lab"
    src = linked_copy(random_model, lab / "fp16")
    (lab / "other_model").mkdir()
    (lab / "other_model" / "weights.bin").write_bytes(b"w")
    (lab / "README").write_text("notes")
    before = sorted(p.relative_to(lab) for p in lab.rglob("*"))

    assert rtn(src, lab, "--overwrite") == 2                    # the probe: it deleted all of lab/
    assert "contains the source model" in one_error_line(capsys)
    assert rtn(src, src, "--overwrite") == 2
    assert "is the source model's directory" in one_error_line(capsys)
    assert rtn(src, src / "int4") == 2
    assert "inside the source model's directory" in one_error_line(capsys)
    assert rtn(src, lab / "other_model", "--overwrite") == 2
    assert f"holds no {MARKER}" in one_error_line(capsys)
    assert sorted(p.relative_to(lab) for p in lab.rglob("*")) == before

    out = tmp_path / "int4"
    assert rtn(src, out) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["source"] == str(src) and "model.safetensors" in marker["files"]
    assert rtn(src, out) == 2 and "--overwrite" in one_error_line(capsys)
    (out / "notes.txt").write_text("mine")
    assert rtn(src, out, "--overwrite") == 2
    assert "notes.txt, which quant-serve did not write" in one_error_line(capsys)
    (out / "notes.txt").unlink()
    inode = (out / "model.safetensors").stat().st_ino
    assert rtn(src, out, "--overwrite") == 0
    assert (out / "model.safetensors").stat().st_ino != inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int4", "lab"]


def test_debris_of_killed_runs_is_cleaned(tmp_path, trained_model):
    out = tmp_path / "int4"
    # the 27M-parameter model: its run lasts long enough to be killed half-way
    run = subprocess.Popen([sys.executable, "-m", "quant_serve.server.cli.main", "quantize", str(trained_model), str(out),
                            "--method", "rtn", "--device", "cpu"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".int4.partial-*")) and time.time() < deadline and run.poll() is None:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    killed = list(tmp_path.glob(".int4.partial-*"))
    assert len(killed) == 1 and (killed[0] / OWNER).is_file() and not out.exists()
    live = tmp_path / ".int4.partial-live"                      # a run still going (this process)
    live.mkdir()
    (live / OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    foreign = tmp_path / ".int4.partial-foreign"                # not provably ours: left alone
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    other = tmp_path / ".other.partial-x"                       # another output's
    other.mkdir()
    (other / OWNER).write_text(killed[0].joinpath(OWNER).read_text())

    assert rtn(trained_model, out) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".int4.partial-foreign", ".int4.partial-live",
                                                                 ".other.partial-x", "int4"])


@pytest.mark.parametrize("umask,dirs,files", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_files_get_the_umask_modes(tmp_path, umask, dirs, files, random_model):
    old = os.umask(umask)
    try:
        assert rtn(random_model, tmp_path / "int4") == 0       # was 0700 / 0600, and 0444 for copied files
    finally:
        os.umask(old)
    out = tmp_path / "int4"
    assert oct(out.stat().st_mode & 0o777) == oct(dirs)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert set(modes.values()) == {oct(files)}, modes


def _fail_save(*args, **kwargs):
    raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) at path "x"')


def _fail_copy(src, dst):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))


def _fail_mkdtemp(prefix=None, dir=None):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dir))


@pytest.mark.parametrize("target,patch,expected", [
    ("out", (output_mod, "save_file", _fail_save), "no space left on the device"),
    ("out", (quantize_mod.shutil, "copyfile", _fail_copy), "no space left on the device"),
    ("ro/out", (output_mod.tempfile, "mkdtemp", _fail_mkdtemp), "read-only file system"),
    ("/sys/x", None, "choose a directory you can write"),
], ids=["enospc-weights", "enospc-copy", "read-only", "sys"])
def test_unwritable_targets_end_in_one_line(tmp_path, monkeypatch, capsys, target, patch, expected, random_model):
    if target.startswith("/sys") and not os.path.isdir("/sys/kernel"):
        pytest.skip("needs Linux sysfs")
    if patch is not None:
        monkeypatch.setattr(*patch)
    out = tmp_path / target if not target.startswith("/") else target
    assert rtn(random_model, out) == 2
    line = one_error_line(capsys)
    assert f"cannot write the quantized checkpoint {out}" in line and expected in line, line
    if not target.startswith("/"):
        assert not os.path.exists(out)
        assert not [p for p in tmp_path.rglob("*") if ".partial-" in p.name or ".old-" in p.name]
