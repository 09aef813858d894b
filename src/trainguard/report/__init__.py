"""A run directory turned into an HTML report (``trainguard report``) or one status screen (``trainguard status``)."""

from __future__ import annotations

from pathlib import Path

from trainguard.fs.fsio import atomic_write_text
from trainguard.errors import TrainguardError
from trainguard.report.facts import RunFacts, read_run

REPORT_FILE = "report.html"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> tuple[Path, RunFacts]:
    """Writes the self-contained page (default ``RUN_DIR/report.html``) and returns its path and the facts."""
    facts = read_run(run_dir)
    try:
        from trainguard.report.plots import all_plots
    except ImportError:
        raise TrainguardError("trainguard report draws its plots with matplotlib (a dependency of trainguard), "
                              "which cannot be imported: pip install 'matplotlib>=3.7'") from None
    from trainguard.report.html import render

    page = render(facts, all_plots(facts))
    path = Path(out) if out is not None else facts.run_dir / REPORT_FILE
    atomic_write_text(path, page)
    return path, facts


__all__ = ["REPORT_FILE", "RunFacts", "read_run", "write_report"]
