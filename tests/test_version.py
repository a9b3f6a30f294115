"""The `loraplex` command itself: `--version`."""

from importlib.metadata import version

from typer.testing import CliRunner

from loraplex.cli import app


def test_version_prints_the_package_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"loraplex {version('loraplex')}\n"
