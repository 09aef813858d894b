"""What ``trainguard doctor`` found: one result per check, a verdict, and a one-screen table."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CheckResult:
    check: str  # "burn-in", "collective" or "storage"
    target: str  # what was checked: a device, the local ranks, a directory
    ok: bool
    detail: str  # one line: what was measured, or what went wrong
    seconds: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass
class DoctorReport:
    host: str
    nproc: int
    checks: list[CheckResult]

    @property
    def healthy(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [check for check in self.checks if not check.ok]

    @property
    def reason(self) -> str | None:
        """One line naming every failed check (None when healthy): the reason a node is excluded for."""
        if self.healthy:
            return None
        return "; ".join(f"{c.check} {c.target}: {c.detail}" for c in self.failures)

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "nproc": self.nproc, "healthy": self.healthy, "reason": self.reason,
                "checks": [asdict(check) for check in self.checks]}

    def render(self, console) -> None:
        """Prints the table and the verdict line to a rich console."""
        from rich.table import Table

        table = Table(title=f"trainguard doctor: {self.host} ({self.nproc} local rank{'s' if self.nproc != 1 else ''})")
        table.add_column("check")
        table.add_column("target")
        table.add_column("result")
        table.add_column("detail", overflow="fold")
        table.add_column("time", justify="right")
        for check in self.checks:
            verdict = "[green]ok[/green]" if check.ok else "[bold red]FAIL[/bold red]"
            table.add_row(check.check, check.target, verdict, check.detail, f"{check.seconds:.1f}s")
        console.print(table)
        if self.healthy:
            console.print(f"[green]healthy[/green]: {self.host} passed {len(self.checks)} checks")
        else:
            console.print(f"[bold red]unhealthy[/bold red]: {self.host}: {self.reason}", soft_wrap=True)
