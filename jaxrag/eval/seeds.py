"""`python -m jaxrag.eval.seeds W [W ...] [--json OUT]`: the paper's claims pooled over world seeds
of one recipe. The tool is `jaxrag.pipeline.seeds`: it compares finished workdirs' configs."""

from jaxrag.pipeline.seeds import main

if __name__ == "__main__":
    raise SystemExit(main())
