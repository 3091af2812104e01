"""The ``loom`` command line: one flat typer app, one function per command.

Any `LoomError` a command raises is printed as a single red ``error:`` line on stderr and the
process exits with status 1; only bugs produce a traceback.
"""

from __future__ import annotations

import sys
from typing import Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from loom.errors import LoomError
from loom.loader import registry

out = Console()
err = Console(stderr=True)


class _LoomGroup(TyperGroup):
    """Turns LoomErrors from any command into a one-line message and exit status 1."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except LoomError as e:
            err.print(f"[bold red]error:[/bold red] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(1) from None


app = typer.Typer(
    cls=_LoomGroup,
    name="loom",
    help="loom: LLM inference and serving on CPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def pull(
    name: str = typer.Argument(registry.DEFAULT_MODEL, help="Registry model name (see `loom models`)."),
    force: bool = typer.Option(False, "--force", help="Download again even if the cache holds the model."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress display."),
) -> None:
    """Download a registry model into the cache and print its path."""
    path = registry.pull(name, progress=not quiet, force=force)
    print(path)


@app.command()
def models() -> None:
    """List the registry's models and whether each is in the cache."""
    table = Table(title=f"models (cache: {registry.models_dir()})", title_justify="left")
    for column in ("name", "size", "cached", "description"):
        table.add_column(column, justify="right" if column == "size" else "left")
    for name, entry in sorted(registry.REGISTRY.items()):
        path = registry.cached_path(name)
        if registry.is_cached(name):
            cached = "[green]yes[/green]"
        elif path.exists():
            cached = "[yellow]invalid[/yellow] (run loom pull --force)"
        else:
            cached = "no"
        label = f"{name} (default)" if name == registry.DEFAULT_MODEL else name
        table.add_row(label, f"{entry.size / 1e6:.0f} MB", cached, entry.description)
    out.print(table)


def main() -> None:
    """Entry point of the ``loom`` script."""
    try:
        app(prog_name="loom")
    except KeyboardInterrupt:
        err.print("[red]interrupted[/red]")
        sys.exit(130)
