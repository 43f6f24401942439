"""The planner: does a config's run fit the hardware, and how long will it take?

    programs.py   every heavy program of the pipeline at the config's real shapes, abstract weights
    fit.py        compile them, read XLA's memory analysis, estimate time; `check_fit`, which the
                  pipeline runs before its decoder stages
    __main__.py   `python -m jaxrag.plan --config ... --devices N --accelerator h100`

Importing this package loads no jax: the CLI sets XLA_FLAGS (fake devices) before jax starts.
"""
