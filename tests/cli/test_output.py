"""The CLI's tables: words whole where the terminal allows, ids whole always, never wider than it; the
least useful columns dropped, then the longest words folded, before a state word is split."""

import io

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from gpuflex.cli.output import table

QUOTE_ROWS = [
    ("aggregator", "n-33d01b2014599c13", "core-1", "core", "0.036", "0.400", "0.400", "-"),
    ("worker", "n-5bcddd3fd19ccce2", "cheap-cheat", "community", "0.031", "0.100", "0.100", "0.0692"),
]
# as `gpuflex deployments` lists them
DEPLOYMENTS = ("id", "name", "state", "replicas", "req/s", "tok/s", "ttft ms p50/p99", "spent", "budget")
LEAST_USEFUL = ["ttft ms p50/p99", "tok/s", "req/s"]
STATES = ("pending", "scheduled", "running", "completed", "failed", "cancelled")


def _print(out, width: int) -> list[str]:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(out)
    return console.export_text().splitlines()


def _render(width: int, rows=QUOTE_ROWS) -> list[str]:
    out = table("role", "node", "name", "kind", "S", "ask/h", "paid/h", "p", ids=["node"])
    for row in rows:
        out.add_row(*row)
    return _print(out, width)


def _deployments(rows, width: int = 80) -> list[str]:
    out = table(*DEPLOYMENTS, ids=["id"], drop=LEAST_USEFUL)
    for row in rows:
        out.add_row(*row)
    return _print(out, width)


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


def test_the_least_useful_columns_go_first_and_a_caption_says_so():
    row = ("d-1a2b3c4d5e6f", "smollm2-135m-instruct", "completed", "1/1", "0.1", "34", "12/45", "0.04", "2")
    lines = _deployments([row])  # before: "compl|eted", "repli|cas", "smoll|m2-13|5m-in|struc|t"
    assert any(all(cell in line for cell in (*row[:4], *row[-2:])) for line in lines), "\n".join(lines)
    assert "not shown, too narrow: ttft ms p50/p99, tok/s" in "\n".join(lines)
    assert all(cell in "\n".join(_deployments([row], 120)) for cell in row)  # with room, every column


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,60}", fullmatch=True),
            st.sampled_from(STATES),
            st.integers(0, 64),
            st.floats(0, 1e4),
            st.floats(0, 1e4),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_at_80_columns_no_state_word_is_split_and_every_line_fits(drawn):
    """Whatever the names (up to 60 letters here, a name may have 100): the name folds, the state not."""
    rows = [
        (f"d-{i:012x}", name, state, f"{n}/{n}", "-", "-", "-", f"{spent:.6f}", f"{budget:.2f}")
        for i, (name, state, n, spent, budget) in enumerate(drawn)
    ]
    lines = _deployments(rows)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for row in rows:  # the row's first line holds its id and its whole state word
        state = f"│{row[2]}│"
        assert any(row[0] in line and state in line.replace(" ", "") for line in lines), "\n".join(lines)
