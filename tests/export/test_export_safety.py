"""`oscar-zoo export`: shell files that nothing from a manifest can break out of, and writes that are all or nothing.

A manifest's `model.id` lands in `sglang.env` and `launch_sglang.sh`: an id with a newline must never become a
command (checked by sourcing / running the files with bash, not by reading them), and odd but printable ids must reach
the server as one exact argument. Bad `--out` values are exit 2 with one line, never a traceback; a failure part-way
(a target name that is a folder, a move that fails) leaves the destination byte for byte as it was, with no staging
folders left behind."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from oscar_zoo.errors import InputError, IntegrityError
from oscar_zoo.export import staging
from oscar_zoo.export.oscar_pt import K_FILE, V_FILE, export_oscar_pt
from oscar_zoo.export.sglang import ENV_FILE, LAUNCH_SCRIPT, SglangSettings, write_sglang_files

from ..hub.helpers import make_artifacts

L, D, H_KV = 2, 16, 2
ALL_FILES = (K_FILE, V_FILE, ENV_FILE, LAUNCH_SCRIPT)


@pytest.fixture
def art(tmp_path):
    make_artifacts(tmp_path / "art", granularity="per-layer", L=L, H_kv=H_KV, D=D)
    return tmp_path / "art"


def _set_model_id(folder, model_id):
    """Edit manifest.json as a hostile publisher would (the manifest is not itself checksummed)."""
    path = folder / "manifest.json"
    doc = json.loads(path.read_text())
    doc["model"]["id"] = model_id
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _snapshot(folder):
    """Every entry under `folder` (hidden ones too): relative path -> bytes, or 'dir'."""
    return {p.relative_to(folder).as_posix(): ("dir" if p.is_dir() else p.read_bytes())
            for p in sorted(folder.rglob("*"))}


def _one_line_error(code, err, expected):
    assert code == expected and "Traceback" not in err, err
    assert sum(line.startswith("error:") for line in err.splitlines()) == 1, err


def _no_staging_left(*folders):
    for folder in folders:
        left = [p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".pull")) or "oscar-export" in p.name]
        assert not left, left


def _source_and_launch(out, fake_bin):
    """Source sglang.env in its folder and run launch_sglang.sh with a fake `python` that prints its arguments, one
    per line; returns those arguments."""
    subprocess.run(["bash", "-c", "set -a; . ./sglang.env; set +a"], cwd=out, check=True, capture_output=True)
    ran = subprocess.run([str(out / LAUNCH_SCRIPT)], cwd=out.parent, capture_output=True, text=True, check=True,
                         env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"})
    return ran.stdout.split("\n")[:-1]


@pytest.fixture
def fake_bin(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "python").write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    (folder / "python").chmod(0o755)
    return folder


# -- shell injection --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sep", ["\n", "\r\n", "\n#\n", "\u2028"])
def test_model_id_with_a_line_break_never_runs_a_command(art, run_cli, tmp_path, sep):
    """The reported injection: `org/Tiny-Llama<newline>touch MARKER` in the manifest. Refused with one line (exit 4,
    whether the manifest loader or the sglang writer refuses it); no shell file is written, and whatever is in --out
    runs nothing when sourced."""
    marker = tmp_path / "PWNED"
    _set_model_id(art, f"org/Tiny-Llama{sep}touch {marker}")
    out = tmp_path / "sg"
    code, _, err = run_cli("export", art, "--format", "sglang", "--out", out)
    _one_line_error(code, err, 4)
    for name in (ENV_FILE, LAUNCH_SCRIPT):
        if (out / name).exists():  # (never, after the fix) an independent check of what a user would do with it
            subprocess.run(["bash", "-c", f"set -a; . ./{name}; set +a"], cwd=out, capture_output=True)
    assert not marker.exists(), "sourcing the export ran a command from the manifest"
    assert not (out / ENV_FILE).exists() and not (out / LAUNCH_SCRIPT).exists()


@pytest.mark.parametrize("bad", ["\n", "\r", "\x00", "\x1b[2J", "\x85", "\u2029", "\u202e"])
def test_writer_refuses_control_characters_in_any_value(tmp_path, bad):
    """The writer holds on its own, whatever reaches it (a model id or a setting the manifest schema let through):
    IntegrityError before anything is written."""
    settings = SglangSettings({"SGLANG_ENABLE_MIXED_KV_WINDOWS": "1"}, ["--kv-cache-dtype", "int2"], (0.0, 0.0))
    bad_value = SglangSettings({"SGLANG_MIXED_KV_HP_DTYPE": f"bfloat16{bad}touch /tmp/x"}, [], (0.0, 0.0))
    for model, chosen in ((f"org/x{bad}touch /tmp/x", settings), ("org/x", bad_value)):
        with pytest.raises(IntegrityError, match="control, line-break or bidi-override"):
            write_sglang_files(tmp_path / "out", chosen, model)
        assert not (tmp_path / "out").exists()


def test_printable_ids_with_shell_syntax_reach_the_server_as_one_exact_argument(tmp_path, fake_bin):
    """Quotes, `$(…)`, backticks, `;`, spaces and a zero-width joiner in a model id: sourcing and launching run
    nothing of them, the server gets the id unchanged, and the `# model:` comment stays one line (the joiner
    escaped). (A bidi override is refused: test_writer_refuses_control_characters_in_any_value.)"""
    markers = [tmp_path / f"M{i}" for i in range(4)]
    model = (f"org/x'; touch {markers[0]}; echo ' $(touch {markers[1]}) `touch {markers[2]}` \"$HOME\" ;"
             f"touch {markers[3]} \\ \u200dtxt.exe")
    settings = SglangSettings({"SGLANG_OSCAR_K_ROTATION_PATH": K_FILE, "SGLANG_OSCAR_V_ROTATION_PATH": V_FILE,
                               "SGLANG_OSCAR_K_CLIP_RATIO": "0.96"}, ["--kv-cache-dtype", "int2"], (0.0, 0.0))
    out = tmp_path / "sg"
    write_sglang_files(out, settings, model)
    for name in (ENV_FILE, LAUNCH_SCRIPT):
        subprocess.run(["bash", "-n", str(out / name)], check=True)
        comments = [line for line in (out / name).read_text().splitlines() if line.startswith("# model: ")]
        assert len(comments) == 1 and "\u200d" not in comments[0] and "\\u200d" in comments[0]
    args = _source_and_launch(out, fake_bin)
    assert args[:4] == ["-m", "sglang.launch_server", "--model-path", model]
    assert args[4:] == ["--kv-cache-dtype", "int2"]
    assert not any(m.exists() for m in markers)


# -- bad --out: one line, exit 2, nothing changed ---------------------------------------------------------------------
def test_out_naming_an_existing_file_is_exit_2(art, run_cli, tmp_path):
    afile = tmp_path / "afile"
    afile.write_bytes(b"mine")
    for fmt in ("oscar-pt", "sglang"):
        code, _, err = run_cli("export", art, "--format", fmt, "--out", afile)
        _one_line_error(code, err, 2)
        assert "not a folder" in err and afile.read_bytes() == b"mine"
        code, _, err = run_cli("export", art, "--format", fmt, "--out", afile / "sub")
        _one_line_error(code, err, 2)
        assert "which is a file" in err and afile.read_bytes() == b"mine"
    _no_staging_left(tmp_path)


def test_out_that_cannot_be_resolved_is_exit_2(art, run_cli, tmp_path):
    (tmp_path / "loopA").symlink_to(tmp_path / "loopB")
    (tmp_path / "loopB").symlink_to(tmp_path / "loopA")
    for out in (tmp_path / "loopA", tmp_path / ("x" * 300)):
        for fmt in ("oscar-pt", "sglang"):
            code, _, err = run_cli("export", art, "--format", fmt, "--out", out)
            _one_line_error(code, err, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "loopA", "loopB"]


@pytest.mark.parametrize("fmt", ["oscar-pt", "sglang"])
@pytest.mark.parametrize("folder_name", [K_FILE, V_FILE])
def test_a_folder_under_an_output_name_changes_nothing(art, run_cli, tmp_path, fmt, folder_name):
    """The reported partial export: with the V (or K) name taken by a folder, the other .pt file was still written
    (or overwritten). Now: exit 2, one line, the folder's previous files byte for byte as they were."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ALL_FILES:
        if name != folder_name:
            (out / name).write_bytes(b"previous " + name.encode())
    (out / folder_name).mkdir()
    (out / folder_name / "inside").write_bytes(b"kept")
    (out / "notes.txt").write_bytes(b"someone else's file")
    before = _snapshot(out)
    code, _, err = run_cli("export", art, "--format", fmt, "--out", out)
    _one_line_error(code, err, 2)
    assert folder_name in err
    assert _snapshot(out) == before
    _no_staging_left(out, tmp_path)


