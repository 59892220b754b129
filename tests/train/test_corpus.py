import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from gpuflex.errors import BadRequest
from gpuflex.train.corpus import MIN_BYTES, build_corpus


def _write(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def test_stdlib_corpus_is_deterministic_nonempty_and_capped():
    first = build_corpus("stdlib", 50_000, [".py"])
    assert len(first) == 50_000
    assert first == build_corpus("stdlib", 50_000, [".py"])
    assert b"def " in first and b"import " in first


def test_stdlib_skips_tests_and_site_packages(tmp_path, monkeypatch):
    big = b"x = 1\n" * 2_000
    _write(
        tmp_path,
        {
            "b.py": b"# B\n" + big,
            "a/m.py": b"# A\n" + big,
            "test/t.py": b"# TEST\n" + big,
            "pkg/tests/t.py": b"# TESTS\n" + big,
            "site-packages/s.py": b"# SITE\n" + big,
        },
    )
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    corpus = build_corpus("stdlib", 1_000_000, [".py"])
    assert corpus == b"# A\n" + big + b"\n# B\n" + big  # sorted by relative path: a/m.py before b.py


def test_directory_source_in_sorted_order_with_extension_filter(tmp_path):
    body = b"y = 2\n" * 1_000
    _write(
        tmp_path,
        {
            "z.py": b"# Z\n" + body,
            "sub/a.py": b"# SUBA\n" + body,
            "notes.txt": b"# TXT\n" + body,
            "bad.py": b"\xff\xfe not utf-8",
        },
    )
    assert build_corpus(str(tmp_path), 1_000_000, [".py"]) == b"# SUBA\n" + body + b"\n# Z\n" + body
    with_txt = build_corpus(str(tmp_path), 1_000_000, ["py", ".txt"])  # the dot is optional
    assert with_txt == b"# TXT\n" + body + b"\n# SUBA\n" + body + b"\n# Z\n" + body
    assert build_corpus(str(tmp_path), 10_000, [".py"]) == (b"# SUBA\n" + body + b"\n# Z\n" + body)[:10_000]


def test_missing_directory_is_a_bad_request(tmp_path):
    with pytest.raises(BadRequest, match="is not a directory"):
        build_corpus(str(tmp_path / "nope"), 100_000, [".py"])


def test_no_matching_files_is_a_bad_request(tmp_path):
    _write(tmp_path, {"a.txt": b"x" * 20_000})
    with pytest.raises(BadRequest, match=r"no files ending in \.py"):
        build_corpus(str(tmp_path), 100_000, [".py"])


def test_too_little_text_is_a_bad_request(tmp_path):
    _write(tmp_path, {"a.py": b"x = 1\n" * 100, "b.py": b"\xff" * 50_000})
    with pytest.raises(BadRequest, match=f"at least {MIN_BYTES}"):
        build_corpus(str(tmp_path), 100_000, [".py"])


def test_importing_corpus_does_not_import_torch():
    code = "import sys, gpuflex.train.corpus; assert 'torch' not in sys.modules, 'torch was imported'"
    src = Path(__file__).resolve().parents[2] / "src"
    result = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(src)}, capture_output=True)
    assert result.returncode == 0, result.stderr.decode()
