"""``python -m services.simulator ...`` = ``lockstep simulate ...``."""

import typer

from services.admin.simulate_cmd import simulate

if __name__ == "__main__":
    typer.run(simulate)
