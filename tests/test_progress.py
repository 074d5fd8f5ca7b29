import io

from rich.console import Console

from selfrl.run.progress import RichProgress


def test_log_lines_are_text_not_rich_markup():
    """The no-signal hint names "[task] options"; rich read it as markup and printed "( options)"."""
    out = io.StringIO()
    with RichProgress(1, console=Console(file=out, width=200)) as p:
        p.log("choose an easier subset ([task] options)")
    assert "([task] options)" in out.getvalue()
