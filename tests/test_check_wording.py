"""`tools/check_wording.py`: flags history wording, passes technical uses of the same words."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("check_wording", ROOT / "tools/check_wording.py")
check_wording = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_wording)


@pytest.mark.parametrize(
    ("text", "path", "want"),
    [
        ("measured in the fifth session", "a.md", ["fifth session"]),
        ("H200, Twenty-third session (2026-12-03)", "a.py", ["Twenty-third session"]),
        ("(eighth and ninth sessions)", "a.py", ["eighth and ninth sessions"]),
        ("the 21st session's table", "a.md", ["21st session"]),
        ("next session: re-run it.", "a.md", ["session"]),
        ("## Ragged kernel (session lead, 2026-11-29)", "a.md", ["session"]),
        ("results in decode_quick_s21_mm.json", "a.py", ["_s21"]),
        ("see `lone_cta_s17_fm.json` and decode_timeline_s10b_1.json", "a.md", ["_s17", "_s10b"]),
        ("as measured (s21) and in s9: call 2", "a.md", ["s21", "s9"]),
    ],
)
def test_history_wording_is_flagged(text, path, want):
    assert [m.group(0) for m in check_wording.find(text, path)] == want


@pytest.mark.parametrize(
    "text",
    [
        "before any CUPTI session and after it",
        "a profiler session, a tmux session, an ssh session",
        "sess = session.run(x); session_id = 3; make(session=s)",
        "tf.Session() and aiohttp.ClientSession()",
        "possession, obsession",
        "for s0, e0 in spans: s2 = rng.integers(0, 9)",
        "ids: G4-C16-S3, x_S2",
    ],
)
def test_technical_words_pass(text):
    assert check_wording.find(text, "a.md") == []
    assert check_wording.find(text, "a.py") == []


def test_prose_tags_only_in_markdown():
    assert check_wording.find("a call (s21) here", "a.py") == []


def test_check_reports_file_and_line_and_skips_exempt_and_binary(tmp_path):
    (tmp_path / "doc.md").write_text("intro\n\nthe third session found it\n")
    (tmp_path / "blob.bin").write_bytes(b"\0 tenth session")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools/check_wording.py").write_text("the first session")
    paths = ["doc.md", "blob.bin", "tools/check_wording.py", "missing.md"]
    assert check_wording.check(tmp_path, paths) == ["doc.md:3: 'third session'"]


def test_command_line_exit_status(tmp_path):
    clean, dirty = tmp_path / "clean.md", tmp_path / "dirty.md"
    clean.write_text("what is\n")
    dirty.write_text("the sixth session\n")
    run = lambda *p: subprocess.run(  # noqa: E731
        [sys.executable, str(ROOT / "tools/check_wording.py"), *map(str, p)],
        capture_output=True,
        text=True,
    )
    assert run(clean).returncode == 0
    proc = run(clean, dirty)
    assert proc.returncode == 1 and f"{dirty}:1: 'sixth session'" in proc.stdout
