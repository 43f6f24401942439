"""`python -m jaxrag.eval.seeds W [W ...] [--json OUT] [--allow-mixed-code]`: the paper's claims
pooled over world seeds of one recipe and one code. The tool is `jaxrag.pipeline.seeds`: it
compares finished workdirs' configs and commits."""

from jaxrag.pipeline.seeds import main

if __name__ == "__main__":
    raise SystemExit(main())
