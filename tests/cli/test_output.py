"""The CLI's tables: words whole where the terminal allows, ids whole always, never wider than it."""

import io

from rich.console import Console

from gpuflex.cli.output import table

QUOTE_ROWS = [
    ("aggregator", "n-33d01b2014599c13", "core-1", "core", "0.036", "0.400", "0.400", "-"),
    ("worker", "n-5bcddd3fd19ccce2", "cheap-cheat", "community", "0.031", "0.100", "0.100", "0.0692"),
]


def _render(width: int, rows=QUOTE_ROWS) -> list[str]:
    out = table("role", "node", "name", "kind", "S", "ask/h", "paid/h", "p", ids=["node"])
    for row in rows:
        out.add_row(*row)
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(out)
    return console.export_text().splitlines()


def test_a_quote_at_80_columns_folds_no_word():
    lines = _render(80)
    assert max(len(line) for line in lines) <= 80
    for row in QUOTE_ROWS:  # every cell whole, on one line: before, "aggre|gator", "commun|ity"
        assert any(all(cell in line for cell in row) for line in lines), "\n".join(lines)


def test_with_room_the_usual_padding_stays():
    assert any("│ aggregator │" in line for line in _render(120))


def test_too_narrow_for_whole_words_it_folds_but_keeps_ids_whole_and_within_the_terminal():
    lines = _render(60)
    assert max(len(line) for line in lines) <= 60, "\n".join(lines)
    assert any("n-33d01b2014599c13" in line for line in lines)
    assert not any("aggregator" in line for line in lines)  # folded: the terminal has no room for it