@pytest.mark.parametrize("via", ["api", "cli"])
@pytest.mark.parametrize("folder_name", [ENV_FILE, LAUNCH_SCRIPT])
def test_sglang_export_is_all_or_nothing(art, run_cli, tmp_path, folder_name, via):
    """export_oscar_pt(…, sglang=True), and `export --format sglang`, write the four files as one set: a folder where
    sglang.env or the launch script goes leaves the old .pt files as they were."""
    out = tmp_path / "out"
    out.mkdir()
    for name in (K_FILE, V_FILE):
        (out / name).write_bytes(b"previous")
    (out / folder_name).mkdir()
    before = _snapshot(out)
    if via == "api":
        with pytest.raises(InputError, match=folder_name):
            export_oscar_pt(art, out, False, sglang=True)
    else:
        code, _, err = run_cli("export", art, "--format", "sglang", "--out", out)
        _one_line_error(code, err, 2)
    assert _snapshot(out) == before
    _no_staging_left(out, tmp_path)


def test_a_failing_move_puts_everything_back(art, tmp_path, monkeypatch):
    """A failure after some files were already moved into place (simulated: the move of the third file fails): the
    moved ones are taken back out, the files they replaced are restored, nothing is left behind."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ALL_FILES:
        (out / name).write_bytes(staging.stamp(b"previous " + name.encode()))  # an earlier export's files
    (out / "notes.txt").write_bytes(b"kept")
    before = _snapshot(out)
    real = os.replace
    moved_in = []

    def failing(src, dst, *a, **kw):
        stage = os.path.basename(os.path.dirname(str(src)))  # a staged file, not one set aside or a temp file
        if stage.startswith(".oscar-export.") and os.path.dirname(str(dst)) == str(out) and len(moved_in) < 3:
            moved_in.append(os.path.basename(str(dst)))
            if len(moved_in) == 3:
                raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(staging.os, "replace", failing)
    with pytest.raises(InputError, match="nothing was changed"):
        export_oscar_pt(art, out, False, sglang=True)
    monkeypatch.undo()
    assert len(moved_in) == 3
    assert _snapshot(out) == before
    _no_staging_left(out, tmp_path)


def test_an_undo_that_fails_keeps_the_replaced_files_and_says_where(art, tmp_path, monkeypatch):
    """The move of the second file fails, and so does every move back out of --out: the error says the export could
    not be undone and names the folder that still holds every replaced file, which is kept (not deleted)."""
    out = tmp_path / "out"
    out.mkdir()
    for name in (K_FILE, V_FILE):
        (out / name).write_bytes(staging.stamp(b"previous " + name.encode()))  # an earlier export's files
    real = os.replace
    calls = []

    def failing(src, dst, *a, **kw):
        from_stage = os.path.basename(os.path.dirname(str(src))).startswith(".oscar-export.")
        if from_stage and os.path.dirname(str(dst)) == str(out):
            calls.append(os.path.basename(str(dst)))
            if len(calls) == 2:
                raise OSError(errno.EIO, "Input/output error", str(dst))
        to_stage = os.path.basename(os.path.dirname(str(dst))).startswith(".oscar-export.")
        if os.path.dirname(str(src)) == str(out) and to_stage:
            raise OSError(errno.EIO, "Input/output error", str(src))  # taking a new file back out fails
        return real(src, dst, *a, **kw)

    monkeypatch.setattr(staging.os, "replace", failing)
    with pytest.raises(InputError, match="could not be undone") as raised:
        export_oscar_pt(art, out, False)
    monkeypatch.undo()
    aside = Path(str(raised.value.message).split("the files it replaced are in ")[1])
    assert "nothing was changed" not in raised.value.message
    assert sorted(p.name for p in aside.iterdir()) == [K_FILE, V_FILE]  # V was set aside before its move failed
    for name in (K_FILE, V_FILE):
        assert (aside / name).read_bytes() == staging.stamp(b"previous " + name.encode())


def test_a_killed_exports_set_aside_files_are_put_back(art, tmp_path):
    """A run killed between setting a file aside and finishing left its staging folder inside --out, the old
    sglang.env set aside there and a new one in place. The next export (oscar-pt: it writes no sglang.env) puts the old
    file back before it removes the dead run's folder."""
    from oscar_zoo.artifacts import _owner_tag

    out = tmp_path / "out"
    out.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    stale = out / f".{staging.STAGING_NAME}.{_owner_tag().split('-')[0]}-{dead.pid}.abc123.tmp"
    (stale / ".replaced").mkdir(parents=True)
    (stale / ".replaced" / ENV_FILE).write_bytes(staging.stamp(b"old settings"))
    (out / ENV_FILE).write_bytes(staging.stamp(b"half of a killed run"))
    export_oscar_pt(art, out, False)
    assert (out / ENV_FILE).read_bytes() == staging.stamp(b"old settings")
    assert not stale.exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([ENV_FILE, K_FILE, V_FILE])


