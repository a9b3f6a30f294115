from loraplex.registry.cli import app

app()
