"""`python -m jaxrag.eval.tau W [W ...] [--json OUT]`: a model's uniform thresholds, chosen on
the validation split of workdirs finished up to the baselines. The tool is `jaxrag.pipeline.tau`: it loads the workdirs' models."""

import sys

from jaxrag.errors import run
from jaxrag.pipeline.tau import main

if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
