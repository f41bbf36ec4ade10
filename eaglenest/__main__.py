from eaglenest.cli import run

run()
