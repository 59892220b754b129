"""Sources: every kind of input gives its documents in a fixed order, with clear errors for bad input."""

from __future__ import annotations

import json
import re

import datasets
import fsspec
import pyarrow as pa
import pytest

from gpuflex.data.sources import Source
from gpuflex.errors import BadRequest

from .helpers import documents, write_jsonl, write_parquet


def read(source: Source, batch_bytes: int = 1 << 20) -> list[str]:
    return [d for batch in source.batches(batch_bytes) for d in batch.documents]


def test_a_directory_of_text_files_is_one_document_per_file_in_sorted_order_without_hidden_ones(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("zed")
    (tmp_path / "a.md").write_text("alpha\n")
    (tmp_path / "c.txt").write_text("naïve 数据")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / ".hidden.txt").write_text("no")
    source = Source([str(tmp_path)])
    assert [f.name for f in source.files] == [f"{tmp_path}/a.md", f"{tmp_path}/b/z.txt", f"{tmp_path}/c.txt"]
    assert read(source) == ["alpha\n", "zed", "naïve 数据"]


def test_inputs_are_read_in_the_order_given_each_glob_sorted_and_a_file_once(tmp_path):
    for name in ("b", "a", "c"):
        write_jsonl(tmp_path / f"{name}.jsonl", [name + "1", name + "2"])
    (tmp_path / "notes.txt").write_text("notes")
    source = Source([str(tmp_path / "notes.txt"), str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])
    assert read(source) == ["notes", "a1", "a2", "b1", "b2", "c1", "c2"]
    assert [f.kind for f in source.files] == ["text", "jsonl", "jsonl", "jsonl"]


def test_jsonl_reads_the_field_and_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"body": "one", "text": "x"}\n\n{"body": "two\\nlines"}\n   \n')
    assert read(Source([str(path)], field="body")) == ["one", "two\nlines"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "d.jsonl line 2: not JSON"),
        (
            '{"title": "t", "id": 3}',
            "d.jsonl line 2: no field 'text' (it has: title, id); choose one with --field",
        ),
        ('{"text": 12}', "d.jsonl line 2: field 'text' is a number, not a string"),
        ('{"text": null}', "d.jsonl line 2: field 'text' is null, not a string"),
        ('["text"]', "d.jsonl line 2: an array, not an object with 'text'"),
    ],
)
def test_a_bad_jsonl_line_is_one_error_naming_the_file_and_line(tmp_path, line, says):
    path = tmp_path / "d.jsonl"
    path.write_text(f'{{"text": "fine"}}\n{line}\n')
    with pytest.raises(BadRequest, match="^" + re.escape(str(tmp_path / says))):
        read(Source([str(path)]))


def test_parquet_is_read_a_batch_of_rows_at_a_time_and_counts_its_bytes(tmp_path):
    docs = [str(i) for i in range(10_000)]  # more rows than one read decodes
    path = write_parquet(tmp_path / "d.parquet", docs, column="content", row_group_size=3000)
    source = Source([str(path)], column="content")
    batches = list(source.batches(batch_bytes=1))
    assert [d for b in batches for d in b.documents] == docs
    assert (
        len(batches) > 1 and sum(b.bytes_read for b in batches) == source.total_bytes == path.stat().st_size
    )


def test_parquet_without_the_column_names_the_columns_it_has(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ["x"], column="content")
    with pytest.raises(BadRequest, match=r"d.parquet has no column 'text' \(its columns: content, n\)"):
        Source([str(path)])


def test_a_column_that_is_not_text_or_a_null_row_is_refused(tmp_path):
    import pyarrow.parquet as pq

    numbers, nulls = tmp_path / "numbers.parquet", tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), numbers)
    pq.write_table(pa.table({"text": ["a", None, "c"]}), nulls)
    with pytest.raises(BadRequest, match="column 'text' holds int64, not text"):
        Source([str(numbers)])
    with pytest.raises(BadRequest, match=r"nulls\.parquet row 1: the column is null"):
        read(Source([str(nulls)]))


def test_a_datasets_directory_is_read_through_its_arrow_files(tmp_path):
    docs = documents(30)
    dataset = datasets.Dataset.from_dict({"content": docs, "n": list(range(30))})
    dataset.save_to_disk(str(tmp_path / "ds"), num_shards=2)
    source = Source([str(tmp_path / "ds")], column="content")
    assert [f.kind for f in source.files] == ["arrow", "arrow"]
    batches = list(source.batches())
    assert [d for b in batches for d in b.documents] == docs
    assert sum(b.bytes_read for b in batches) == source.total_bytes

    dataset.select(range(5)).save_to_disk(str(tmp_path / "small"))  # an indices mapping, flattened when saved
    assert read(Source([str(tmp_path / "small")], column="content")) == docs[:5]

    datasets.DatasetDict({"train": dataset, "test": dataset}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(BadRequest, match=r"holds a DatasetDict \(splits: train, test\): name one split's"):
        Source([str(tmp_path / "dd")])


def test_any_fsspec_url_works_and_names_files_as_the_input_did():
    fs = fsspec.filesystem("memory")
    fs.pipe("/corpus/b.jsonl", b'{"text": "b"}\n')
    fs.pipe("/corpus/a.jsonl", b'{"text": "a"}\n')
    fs.pipe("/corpus/sub/c.txt", "c ü".encode())
    try:
        globbed = Source(["memory://corpus/*.jsonl"])
        assert [f.name for f in globbed.files] == ["memory://corpus/a.jsonl", "memory://corpus/b.jsonl"]
        assert read(globbed) == ["a", "b"]
        whole = Source(["memory://corpus/"])
        assert [f.name for f in whole.files][-1] == "memory://corpus/sub/c.txt"
        assert read(whole) == ["a", "b", "c ü"]
    finally:
        fs.rm("/corpus", recursive=True)


def test_no_match_and_unreadable_files_are_clear_errors(tmp_path):
    with pytest.raises(BadRequest, match=r"no input matched '.*\*\.jsonl'"):
        Source([str(tmp_path / "*.jsonl")])
    with pytest.raises(BadRequest, match="no such file or directory"):
        Source([str(tmp_path / "missing.txt")])
    (tmp_path / "fake.parquet").write_text("not parquet at all")
    with pytest.raises(BadRequest, match=r"fake\.parquet is not a readable parquet file: "):
        Source([str(tmp_path / "fake.parquet")])
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\xff")
    with pytest.raises(BadRequest, match=r"image.png is not UTF-8 text \(byte 0\); name the files to read"):
        read(Source([str(tmp_path / "image.png")]))


def test_batches_hold_whole_documents_and_count_every_byte(tmp_path):
    docs = documents(300)
    path = write_jsonl(tmp_path / "d.jsonl", docs)
    (tmp_path / "e.txt").write_text(json.dumps(docs))
    source = Source([str(path), str(tmp_path / "e.txt")])
    batches = list(source.batches(batch_bytes=500))
    assert [d for b in batches for d in b.documents] == [*docs, json.dumps(docs)]
    assert sum(b.bytes_read for b in batches) == source.total_bytes