@pytest.mark.parametrize("planted", ["unmarked", "marked"])
def test_a_staging_folder_never_puts_a_file_over_the_users(art, tmp_path, planted):
    """A staging folder that holds a set-aside file export did not write (or one over a file the user wrote): the
    user's file stays byte for byte, and the folder is kept with what it holds (nothing is lost either way)."""
    from oscar_zoo.artifacts import _owner_tag

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_bytes(b"mine")
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = out / f".{staging.STAGING_NAME}.{_owner_tag().split('-')[0]}-{dead.pid}.abc123.tmp"
    (stale / ".replaced").mkdir(parents=True)
    evil = b"evil" if planted == "unmarked" else staging.stamp(b"evil")
    (stale / ".replaced" / "notes.txt").write_bytes(evil)
    export_oscar_pt(art, out, False)
    assert (out / "notes.txt").read_bytes() == b"mine"
    assert (stale / ".replaced" / "notes.txt").read_bytes() == evil
    assert (out / K_FILE).is_file() and (out / V_FILE).is_file()


# -- what succeeds ----------------------------------------------------------------------------------------------------
def test_export_over_a_previous_one_replaces_only_its_files(art, run_cli, tmp_path, fake_bin):
    """A new nested --out, then again into the same folder (now holding other files too): exit 0 both times, the
    export's files replaced, the others kept, usual modes, no staging left; the scripts work."""
    out = tmp_path / "a" / "b" / "sg"
    assert run_cli("export", art, "--format", "sglang", "--out", out)[0] == 0
    (out / "notes.txt").write_bytes(b"kept")
    (out / K_FILE).write_bytes(staging.stamp(b"stale"))  # an earlier export's file
    code, _, err = run_cli("export", art, "--format", "sglang", "--out", out)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == sorted([*ALL_FILES, "notes.txt"])
    assert (out / "notes.txt").read_bytes() == b"kept" and (out / K_FILE).read_bytes() != staging.stamp(b"stale")
    umask = os.umask(0o022)
    os.umask(umask)
    assert (out / K_FILE).stat().st_mode & 0o777 == 0o666 & ~umask
    assert (out / LAUNCH_SCRIPT).stat().st_mode & 0o777 == 0o777 & ~umask
    assert out.stat().st_mode & 0o777 == 0o777 & ~umask
    args = _source_and_launch(out, fake_bin)
    assert args[:4] == ["-m", "sglang.launch_server", "--model-path", "org/Tiny-Llama"]
    _no_staging_left(out, out.parent)


def test_export_into_the_current_folder(art, run_cli, tmp_path, monkeypatch):
    """`--out .` adds the files to the folder the shell is in (no swap of the folder itself)."""
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_bytes(b"kept")
    monkeypatch.chdir(here)
    code, _, err = run_cli("export", art, "--format", "oscar-pt", "--out", ".")
    assert code == 0, err
    assert sorted(p.name for p in here.iterdir()) == sorted([K_FILE, V_FILE, "notes.txt"])
